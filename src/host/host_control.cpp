#include "sriovd/host/host_control.hpp"

#include <cerrno>
#include <thread>

#include "sriovd/util/error.hpp"

namespace sriovd::host {

namespace {

constexpr const char* kVfio = "vfio-pci";

std::string override_text(const std::optional<std::string>& raw) {
  if (!raw || *raw == "(null)") return "";
  return *raw;
}

}  // namespace

bool GroupReport::viable() const {
  if (group < 0) return false;
  for (const auto& m : members)
    if (!m.ok) return false;
  return true;
}

HostControl::HostControl(SysfsIo& sysfs, VfLinkControl& vf_link, std::chrono::milliseconds vf_timeout)
    : sysfs_(sysfs), vf_link_(vf_link), vf_timeout_(vf_timeout) {}

std::string HostControl::dev_path(const PciAddress& dev, const std::string& attr) const {
  return "bus/pci/devices/" + dev.to_string() + (attr.empty() ? "" : "/" + attr);
}

bool HostControl::exists(const PciAddress& dev) { return sysfs_.exists(dev_path(dev, "")); }

std::optional<unsigned> HostControl::total_vfs(const PciAddress& pf) {
  auto text = sysfs_.read(dev_path(pf, "sriov_totalvfs"));
  if (!text) return std::nullopt;
  return static_cast<unsigned>(std::stoul(*text));
}

unsigned HostControl::num_vfs(const PciAddress& pf) {
  auto text = sysfs_.read(dev_path(pf, "sriov_numvfs"));
  if (!text) throw std::runtime_error("PF " + pf.to_string() + " has no sriov_numvfs: it does not support SR-IOV");
  return static_cast<unsigned>(std::stoul(*text));
}

std::optional<PciAddress> HostControl::vf_address(const PciAddress& pf, unsigned index) {
  auto name = sysfs_.link_name(dev_path(pf, "virtfn" + std::to_string(index)));
  return name ? PciAddress::parse(*name) : std::nullopt;
}

std::string HostControl::driver(const PciAddress& dev) {
  return sysfs_.link_name(dev_path(dev, "driver")).value_or("");
}

std::string HostControl::pf_netdev(const PciAddress& pf) {
  auto names = sysfs_.list(dev_path(pf, "net"));
  return names.empty() ? "" : names.front();
}

std::optional<PciAddress> HostControl::resolve_netdev(const std::string& netdev) {
  auto name = sysfs_.link_name("class/net/" + netdev + "/device");
  return name ? PciAddress::parse(*name) : std::nullopt;
}

PciAddress HostControl::target(const Key& key) {
  if (key.vf < 0) return key.device;
  auto vf = vf_address(key.device, static_cast<unsigned>(key.vf));
  if (!vf)
    throw std::runtime_error("PF " + key.device.to_string() + " has no VF " + std::to_string(key.vf) + " (no virtfn" +
                             std::to_string(key.vf) + " link)");
  return *vf;
}

GroupReport HostControl::iommu_group(const PciAddress& dev) {
  GroupReport report;
  auto group = sysfs_.link_name(dev_path(dev, "iommu_group"));
  if (!group) return report;
  report.group = std::stoi(*group);
  for (const auto& name : sysfs_.list("kernel/iommu_groups/" + *group + "/devices")) {
    auto addr = PciAddress::parse(name);
    if (!addr) continue;
    GroupMember m;
    m.address = *addr;
    m.driver = driver(*addr);
    const std::string cls = sysfs_.read(dev_path(*addr, "class")).value_or("0x000000");
    m.bridge = cls.rfind("0x0604", 0) == 0;
    // As the kernel's VFIO decides viability: bound to vfio-pci, to no
    // driver, to pci-stub, or a bridge (pcieport) is fine; anything else
    // means another driver could DMA through the same IOMMU context.
    m.ok = m.driver == kVfio || m.driver.empty() || m.driver == "pci-stub" || m.bridge;
    report.members.push_back(m);
  }
  return report;
}

json HostControl::get(const Key& key) {
  switch (key.kind) {
    case KeyKind::autoprobe: {
      auto text = sysfs_.read(dev_path(key.device, "sriov_drivers_autoprobe"));
      if (!text) throw std::runtime_error("PF " + key.device.to_string() + " has no sriov_drivers_autoprobe");
      return *text == "1";
    }
    case KeyKind::numvfs: return get_numvfs(key.device);
    case KeyKind::vf_settings: {
      const std::string netdev = pf_netdev(key.device);
      if (netdev.empty())
        throw std::runtime_error("PF " + key.device.to_string() + " has no netdev to read VF settings through");
      return vf_link_.get(netdev, static_cast<unsigned>(key.vf)).to_json();
    }
    case KeyKind::binding: return get_binding(target(key));
    case KeyKind::group_check: return iommu_group(target(key)).viable();
    case KeyKind::vf_mtu: {
      const auto text = sysfs_.read(vf_netdev_path(key, "mtu"));
      if (!text) throw std::runtime_error(key.to_string() + ": its netdev has no mtu");
      return json{{"mtu", std::stoul(*text)}};
    }
  }
  return nullptr;
}

void HostControl::set(const Key& key, const json& value) {
  switch (key.kind) {
    case KeyKind::autoprobe:
      sysfs_.write(dev_path(key.device, "sriov_drivers_autoprobe"), value.get<bool>() ? "1" : "0");
      return;
    case KeyKind::numvfs: set_numvfs(key.device, value); return;
    case KeyKind::vf_settings:
      if (set_vf_settings(key.device, static_cast<unsigned>(key.vf), VfSettings::from_json(value)))
        reload_vf_driver(target(key));
      return;
    case KeyKind::binding: set_binding(target(key), value); return;
    case KeyKind::vf_mtu:
      sysfs_.write(vf_netdev_path(key, "mtu"), std::to_string(value.at("mtu").get<unsigned>()));
      return;
    case KeyKind::group_check: {
      const PciAddress dev = target(key);
      const GroupReport report = iommu_group(dev);
      if (report.group < 0)
        throw std::runtime_error(dev.to_string() +
                                 " has no IOMMU group: is the IOMMU on (intel_iommu=on or amd_iommu=on)?");
      for (const auto& m : report.members)
        if (!m.ok)
          throw std::runtime_error("IOMMU group " + std::to_string(report.group) + " of " + dev.to_string() +
                                   " is not viable: member " + m.address.to_string() + " is bound to " + m.driver +
                                   " (bind it to vfio-pci or unbind it)");
      return;
    }
  }
}

void HostControl::wait_until_released(const PciAddress& dev) {
  if (!release_check_) return;
  const auto deadline = std::chrono::steady_clock::now() + release_wait_;
  for (;;) {
    const std::string holders = release_check_(dev);
    if (holders.empty()) return;
    if (std::chrono::steady_clock::now() >= deadline)
      throw std::runtime_error("unbinding " + dev.to_string() + " from vfio-pci: its VFIO device is still held by " +
                               holders + " after " + std::to_string(release_wait_.count()) +
                               " ms (a VMM given the device fd - assign.bar_access: mmap - keeps the VF until it "
                               "closes that fd and its BAR mappings); the VF stays on vfio-pci, out of use");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// A VF driver reads its MAC from the PF when it probes (igbvf; igb says
// "Reload the VF driver to make this change effective"): after a new MAC,
// a VF bound to its own driver is unbound and probed again, so that its
// netdev carries the MAC the PF now filters for. Not for vfio-pci (the
// guest's driver probes later) nor an unbound VF.
void HostControl::reload_vf_driver(const PciAddress& vf) {
  const std::string have = driver(vf);
  if (have.empty() || have == kVfio || have == "pci-stub") return;
  const std::string addr = vf.to_string();
  const std::string have_override = override_text(sysfs_.read(dev_path(vf, "driver_override")));
  sysfs_.write("bus/pci/drivers/" + have + "/unbind", addr);
  if (have_override != have) sysfs_.write(dev_path(vf, "driver_override"), have + "\n");
  sysfs_.write("bus/pci/drivers_probe", addr);
  if (have_override != have) sysfs_.write(dev_path(vf, "driver_override"), have_override + "\n");
  if (driver(vf) != have)
    throw std::runtime_error("reloading " + have + " on " + addr + " for its new MAC: the device is " +
                             (driver(vf).empty() ? std::string("bound to no driver") : "bound to " + driver(vf)));
}

// Only what differs from what the driver holds is sent: a driver refuses
// some settings outright (igb: every link state) even when asked for the
// value it already has, and a restore or rollback must not fail on a field
// it does not change. The two rates travel together, so one that differs
// takes the other's current value along.
// True when a non-zero MAC was set (the VF's driver must read it again).
bool HostControl::set_vf_settings(const PciAddress& pf, unsigned vf, const VfSettings& want) {
  const std::string netdev = pf_netdev(pf);
  if (netdev.empty())
    throw std::runtime_error("PF " + pf.to_string() + " has no netdev: cannot change settings of VF " +
                             std::to_string(vf));
  const VfSettings have = vf_link_.get(netdev, vf);
  VfSettings diff;
  if (want.mac && want.mac != have.mac) diff.mac = want.mac;
  if ((want.vlan && want.vlan != have.vlan) || (want.qos && want.qos != have.qos)) {
    diff.vlan = want.vlan ? want.vlan : have.vlan;
    diff.qos = want.qos ? want.qos : have.qos;
  }
  if (want.trust && want.trust != have.trust) diff.trust = want.trust;
  if (want.spoofchk && want.spoofchk != have.spoofchk) diff.spoofchk = want.spoofchk;
  if (want.link_state && want.link_state != have.link_state) diff.link_state = want.link_state;
  if ((want.max_tx_rate && want.max_tx_rate.value() != have.max_tx_rate.value_or(0)) ||
      (want.min_tx_rate && want.min_tx_rate.value() != have.min_tx_rate.value_or(0))) {
    diff.max_tx_rate = want.max_tx_rate ? want.max_tx_rate : have.max_tx_rate.value_or(0);
    diff.min_tx_rate = want.min_tx_rate ? want.min_tx_rate : have.min_tx_rate.value_or(0);
  }
  if (diff.empty()) return false;
  const bool new_mac = diff.mac && !diff.mac->is_zero();
  // Right after sriov_numvfs changes, a driver may refuse rates for a
  // while: igb resets the PF to enable VFs, its link goes down and comes
  // back seconds later, and until then every rate is EINVAL (so is one
  // asked ~0.2 s after the change with the link up). A rate refused with
  // EINVAL is asked again, for at most rate_retry_.
  const auto deadline = std::chrono::steady_clock::now() + rate_retry_;
  for (;;) {
    try {
      vf_link_.set(netdev, vf, diff);
      return new_mac;
    } catch (const VfSettingRefused& e) {
      if (e.setting() != "rate" || e.error() != EINVAL) throw;
      if (std::chrono::steady_clock::now() >= deadline) {
        if (!link_up(netdev))
          throw VfSettingRefused(e.setting(), e.error(),
                                 std::string(e.what()) + " (the PF's link has been down for " +
                                     std::to_string(rate_retry_.count()) + " ms: " + driver(pf) +
                                     " takes VF rates only while it has a link)");
        throw;
      }
      diff.mac.reset();  // the settings before the rate went through
      diff.vlan.reset();
      diff.qos.reset();
      diff.trust.reset();
      diff.spoofchk.reset();
      diff.link_state.reset();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

bool HostControl::link_up(const std::string& netdev) {
  return sysfs_.read("class/net/" + netdev + "/carrier").value_or("0") == "1";
}

// The driver the kernel would give `dev` if nothing stood in the way: the
// loaded PCI driver of a module whose ID table matches the device's
// modalias. With sriov_drivers_autoprobe off the kernel probes a VF only for
// a driver named in its driver_override, so sriovd names it there.
std::string HostControl::own_driver(const PciAddress& dev) {
  const auto modalias = sysfs_.read(dev_path(dev, "modalias"));
  if (!modalias || modalias->empty()) throw std::runtime_error(dev.to_string() + " has no modalias");
  const auto modules = sysfs_.modules_for(*modalias);
  auto norm = [](std::string m) {
    for (char& c : m)
      if (c == '-') c = '_';
    return m;
  };
  for (const auto& d : sysfs_.list("bus/pci/drivers")) {
    if (d == kVfio || d == "pci-stub") continue;
    const std::string module = sysfs_.link_name("bus/pci/drivers/" + d + "/module").value_or(d);
    for (const auto& m : modules)
      if (norm(m) == norm(module) || norm(m) == norm(d)) return d;
  }
  std::string names;
  for (const auto& m : modules) names += (names.empty() ? "" : ", ") + m;
  throw std::runtime_error(dev.to_string() + " (" + *modalias + "): no loaded driver claims it" +
                           (names.empty() ? std::string(" (no module's ID table matches it)")
                                          : " (modules.alias names " + names + ": load it with modprobe)"));
}

// Binds `dev` to its own driver. Named by modalias where modules.alias can
// be read; where it cannot (the shipped unit's ProtectKernelModules hides
// /lib/modules), the kernel picks as it does for a new VF: the VF's PF gets
// sriov_drivers_autoprobe on for the one drivers_probe, and its old value
// back at once (a crash in between leaves it on: the journal's next start
// converges it).
void HostControl::probe_own_driver(const PciAddress& dev) {
  const std::string addr = dev.to_string();
  std::string own, why;
  try {
    own = own_driver(dev);
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (!own.empty()) {
    sysfs_.write(dev_path(dev, "driver_override"), own + "\n");
    sysfs_.write("bus/pci/drivers_probe", addr);
    sysfs_.write(dev_path(dev, "driver_override"), "\n");
  } else {
    const auto pf = sysfs_.link_name(dev_path(dev, "physfn"));
    const std::string autoprobe = pf ? "bus/pci/devices/" + *pf + "/sriov_drivers_autoprobe" : "";
    const bool toggle = pf && sysfs_.read(autoprobe).value_or("1") == "0";
    if (toggle) sysfs_.write(autoprobe, "1");
    try {
      sysfs_.write("bus/pci/drivers_probe", addr);
    } catch (...) {
      if (toggle) sysfs_.write(autoprobe, "0");
      throw;
    }
    if (toggle) sysfs_.write(autoprobe, "0");
  }
  const std::string bound = driver(dev);
  if (bound.empty() || bound == kVfio || (!own.empty() && bound != own))
    throw std::runtime_error("binding " + addr + " to its own driver" + (own.empty() ? "" : " " + own) +
                             ": drivers_probe succeeded but the device is " +
                             (bound.empty() ? std::string("bound to no driver") : "bound to " + bound) +
                             (why.empty() ? "" : " (" + why + ")"));
}

// A file of the netdev of the VF `key` names (its own driver's): throws
// when the VF has none (on vfio-pci, no driver, not there).
std::string HostControl::vf_netdev_path(const Key& key, const std::string& file) {
  const PciAddress vf = target(key);
  const auto names = sysfs_.list(dev_path(vf, "net"));
  if (names.empty())
    throw std::runtime_error("VF " + vf.to_string() + " has no netdev (driver '" + driver(vf) +
                             "'): its MTU is set on its own driver");
  return dev_path(vf, "net/" + names.front() + "/" + file);
}

json HostControl::get_binding(const PciAddress& dev) {
  return {{"driver", driver(dev)}, {"override", override_text(sysfs_.read(dev_path(dev, "driver_override")))}};
}

void HostControl::set_binding(const PciAddress& dev, const json& value) {
  const std::string want = value.at("driver").get<std::string>();
  const std::string want_override = value.value("override", "");
  const std::string addr = dev.to_string();
  std::string have = driver(dev);
  const std::string have_override = override_text(sysfs_.read(dev_path(dev, "driver_override")));

  if (have == kVfio && want != kVfio) wait_until_released(dev);
  if (want == "*") {
    // The device's own driver, whichever the kernel picks with no override:
    // probed with that driver as the override (autoprobe may be off), which
    // is then cleared.
    if (have == kVfio || (!have.empty() && !have_override.empty())) {
      sysfs_.write("bus/pci/drivers/" + have + "/unbind", addr);
      have.clear();
    }
    if (!have_override.empty()) sysfs_.write(dev_path(dev, "driver_override"), "\n");
    if (have.empty()) probe_own_driver(dev);
    return;
  }
  if (have == want && have_override == want_override) return;
  if (!have.empty() && have != want) {
    sysfs_.write("bus/pci/drivers/" + have + "/unbind", addr);
    have.clear();
  }
  // Writing a newline clears driver_override; leaving it set is what keeps
  // the original driver from ever binding again.
  if (want.empty() || have == want) {
    if (have_override != want_override) sysfs_.write(dev_path(dev, "driver_override"), want_override + "\n");
    return;
  }

  // Probe with the wanted driver as the override, so that neither the
  // device's native driver nor a driver without its ID (pci-stub) gets in
  // the way; then leave the override as wanted.
  if (have_override != want) sysfs_.write(dev_path(dev, "driver_override"), want + "\n");
  sysfs_.write("bus/pci/drivers_probe", addr);
  std::string bound = driver(dev);
  if (want_override != want) sysfs_.write(dev_path(dev, "driver_override"), want_override + "\n");
  if (bound != want)
    throw std::runtime_error("binding " + addr + " to " + want + ": drivers_probe succeeded but the device is " +
                             (bound.empty() ? std::string("bound to no driver") : "bound to " + bound) +
                             (want == kVfio ? " (is the vfio-pci module loaded?)" : ""));
}

json HostControl::get_numvfs(const PciAddress& pf) {
  const unsigned n = num_vfs(pf);
  json vfs = json::array();
  const std::string netdev = pf_netdev(pf);
  for (unsigned i = 0; i < n; ++i) {
    auto addr = vf_address(pf, i);
    if (!addr) continue;
    json snap = {{"index", i}, {"binding", get_binding(*addr)}};
    if (!netdev.empty()) {
      try {
        snap["settings"] = vf_link_.get(netdev, i).to_json();
      } catch (const std::exception&) {
        // A PF that cannot report VF settings has none to restore.
      }
    }
    vfs.push_back(snap);
  }
  return {{"numvfs", n}, {"vfs", vfs}};
}

void HostControl::set_numvfs(const PciAddress& pf, const json& value) {
  const unsigned want = value.at("numvfs").get<unsigned>();
  const unsigned have = num_vfs(pf);
  const std::string path = dev_path(pf, "sriov_numvfs");
  if (have != want) {
    // The kernel changes a non-zero VF count only through 0.
    if (have != 0) sysfs_.write(path, "0");
    if (want != 0) sysfs_.write(path, std::to_string(want));
  }
  wait_for_vfs(pf, want);
  // A snapshot (from get) brings the VFs back as they were.
  if (value.contains("vfs") && have != want) {
    // Driver first, then settings, as a release goes: a VF driver that
    // comes up registers its own MAC with the PF (igbvf: a random one), and
    // only a MAC set after that leaves the PF's view as it was.
    for (const auto& snap : value["vfs"]) {
      set(Key{KeyKind::binding, pf, snap.at("index").get<int>()}, snap.at("binding"));
      const Key settings{KeyKind::vf_settings, pf, snap.at("index").get<int>()};
      if (snap.contains("settings")) set(settings, snap["settings"]);
    }
  }
}

void HostControl::wait_for_vfs(const PciAddress& pf, unsigned n) {
  const auto deadline = std::chrono::steady_clock::now() + vf_timeout_;
  for (;;) {
    unsigned present = 0;
    for (unsigned i = 0; i < n; ++i) {
      auto vf = vf_address(pf, i);
      if (vf && exists(*vf)) ++present;
    }
    if (present == n && !vf_address(pf, n)) return;
    if (std::chrono::steady_clock::now() >= deadline)
      throw std::runtime_error("PF " + pf.to_string() + ": " + std::to_string(present) + " of " + std::to_string(n) +
                               " VFs appeared within " + std::to_string(vf_timeout_.count()) + " ms");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace sriovd::host
