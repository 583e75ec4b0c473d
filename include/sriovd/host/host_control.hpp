#pragma once
// Reads and changes one Key of host state, the way the kernel wants it done,
// and verifies the result: a drivers_probe that "succeeds" with the wrong
// driver bound is an error here, not a surprise later.

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "sriovd/host/state.hpp"
#include "sriovd/host/sysfs_io.hpp"
#include "sriovd/host/vf_link.hpp"

namespace sriovd::host {

struct GroupMember {
  PciAddress address;
  std::string driver;  // "" when unbound
  bool bridge = false;
  bool ok = false;  // does not stop the group from being viable
};

struct GroupReport {
  int group = -1;  // -1: the device has no IOMMU group
  std::vector<GroupMember> members;
  [[nodiscard]] bool viable() const;
};

class HostControl {
 public:
  HostControl(SysfsIo& sysfs, VfLinkControl& vf_link, std::chrono::milliseconds vf_timeout = std::chrono::seconds(10));

  json get(const Key& key);
  void set(const Key& key, const json& value);

  // Topology helpers, all through sysfs.
  [[nodiscard]] bool exists(const PciAddress& dev);
  [[nodiscard]] std::optional<unsigned> total_vfs(const PciAddress& pf);
  [[nodiscard]] unsigned num_vfs(const PciAddress& pf);
  [[nodiscard]] std::optional<PciAddress> vf_address(const PciAddress& pf, unsigned index);
  [[nodiscard]] std::string driver(const PciAddress& dev);
  [[nodiscard]] std::string pf_netdev(const PciAddress& pf);
  [[nodiscard]] std::optional<PciAddress> resolve_netdev(const std::string& netdev);
  [[nodiscard]] GroupReport iommu_group(const PciAddress& dev);
  // The driver the kernel would bind `dev` to on its own (by modalias).
  [[nodiscard]] std::string own_driver(const PciAddress& dev);
  [[nodiscard]] bool link_up(const std::string& netdev);
  // How long a rate refused with EINVAL is asked again (see set_vf_settings).
  void set_rate_retry(std::chrono::milliseconds d) { rate_retry_ = d; }

  SysfsIo& sysfs() { return sysfs_; }

  // Asked before a device is unbound from vfio-pci: who still holds its
  // VFIO device ("" - nobody). The unbind would wait in the kernel for that
  // holder, so it waits here instead, at most `wait`, and then fails
  // naming the holder (the device stays on vfio-pci, out of use).
  using ReleaseCheck = std::function<std::string(const PciAddress& device)>;
  void set_release_check(ReleaseCheck check, std::chrono::milliseconds wait = std::chrono::seconds(3)) {
    release_check_ = std::move(check);
    release_wait_ = wait;
  }

 private:
  PciAddress target(const Key& key);
  std::string dev_path(const PciAddress& dev, const std::string& attr) const;
  std::string vf_netdev_path(const Key& key, const std::string& file);
  json get_binding(const PciAddress& dev);
  void set_binding(const PciAddress& dev, const json& value);
  bool set_vf_settings(const PciAddress& pf, unsigned vf, const VfSettings& want);
  void reload_vf_driver(const PciAddress& vf);
  void probe_own_driver(const PciAddress& dev);
  json get_numvfs(const PciAddress& pf);
  void set_numvfs(const PciAddress& pf, const json& value);
  void wait_for_vfs(const PciAddress& pf, unsigned n);

  void wait_until_released(const PciAddress& dev);
  SysfsIo& sysfs_;
  VfLinkControl& vf_link_;
  ReleaseCheck release_check_;
  std::chrono::milliseconds release_wait_{3000};
  std::chrono::milliseconds vf_timeout_;
  std::chrono::milliseconds rate_retry_{8000};
};

}  // namespace sriovd::host
