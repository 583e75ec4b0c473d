// The daemon's side of the kubelet device plugin: the pools the config asks
// for, with each member's health as the host shows it now. A VF is healthy
// while it exists, is bound to vfio-pci as configured (not released), its
// IOMMU group is viable and its PF has link; a virtio device while sriovd
// serves its socket.
#include <spdlog/spdlog.h>

#include "daemon_internal.hpp"
#include "sriovd/daemon/daemon.hpp"

#include "dra_driver.hpp"
#include "host_service.hpp"

namespace sriovd::daemon {

namespace {

bool selected(const config::PoolSelector& sel, const config::PfConfig& pf, const config::VfConfig& vf,
              const control::json& host_vf) {
  if (!vf.assign || vf.assign->export_kind != config::ExportKind::none) return false;
  if (sel.pf && !(*sel.pf == pf.ref)) return false;
  if (sel.owner && *sel.owner != vf.assign->owner) return false;
  if (sel.vendor_id && host_vf.value("vendor_id", -1) != *sel.vendor_id) return false;
  if (sel.device_id && host_vf.value("device_id", -1) != *sel.device_id) return false;
  return true;
}

}  // namespace

std::vector<k8s::Pool> Daemon::k8s_pools() const {
  const control::json devices = devices_json();
  std::vector<k8s::Pool> out;
  for (const auto& pool_cfg : config_.kubernetes.pools) {
    k8s::Pool pool{pool_cfg.name, {}};
    for (size_t p = 0; p < config_.physical_functions.size(); ++p) {
      const config::PfConfig& pf = config_.physical_functions[p];
      const control::json& host_pf = devices["physical_functions"][p];
      for (const config::VfConfig& vf : pf.vfs) {
        bool member = false;
        for (const auto& list : pool_cfg.vfs)
          if (list.pf == pf.ref && std::find(list.indexes.begin(), list.indexes.end(), vf.index) != list.indexes.end())
            member = true;
        control::json host_vf = control::json::object();
        for (const auto& v : host_pf.value("vfs", control::json::array()))
          if (v.value("index", -1) == vf.index) host_vf = v;
        if (!member && !(pool_cfg.selector && selected(*pool_cfg.selector, pf, vf, host_vf))) continue;
        // A VF listed once keeps its id (its PCI address) when it goes, so
        // the kubelet hears it is unhealthy rather than nothing.
        std::string& id = k8s_ids_[{pf.ref.to_string(), vf.index}];
        if (host_vf.contains("address")) id = host_vf["address"].get<std::string>();
        if (id.empty()) continue;  // never seen: nothing to list yet
        k8s::Device d;
        d.id = id;
        d.pf = pf.ref.to_string();
        d.numa_node = host_vf.value("numa_node", -1);
        const bool vfio = host_vf.value("driver", "") == "vfio-pci";
        d.iommu_group = vfio ? host_vf.value("iommu_group", -1) : -1;
        d.healthy = assigned_vf_healthy(host_pf, host_vf);
        pool.devices.push_back(std::move(d));
      }
    }
    for (const auto& name : pool_cfg.virtio_devices)
      for (const auto& v : devices["virtio_devices"])
        if (v.value("name", "") == name) {
          k8s::Device d;
          d.id = name;
          d.socket = v.value("socket", "");
          d.healthy = v.value("state", "") != "not served";
          pool.devices.push_back(std::move(d));
        }
    out.push_back(std::move(pool));
  }
  return out;
}

void Daemon::update_k8s() {
  if (dra_) {
    try {
      dra_->update(yaml_, devices_json(), host_->simulated() ? host_->simulated()->root() : options_.sysfs_root);
    } catch (const std::exception& e) {
      spdlog::error("dra: {}", e.what());
    }
  }
  // The device plugin: for its pools (a DRA driver alone needs none).
  if (!config_.kubernetes.enabled || (config_.kubernetes.pools.empty() && config_.kubernetes.dra.enabled)) {
    k8s_.reset();
    return;
  }
  try {
    if (!k8s_)
      k8s_ = std::make_unique<k8s::NodeAgent>(config_.kubernetes.device_plugin_dir, config_.kubernetes.cdi_dir);
    k8s_->update(k8s_pools());
  } catch (const std::exception& e) {
    spdlog::error("kubernetes: {}", e.what());
  }
}

}  // namespace sriovd::daemon
