// MQ steering over AF_XDP, end to end: a virtio-net-pci device (two queue
// pairs) over vfio-user whose port is the AF_XDP port on a real veth with
// four queues each way, in a network namespace of the test's own; the
// user-space guest driver negotiates MQ and sets the pairs it uses through
// the control queue (VQ_PAIRS_SET). Frames of many flows from the wire,
// spread by the veth over its four queues, all reach the driver, with one
// pair and with two. Needs root (a network namespace, XDP).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <sys/socket.h>

#include <cstring>
#include <set>
#include <thread>

#include "sriovd/guest/vfio_user_client.hpp"
#include "sriovd/guest/virtio_net_driver.hpp"
#include "sriovd/vfio_user/server.hpp"
#include "sriovd/vfio_user/virtio_pci.hpp"
#include "sriovd/ports/xdp_socket.hpp"
#include "sriovd/virtio/net.hpp"
#include "support/temp_dir.hpp"
#include "ports/wire_harness.hpp"

namespace sriovd::vfio_user {
namespace {

// An IPv4/UDP frame whose source port is `flow` (what the veth's transmit
// hash spreads over its queues) and whose payload starts with `seq`.
std::vector<uint8_t> udp_frame(uint32_t seq, uint16_t flow) {
  std::vector<uint8_t> f(64, 0);
  std::memset(f.data(), 0xff, 6);
  f[6] = 0x02;
  f[11] = 1;
  f[12] = 0x08;
  uint8_t* ip = f.data() + 14;
  ip[0] = 0x45;
  ip[3] = 50;
  ip[8] = 64;
  ip[9] = 17;
  const uint16_t sport = htons(static_cast<uint16_t>(2000 + flow));
  std::memcpy(ip + 20, &sport, 2);
  std::memcpy(ip + 28, &seq, 4);
  return f;
}

TEST(XdpMq, EveryRxQueueOfTheNetdevReachesThePairsTheDriverSet) {
  if (const std::string why = ports::wire::enter_private_netns(false, 1500, 4); !why.empty()) GTEST_SKIP() << why;
  test::TempDir dir;
  const std::string socket = dir.file("xmq.sock");
  irq::Engine engine{irq::EngineOptions{}};
  auto owned = std::make_unique<ports::XdpSocket>("vf0", 2, 1500, dir.path(), "xmq", 512);
  ports::XdpSocket& port = *owned;
  ASSERT_EQ(port.sockets(), 4U) << "a socket per RX queue of the netdev";
  virtio::NetConfig nc;
  nc.name = "xmq";
  nc.queue_pairs = 2;
  nc.offloads = false;
  nc.control_queue = true;
  virtio::NetDevice net(nc, engine, std::move(owned));
  VirtioPci pci(net, engine, "xmq");
  asio::io_context io;
  auto work = asio::make_work_guard(io);
  Server server(io, socket, pci);
  std::thread thread([&] { io.run(); });

  UniqueFd tx(::socket(AF_PACKET, SOCK_RAW | SOCK_CLOEXEC, 0));
  sockaddr_ll to{};
  to.sll_family = AF_PACKET;
  to.sll_ifindex = static_cast<int>(::if_nametoindex("wire0"));
  to.sll_halen = 6;
  ASSERT_TRUE(tx.valid());
  uint32_t seq = 0;
  {
    guest::VfioUserClient c(socket);
    guest::VirtioNetDriver d(c, {.queue_size = 256, .packed = false, .offloads = false, .queue_pairs = 2});
    d.bring_up();
    ASSERT_EQ(d.queue_pairs(), 2U);
    for (const uint8_t pairs : {uint8_t{1}, uint8_t{2}}) {
      ASSERT_EQ(d.control(4, 0, {pairs, 0}), 0) << "VQ_PAIRS_SET " << int(pairs);
      std::vector<uint64_t> before(4);
      for (unsigned q = 0; q < 4; ++q) before[q] = port.received_on(q);
      const uint64_t second_pair_before = net.stats(2).packets.load();
      constexpr uint32_t kFrames = 200;
      const uint32_t first = seq;
      for (uint32_t i = 0; i < kFrames; ++i, ++seq) {
        const auto f = udp_frame(seq, static_cast<uint16_t>(seq % 64));
        ASSERT_EQ(::sendto(tx.get(), f.data(), f.size(), 0, reinterpret_cast<const sockaddr*>(&to), sizeof to),
                  static_cast<ssize_t>(f.size()));
      }
      std::set<uint32_t> got;
      std::vector<uint8_t> buf(4096);
      while (got.size() < kFrames) {
        const size_t n = d.receive(buf.data(), buf.size(), 3000);
        if (n == 0) break;
        uint32_t s = 0;
        if (n >= 12 + 46 && buf[12 + 12] == 0x08 && buf[12 + 23] == 17) {
          std::memcpy(&s, buf.data() + 12 + 42, 4);
          if (s >= first && s < first + kFrames) got.insert(s);
        }
      }
      EXPECT_EQ(got.size(), kFrames) << "with " << int(pairs) << " pair(s)";
      unsigned used = 0;
      for (unsigned q = 0; q < 4; ++q) used += port.received_on(q) > before[q] ? 1U : 0U;
      EXPECT_GE(used, 2U) << "the veth put every flow on one queue: nothing was steered";
      const uint64_t second_pair = net.stats(2).packets.load() - second_pair_before;
      if (pairs == 1)
        EXPECT_EQ(second_pair, 0U) << "the pair the driver turned off received frames";
      else
        EXPECT_GT(second_pair, 0U) << "the second pair's RX queue carried nothing once it was on";
    }
  }
  io.stop();
  thread.join();
}

}  // namespace
}  // namespace sriovd::vfio_user
