#include "host_service.hpp"

#include <csignal>
#include <filesystem>

#include <spdlog/spdlog.h>

#include "sriovd/host/netlink_vf_link.hpp"
#include "sriovd/host/topology.hpp"
#include "sriovd/vfio/kernel.hpp"
#include "sriovd/vfio/simulated.hpp"

namespace sriovd::daemon {

using control::json;

json steps_json(const std::vector<host::Step>& steps) {
  json out = json::array();
  for (const auto& s : steps) out.push_back(s.describe());
  return out;
}

HostService::HostService(const config::Config& cfg, const std::string& sysfs_root, const std::string& simulated_state)
    : sysfs_root_(sysfs_root) {
  std::string journal = cfg.state_dir + "/state.json";
  if (cfg.host == config::HostMode::simulated) {
    journal = cfg.state_dir + "/state-simulated.json";
    if (!simulated_state.empty()) {
      // An upgrade in place: the host goes on as a real kernel would.
      sim_ = std::make_unique<host::SimulatedKernel>(cfg.state_dir + "/simulated-sysfs", simulated_state);
    } else {
      // The simulated host is born anew with the daemon: a journal of an
      // earlier one describes a host that no longer exists.
      std::error_code ec;
      if (std::filesystem::remove(journal, ec))
        spdlog::info("host: discarded the journal of the previous simulated host");
      sim_ = std::make_unique<host::SimulatedKernel>(cfg.state_dir + "/simulated-sysfs", cfg.simulated_pfs);
    }
    control_ = std::make_unique<host::HostControl>(*sim_, *sim_);
    spdlog::info("host: simulated kernel with {} PF(s), sysfs tree in {}", cfg.simulated_pfs.size(), sim_->root());
  } else {
    sysfs_ = std::make_unique<host::RealSysfs>(sysfs_root);
    vf_link_ = std::make_unique<host::NetlinkVfLink>();
    control_ = std::make_unique<host::HostControl>(*sysfs_, *vf_link_);
  }
  reconciler_ = std::make_unique<host::Reconciler>(*control_, host::StateFile(journal));
}

HostService::~HostService() = default;

std::string HostService::simulated_state() const { return sim_ ? sim_->save() : std::string(); }

void HostService::keep_for_successor() {
  if (sim_) sim_->keep_for_successor();
}

namespace {

// Crash tests: the process stops itself (SIGSTOP) before step n, so that a
// test can SIGKILL it in the middle of a transaction.
std::function<void(const host::Step&, size_t)> stop_before(std::optional<size_t> n) {
  if (!n) return nullptr;
  return [n = *n](const host::Step& step, size_t i) {
    if (i != n) return;
    spdlog::warn("host: stopping myself before step {} ({}) as a --test-stop option asked", i, step.describe());
    ::raise(SIGSTOP);
  };
}

}  // namespace

void HostService::start(const config::Config& cfg, std::optional<size_t> stop_before_step) {
  recovered_ = reconciler_->recover();
  for (const auto& s : recovered_) spdlog::warn("host: recovered: undid {}", s);
  reconciler_->before_step = stop_before(stop_before_step);
  const auto steps = reconciler_->converge(cfg, released_);
  reconciler_->before_step = nullptr;
  spdlog::info("host: {} change(s) applied", steps.size());
}

std::vector<host::Step> HostService::apply(const config::Config& cfg) {
  released_.clear();  // a reload starts from what the file says
  return reconciler_->converge(cfg, released_);
}

std::vector<host::Step> HostService::reconcile(const config::Config& cfg, std::optional<size_t> stop_before_step) {
  reconciler_->before_step = stop_before(stop_before_step);
  try {
    auto steps = reconciler_->converge(cfg, released_);
    reconciler_->before_step = nullptr;
    return steps;
  } catch (...) {
    reconciler_->before_step = nullptr;
    throw;
  }
}

// What a reload would do: a reload forgets released VFs.
std::vector<host::Step> HostService::plan(const config::Config& cfg) { return reconciler_->plan(cfg); }

std::vector<host::Step> HostService::release_vfs(const config::Config& cfg, const PciAddress& pf,
                                                 const std::vector<unsigned>& indices) {
  const auto before = released_;
  for (unsigned i : indices) released_.insert({pf, i});
  try {
    return reconciler_->converge(cfg, released_);
  } catch (...) {
    released_ = before;
    throw;
  }
}

std::optional<PciAddress> HostService::pf_address(const config::PfRef& ref) {
  if (ref.address) return ref.address;
  return control_->resolve_netdev(ref.netdev);
}

std::string HostService::pf_netdev(const PciAddress& pf) { return control_->pf_netdev(pf); }

std::vector<host::Step> HostService::release_all() { return reconciler_->release_all(); }

std::optional<PciAddress> HostService::vf_address(const config::PfRef& pf_ref, unsigned index) {
  std::optional<PciAddress> pf = pf_ref.address;
  if (!pf) pf = control_->resolve_netdev(pf_ref.netdev);
  if (!pf) return std::nullopt;
  return control_->vf_address(*pf, index);
}

bool HostService::released(const PciAddress& pf, unsigned index) const { return released_.count({pf, index}) != 0; }

std::unique_ptr<vfio::Device> HostService::open_vf(const config::Config& cfg, const config::PfRef& pf_ref,
                                                   unsigned index) {
  const auto vf = vf_address(pf_ref, index);
  if (!vf) throw std::runtime_error("PF " + pf_ref.to_string() + " has no VF " + std::to_string(index));
  if (sim_) {
    std::optional<PciAddress> pf = pf_ref.address;
    if (!pf) pf = control_->resolve_netdev(pf_ref.netdev);
    for (const auto& spf : cfg.simulated_pfs)
      if (pf && spf.address == *pf) {
        const std::string driver = control_->driver(*vf);
        if (driver != "vfio-pci")
          throw std::runtime_error("VF " + vf->to_string() + " is on '" + driver + "', not vfio-pci");
        const auto text = control_->sysfs().read("bus/pci/devices/" + vf->to_string() + "/device");
        if (!text) throw std::runtime_error("VF " + vf->to_string() + " has no device id in sysfs");
        const auto device_id = static_cast<uint16_t>(std::stoul(*text, nullptr, 16));
        auto dev =
            std::make_unique<vfio::SimulatedDevice>(vf->to_string(), spf.vendor_id, device_id, spf.msix_vectors_per_vf);
        dev->set_set_irqs_cost(std::chrono::microseconds(spf.set_irqs_cost_us));
        return dev;
      }
    throw std::runtime_error("PF " + pf_ref.to_string() + " is not a simulated PF");
  }
  return vfio::KernelDevice::open(*vf, sysfs_root_);
}

std::unique_ptr<vfio::Device> HostService::adopt_vf(const config::Config& cfg, const config::PfRef& pf_ref,
                                                    unsigned index, std::unique_ptr<vfio::Device> adopted) {
  const auto vf = vf_address(pf_ref, index);
  if (!vf || adopted->name() != vf->to_string())
    throw std::invalid_argument("the handed device " + adopted->name() + " is not VF " + std::to_string(index) +
                                " of " + pf_ref.to_string());
  if (auto* sim = dynamic_cast<vfio::SimulatedDevice*>(adopted.get())) {
    if (!sim_) throw std::invalid_argument("a simulated VF handed to a real host");
    for (const auto& spf : cfg.simulated_pfs)
      if (pf_ref.address && spf.address == *pf_ref.address)
        sim->set_set_irqs_cost(std::chrono::microseconds(spf.set_irqs_cost_us));
  } else if (sim_) {
    throw std::invalid_argument("a kernel VFIO device handed to a simulated host");
  }
  return adopted;
}

std::string HostService::vf_netdev(const config::PfRef& pf_ref, unsigned index) {
  std::optional<PciAddress> pf = pf_ref.address;
  if (!pf) pf = control_->resolve_netdev(pf_ref.netdev);
  if (!pf) throw std::runtime_error("PF " + pf_ref.to_string() + " not found");
  auto vf = control_->vf_address(*pf, index);
  if (!vf) throw std::runtime_error("PF " + pf_ref.to_string() + " has no VF " + std::to_string(index));
  if (sim_) return sim_->realize_vf_netdev(*vf);
  auto names = control_->sysfs().list("bus/pci/devices/" + vf->to_string() + "/net");
  if (names.empty())
    throw std::runtime_error("VF " + vf->to_string() + " has no netdev (is it bound to its own network driver?)");
  return names.front();
}

json HostService::devices_json(const config::Config& cfg, bool read_settings) {
  const auto devices = host::scan_pci(sim_ ? sim_->root() : sysfs_->root());
  auto info_of = [&](const PciAddress& a) -> const host::PciDeviceInfo* {
    for (const auto& d : devices)
      if (d.address == a) return &d;
    return nullptr;
  };
  json pfs = json::array();
  for (const auto& pf_cfg : cfg.physical_functions) {
    std::optional<PciAddress> addr = pf_cfg.ref.address;
    if (!addr) addr = control_->resolve_netdev(pf_cfg.ref.netdev);
    json pf = {{"pf", pf_cfg.ref.to_string()}, {"num_vfs", pf_cfg.num_vfs}};
    const host::PciDeviceInfo* info = addr ? info_of(*addr) : nullptr;
    if (!info) {
      pf["state"] = "missing";
      pf["vfs"] = json::array();
      pfs.push_back(pf);
      continue;
    }
    pf["address"] = info->address.to_string();
    pf["driver"] = info->driver;
    pf["netdevs"] = info->netdevs;
    pf["numa_node"] = info->numa_node;
    pf["total_vfs"] = info->total_vfs;
    pf["active_vfs"] = control_->num_vfs(info->address);
    pf["state"] = "present";
    // The PF's link (its netdev's carrier): a VF of a PF without link
    // carries nothing, whatever it is bound to.
    if (!info->netdevs.empty()) pf["link"] = control_->link_up(info->netdevs.front()) ? "up" : "down";
    json vfs = json::array();
    for (unsigned i = 0; i < std::max<unsigned>(pf_cfg.num_vfs, control_->num_vfs(info->address)); ++i) {
      const config::VfConfig* vf_cfg = nullptr;
      for (const auto& c : pf_cfg.vfs)
        if (c.index == i) vf_cfg = &c;
      json vf = {{"index", i}};
      if (vf_cfg && vf_cfg->mac) vf["mac"] = vf_cfg->mac->to_string();
      if (vf_cfg && vf_cfg->vlan) vf["vlan"] = *vf_cfg->vlan;
      const bool assigned = vf_cfg && vf_cfg->assign;
      if (assigned) {
        vf["owner"] = vf_cfg->assign->owner;
        vf["export"] = config::to_string(vf_cfg->assign->export_kind);
        if (!vf_cfg->assign->socket.empty()) vf["socket"] = vf_cfg->assign->socket;
        vf["msix_policy"] = config::to_string(vf_cfg->assign->msix_policy);
      }
      auto vf_addr = control_->vf_address(info->address, i);
      const host::PciDeviceInfo* vf_info = vf_addr ? info_of(*vf_addr) : nullptr;
      if (!vf_info) {
        vf["state"] = "missing";
        vfs.push_back(vf);
        continue;
      }
      vf["address"] = vf_info->address.to_string();
      vf["driver"] = vf_info->driver;
      vf["iommu_group"] = vf_info->iommu_group;
      vf["vendor_id"] = vf_info->vendor;
      vf["device_id"] = vf_info->device;
      vf["numa_node"] = vf_info->numa_node >= 0 ? vf_info->numa_node : info->numa_node;
      vf["netdevs"] = vf_info->netdevs;
      // Its netdev's MTU, as the kernel has it (a VF on its own driver).
      if (!vf_info->netdevs.empty())
        if (const auto mtu = control_->sysfs().read("bus/pci/devices/" + vf_info->address.to_string() + "/net/" +
                                                    vf_info->netdevs.front() + "/mtu"))
          vf["mtu"] = std::strtoul(mtu->c_str(), nullptr, 10);
      if (vf_info->msix) vf["msix_vectors"] = vf_info->msix->vectors;
      // What the PF's driver holds for the VF now (IFLA_VF_*), read back -
      // not what the config asks: an operator or a test sees what it has.
      if (read_settings && !info->netdevs.empty()) {
        try {
          vf["settings"] = control_->get(host::Key{host::KeyKind::vf_settings, info->address, static_cast<int>(i)});
        } catch (const std::exception& e) {
          vf["settings_error"] = e.what();
        }
      }
      std::string state;
      if (released_.count({info->address, i}))
        state = "released";
      else if (assigned)
        state = vf_info->driver == "vfio-pci" ? "assigned" : "not bound";
      else if (i >= pf_cfg.num_vfs)
        state = "unconfigured";
      else
        state = vf_info->driver.empty() ? "unbound" : "host";
      if (vf_info->driver == "vfio-pci") vf["group_viable"] = control_->iommu_group(vf_info->address).viable();
      vf["state"] = state;
      vfs.push_back(vf);
    }
    pf["vfs"] = vfs;
    pfs.push_back(pf);
  }
  return {{"physical_functions", pfs}};
}

}  // namespace sriovd::daemon
