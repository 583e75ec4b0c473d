// The macvtap port of the VF-to-virtio bridge on a real veth pair, in
// network and mount namespaces of this test process's own (a sysfs of its
// own too: the port reads its character device's number there): frames
// both ways with the virtio-net header, queues steered and detached, the
// carrier followed, and the link - host state that outlives a process -
// made, owned, found after a crash and deleted.
#include <gtest/gtest.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/ports/macvtap.hpp"
#include "support/process.hpp"
#include "ports/wire_harness.hpp"

namespace sriovd::ports {
namespace {

using namespace std::chrono_literals;
using wire::frame;
using wire::seq_of;

constexpr const char* kInstance = "/var/lib/sriovd-test";

std::string read_line(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

bool link_exists(const std::string& name) { return ::if_nametoindex(name.c_str()) != 0; }

std::string svt_name() { return "svt" + std::to_string(::if_nametoindex("vf0")); }

class MacvtapTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    skip_reason = wire::enter_private_netns(true, 1500);
    if (!skip_reason.empty()) return;
    // Whether this kernel has macvtap at all (a module on most).
    auto r = test::run({"/sbin/ip", "link", "add", "link", "vf0", "name", "probe0", "type", "macvtap"});
    if (r.exit_code != 0) {
      skip_reason = "this kernel has no macvtap: " + r.output;
      return;
    }
    test::run({"/sbin/ip", "link", "del", "probe0"});
  }
  void SetUp() override {
    if (!skip_reason.empty()) GTEST_SKIP() << skip_reason;
    wire_fd = wire::open_wire();
    ASSERT_TRUE(wire_fd.valid());
  }

  // The next of the test's frames on queue q of the port, waiting on its fd
  // as the device does; -1 when none comes.
  static ssize_t receive(Macvtap& port, unsigned q, uint8_t* buf, size_t size, int tries = 100) {
    for (int i = 0; i < tries; ++i) {
      const ssize_t n = port.recv(q, buf, size);
      if (n > 12 && wire::is_test_frame(buf + 12, static_cast<size_t>(n - 12))) return n;
      if (n > 0) continue;
      pollfd p{port.fd(q), POLLIN, 0};
      ::poll(&p, 1, 20);
    }
    return -1;
  }
  void send_wire(const std::vector<uint8_t>& f) const {
    ASSERT_EQ(::send(wire_fd.get(), f.data(), f.size(), 0), static_cast<ssize_t>(f.size()));
  }

  static inline std::string skip_reason;
  UniqueFd wire_fd;
};

TEST_F(MacvtapTest, FramesBothWaysWithTheDeviceHeader) {
  Macvtap port("vf0", kInstance, "net0", 1);
  EXPECT_EQ(port.name(), svt_name());
  EXPECT_EQ(port.lower(), "vf0");
  std::vector<uint8_t> buf(65536);
  // Wire -> device: every frame in order, behind a 12-byte header with no
  // offload metadata (nothing asked for).
  for (uint32_t i = 0; i < 300; ++i) send_wire(frame(i, 60 + (i * 5) % 1400));
  for (uint32_t i = 0; i < 300; ++i) {
    const ssize_t n = receive(port, 0, buf.data(), buf.size());
    ASSERT_EQ(n, static_cast<ssize_t>(12 + 60 + (i * 5) % 1400)) << "frame " << i;
    EXPECT_EQ(buf[0], 0) << "flags";
    EXPECT_EQ(buf[1], 0) << "gso_type";
    EXPECT_EQ(seq_of(buf.data() + 12), i);
  }
  // Device -> wire: the header is taken off, the frame goes out as it is.
  for (uint32_t i = 0; i < 300; ++i) {
    uint8_t hdr[12] = {};
    const auto f = frame(1000 + i, 64 + i);
    iovec iov[2] = {{hdr, sizeof hdr}, {const_cast<uint8_t*>(f.data()), f.size()}};
    ASSERT_EQ(port.send(0, iov, 2), static_cast<ssize_t>(12 + f.size()));
    ssize_t n = -1;
    for (int t = 0; t < 100 && n < 0; ++t) {
      n = ::recv(wire_fd.get(), buf.data(), buf.size(), MSG_DONTWAIT);
      if (n < 0) std::this_thread::sleep_for(2ms);
    }
    ASSERT_EQ(n, static_cast<ssize_t>(f.size())) << "frame " << i;
    EXPECT_EQ(0, std::memcmp(buf.data(), f.data(), f.size()));
  }
}

// An IPv4/UDP frame of flow `flow` (its source port): what the kernel's
// flow hash, which picks a macvtap queue, looks at.
std::vector<uint8_t> udp_frame(uint16_t flow) {
  std::vector<uint8_t> f(14 + 20 + 8 + 32, 0);
  std::memset(f.data(), 0xff, 6);
  f[6] = 0x02;
  f[11] = 0x01;
  f[12] = 0x08;  // IPv4
  uint8_t* ip = f.data() + 14;
  ip[0] = 0x45;
  ip[3] = 20 + 8 + 32;
  ip[8] = 64;
  ip[9] = 17;  // UDP
  const uint8_t src[4] = {10, 0, 0, 1}, dst[4] = {10, 0, 0, 2};
  std::memcpy(ip + 12, src, 4);
  std::memcpy(ip + 16, dst, 4);
  uint8_t* udp = ip + 20;
  udp[0] = static_cast<uint8_t>(0x80U | (flow >> 8U));
  udp[1] = static_cast<uint8_t>(flow);
  udp[2] = 0x27;  // port 9999
  udp[3] = 0x0f;
  udp[5] = 8 + 32;
  return f;
}

bool is_udp_test_frame(const uint8_t* f, ssize_t len) {
  return len >= 14 + 28 && f[12] == 0x08 && f[13] == 0 && f[14 + 9] == 17 && f[14 + 22] == 0x27 && f[14 + 23] == 0x0f;
}

// With two queues the kernel spreads flows over both; with one active, the
// other is detached and gets nothing (the driver's MQ setting).
TEST_F(MacvtapTest, QueuesAreSteeredAndDetached) {
  Macvtap port("vf0", kInstance, "net0", 2);
  ASSERT_EQ(port.queues(), 2U);
  UniqueFd raw(::socket(AF_PACKET, SOCK_RAW | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(raw.valid());
  sockaddr_ll to{};
  to.sll_family = AF_PACKET;
  to.sll_ifindex = static_cast<int>(::if_nametoindex("wire0"));
  std::vector<uint8_t> buf(4096);
  auto spread = [&] {
    for (uint16_t flow = 0; flow < 64; ++flow) {
      const auto f = udp_frame(flow);
      EXPECT_EQ(::sendto(raw.get(), f.data(), f.size(), 0, reinterpret_cast<sockaddr*>(&to), sizeof to),
                static_cast<ssize_t>(f.size()));
    }
    std::array<unsigned, 2> got{};
    for (int round = 0; round < 50 && got[0] + got[1] < 64; ++round) {
      for (unsigned q = 0; q < 2; ++q)
        for (ssize_t n; (n = port.recv(q, buf.data(), buf.size())) > 0;)
          if (is_udp_test_frame(buf.data() + 12, n - 12)) ++got[q];
      std::this_thread::sleep_for(5ms);
    }
    return got;
  };
  const auto both = spread();
  EXPECT_EQ(both[0] + both[1], 64U);
  EXPECT_GT(both[0], 0U) << "64 flows, none on queue 0";
  EXPECT_GT(both[1], 0U) << "64 flows, none on queue 1";
  port.set_active_queues(1);
  const auto one = spread();
  EXPECT_EQ(one[0], 64U);
  EXPECT_EQ(one[1], 0U);
  port.set_active_queues(2);
  const auto again = spread();
  EXPECT_EQ(again[0] + again[1], 64U);
  EXPECT_GT(again[1], 0U);
}

TEST_F(MacvtapTest, CarrierFollowsTheLowerDevice) {
  Macvtap port("vf0", kInstance, "net0", 1);
  ASSERT_TRUE(test::wait_until([&] { return port.link_up(); }, 2s));
  ASSERT_EQ(test::run({"/sbin/ip", "link", "set", "wire0", "down"}).exit_code, 0);  // vf0 loses its carrier
  EXPECT_TRUE(test::wait_until([&] { return !port.link_up(); }, 2s));
  ASSERT_EQ(test::run({"/sbin/ip", "link", "set", "wire0", "up"}).exit_code, 0);
  EXPECT_TRUE(test::wait_until([&] { return port.link_up(); }, 2s));
}

// The link carries its owner; the port's end deletes it.
TEST_F(MacvtapTest, TheLinkIsOwnedAndGoesWithThePort) {
  const std::string name = svt_name();
  {
    Macvtap port("vf0", kInstance, "net0", 1);
    ASSERT_TRUE(link_exists(name));
    EXPECT_EQ(read_line("/sys/class/net/" + name + "/ifalias"), Macvtap::alias_of(kInstance, "net0"));
    EXPECT_EQ(read_line("/sys/class/net/" + name + "/address"), read_line("/sys/class/net/vf0/address"))
        << "passthru: the link is the VF's own address";
  }
  EXPECT_FALSE(link_exists(name));
}

// What a crashed daemon leaves: a link with its alias. Serving the device
// again replaces it; remove_left_over deletes only this instance's links
// of devices not kept.
TEST_F(MacvtapTest, ALinkLeftByACrashIsFoundByItsAlias) {
  auto leave = [](const std::string& name, const std::string& alias) {
    ASSERT_EQ(test::run({"/sbin/ip", "link", "add", "link", "vf0", "name", name, "type", "macvtap", "mode", "passthru"})
                  .exit_code,
              0);
    ASSERT_EQ(test::run({"/sbin/ip", "link", "set", name, "alias", alias}).exit_code, 0);
  };
  leave("crashed0", Macvtap::alias_of(kInstance, "net0"));
  {
    Macvtap port("vf0", kInstance, "net0", 1);
    EXPECT_FALSE(link_exists("crashed0"));
    EXPECT_TRUE(link_exists(port.name()));
  }
  leave("crashed1", Macvtap::alias_of(kInstance, "gone0"));
  EXPECT_TRUE(Macvtap::remove_left_over(kInstance, {"gone0"}).empty()) << "a kept device's link stays";
  EXPECT_TRUE(Macvtap::remove_left_over("/other/instance").empty()) << "another instance's link stays";
  EXPECT_TRUE(link_exists("crashed1"));
  const auto removed = Macvtap::remove_left_over(kInstance);
  ASSERT_EQ(removed.size(), 1U);
  EXPECT_NE(removed[0].find("crashed1"), std::string::npos) << removed[0];
  EXPECT_FALSE(link_exists("crashed1"));
}

// A macvtap of another sriovd, or any other macvlan on the lower device,
// is not taken over: the error names it, and nothing is left behind.
TEST_F(MacvtapTest, ALinkThatIsNotOursIsNamedAndLeftAlone) {
  ASSERT_EQ(
      test::run({"/sbin/ip", "link", "add", "link", "vf0", "name", "theirs0", "type", "macvtap", "mode", "passthru"})
          .exit_code,
      0);
  ASSERT_EQ(test::run({"/sbin/ip", "link", "set", "theirs0", "alias", "sriovd:/other/instance net9"}).exit_code, 0);
  try {
    Macvtap port("vf0", kInstance, "net0", 1);
    ADD_FAILURE() << "took the lower device of another sriovd";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("theirs0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("another sriovd"), std::string::npos) << e.what();
  }
  ASSERT_EQ(test::run({"/sbin/ip", "link", "set", "theirs0", "alias", ""}).exit_code, 0);
  try {
    Macvtap port("vf0", kInstance, "net0", 1);
    ADD_FAILURE() << "a passthru macvtap next to another";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("theirs0"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(link_exists("theirs0"));
  EXPECT_FALSE(link_exists(svt_name()));
  test::run({"/sbin/ip", "link", "del", "theirs0"});
}

TEST_F(MacvtapTest, AMissingLowerDeviceIsNamed) {
  try {
    Macvtap port("nosuch0", kInstance, "net0", 1);
    ADD_FAILURE() << "made a macvtap on nothing";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("nosuch0"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace sriovd::ports
