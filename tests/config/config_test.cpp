// Valid configurations: the shipped files, defaults, and the YAML round trip.
#include <gtest/gtest.h>

#include "sriovd/config/loader.hpp"
#include "support/temp_dir.hpp"

namespace sriovd::config {
namespace {

const std::string kDemo = std::string(SRIOVD_SOURCE_DIR) + "/config/demo.yaml";
const std::string kExample = std::string(SRIOVD_SOURCE_DIR) + "/config/sriovd.yaml";

TEST(ShippedConfig, DemoDescribesTheSimulatedHost) {
  const Config cfg = load(kDemo);
  EXPECT_EQ(cfg.host, HostMode::simulated);
  EXPECT_EQ(cfg.control.socket, "/run/sriovd/control.sock");
  EXPECT_EQ(cfg.state_dir, "/var/lib/sriovd");
  ASSERT_EQ(cfg.simulated_pfs.size(), 1U);
  EXPECT_EQ(cfg.simulated_pfs[0].address.to_string(), "0000:3b:00.0");
  EXPECT_EQ(cfg.simulated_pfs[0].vendor_id, 0x8086);
  EXPECT_EQ(cfg.simulated_pfs[0].device_id, 0x1572);
  ASSERT_EQ(cfg.physical_functions.size(), 1U);
  const PfConfig& pf = cfg.physical_functions[0];
  EXPECT_EQ(pf.num_vfs, 5);
  EXPECT_EQ(pf.ref.netdev, "simpf0");  // resolved from the simulated PF
  // Four VFs configured, and VF 4 added for the device bridged to it: its
  // MAC is the device's (a bridged guest speaks with its VF's MAC).
  ASSERT_EQ(pf.vfs.size(), 5U);
  EXPECT_EQ(pf.vfs[4].index, 4);
  EXPECT_EQ(pf.vfs[4].mac, cfg.virtio_devices[1].mac);
  EXPECT_EQ(pf.vfs[4].mac_from_device, "vnet-vf4");
  ASSERT_TRUE(pf.vfs[0].assign.has_value());
  EXPECT_EQ(pf.vfs[0].assign->export_kind, ExportKind::vfio_user);
  EXPECT_EQ(pf.vfs[0].assign->msix_policy, MsixPolicy::adaptive);
  EXPECT_EQ(pf.vfs[1].assign->msix_policy, MsixPolicy::direct);
  EXPECT_FALSE(pf.vfs[2].assign.has_value());
  EXPECT_EQ(pf.vfs[3].assign->msix_policy, MsixPolicy::relay);
  ASSERT_EQ(cfg.virtio_devices.size(), 3U);
  EXPECT_EQ(cfg.virtio_devices[0].backend_kind, BackendKind::vf);
  EXPECT_EQ(cfg.virtio_devices[0].vf.vf, 2);
  EXPECT_EQ(cfg.virtio_devices[0].mac, pf.vfs[2].mac) << "the device takes its VF's MAC";
  EXPECT_EQ(cfg.virtio_devices[0].vf.via, VfAttach::af_packet);
  EXPECT_EQ(cfg.virtio_devices[0].transport, Transport::vfio_user);
  // Two queue pairs over vfio-user on a VF: through a macvtap.
  EXPECT_EQ(cfg.virtio_devices[1].vf.vf, 4);
  EXPECT_EQ(cfg.virtio_devices[1].vf.via, VfAttach::macvtap);
  EXPECT_EQ(cfg.virtio_devices[1].transport, Transport::vfio_user);
  EXPECT_EQ(cfg.virtio_devices[1].queue_pairs, 2);
  EXPECT_EQ(cfg.virtio_devices[2].transport, Transport::vhost_user);
  EXPECT_EQ(cfg.virtio_devices[2].packed, PackedRing::on);
  EXPECT_EQ(cfg.virtio_devices[2].queue_pairs, 2);
}

TEST(ShippedConfig, ExampleDescribesARealHost) {
  const Config cfg = load(kExample);
  EXPECT_EQ(cfg.host, HostMode::system);
  ASSERT_EQ(cfg.physical_functions.size(), 2U);
  EXPECT_EQ(cfg.physical_functions[0].ref.netdev, "enp59s0f0");
  EXPECT_FALSE(cfg.physical_functions[0].ref.address.has_value());
  EXPECT_EQ(cfg.physical_functions[1].ref.address->to_string(), "0000:5e:00.1");
  const VfConfig& vf0 = cfg.physical_functions[0].vfs[0];
  EXPECT_EQ(vf0.vlan, 100);
  EXPECT_EQ(vf0.spoofchk, true);
  EXPECT_EQ(vf0.link_state, LinkState::automatic);
  EXPECT_EQ(cfg.physical_functions[0].vfs[1].assign->export_kind, ExportKind::none);
  EXPECT_TRUE(cfg.physical_functions[0].vfs[1].assign->socket.empty());
  // Settings left out of the file stay unset: they are not touched on the host.
  EXPECT_FALSE(cfg.physical_functions[0].vfs[2].vlan.has_value());
  EXPECT_FALSE(cfg.physical_functions[0].vfs[2].spoofchk.has_value());
  EXPECT_EQ(cfg.virtio_devices[0].vf.pf.netdev, "enp59s0f0");
  EXPECT_TRUE(cfg.virtio_devices[1].tap.offloads.tso6);
  EXPECT_FALSE(cfg.virtio_devices[1].tap.offloads.ufo);
}

// Emitting a config and reading it back gives the same config; emitting that
// again gives the same text.
class RoundTrip : public ::testing::TestWithParam<std::string> {};

TEST_P(RoundTrip, EmitAndReloadIsAFixpoint) {
  const Config first = load(GetParam());
  const std::string yaml = to_yaml(first);
  const Config second = parse(yaml, "emitted.yaml");
  EXPECT_EQ(to_yaml(second), yaml);
  EXPECT_EQ(second.host, first.host);
  ASSERT_EQ(second.physical_functions.size(), first.physical_functions.size());
  for (size_t i = 0; i < first.physical_functions.size(); ++i) {
    EXPECT_EQ(second.physical_functions[i].ref, first.physical_functions[i].ref);
    EXPECT_EQ(second.physical_functions[i].vfs.size(), first.physical_functions[i].vfs.size());
  }
  ASSERT_EQ(second.virtio_devices.size(), first.virtio_devices.size());
  for (size_t i = 0; i < first.virtio_devices.size(); ++i) {
    EXPECT_EQ(second.virtio_devices[i].tap, first.virtio_devices[i].tap);
    EXPECT_EQ(second.virtio_devices[i].vf, first.virtio_devices[i].vf);
    EXPECT_EQ(second.virtio_devices[i].packed, first.virtio_devices[i].packed);
  }
}

INSTANTIATE_TEST_SUITE_P(ShippedConfigs, RoundTrip, ::testing::Values(kDemo, kExample));

TEST(Defaults, MinimalSystemConfig) {
  const Config cfg = parse("version: 1\nhost: system\n", "min.yaml");
  EXPECT_EQ(cfg.control.socket, "/run/sriovd/control.sock");
  EXPECT_EQ(cfg.state_dir, "/var/lib/sriovd");
  EXPECT_EQ(cfg.log_level, "info");
  EXPECT_EQ(cfg.interrupts.relay_threads, 1);
  EXPECT_FALSE(cfg.interrupts.busy_poll);
  EXPECT_EQ(cfg.control.poll_us, 0U);
  EXPECT_EQ(cfg.control.session_threads, 0U);
  EXPECT_TRUE(cfg.physical_functions.empty());
}

TEST(Control, SessionThreadsAreReadAndEmitted) {
  const Config cfg = parse("version: 1\nhost: system\ncontrol: {session_threads: 3}\n", "s.yaml");
  EXPECT_EQ(cfg.control.session_threads, 3U);
  EXPECT_EQ(parse(to_yaml(cfg), "emitted.yaml").control.session_threads, 3U);
}

TEST(Control, PollWindowIsReadAndEmitted) {
  const Config cfg = parse("version: 1\nhost: system\ncontrol: {poll_us: 50}\n", "p.yaml");
  EXPECT_EQ(cfg.control.poll_us, 50U);
  EXPECT_EQ(parse(to_yaml(cfg), "emitted.yaml").control.poll_us, 50U);
  EXPECT_EQ(parse("version: 1\nhost: system\ncontrol: {poll_us: 1000}\n", "p.yaml").control.poll_us, 1000U);
}

TEST(Metrics, OffByDefaultLoopbackOrAskedForRemote) {
  EXPECT_TRUE(parse("version: 1\nhost: system\n", "m.yaml").metrics.listen.empty());
  const Config v4 = parse("version: 1\nhost: system\nmetrics: {listen: \"127.0.0.1:9808\"}\n", "m.yaml");
  EXPECT_EQ(v4.metrics.listen, "127.0.0.1:9808");
  EXPECT_FALSE(v4.metrics.allow_remote);
  EXPECT_EQ(parse("version: 1\nhost: system\nmetrics: {listen: \"127.1.2.3:9100\"}\n", "m.yaml").metrics.listen,
            "127.1.2.3:9100");
  const Config remote =
      parse("version: 1\nhost: system\nmetrics: {listen: \"0.0.0.0:9808\", allow_remote: true}\n", "m.yaml");
  EXPECT_TRUE(remote.metrics.allow_remote);
  EXPECT_EQ(parse(to_yaml(remote), "emitted.yaml").metrics, remote.metrics);
}

TEST(Defaults, VirtioDeviceDefaults) {
  const Config cfg = parse(R"(version: 1
host: system
virtio_devices:
  - name: n0
    type: net
    transport: vhost-user
    socket: /run/n0.sock
    backend: {type: tap, name: tap0}
)",
                           "v.yaml");
  const VirtioDevice& d = cfg.virtio_devices.at(0);
  EXPECT_EQ(d.queue_pairs, 1);
  EXPECT_EQ(d.queue_size, 256);
  EXPECT_EQ(d.packed, PackedRing::automatic);
  EXPECT_EQ(d.mtu, 1500);
  EXPECT_TRUE(d.tap.offloads.csum);
  EXPECT_TRUE(d.tap.offloads.tso4);
  EXPECT_FALSE(d.tap.offloads.ufo);
}

// transport: vduse - no socket, a bind (netdev by default), emitted and
// read back the same.
TEST(Values, VduseDeviceIsReadAndEmitted) {
  const Config cfg = parse(R"(version: 1
host: system
virtio_devices:
  - {name: v0, type: net, transport: vduse, backend: {type: tap, name: tap0}}
  - {name: v1, type: net, transport: vduse, bind: vhost-vdpa, backend: {type: tap, name: tap1}}
)",
                           "v.yaml");
  ASSERT_EQ(cfg.virtio_devices.size(), 2U);
  EXPECT_EQ(cfg.virtio_devices[0].transport, Transport::vduse);
  EXPECT_EQ(cfg.virtio_devices[0].bind, VduseBind::netdev);
  EXPECT_TRUE(cfg.virtio_devices[0].socket.empty());
  EXPECT_EQ(cfg.virtio_devices[1].bind, VduseBind::vhost_vdpa);
  const Config again = parse(to_yaml(cfg), "emitted.yaml");
  ASSERT_EQ(again.virtio_devices.size(), 2U);
  for (size_t i = 0; i < 2; ++i) EXPECT_TRUE(again.virtio_devices[i].same_settings(cfg.virtio_devices[i]));
}

TEST(Values, HexAndPackedNonPowerOfTwo) {
  const Config cfg = parse(R"(version: 1
host: system
virtio_devices:
  - name: n0
    type: net
    transport: vfio-user
    socket: /run/n0.sock
    queue_size: 1000
    packed: on
    backend: {type: tap, name: tap0, offloads: []}
)",
                           "v.yaml");
  EXPECT_EQ(cfg.virtio_devices[0].queue_size, 1000);
  EXPECT_FALSE(cfg.virtio_devices[0].tap.offloads.csum);
}

TEST(Values, ControlAllowListAndGroup) {
  const Config cfg = parse(R"(version: 1
host: system
control:
  socket: /tmp/x/control.sock
  group: root
  allowed_uids: [0, 1000]
)",
                           "c.yaml");
  EXPECT_EQ(cfg.control.gid, 0U);
  EXPECT_EQ(cfg.control.allowed_uids, (std::vector<uid_t>{0, 1000}));
}

TEST(Files, UnreadableFileIsOneDiagnosticWithoutLine) {
  try {
    load("/nonexistent/sriovd.yaml");
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1U);
    EXPECT_EQ(e.diagnostics()[0].line, 0);
    EXPECT_EQ(e.diagnostics()[0].to_string(), "/nonexistent/sriovd.yaml: cannot read: No such file or directory");
  }
}

TEST(Files, AllErrorsAreReportedInFileOrder) {
  test::TempDir dir;
  const std::string path = dir.write("bad.yaml", R"(version: 1
host: system
log_level: loud
interrupts:
  relay_threads: 0
physical_functions:
  - address: "0000:03:00.0"
    num_vfs: 2
    vfs:
      - index: 5
)");
  try {
    load(path);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    ASSERT_EQ(e.diagnostics().size(), 3U);
    EXPECT_EQ(e.diagnostics()[0].line, 3);
    EXPECT_EQ(e.diagnostics()[1].line, 5);
    EXPECT_EQ(e.diagnostics()[2].line, 10);
    EXPECT_EQ(e.diagnostics()[2].file, path);
  }
}

}  // namespace
}  // namespace sriovd::config
