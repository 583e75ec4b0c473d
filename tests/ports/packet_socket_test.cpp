// The AF_PACKET port of the VF-to-virtio bridge on a real veth pair, in a
// network namespace of this test process's own: frames in both directions
// through each way of moving them (TPACKET_V3 blocks, TPACKET_V2 frames,
// a system call per frame), in order, with the virtio-net header where
// the device expects it, across many ring blocks and slots.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/ports/packet_socket.hpp"
#include "support/process.hpp"
#include "ports/wire_harness.hpp"

namespace sriovd::ports {
namespace {

using wire::frame;
using wire::kEthertype;
using wire::seq_of;

class PacketSocketTest : public ::testing::TestWithParam<PacketRing> {
 protected:
  static void SetUpTestSuite() { skip_reason = wire::enter_private_netns(false); }
  void SetUp() override {
    if (!skip_reason.empty()) GTEST_SKIP() << skip_reason;
    wire = wire::open_wire();
    ASSERT_TRUE(wire.valid());
    port = std::make_unique<PacketSocket>("vf0", 1, GetParam(), 1500);
  }

  // The next of the test's frames the port receives (anything else the
  // kernel sends on the link is passed over), waiting on its fd as the
  // device does.
  ssize_t receive(uint8_t* buf, size_t size) {
    for (int tries = 0; tries < 200; ++tries) {
      const ssize_t n = port->recv(0, buf, size);
      if (n >= 12 + 14 && buf[12 + 12] == (kEthertype >> 8U) && buf[12 + 13] == (kEthertype & 0xffU)) return n;
      if (n > 0) continue;
      pollfd p{port->fd(0), POLLIN, 0};
      ::poll(&p, 1, 20);
    }
    return -1;
  }

  static inline std::string skip_reason;
  UniqueFd wire;
  std::unique_ptr<PacketSocket> port;
};

TEST_P(PacketSocketTest, WireToDeviceInOrderWithTheDeviceHeader) {
  constexpr uint32_t kFrames = 1500;  // many v3 blocks, most of the v2 slots
  constexpr uint32_t kBurst = 100;    // what a plain socket's buffer holds
  std::vector<uint8_t> buf(65536);
  for (uint32_t i = 0; i < kFrames; ++i) {
    if (i % kBurst == 0) {
      for (uint32_t k = i; k < i + kBurst; ++k) {
        const auto f = frame(k, 60 + (k % 1400));
        ASSERT_EQ(::send(wire.get(), f.data(), f.size(), 0), static_cast<ssize_t>(f.size()));
      }
    }
    const ssize_t n = receive(buf.data(), buf.size());
    ASSERT_GT(n, 12) << "frame " << i;
    const auto want = frame(i, 60 + (i % 1400));
    ASSERT_EQ(static_cast<size_t>(n), 12 + want.size()) << "frame " << i;
    EXPECT_EQ(buf[10], 0);  // num_buffers is the device's to fill
    EXPECT_EQ(buf[11], 0);
    ASSERT_EQ(seq_of(buf.data() + 12), i);
    ASSERT_EQ(std::memcmp(buf.data() + 12, want.data(), want.size()), 0) << "frame " << i;
  }
  EXPECT_LT(port->recv(0, buf.data(), buf.size()), 0);
  EXPECT_EQ(errno, EAGAIN);
}

// A frame larger than the ring's slots (the port is sized for MTU 1500;
// GRO or a local TSO sender make such frames) arrives whole and in its
// turn: v3 blocks hold it, v2 reads it from the socket's queue.
TEST_P(PacketSocketTest, FrameLargerThanASlotArrivesWholeInOrder) {
  std::vector<uint8_t> buf(65536);
  const size_t sizes[] = {100, 8000, 200, 9000, 60};
  for (uint32_t i = 0; i < 5; ++i) {
    const auto f = frame(i, sizes[i]);
    ASSERT_EQ(::send(wire.get(), f.data(), f.size(), 0), static_cast<ssize_t>(f.size()));
  }
  for (uint32_t i = 0; i < 5; ++i) {
    const ssize_t n = receive(buf.data(), buf.size());
    ASSERT_EQ(n, static_cast<ssize_t>(12 + sizes[i])) << "frame " << i;
    EXPECT_EQ(seq_of(buf.data() + 12), i);
    const auto want = frame(i, sizes[i]);
    EXPECT_EQ(std::memcmp(buf.data() + 12, want.data(), want.size()), 0) << "frame " << i;
  }
}

TEST_P(PacketSocketTest, DeviceToWireInOrderAcrossTheRing) {
  constexpr uint32_t kFrames = 2000;  // the TX ring wraps several times
  ::setsockopt(wire.get(), SOL_SOCKET, SO_RCVBUF, &kFrames, sizeof kFrames);
  const int big = 16 << 20;
  ::setsockopt(wire.get(), SOL_SOCKET, SO_RCVBUFFORCE, &big, sizeof big);
  std::vector<uint8_t> buf(2048);
  uint32_t received = 0;
  auto drain = [&] {
    for (;;) {
      const ssize_t n = ::recv(wire.get(), buf.data(), buf.size(), MSG_DONTWAIT);
      if (n <= 0) return;
      ASSERT_EQ(seq_of(buf.data()), received) << "out of order or lost";
      const auto want = frame(received, 60 + (received % 1400));
      ASSERT_EQ(static_cast<size_t>(n), want.size());
      ASSERT_EQ(std::memcmp(buf.data(), want.data(), want.size()), 0);
      ++received;
    }
  };
  uint8_t header[12] = {};
  for (uint32_t i = 0; i < kFrames; ++i) {
    auto f = frame(i, 60 + (i % 1400));
    // The guest's chain: the 12-byte header split from the frame, the
    // frame itself in two pieces.
    iovec iov[3] = {{header, 12}, {f.data(), 20}, {f.data() + 20, f.size() - 20}};
    ASSERT_EQ(port->send(0, iov, 3), static_cast<ssize_t>(f.size())) << "frame " << i << ": " << std::strerror(errno);
    if (i % 64 == 63) {
      port->flush(0);
      drain();
    }
  }
  port->flush(0);
  for (int t = 0; t < 100 && received < kFrames; ++t) {
    drain();
    ::usleep(10000);
  }
  EXPECT_EQ(received, kFrames);
}

// Issue 25 item 10: a guest sending into a VF netdev that is down (before
// it is brought up, or when its link goes) must neither fill the TX ring
// for good (every flush refused: the queue stalled even after the netdev
// came up) nor leave the socket's ENETDOWN pending (epoll reports it until
// it is taken: the worker woke without end).
TEST_P(PacketSocketTest, ANetdevThatIsDownDropsFramesAndNeverStallsTheQueue) {
  auto ip = [](const char* updown) { return test::run({"/sbin/ip", "link", "set", "vf0", updown}).exit_code; };
  ASSERT_EQ(ip("down"), 0);
  // The pending error, reported as EPOLLERR whatever is asked for.
  pollfd p{port->fd(0), 0, 0};
  ASSERT_EQ(::poll(&p, 1, 0), 1);
  EXPECT_TRUE(p.revents & POLLERR);
  EXPECT_EQ(port->take_error(0), ENETDOWN);
  p.revents = 0;
  EXPECT_EQ(::poll(&p, 1, 0), 0) << "the error stays after it was taken";
  uint8_t header[12] = {};
  // Far more than the TX ring holds, flushed as the device does.
  for (uint32_t i = 0; i < 3000; ++i) {
    auto f = frame(i, 100);
    iovec iov[2] = {{header, 12}, {f.data(), f.size()}};
    const ssize_t n = port->send(0, iov, 2);
    ASSERT_TRUE(n == static_cast<ssize_t>(f.size()) || (n < 0 && errno != EAGAIN))
        << "frame " << i << ": the queue is full while its netdev is down: " << std::strerror(errno);
    if (i % 32 == 31) port->flush(0);
  }
  port->flush(0);
  ASSERT_EQ(ip("up"), 0);
  (void)port->take_error(0);
  // Up again: frames go out.
  std::vector<uint8_t> buf(2048);
  timeval tv{2, 0};
  ::setsockopt(wire.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  bool seen = false;
  for (uint32_t i = 100000; i < 100050 && !seen; ++i) {
    auto f = frame(i, 100);
    iovec iov[2] = {{header, 12}, {f.data(), f.size()}};
    ASSERT_EQ(port->send(0, iov, 2), static_cast<ssize_t>(f.size())) << std::strerror(errno);
    port->flush(0);
    pollfd w{wire.get(), POLLIN, 0};
    while (::poll(&w, 1, 50) == 1) {
      const ssize_t n = ::recv(wire.get(), buf.data(), buf.size(), MSG_DONTWAIT);
      if (n > 0 && seq_of(buf.data()) >= 100000) seen = true;
      if (n <= 0) break;
    }
  }
  EXPECT_TRUE(seen) << "nothing reached the wire after the netdev came up";
}

// With rings, a frame larger than a TX slot (a TSO segment, or here a
// 9000-byte frame on a port sized for MTU 1500) goes around the ring, after
// what the ring holds: the wire sees every frame, in order.
class PacketRingTest : public PacketSocketTest {};

TEST_P(PacketRingTest, FrameLargerThanATxSlotGoesOutInItsTurn) {
  const size_t sizes[] = {100, 9000, 200, 8000, 60};
  uint8_t header[12] = {};
  for (uint32_t i = 0; i < 5; ++i) {
    auto f = frame(i, sizes[i]);
    iovec iov[2] = {{header, 12}, {f.data(), f.size()}};
    ASSERT_EQ(port->send(0, iov, 2), static_cast<ssize_t>(f.size())) << "frame " << i << ": " << std::strerror(errno);
  }
  port->flush(0);
  std::vector<uint8_t> buf(16384);
  timeval tv{2, 0};
  ::setsockopt(wire.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  for (uint32_t i = 0; i < 5; ++i) {
    const ssize_t n = ::recv(wire.get(), buf.data(), buf.size(), 0);
    ASSERT_EQ(n, static_cast<ssize_t>(sizes[i])) << "frame " << i;
    EXPECT_EQ(seq_of(buf.data()), i);
  }
}

INSTANTIATE_TEST_SUITE_P(Rings, PacketSocketTest, ::testing::Values(PacketRing::v3, PacketRing::v2, PacketRing::off),
                         [](const auto& param_info) { return std::string(to_string(param_info.param)); });
INSTANTIATE_TEST_SUITE_P(Rings, PacketRingTest, ::testing::Values(PacketRing::v3, PacketRing::v2),
                         [](const auto& param_info) { return std::string(to_string(param_info.param)); });

}  // namespace
}  // namespace sriovd::ports
