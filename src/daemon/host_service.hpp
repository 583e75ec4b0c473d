#pragma once
// The daemon's side of the host layer: picks the real or the simulated
// kernel, recovers a crashed transaction on start, converges the host to
// each accepted config, releases VFs, and reports devices.

#include <memory>
#include <optional>
#include <set>
#include <string>

#include "sriovd/config/config.hpp"
#include "sriovd/control/protocol.hpp"
#include "sriovd/host/host_control.hpp"
#include "sriovd/host/reconciler.hpp"
#include "sriovd/host/simulated_kernel.hpp"
#include "sriovd/vfio/device.hpp"

namespace sriovd::daemon {

class HostService {
 public:
  // Sets up the host layer for cfg.host; does not change the host yet.
  // `simulated_state`: the simulated kernel an upgrade's predecessor
  // handed over (its journal stays too); empty: a simulated host is born
  // anew.
  HostService(const config::Config& cfg, const std::string& sysfs_root, const std::string& simulated_state = "");
  // An upgrade in place: the simulated kernel's state (empty on a real
  // host), and the successor has it (its tree and netdevs stay).
  [[nodiscard]] std::string simulated_state() const;
  void keep_for_successor();
  ~HostService();

  // Rolls back what a crash left half done, then converges to cfg. Throws
  // (with the host rolled back) when the config cannot be applied.
  void start(const config::Config& cfg, std::optional<size_t> stop_before_step = std::nullopt);
  // Converges to a new config; on failure the host is as it was before.
  std::vector<host::Step> apply(const config::Config& cfg);
  // Converges to the same config again (released VFs stay released).
  // stop_before_step: crash tests, as start's.
  std::vector<host::Step> reconcile(const config::Config& cfg, std::optional<size_t> stop_before_step = std::nullopt);
  [[nodiscard]] std::vector<host::Step> plan(const config::Config& cfg);
  // Gives one VF back to the host (until the next reload).
  // Gives the VFs back to the host until the next reload.
  std::vector<host::Step> release_vfs(const config::Config& cfg, const PciAddress& pf,
                                      const std::vector<unsigned>& indices);
  std::optional<PciAddress> pf_address(const config::PfRef& ref);
  std::string pf_netdev(const PciAddress& pf);
  std::vector<host::Step> release_all();

  // read_settings: each VF's settings read back from the PF's driver.
  [[nodiscard]] control::json devices_json(const config::Config& cfg, bool read_settings = false);
  // The kernel netdev of VF `index` of `pf` (on the simulated host: a real
  // veth made for it). Throws when the VF has none (not on its own driver).
  std::string vf_netdev(const config::PfRef& pf, unsigned index);
  // The PCI address of VF `index` of `pf`, and whether it is released.
  std::optional<PciAddress> vf_address(const config::PfRef& pf, unsigned index);
  [[nodiscard]] bool released(const PciAddress& pf, unsigned index) const;
  // Opens the VF through VFIO: the kernel's (it must be on vfio-pci, in a
  // viable group) or, on the simulated host, a simulated VF with the PF's
  // ids and MSI-X vector count.
  std::unique_ptr<vfio::Device> open_vf(const config::Config& cfg, const config::PfRef& pf, unsigned index);
  // A VF's device handed over by the predecessor (VfProxy::adopt_device),
  // as open_vf would have made it (a simulated VF's SET_IRQS cost); throws
  // std::invalid_argument when it is not VF `index` of `pf`.
  std::unique_ptr<vfio::Device> adopt_vf(const config::Config& cfg, const config::PfRef& pf, unsigned index,
                                         std::unique_ptr<vfio::Device> adopted);
  [[nodiscard]] host::SimulatedKernel* simulated() { return sim_.get(); }
  // See HostControl::set_release_check.
  void set_release_check(host::HostControl::ReleaseCheck check) { control_->set_release_check(std::move(check)); }
  [[nodiscard]] const std::vector<std::string>& recovered() const { return recovered_; }
  [[nodiscard]] const host::Reconciler::Counters& transactions() const { return reconciler_->counters(); }

 private:
  std::unique_ptr<host::SimulatedKernel> sim_;
  std::string sysfs_root_;
  std::unique_ptr<host::SysfsIo> sysfs_;
  std::unique_ptr<host::VfLinkControl> vf_link_;
  std::unique_ptr<host::HostControl> control_;
  std::unique_ptr<host::Reconciler> reconciler_;
  std::set<host::VfRef> released_;
  std::vector<std::string> recovered_;
};

control::json steps_json(const std::vector<host::Step>& steps);

}  // namespace sriovd::daemon
