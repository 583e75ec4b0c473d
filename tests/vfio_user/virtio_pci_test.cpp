// virtio-net-pci over vfio-user: sriovd's transport in front of the
// virtio-net device model, driven by the user-space guest driver over a
// real socket. The device's packet port is a SOCK_SEQPACKET pair, so every
// frame is checked byte for byte at both ends.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/vfio.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sched.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <thread>

#include "sriovd/guest/vfio_user_client.hpp"
#include "sriovd/msix/msix.hpp"
#include "sriovd/pci/config_space.hpp"
#include "sriovd/vfio_user/server.hpp"
#include "sriovd/guest/virtio_net_driver.hpp"
#include "sriovd/vfio_user/virtio_pci.hpp"
#include "sriovd/virtio/net.hpp"
#include "support/pair_port.hpp"
#include "support/process.hpp"
#include "support/temp_dir.hpp"
#include "vfio_user/harness.hpp"

namespace sriovd::vfio_user {
namespace {

using namespace std::chrono_literals;

using test::PairPort;

using test::Exported;

class VirtioPciTest : public ::testing::Test {
 public:
  VirtioPciTest() {
    auto p = std::make_unique<PairPort>();
    port = p.get();
    virtio::NetConfig nc;
    nc.name = "vnet-test";
    nc.mac = MacAddress::parse("02:5a:00:00:01:02");
    nc.mtu = 1500;
    nc.offloads = false;
    nc.control_queue = true;
    nc.cpus = {0};  // the queue pair's worker is pinned (checked below)
    net = std::make_unique<virtio::NetDevice>(nc, engine, std::move(p));
    pci = std::make_unique<VirtioPci>(*net, engine, "vnet-test");
    server = std::make_unique<Server>(io, socket, *pci);
    thread = std::thread([this] { io.run(); });
  }
  ~VirtioPciTest() override {
    io.stop();
    thread.join();
    server.reset();
  }
  std::vector<uint8_t> frame(size_t payload, uint8_t fill) {
    std::vector<uint8_t> f(12 + payload, fill);
    std::memset(f.data(), 0, 12);  // virtio_net_hdr_v1: no offload
    return f;
  }
  // The configuration change vector (the last, after the three queues),
  // wired to an eventfd and unmasked; the eventfd.
  static UniqueFd config_vector(guest::VfioUserClient& c) {
    UniqueFd irq(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    const int fds[1] = {irq.get()};
    c.set_irq_eventfds(VFIO_PCI_MSIX_IRQ_INDEX, 3, fds);
    c.write32(1, 3 * 16 + 12, 0);
    c.write(0, 0x10, std::vector<uint8_t>{3, 0});  // config_msix_vector = 3
    return irq;
  }
  std::vector<uint8_t> from_peer(int timeout_ms = 2000) {
    pollfd p{port->peer(), POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) != 1) return {};
    std::vector<uint8_t> buf(70000);
    const ssize_t n = ::recv(port->peer(), buf.data(), buf.size(), 0);
    buf.resize(n > 0 ? static_cast<size_t>(n) : 0);
    return buf;
  }

  test::TempDir dir;
  std::string socket = dir.file("vnet.sock");
  irq::Engine engine{irq::EngineOptions{}};
  PairPort* port = nullptr;
  std::unique_ptr<virtio::NetDevice> net;
  std::unique_ptr<VirtioPci> pci;
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  std::unique_ptr<Server> server;
  std::thread thread;
};

// Two queue pairs: the driver negotiates MQ and turns both on through the
// control queue (the port hears it); each pair carries its own traffic both
// ways, with its own MSI-X vectors.
TEST(VirtioPciMq, TwoPairsTurnedOnByTheControlQueueCarryTrafficBothWays) {
  test::TempDir dir;
  const std::string socket = dir.file("mq.sock");
  auto owned = std::make_unique<PairPort>(2);
  PairPort& port = *owned;
  virtio::NetConfig nc;
  nc.name = "vnet-mq";
  nc.queue_pairs = 2;
  nc.offloads = false;
  nc.control_queue = true;
  Exported exported(socket, nc, std::move(owned));
  virtio::NetDevice& net = exported.net;
  EXPECT_EQ(port.active.load(), 1U) << "a new device uses its first pair: the port steers there";
  {
    // A driver without MQ: every flow must come to the one pair it reads.
    guest::VfioUserClient c(socket);
    guest::VirtioNetDriver one(c, {.queue_size = 64, .packed = false, .offloads = false});
    one.bring_up();
    EXPECT_EQ(one.queue_pairs(), 1U);
    EXPECT_EQ(port.active.load(), 1U);
  }
  {
    guest::VfioUserClient c(socket);
    EXPECT_EQ(c.irq_info(VFIO_PCI_MSIX_IRQ_INDEX).count, 6U);  // 4 data queues, control, config
    guest::VirtioNetDriver d(c, {.queue_size = 64, .packed = false, .offloads = false, .queue_pairs = 2});
    d.bring_up();
    ASSERT_EQ(d.queue_pairs(), 2U);
    EXPECT_TRUE(d.features() & virtio::kNetMq);
    EXPECT_EQ(port.active.load(), 2U) << "VQ_PAIRS_SET 2 reached the port";
    std::vector<uint8_t> buf(4096);
    for (unsigned pair = 0; pair < 2; ++pair) {
      // Driver -> wire on this pair's TX queue: out on this pair's port queue.
      std::vector<uint8_t> f(12 + 100, static_cast<uint8_t>(0x40 + pair));
      std::memset(f.data(), 0, 12);
      ASSERT_TRUE(d.send(f.data(), f.size(), pair));
      pollfd p{port.peer(pair), POLLIN, 0};
      ASSERT_EQ(::poll(&p, 1, 2000), 1) << "pair " << pair;
      const ssize_t n = ::recv(port.peer(pair), buf.data(), buf.size(), 0);
      ASSERT_EQ(n, static_cast<ssize_t>(f.size()));
      EXPECT_EQ(buf[12], 0x40 + pair);
      // Wire -> driver through this pair's port queue and RX queue.
      std::vector<uint8_t> in(12 + 80, static_cast<uint8_t>(0x60 + pair));
      std::memset(in.data(), 0, 12);
      ASSERT_EQ(::send(port.peer(pair), in.data(), in.size(), 0), static_cast<ssize_t>(in.size()));
      ASSERT_EQ(d.receive(buf.data(), buf.size(), 2000), in.size()) << "pair " << pair;
      EXPECT_EQ(buf[12], 0x60 + pair);
      EXPECT_EQ(net.stats(2 * pair).packets.load(), 1U) << "RX queue of pair " << pair;
      EXPECT_EQ(net.stats(2 * pair + 1).packets.load(), 1U) << "TX queue of pair " << pair;
    }
    // Back to one pair: the port is told, and the control queue says OK.
    EXPECT_EQ(d.control(4, 0, {1, 0}), 0);
    EXPECT_EQ(port.active.load(), 1U);
    EXPECT_EQ(d.control(4, 0, {3, 0}), 1) << "more pairs than the device has";
    EXPECT_EQ(d.control(4, 0, {2, 0}), 0);
    EXPECT_EQ(port.active.load(), 2U);
  }
  // The driver gone, the device is reset: back to its first pair.
  EXPECT_TRUE(test::wait_until([&] { return port.active.load() == 1U; }, 2s));
}

TEST_F(VirtioPciTest, LooksLikeAVirtioPciFunction) {
  guest::VfioUserClient c(socket);
  const uint32_t id = c.read32(VFIO_PCI_CONFIG_REGION_INDEX, 0);
  EXPECT_EQ(id & 0xffff, 0x1af4U);
  EXPECT_EQ(id >> 16U, 0x1041U);  // 0x1040 + virtio-net (§4.1.2.1)
  EXPECT_EQ(c.read32(VFIO_PCI_CONFIG_REGION_INDEX, 0x08) >> 8U, 0x020000U);
  EXPECT_EQ(c.region(0).info.size, VirtioPci::kBar0Size);
  EXPECT_EQ(c.region(1).info.size, VirtioPci::kBar1Size);
  EXPECT_EQ(c.irq_info(VFIO_PCI_MSIX_IRQ_INDEX).count, 4U);  // RX, TX, control queue, config
  // One doorbell eventfd per queue, each at its own notify address.
  const auto io_fds = c.region_io_fds(0);
  ASSERT_EQ(io_fds.entries.size(), 3U);
  EXPECT_EQ(io_fds.fds.size(), 3U);
  EXPECT_EQ(io_fds.entries[0].offset, VirtioPci::kNotifyOffset);
  EXPECT_EQ(io_fds.entries[1].offset, VirtioPci::kNotifyOffset + VirtioPci::kNotifyMultiplier);
  // The PCI configuration access capability reaches BAR0: num_queues.
  c.write(VFIO_PCI_CONFIG_REGION_INDEX, VirtioPci::kCapPciCfg + 4, std::vector<uint8_t>{0});
  c.write32(VFIO_PCI_CONFIG_REGION_INDEX, VirtioPci::kCapPciCfg + 8, 0x12);
  c.write32(VFIO_PCI_CONFIG_REGION_INDEX, VirtioPci::kCapPciCfg + 12, 2);
  EXPECT_EQ(c.read32(VFIO_PCI_CONFIG_REGION_INDEX, VirtioPci::kCapPciCfg + 16) & 0xffff, 3U);
}

TEST_F(VirtioPciTest, FeaturesOutsideTheOfferDoNotStick) {
  guest::VfioUserClient c(socket);
  c.write(0, 0x14, std::vector<uint8_t>{3});
  c.write32(0, 0x08, 1);
  c.write32(0, 0x0c, 1U | (1U << 30U));  // VERSION_1 and an unoffered bit 62
  c.write(0, 0x14, std::vector<uint8_t>{3 | 8});
  uint8_t status = 0;
  c.read(0, 0x14, {&status, 1});
  EXPECT_FALSE(status & 8);
}

// The transport's state with the device's (a migration's payload): a
// driver's running device saved, restored into a fresh transport, reads back
// the same through config space, every queue's common configuration and the
// MSI-X table and PBA; it waits for guest memory, then runs from where it
// stood: a frame the driver sent while neither ran goes out, and one from
// the wire reaches the driver's ring.
TEST_F(VirtioPciTest, ItsStateRestoredIntoAFreshTransportReadsBackTheSameAndRunsOn) {
  guest::VfioUserClient c(socket);
  guest::VirtioNetDriver d(c, {.queue_size = 64, .packed = false, .offloads = false});
  d.bring_up();
  auto f = frame(80, 0x11);
  ASSERT_TRUE(d.send(f.data(), f.size()));
  ASSERT_EQ(from_peer(), f);
  ASSERT_EQ(::send(port->peer(), f.data(), f.size(), 0), static_cast<ssize_t>(f.size()));
  std::vector<uint8_t> out(4096);
  ASSERT_EQ(d.receive(out.data(), out.size(), 2000), f.size());
  // A vector masked with a message waiting (its pending bit set).
  c.write32(1, 2 * msix::kEntryBytes + 12, msix::kVectorMasked);  // the control queue's vector
  auto on_io = [this](auto fn) {
    std::promise<decltype(fn())> p;
    asio::post(io, [&] { p.set_value(fn()); });
    return p.get_future().get();
  };
  engine.set_pending(pci->vector_route(2));

  const auto [state, windows] = on_io([&] { return std::pair(pci->save_state(), pci->dma_windows()); });
  EXPECT_FALSE(net->running()) << "the source stops";
  EXPECT_EQ(state.device_id, virtio::kDeviceIdNet);
  EXPECT_EQ(state.queues.at(1).base, 1U) << "one frame sent";
  // The driver sends while neither device runs: the frame must not be lost.
  auto in_flight = frame(90, 0x22);
  ASSERT_TRUE(d.send(in_flight.data(), in_flight.size()));

  auto owned = std::make_unique<PairPort>();
  PairPort& wire = *owned;
  irq::Engine engine_b{irq::EngineOptions{}};
  virtio::NetConfig nc;
  nc.name = "vnet-test";
  nc.mac = MacAddress::parse("02:5a:00:00:01:02");
  nc.offloads = false;
  nc.control_queue = true;
  virtio::NetDevice net_b(nc, engine_b, std::move(owned));
  VirtioPci pci_b(net_b, engine_b, "vnet-b");
  pci_b.restore_state(virtio::DeviceState::parse(state.serialize(), "the saved state"));
  EXPECT_FALSE(net_b.running()) << "no guest memory yet";
  EXPECT_EQ(net_b.features(), state.features);
  EXPECT_TRUE(engine_b.pending(pci_b.vector_route(2))) << "the pending bit came along";

  auto read = [](VirtioPci& p, uint32_t region, uint64_t off, size_t size) {
    std::vector<uint8_t> b(size);
    p.read(region, off, b);
    return b;
  };
  on_io([&] {
    EXPECT_EQ(read(*pci, vfio::kConfigRegion, 0, 256), read(pci_b, vfio::kConfigRegion, 0, 256)) << "config space";
    for (uint16_t q = 0; q < 3; ++q) {
      const uint8_t sel[2] = {static_cast<uint8_t>(q), 0};
      pci->write(0, 0x16, sel);
      pci_b.write(0, 0x16, sel);
      EXPECT_EQ(read(*pci, 0, 0, VirtioPci::kCommonSize), read(pci_b, 0, 0, VirtioPci::kCommonSize)) << "queue " << q;
    }
    EXPECT_EQ(read(*pci, 1, 0, 4 * msix::kEntryBytes), read(pci_b, 1, 0, 4 * msix::kEntryBytes)) << "MSI-X table";
    EXPECT_EQ(read(*pci, 1, VirtioPci::kPbaOffset, 8).at(0), 0x04) << "vector 2 pending";
    EXPECT_EQ(read(*pci, 1, VirtioPci::kPbaOffset, 8), read(pci_b, 1, VirtioPci::kPbaOffset, 8)) << "PBA";
    return 0;
  });

  for (const DmaWindow& w : windows) pci_b.dma_mapped(w);  // the client's memory, as its DMA_MAP gives it
  ASSERT_TRUE(net_b.running()) << "restored as started, memory mapped: it runs";
  pollfd p{wire.peer(), POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 2000), 1) << "the frame sent in between goes out";
  std::vector<uint8_t> got(4096);
  ASSERT_EQ(::recv(wire.peer(), got.data(), got.size(), 0), static_cast<ssize_t>(in_flight.size()));
  got.resize(in_flight.size());
  EXPECT_EQ(got, in_flight);
  // The guest is somewhere else now, and its driver did not take
  // GUEST_ANNOUNCE: the device sends a RARP for its MAC itself.
  ASSERT_EQ(::poll(&p, 1, 2000), 1) << "no announcement after the resume";
  got.assign(4096, 0);
  ASSERT_EQ(::recv(wire.peer(), got.data(), got.size(), 0), 12 + 60);
  EXPECT_EQ(got[12 + 12], 0x80);
  EXPECT_EQ(got[12 + 13], 0x35) << "a RARP";
  EXPECT_EQ(std::vector<uint8_t>(got.begin() + 12 + 6, got.begin() + 12 + 12),
            (std::vector<uint8_t>{0x02, 0x5a, 0x00, 0x00, 0x01, 0x02}))
      << "from the device's MAC";
  auto inbound = frame(70, 0x33);
  ASSERT_EQ(::send(wire.peer(), inbound.data(), inbound.size(), 0), static_cast<ssize_t>(inbound.size()));
  ASSERT_TRUE(test::wait_until([&] { return net_b.stats(0).packets.load() == 1; }, 2s));
  ASSERT_EQ(d.receive(out.data(), out.size(), 0), inbound.size()) << "in the driver's ring";
  EXPECT_EQ(0, std::memcmp(out.data() + 12, inbound.data() + 12, inbound.size() - 12));
  net_b.stop();  // before the windows go with the client
}

// The device_state fuzzer's seeds are states this sriovd takes (a fresh
// device's, and a started one's with a pending vector): the fuzzer starts
// past the parser, and a format change that forgets them fails here.
TEST(VirtioPciState, TheFuzzersSeedsAreStatesThisSriovdRestores) {
  for (const char* seed : {"fresh", "started"}) {
    std::ifstream in(std::string(SRIOVD_SOURCE_DIR) + "/tests/fuzz/corpus/device_state/" + seed, std::ios::binary);
    const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    irq::Engine engine{irq::EngineOptions{}};
    virtio::NetConfig nc;
    nc.name = "seed";
    nc.queue_pairs = 2;
    nc.control_queue = true;
    nc.max_queue_size = 256;
    virtio::NetDevice net(nc, engine, std::make_unique<PairPort>(2));
    VirtioPci pci(net, engine, "seed");
    const virtio::DeviceState state = virtio::DeviceState::parse(bytes, seed);
    EXPECT_NO_THROW(pci.restore_state(state)) << seed;
    const virtio::DeviceState saved = pci.save_state();
    EXPECT_EQ(saved.features, state.features) << seed;
    EXPECT_EQ(saved.queues, state.queues) << seed;
    EXPECT_EQ(saved.device, state.device) << seed;
    // The transport's part differs only in config space bits the guest
    // cannot write (a seed's are zero; these are the device's).
    EXPECT_EQ(saved.transport.size(), state.transport.size()) << seed;
  }
}

void run_traffic(VirtioPciTest& t, guest::VfioUserClient& c, bool packed, bool keeps_msix_table = false) {
  guest::VirtioNetDriver d(
      c, {.queue_size = 64, .packed = packed, .offloads = false, .keeps_msix_table = keeps_msix_table});
  d.bring_up();
  EXPECT_EQ(d.packed(), packed);
  EXPECT_EQ(d.mac(), "02:5a:00:00:01:02");
  // Guest -> device -> port.
  for (int i = 0; i < 200; ++i) {
    auto f = t.frame(60 + static_cast<size_t>(i), static_cast<uint8_t>(i));
    ASSERT_TRUE(d.send(f.data(), f.size()) || (std::this_thread::sleep_for(1ms), d.send(f.data(), f.size())));
    const auto got = t.from_peer();
    ASSERT_EQ(got.size(), f.size()) << "frame " << i;
    EXPECT_EQ(got, f);
  }
  // Port -> device -> guest, with an MSI-X interrupt for each.
  for (int i = 0; i < 200; ++i) {
    auto f = t.frame(100 + static_cast<size_t>(i), static_cast<uint8_t>(0x80 + i));
    ASSERT_EQ(::send(t.port->peer(), f.data(), f.size(), 0), static_cast<ssize_t>(f.size()));
    std::vector<uint8_t> out(70000);
    const size_t n = d.receive(out.data(), out.size(), 2000);
    ASSERT_EQ(n, f.size()) << "frame " << i;
    EXPECT_EQ(0, std::memcmp(out.data() + 12, f.data() + 12, f.size() - 12));
  }
  EXPECT_GT(d.stats().interrupts.load(), 0U);
}

TEST_F(VirtioPciTest, SplitRingTrafficBothWays) {
  guest::VfioUserClient c(socket);
  run_traffic(*this, c, false);
}

TEST_F(VirtioPciTest, PackedRingTrafficBothWays) {
  guest::VfioUserClient c(socket);
  run_traffic(*this, c, true);
}

// The queue's interrupt is its MSI-X vector's route: masked, it latches
// the PBA bit; unmasked, it is delivered.
// Over virtio-pci a queue's interrupt is the MSI-X vector the driver
// chose: the engine holds the transport's vector routes and nothing else
// (the device model used to make a vhost-user-style route per queue that
// sat idle here).
TEST_F(VirtioPciTest, TheEngineHoldsOnlyTheMsixVectorRoutes) {
  std::vector<irq::RouteId> vector_routes;
  for (unsigned v = 0;; ++v) {
    try {
      vector_routes.push_back(pci->vector_route(v));
    } catch (const std::out_of_range&) {
      break;
    }
  }
  ASSERT_FALSE(vector_routes.empty());
  const auto routes = engine.list();
  ASSERT_EQ(routes.size(), vector_routes.size());
  for (const auto& r : routes)
    EXPECT_NE(std::find(vector_routes.begin(), vector_routes.end(), r.id), vector_routes.end()) << "route " << r.id;
}

TEST_F(VirtioPciTest, QueueInterruptHonoursTheVectorMask) {
  guest::VfioUserClient c(socket);
  guest::VirtioNetDriver d(c, {.queue_size = 64, .packed = false, .offloads = false});
  d.bring_up();
  c.write32(1, 0 * 16 + 12, 1);  // mask vector 0 (RX)
  auto f = frame(64, 0x55);
  ASSERT_EQ(::send(port->peer(), f.data(), f.size(), 0), static_cast<ssize_t>(f.size()));
  for (int i = 0; i < 200 && !(c.read32(1, VirtioPci::kPbaOffset) & 1U); ++i) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(c.read32(1, VirtioPci::kPbaOffset) & 1U, 1U);
  const auto before = engine.stats(pci->vector_route(0));
  EXPECT_EQ(before.masked_pending, 1U);
  c.write32(1, 0 * 16 + 12, 0);
  EXPECT_EQ(engine.stats(pci->vector_route(0)).replayed, 1U);
  std::vector<uint8_t> out(2048);
  EXPECT_EQ(d.receive(out.data(), out.size(), 2000), f.size());
}

// Posted Vector Control writes (No_reply, as QEMU sends BAR writes): the
// server answers none of them, serves them in order with what follows, and
// a read after them sees their effect (a read flushes posted writes).
TEST_F(VirtioPciTest, PostedMaskWritesTakeEffectInOrderWithoutReplies) {
  guest::VfioUserClient c(socket);
  guest::VirtioNetDriver d(c, {.queue_size = 64, .packed = false, .offloads = false});
  d.bring_up();
  const auto mask = [&](uint32_t v) { c.post_write(1, 0 * 16 + 12, {reinterpret_cast<const uint8_t*>(&v), sizeof v}); };
  const uint64_t masks = engine.stats(pci->vector_route(0)).masks;
  for (int i = 0; i < 100; ++i) {
    mask(1);
    mask(0);
  }
  mask(1);
  // Any reply to a posted write would come before this read's and make the
  // client refuse it as an unexpected message.
  EXPECT_EQ(c.read32(1, 0 * 16 + 12) & 1U, 1U) << "the last posted write masked the vector";
  EXPECT_EQ(engine.stats(pci->vector_route(0)).masks, masks + 101);
  EXPECT_TRUE(engine.masked(pci->vector_route(0)));
  // Masked: a frame's interrupt is held in the PBA; the posted unmask
  // delivers it.
  auto f = frame(64, 0x56);
  ASSERT_EQ(::send(port->peer(), f.data(), f.size(), 0), static_cast<ssize_t>(f.size()));
  for (int i = 0; i < 200 && !(c.read32(1, VirtioPci::kPbaOffset) & 1U); ++i) std::this_thread::sleep_for(5ms);
  ASSERT_EQ(c.read32(1, VirtioPci::kPbaOffset) & 1U, 1U);
  mask(0);
  EXPECT_TRUE(test::wait_until([&] { return engine.stats(pci->vector_route(0)).replayed == 1U; }, 2s));
  std::vector<uint8_t> out(2048);
  EXPECT_EQ(d.receive(out.data(), out.size(), 2000), f.size());
  // A posted write the server refuses (outside the region) is dropped
  // silently, as a PCI posted write is; the session goes on.
  uint32_t v = 0;
  c.post_write(1, 1ULL << 40, {reinterpret_cast<const uint8_t*>(&v), sizeof v});
  EXPECT_EQ(c.read32(1, 0 * 16 + 12) & 1U, 0U);
  EXPECT_EQ(server->stats().error_replies, 1U);
}

std::vector<uint8_t> eth_frame(const uint8_t* dest, uint8_t fill) {
  std::vector<uint8_t> f(12 + 64, fill);
  std::memset(f.data(), 0, 12);
  std::memcpy(f.data() + 12, dest, 6);
  return f;
}

// The control queue (§5.1.6.5): RX mode and MAC filtering decide what the
// driver receives; MAC_ADDR_SET changes the address in config space too.
TEST_F(VirtioPciTest, ControlQueueFiltersWhatTheDriverReceives) {
  guest::VfioUserClient c(socket);
  guest::VirtioNetDriver d(c, {.queue_size = 64, .packed = false, .offloads = false, .control_queue = true});
  d.bring_up();
  ASSERT_TRUE(d.features() & virtio::kNetCtrlVq);
  const uint8_t ours[6] = {0x02, 0x5a, 0x00, 0x00, 0x01, 0x02};
  const uint8_t other[6] = {0x02, 0x99, 0x00, 0x00, 0x00, 0x01};
  const uint8_t bcast[6] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
  const uint8_t mcast[6] = {0x01, 0x00, 0x5e, 0x00, 0x00, 0xfb};
  auto delivered = [&](const uint8_t* dest) {
    auto f = eth_frame(dest, 0x42);
    EXPECT_EQ(::send(port->peer(), f.data(), f.size(), 0), static_cast<ssize_t>(f.size()));
    std::vector<uint8_t> out(2048);
    return d.receive(out.data(), out.size(), 200) == f.size();
  };
  EXPECT_TRUE(delivered(other));       // promiscuous until the driver says otherwise
  EXPECT_EQ(d.control(0, 0, {0}), 0);  // RX PROMISC off
  EXPECT_EQ(d.control(0, 1, {0}), 0);  // RX ALLMULTI off
  EXPECT_FALSE(delivered(other));
  EXPECT_TRUE(delivered(ours));
  EXPECT_TRUE(delivered(bcast));
  EXPECT_FALSE(delivered(mcast));
  // MAC TABLE_SET: no unicast entries, one multicast entry.
  std::vector<uint8_t> table(14, 0);
  table[4] = 1;
  std::memcpy(table.data() + 8, mcast, 6);
  EXPECT_EQ(d.control(1, 0, table), 0);
  EXPECT_TRUE(delivered(mcast));
  // A table whose count runs past the data is refused.
  EXPECT_EQ(d.control(1, 0, {9, 0, 0, 0}), 1);
  // MAC_ADDR_SET: the new address is the device's, in config space too.
  EXPECT_EQ(d.control(1, 1, std::vector<uint8_t>(other, other + 6)), 0);
  EXPECT_EQ(d.mac(), "02:99:00:00:00:01");
  EXPECT_TRUE(delivered(other));
  EXPECT_FALSE(delivered(ours));
  // MQ on a one-pair device, and an unknown class: ERR, and the device goes on.
  EXPECT_EQ(d.control(4, 0, {1, 0}), 1);
  EXPECT_EQ(d.control(9, 9, {}), 1);
  EXPECT_EQ(d.control(0, 0, {1}), 0);
  EXPECT_TRUE(delivered(ours));
  EXPECT_FALSE(net->broken());
}

// The queue pair's worker is named and pinned to the CPU the config gives.
TEST_F(VirtioPciTest, WorkerRunsOnTheConfiguredCpu) {
  guest::VfioUserClient c(socket);
  guest::VirtioNetDriver d(c, {.queue_size = 64, .packed = false, .offloads = false});
  d.bring_up();
  bool found = false;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(e.path() / "comm");
    std::string name;
    std::getline(comm, name);
    if (name != "sriovd-q0") continue;
    found = true;
    cpu_set_t set;
    CPU_ZERO(&set);
    ASSERT_EQ(::sched_getaffinity(std::stoi(e.path().filename().string()), sizeof set, &set), 0);
    EXPECT_EQ(CPU_COUNT(&set), 1);
    EXPECT_TRUE(CPU_ISSET(0, &set));
  }
  EXPECT_TRUE(found) << "no sriovd-q0 worker thread";
}

// The link follows the port's carrier: status in the device config, a new
// config_generation, and the configuration vector fires (§4.1.5.3).
TEST_F(VirtioPciTest, LinkChangeIsAConfigurationChange) {
  guest::VfioUserClient c(socket);
  guest::VirtioNetDriver d(c, {.queue_size = 64, .packed = false, .offloads = false});
  d.bring_up();
  UniqueFd cfg_irq = config_vector(c);
  auto status = [&] { return c.read32(0, VirtioPci::kDeviceOffset + 4) >> 16U; };
  auto generation = [&] {
    uint8_t g = 0;
    c.read(0, 0x15, {&g, 1});
    return g;
  };
  EXPECT_EQ(status(), 1U);
  const uint8_t before = generation();
  port->link = false;
  std::promise<bool> changed;
  asio::post(io, [&] {
    const bool ch = net->poll_link();
    if (ch) pci->config_changed();
    changed.set_value(ch);
  });
  ASSERT_TRUE(changed.get_future().get());
  pollfd p{cfg_irq.get(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 2000), 1) << "no configuration change interrupt";
  EXPECT_EQ(status(), 0U);
  EXPECT_NE(generation(), before);
}

// After a migration the restored device makes the guest known where it is
// now (announce_restored, which resume_device calls): a driver that took
// VIRTIO_NET_F_GUEST_ANNOUNCE sees VIRTIO_NET_S_ANNOUNCE and a configuration
// change, announces itself and acknowledges on the control queue
// (§5.1.6.5.4), which clears the bit.
TEST_F(VirtioPciTest, ADriverThatTakesGuestAnnounceIsAskedToAnnounceAndAcknowledges) {
  guest::VfioUserClient c(socket);
  guest::VirtioNetDriver d(c, {.queue_size = 64, .packed = false, .offloads = false, .control_queue = true});
  d.bring_up();
  ASSERT_TRUE(net->features() & virtio::kNetGuestAnnounce);
  UniqueFd cfg_irq = config_vector(c);
  auto status = [&] { return c.read32(0, VirtioPci::kDeviceOffset + 4) >> 16U; };
  EXPECT_EQ(status(), 1U) << "link up, nothing to announce";
  EXPECT_EQ(d.control(3, 0, {}), 0) << "an ack with nothing asked is harmless";
  std::promise<bool> asked;
  asio::post(io, [&] {
    const bool a = net->announce_restored();
    if (a) pci->config_changed();
    asked.set_value(a);
  });
  ASSERT_TRUE(asked.get_future().get()) << "the driver is asked, no RARP sent for it";
  pollfd p{cfg_irq.get(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 2000), 1) << "no configuration change interrupt";
  EXPECT_EQ(status(), 3U) << "VIRTIO_NET_S_LINK_UP | VIRTIO_NET_S_ANNOUNCE";
  EXPECT_EQ(d.control(3, 0, {1}), 1) << "the ack has no data";
  EXPECT_EQ(d.control(3, 0, {}), 0);
  EXPECT_EQ(status(), 1U) << "acknowledged";
  EXPECT_TRUE(from_peer(100).empty()) << "the guest announces itself; the device sends nothing";
}

TEST_F(VirtioPciTest, ClientGoneResetsAndTheNextOneWorks) {
  {
    guest::VfioUserClient c(socket);
    guest::VirtioNetDriver d(c, {.queue_size = 64, .packed = true, .offloads = false});
    d.bring_up();
    EXPECT_TRUE(net->running());
  }
  for (int i = 0; i < 200 && (server->connected() || net->running()); ++i) std::this_thread::sleep_for(5ms);
  EXPECT_FALSE(net->running());
  guest::VfioUserClient c(socket);
  run_traffic(*this, c, false);
}

// QEMU keeps the MSI-X table itself (it never forwards a table write),
// wires each vector with SET_IRQS TRIGGER and enables MSI-X in config
// space: every queue interrupt must still reach it (msix.hpp's rules).
TEST_F(VirtioPciTest, TableKeepingClientGetsEveryInterrupt) {
  guest::VfioUserClient c(socket);
  run_traffic(*this, c, false, true);
  EXPECT_FALSE(pci->msix().table_forwarded());
}

// ...and a mask it asks for with SET_IRQS holds the interrupt in the PBA
// until UNMASK replays it.
TEST_F(VirtioPciTest, TableKeepingClientMasksWithSetIrqs) {
  guest::VfioUserClient c(socket);
  guest::VirtioNetDriver d(c, {.queue_size = 64, .packed = false, .offloads = false, .keeps_msix_table = true});
  d.bring_up();
  c.mask(VFIO_PCI_MSIX_IRQ_INDEX, 0, true);
  auto f = frame(64, 0x33);
  ASSERT_EQ(::send(port->peer(), f.data(), f.size(), 0), static_cast<ssize_t>(f.size()));
  ASSERT_TRUE(test::wait_until([&] { return (c.read32(1, VirtioPci::kPbaOffset) & 1U) != 0; }, 2s));
  EXPECT_EQ(engine.stats(pci->vector_route(0)).delivered, 0U);
  c.mask(VFIO_PCI_MSIX_IRQ_INDEX, 0, false);
  EXPECT_EQ(engine.stats(pci->vector_route(0)).replayed, 1U);
  std::vector<uint8_t> out(2048);
  EXPECT_EQ(d.receive(out.data(), out.size(), 2000), f.size());
}

// The capability list a guest walks: each capability where its pointer
// says, inside the 256 bytes, none overlapping another.
TEST_F(VirtioPciTest, ConfigSpaceIsWellFormed) {
  guest::VfioUserClient c(socket);
  std::vector<uint8_t> cfg(256);
  c.read(VFIO_PCI_CONFIG_REGION_INDEX, 0, cfg);
  EXPECT_EQ(pci::capability_problems(cfg), std::vector<std::string>{});
  ASSERT_TRUE(pci::find_msix(cfg));
  // The device configuration capability (cfg_type 4) is as long as the
  // device type's configuration (virtio-net: 12 bytes), not a fixed window.
  uint32_t device_cfg_length = 0, device_cfg_offset = 0;
  for (unsigned p = cfg[0x34]; p != 0 && p < 0xff; p = cfg[p + 1])
    if (cfg[p] == 0x09 && cfg[p + 3] == 4) {
      std::memcpy(&device_cfg_offset, &cfg[p + 8], 4);
      std::memcpy(&device_cfg_length, &cfg[p + 12], 4);
    }
  EXPECT_EQ(device_cfg_offset, VirtioPci::kDeviceOffset);
  EXPECT_EQ(device_cfg_length, net->config_size());
  EXPECT_EQ(device_cfg_length, 12U);
  // Past it, the window reads as zero.
  EXPECT_EQ(c.read32(0, VirtioPci::kDeviceOffset + 12), 0U);
}

// What of a client's memory the server still has: mappings and fds of
// the guest RAM memfd (the client's own are gone with it).
size_t guest_ram_held() {
  size_t n = 0;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) n += line.find("sriovd-guest-ram") != std::string::npos;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    n += std::filesystem::read_symlink(e.path(), ec).string().find("sriovd-guest-ram") != std::string::npos;
  }
  return n;
}

// QEMU leaves without DEVICE_RESET: the device is running on the client's
// memory when the socket closes. The device stops first and then every
// window goes - none stays mapped in the daemon, however often it happens.
TEST_F(VirtioPciTest, ClientsThatVanishWithTheDeviceRunningLeaveNoMemory) {
  ASSERT_EQ(guest_ram_held(), 0U);
  for (int i = 0; i < 20; ++i) {
    {
      guest::VfioUserClient c(socket);
      guest::VirtioNetDriver d(
          c, {.queue_size = 64, .packed = (i % 2) != 0, .offloads = false, .keeps_msix_table = (i % 3) == 0});
      d.bring_up();
      ASSERT_TRUE(net->running());
    }
    ASSERT_TRUE(test::wait_until([&] { return !server->connected() && !net->running(); }, 5s)) << "round " << i;
    ASSERT_TRUE(test::wait_until([&] { return guest_ram_held() == 0; }, 5s))
        << "round " << i << ": " << guest_ram_held() << " mappings or fds of a departed client's memory";
  }
  guest::VfioUserClient c(socket);
  run_traffic(*this, c, false);
}

// The same with a client killed (SIGKILL) while its device runs: a separate
// process (sriovd-guest) whose memory only the daemon could keep.
TEST_F(VirtioPciTest, KilledClientsLeaveNoMemory) {
  const std::string guest = SRIOVD_GUEST_BIN;
  if (::geteuid() != 0 || ::access("/dev/net/tun", R_OK | W_OK) != 0)
    GTEST_SKIP() << "sriovd-guest bridges to a tap: needs root and /dev/net/tun";
  for (int i = 0; i < 5; ++i) {
    const std::string tap = "sdkill" + std::to_string(::getpid() % 10000) + std::to_string(i);
    test::Process p({guest, "virtio-net", "--socket", socket, "--tap", tap, "--queue-size", "64", "--no-offloads"},
                    dir.file("guest" + std::to_string(i) + ".log"));
    ASSERT_TRUE(test::wait_until([&] { return net->running(); }, 10s)) << p.log();
    ASSERT_GT(guest_ram_held(), 0U);
    p.signal(SIGKILL);
    ASSERT_TRUE(p.wait_for(5s));
    ASSERT_TRUE(test::wait_until([&] { return !server->connected() && !net->running() && guest_ram_held() == 0; }, 5s))
        << "round " << i << ": " << guest_ram_held() << " mappings or fds of a killed client's memory";
  }
}

// Doorbells are the client's own: one that left still holds the eventfds
// it was given (GET_REGION_IO_FDS), and ringing them reaches nothing of
// the next client's device.
TEST_F(VirtioPciTest, ADepartedClientsDoorbellsRingNothing) {
  std::vector<UniqueFd> old;
  {
    guest::VfioUserClient c(socket);
    old = std::move(c.region_io_fds(0).fds);
    ASSERT_EQ(old.size(), 3U);
  }
  ASSERT_TRUE(test::wait_until([&] { return !server->connected(); }, 5s));
  guest::VfioUserClient c(socket);
  // Not the same eventfds: a count written on a new one does not show on
  // the old one (the device is not started yet: nobody drains either).
  const auto fresh = c.region_io_fds(0);
  ASSERT_EQ(fresh.fds.size(), old.size());
  for (size_t q = 0; q < old.size(); ++q) {
    const uint64_t seven = 7;
    ASSERT_EQ(::write(fresh.fds[q].get(), &seven, sizeof seven), 8);
    uint64_t count = 0;
    EXPECT_EQ(::read(old[q].get(), &count, sizeof count), -1) << "queue " << q << ": the old doorbell is the new one";
    ASSERT_EQ(::read(fresh.fds[q].get(), &count, sizeof count), 8);
  }
  guest::VirtioNetDriver d(c, {.queue_size = 64, .packed = false, .offloads = false});
  d.bring_up();
  // Ring the old ones, then a frame through the device: the worker pass
  // that sent it would have drained any doorbell it watched.
  const uint64_t one = 1;
  for (const auto& fd : old) ASSERT_EQ(::write(fd.get(), &one, sizeof one), 8);
  auto f = frame(80, 0x5a);
  ASSERT_TRUE(d.send(f.data(), f.size()));
  ASSERT_EQ(from_peer().size(), f.size());
  for (const auto& fd : old) {
    uint64_t count = 0;
    EXPECT_EQ(::read(fd.get(), &count, sizeof count), 8) << "an old doorbell was drained by the device";
    EXPECT_EQ(count, 1U);
  }
}

// A port whose next recv() waits, when asked to, until the test lets it
// go (and then finds nothing): a worker held at a known point of a batch
// of events.
class GatedPort : public PairPort {
 public:
  ssize_t recv(unsigned q, uint8_t* buf, size_t size) override {
    if (!hold_next.exchange(false)) return PairPort::recv(q, buf, size);
    std::unique_lock lock(m);
    ++held;
    cv.notify_all();
    cv.wait(lock, [&] { return released >= held; });
    errno = EAGAIN;
    return -1;
  }
  void wait_held(unsigned n) {
    std::unique_lock lock(m);
    ASSERT_TRUE(cv.wait_for(lock, 3s, [&] { return held >= n; })) << "the worker never came to recv " << n;
  }
  void release() {
    std::lock_guard lock(m);
    ++released;
    cv.notify_all();
  }
  std::atomic<bool> hold_next{false};

 private:
  std::mutex m;
  std::condition_variable cv;
  unsigned held = 0, released = 0;
};

// Issue 24 item 2: the client clears O_NONBLOCK on a doorbell it was given
// and drains it between the worker's epoll_wait and its read. The read is
// cut short by the peer I/O watchdog and the device stops (NEEDS_RESET)
// instead of its worker blocking for good; the next client's device works.
TEST(VirtioPciHostile, ADoorbellMadeBlockingAndDrainedStopsOnlyTheDevice) {
  test::TempDir dir;
  const std::string socket = dir.file("hostile.sock");
  auto owned = std::make_unique<GatedPort>();
  GatedPort& port = *owned;
  virtio::NetConfig nc;
  nc.name = "vnet-hostile";
  nc.offloads = false;
  Exported exported(socket, nc, std::move(owned));
  virtio::NetDevice& net = exported.net;
  Server& server = exported.server;
  std::vector<UniqueFd> doorbells;
  {
    guest::VfioUserClient c(socket);
    doorbells = std::move(c.region_io_fds(0).fds);
    ASSERT_GE(doorbells.size(), 2U);
    guest::VirtioNetDriver d(c, {.queue_size = 64, .packed = false, .offloads = false});
    d.bring_up();  // RX buffers posted: the worker reads the port when it has a frame
    // The worker has taken the kicks of bring-up: the next batch that
    // reports the RX doorbell is the one arranged below.
    auto rung = [](const UniqueFd& fd) {
      pollfd p{fd.get(), POLLIN, 0};
      return ::poll(&p, 1, 0) == 1;
    };
    ASSERT_TRUE(test::wait_until([&] { return !rung(doorbells[0]) && !rung(doorbells[1]); }, 2s));
    const std::vector<uint8_t> in(12 + 60, 0);
    // Batch 1: the port is readable; its recv is held.
    port.hold_next = true;
    ASSERT_EQ(::send(port.peer(), in.data(), in.size(), 0), static_cast<ssize_t>(in.size()));
    port.wait_held(1);
    // Meanwhile the RX doorbell rings: the next batch is [port, RX doorbell],
    // and the port's recv is held again before the doorbell is read.
    const uint64_t one = 1;
    ASSERT_EQ(::write(doorbells[0].get(), &one, sizeof one), 8);
    port.hold_next = true;
    port.release();
    port.wait_held(2);
    // Now, after epoll_wait said the doorbell is readable: blocking, drained.
    const int flags = ::fcntl(doorbells[0].get(), F_GETFL);
    ASSERT_EQ(::fcntl(doorbells[0].get(), F_SETFL, flags & ~O_NONBLOCK), 0);
    uint64_t count = 0;
    ASSERT_EQ(::read(doorbells[0].get(), &count, sizeof count), 8);
    port.release();
    const bool stopped = test::wait_until([&] { return net.broken(); }, 3s);
    if (!stopped) (void)::write(doorbells[0].get(), &one, sizeof one);  // let the blocked worker go
    EXPECT_TRUE(stopped) << "the worker is blocked in read() on the client's doorbell";
  }
  // The client left: its device is reset, and the next client's works.
  ASSERT_TRUE(test::wait_until([&] { return !server.connected(); }, 5s));
  {
    guest::VfioUserClient c(socket);
    guest::VirtioNetDriver d(c, {.queue_size = 64, .packed = false, .offloads = false});
    d.bring_up();
    std::vector<uint8_t> f(12 + 80, 0x33);
    std::memset(f.data(), 0, 12);
    ASSERT_TRUE(d.send(f.data(), f.size()));
    pollfd p{port.peer(), POLLIN, 0};
    std::vector<uint8_t> buf(4096);
    bool out = false;
    // The first frame the peer reads may be the one it sent in: skip to ours.
    for (int i = 0; i < 3 && !out && ::poll(&p, 1, 2000) == 1; ++i)
      out = ::recv(port.peer(), buf.data(), buf.size(), 0) == static_cast<ssize_t>(f.size()) && buf[12] == 0x33;
    EXPECT_TRUE(out) << "the next client's device does not send";
  }
}

// A window shared without an fd (QEMU's BIOS and ROM windows) is taken at
// DMA_MAP; a queue that lies in one cannot be served, and the device says
// so when the driver starts it (NEEDS_RESET), not at DMA_MAP.
TEST_F(VirtioPciTest, FdLessWindowsAreTakenAndRingsInThemRefusedAtStart) {
  guest::VfioUserClient c(socket);
  std::vector<uint8_t> rom(1 << 16);
  c.dma_map_local(0xc0000, rom.size(), rom.data(), false);
  c.dma_unmap(0xc0000, rom.size());
  c.dma_map_local(0xc0000, rom.size(), rom.data(), false);
  guest::VirtioNetDriver d(c, {.queue_size = 64, .packed = false, .offloads = false});
  d.bring_up();  // its rings are in its own memfd RAM: served
  EXPECT_TRUE(net->running());
  std::vector<uint8_t> fdless(1 << 16);
  c.dma_map_local(0x40000000, fdless.size(), fdless.data());
  c.reset();
  // A driver that puts queue 0 in the fd-less window.
  c.write(0, 0x14, std::vector<uint8_t>{1 | 2});
  c.write32(0, 0x08, 1);
  c.write32(0, 0x0c, 1);  // VERSION_1
  c.write(0, 0x14, std::vector<uint8_t>{1 | 2 | 8});
  for (uint16_t q = 0; q < 2; ++q) {
    c.write(0, 0x16, std::vector<uint8_t>{static_cast<uint8_t>(q), 0});
    c.write(0, 0x18, std::vector<uint8_t>{64, 0});
    const uint64_t base = 0x40000000 + q * 0x4000;
    for (const auto& [at, v] :
         {std::pair{0x20U, base}, std::pair{0x28U, base + 0x1000}, std::pair{0x30U, base + 0x2000}}) {
      c.write32(0, at, static_cast<uint32_t>(v));
      c.write32(0, at + 4, static_cast<uint32_t>(v >> 32U));
    }
    c.write(0, 0x1c, std::vector<uint8_t>{1, 0});
  }
  c.write(0, 0x14, std::vector<uint8_t>{1 | 2 | 4 | 8});
  uint8_t status = 0;
  c.read(0, 0x14, {&status, 1});
  EXPECT_TRUE(status & 64) << "DEVICE_NEEDS_RESET expected, status " << int(status);
  EXPECT_FALSE(net->running());
}

}  // namespace
}  // namespace sriovd::vfio_user
