#pragma once
// The bad configurations, one rule each, with the position and text of the
// first diagnostic each must get. Read by bad_config_test.cpp (the parser's
// messages) and by dump_bad_configs.cpp, which writes each as a file for
// tests/config/check_schema.py (the JSON Schema must refuse them too, but for
// the checks a schema cannot make, which that script lists).
#include <ostream>
#include <string>

namespace sriovd::config::bad_configs {

// Lines 1-2.
inline const std::string kSystem = "version: 1\nhost: system\n";
// Lines 1-8: a simulated host with one PF of 4 VFs, 4 vectors each.
inline const std::string kSimulated = R"(version: 1
host: simulated
simulated:
  physical_functions:
    - address: "0000:3b:00.0"
      netdev: simpf0
      total_vfs: 4
      msix_vectors_per_vf: 4
)";
// Lines 9-13 after kSimulated: the PF with VF 0 open for more keys.
inline const std::string kPf = R"(physical_functions:
  - address: "0000:3b:00.0"
    num_vfs: 2
    vfs:
      - index: 0
)";
// Line 14 after kSimulated + kPf: VF 0 for a pool.
inline const std::string kK8sVf = "        assign: {owner: k, export: none}\n";
// Lines 3-7 after kSystem: one virtio device open for more keys.
inline const std::string kVirtio = R"(virtio_devices:
  - name: n0
    type: net
    transport: vhost-user
    socket: /run/sriovd/n0.sock
)";

struct BadCase {
  const char* name;
  std::string text;
  int line;
  int column;
  std::string message;
};

inline std::ostream& operator<<(std::ostream& os, const BadCase& c) { return os << c.name; }

inline const std::string kTopKeys =
    "(expected one of: version, host, log_level, state_dir, simulated, control, physical_functions, "
    "virtio_devices, interrupts, peer_limits, metrics, kubernetes)";

// clang-format off
inline const BadCase kCases[] = {
  // --- the file as a whole (YAML 1.2 syntax, document shape) ---
  {"SyntaxError", "version: 1\nhost: [system\n", 3, 1,
   "YAML syntax error: end of sequence flow not found"},
  {"EmptyFile", "", 1, 1, "the file is empty; expected a mapping with 'version: 1'"},
  {"DocumentIsAList", "- version: 1\n", 1, 1, "document: expected a mapping, got a list"},
  {"MissingVersion", "host: system\n", 1, 1, "document: missing required key 'version'"},
  {"UnsupportedVersion", "version: 2\nhost: system\n", 1, 10,
   "version: unsupported schema version 2 (this sriovd reads version 1)"},
  {"VersionNotANumber", "version: one\nhost: system\n", 1, 10,
   "version: expected an integer from 0 to 4294967295, got 'one'"},
  {"MissingHost", "version: 1\n", 1, 1, "document: missing required key 'host'"},
  {"UnknownHostMode", "version: 1\nhost: cloud\n", 2, 7,
   "host: expected one of system, simulated, got 'cloud'"},
  {"UnknownTopLevelKey", kSystem + "logging: debug\n", 3, 1, "unknown key 'logging' " + kTopKeys},
  {"DuplicateKey", kSystem + "host: simulated\n", 3, 1, "duplicate key 'host' (first at line 2)"},
  {"UnknownLogLevel", kSystem + "log_level: loud\n", 3, 12,
   "log_level: expected one of trace, debug, info, warn, error, critical, off, got 'loud'"},
  {"RelativeStateDir", kSystem + "state_dir: var/lib/sriovd\n", 3, 12,
   "state_dir: expected an absolute path, got 'var/lib/sriovd'"},

  // --- host: simulated ---
  {"SimulatedWithoutSection", "version: 1\nhost: simulated\n", 1, 1,
   "document: 'host: simulated' needs a 'simulated' section"},
  {"SimulatedSectionOnSystemHost", kSystem + "simulated:\n  physical_functions: []\n", 4, 3,
   "simulated: only allowed with 'host: simulated' (host is system)"},
  {"SimulatedBadAddress",
   "version: 1\nhost: simulated\nsimulated:\n  physical_functions:\n    - {address: 0000:3b:00, netdev: p0}\n",
   5, 17, "simulated.physical_functions[0].address: expected a PCI address like 0000:03:00.0, got '0000:3b:00'"},
  {"SimulatedDeviceNumberOutOfRange",
   "version: 1\nhost: simulated\nsimulated:\n  physical_functions:\n    - {address: 0000:3b:20.0, netdev: p0}\n",
   5, 17, "simulated.physical_functions[0].address: expected a PCI address like 0000:03:00.0, got '0000:3b:20.0'"},
  {"SimulatedZeroTotalVfs",
   "version: 1\nhost: simulated\nsimulated:\n  physical_functions:\n    - {address: 0000:3b:00.0, netdev: p0, total_vfs: 0}\n",
   5, 54, "simulated.physical_functions[0].total_vfs: expected an integer from 1 to 256, got '0'"},
  {"SimulatedNetdevTooLong",
   "version: 1\nhost: simulated\nsimulated:\n  physical_functions:\n    - {address: 0000:3b:00.0, netdev: averyveryverylongname}\n",
   5, 39, "simulated.physical_functions[0].netdev: 'averyveryverylongname' is not a valid interface name "
          "(1 to 15 characters, no '/', ':' or spaces)"},
  {"SimulatedDuplicateAddress",
   kSimulated + "    - {address: \"0000:3b:00.0\", netdev: simpf1}\n", 9, 17,
   "simulated.physical_functions[1].address: PCI address 0000:3b:00.0 is already simulated at line 5"},

  // --- control ---
  {"RelativeControlSocket", kSystem + "control:\n  socket: control.sock\n", 4, 11,
   "control.socket: expected an absolute path, got 'control.sock'"},
  {"ControlSocketTooLong", kSystem + "control:\n  socket: /" + std::string(110, 'x') + "\n", 4, 11,
   "control.socket: socket path is 111 bytes; the limit is 107"},
  {"UnknownGroup", kSystem + "control:\n  group: no-such-group-here\n", 4, 10,
   "control.group: no such group 'no-such-group-here' on this host"},
  {"NegativeUid", kSystem + "control:\n  allowed_uids: [-1]\n", 4, 18,
   "control.allowed_uids[0]: expected an integer from 0 to 4294967294, got '-1'"},
  {"ControlPollTooLong", kSystem + "control:\n  poll_us: 5000\n", 4, 12,
   "control.poll_us: expected an integer from 0 to 1000, got '5000'"},
  {"SessionThreadsTooMany", kSystem + "control:\n  session_threads: 257\n", 4, 20,
   "control.session_threads: expected an integer from 0 to 256, got '257'"},
  {"ControlPollNegative", kSystem + "control:\n  poll_us: -1\n", 4, 12,
   "control.poll_us: expected an integer from 0 to 1000, got '-1'"},
  {"ControlSocketIsAList", kSystem + "control:\n  socket: [/a, /b]\n", 4, 11,
   "control.socket: expected a string, got a list"},

  // --- peer_limits ---
  {"ZeroPeerMappings", kSystem + "peer_limits:\n  max_mappings: 0\n", 4, 17,
   "peer_limits.max_mappings: expected an integer from 1 to 65536, got '0'"},
  {"AddressSpaceBelowBytes", kSystem + "peer_limits:\n  max_mib: 4096\n  max_address_space_mib: 1024\n", 5, 26,
   "peer_limits.max_address_space_mib: 1024 MiB is less than max_mib (4096 MiB): what a client declares always "
   "takes at least that much address space"},
  {"UnknownPeerLimit", kSystem + "peer_limits:\n  max_regions: 4\n", 4, 3,
   "peer_limits: unknown key 'max_regions' (expected one of: max_mappings, max_mib, max_address_space_mib)"},

  // --- interrupts ---
  {"ZeroRelayThreads", kSystem + "interrupts:\n  relay_threads: 0\n", 4, 18,
   "interrupts.relay_threads: expected an integer from 1 to 64, got '0'"},
  {"CpuListedTwice", kSystem + "interrupts:\n  cpus: [1, 1]\n", 4, 13,
   "interrupts.cpus[1]: CPU 1 is listed twice"},
  {"BusyPollYesIsNotABoolean", kSystem + "interrupts:\n  busy_poll: yes\n", 4, 14,
   "interrupts.busy_poll: expected true or false, got 'yes'"},
  {"InterruptsIsAList", kSystem + "interrupts: [1]\n", 3, 13,
   "interrupts: expected a mapping, got a list"},

  // --- physical_functions ---
  {"PfNamedTwice", kSystem + "physical_functions:\n  - {address: 0000:03:00.0, netdev: eth0, num_vfs: 1}\n", 4, 5,
   "physical_functions[0]: expected exactly one of 'address' or 'netdev' to name the PF"},
  {"PfWithoutNumVfs", kSystem + "physical_functions:\n  - address: \"0000:03:00.0\"\n", 4, 5,
   "physical_functions[0]: missing required key 'num_vfs'"},
  {"PfNotSimulated", kSimulated + "physical_functions:\n  - {address: 0000:3c:00.0, num_vfs: 1}\n", 10, 15,
   "physical_functions[0].address: PF '0000:3c:00.0' is not one of the simulated PFs"},
  {"NumVfsAboveTotalVfs", kSimulated + "physical_functions:\n  - {netdev: simpf0, num_vfs: 5}\n", 10, 31,
   "physical_functions[0].num_vfs: num_vfs 5 exceeds total_vfs 4 of simulated PF 0000:3b:00.0"},
  {"PfConfiguredTwice", kSimulated + kPf + "  - {netdev: simpf0, num_vfs: 1}\n", 14, 14,
   "physical_functions[1].netdev: PF '0000:3b:00.0' is already configured at line 10"},
  {"VfsIsAMapping", kSystem + "physical_functions:\n  - {address: 0000:03:00.0, num_vfs: 1, vfs: {index: 0}}\n", 4, 46,
   "physical_functions[0].vfs: expected a list, got a mapping"},
  {"VfIsAScalar", kSystem + "physical_functions:\n  - {address: 0000:03:00.0, num_vfs: 1, vfs: [zero]}\n", 4, 47,
   "physical_functions[0].vfs[0]: expected a mapping, got 'zero'"},
  {"VfIndexNotBelowNumVfs", kSimulated + kPf + "      - index: 2\n", 14, 16,
   "physical_functions[0].vfs[1].index: VF index 2 is not below num_vfs 2 of PF 0000:3b:00.0"},
  {"VfConfiguredTwice", kSimulated + kPf + "      - index: 0\n", 14, 16,
   "physical_functions[0].vfs[1].index: VF 0 of PF 0000:3b:00.0 is already configured at line 13"},
  {"UnknownVfKey", kSimulated + kPf + "        vlna: 5\n", 14, 9,
   "physical_functions[0].vfs[0]: unknown key 'vlna' (expected one of: index, mac, vlan, qos, trust, "
   "spoofchk, link_state, max_tx_rate, min_tx_rate, mtu, assign)"},
  {"MtuOnAnAssignedVf", kSimulated + kPf + "        mtu: 9000\n        assign: {owner: vm, export: none}\n", 14, 14,
   "physical_functions[0].vfs[0].mtu: mtu is the MTU of the VF's own netdev; an assigned VF has none on the host "
   "(its guest sets its MTU)"},
  {"VfMtuTooSmall", kSimulated + kPf + "        mtu: 40\n", 14, 14,
   "physical_functions[0].vfs[0].mtu: expected an integer from 68 to 65535, got '40'"},
  {"MalformedMac", kSimulated + kPf + "        mac: 02:00:00:00:00\n", 14, 14,
   "physical_functions[0].vfs[0].mac: expected a MAC address like 02:00:00:00:00:01, got '02:00:00:00:00'"},
  {"MulticastMac", kSimulated + kPf + "        mac: 01:00:5e:00:00:01\n", 14, 14,
   "physical_functions[0].vfs[0].mac: '01:00:5e:00:00:01' is a multicast address; a device MAC must be unicast"},
  {"ZeroMac", kSimulated + kPf + "        mac: 00:00:00:00:00:00\n", 14, 14,
   "physical_functions[0].vfs[0].mac: 00:00:00:00:00:00 is not a usable MAC; omit the key to leave the MAC unchanged"},
  {"VlanOutOfRange", kSimulated + kPf + "        vlan: 4096\n", 14, 15,
   "physical_functions[0].vfs[0].vlan: expected an integer from 0 to 4095, got '4096'"},
  {"QuotedVlan", kSimulated + kPf + "        vlan: \"100\"\n", 14, 15,
   "physical_functions[0].vfs[0].vlan: expected an integer from 0 to 4095, got a string"},
  {"QosOutOfRange", kSimulated + kPf + "        vlan: 10\n        qos: 8\n", 15, 14,
   "physical_functions[0].vfs[0].qos: expected an integer from 0 to 7, got '8'"},
  {"QosWithoutVlan", kSimulated + kPf + "        qos: 3\n", 14, 14,
   "physical_functions[0].vfs[0].qos: qos needs a vlan to tag with"},
  {"UnknownLinkState", kSimulated + kPf + "        link_state: up\n", 14, 21,
   "physical_functions[0].vfs[0].link_state: expected one of auto, enable, disable, got 'up'"},
  {"TrustIsANumber", kSimulated + kPf + "        trust: 1\n", 14, 16,
   "physical_functions[0].vfs[0].trust: expected true or false, got '1'"},
  {"MinRateAboveMaxRate", kSimulated + kPf + "        max_tx_rate: 100\n        min_tx_rate: 200\n", 15, 22,
   "physical_functions[0].vfs[0].min_tx_rate: min_tx_rate 200 exceeds max_tx_rate 100"},
  {"DuplicateVfMac", kSimulated + kPf + "        mac: 02:00:00:00:00:01\n      - index: 1\n        mac: 02:00:00:00:00:01\n",
   15, 9, "VF 1 of PF 0000:3b:00.0: MAC 02:00:00:00:00:01 is already used by VF 0 of PF 0000:3b:00.0"},

  // --- assign ---
  {"AssignWithoutOwner", kSimulated + kPf + "        assign: {export: none}\n", 14, 17,
   "physical_functions[0].vfs[0].assign: missing required key 'owner'"},
  {"ExportWithoutSocket", kSimulated + kPf + "        assign: {owner: vm1}\n", 14, 17,
   "physical_functions[0].vfs[0].assign: missing required key 'socket'"},
  {"SocketWithoutExport", kSimulated + kPf + "        assign: {owner: vm1, export: none, socket: /run/a.sock}\n", 14, 52,
   "physical_functions[0].vfs[0].assign.socket: a socket is only used with 'export: vfio-user'"},
  {"UnknownMsixPolicy", kSimulated + kPf + "        assign: {owner: vm1, socket: /run/a.sock, msix_policy: lazy}\n", 14, 64,
   "physical_functions[0].vfs[0].assign.msix_policy: expected one of direct, relay, adaptive, got 'lazy'"},
  {"MaxVectorsAboveTheVfs", kSimulated + kPf + "        assign: {owner: vm1, socket: /run/a.sock, max_vectors: 5}\n", 14, 64,
   "physical_functions[0].vfs[0].assign.max_vectors: expected an integer from 0 to 4, got '5'"},
  {"OwnerWithSpace", kSimulated + kPf + "        assign: {owner: vm one, export: none}\n", 14, 25,
   "physical_functions[0].vfs[0].assign.owner: owner 'vm one' may use only letters, digits, '-', '_' and '.' (at most 64)"},
  {"ExportSocketIsControlSocket", kSimulated + kPf + "        assign: {owner: vm1, socket: /run/sriovd/control.sock}\n", 14, 38,
   "VF 0 of PF 0000:3b:00.0: socket '/run/sriovd/control.sock' is already used by control.socket"},

  // --- virtio_devices ---
  {"VirtioWithoutType", kSystem + "virtio_devices:\n  - {name: n0, transport: vhost-user, socket: /run/n0.sock, backend: {type: tap, name: t0}}\n",
   4, 5, "virtio_devices[0]: missing required key 'type'"},
  {"DuplicateVirtioKey", kSystem + kVirtio + "    backend: {type: tap, name: t0}\n    type: blk\n", 9, 5,
   "virtio_devices[0]: duplicate key 'type' (first at line 5)"},
  {"UnknownTransport", kSystem + "virtio_devices:\n  - {name: n0, type: net, transport: mmio, socket: /run/n0.sock, backend: {type: tap, name: t0}}\n",
   4, 38, "virtio_devices[0].transport: expected one of vhost-user, vfio-user, vduse, got 'mmio'"},
  {"NotANetDevice", kSystem + "virtio_devices:\n  - {name: n0, type: blk, transport: vhost-user, socket: /run/n0.sock, backend: {type: tap, name: t0}}\n",
   4, 22, "virtio_devices[0].type: expected one of net, got 'blk'"},
  {"ClientModeForVfioUser", kSystem + "virtio_devices:\n  - {name: n0, type: net, transport: vfio-user, socket: /run/n0.sock, socket_mode: client, backend: {type: tap, name: t0}}\n",
   4, 84, "virtio_devices[0].socket_mode: client mode is only for vhost-user (a vfio-user server always listens)"},
  {"SocketForVduse", kSystem + "virtio_devices:\n  - {name: n0, type: net, transport: vduse, socket: /run/n0.sock, backend: {type: tap, name: t0}}\n",
   4, 53, "virtio_devices[0].socket: 'socket' is not used with 'transport: vduse' (the kernel drives the device)"},
  {"BindWithoutVduse", kSystem + "virtio_devices:\n  - {name: n0, type: net, transport: vhost-user, bind: netdev, socket: /run/n0.sock, backend: {type: tap, name: t0}}\n",
   4, 56, "virtio_devices[0].bind: 'bind' is only used with 'transport: vduse'"},
  {"UnknownVduseBind", kSystem + "virtio_devices:\n  - {name: n0, type: net, transport: vduse, bind: vfio, backend: {type: tap, name: t0}}\n",
   4, 51, "virtio_devices[0].bind: expected one of netdev, vhost-vdpa, got 'vfio'"},
  {"VduseQueuePairs", kSystem + "virtio_devices:\n  - {name: n0, type: net, transport: vduse, queues: 2, backend: {type: tap, name: t0}}\n",
   4, 53, "virtio_devices[0].queues: queues 2 with 'transport: vduse': a VDUSE network device has one queue pair (the kernel takes no control queue from VDUSE, and several pairs need one)"},
  {"UnknownSocketMode", kSystem + kVirtio + "    socket_mode: listen\n    backend: {type: tap, name: t0}\n", 8, 18,
   "virtio_devices[0].socket_mode: expected one of server, client, got 'listen'"},
  {"UnknownBarAccess", kSimulated + kPf + "        assign: {owner: vm1, socket: /run/vf0.sock, bar_access: direct}\n", 14, 65,
   "physical_functions[0].vfs[0].assign.bar_access: expected one of trapped, mmap, got 'direct'"},
  {"SocketModeWithExecuteBits", kSystem + kVirtio + "    access: {mode: \"0775\"}\n    backend: {type: tap, name: t0}\n", 8, 20,
   "virtio_devices[0].access.mode: mode '0775': octal file mode with read and write for the owner and no execute bits (e.g. \"0660\")"},
  {"SocketModeNotOctal", kSystem + kVirtio + "    access: {mode: rw}\n    backend: {type: tap, name: t0}\n", 8, 20,
   "virtio_devices[0].access.mode: mode 'rw': octal file mode with read and write for the owner and no execute bits (e.g. \"0660\")"},
  {"SocketUserUnknown", kSystem + kVirtio + "    access: {user: no-such-user-here}\n    backend: {type: tap, name: t0}\n", 8, 20,
   "virtio_devices[0].access.user: no such user 'no-such-user-here' on this host"},
  {"SocketGroupUnknown", kSystem + kVirtio + "    access: {group: no-such-group-here}\n    backend: {type: tap, name: t0}\n", 8, 21,
   "virtio_devices[0].access.group: no such group 'no-such-group-here' on this host"},
  {"SocketAccessUnknownKey", kSystem + kVirtio + "    access: {owner: qemu}\n    backend: {type: tap, name: t0}\n", 8, 14,
   "virtio_devices[0].access: unknown key 'owner' (expected one of: user, group, mode, allowed_uids)"},
  {"SocketAllowedUidNotANumber", kSystem + kVirtio + "    access: {allowed_uids: [qemu]}\n    backend: {type: tap, name: t0}\n", 8, 29,
   "virtio_devices[0].access.allowed_uids[0]: expected an integer from 0 to 4294967294, got 'qemu'"},
  {"TooManyQueues", kSystem + kVirtio + "    queues: 17\n    backend: {type: tap, name: t0}\n", 8, 13,
   "virtio_devices[0].queues: expected an integer from 1 to 16, got '17'"},
  {"SplitRingNotPowerOfTwo", kSystem + kVirtio + "    queue_size: 1000\n    backend: {type: tap, name: t0}\n", 8, 17,
   "virtio_devices[0].queue_size: queue_size 1000 is not a power of two, which split rings require (only 'packed: on' allows it)"},
  {"MtuTooSmall", kSystem + kVirtio + "    mtu: 10\n    backend: {type: tap, name: t0}\n", 8, 10,
   "virtio_devices[0].mtu: expected an integer from 68 to 65535, got '10'"},
  {"VirtioWithoutBackend", kSystem + kVirtio, 4, 5, "virtio_devices[0]: missing required key 'backend'"},
  {"MultiQueueVfOverVfioUser", kSimulated + "physical_functions:\n  - {address: \"0000:3b:00.0\", num_vfs: 2}\nvirtio_devices:\n  - {name: n0, type: net, transport: vfio-user, socket: /run/n0.sock, queues: 2, backend: {type: vf, pf: \"0000:3b:00.0\", vf: 1}}\n",
   12, 79, "virtio_devices[0].queues: a VF backend with more than one queue pair over vfio-user needs 'via: macvtap' or 'via: af_xdp' (through AF_PACKET it serves one; over vhost-user any works)"},
  {"VirtioCpuTwice", kSystem + kVirtio + "    cpus: [1, 1]\n    backend: {type: tap, name: t0}\n", 8, 15,
   "virtio_devices[0].cpus[1]: CPU 1 is listed twice"},
  {"IommuPlatformOverVfioUser", kSystem + "virtio_devices:\n  - {name: n0, type: net, transport: vfio-user, socket: /run/n0.sock, iommu_platform: true, backend: {type: tap, name: t0}}\n",
   4, 87, "virtio_devices[0].iommu_platform: iommu_platform is for vhost-user devices (over vfio-user the VMM maps DMA itself)"},
  {"DuplicateVirtioName", kSystem + kVirtio + "    backend: {type: tap, name: t0}\n" +
   "  - {name: n0, type: net, transport: vhost-user, socket: /run/n1.sock, backend: {type: tap, name: t1}}\n", 9, 12,
   "virtio_devices[1].name: virtio device 'n0' is already defined at line 4"},
  {"TapWithoutName", kSystem + kVirtio + "    backend: {type: tap}\n", 8, 14,
   "virtio_devices[0].backend: missing required key 'name'"},
  {"TapWithVfKey", kSystem + kVirtio + "    backend: {type: tap, name: t0, vf: 1}\n", 8, 40,
   "virtio_devices[0].backend.vf: 'vf' is only used with 'type: vf'"},
  {"TapWithRingKey", kSystem + kVirtio + "    backend: {type: tap, name: t0, ring: v3}\n", 8, 42,
   "virtio_devices[0].backend.ring: 'ring' is only used with 'type: vf'"},
  {"UnknownPacketRing", kSimulated + kPf + "virtio_devices:\n  - {name: n0, type: net, transport: vhost-user, socket: /run/n0.sock, backend: {type: vf, pf: 0000:3b:00.0, vf: 1, ring: v4}}\n",
   15, 123, "virtio_devices[0].backend.ring: expected one of v3, v2, off, got 'v4'"},
  {"BridgedMacDiffersFromItsVfs", kSimulated + kPf + "        mac: 02:00:00:00:00:01\nvirtio_devices:\n  - {name: n0, type: net, transport: vhost-user, socket: /run/n0.sock, mac: 02:00:00:00:00:02, backend: {type: vf, pf: 0000:3b:00.0, vf: 0}}\n",
   16, 5, "virtio_devices[0].mac: virtio device 'n0' has MAC 02:00:00:00:00:02 but its backing VF 0 of PF 0000:3b:00.0 has 02:00:00:00:00:01 (line 13): a bridged guest must use its VF's MAC (the VF receives only its own, and spoofchk drops others); leave one of the two out"},
  {"UnknownVfAttach", kSimulated + kPf + "virtio_devices:\n  - {name: n0, type: net, transport: vhost-user, socket: /run/n0.sock, backend: {type: vf, pf: 0000:3b:00.0, vf: 1, via: macvlan}}\n",
   15, 122, "virtio_devices[0].backend.via: expected one of af_packet, macvtap, af_xdp, got 'macvlan'"},
  {"AfXdpMtuAboveOneFrame", kSimulated + kPf + "virtio_devices:\n  - {name: n0, type: net, transport: vhost-user, socket: /run/n0.sock, mtu: 9000, backend: {type: vf, pf: 0000:3b:00.0, vf: 1, via: af_xdp}}\n",
   15, 77, "virtio_devices[0].mtu: mtu 9000 is above what 'via: af_xdp' carries (3822: one 4096-byte frame with its headroom)"},
  {"RingWithAfXdp", kSimulated + kPf + "virtio_devices:\n  - {name: n0, type: net, transport: vhost-user, socket: /run/n0.sock, backend: {type: vf, pf: 0000:3b:00.0, vf: 1, via: af_xdp, ring: v3}}\n",
   15, 136, "virtio_devices[0].backend.ring: 'ring' is only used with 'via: af_packet'"},
  {"RingWithMacvtap", kSimulated + kPf + "virtio_devices:\n  - {name: n0, type: net, transport: vhost-user, socket: /run/n0.sock, backend: {type: vf, pf: 0000:3b:00.0, vf: 1, via: macvtap, ring: v2}}\n",
   15, 137, "virtio_devices[0].backend.ring: 'ring' is only used with 'via: af_packet'"},
  {"TapWithViaKey", kSystem + kVirtio + "    backend: {type: tap, name: t0, via: macvtap}\n", 8, 41,
   "virtio_devices[0].backend.via: 'via' is only used with 'type: vf'"},
  {"UnknownOffload", kSystem + kVirtio + "    backend: {type: tap, name: t0, offloads: [csum, gso]}\n", 8, 53,
   "virtio_devices[0].backend.offloads[1]: expected one of csum, tso4, tso6, tso_ecn, ufo, got 'gso'"},
  {"TsoWithoutCsum", kSystem + kVirtio + "    backend: {type: tap, name: t0, offloads: [tso4]}\n", 8, 46,
   "virtio_devices[0].backend.offloads: tso4, tso6 and ufo need csum (segmentation offloads imply checksum offload)"},
  {"NetnsWithSlash", kSystem + kVirtio + "    backend: {type: tap, name: t0, netns: ../x}\n", 8, 43,
   "virtio_devices[0].backend.netns: '../x' is not a network namespace name (as in 'ip netns')"},
  {"TapUsedTwice", kSystem + kVirtio + "    backend: {type: tap, name: t0}\n" +
   "  - {name: n1, type: net, transport: vhost-user, socket: /run/n1.sock, backend: {type: tap, name: t0}}\n", 9, 99,
   "virtio_devices[1].backend.name: tap 't0' is already the backend of 'n0'"},
  {"BackendPfNotConfigured", kSimulated + kPf + "virtio_devices:\n  - {name: n0, type: net, transport: vhost-user, socket: /run/n0.sock, backend: {type: vf, pf: simpf9, vf: 0}}\n",
   15, 96, "virtio_devices[0].backend.pf: PF 'simpf9' is not in physical_functions"},
  {"BackendVfNotBelowNumVfs", kSimulated + kPf + "virtio_devices:\n  - {name: n0, type: net, transport: vhost-user, socket: /run/n0.sock, backend: {type: vf, pf: 0000:3b:00.0, vf: 3}}\n",
   15, 114, "virtio_devices[0].backend.vf: VF index 3 is not below num_vfs 2 of PF 0000:3b:00.0"},
  {"BackendVfIsExported", kSimulated + kPf + "        assign: {owner: vm1, socket: /run/vf0.sock}\n" +
   "virtio_devices:\n  - {name: n0, type: net, transport: vhost-user, socket: /run/n0.sock, backend: {type: vf, pf: 0000:3b:00.0, vf: 0}}\n",
   16, 114, "virtio_devices[0].backend.vf: VF 0 of PF 0000:3b:00.0 is exported over vfio-user to 'vm1' (line 13); "
            "its netdev cannot also back a virtio device"},
  {"BackendVfUsedTwice", kSimulated + kPf +
   "virtio_devices:\n  - {name: n0, type: net, transport: vhost-user, socket: /run/n0.sock, backend: {type: vf, pf: 0000:3b:00.0, vf: 1}}\n" +
   "  - {name: n1, type: net, transport: vhost-user, socket: /run/n1.sock, backend: {type: vf, pf: simpf0, vf: 1}}\n",
   16, 108, "virtio_devices[1].backend.vf: VF 1 of PF 0000:3b:00.0 is already the backend of 'n0'"},
  {"SocketSharedByVirtioAndVf", kSimulated + kPf + "        assign: {owner: vm1, socket: /run/n0.sock}\n" +
   "virtio_devices:\n  - {name: n0, type: net, transport: vhost-user, socket: /run/n0.sock, backend: {type: tap, name: t0}}\n",
   16, 58, "virtio device 'n0': socket '/run/n0.sock' is already used by VF 0 of PF 0000:3b:00.0 (line 14)"},
  {"MetricsNotLoopback", kSystem + "metrics: {listen: \"0.0.0.0:9808\"}\n", 3, 19,
   "metrics.listen: '0.0.0.0:9808' is not a loopback address; the metrics name every VF, owner and socket of this host, "
   "so serving them beyond it needs 'allow_remote: true'"},
  {"MetricsHostName", kSystem + "metrics: {listen: \"localhost:9808\"}\n", 3, 19,
   "metrics.listen: 'localhost:9808' is not an address and port (e.g. \"127.0.0.1:9808\")"},
  {"MetricsNoPort", kSystem + "metrics: {listen: \"127.0.0.1\"}\n", 3, 19,
   "metrics.listen: '127.0.0.1' is not an address and port (e.g. \"127.0.0.1:9808\")"},
  {"MetricsPortTooBig", kSystem + "metrics: {listen: \"127.0.0.1:65536\"}\n", 3, 19,
   "metrics.listen: '127.0.0.1:65536' is not an address and port (e.g. \"127.0.0.1:9808\")"},
  {"MetricsIpv6", kSystem + "metrics: {listen: \"[::1]:9808\"}\n", 3, 19,
   "metrics.listen: '[::1]:9808': IPv6 is not served (the metrics endpoint listens on an IPv4 address); use an "
   "IPv4 address such as \"127.0.0.1:9808\""},
  {"MetricsUnknownKey", kSystem + "metrics: {listen: \"127.0.0.1:9808\", port: 1}\n", 3, 37,
   "metrics: unknown key 'port' (expected one of: listen, allow_remote)"},
  {"PoolNameNotAResourceName", kSimulated + kPf + kK8sVf + "kubernetes:\n  pools:\n    - {name: bad_name, vfs: [{pf: \"0000:3b:00.0\", indexes: [0]}]}\n",
   17, 14, "kubernetes.pools[0].name: 'bad_name' is not a resource name 'vendor.domain/name' (a DNS subdomain, '/', up to 63 "
   "letters, digits, '-', '_', '.')"},
  {"PoolVfExportedOverVfioUser", kSimulated + kPf + "        assign: {owner: k, socket: /run/x.sock}\nkubernetes:\n  pools:\n"
   "    - {name: a.com/x, vfs: [{pf: \"0000:3b:00.0\", indexes: [0]}]}\n",
   17, 60, "kubernetes.pools[0].vfs[0].indexes[0]: VF 0 of PF 0000:3b:00.0 is exported over vfio-user to 'k'; a pool's VFs go "
   "to pods whole ('export: none')"},
  {"PoolVfNotAssigned", kSimulated + kPf + kK8sVf + "kubernetes:\n  pools:\n    - {name: a.com/x, vfs: [{pf: \"0000:3b:00.0\", indexes: [1]}]}\n",
   17, 60, "kubernetes.pools[0].vfs[0].indexes[0]: VF 1 of PF 0000:3b:00.0 is not assigned (a pool's VFs are bound to "
   "vfio-pci: vfs[].assign with 'export: none')"},
  {"PoolVfInTwoPools", kSimulated + kPf + kK8sVf + "kubernetes:\n  pools:\n    - {name: a.com/x, vfs: [{pf: \"0000:3b:00.0\", indexes: [0]}]}\n"
   "    - {name: a.com/y, selector: {owner: k}}\n",
   18, 7, "kubernetes.pools: VF 0 of PF 0000:3b:00.0 is in pool 'a.com/x' and pool 'a.com/y' (a VF is in at most one pool)"},
  {"PoolWithoutMembers", kSimulated + kPf + kK8sVf + "kubernetes:\n  pools:\n    - {name: a.com/x}\n", 17, 7,
   "kubernetes.pools[0]: pool 'a.com/x' has no members (vfs, selector or virtio_devices)"},
  {"PoolUnknownVirtioDevice", kSimulated + kPf + kK8sVf + "kubernetes:\n  pools:\n    - {name: a.com/x, virtio_devices: [nope]}\n",
   17, 40, "kubernetes.pools[0].virtio_devices[0]: no virtio device 'nope' in virtio_devices"},
  {"DevicePluginDirRelative", kSimulated + kPf + kK8sVf + "kubernetes:\n  device_plugin_dir: relative\n", 16, 22,
   "kubernetes.device_plugin_dir: expected an absolute path, got 'relative'"},
};
// clang-format on

}  // namespace sriovd::config::bad_configs
