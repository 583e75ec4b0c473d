#pragma once
// An in-process model of the kernel's PCI/SR-IOV sysfs behaviour for
// `host: simulated` and for tests. It materialises a sysfs-like tree in a
// directory, with config-space files libpci can parse, and reacts to writes
// the way the kernel does: sriov_numvfs creates and removes VFs,
// driver_override + drivers_probe binds, unbind releases, busy devices
// refuse. Faults can be injected into any write.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "sriovd/config/config.hpp"
#include "sriovd/host/sysfs_io.hpp"
#include "sriovd/host/vf_link.hpp"

namespace sriovd::host {

class SimulatedKernel : public SysfsIo, public VfLinkControl {
 public:
  // The drivers the model knows: a PF driver, a native VF driver, vfio-pci
  // and pci-stub. Probing a device with an override naming a driver that
  // is not registered leaves it unbound (as the kernel does).
  static constexpr const char* kPfDriver = "i40e";
  static constexpr const char* kVfDriver = "iavf";

  // Builds the tree under `dir` (created if needed, emptied first).
  SimulatedKernel(std::string dir, const std::vector<config::SimulatedPf>& pfs);
  // A successor's (an upgrade in place): the kernel its predecessor had,
  // from save() - its devices, drivers, VF settings and netdevs as they
  // stand - as a real kernel outlives the daemon. Throws
  // std::invalid_argument when `saved` does not parse.
  SimulatedKernel(std::string dir, const std::string& saved);
  ~SimulatedKernel() override;
  [[nodiscard]] std::string save() const;
  // The successor has it: the sysfs tree and the VF netdevs stay.
  void keep_for_successor() { keep_ = true; }

  // SysfsIo
  [[nodiscard]] const std::string& root() const override { return real_.root(); }
  std::optional<std::string> read(const std::string& path) override;
  void write(const std::string& path, const std::string& value) override;
  std::optional<std::string> link_name(const std::string& path) override;
  std::vector<std::string> list(const std::string& dir) override;
  bool exists(const std::string& path) override;
  std::vector<std::string> modules_for(const std::string& modalias) override;

  // VfLinkControl
  VfSettings get(const std::string& pf_netdev, unsigned vf) override;
  void set(const std::string& pf_netdev, unsigned vf, const VfSettings& settings) override;

  // --- test and demo controls ---
  struct Fault {
    std::string path_contains;  // matches a sysfs path or "netlink/<pf>/vf<N>/<setting>"
    int error = EIO;
    unsigned skip = 0;   // matching operations let through first
    unsigned times = 1;  // then this many fail
  };
  void inject(const Fault& fault);
  // Fails the n-th (0-based) mutating operation from now on, whatever it is.
  void fail_nth_operation(unsigned n, int error);
  void clear_faults();
  // Mutating operations (sysfs writes and VF setting changes) so far.
  [[nodiscard]] unsigned operations() const;

  // New VFs' sysfs entries appear only after this delay.
  void delay_vf_appearance(std::chrono::milliseconds delay);
  // A busy device refuses unbind, and its PF refuses a numvfs change.
  void set_busy(const PciAddress& dev, bool busy);
  // What an administrator does by hand: binds a device to a driver.
  void bind_by_hand(const PciAddress& dev, const std::string& driver);
  // Adds a plain device (for IOMMU group tests); group -1: a new group.
  void add_device(const PciAddress& dev, uint16_t vendor, uint16_t device, uint32_t class_code,
                  const std::string& driver, int iommu_group = -1);
  [[nodiscard]] int iommu_group_of(const PciAddress& dev) const;
  // An unloaded driver binds nothing and has no bind/unbind files.
  void set_driver_loaded(const std::string& driver, bool loaded);

  // The PF's driver is igb (its VFs' is igbvf) and behaves as igb does with VF settings (seen on QEMU 10's
  // 82576 with Linux 6.1 and 6.12): no VF link state at all (EOPNOTSUPP,
  // even "auto"), no minimum rate (EINVAL), and rates (EINVAL) neither while
  // the PF has no link nor within `settle` of a sriov_numvfs change.
  void behave_like_igb(const PciAddress& pf, std::chrono::milliseconds settle = std::chrono::milliseconds(200));
  // modules.alias cannot be read (the shipped unit's ProtectKernelModules):
  // modules_for() finds nothing.
  void hide_module_aliases(bool hidden) { aliases_hidden_ = hidden; }
  // The PF netdev's carrier (class/net/<pf>/carrier).
  void set_pf_link(const PciAddress& pf, bool up);

  // A VF's netdev as a real interface: a veth pair "<vf netdev>" (the VF's
  // side, for the VF-to-virtio bridge) and "<vf netdev>p" (the wire, where
  // tests put traffic). Created on first use, deleted with the model.
  std::string realize_vf_netdev(const PciAddress& vf);

  // A comparable picture of everything the model holds, for "the host
  // equals its starting state" assertions.
  [[nodiscard]] std::string snapshot() const;

 private:
  static constexpr uint16_t kDefaultMtu = 1500;
  static constexpr uint16_t kMaxMtu = 9216;  // igbvf's
  struct Device {
    PciAddress address;
    uint16_t vendor = 0;
    uint16_t device = 0;
    uint32_t class_code = 0;
    std::string driver;
    std::string native_driver;
    std::string override;
    int group = 0;
    bool busy = false;
    // Its netdev's (while its network driver holds it; a new netdev starts
    // at the default).
    uint16_t mtu = kDefaultMtu;
    // PF
    uint16_t total_vfs = 0;
    uint16_t num_vfs = 0;
    bool autoprobe = true;
    uint16_t vf_msix = 0;
    uint16_t vf_device = 0;
    std::string netdev;
    bool igb_rules = false;
    std::string vf_driver = kVfDriver;
    bool link_up = true;
    std::chrono::milliseconds settle{0};
    std::chrono::steady_clock::time_point numvfs_changed_at;
    // VF
    std::optional<PciAddress> physfn;
    unsigned vf_index = 0;
    uint16_t msix_vectors = 0;
    bool materialized = true;
  };

  void check_fault(const std::string& op);
  Device& device_at(const std::string& addr_text, const std::string& path);
  Device* find(const PciAddress& a);
  Device* find_pf_by_netdev(const std::string& netdev);
  void set_numvfs(Device& pf, unsigned n, const std::string& path);
  void probe(Device& d);
  void bind(Device& d, const std::string& driver);
  void unbind(Device& d);
  void materialize_due();
  void make_tree();
  void write_device(const Device& d);
  void remove_device_files(const Device& d);
  void link_driver(const Device& d, bool present);
  [[nodiscard]] std::string vf_netdev(const Device& vf) const;
  [[nodiscard]] VfSettings effective_settings(const PciAddress& pf, unsigned vf) const;
  static std::vector<uint8_t> config_space(const Device& d);
  static std::string modalias(const Device& d);

  mutable std::mutex mutex_;
  RealSysfs real_;
  std::string dir_;
  std::map<PciAddress, Device> devices_;
  std::map<std::pair<PciAddress, unsigned>, VfSettings> vf_settings_;
  std::vector<Fault> faults_;
  std::set<std::string> unloaded_;
  std::vector<std::string> veths_;
  std::optional<std::pair<unsigned, int>> nth_fault_;
  unsigned operations_ = 0;
  std::atomic<bool> aliases_hidden_{false};
  int next_group_ = 0;
  std::chrono::milliseconds vf_delay_{0};
  std::optional<std::chrono::steady_clock::time_point> materialize_at_;
  bool keep_ = false;
};

}  // namespace sriovd::host
