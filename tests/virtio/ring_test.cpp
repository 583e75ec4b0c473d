// Split and packed virtqueues, device side, driven by the driver side as a
// guest would: chains, indirect tables, wrap-around, notification
// suppression, and every malformed input the device must survive.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "sriovd/guest/virtqueue.hpp"
#include "virtio/guest_ram.hpp"

namespace sriovd::virtio {
namespace {

using guest::Buffer;
using guest::PackedDriver;
using guest::SplitDriver;

constexpr uint64_t kBase = test::kGuestBase;
constexpr uint64_t kMemSize = test::kGuestRamSize;
constexpr uint64_t kData = kBase + 0x80000;

using Guest = test::GuestRam;

template <bool Packed>
struct Rig {
  using Driver = std::conditional_t<Packed, PackedDriver, SplitDriver>;
  explicit Rig(uint16_t size = 8, bool event_idx = false)
      : driver(g.at(kBase), kBase, size),
        queue(Packed ? make_packed_queue(g.mem, size, driver.addresses(), event_idx)
                     : make_split_queue(g.mem, size, driver.addresses(), event_idx)) {}
  int add(std::initializer_list<Buffer> chain) {
    const int id = driver.add(std::vector<Buffer>(chain));
    if constexpr (!Packed) driver.publish();
    return id;
  }
  Guest g;
  Driver driver;
  std::unique_ptr<Virtqueue> queue;
  std::array<Segment, 16> segs{};
};

template <typename T>
class Rings : public ::testing::Test {};
TYPED_TEST_SUITE(Rings, test::RingKinds, test::RingKindNames);

TYPED_TEST(Rings, EmptyRingHasNothing) {
  Rig<TypeParam::value> r;
  Chain c;
  EXPECT_FALSE(r.queue->pop(c, r.segs));
  EXPECT_FALSE(r.queue->broken());
}

TYPED_TEST(Rings, ChainOfReadableThenWritableSegments) {
  Rig<TypeParam::value> r;
  std::memcpy(r.g.at(kData), "hello", 5);
  const int id = r.add({{kData, 5, false}, {kData + 0x1000, 100, true}, {kData + 0x2000, 50, true}});
  ASSERT_GE(id, 0);
  Chain c;
  ASSERT_TRUE(r.queue->pop(c, r.segs));
  EXPECT_EQ(c.id, id);
  EXPECT_EQ(c.count, 3);
  EXPECT_EQ(c.readable, 1);
  EXPECT_EQ(c.readable_bytes, 5U);
  EXPECT_EQ(c.writable_bytes, 150U);
  EXPECT_EQ(std::memcmp(r.segs[0].data, "hello", 5), 0);
  EXPECT_TRUE(r.segs[1].writable);
  std::memcpy(r.segs[1].data, "world", 5);
  r.queue->push(c, 5);
  uint32_t used_id = 0, len = 0;
  ASSERT_TRUE(r.driver.take_used(used_id, len));
  EXPECT_EQ(used_id, static_cast<uint32_t>(id));
  EXPECT_EQ(len, 5U);
  EXPECT_EQ(std::memcmp(r.g.at(kData + 0x1000), "world", 5), 0);
  EXPECT_FALSE(r.queue->pop(c, r.segs));
}

// A burst of used buffers is invisible to the driver until publish_used(),
// then all of it at once, in order, across the ring's wrap (packed: the
// first descriptor's flags, stored last; split: one used index store).
TYPED_TEST(Rings, ABurstOfUsedBuffersIsPublishedAtOnce) {
  Rig<TypeParam::value> r(8);
  for (int lap = 0; lap < 5; ++lap) {
    std::vector<int> ids;
    for (int i = 0; i < 6; ++i) ids.push_back(r.add({{kData + static_cast<uint64_t>(i) * 64, 64, true}}));
    std::vector<Chain> chains(6);
    for (auto& c : chains) ASSERT_TRUE(r.queue->pop(c, r.segs)) << to_string(r.queue->error());
    for (size_t i = 0; i < chains.size(); ++i) r.queue->add_used(chains[i], static_cast<uint32_t>(10 + i));
    uint32_t used_id = 0, len = 0;
    EXPECT_FALSE(r.driver.take_used(used_id, len)) << "lap " << lap << ": a used buffer visible before publish_used()";
    r.queue->publish_used();
    for (size_t i = 0; i < chains.size(); ++i) {
      ASSERT_TRUE(r.driver.take_used(used_id, len)) << "lap " << lap << ", buffer " << i;
      EXPECT_EQ(used_id, static_cast<uint32_t>(ids[i]));
      EXPECT_EQ(len, 10 + i);
    }
    EXPECT_FALSE(r.driver.take_used(used_id, len));
    r.queue->publish_used();  // nothing new: no change
    EXPECT_FALSE(r.driver.take_used(used_id, len));
  }
}

TYPED_TEST(Rings, IndirectTable) {
  Rig<TypeParam::value> r;
  const std::vector<Buffer> chain = {{kData, 10, false}, {kData + 0x100, 20, false}, {kData + 0x200, 30, true}};
  const uint64_t table = kBase + 0x40000;
  const int id = r.driver.add_indirect(table, r.g.at(table), chain);
  if constexpr (!TypeParam::value) r.driver.publish();
  Chain c;
  ASSERT_TRUE(r.queue->pop(c, r.segs)) << to_string(r.queue->error());
  EXPECT_EQ(c.id, id);
  EXPECT_EQ(c.count, 3);
  EXPECT_EQ(c.readable_bytes, 30U);
  EXPECT_EQ(c.writable_bytes, 30U);
}

TYPED_TEST(Rings, ManyLapsAroundASmallRing) {
  Rig<TypeParam::value> r(4);
  for (int i = 0; i < 1000; ++i) {
    const int id = r.add({{kData + static_cast<uint64_t>(i % 7) * 64, 64, i % 2 == 0}, {kData, 8, true}});
    ASSERT_GE(id, 0) << i;
    Chain c;
    ASSERT_TRUE(r.queue->pop(c, r.segs)) << i << ": " << to_string(r.queue->error());
    ASSERT_EQ(c.id, id);
    r.queue->push(c, static_cast<uint32_t>(i));
    uint32_t used_id = 0, len = 0;
    ASSERT_TRUE(r.driver.take_used(used_id, len));
    EXPECT_EQ(len, static_cast<uint32_t>(i));
  }
}

// A device stopped and started again (a feature change, a new log, the
// rings handed to another back-end) continues from base(), wherever the
// ring stands - every slot of three laps, the two lap boundaries among
// them (packed: position 0 with wrap counters 0 reads as base 0, as a
// fresh ring does).
TYPED_TEST(Rings, ARingRestartedFromItsBaseAnywhereGoesOn) {
  constexpr uint16_t kSize = 4;
  Rig<TypeParam::value> r(kSize);
  for (int i = 0; i < 3 * kSize; ++i) {
    const uint32_t base = r.queue->base();
    r.queue = TypeParam::value ? make_packed_queue(r.g.mem, kSize, r.driver.addresses(), false, Barriers::one_way, base)
                               : make_split_queue(r.g.mem, kSize, r.driver.addresses(), false, Barriers::one_way, base);
    const int id = r.add({{kData, 64, true}});
    ASSERT_GE(id, 0) << i;
    Chain c;
    ASSERT_TRUE(r.queue->pop(c, r.segs)) << "position " << i << ", base 0x" << std::hex << base;
    ASSERT_EQ(c.id, id);
    r.queue->push(c, static_cast<uint32_t>(i));
    uint32_t used_id = 0, len = 0;
    ASSERT_TRUE(r.driver.take_used(used_id, len)) << i;
    EXPECT_EQ(len, static_cast<uint32_t>(i));
  }
}

// With a dirty log (live migration) every write of the ring into guest
// memory marks its page, where the front-end said the device area is
// (log_guest_addr) or by its guest address; without one, nothing.
TYPED_TEST(Rings, EveryRingWriteIsMarkedInTheDirtyLog) {
  constexpr bool kPacked = TypeParam::value;
  std::vector<uint8_t> bits(128);  // guest addresses below 4 MiB
  Guest g;
  const DirtyLog dirty(bits.data(), bits.size(), g.mem);
  auto page_marked = [&](uint64_t gpa) { return (bits[gpa / 4096 / 8] >> (gpa / 4096 % 8)) & 1; };
  using Driver = std::conditional_t<kPacked, PackedDriver, SplitDriver>;
  Driver driver(g.at(kBase), kBase, 8);
  const RingAddresses a = driver.addresses();
  uint32_t base = 0;
  for (const uint64_t where : {RingLog::kByHost, uint64_t{0x200000}}) {
    SCOPED_TRACE(where == RingLog::kByHost ? "by host pointer" : "at log_guest_addr");
    std::fill(bits.begin(), bits.end(), 0);
    auto q = kPacked ? make_packed_queue(g.mem, 8, a, true, Barriers::one_way, base, nullptr, {&dirty, where})
                     : make_split_queue(g.mem, 8, a, true, Barriers::one_way, base, nullptr, {&dirty, where});
    const Buffer b{kData, 64, true};
    (void)driver.add({&b, 1});
    if constexpr (!kPacked) driver.publish();
    Chain c;
    std::array<Segment, 4> segs{};
    ASSERT_TRUE(q->pop(c, segs));
    EXPECT_EQ(std::count_if(bits.begin(), bits.end(), [](uint8_t v) { return v != 0; }), 0) << "a pop writes nothing";
    q->push(c, 64);
    (void)q->enable_kicks();
    const uint64_t device_area = where == RingLog::kByHost ? a.device : where;
    if (kPacked) {
      EXPECT_TRUE(page_marked(a.desc)) << "the used descriptor";
      EXPECT_TRUE(page_marked(device_area)) << "the device event suppression";
    } else {
      EXPECT_TRUE(page_marked(device_area)) << "the used element and index";
      EXPECT_TRUE(page_marked(device_area + 4 + 8 * 8)) << "avail_event";
    }
    EXPECT_FALSE(page_marked(kData)) << "the buffer is the device's to mark, not the ring's";
    EXPECT_EQ(dirty.missed(), 0U);
    uint32_t id = 0, len = 0;
    ASSERT_TRUE(driver.take_used(id, len));
    base = q->base();
  }
}

TYPED_TEST(Rings, BufferOutsideGuestMemoryBreaksTheQueue) {
  Rig<TypeParam::value> r;
  r.add({{kBase + kMemSize - 4, 8, false}});  // straddles the end of RAM
  Chain c;
  EXPECT_FALSE(r.queue->pop(c, r.segs));
  EXPECT_EQ(r.queue->error(), RingError::bad_address);
  r.add({{kData, 8, false}});
  EXPECT_FALSE(r.queue->pop(c, r.segs)) << "a broken queue stays broken until reset";
}

TYPED_TEST(Rings, AddressWrapAroundIsOutside) {
  Rig<TypeParam::value> r;
  r.add({{~0ULL - 2, 16, false}});
  Chain c;
  EXPECT_FALSE(r.queue->pop(c, r.segs));
  EXPECT_EQ(r.queue->error(), RingError::bad_address);
}

TYPED_TEST(Rings, ReadableAfterWritableIsRefused) {
  Rig<TypeParam::value> r;
  r.add({{kData, 8, true}, {kData + 64, 8, false}});
  Chain c;
  EXPECT_FALSE(r.queue->pop(c, r.segs));
  EXPECT_EQ(r.queue->error(), RingError::write_then_read);
}

TYPED_TEST(Rings, MoreSegmentsThanTheDeviceTakesIsRefused) {
  Rig<TypeParam::value> r(32);
  std::vector<Buffer> chain(20, Buffer{kData, 8, false});
  r.driver.add(chain);
  if constexpr (!TypeParam::value) r.driver.publish();
  Chain c;
  EXPECT_FALSE(r.queue->pop(c, r.segs));  // 16 segments of room
  EXPECT_EQ(r.queue->error(), RingError::chain_too_long);
}

TYPED_TEST(Rings, IndirectTableOfBadLengthIsRefused) {
  Rig<TypeParam::value> r;
  const uint64_t table = kBase + 0x40000;
  const std::vector<Buffer> chain = {{kData, 8, false}};
  const int id = r.driver.add_indirect(table, r.g.at(table), chain);
  if constexpr (!TypeParam::value) r.driver.publish();
  // 24 bytes: not a whole number of descriptors.
  r.driver.desc()[TypeParam::value ? 0 : id].len = 24;
  Chain c;
  EXPECT_FALSE(r.queue->pop(c, r.segs));
  EXPECT_EQ(r.queue->error(), RingError::bad_indirect);
}

TEST(SplitRing, HeadOutOfRangeIsRefused) {
  Rig<false> r;
  r.add({{kData, 8, false}});
  r.driver.avail()[2] = 99;
  Chain c;
  EXPECT_FALSE(r.queue->pop(c, r.segs));
  EXPECT_EQ(r.queue->error(), RingError::bad_head);
}

TEST(SplitRing, AvailIndexAheadOfTheRingIsRefused) {
  Rig<false> r;
  r.driver.avail()[1] = 9;  // 9 buffers in an 8-entry ring
  Chain c;
  EXPECT_FALSE(r.queue->pop(c, r.segs));
  EXPECT_EQ(r.queue->error(), RingError::bad_avail_index);
}

TEST(SplitRing, ADescriptorLoopIsCaught) {
  Rig<false> r;
  const int head = r.add({{kData, 8, false}, {kData + 8, 8, false}});
  SplitDesc* d = r.driver.desc();
  const uint16_t second = d[head].next;
  d[second].flags |= kDescNext;
  d[second].next = static_cast<uint16_t>(head);  // back to the head
  Chain c;
  std::array<Segment, 64> many{};
  EXPECT_FALSE(r.queue->pop(c, many));
  EXPECT_EQ(r.queue->error(), RingError::chain_too_long);
}

TEST(SplitRing, NextOutOfRangeIsRefused) {
  Rig<false> r;
  const int head = r.add({{kData, 8, false}, {kData + 8, 8, false}});
  r.driver.desc()[head].next = 1000;
  Chain c;
  EXPECT_FALSE(r.queue->pop(c, r.segs));
  EXPECT_EQ(r.queue->error(), RingError::bad_head);
}

TEST(SplitRing, IndirectWithNextOrNestedIsRefused) {
  {
    Rig<false> r;
    const uint64_t table = kBase + 0x40000;
    const std::vector<Buffer> chain = {{kData, 8, false}};
    const int head = r.driver.add_indirect(table, r.g.at(table), chain);
    r.driver.desc()[head].flags |= kDescNext;
    r.driver.publish();
    Chain c;
    EXPECT_FALSE(r.queue->pop(c, r.segs));
    EXPECT_EQ(r.queue->error(), RingError::bad_indirect);
  }
  Rig<false> r;
  const uint64_t table = kBase + 0x40000;
  const std::vector<Buffer> chain = {{kData, 8, false}};
  r.driver.add_indirect(table, r.g.at(table), chain);
  reinterpret_cast<SplitDesc*>(r.g.at(table))[0].flags = kDescIndirect;  // nested
  r.driver.publish();
  Chain c;
  EXPECT_FALSE(r.queue->pop(c, r.segs));
  EXPECT_EQ(r.queue->error(), RingError::bad_indirect);
}

TEST(SplitRing, EventIdxAndNoInterrupt) {
  Rig<false> r(8, /*event_idx=*/true);
  r.driver.set_used_event(1);  // "interrupt me when used idx passes 1"
  Chain c;
  for (int i = 0; i < 3; ++i) r.add({{kData, 8, true}});
  ASSERT_TRUE(r.queue->pop(c, r.segs));
  r.queue->push(c, 0);
  EXPECT_FALSE(r.queue->should_notify());  // used idx 1: not past 1 yet
  ASSERT_TRUE(r.queue->pop(c, r.segs));
  r.queue->push(c, 0);
  EXPECT_TRUE(r.queue->should_notify());  // used idx 2 passed event 1
  ASSERT_TRUE(r.queue->pop(c, r.segs));
  r.queue->push(c, 0);
  EXPECT_FALSE(r.queue->should_notify());  // already told past 1
  Rig<false> flags(8, false);
  flags.driver.set_no_interrupt(true);
  flags.add({{kData, 8, true}});
  ASSERT_TRUE(flags.queue->pop(c, flags.segs));
  flags.queue->push(c, 0);
  EXPECT_FALSE(flags.queue->should_notify());
  flags.driver.set_no_interrupt(false);
  EXPECT_TRUE(flags.queue->should_notify());
}

// The device asks for kicks before sleeping (§2.7.10): with EVENT_IDX it
// publishes avail_event = the next index it will read, and reports buffers
// that arrived in between so that none is left without a kick.
TEST(SplitRing, EnableKicksPublishesAvailEventAndCatchesLateBuffers) {
  Rig<false> r(8, /*event_idx=*/true);
  Chain c;
  r.add({{kData, 8, false}});
  r.add({{kData, 8, false}});
  ASSERT_TRUE(r.queue->pop(c, r.segs));
  ASSERT_TRUE(r.queue->pop(c, r.segs));
  EXPECT_FALSE(r.queue->enable_kicks());
  const auto* used = r.g.at(r.driver.addresses().device);
  uint16_t avail_event;
  std::memcpy(&avail_event, used + 4 + 8 * 8, sizeof avail_event);
  EXPECT_EQ(avail_event, 2) << "kick me when you publish index 2";
  r.add({{kData, 8, false}});
  EXPECT_TRUE(r.queue->enable_kicks()) << "a buffer that came before the sleep";
  Rig<false> flags(8, /*event_idx=*/false);
  EXPECT_FALSE(flags.queue->enable_kicks());
}

TEST(PackedRing, EnableKicksSetsTheDeviceEventOffset) {
  Rig<true> r(8, /*event_idx=*/true);
  Chain c;
  r.add({{kData, 8, false}});
  ASSERT_TRUE(r.queue->pop(c, r.segs));
  EXPECT_FALSE(r.queue->enable_kicks());
  EventSuppress dev;
  std::memcpy(&dev, r.g.at(r.driver.addresses().device), sizeof dev);
  EXPECT_EQ(dev.flags, kEventDesc);
  EXPECT_EQ(dev.off_wrap, 1U | (1U << 15U));
  r.add({{kData, 8, false}});
  EXPECT_TRUE(r.queue->enable_kicks());
}

TEST(PackedRing, EventSuppression) {
  Rig<true> r(8, /*event_idx=*/true);
  Chain c;
  r.driver.set_event(kEventDisable);
  r.add({{kData, 8, true}});
  ASSERT_TRUE(r.queue->pop(c, r.segs));
  r.queue->push(c, 0);
  EXPECT_FALSE(r.queue->should_notify());
  r.driver.set_event(kEventEnable);
  EXPECT_TRUE(r.queue->should_notify());
  // Descriptor-specific: notify once the used index passes 2 (wrap bit 1).
  r.driver.set_event(kEventDesc, static_cast<uint16_t>(2U | (1U << 15U)));
  r.add({{kData, 8, true}});
  ASSERT_TRUE(r.queue->pop(c, r.segs));
  r.queue->push(c, 0);
  EXPECT_FALSE(r.queue->should_notify());  // used index 2: event 2 not passed
  r.add({{kData, 8, true}});
  ASSERT_TRUE(r.queue->pop(c, r.segs));
  r.queue->push(c, 0);
  EXPECT_TRUE(r.queue->should_notify());  // used index 3 passed 2
}

TEST(PackedRing, ADescriptorNotYetAvailableInAChainIsRefused) {
  Rig<true> r;
  r.add({{kData, 8, false}, {kData + 8, 8, false}});
  r.driver.desc()[1].flags = kDescNext;  // second descriptor from no lap at all
  r.driver.desc()[0].flags |= kDescNext;
  Chain c;
  EXPECT_FALSE(r.queue->pop(c, r.segs));
  EXPECT_EQ(r.queue->error(), RingError::bad_head);
}

TEST(Rings, BadSizesAndRingsOutsideMemoryAreRejected) {
  Guest g;
  RingAddresses a{kBase, kBase + 0x1000, kBase + 0x2000};
  EXPECT_THROW(make_split_queue(g.mem, 100, a, false), std::invalid_argument);
  EXPECT_THROW(make_split_queue(g.mem, 0, a, false), std::invalid_argument);
  EXPECT_NO_THROW(make_packed_queue(g.mem, 100, a, false));
  RingAddresses outside{kBase + kMemSize - 8, kBase, kBase + 0x2000};
  EXPECT_THROW(make_split_queue(g.mem, 8, outside, false), std::invalid_argument);
  RingAddresses misaligned{kBase + 8, kBase + 0x1000, kBase + 0x2000};
  EXPECT_THROW(make_packed_queue(g.mem, 8, misaligned, false), std::invalid_argument);
}

// Driver and device on two threads: the one-way barriers must be enough.
TYPED_TEST(Rings, TwoThreadsHandOverEveryBuffer) {
  Rig<TypeParam::value> r(64);
  constexpr int kBuffers = 200000;
  std::atomic<bool> done{false};
  std::thread device([&] {
    Chain c;
    int served = 0;
    while (served < kBuffers) {
      if (r.queue->pop(c, r.segs)) {
        r.queue->push(c, c.readable_bytes);
        ++served;
      } else if (r.queue->broken()) {
        break;
      }
    }
    done = true;
  });
  int sent = 0, received = 0;
  uint64_t len_sum = 0;
  while (received < kBuffers && !(done && received < sent && r.queue->broken())) {
    while (sent < kBuffers &&
           r.add({{kData + static_cast<uint64_t>(sent % 64) * 16, static_cast<uint32_t>(sent % 97 + 1), false}}) >= 0)
      ++sent;
    uint32_t id, len;
    while (r.driver.take_used(id, len)) {
      ++received;
      len_sum += len;
    }
  }
  device.join();
  EXPECT_FALSE(r.queue->broken()) << to_string(r.queue->error());
  EXPECT_EQ(received, kBuffers);
  uint64_t expected = 0;
  for (int i = 0; i < kBuffers; ++i) expected += static_cast<uint64_t>(i % 97 + 1);
  EXPECT_EQ(len_sum, expected);
}

}  // namespace
}  // namespace sriovd::virtio

namespace sriovd::virtio {
namespace {

using guest::Buffer;
using guest::PackedDriver;
using guest::SplitDriver;

// Issue 11, item 5: after recovery validated the inflight region, the
// front-end rewrote an entry's descriptor count (and counters) in the
// shared region; the re-read count overran the descriptor ring on push.
// The device now uses the copies it validated.
TEST(InflightRegion, ACountRewrittenAfterRecoveryIsNotReadAgain) {
  Guest g;
  constexpr uint16_t kSize = 8;
  PackedDriver driver(g.at(kBase), kBase, kSize);
  alignas(64) std::array<uint8_t, inflight_queue_bytes(kSize)> region{};
  std::array<Segment, 16> segs{};
  {
    auto before = make_packed_queue(g.mem, kSize, driver.addresses(), false, Barriers::one_way, 0, region.data());
    const Buffer b{kData, 64, false};
    ASSERT_GE(driver.add({&b, 1}), 0);
    Chain c;
    ASSERT_TRUE(before->pop(c, segs));  // taken, never returned: the crash
  }
  auto after = make_packed_queue(g.mem, kSize, driver.addresses(), false, Barriers::one_way, 0, region.data());
  ASSERT_EQ(after->recovered(), 1U);
  // The front-end rewrites every entry's count and counter.
  for (uint16_t i = 0; i < kSize; ++i) {
    uint8_t* e = region.data() + 32 + 32 * i;
    const uint16_t huge = 0xffff;
    const uint64_t counter = 0x8000000000000000ULL - i;
    std::memcpy(e + 6, &huge, 2);
    std::memcpy(e + 8, &counter, 8);
  }
  Chain c;
  ASSERT_TRUE(after->pop(c, segs));
  EXPECT_TRUE(c.resubmitted);
  EXPECT_EQ(c.slots, 1U);  // the count recovery checked, not the one rewritten
  after->push(c, 0);
  uint32_t id = 0, len = 0;
  EXPECT_TRUE(driver.take_used(id, len));
  // And the ring goes on: a new buffer, taken and returned.
  const Buffer b{kData, 64, false};
  ASSERT_GE(driver.add({&b, 1}), 0);
  ASSERT_TRUE(after->pop(c, segs));
  EXPECT_FALSE(c.resubmitted);
  after->push(c, 0);
  EXPECT_TRUE(driver.take_used(id, len));
  EXPECT_FALSE(after->broken());
}

}  // namespace
}  // namespace sriovd::virtio
