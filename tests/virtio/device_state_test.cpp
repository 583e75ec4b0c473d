// A device's state in one versioned form (virtio/device.hpp): a running
// virtio-net device is saved mid-stream, the bytes parsed, a fresh device
// restored from them on the same guest memory and port, and traffic goes on
// both ways without a frame lost or seen twice - what live migration moves.
// A state that does not fit is refused, naming why, and changes nothing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "sriovd/guest/virtqueue.hpp"
#include "virtio/guest_ram.hpp"
#include "sriovd/virtio/net.hpp"
#include "support/pair_port.hpp"
#include "support/process.hpp"

namespace sriovd::virtio {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kBase = test::kGuestBase;
constexpr uint64_t kRxRing = kBase, kTxRing = kBase + 0x10000;
constexpr uint64_t kRxBufs = kBase + 0x20000, kTxBufs = kBase + 0x40000;
constexpr uint16_t kQueueSize = 64;
constexpr unsigned kRxPosted = 16;  // RX buffers the driver has out at once
constexpr uint32_t kBufBytes = 2048;
constexpr unsigned kFrames = 48;  // each way
constexpr size_t kHdr = sizeof(NetHeader);
constexpr size_t kFrameBytes = kHdr + 64;

using Guest = test::GuestRam;

// A frame as the port carries it: the 12-byte header, a broadcast
// Ethernet header, the sequence number.
std::vector<uint8_t> frame(uint32_t seq) {
  std::vector<uint8_t> f(kFrameBytes, 0);
  std::memset(f.data() + kHdr, 0xff, 6);
  f[kHdr + 12] = 0x88;
  f[kHdr + 13] = 0xb5;
  std::memcpy(f.data() + kHdr + 14, &seq, 4);
  return f;
}
uint32_t seq_of(const uint8_t* f) {
  uint32_t seq;
  std::memcpy(&seq, f + kHdr + 14, 4);
  return seq;
}

NetConfig config() {
  NetConfig nc;
  nc.name = "state-test";
  nc.mac = MacAddress::parse("02:5a:00:00:00:07");
  nc.offloads = false;
  nc.max_queue_size = 256;
  return nc;
}

irq::EngineOptions no_relay() {
  irq::EngineOptions o;
  o.relay_threads = 0;
  return o;
}

template <typename Kind>
class DeviceStateRoundTrip : public ::testing::Test {
 protected:
  static constexpr bool kPacked = Kind::value;
  using Driver = std::conditional_t<kPacked, guest::PackedDriver, guest::SplitDriver>;

  DeviceStateRoundTrip() : rx(g.at(kRxRing), kRxRing, kQueueSize), tx(g.at(kTxRing), kTxRing, kQueueSize) {
    for (auto& k : kicks) k.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  }

  // What a transport hands a device: features, memory, queues, kicks.
  void wire(NetDevice& d, bool restored) {
    if (!restored) {
      d.set_features(kVersion1 | kRingEventIdx | (kPacked ? kRingPacked : 0));
      for (unsigned q = 0; q < 2; ++q) {
        d.set_queue_size(q, kQueueSize);
        d.set_queue_rings(q, (q == 0 ? rx : tx).addresses());
        d.set_queue_enabled(q, true);
      }
    }
    d.set_memory(&g.mem);
    for (unsigned q = 0; q < 2; ++q) d.set_queue_kick(q, UniqueFd(::dup(kicks[q].get())));
    d.start();
  }
  void kick(unsigned q) {
    const uint64_t one = 1;
    ASSERT_EQ(::write(kicks[q].get(), &one, sizeof one), 8);
  }
  void post_rx(unsigned slot) {
    const guest::Buffer b{kRxBufs + uint64_t{slot} * kBufBytes, kBufBytes, true};
    const int id = rx.add(std::span(&b, 1));
    ASSERT_GE(id, 0);
    slot_of_id.at(static_cast<size_t>(id)) = slot;  // split: the head descriptor; packed: the buffer id
    if constexpr (!kPacked) rx.publish();
  }
  void post_tx(uint32_t seq) {
    const uint64_t at = kTxBufs + uint64_t{seq} * 128;
    const auto f = frame(seq);
    std::memcpy(g.at(at), f.data(), f.size());
    const guest::Buffer b{at, static_cast<uint32_t>(f.size()), false};
    ASSERT_GE(tx.add(std::span(&b, 1)), 0);
    if constexpr (!kPacked) tx.publish();
  }
  // Received frames taken off the RX ring (each buffer posted again when
  // `refill`), until `count` in all or the deadline.
  void take_rx(size_t count, bool refill) {
    test::wait_until(
        [&] {
          uint32_t id = 0, len = 0;
          while (rx.take_used(id, len)) {
            const unsigned slot = slot_of_id.at(id);
            EXPECT_EQ(len, kFrameBytes);
            received.push_back(seq_of(g.at(kRxBufs + uint64_t{slot} * kBufBytes)));
            if (refill) {
              post_rx(slot);
              kick(0);
            }
          }
          return received.size() >= count;
        },
        5s);
  }
  std::vector<uint32_t> wire_frames(size_t count) {
    std::vector<uint32_t> seqs;
    std::vector<uint8_t> buf(4096);
    while (seqs.size() < count) {
      pollfd p{port->peer(), POLLIN, 0};
      if (::poll(&p, 1, 5000) != 1) break;
      const ssize_t n = ::recv(port->peer(), buf.data(), buf.size(), 0);
      if (n != static_cast<ssize_t>(kFrameBytes)) break;
      seqs.push_back(seq_of(buf.data()));
    }
    return seqs;
  }
  static std::vector<uint32_t> iota(size_t n) {
    std::vector<uint32_t> v(n);
    for (uint32_t i = 0; i < n; ++i) v[i] = i;
    return v;
  }

  Guest g;
  Driver rx, tx;
  std::array<UniqueFd, 2> kicks;
  irq::Engine engine{no_relay()};
  test::PairPort* port = nullptr;
  std::vector<uint32_t> received;
  std::vector<unsigned> slot_of_id = std::vector<unsigned>(kQueueSize, 0);
};

TYPED_TEST_SUITE(DeviceStateRoundTrip, test::RingKinds, test::RingKindNames);

TYPED_TEST(DeviceStateRoundTrip, ARunningDeviceSavedAndRestoredLosesAndRepeatsNothing) {
  auto owned = std::make_unique<test::PairPort>();
  this->port = owned.get();
  auto a = std::make_unique<NetDevice>(config(), this->engine, std::move(owned));
  this->wire(*a, false);

  // Wire -> guest: every frame offered at once, fewer buffers than frames.
  for (uint32_t s = 0; s < kFrames; ++s) {
    const auto f = frame(s);
    ASSERT_EQ(::send(this->port->peer(), f.data(), f.size(), 0), static_cast<ssize_t>(f.size()));
  }
  for (unsigned slot = 0; slot < kRxPosted; ++slot) this->post_rx(slot);
  this->kick(0);
  this->take_rx(kRxPosted, false);
  ASSERT_EQ(this->received.size(), kRxPosted) << "the first buffers filled";
  // Guest -> wire: half the frames posted and kicked, then the save comes
  // while the device may be anywhere in them.
  for (uint32_t s = 0; s < kFrames / 2; ++s) this->post_tx(s);
  this->kick(1);
  std::this_thread::sleep_for(1ms);  // not a synchronisation: any point of the stream is right

  const DeviceState saved = a->save_state();
  EXPECT_FALSE(a->running());
  const std::vector<uint8_t> bytes = saved.serialize();
  std::unique_ptr<PacketPort> released = a->release_port();
  ASSERT_TRUE(released);
  a.reset();

  auto b = std::make_unique<NetDevice>(config(), this->engine, std::move(released));
  const DeviceState parsed = DeviceState::parse(bytes, "the saved state");
  EXPECT_EQ(parsed, saved);
  b->restore_state(parsed);
  EXPECT_EQ(b->features(), saved.features);
  this->wire(*b, true);
  ASSERT_TRUE(b->running()) << "both queues restored ready";

  // The rest of the stream, both ways, through the restored device.
  for (uint32_t s = kFrames / 2; s < kFrames; ++s) this->post_tx(s);
  this->kick(1);
  for (unsigned slot = 0; slot < kRxPosted; ++slot) this->post_rx(slot);
  this->kick(0);
  this->take_rx(kFrames, true);
  EXPECT_EQ(this->received, this->iota(kFrames)) << "wire -> guest: every frame once, in order";
  EXPECT_EQ(this->wire_frames(kFrames), this->iota(kFrames)) << "guest -> wire: every frame once, in order";
  EXPECT_EQ(b->stats().queues.at(0).packets, uint64_t{kFrames - kRxPosted}) << "what the first device delivered "
                                                                               "is not delivered again";
}

// The message of what `fn` threw (std::invalid_argument), or "" when it did not.
template <typename F>
std::string refusal(F fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// A version-2 state after a change: its checksum made again, as a sender
// that meant it would.
std::vector<uint8_t> resealed(std::vector<uint8_t> b) {
  b.resize(b.size() - 4);
  const uint32_t crc = DeviceState::checksum(b);
  for (unsigned i = 0; i < 4; ++i) b.push_back(static_cast<uint8_t>(crc >> (8U * i)));
  return b;
}

// The same state as sriovd wrote it before part versions and checksums
// (frame version 1).
std::vector<uint8_t> as_version_1(const DeviceState& s) {
  std::vector<uint8_t> v2 = s.serialize();
  std::vector<uint8_t> b(v2.begin(), v2.end() - 4);  // no checksum
  b[4] = 1;
  const size_t queues_end = 22 + s.queues.size() * 31;  // magic, version, id, features, count; 31 bytes a queue
  b.erase(b.begin() + static_cast<std::ptrdiff_t>(queues_end),
          b.begin() + static_cast<std::ptrdiff_t>(queues_end + 4));  // the device part's version
  const size_t transport_at = queues_end + 4 + s.device.size();
  b.erase(b.begin() + static_cast<std::ptrdiff_t>(transport_at),
          b.begin() + static_cast<std::ptrdiff_t>(transport_at + 4));  // the transport part's
  return b;
}

TEST(DeviceState, EveryTruncationAndEveryBadHeaderIsRefused) {
  const DeviceState s{kDeviceIdNet, kVersion1, {QueueState{64, true, true, {0x1000, 0x2000, 0x3000}, 5}}, {1, 2, 3}, 1,
                      {4},          1};
  std::vector<uint8_t> bytes = s.serialize();
  EXPECT_EQ(DeviceState::parse(bytes, "st"), s);
  for (size_t n = 0; n < bytes.size(); ++n)
    EXPECT_THAT(refusal([&] { (void)DeviceState::parse(std::span(bytes.data(), n), "st"); }),
                ::testing::StartsWith("st: "))
        << "cut at " << n;
  auto longer = bytes;
  longer.push_back(0);
  EXPECT_THAT(refusal([&] { (void)DeviceState::parse(longer, "st"); }), ::testing::HasSubstr("damaged"));
  longer.insert(longer.end() - 5, 0);
  longer.pop_back();
  EXPECT_THAT(refusal([&] { (void)DeviceState::parse(resealed(longer), "st"); }),
              ::testing::HasSubstr("1 bytes left over"));
  auto magic = bytes;
  magic[0] ^= 1;
  EXPECT_THAT(refusal([&] { (void)DeviceState::parse(magic, "st"); }), ::testing::HasSubstr("not a device state"));
  auto version = bytes;
  version[4] = 3;
  EXPECT_THAT(refusal([&] { (void)DeviceState::parse(version, "st"); }),
              ::testing::HasSubstr("state version 3 (this sriovd reads 1 to 2)"));
  // Every bit flipped past the header is caught by the checksum.
  for (size_t i = 8; i < bytes.size(); ++i) {
    auto flipped = bytes;
    flipped[i] ^= 0x10;
    EXPECT_THAT(refusal([&] { (void)DeviceState::parse(flipped, "st"); }), ::testing::HasSubstr("damaged"))
        << "byte " << i;
  }
  auto queues = bytes;
  std::memset(queues.data() + 18, 0xff, 4);  // after magic, version, device id, features
  EXPECT_THAT(refusal([&] { (void)DeviceState::parse(resealed(queues), "st"); }),
              ::testing::HasSubstr("4294967295 queues"));
  auto flags = bytes;
  flags[24] = 0x80;  // the first queue's flags, after its size
  EXPECT_THAT(refusal([&] { (void)DeviceState::parse(resealed(flags), "st"); }),
              ::testing::HasSubstr("unknown flags 128"));
}

TEST(DeviceState, AVersion1StateIsStillRead) {
  const DeviceState s{kDeviceIdNet, kVersion1, {QueueState{64, true, true, {0x1000, 0x2000, 0x3000}, 5}}, {1, 2, 3}, 1,
                      {4, 5},       1};
  const std::vector<uint8_t> old = as_version_1(s);
  EXPECT_EQ(old.size() + 12, s.serialize().size());
  EXPECT_EQ(DeviceState::parse(old, "old"), s);  // its parts as their version 1
  for (size_t n = 0; n < old.size(); ++n)
    EXPECT_THAT(refusal([&] { (void)DeviceState::parse(std::span(old.data(), n), "old"); }),
                ::testing::StartsWith("old: "))
        << "cut at " << n;
}

TEST(DeviceState, AStateThatDoesNotFitIsRefusedNamingWhyAndChangesNothing) {
  irq::Engine engine{no_relay()};
  NetDevice d(config(), engine, std::make_unique<test::PairPort>());
  const DeviceState fresh = d.save_state();
  ASSERT_EQ(fresh.queues.size(), 2U);
  auto refused = [&](const DeviceState& st) {
    const std::string why = refusal([&] { d.restore_state(st); });
    EXPECT_EQ(d.save_state(), fresh) << "a refused state changed the device";
    return why;
  };
  DeviceState more = fresh;
  more.queues.emplace_back();
  EXPECT_THAT(refused(more), ::testing::HasSubstr("3 queues, this device has 2"));
  DeviceState other = fresh;
  other.device_id = 2;
  EXPECT_THAT(refused(other), ::testing::HasSubstr("device id 2, this device is 1"));
  DeviceState features = fresh;
  features.features = kVersion1 | (1ULL << 60U);
  EXPECT_THAT(refused(features), ::testing::HasSubstr("features 0x1000000000000000 this device does not offer"));
  DeviceState large = fresh;
  large.queues[1].size = 4096;
  EXPECT_THAT(refused(large), ::testing::HasSubstr("queue 1 size 4096 (at most 256)"));
  DeviceState pairs = fresh;
  pairs.device[10] = 5;  // after the MAC (8) and the RX mode (2): the pairs in use
  EXPECT_THAT(refused(pairs), ::testing::HasSubstr("5 queue pairs in use, the device has 1"));
  DeviceState newer = fresh;
  newer.device_version = 2;
  EXPECT_THAT(refused(newer),
              ::testing::HasSubstr("its device part is version 2, this sriovd's device reads version 1"));
  DeviceState cut = fresh;
  cut.device.pop_back();
  EXPECT_THAT(refused(cut), ::testing::HasSubstr("virtio-net state"));
  DeviceState held = fresh;
  held.device.resize(held.device.size() - 4);
  const uint32_t too_short = 3;  // a held packet shorter than its header
  for (unsigned i = 0; i < 4; ++i) held.device.push_back(static_cast<uint8_t>(too_short >> (8U * i)));
  held.device.insert(held.device.end(), {1, 2, 3});
  EXPECT_THAT(refused(held), ::testing::HasSubstr("a held packet shorter than its header"));
}

}  // namespace
}  // namespace sriovd::virtio
