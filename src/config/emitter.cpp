#include <yaml-cpp/yaml.h>

#include <cstdio>

#include "sriovd/config/loader.hpp"

namespace sriovd::config {
namespace {

void emit_access(YAML::Emitter& out, const SocketAccess& a) {
  if (a == SocketAccess{}) return;
  out << YAML::Key << "access" << YAML::Value << YAML::BeginMap;
  if (!a.user.empty()) out << YAML::Key << "user" << YAML::Value << a.user;
  if (!a.group.empty()) out << YAML::Key << "group" << YAML::Value << a.group;
  char mode[8];
  std::snprintf(mode, sizeof mode, "0%o", a.mode);
  out << YAML::Key << "mode" << YAML::Value << YAML::DoubleQuoted << mode;
  if (!a.allowed_uids.empty()) out << YAML::Key << "allowed_uids" << YAML::Value << YAML::Flow << a.allowed_uids;
  out << YAML::EndMap;
}

void emit_pf_ref(YAML::Emitter& out, const PfRef& ref) {
  if (ref.address)
    out << YAML::Key << "address" << YAML::Value << YAML::DoubleQuoted << ref.address->to_string();
  else
    out << YAML::Key << "netdev" << YAML::Value << ref.netdev;
}

void emit_vf(YAML::Emitter& out, const VfConfig& vf) {
  out << YAML::BeginMap << YAML::Key << "index" << YAML::Value << vf.index;
  if (vf.mac) out << YAML::Key << "mac" << YAML::Value << YAML::DoubleQuoted << vf.mac->to_string();
  if (vf.vlan) {
    out << YAML::Key << "vlan" << YAML::Value << *vf.vlan;
    out << YAML::Key << "qos" << YAML::Value << static_cast<unsigned>(vf.qos);
  }
  if (vf.trust) out << YAML::Key << "trust" << YAML::Value << *vf.trust;
  if (vf.spoofchk) out << YAML::Key << "spoofchk" << YAML::Value << *vf.spoofchk;
  if (vf.link_state) out << YAML::Key << "link_state" << YAML::Value << to_string(*vf.link_state);
  if (vf.max_tx_rate) out << YAML::Key << "max_tx_rate" << YAML::Value << *vf.max_tx_rate;
  if (vf.min_tx_rate) out << YAML::Key << "min_tx_rate" << YAML::Value << *vf.min_tx_rate;
  if (vf.mtu) out << YAML::Key << "mtu" << YAML::Value << *vf.mtu;
  if (vf.assign) {
    const auto& a = *vf.assign;
    out << YAML::Key << "assign" << YAML::Value << YAML::BeginMap;
    out << YAML::Key << "owner" << YAML::Value << a.owner;
    out << YAML::Key << "export" << YAML::Value << to_string(a.export_kind);
    if (!a.socket.empty()) out << YAML::Key << "socket" << YAML::Value << a.socket;
    out << YAML::Key << "msix_policy" << YAML::Value << to_string(a.msix_policy);
    if (a.export_kind == ExportKind::vfio_user)
      out << YAML::Key << "bar_access" << YAML::Value << to_string(a.bar_access);
    out << YAML::Key << "max_vectors" << YAML::Value << a.max_vectors;
    if (a.export_kind == ExportKind::vfio_user) out << YAML::Key << "max_dma_mib" << YAML::Value << a.max_dma_mib;
    emit_access(out, a.access);
    out << YAML::EndMap;
  }
  out << YAML::EndMap;
}

void emit_virtio(YAML::Emitter& out, const VirtioDevice& dev) {
  out << YAML::BeginMap;
  out << YAML::Key << "name" << YAML::Value << dev.name;
  out << YAML::Key << "type" << YAML::Value << to_string(dev.type);
  out << YAML::Key << "transport" << YAML::Value << to_string(dev.transport);
  if (dev.transport == Transport::vduse) {
    out << YAML::Key << "bind" << YAML::Value << to_string(dev.bind);
  } else {
    out << YAML::Key << "socket" << YAML::Value << dev.socket;
    out << YAML::Key << "socket_mode" << YAML::Value << to_string(dev.socket_mode);
  }
  out << YAML::Key << "queues" << YAML::Value << dev.queue_pairs;
  out << YAML::Key << "queue_size" << YAML::Value << dev.queue_size;
  // Quoted: a plain on/off would read back as a YAML 1.1 boolean elsewhere.
  out << YAML::Key << "packed" << YAML::Value << YAML::DoubleQuoted << to_string(dev.packed);
  if (dev.mac) out << YAML::Key << "mac" << YAML::Value << YAML::DoubleQuoted << dev.mac->to_string();
  out << YAML::Key << "mtu" << YAML::Value << dev.mtu;
  if (dev.iommu_platform) out << YAML::Key << "iommu_platform" << YAML::Value << true;
  if (!dev.cpus.empty()) out << YAML::Key << "cpus" << YAML::Value << YAML::Flow << dev.cpus;
  emit_access(out, dev.access);
  out << YAML::Key << "backend" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "type" << YAML::Value << to_string(dev.backend_kind);
  if (dev.backend_kind == BackendKind::tap) {
    out << YAML::Key << "name" << YAML::Value << dev.tap.name;
    if (!dev.tap.netns.empty()) out << YAML::Key << "netns" << YAML::Value << dev.tap.netns;
    out << YAML::Key << "offloads" << YAML::Value << YAML::Flow << YAML::BeginSeq;
    const auto& o = dev.tap.offloads;
    if (o.csum) out << "csum";
    if (o.tso4) out << "tso4";
    if (o.tso6) out << "tso6";
    if (o.tso_ecn) out << "tso_ecn";
    if (o.ufo) out << "ufo";
    out << YAML::EndSeq;
  } else {
    out << YAML::Key << "pf" << YAML::Value << YAML::DoubleQuoted << dev.vf.pf.to_string();
    out << YAML::Key << "vf" << YAML::Value << dev.vf.vf;
    out << YAML::Key << "via" << YAML::Value << to_string(dev.vf.via);
    if (dev.vf.via == VfAttach::af_packet)
      out << YAML::Key << "ring" << YAML::Value << YAML::DoubleQuoted << to_string(dev.vf.ring);
  }
  out << YAML::EndMap << YAML::EndMap;
}

void emit_simulated(YAML::Emitter& out, const std::vector<SimulatedPf>& pfs) {
  out << YAML::Key << "simulated" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "physical_functions" << YAML::Value << YAML::BeginSeq;
  for (const auto& sim : pfs) {
    out << YAML::BeginMap;
    out << YAML::Key << "address" << YAML::Value << YAML::DoubleQuoted << sim.address.to_string();
    out << YAML::Key << "vendor_id" << YAML::Value << YAML::Hex << sim.vendor_id << YAML::Dec;
    out << YAML::Key << "device_id" << YAML::Value << YAML::Hex << sim.device_id << YAML::Dec;
    out << YAML::Key << "total_vfs" << YAML::Value << sim.total_vfs;
    out << YAML::Key << "msix_vectors_per_vf" << YAML::Value << sim.msix_vectors_per_vf;
    out << YAML::Key << "set_irqs_cost_us" << YAML::Value << sim.set_irqs_cost_us;
    out << YAML::Key << "netdev" << YAML::Value << sim.netdev;
    out << YAML::EndMap;
  }
  out << YAML::EndSeq << YAML::EndMap;
}

void emit_kubernetes(YAML::Emitter& out, const Kubernetes& k) {
  out << YAML::Key << "kubernetes" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "device_plugin_dir" << YAML::Value << k.device_plugin_dir;
  out << YAML::Key << "cdi_dir" << YAML::Value << k.cdi_dir;
  out << YAML::Key << "pools" << YAML::Value << YAML::BeginSeq;
  for (const auto& pool : k.pools) {
    out << YAML::BeginMap << YAML::Key << "name" << YAML::Value << pool.name;
    if (!pool.vfs.empty()) {
      out << YAML::Key << "vfs" << YAML::Value << YAML::BeginSeq;
      for (const auto& v : pool.vfs)
        out << YAML::BeginMap << YAML::Key << "pf" << YAML::Value << YAML::DoubleQuoted << v.pf.to_string() << YAML::Key
            << "indexes" << YAML::Value << YAML::Flow << v.indexes << YAML::EndMap;
      out << YAML::EndSeq;
    }
    if (pool.selector) {
      const auto& sel = *pool.selector;
      out << YAML::Key << "selector" << YAML::Value << YAML::BeginMap;
      if (sel.pf) out << YAML::Key << "pf" << YAML::Value << YAML::DoubleQuoted << sel.pf->to_string();
      if (sel.vendor_id) out << YAML::Key << "vendor_id" << YAML::Value << *sel.vendor_id;
      if (sel.device_id) out << YAML::Key << "device_id" << YAML::Value << *sel.device_id;
      if (sel.owner) out << YAML::Key << "owner" << YAML::Value << *sel.owner;
      out << YAML::EndMap;
    }
    if (!pool.virtio_devices.empty())
      out << YAML::Key << "virtio_devices" << YAML::Value << YAML::Flow << pool.virtio_devices;
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
  if (k.dra.enabled) {
    out << YAML::Key << "dra" << YAML::Value << YAML::BeginMap;
    out << YAML::Key << "driver" << YAML::Value << k.dra.driver;
    if (!k.dra.node_name.empty()) out << YAML::Key << "node_name" << YAML::Value << k.dra.node_name;
    if (!k.dra.kubeconfig.empty()) out << YAML::Key << "kubeconfig" << YAML::Value << k.dra.kubeconfig;
    out << YAML::Key << "registry_dir" << YAML::Value << k.dra.registry_dir;
    out << YAML::Key << "plugins_dir" << YAML::Value << k.dra.plugins_dir;
    out << YAML::EndMap;
  }
  out << YAML::EndMap;
}

}  // namespace

std::string to_yaml(const Config& cfg) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "version" << YAML::Value << 1;
  out << YAML::Key << "host" << YAML::Value << to_string(cfg.host);
  out << YAML::Key << "log_level" << YAML::Value << cfg.log_level;
  out << YAML::Key << "state_dir" << YAML::Value << cfg.state_dir;
  if (cfg.host == HostMode::simulated) emit_simulated(out, cfg.simulated_pfs);
  out << YAML::Key << "control" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "socket" << YAML::Value << cfg.control.socket;
  if (!cfg.control.group.empty()) out << YAML::Key << "group" << YAML::Value << cfg.control.group;
  if (!cfg.control.allowed_uids.empty())
    out << YAML::Key << "allowed_uids" << YAML::Value << YAML::Flow << cfg.control.allowed_uids;
  if (cfg.control.poll_us != 0) out << YAML::Key << "poll_us" << YAML::Value << cfg.control.poll_us;
  if (cfg.control.session_threads != 0)
    out << YAML::Key << "session_threads" << YAML::Value << cfg.control.session_threads;
  out << YAML::EndMap;
  out << YAML::Key << "interrupts" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "relay_threads" << YAML::Value << cfg.interrupts.relay_threads;
  if (!cfg.interrupts.cpus.empty()) out << YAML::Key << "cpus" << YAML::Value << YAML::Flow << cfg.interrupts.cpus;
  out << YAML::Key << "busy_poll" << YAML::Value << cfg.interrupts.busy_poll;
  out << YAML::EndMap;
  if (cfg.peer_limits != PeerLimits{}) {
    out << YAML::Key << "peer_limits" << YAML::Value << YAML::BeginMap;
    out << YAML::Key << "max_mappings" << YAML::Value << cfg.peer_limits.max_mappings;
    out << YAML::Key << "max_mib" << YAML::Value << cfg.peer_limits.max_mib;
    out << YAML::Key << "max_address_space_mib" << YAML::Value << cfg.peer_limits.max_address_space_mib;
    out << YAML::EndMap;
  }
  if (cfg.kubernetes.enabled) emit_kubernetes(out, cfg.kubernetes);
  if (!cfg.metrics.listen.empty()) {
    out << YAML::Key << "metrics" << YAML::Value << YAML::BeginMap;
    out << YAML::Key << "listen" << YAML::Value << YAML::DoubleQuoted << cfg.metrics.listen;
    if (cfg.metrics.allow_remote) out << YAML::Key << "allow_remote" << YAML::Value << true;
    out << YAML::EndMap;
  }
  out << YAML::Key << "physical_functions" << YAML::Value << YAML::BeginSeq;
  for (const auto& pf : cfg.physical_functions) {
    out << YAML::BeginMap;
    emit_pf_ref(out, pf.ref);
    out << YAML::Key << "num_vfs" << YAML::Value << pf.num_vfs;
    out << YAML::Key << "vfs" << YAML::Value << YAML::BeginSeq;
    for (const auto& vf : pf.vfs) emit_vf(out, vf);
    out << YAML::EndSeq << YAML::EndMap;
  }
  out << YAML::EndSeq;
  out << YAML::Key << "virtio_devices" << YAML::Value << YAML::BeginSeq;
  for (const auto& dev : cfg.virtio_devices) emit_virtio(out, dev);
  out << YAML::EndSeq;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace sriovd::config
