#pragma once
// The typed, validated form of sriovd.yaml (schema version 1). Nothing here
// is acted on before config::load() has checked all of it.

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "sriovd/util/pci_address.hpp"

namespace sriovd::config {

// Where a value stood in the file: 1-based line and column.
struct SourceLocation {
  int line = 0;
  int column = 0;
};

enum class HostMode { system, simulated };
enum class LinkState { automatic, enable, disable };
enum class ExportKind { none, vfio_user };
enum class MsixPolicy { direct, relay, adaptive };
// How a vfio-user client reaches a VF's BARs: every access through the
// server (trapped), or mapped through the VFIO device fd handed to it
// (mmap: zero-copy, and a kernel object the VMM then holds - README).
enum class BarAccess { trapped, mmap };
// vduse: the kernel drives the device itself (linux/vduse.h, the vDPA bus).
enum class Transport { vhost_user, vfio_user, vduse };
// A VDUSE device's vDPA driver: virtio_vdpa (a host netdev) or vhost_vdpa
// (/dev/vhost-vdpa-N, for a VMM).
enum class VduseBind { netdev, vhost_vdpa };
// A virtio device's type (virtio 1.2 §5): what the device factory makes.
enum class VirtioType { net };
enum class PackedRing { off, on, automatic };
enum class BackendKind { tap, vf };

const char* to_string(HostMode);
const char* to_string(LinkState);
const char* to_string(ExportKind);
const char* to_string(MsixPolicy);
const char* to_string(BarAccess);
const char* to_string(Transport);
const char* to_string(VduseBind);
const char* to_string(VirtioType);
const char* to_string(PackedRing);
const char* to_string(BackendKind);

// A PF as the operator names it: by PCI address or by netdev (exactly one).
// In simulated mode the loader resolves a netdev to its address.
struct PfRef {
  std::optional<PciAddress> address;
  std::string netdev;

  [[nodiscard]] std::string to_string() const { return address ? address->to_string() : netdev; }
  bool operator==(const PfRef&) const = default;
};

// One PF of the simulated host (host: simulated).
struct SimulatedPf {
  PciAddress address;
  uint16_t vendor_id = 0x8086;
  uint16_t device_id = 0x1572;
  uint16_t total_vfs = 8;
  uint16_t msix_vectors_per_vf = 4;
  // What one VFIO_DEVICE_SET_IRQS of a simulated VF costs, spent on the
  // calling thread, so that the MSI-X policies differ as they do on real
  // vfio-pci. The default is the real kernel's cost measured here:
  // `scripts/bench mask-storm` (vfio-pci in the VM harness, kernel 6.1)
  // handled 18.6k masking interrupts/s naive (two SET_IRQS each) against
  // 42.6k/s lazy (none): (1/18.6k - 1/42.6k) / 2 = 15 us per SET_IRQS.
  uint32_t set_irqs_cost_us = 15;
  std::string netdev;
  SourceLocation where;
};

// The longest control.poll_us: the window is for the message that follows
// within tens of microseconds; a thread that polls longer is a spinner.
inline constexpr uint32_t kMaxControlPollUs = 1000;

struct Control {
  std::string socket = "/run/sriovd/control.sock";
  std::string group;                // empty: the daemon's own group
  std::optional<gid_t> gid;         // resolved from group
  std::vector<uid_t> allowed_uids;  // empty: any peer the socket mode admits
  // After work, the control thread and the session threads (control API,
  // vfio-user, vhost-user messages) poll up to this long before they
  // sleep, while that pays (util/polling_loop.hpp); 0: they sleep at once.
  uint32_t poll_us = 0;
  // The session threads that serve the VMMs' vfio-user and vhost-user
  // sessions (util/session_threads.hpp); 0: one per CPU the daemon may
  // run on.
  uint16_t session_threads = 0;
};

inline constexpr uint16_t kMaxSessionThreads = 256;

// Who may use one of the sockets a VMM connects to (a vfio-user export, a
// vhost-user or virtio-pci device): the file's owner, group and mode, set
// at creation and on reload, and the peer uids (SO_PEERCRED) admitted. An
// empty list admits any peer whose credentials the kernel can give (the
// file mode is the gate); a list admits exactly those uids. A peer whose
// credentials cannot be read is always refused.
struct SocketAccess {
  std::vector<uid_t> allowed_uids;
  std::string user;          // socket file owner; empty: the daemon's
  std::optional<uid_t> uid;  // resolved from user
  std::string group;         // socket file group; empty: the daemon's
  std::optional<gid_t> gid;  // resolved from group
  uint32_t mode = 0660;
  bool operator==(const SocketAccess&) const = default;
};

struct VfAssign {
  std::string owner;
  ExportKind export_kind = ExportKind::vfio_user;
  std::string socket;  // required when export_kind is vfio_user
  MsixPolicy msix_policy = MsixPolicy::adaptive;
  BarAccess bar_access = BarAccess::trapped;
  uint16_t max_vectors = 0;  // 0: as many as the VF has
  // The most guest memory the VMM may map for the VF's DMA: each window is
  // pinned by the kernel and charged to the daemon (LimitMEMLOCK=infinity).
  uint64_t max_dma_mib = 256 * 1024;
  SocketAccess access;
  SourceLocation socket_where;
};

// Settings left unset (nullopt) are not touched on the host.
struct VfConfig {
  uint16_t index = 0;
  std::optional<MacAddress> mac;
  // The virtio device bridged to this VF whose `mac` this is ("" when the
  // VF's own entry gives it); see Loader::link_bridged_macs.
  std::string mac_from_device;
  std::optional<uint16_t> vlan;
  uint8_t qos = 0;
  std::optional<bool> trust;
  std::optional<bool> spoofchk;
  std::optional<LinkState> link_state;
  std::optional<uint32_t> max_tx_rate;  // Mbit/s, 0 = unlimited
  std::optional<uint32_t> min_tx_rate;  // Mbit/s
  // The MTU of the VF's own netdev (a VF not assigned: on its kernel
  // driver); an assigned VF's is its guest's.
  std::optional<uint16_t> mtu;
  std::optional<VfAssign> assign;
  SourceLocation where;
};

struct PfConfig {
  PfRef ref;
  uint16_t num_vfs = 0;
  std::vector<VfConfig> vfs;
  SourceLocation where;
};

// Offloads a tap backend enables with TUNSETOFFLOAD.
struct TapOffloads {
  bool csum = true;
  bool tso4 = true;
  bool tso6 = true;
  bool tso_ecn = false;
  bool ufo = false;
  bool operator==(const TapOffloads&) const = default;
};

struct TapBackend {
  std::string name;
  std::string netns;  // empty: the daemon's namespace
  TapOffloads offloads;
  bool operator==(const TapBackend&) const = default;
};

// How the VF-to-virtio bridge moves frames through AF_PACKET: TPACKET_V2
// frame rings (the default: each frame handed over at once), TPACKET_V3
// block rings (a block handed over when full or after a timer tick: fewer
// wakeups, but a frame on a quiet link waits for the tick - TCP sees
// late ACKs), or a system call per frame.
enum class PacketRingMode { v3, v2, off };
const char* to_string(PacketRingMode);

// How the VF's netdev is reached: an AF_PACKET socket on it, a macvtap
// link (passthru) made on it for the device's lifetime, or AF_XDP sockets
// (one per queue) behind sriovd's XDP program attached to it.
enum class VfAttach { af_packet, macvtap, af_xdp };
const char* to_string(VfAttach);

// A VF's kernel netdev as the backend: the VF-to-virtio bridge.
struct VfBackend {
  PfRef pf;
  uint16_t vf = 0;
  VfAttach via = VfAttach::af_packet;
  PacketRingMode ring = PacketRingMode::v2;  // af_packet only
  bool operator==(const VfBackend&) const = default;
};

enum class SocketMode { server, client };
const char* to_string(SocketMode);

struct VirtioDevice {
  std::string name;
  VirtioType type = VirtioType::net;
  Transport transport = Transport::vhost_user;
  VduseBind bind = VduseBind::netdev;  // transport: vduse
  std::string socket;                  // empty for vduse (no socket: the kernel is the driver)
  // server: sriovd listens; client: sriovd connects to a VMM that listens
  // (and reconnects when it goes away). vhost-user only.
  SocketMode socket_mode = SocketMode::server;
  uint16_t queue_pairs = 1;
  uint16_t queue_size = 256;
  PackedRing packed = PackedRing::automatic;
  std::optional<MacAddress> mac;
  uint16_t mtu = 1500;
  // Offer VIRTIO_F_ACCESS_PLATFORM (vhost-user): the VMM's vIOMMU
  // translates ring addresses through the device IOTLB.
  bool iommu_platform = false;
  // Queue pair i's worker runs on cpus[i % n]; empty: not pinned.
  std::vector<uint16_t> cpus;
  // Its socket's owner, group, mode and peers (server mode); in client mode
  // allowed_uids is checked against the VMM that listens.
  SocketAccess access;
  BackendKind backend_kind = BackendKind::tap;
  TapBackend tap;
  VfBackend vf;
  SourceLocation where;
  SourceLocation socket_where;
  SourceLocation backend_where;

  // The same device with the same settings, wherever in the file it is.
  [[nodiscard]] bool same_settings(const VirtioDevice& o) const {
    auto key = [](const VirtioDevice& d) {
      return std::tie(d.name, d.type, d.transport, d.bind, d.socket, d.socket_mode, d.queue_pairs, d.queue_size,
                      d.packed, d.mac, d.mtu, d.iommu_platform, d.cpus, d.backend_kind, d.tap, d.vf);
      // access is not part of it: a reload applies it to the running device.
    };
    return key(*this) == key(o);
  }
};

// peer_limits: what one client (a vhost-user front-end, a vfio-user
// client) may make the daemon map of its memory at once - guest RAM
// regions, DMA windows, dirty logs, inflight buffers. Over it, the mapping is
// refused (EDQUOT, or the connection ends) and nothing else changes.
struct PeerLimits {
  uint32_t max_mappings = 1024;
  uint64_t max_mib = 1ULL << 20U;                // 1 TiB: the sizes the client declared
  uint64_t max_address_space_mib = 1ULL << 21U;  // 2 TiB: what they take mapped, in whole pages
  bool operator==(const PeerLimits&) const = default;
};

struct Interrupts {
  uint16_t relay_threads = 1;
  std::vector<uint16_t> cpus;  // empty: no pinning; else relay thread i -> cpus[i % n]
  bool busy_poll = false;
};

// metrics: a Prometheus scrape endpoint, off without the section. A
// non-loopback address only with allow_remote (the counters name every VF,
// owner and socket of the host).
struct Metrics {
  std::string listen;  // "127.0.0.1:9808" (IPv4: the HTTP server here has no IPv6); empty: off
  bool allow_remote = false;
  bool operator==(const Metrics&) const = default;
};

// kubernetes: sriovd as a kubelet device plugin (v1beta1). Each pool is
// one extended resource ("vendor.domain/name"); its members are VFs (by PF
// and indexes, or by a selector over the configured VFs) and virtio
// devices (their sockets). A VF is in at most one pool.
struct PoolVfs {
  PfRef pf;
  std::vector<uint16_t> indexes;
  bool operator==(const PoolVfs&) const = default;
};
struct PoolSelector {
  std::optional<PfRef> pf;
  std::optional<uint16_t> vendor_id, device_id;  // the PF's ids (a VF's device id follows its PF's)
  std::optional<std::string> owner;              // assign.owner
  bool operator==(const PoolSelector&) const = default;
};
struct ResourcePool {
  std::string name;
  std::vector<PoolVfs> vfs;
  std::optional<PoolSelector> selector;
  std::vector<std::string> virtio_devices;
  SourceLocation where;
  bool operator==(const ResourcePool& o) const {
    return name == o.name && vfs == o.vfs && selector == o.selector && virtio_devices == o.virtio_devices;
  }
};
// kubernetes.dra: sriovd as a DRA driver (resource.k8s.io/v1) for the VFs
// of the configured PFs that the YAML does not give to anything itself.
struct Dra {
  bool enabled = false;  // the section is there
  std::string driver = "sriovd.io";
  // The node the slices are for; empty: $NODE_NAME, else the host name.
  std::string node_name;
  // Where the API server is; empty: $KUBECONFIG, else the pod's service
  // account (in-cluster).
  std::string kubeconfig;
  std::string registry_dir = "/var/lib/kubelet/plugins_registry";
  std::string plugins_dir = "/var/lib/kubelet/plugins";
  SourceLocation where;
  bool operator==(const Dra& o) const {
    return std::tie(enabled, driver, node_name, kubeconfig, registry_dir, plugins_dir) ==
           std::tie(o.enabled, o.driver, o.node_name, o.kubeconfig, o.registry_dir, o.plugins_dir);
  }
};

struct Kubernetes {
  bool enabled = false;  // the section is there
  std::string device_plugin_dir = "/var/lib/kubelet/device-plugins";
  std::string cdi_dir = "/var/run/cdi";
  std::vector<ResourcePool> pools;
  Dra dra;
  bool operator==(const Kubernetes&) const = default;
};

struct Config {
  std::string path;  // the file it came from
  HostMode host = HostMode::system;
  std::string log_level = "info";
  std::string state_dir = "/var/lib/sriovd";
  std::vector<SimulatedPf> simulated_pfs;
  Control control;
  std::vector<PfConfig> physical_functions;
  std::vector<VirtioDevice> virtio_devices;
  Interrupts interrupts;
  PeerLimits peer_limits;
  Metrics metrics;
  Kubernetes kubernetes;
};

}  // namespace sriovd::config
