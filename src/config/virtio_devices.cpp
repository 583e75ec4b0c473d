// virtio_devices: each device, its queues and its backend (a tap, or a
// VF's netdev).

#include "loader_sections.hpp"

namespace sriovd::config {

// A name of letters, digits, '-', '_' and '.', no other device's.
std::optional<std::string> Loader::read_device_name(Mapping& m) {
  auto name = m.string("name", true);
  if (!name) return std::nullopt;
  if (!valid_identifier(*name)) {
    ctx_.error(m.where("name"), m.path_of("name"),
               "name '" + *name + "' may use only letters, digits, '-', '_' and '.' (at most 64)");
    return std::nullopt;
  }
  for (const auto& other : cfg_.virtio_devices)
    if (other.name == *name) {
      ctx_.error(m.where("name"), m.path_of("name"),
                 "virtio device '" + *name + "' is already defined at " + line_ref(other.where));
      return std::nullopt;
    }
  return name;
}

// Queue pairs, ring layout and size, MTU and the workers' CPUs.
// What fits one 4096-byte AF_XDP frame after the XDP headroom (256) and a
// VLAN-tagged Ethernet header (18); ports/xdp_socket.cpp sizes frames so.
constexpr unsigned kAfXdpMaxMtu = 4096 - 256 - 18;

void Loader::read_queues(Mapping& m, VirtioDevice& dev) {
  if (auto q = m.unsigned_in("queues", 1, 16)) dev.queue_pairs = static_cast<uint16_t>(*q);
  if (auto p = m.choice<PackedRing>(
          "packed", {{"off", PackedRing::off}, {"on", PackedRing::on}, {"auto", PackedRing::automatic}}))
    dev.packed = *p;
  if (auto qs = m.unsigned_in("queue_size", 2, 32768)) {
    // Split rings need a power of two (virtio 1.2 §2.7); packed rings do not.
    const bool power_of_two = (*qs & (*qs - 1)) == 0;
    if (!power_of_two && dev.packed != PackedRing::on)
      ctx_.error(m.where("queue_size"), m.path_of("queue_size"),
                 "queue_size " + std::to_string(*qs) +
                     " is not a power of two, which split rings require (only 'packed: on' allows it)");
    else
      dev.queue_size = static_cast<uint16_t>(*qs);
  }
  dev.mac = mac_value(ctx_, m, "mac");
  if (auto mtu = m.unsigned_in("mtu", 68, 65535)) dev.mtu = static_cast<uint16_t>(*mtu);
  for_each_item(ctx_, m, "cpus", [&](const YAML::Node& n, const std::string& p) {
    auto cpu = Mapping::unsigned_value(ctx_, n, p, 0, CPU_SETSIZE - 1);
    if (!cpu) return;
    if (std::find(dev.cpus.begin(), dev.cpus.end(), *cpu) != dev.cpus.end())
      ctx_.error(n, p, "CPU " + std::to_string(*cpu) + " is listed twice");
    else
      dev.cpus.push_back(static_cast<uint16_t>(*cpu));
  });
}

void Loader::read_virtio(const YAML::Node& node, const std::string& path) {
  Mapping m(ctx_, node, path,
            {"name", "type", "transport", "bind", "socket", "socket_mode", "queues", "queue_size", "packed", "mac",
             "mtu", "iommu_platform", "cpus", "access", "backend"});
  if (!m.valid()) return;
  VirtioDevice dev;
  dev.where = m.where();
  bool ok = true;
  const auto name = read_device_name(m);
  ok &= name.has_value();
  if (auto t = m.choice<VirtioType>("type", {{"net", VirtioType::net}}, true))
    dev.type = *t;
  else
    ok = false;
  if (auto t = m.choice<Transport>(
          "transport",
          {{"vhost-user", Transport::vhost_user}, {"vfio-user", Transport::vfio_user}, {"vduse", Transport::vduse}},
          true))
    dev.transport = *t;
  else
    ok = false;
  const bool vduse = dev.transport == Transport::vduse;
  std::optional<std::string> socket;
  if (vduse) {
    // The kernel is the driver: no socket, no peer to admit.
    for (const char* key : {"socket", "socket_mode", "access"})
      if (m.has(key)) {
        ctx_.error(m.where(key), m.path_of(key),
                   std::string("'") + key + "' is not used with 'transport: vduse' (the kernel drives the device)");
        ok = false;
      }
    socket = std::string();
    if (auto b = m.choice<VduseBind>("bind", {{"netdev", VduseBind::netdev}, {"vhost-vdpa", VduseBind::vhost_vdpa}}))
      dev.bind = *b;
  } else {
    if (m.has("bind")) {
      ctx_.error(m.where("bind"), m.path_of("bind"), "'bind' is only used with 'transport: vduse'");
      ok = false;
    }
    socket = socket_path(ctx_, m, "socket", true);
    ok &= socket.has_value();
  }
  if (auto mode =
          m.choice<SocketMode>("socket_mode", {{"server", SocketMode::server}, {"client", SocketMode::client}})) {
    dev.socket_mode = *mode;
    if (*mode == SocketMode::client && dev.transport != Transport::vhost_user)
      ctx_.error(m.where("socket_mode"), m.path_of("socket_mode"),
                 "client mode is only for vhost-user (a vfio-user server always listens)");
  }
  read_queues(m, dev);
  if (auto iommu = m.boolean("iommu_platform")) {
    if (*iommu && dev.transport != Transport::vhost_user) {
      ctx_.error(m.where("iommu_platform"), m.path_of("iommu_platform"),
                 "iommu_platform is for vhost-user devices (over vfio-user the VMM maps DMA itself)");
      ok = false;
    }
    dev.iommu_platform = *iommu;
  }
  if (m.has("access") && !vduse) dev.access = read_access(m.get("access", false), m.path_of("access"));
  if (vduse && dev.queue_pairs > 1) {
    // Several pairs need the control queue (VIRTIO_NET_F_MQ), which the
    // kernel's VDUSE does not take for a network device.
    ctx_.error(m.where("queues"), m.path_of("queues"),
               "queues " + std::to_string(dev.queue_pairs) +
                   " with 'transport: vduse': a VDUSE network device has one queue pair (the kernel takes no "
                   "control queue from VDUSE, and several pairs need one)");
    ok = false;
  }
  ok &= read_backend(m.get("backend", true), m.path_of("backend"), dev);
  if (ok && dev.backend_kind == BackendKind::vf && dev.vf.via == VfAttach::af_packet && dev.queue_pairs > 1 &&
      dev.transport != Transport::vhost_user) {
    // The driver's MQ setting (control queue) would have to move flows
    // between AF_PACKET fanout members, which cannot leave their group;
    // a macvtap's queues detach (TUNSETQUEUE) as a tap's do, and AF_XDP
    // sockets are steered by the port.
    ctx_.error(m.where("queues"), m.path_of("queues"),
               "a VF backend with more than one queue pair over vfio-user needs 'via: macvtap' or 'via: af_xdp' "
               "(through AF_PACKET it serves one; over vhost-user any works)");
    ok = false;
  }
  if (ok && dev.backend_kind == BackendKind::vf && dev.vf.via == VfAttach::af_xdp && dev.mtu > kAfXdpMaxMtu) {
    // One UMEM frame per packet (no AF_XDP multi-buffer on these kernels).
    ctx_.error(m.where("mtu"), m.path_of("mtu"),
               "mtu " + std::to_string(dev.mtu) + " is above what 'via: af_xdp' carries (" +
                   std::to_string(kAfXdpMaxMtu) + ": one 4096-byte frame with its headroom)");
    ok = false;
  }
  if (!ok) return;
  dev.name = *name;
  dev.socket = *socket;
  dev.socket_where = m.where("socket");
  cfg_.virtio_devices.push_back(std::move(dev));
}

bool Loader::read_backend(const YAML::Node& node, const std::string& path, VirtioDevice& dev) {
  if (!node.IsDefined()) return false;
  dev.backend_where = location_of(node);
  Mapping m(ctx_, node, path, {"type", "name", "netns", "offloads", "pf", "vf", "via", "ring"});
  if (!m.valid()) return false;
  auto kind = m.choice<BackendKind>("type", {{"tap", BackendKind::tap}, {"vf", BackendKind::vf}}, true);
  if (!kind) return false;
  dev.backend_kind = *kind;
  if (*kind == BackendKind::tap) {
    for (const char* key : {"pf", "vf", "via", "ring"}) only_for(m, key, "vf");
    return read_tap_backend(m, dev);
  }
  for (const char* key : {"name", "netns", "offloads"}) only_for(m, key, "tap");
  return read_vf_backend(m, dev);
}

void Loader::only_for(Mapping& m, const char* key, const char* kind_name) {
  if (m.has(key))
    ctx_.error(m.where(key), m.path_of(key), std::string("'") + key + "' is only used with 'type: " + kind_name + "'");
}

// type: tap - a tap of this name (in netns, if given), no other device's.
bool Loader::read_tap_backend(Mapping& m, VirtioDevice& dev) {
  auto name = m.string("name", true);
  if (!name) return false;
  if (!valid_ifname(*name)) {
    ctx_.error(m.where("name"), m.path_of("name"),
               "'" + *name + "' is not a valid interface name (1 to 15 characters, no '/', ':' or spaces)");
    return false;
  }
  for (const auto& other : cfg_.virtio_devices)
    if (other.backend_kind == BackendKind::tap && other.tap.name == *name &&
        other.tap.netns == m.string("netns").value_or("")) {
      ctx_.error(m.where("name"), m.path_of("name"),
                 "tap '" + *name + "' is already the backend of '" + other.name + "'");
      return false;
    }
  dev.tap.name = *name;
  if (auto ns = m.string("netns")) {
    if (ns->find('/') != std::string::npos || *ns == "." || *ns == "..") {
      ctx_.error(m.where("netns"), m.path_of("netns"),
                 "'" + *ns + "' is not a network namespace name (as in 'ip netns')");
      return false;
    }
    dev.tap.netns = *ns;
  }
  if (m.has("offloads")) read_tap_offloads(m, dev.tap);
  return true;
}

// offloads: what the kernel may hand the device on the tap.
void Loader::read_tap_offloads(Mapping& m, TapBackend& tap) {
  tap.offloads = TapOffloads{false, false, false, false, false};
  for_each_item(ctx_, m, "offloads", [&](const YAML::Node& n, const std::string& p) {
    static const std::vector<std::pair<const char*, bool TapOffloads::*>> names = {{"csum", &TapOffloads::csum},
                                                                                   {"tso4", &TapOffloads::tso4},
                                                                                   {"tso6", &TapOffloads::tso6},
                                                                                   {"tso_ecn", &TapOffloads::tso_ecn},
                                                                                   {"ufo", &TapOffloads::ufo}};
    for (const auto& [nm, member] : names)
      if (n.IsScalar() && n.Scalar() == nm) {
        tap.offloads.*member = true;
        return;
      }
    ctx_.error(n, p, "expected one of csum, tso4, tso6, tso_ecn, ufo, got " + describe(n));
  });
  const auto& o = tap.offloads;
  if ((o.tso4 || o.tso6 || o.ufo) && !o.csum)
    ctx_.error(m.where("offloads"), m.path_of("offloads"),
               "tso4, tso6 and ufo need csum (segmentation offloads imply checksum offload)");
}

// The PF a VF backend names, by address or netdev, among physical_functions.
const PfConfig* Loader::find_pf(Mapping& m, const std::string& pf_name) {
  PfRef ref;
  if (auto addr = PciAddress::parse(pf_name))
    ref.address = addr;
  else
    ref.netdev = pf_name;
  const PfConfig* pf = nullptr;
  for (const auto& candidate : cfg_.physical_functions)
    if ((ref.address && candidate.ref.address == ref.address) || (!ref.address && candidate.ref.netdev == ref.netdev))
      pf = &candidate;
  if (!pf) {
    ctx_.error(m.where("pf"), m.path_of("pf"), "PF '" + pf_name + "' is not in physical_functions");
    return nullptr;
  }
  return pf;
}

// type: vf - VF `vf` of PF `pf` (configured, not exported over vfio-user,
// no other device's), reached through AF_PACKET or a macvtap.
bool Loader::read_vf_backend(Mapping& m, VirtioDevice& dev) {
  auto pf_name = m.string("pf", true);
  auto vf_index = m.unsigned_in("vf", 0, 255, true);
  if (!pf_name || !vf_index) return false;
  if (m.has("via")) {
    auto via = m.choice<VfAttach>(
        "via", {{"af_packet", VfAttach::af_packet}, {"macvtap", VfAttach::macvtap}, {"af_xdp", VfAttach::af_xdp}},
        true);
    if (!via) return false;
    dev.vf.via = *via;
  }
  if (m.has("ring") && dev.vf.via != VfAttach::af_packet) {
    ctx_.error(m.where("ring"), m.path_of("ring"), "'ring' is only used with 'via: af_packet'");
    return false;
  }
  if (m.has("ring")) {
    auto ring = m.choice<PacketRingMode>(
        "ring", {{"v3", PacketRingMode::v3}, {"v2", PacketRingMode::v2}, {"off", PacketRingMode::off}}, true);
    if (!ring) return false;
    dev.vf.ring = *ring;
  }
  const PfConfig* pf = find_pf(m, *pf_name);
  if (!pf) return false;
  if (*vf_index >= pf->num_vfs) {
    ctx_.error(m.where("vf"), m.path_of("vf"),
               "VF index " + std::to_string(*vf_index) + " is not below num_vfs " + std::to_string(pf->num_vfs) +
                   " of PF " + pf->ref.to_string());
    return false;
  }
  for (const auto& vf : pf->vfs)
    if (vf.index == *vf_index && vf.assign && vf.assign->export_kind == ExportKind::vfio_user) {
      ctx_.error(m.where("vf"), m.path_of("vf"),
                 "VF " + std::to_string(*vf_index) + " of PF " + pf->ref.to_string() +
                     " is exported over vfio-user to '" + vf.assign->owner + "' (" + line_ref(vf.where) +
                     "); its netdev cannot also back a virtio device");
      return false;
    }
  dev.vf.pf = pf->ref;
  dev.vf.vf = static_cast<uint16_t>(*vf_index);
  for (const auto& other : cfg_.virtio_devices)
    if (other.backend_kind == BackendKind::vf && other.vf == dev.vf) {
      ctx_.error(m.where("vf"), m.path_of("vf"),
                 "VF " + std::to_string(dev.vf.vf) + " of PF " + dev.vf.pf.to_string() +
                     " is already the backend of '" + other.name + "'");
      return false;
    }
  return true;
}

}  // namespace sriovd::config
