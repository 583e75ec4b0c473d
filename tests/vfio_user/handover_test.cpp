// virtio-net-pci over vfio-user handed over to a successor (an upgrade in
// place): the client keeps its connection, its DMA windows, its doorbells
// and its interrupt eventfds; the device goes on from its rings where the
// predecessor stopped, the stream into the guest in order; the guest is
// not announced (it has not moved); the socket file stays and takes the
// next client. A handover that cannot happen (a live migration) leaves the
// server serving, and bytes that do not fit are refused by name.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "sriovd/guest/vfio_user_client.hpp"
#include "sriovd/guest/virtio_net_driver.hpp"
#include "sriovd/vfio_user/server.hpp"
#include "sriovd/vfio_user/virtio_pci.hpp"
#include "sriovd/virtio/net.hpp"
#include "support/process.hpp"
#include "support/stream_port.hpp"
#include "support/temp_dir.hpp"
#include "vfio_user/harness.hpp"

namespace sriovd::vfio_user {
namespace {

using namespace std::chrono_literals;
using sriovd::test::StreamPort;

virtio::NetConfig config() {
  virtio::NetConfig nc;
  nc.name = "vnet-up";
  nc.mac = MacAddress::parse("02:5a:00:00:07:02");
  nc.offloads = false;
  return nc;
}

class VfioUserHandover : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    port_a = new StreamPort();
    a = std::make_unique<test::Exported>(path(), config(), std::unique_ptr<virtio::PacketPort>(port_a));
    c = std::make_unique<guest::VfioUserClient>(path());
    d = std::make_unique<guest::VirtioNetDriver>(
        *c, guest::VirtioNetDriverOptions{.queue_size = 64, .packed = GetParam(), .offloads = false});
    d->bring_up();
  }
  void TearDown() override {
    d.reset();
    c.reset();
    b.reset();
    a.reset();
  }
  std::string path() { return dir.file("vnet.sock"); }

  // Frozen `h` through the bytes and fd list an exec carries: a is handed
  // over and gone (its exec); what the successor reads is returned.
  ServerHandover pass_on(ServerHandover h) {
    const std::vector<uint8_t> bytes = h.serialize();
    std::vector<UniqueFd> fds = std::move(h.fds);
    a->on_io([&] {
      a->server.handed_over();
      return 0;
    });
    a.reset();
    ServerHandover got = ServerHandover::parse(bytes, fds.size(), "the test's handover");
    got.fds = std::move(fds);
    return got;
  }
  // Hands a's server over to a new one through the bytes and fd list an
  // exec carries, as the daemon does; a is gone after it (its exec). The
  // successor's wire goes on where a's stopped.
  void hand_over() {
    const uint32_t generated = port_a->generated();
    ServerHandover got = pass_on(a->on_io([&] { return a->server.freeze_for_handover(); }));
    port_b = new StreamPort();
    port_b->start_at(generated);
    b = std::make_unique<test::Exported>(path(), config(), std::unique_ptr<virtio::PacketPort>(port_b), std::move(got));
  }
  // The guest takes `n` packets, each checked (test::StreamCheck).
  bool receive(unsigned n) {
    return stream.take([&](uint8_t* out, size_t size, int ms) { return d->receive(out, size, ms); }, n);
  }
  // `n` frames out, each with its number in the first payload byte.
  void transmit(uint8_t first, uint8_t n) {
    std::vector<uint8_t> f(12 + 60, 0);
    for (uint8_t i = first; i < first + n; ++i) {
      std::memset(f.data() + 12, i, 60);
      ASSERT_TRUE(d->send(f.data(), f.size()));
    }
  }

  test::TempDir dir;
  StreamPort* port_a = nullptr;
  StreamPort* port_b = nullptr;
  std::unique_ptr<test::Exported> a, b;
  std::unique_ptr<guest::VfioUserClient> c;
  std::unique_ptr<guest::VirtioNetDriver> d;
  test::StreamCheck stream;
};

TEST_P(VfioUserHandover, TheClientKeepsItsDeviceAndTheStreamGoesOnInOrder) {
  port_a->flow(true);
  ASSERT_TRUE(receive(100));
  transmit(1, 5);
  ASSERT_TRUE(test::wait_until([&] { return port_a->sent().size() == 5; }, 3s));
  const uint64_t interrupts = d->stats().interrupts.load();

  hand_over();
  port_b->flow(true);
  ASSERT_TRUE(receive(200)) << "the successor goes on from the predecessor's rings";
  EXPECT_EQ(stream.corrupt, 0U) << "no repeat, nothing out of order, every byte as sent";
  EXPECT_LE(stream.gaps, 1U) << "at most the packet the predecessor had in hand";
  EXPECT_GT(d->stats().interrupts.load(), interrupts) << "the client's interrupt eventfds were taken over";
  transmit(6, 5);
  ASSERT_TRUE(test::wait_until([&] { return port_b->sent().size() == 5; }, 3s));
  const auto sent = port_b->sent();
  for (size_t i = 0; i < sent.size(); ++i) EXPECT_EQ(sent[i].at(12), 6 + i) << "each frame once, in order";
  EXPECT_TRUE(b->on_io([&] { return b->server.connected(); }));
  const ServerStats st = b->on_io([&] { return b->server.stats(); });
  EXPECT_EQ(st.protocol_errors, 0U);
  EXPECT_EQ(st.connections, 1U);
  // The configuration is the client's as it was: the MAC through BAR0.
  EXPECT_EQ(d->mac(), "02:5a:00:00:07:02");
}

// What the guest queued while the device was frozen goes out once, from
// the successor: nothing is lost between the two, nothing sent twice.
TEST_P(VfioUserHandover, WhatTheGuestQueuedWhileFrozenGoesOutOnce) {
  transmit(1, 3);
  ASSERT_TRUE(test::wait_until([&] { return port_a->sent().size() == 3; }, 3s));
  ServerHandover h = a->on_io([&] { return a->server.freeze_for_handover(); });
  transmit(4, 4);  // a doorbell nobody serves yet
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(port_a->sent().size(), 3U) << "frozen: the device does not run";
  ServerHandover got = pass_on(std::move(h));
  port_b = new StreamPort();
  b = std::make_unique<test::Exported>(path(), config(), std::unique_ptr<virtio::PacketPort>(port_b), std::move(got));
  ASSERT_TRUE(test::wait_until([&] { return port_b->sent().size() == 4; }, 3s))
      << "the successor serves what was queued (the kick it missed is owed)";
  const auto sent = port_b->sent();
  for (size_t i = 0; i < sent.size(); ++i) EXPECT_EQ(sent[i].at(12), 4 + i);
}

TEST_P(VfioUserHandover, TheSocketStaysAndTakesTheNextClient) {
  struct stat before {};
  ASSERT_EQ(::stat(path().c_str(), &before), 0);
  hand_over();
  struct stat after {};
  ASSERT_EQ(::stat(path().c_str(), &after), 0);
  EXPECT_EQ(after.st_ino, before.st_ino) << "the same socket file";
  d.reset();
  c.reset();
  ASSERT_TRUE(test::wait_until([&] { return !b->on_io([&] { return b->server.connected(); }); }, 3s));
  guest::VfioUserClient again(path());
  guest::VirtioNetDriver d2(again, {.queue_size = 64, .packed = GetParam(), .offloads = false});
  d2.bring_up();
  port_b->flow(true);
  std::vector<uint8_t> out(70000);
  EXPECT_GT(d2.receive(out.data(), out.size(), 3000), 12U);
}

TEST_P(VfioUserHandover, AHandoverThatDoesNotHappenLeavesItServing) {
  ServerHandover h = a->on_io([&] { return a->server.freeze_for_handover(); });
  h.fds.clear();  // what the successor would have had
  a->on_io([&] {
    a->server.thaw();
    return 0;
  });
  port_a->flow(true);
  ASSERT_TRUE(receive(50));
  transmit(1, 2);
  ASSERT_TRUE(test::wait_until([&] { return port_a->sent().size() == 2; }, 3s));
  EXPECT_EQ(stream.corrupt, 0U);
}

TEST_P(VfioUserHandover, ALiveMigrationIsNotHandedOver) {
  const DmaRange ram{d->ram_iova(), d->ram().size()};
  ASSERT_EQ(c->dma_logging_start(4096, {&ram, 1}), 4096U);
  const std::string why = a->on_io([&]() -> std::string {
    try {
      (void)a->server.freeze_for_handover();
      return "";
    } catch (const HandoverRefused& e) {
      return e.what();
    }
  });
  EXPECT_NE(why.find("live migration"), std::string::npos) << why;
  c->dma_logging_stop();
  port_a->flow(true);
  ASSERT_TRUE(receive(20)) << "serving on";
}

// A successor whose device does not fit what was handed over (here: its
// queues at most 32 entries where the driver set 64) refuses it by name; nothing
// of it is half-taken - the client's connection ends as after a crash, the
// windows it mapped are unmapped again, and the process goes on.
TEST_P(VfioUserHandover, AHandoverThatDoesNotFitIsRefusedByName) {
  ServerHandover h = a->on_io([&] { return a->server.freeze_for_handover(); });
  ServerHandover got = pass_on(std::move(h));
  virtio::NetConfig other = config();
  other.max_queue_size = 32;
  try {
    test::Exported b2(path(), other, std::make_unique<StreamPort>(), std::move(got));
    ADD_FAILURE() << "a device of 32-entry queues took a handover of 64-entry ones";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("queue 0 size 64"), std::string::npos) << e.what();
  }
  // The client hears its connection end (its next request fails).
  EXPECT_THROW((void)c->read32(vfio::kConfigRegion, 0), std::exception);
}

INSTANTIATE_TEST_SUITE_P(Rings, VfioUserHandover, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& p) { return p.param ? "packed" : "split"; });

ServerHandover one_window() {
  ServerHandover h;
  h.connection = 0;
  h.windows.push_back({0x100000, 0x10000, 0, true, true, 1});
  return h;
}

TEST(ServerHandoverBytes, AnotherVersionOrAnFdPastTheListIsRefusedByName) {
  const std::vector<uint8_t> bytes = one_window().serialize();
  EXPECT_NO_THROW((void)ServerHandover::parse(bytes, 2, "ok"));
  try {
    (void)ServerHandover::parse(bytes, 1, "the handover of vnet0");
    ADD_FAILURE() << "an fd past the list";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("the handover of vnet0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("a DMA window names fd 1 of 1"), std::string::npos) << e.what();
  }
  std::vector<uint8_t> other = bytes;
  other[0] = 9;
  EXPECT_THROW((void)ServerHandover::parse(other, 2, "v9"), std::invalid_argument);
  ServerHandover overlap = one_window();
  overlap.windows.push_back({0x108000, 0x1000, 0, true, false, ServerHandover::kNoFd});
  EXPECT_THROW((void)ServerHandover::parse(overlap.serialize(), 2, "overlap"), std::invalid_argument);
  ServerHandover unaligned = one_window();
  unaligned.windows[0].size = 0x10001;
  EXPECT_THROW((void)ServerHandover::parse(unaligned.serialize(), 2, "unaligned"), std::invalid_argument);
}

}  // namespace
}  // namespace sriovd::vfio_user
