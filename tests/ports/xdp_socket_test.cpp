// The AF_XDP port of the VF-to-virtio bridge on a real veth pair (four
// queues each way, native XDP), in a network namespace of this test
// process's own: frames both ways in order across many ring laps, MQ
// steering (all of the netdev's RX queues reach the active ones), a crashed
// run's program found by its owner and removed, and the errors when XDP
// cannot attach. Needs root (CAP_SYS_ADMIN, CAP_BPF, CAP_NET_ADMIN).
#include <arpa/inet.h>
#include <bpf/libbpf.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <gtest/gtest.h>
#include <net/if.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <set>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/ports/xdp_socket.hpp"
#include "support/process.hpp"
#include "ports/wire_harness.hpp"

namespace sriovd::ports {
namespace {

constexpr unsigned kQueues = 4;
constexpr size_t kHdr = 12;

uint32_t attached_prog(const char* ifname) {
  uint32_t id = 0;
  (void)bpf_xdp_query_id(static_cast<int>(::if_nametoindex(ifname)), 0, &id);
  return id;
}

// An IPv4/UDP frame from wire0 (so that the veth's transmit hash spreads
// flows over its queues) carrying `seq`; `flow` picks the source port.
std::vector<uint8_t> udp_frame(uint32_t seq, uint16_t flow, size_t len = 64) {
  std::vector<uint8_t> f(len, 0);
  std::memset(f.data(), 0xff, 6);
  const uint8_t src[6] = {0x02, 0, 0, 0, 0, 1};
  std::memcpy(f.data() + 6, src, 6);
  f[12] = 0x08;
  f[13] = 0x00;
  uint8_t* ip = f.data() + 14;
  ip[0] = 0x45;
  const uint16_t tot = htons(static_cast<uint16_t>(len - 14));
  std::memcpy(ip + 2, &tot, 2);
  ip[8] = 64;
  ip[9] = 17;
  const uint32_t s = htonl(0x0a000001), d = htonl(0x0a000002);
  std::memcpy(ip + 12, &s, 4);
  std::memcpy(ip + 16, &d, 4);
  uint8_t* udp = ip + 20;
  const uint16_t sport = htons(static_cast<uint16_t>(1000 + flow)), dport = htons(9),
                 ulen = htons(static_cast<uint16_t>(len - 34));
  std::memcpy(udp, &sport, 2);
  std::memcpy(udp + 2, &dport, 2);
  std::memcpy(udp + 4, &ulen, 2);
  std::memcpy(udp + 8, &seq, 4);
  return f;
}
uint32_t udp_seq(const uint8_t* frame) {
  uint32_t s = 0;
  std::memcpy(&s, frame + 42, 4);
  return s;
}
bool is_udp_test_frame(const uint8_t* frame, size_t len) {
  return len >= 46 && frame[12] == 0x08 && frame[13] == 0x00 && frame[14 + 9] == 17;
}

class XdpSocketTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { skip_reason = wire::enter_private_netns(false, 1500, kQueues); }
  void SetUp() override {
    if (!skip_reason.empty()) GTEST_SKIP() << skip_reason;
    ASSERT_EQ(attached_prog("vf0"), 0U) << "a program from an earlier test is still on vf0";
    wire = wire::open_wire("wire0", ETH_P_ALL);
    ASSERT_TRUE(wire.valid());
  }
  void TearDown() override {
    if (skip_reason.empty()) (void)XdpSocket::remove_left_over("test", {});
  }

  // Receives on the active queues [0, n) until `want` test frames came or
  // 5 s passed, waiting on each queue's fd as the device does.
  std::vector<uint32_t> receive(XdpSocket& port, unsigned n, size_t want) {
    std::vector<uint32_t> seqs;
    std::vector<uint8_t> buf(4096);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (seqs.size() < want && std::chrono::steady_clock::now() < deadline) {
      bool any = false;
      for (unsigned q = 0; q < n; ++q) {
        for (;;) {
          const ssize_t got = port.recv(q, buf.data(), buf.size());
          if (got <= 0) break;
          any = true;
          for (size_t i = 0; i < kHdr; ++i) EXPECT_EQ(buf[i], 0) << "byte " << i << " of the device header";
          if (is_udp_test_frame(buf.data() + kHdr, static_cast<size_t>(got) - kHdr))
            seqs.push_back(udp_seq(buf.data() + kHdr));
        }
        port.rx_done(q);
      }
      if (!any) {
        std::vector<pollfd> p;
        for (unsigned q = 0; q < n; ++q) p.push_back({port.fd(q), POLLIN, 0});
        ::poll(p.data(), p.size(), 20);
      }
    }
    return seqs;
  }

  void send_flows(uint32_t count, uint16_t flows) {
    for (uint32_t i = 0; i < count; ++i) {
      const auto f = udp_frame(i, static_cast<uint16_t>(i % flows));
      ASSERT_EQ(::send(wire.get(), f.data(), f.size(), 0), static_cast<ssize_t>(f.size())) << std::strerror(errno);
    }
  }

  static inline std::string skip_reason;
  UniqueFd wire;
};

TEST_F(XdpSocketTest, WireToDeviceInOrderWithAZeroDeviceHeader) {
  XdpSocket port("vf0", 1, 1500, "test", "d0", 64);  // small rings: many laps
  EXPECT_NE(attached_prog("vf0"), 0U);
  EXPECT_EQ(port.mode(), XdpMode::copy) << "veth has no zero-copy AF_XDP";
  constexpr uint32_t kFrames = 1024;
  // In batches the rings can hold: the reader empties them between.
  std::vector<uint32_t> got;
  for (uint32_t base = 0; base < kFrames; base += 32) {
    for (uint32_t i = base; i < base + 32; ++i) {
      const auto f = udp_frame(i, 0);  // one flow: one queue, its order
      ASSERT_EQ(::send(wire.get(), f.data(), f.size(), 0), static_cast<ssize_t>(f.size()));
    }
    const auto part = receive(port, 1, 32);
    got.insert(got.end(), part.begin(), part.end());
    ASSERT_EQ(got.size(), base + 32) << "frames lost (a queue without a socket?)";
  }
  ASSERT_EQ(got.size(), kFrames);
  for (uint32_t i = 0; i < kFrames; ++i) ASSERT_EQ(got[i], i);
}

// The port's carrier is its netdev's (an AF_XDP socket takes no interface
// ioctl: asked through it, the link read as down for good, and a real
// virtio_net driver behind VDUSE kept its carrier off).
TEST_F(XdpSocketTest, CarrierFollowsTheNetdev) {
  XdpSocket port("vf0", 1, 1500, "test", "d0", 64);
  ASSERT_TRUE(test::wait_until([&] { return port.link_up(); }, std::chrono::seconds(2)));
  ASSERT_EQ(test::run({"/sbin/ip", "link", "set", "wire0", "down"}).exit_code, 0);  // vf0 loses its carrier
  EXPECT_TRUE(test::wait_until([&] { return !port.link_up(); }, std::chrono::seconds(2)));
  ASSERT_EQ(test::run({"/sbin/ip", "link", "set", "wire0", "up"}).exit_code, 0);
  EXPECT_TRUE(test::wait_until([&] { return port.link_up(); }, std::chrono::seconds(2)));
}

TEST_F(XdpSocketTest, DeviceToWireInOrderAcrossRingLaps) {
  XdpSocket port("vf0", 1, 1500, "test", "d0", 64);
  constexpr uint32_t kFrames = 2000;
  std::vector<uint32_t> seen;
  std::vector<uint8_t> buf(4096);
  uint32_t sent = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (seen.size() < kFrames && std::chrono::steady_clock::now() < deadline) {
    // A burst as a worker sends one: frames until no room, then flush.
    for (int b = 0; b < 48 && sent < kFrames; ++b) {
      std::vector<uint8_t> chain(kHdr, 0);
      const auto f = udp_frame(sent, 0, 60 + sent % 1400);
      chain.insert(chain.end(), f.begin(), f.end());
      // Header and frame in two segments, as a guest's chain often is.
      const iovec iov[2] = {{chain.data(), kHdr}, {chain.data() + kHdr, chain.size() - kHdr}};
      const ssize_t n = port.send(0, iov, 2);
      if (n < 0) {
        ASSERT_EQ(errno, EAGAIN);
        break;
      }
      ASSERT_EQ(static_cast<size_t>(n), f.size());
      ++sent;
    }
    port.flush(0);
    for (;;) {
      pollfd p{wire.get(), POLLIN, 0};
      if (::poll(&p, 1, seen.size() + 48 >= sent ? 5 : 0) <= 0) break;
      const ssize_t n = ::recv(wire.get(), buf.data(), buf.size(), MSG_DONTWAIT);
      if (n > 0 && is_udp_test_frame(buf.data(), static_cast<size_t>(n))) {
        const uint32_t seq = udp_seq(buf.data());
        ASSERT_EQ(static_cast<size_t>(n), 60 + seq % 1400) << "frame " << seq << " changed length";
        seen.push_back(seq);
      }
    }
  }
  ASSERT_EQ(seen.size(), kFrames);
  for (uint32_t i = 0; i < kFrames; ++i) ASSERT_EQ(seen[i], i);
}

// Copy mode transmits inside sendto(): a kernel that takes
// XDP_MAX_TX_SKB_BUDGET (6.17 on) sends the whole TX ring per call, an
// older one 32 frames, and flush() calls again until the ring is taken.
// Either way one flush sends a full ring's burst, in order.
TEST_F(XdpSocketTest, OneFlushSendsAFullRingsBurst) {
  constexpr uint32_t kRing = 64;
  XdpSocket port("vf0", 1, 1500, "test", "d0", kRing);
  utsname u{};
  ASSERT_EQ(::uname(&u), 0);
  unsigned major = 0, minor = 0;
  ASSERT_EQ(std::sscanf(u.release, "%u.%u", &major, &minor), 2) << u.release;
  if (major > 6 || (major == 6 && minor >= 17))
    EXPECT_EQ(port.tx_budget(), kRing) << "kernel " << u.release << " takes XDP_MAX_TX_SKB_BUDGET";
  else
    EXPECT_EQ(port.tx_budget(), 32U) << "kernel " << u.release;
  for (uint32_t i = 0; i < kRing; ++i) {
    std::vector<uint8_t> chain(kHdr, 0);
    const auto f = udp_frame(i, 0);
    chain.insert(chain.end(), f.begin(), f.end());
    const iovec iov{chain.data(), chain.size()};
    ASSERT_EQ(port.send(0, &iov, 1), static_cast<ssize_t>(f.size())) << "frame " << i << ": " << std::strerror(errno);
  }
  port.flush(0);
  std::vector<uint32_t> seen;
  std::vector<uint8_t> buf(4096);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (seen.size() < kRing && std::chrono::steady_clock::now() < deadline) {
    pollfd p{wire.get(), POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = ::recv(wire.get(), buf.data(), buf.size(), MSG_DONTWAIT);
    if (n > 0 && is_udp_test_frame(buf.data(), static_cast<size_t>(n))) seen.push_back(udp_seq(buf.data()));
  }
  ASSERT_EQ(seen.size(), kRing) << "one flush left frames in the TX ring";
  for (uint32_t i = 0; i < kRing; ++i) EXPECT_EQ(seen[i], i);
}

TEST_F(XdpSocketTest, AFrameTooLargeOrGsoIsRefusedNotSent) {
  XdpSocket port("vf0", 1, 1500, "test", "d0", 64);
  std::vector<uint8_t> chain(kHdr + 3000, 0);
  iovec iov{chain.data(), chain.size()};
  EXPECT_EQ(port.send(0, &iov, 1), -1);
  EXPECT_EQ(errno, EMSGSIZE);
  std::vector<uint8_t> gso(kHdr + 100, 0);
  gso[1] = 1;  // VIRTIO_NET_HDR_GSO_TCPV4: not negotiated over this port
  iov = {gso.data(), gso.size()};
  EXPECT_EQ(port.send(0, &iov, 1), -1);
  EXPECT_EQ(errno, EMSGSIZE);
}

TEST_F(XdpSocketTest, MqSteeringBringsEveryRxQueueToTheActiveOnes) {
  XdpSocket port("vf0", kQueues, 1500, "test", "d0", 512);
  constexpr uint32_t kFrames = 400;
  for (const unsigned active : {1U, 2U, 4U}) {
    port.set_active_queues(active);
    std::vector<uint64_t> before(kQueues);
    for (unsigned q = 0; q < kQueues; ++q) before[q] = port.received_on(q);
    send_flows(kFrames, 64);
    auto got = receive(port, active, kFrames);
    EXPECT_EQ(got.size(), kFrames) << "with " << active << " active queue(s)";
    const std::set<uint32_t> unique(got.begin(), got.end());
    EXPECT_EQ(unique.size(), kFrames);
    // The flows spread over the netdev's queues, and every queue's frames
    // came out through the active ones.
    unsigned queues_used = 0;
    for (unsigned q = 0; q < kQueues; ++q) queues_used += port.received_on(q) > before[q] ? 1U : 0U;
    EXPECT_GE(queues_used, 2U) << "the veth's hash put every flow on one queue: the test proves nothing";
    // Nothing for an inactive queue's own reader.
    std::vector<uint8_t> buf(4096);
    for (unsigned q = active; q < kQueues; ++q) EXPECT_LE(port.recv(q, buf.data(), buf.size()), 0);
  }
}

TEST_F(XdpSocketTest, ACrashedRunsProgramIsFoundByItsOwnerAndRemoved) {
  // A daemon that dies (SIGKILL, _exit) leaves its program attached.
  auto crash = [](const char* instance) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      try {
        auto* leaked = new XdpSocket("vf0", 2, 1500, instance, "d0", 64);
        (void)leaked;
      } catch (const std::exception& ex) {
        std::fprintf(stderr, "the crashing child could not start: %s\n", ex.what());
        ::_exit(2);
      }
      ::_exit(0);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
  };
  ASSERT_TRUE(crash("test"));
  ASSERT_NE(attached_prog("vf0"), 0U);
  // Another instance's program is not ours to remove, nor to replace.
  EXPECT_TRUE(XdpSocket::remove_left_over("other").empty());
  try {
    XdpSocket port("vf0", 1, 1500, "other", "d0", 64);
    ADD_FAILURE() << "attached over another instance's program";
  } catch (const std::exception& ex) {
    EXPECT_NE(std::string(ex.what()).find("another sriovd instance (sriovd:test d0"), std::string::npos) << ex.what();
  }
  // At start: removed by owner, named.
  const auto removed = XdpSocket::remove_left_over("test");
  ASSERT_EQ(removed.size(), 1U);
  EXPECT_EQ(removed[0], "vf0 (sriovd:test d0)");
  EXPECT_EQ(attached_prog("vf0"), 0U);
  // When the device is served again: the leftover goes, the port works.
  ASSERT_TRUE(crash("test"));
  const uint32_t leftover = attached_prog("vf0");
  {
    XdpSocket port("vf0", 1, 1500, "test", "d0", 64);
    EXPECT_NE(attached_prog("vf0"), leftover);
    send_flows(10, 1);
    EXPECT_EQ(receive(port, 1, 10).size(), 10U);
  }
  EXPECT_EQ(attached_prog("vf0"), 0U) << "the port's destructor left its program";
}

// A netdev whose driver has no native XDP (igbvf; here a macvlan) gets
// the program as generic XDP, says so, and loses it with the socket.
TEST_F(XdpSocketTest, ADriverWithoutNativeXdpGetsGenericXdp) {
  ASSERT_EQ(test::run({"/sbin/ip", "link", "add", "link", "vf0", "name", "mv0", "type", "macvlan", "mode", "bridge"})
                .exit_code,
            0);
  ASSERT_EQ(test::run({"/sbin/ip", "link", "set", "mv0", "up"}).exit_code, 0);
  {
    std::unique_ptr<XdpSocket> port;
    try {
      port = std::make_unique<XdpSocket>("mv0", 1, 1500, "test", "d0", 64);
    } catch (const std::exception& ex) {
      ADD_FAILURE() << "no fallback to generic XDP: " << ex.what();
    }
    if (port) {
      EXPECT_TRUE(port->generic());
      EXPECT_NE(attached_prog("mv0"), 0U);
    }
  }
  EXPECT_EQ(attached_prog("mv0"), 0U);
  (void)test::run({"/sbin/ip", "link", "del", "mv0"});
}

TEST_F(XdpSocketTest, AttachFailuresSayWhyAndLeaveNothing) {
  // The kernel refuses XDP on a veth whose peer's MTU exceeds a page.
  ASSERT_EQ(test::run({"/sbin/ip", "link", "set", "wire0", "mtu", "9000"}).exit_code, 0);
  try {
    XdpSocket port("vf0", 1, 1500, "test", "d0", 64);
    ADD_FAILURE() << "attached with the peer's MTU at 9000";
  } catch (const std::exception& ex) {
    EXPECT_NE(std::string(ex.what()).find("attaching the XDP program to vf0 failed"), std::string::npos) << ex.what();
  }
  (void)test::run({"/sbin/ip", "link", "set", "wire0", "mtu", "1500"});
  EXPECT_EQ(attached_prog("vf0"), 0U);
  try {
    XdpSocket port("vf0", kQueues + 1, 1500, "test", "d0", 64);
    ADD_FAILURE() << "bound more queues than the netdev has";
  } catch (const std::exception& ex) {
    EXPECT_NE(std::string(ex.what()).find("the netdev has 4"), std::string::npos) << ex.what();
  }
  EXPECT_EQ(attached_prog("vf0"), 0U);
  try {
    XdpSocket port("no-such-netdev", 1, 1500, "test", "d0", 64);
    ADD_FAILURE();
  } catch (const std::exception& ex) {
    EXPECT_NE(std::string(ex.what()).find("no-such-netdev"), std::string::npos) << ex.what();
  }
}

}  // namespace
}  // namespace sriovd::ports
