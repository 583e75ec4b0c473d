#pragma once
// Virtqueues, device side, virtio 1.2 §2.7 (split) and §2.8 (packed), behind
// one interface. Every index, length and address the guest wrote is checked
// here; a malformed chain sets error() and the device goes to NEEDS_RESET
// instead of touching memory it was not given.
//
// Barriers are one-way at the synchronisation points: an acquire load of the
// avail index (split) or the descriptor flags (packed) before the descriptor
// is read, a release store of the used index (split) or used flags (packed)
// after the used element is written. The only full fence sits between
// publishing used entries and reading the driver's event suppression (the
// store->load order §2.7.10/§2.8.21 need). FullFence exists for the bench.

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>

#include "sriovd/virtio/dirty_log.hpp"
#include "sriovd/virtio/guest_memory.hpp"

namespace sriovd::virtio {

inline constexpr uint16_t kDescNext = 1;
inline constexpr uint16_t kDescWrite = 2;
inline constexpr uint16_t kDescIndirect = 4;
inline constexpr uint16_t kPackedAvail = 1U << 7U;
inline constexpr uint16_t kPackedUsed = 1U << 15U;
inline constexpr uint16_t kAvailNoInterrupt = 1;                                // split avail->flags
inline constexpr uint16_t kUsedNoNotify = 1;                                    // split used->flags
inline constexpr uint16_t kEventEnable = 0, kEventDisable = 1, kEventDesc = 2;  // packed event flags
inline constexpr uint16_t kMaxQueueSize = 32768;

// virtio 1.2 §2.7.5 and §2.8.13: one 16-byte descriptor each.
struct SplitDesc {
  uint64_t addr;
  uint32_t len;
  uint16_t flags;
  uint16_t next;
};
static_assert(sizeof(SplitDesc) == 16);
struct PackedDesc {
  uint64_t addr;
  uint32_t len;
  uint16_t id;
  uint16_t flags;
};
static_assert(sizeof(PackedDesc) == 16);
struct UsedElem {
  uint32_t id;
  uint32_t len;
};
static_assert(sizeof(UsedElem) == 8);
struct EventSuppress {  // §2.8.14
  uint16_t off_wrap;
  uint16_t flags;
};
static_assert(sizeof(EventSuppress) == 4);

enum class RingError : uint8_t {
  none,
  bad_avail_index,  // the driver claims more buffers than the ring holds
  bad_head,         // a descriptor index >= queue size
  chain_too_long,   // more descriptors than the queue size (a loop), or than the caller's segments
  bad_address,      // a buffer outside guest memory
  bad_indirect,     // INDIRECT with NEXT, nested, empty, or a length not a multiple of 16
  write_then_read,  // a device-readable buffer after a device-writable one (§2.7.4.2)
  iotlb_miss,       // not an error: an IOVA the IOTLB lacks; the pop is retried once it is answered
};
const char* to_string(RingError);

struct Segment {
  uint8_t* data = nullptr;
  uint32_t len = 0;
  bool writable = false;
};

// One buffer as popped: its segments live in the caller's span.
struct Chain {
  uint16_t id = 0;        // split: head index; packed: buffer id
  uint16_t slots = 0;     // ring slots it took (packed: how far to skip)
  uint16_t readable = 0;  // segments [0, readable) are device-readable
  uint16_t count = 0;     // segments [readable, count) are device-writable
  uint32_t readable_bytes = 0;
  uint32_t writable_bytes = 0;
  // Inflight tracking (vhost-user INFLIGHT_SHMFD): the chain came from the
  // inflight region (a back-end restart), and which region entry is its
  // head (packed rings keep their own entries).
  bool resubmitted = false;
  uint16_t inflight_entry = 0;
};

// Where the three parts of a ring are, in guest physical addresses.
struct RingAddresses {
  uint64_t desc = 0;
  uint64_t driver = 0;  // split: avail ring; packed: driver event suppression
  uint64_t device = 0;  // split: used ring; packed: device event suppression
  friend bool operator==(const RingAddresses&, const RingAddresses&) = default;
};

enum class Barriers { one_way, full_fence };

// vhost-user inflight I/O tracking (INFLIGHT_SHMFD, "Inflight I/O
// tracking" in the vhost-user spec): one region per queue in a buffer the
// front-end keeps across back-end restarts. A queue given a region records
// every buffer it takes and hands back there; a queue started on a region
// a previous back-end left behind first hands out again, in the order they
// were taken, the buffers that back-end took and never returned. Each region
// has room for the packed layout (the larger one), so where a queue's
// region lies does not depend on the ring format negotiated later.
inline constexpr uint64_t inflight_queue_bytes(uint16_t queue_size) {
  return (32ULL + 32ULL * queue_size + 63ULL) & ~63ULL;
}

class Virtqueue {
 public:
  virtual ~Virtqueue() = default;
  // The next available buffer, its segments in `segs`. false: none, or the
  // ring is broken (error() says why; it stays broken).
  virtual bool pop(Chain& chain, std::span<Segment> segs) = 0;
  // Returns a buffer to the driver with `written` bytes written: add_used()
  // then publish_used().
  void push(const Chain& chain, uint32_t written) {
    add_used(chain, written);
    publish_used();
  }
  // A burst: each buffer's used entry written (split: the used element;
  // packed: the used descriptor, all but the first's flags), and the burst
  // made visible to the driver at once by publish_used() (split: one
  // release store of the used index; packed: the first descriptor's flags,
  // stored last with release, so the driver, which reads used descriptors
  // in order, sees none of the burst before all of it). A queue with an
  // inflight region publishes each buffer as it goes (the region's steps
  // are per buffer). Nothing is visible to the driver before publish_used();
  // should_notify() and base() assume it ran.
  virtual void add_used(const Chain& chain, uint32_t written) = 0;
  virtual void publish_used() = 0;
  // Puts back the most recently popped, not yet pushed chain (a device that
  // found too few buffers for a packet undoes its pops, latest first).
  virtual void rewind(const Chain& chain) = 0;
  // Where the device stands, as vhost-user GET/SET_VRING_BASE carry it:
  // split: the next avail index; packed: avail index | wrap << 15 in the
  // low half, used index | wrap << 15 in the high half (a high half of 0
  // given at setup means "used where avail is").
  [[nodiscard]] virtual uint32_t base() const = 0;
  // After pushes (published): does the driver want to be interrupted
  // (flags / event idx)?
  virtual bool should_notify() = 0;
  // Before the device sleeps: asks the driver to kick for anything it adds
  // after what was popped (EVENT_IDX: avail_event / the device event
  // offset; else the no-notify flag cleared). True when buffers arrived in
  // the meantime: pop again instead of sleeping.
  virtual bool enable_kicks() = 0;
  [[nodiscard]] virtual uint16_t size() const = 0;
  [[nodiscard]] RingError error() const { return error_; }
  [[nodiscard]] bool broken() const { return error_ != RingError::none; }
  // The last pop found an IOVA the IOTLB does not translate yet: the
  // buffer stays available and the miss has been reported.
  [[nodiscard]] bool stalled() const { return stalled_; }
  // Buffers found in flight in the inflight region at setup, handed out
  // again before anything new.
  [[nodiscard]] size_t recovered() const { return recovered_; }

 protected:
  bool fail(RingError e) {
    error_ = e;
    return false;
  }
  // A failed chain walk: an IOTLB miss stalls (no index moves), anything
  // else breaks the ring.
  bool fail_or_stall(RingError e) {
    if (e == RingError::iotlb_miss) {
      stalled_ = true;
      return false;
    }
    return fail(e);
  }
  RingError error_ = RingError::none;
  bool stalled_ = false;
  size_t recovered_ = 0;
};

// Throws std::invalid_argument when the size is bad or a ring part is not in
// guest memory (checked once here: the O(1) ring-metadata translation), or
// when an inflight region left behind is inconsistent. `inflight`: the
// queue's region (inflight_queue_bytes(size) bytes at least), or null.
// `log`: where the ring marks what it writes (live migration), or nothing.
std::unique_ptr<Virtqueue> make_split_queue(const GuestMemory& mem, uint16_t size, const RingAddresses& rings,
                                            bool event_idx, Barriers barriers = Barriers::one_way, uint32_t base = 0,
                                            uint8_t* inflight = nullptr, RingLog log = {});
std::unique_ptr<Virtqueue> make_packed_queue(const GuestMemory& mem, uint16_t size, const RingAddresses& rings,
                                             bool event_idx, Barriers barriers = Barriers::one_way, uint32_t base = 0,
                                             uint8_t* inflight = nullptr, RingLog log = {});

// Bytes of each ring part (for drivers laying rings out).
struct RingLayout {
  uint64_t desc_bytes, driver_bytes, device_bytes;
};
RingLayout split_layout(uint16_t size);
RingLayout packed_layout(uint16_t size);

}  // namespace sriovd::virtio
