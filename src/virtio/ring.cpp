#include "sriovd/virtio/ring.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace sriovd::virtio {

const char* to_string(RingError e) {
  switch (e) {
    case RingError::none: return "none";
    case RingError::bad_avail_index: return "avail index ahead of the ring";
    case RingError::bad_head: return "descriptor index out of range";
    case RingError::chain_too_long: return "descriptor chain too long (loop?)";
    case RingError::bad_address: return "buffer outside guest memory";
    case RingError::bad_indirect: return "malformed indirect descriptor";
    case RingError::write_then_read: return "device-readable buffer after a device-writable one";
    case RingError::iotlb_miss: return "IOTLB miss";
  }
  return "?";
}

RingLayout split_layout(uint16_t size) {
  // §2.7: desc 16*n; avail 6+2n (flags, idx, ring, used_event); used 6+8n.
  return {16ULL * size, 6ULL + 2ULL * size, 6ULL + 8ULL * size};
}
RingLayout packed_layout(uint16_t size) { return {16ULL * size, 4, 4}; }

namespace {

template <Barriers B>
uint16_t load_acquire(const uint16_t& v) {
  if constexpr (B == Barriers::one_way) {
    return std::atomic_ref<const uint16_t>(v).load(std::memory_order_acquire);
  } else {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    const uint16_t x = std::atomic_ref<const uint16_t>(v).load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    return x;
  }
}

template <Barriers B>
void store_release(uint16_t& v, uint16_t x) {
  if constexpr (B == Barriers::one_way) {
    std::atomic_ref<uint16_t>(v).store(x, std::memory_order_release);
  } else {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    std::atomic_ref<uint16_t>(v).store(x, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
}

// vring_need_event (§2.7.10): did [old, new) pass the driver's event index?
bool need_event(uint16_t event, uint16_t new_idx, uint16_t old_idx) {
  return static_cast<uint16_t>(new_idx - event - 1) < static_cast<uint16_t>(new_idx - old_idx);
}

// The inflight regions, as the vhost-user spec lays them out.
struct InflightSplitHeader {
  uint64_t features;
  uint16_t version;  // 1; 0: a fresh buffer
  uint16_t desc_num;
  uint16_t last_batch_head;
  uint16_t used_idx;
};
static_assert(sizeof(InflightSplitHeader) == 16);
struct InflightSplitDesc {
  uint8_t inflight;
  uint8_t padding[5];
  uint16_t next;
  uint64_t counter;
};
static_assert(sizeof(InflightSplitDesc) == 16);
struct InflightPackedHeader {
  uint64_t features;
  uint16_t version;
  uint16_t desc_num;
  uint16_t free_head;
  uint16_t old_free_head;
  uint16_t used_idx;
  uint16_t old_used_idx;
  uint8_t used_wrap_counter;
  uint8_t old_used_wrap_counter;
  uint8_t padding[10];
};
static_assert(sizeof(InflightPackedHeader) == 32);
struct InflightPackedDesc {
  uint8_t inflight;
  uint8_t padding;
  uint16_t next;
  uint16_t last;
  uint16_t num;
  uint64_t counter;
  uint16_t id;
  uint16_t flags;
  uint32_t len;
  uint64_t addr;
};
static_assert(sizeof(InflightPackedDesc) == 32);
constexpr uint16_t kInflightVersion = 1;

// Stores into the inflight region stay in program order (release): after
// a crash the front-end's copy must show them in the order the spec's
// steps make them.
template <typename T>
void publish(T& field, T value) {
  std::atomic_ref<T>(field).store(value, std::memory_order_release);
}

[[noreturn]] void bad_inflight(const std::string& why) {
  throw std::invalid_argument("inflight region left by the previous back-end is inconsistent: " + why);
}

// Aligned guest addresses can still land misaligned in the daemon: an IOTLB
// entry (or a memory region) whose front-end address is not aligned like its
// IOVA. The rings are read with atomic loads of their natural size, which
// must not straddle.
bool misaligned(const void* p, uintptr_t alignment) { return reinterpret_cast<uintptr_t>(p) % alignment != 0; }
constexpr const char* kHostMisaligned =
    "ring parts are misaligned where they are mapped (an IOTLB entry or memory region whose front-end address is "
    "aligned differently from the guest address)";

// A buffer a previous back-end left in flight, as read once from the region.
struct Resubmit {
  uint16_t head;
  uint16_t num;  // packed: descriptors in the chain
  uint64_t counter;
};

void sort_by_counter(std::vector<Resubmit>& v) {
  std::sort(v.begin(), v.end(), [](const Resubmit& a, const Resubmit& b) { return a.counter < b.counter; });
}

// Adds one buffer segment, checking its address and the read-then-write order.
bool add_segment(const GuestMemory& mem, uint64_t addr, uint32_t len, bool writable, Chain& c, std::span<Segment> segs,
                 RingError& err) {
  if (writable == false && c.count > c.readable) {
    err = RingError::write_then_read;
    return false;
  }
  if (c.count >= segs.size()) {
    err = RingError::chain_too_long;
    return false;
  }
  uint8_t* p = mem.translate(addr, len, writable);
  if (!p && len > 0) {
    err = mem.iotlb_miss(addr, len, writable) ? RingError::iotlb_miss : RingError::bad_address;
    return false;
  }
  segs[c.count++] = {p, len, writable};
  if (writable) {
    c.writable_bytes += len;
  } else {
    ++c.readable;
    c.readable_bytes += len;
  }
  return true;
}

// Segments of an indirect table (§2.7.5.3 / §2.8.19): entries are split or
// packed descriptors; no nesting, and a table within guest memory.
template <typename Desc>
bool add_indirect(const GuestMemory& mem, uint64_t addr, uint32_t len, Chain& c, std::span<Segment> segs,
                  RingError& err) {
  if (len == 0 || len % sizeof(Desc) != 0 || len / sizeof(Desc) > kMaxQueueSize) {
    err = RingError::bad_indirect;
    return false;
  }
  const uint8_t* table = mem.translate(addr, len);
  if (!table) {
    err = mem.iotlb_miss(addr, len, false) ? RingError::iotlb_miss : RingError::bad_address;
    return false;
  }
  const uint32_t n = len / sizeof(Desc);
  uint32_t i = 0;
  for (uint32_t hops = 0;; ++hops) {
    if (hops >= n) {
      err = RingError::chain_too_long;
      return false;
    }
    Desc d;
    std::memcpy(&d, table + i * sizeof(Desc), sizeof d);
    if (d.flags & kDescIndirect) {
      err = RingError::bad_indirect;
      return false;
    }
    if (!add_segment(mem, d.addr, d.len, d.flags & kDescWrite, c, segs, err)) return false;
    if constexpr (std::is_same_v<Desc, SplitDesc>) {
      if (!(d.flags & kDescNext)) return true;
      if (d.next >= n) {
        err = RingError::bad_head;
        return false;
      }
      i = d.next;
    } else {
      // Packed indirect tables are walked in order, no NEXT (§2.8.19).
      if (++i == n) return true;
    }
  }
}

template <Barriers B>
class SplitQueue final : public Virtqueue {
 public:
  SplitQueue(const GuestMemory& mem, uint16_t size, const RingAddresses& rings, bool event_idx, uint32_t base,
             uint8_t* inflight, RingLog log)
      : mem_(mem), size_(size), event_idx_(event_idx), log_(log) {
    const RingLayout l = split_layout(size);
    desc_ = reinterpret_cast<SplitDesc*>(mem.translate(rings.desc, l.desc_bytes));
    avail_ = reinterpret_cast<uint16_t*>(mem.translate(rings.driver, l.driver_bytes));
    used_ = mem.translate_rw(rings.device, l.device_bytes);
    if (!desc_ || !avail_ || !used_) throw std::invalid_argument("split ring parts are not in guest memory");
    if (rings.desc % 16 || rings.driver % 2 || rings.device % 4)
      throw std::invalid_argument("split ring parts are misaligned (§2.7: 16, 2, 4)");
    if (misaligned(desc_, 16) || misaligned(avail_, 2) || misaligned(used_, 4))
      throw std::invalid_argument(kHostMisaligned);
    last_avail_ = cached_avail_ = static_cast<uint16_t>(base);
    // The used index continues from what the ring holds (a reconnect).
    used_idx_ = signalled_ = published_ = std::atomic_ref<uint16_t>(*reinterpret_cast<uint16_t*>(used_ + 2)).load();
    if (inflight) recover(inflight);
  }

  void rewind(const Chain& c) override {
    if (c.resubmitted) {
      --resubmit_pos_;
      return;
    }
    --last_avail_;
    if (track_) publish<uint8_t>(track_[c.id].inflight, 0);
  }
  uint32_t base() const override { return last_avail_; }

  uint16_t size() const override { return size_; }

  bool pop(Chain& c, std::span<Segment> segs) override {
    if (broken()) return false;
    stalled_ = false;
    if (resubmit_pos_ < resubmit_.size()) {
      // What the previous back-end took and never returned comes first.
      if (!walk(resubmit_[resubmit_pos_], c, segs)) return false;
      c.resubmitted = true;
      ++resubmit_pos_;
      return true;
    }
    if (last_avail_ == cached_avail_) {
      cached_avail_ = load_acquire<B>(avail_[1]);
      if (last_avail_ == cached_avail_) return false;
      if (static_cast<uint16_t>(cached_avail_ - last_avail_) > size_) return fail(RingError::bad_avail_index);
    }
    const uint16_t head = avail_[2 + last_avail_ % size_];
    if (!walk(head, c, segs)) return false;
    ++last_avail_;
    if (track_) {
      // Taken: counter first, then the inflight mark.
      track_[head].counter = counter_++;
      publish<uint8_t>(track_[head].inflight, 1);
    }
    return true;
  }

  void add_used(const Chain& c, uint32_t written) override {
    if (track_) {
      // A batch of one: the list of the last batch is this head.
      track_[c.id].next = header_->last_batch_head;
      publish(header_->last_batch_head, c.id);
    }
    const UsedElem e{c.id, written};
    uint8_t* elem = used_ + 4 + (used_idx_ % size_) * sizeof(UsedElem);
    std::memcpy(elem, &e, sizeof e);
    if (log_.log) log_device(elem, sizeof e);  // before the index hands it over
    ++used_idx_;
    if (track_) {
      store_release<B>(*reinterpret_cast<uint16_t*>(used_ + 2), used_idx_);
      if (log_.log) log_device(used_ + 2, 2);
      published_ = used_idx_;
      publish<uint8_t>(track_[c.id].inflight, 0);
      publish(header_->used_idx, used_idx_);
    }
  }

  void publish_used() override {
    if (published_ == used_idx_) return;
    store_release<B>(*reinterpret_cast<uint16_t*>(used_ + 2), used_idx_);
    if (log_.log) log_device(used_ + 2, 2);
    published_ = used_idx_;
  }

  bool enable_kicks() override {
    if (event_idx_) {
      std::atomic_ref<uint16_t>(*reinterpret_cast<uint16_t*>(used_ + 4 + 8 * size_))
          .store(last_avail_, std::memory_order_relaxed);
      if (log_.log) log_device(used_ + 4 + 8 * size_, 2);
    } else {
      std::atomic_ref<uint16_t>(*reinterpret_cast<uint16_t*>(used_)).store(0, std::memory_order_relaxed);
      if (log_.log) log_device(used_, 2);
    }
    // The driver must see the request before we look for its buffers (§2.7.10).
    std::atomic_thread_fence(std::memory_order_seq_cst);
    return load_acquire<B>(avail_[1]) != last_avail_;
  }

  bool should_notify() override {
    // The used index must be visible before the driver's flags or event
    // index are read: the one store->load point, a full fence.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    const uint16_t old = signalled_;
    signalled_ = used_idx_;
    if (!event_idx_) return !(std::atomic_ref<uint16_t>(avail_[0]).load(std::memory_order_relaxed) & kAvailNoInterrupt);
    const uint16_t used_event = std::atomic_ref<uint16_t>(avail_[2 + size_]).load(std::memory_order_relaxed);
    return need_event(used_event, used_idx_, old);
  }

 private:
  // A write into the used ring, logged at the guest address the front-end
  // gave for it, or by its host pointer.
  void log_device(const uint8_t* p, uint64_t len) const {
    if (log_.device_area == RingLog::kByHost)
      log_.log->mark_host(p, len);
    else
      log_.log->mark_gpa(log_.device_area + static_cast<uint64_t>(p - used_), len);
  }
  // The chain whose head is `head`, into `c`/`segs`.
  bool walk(uint16_t head, Chain& c, std::span<Segment> segs) {
    if (head >= size_) return fail(RingError::bad_head);
    c = Chain{};
    c.id = head;
    c.slots = 1;
    RingError err = RingError::none;
    uint16_t i = head;
    for (uint32_t hops = 0;; ++hops) {
      if (hops >= size_) return fail(RingError::chain_too_long);
      SplitDesc d;
      std::memcpy(&d, &desc_[i], sizeof d);
      if (d.flags & kDescIndirect) {
        if ((d.flags & kDescNext) || c.count > 0) return fail(RingError::bad_indirect);
        if (!add_indirect<SplitDesc>(mem_, d.addr, d.len, c, segs, err)) return fail_or_stall(err);
        return true;
      }
      if (!add_segment(mem_, d.addr, d.len, d.flags & kDescWrite, c, segs, err)) return fail_or_stall(err);
      if (!(d.flags & kDescNext)) return true;
      if (d.next >= size_) return fail(RingError::bad_head);
      i = d.next;
    }
  }

  // A fresh region is initialised; one a previous back-end left is read
  // as the spec's reconnect steps say: a last batch half published is
  // finished, and every head still in flight is handed out again in the
  // order it was taken. The avail ring was consumed up to the used index
  // plus what is still in flight.
  void recover(uint8_t* region) {
    header_ = reinterpret_cast<InflightSplitHeader*>(region);
    track_ = reinterpret_cast<InflightSplitDesc*>(region + sizeof(InflightSplitHeader));
    if (header_->version != kInflightVersion || header_->desc_num != size_) {
      std::memset(region, 0, sizeof(InflightSplitHeader) + sizeof(InflightSplitDesc) * size_);
      header_->desc_num = size_;
      header_->used_idx = used_idx_;
      publish(header_->version, kInflightVersion);
      return;
    }
    if (header_->used_idx != used_idx_) {
      const uint16_t batch = static_cast<uint16_t>(used_idx_ - header_->used_idx);
      if (batch > size_) bad_inflight("its used index is " + std::to_string(batch) + " behind the ring's");
      uint16_t i = header_->last_batch_head;
      for (uint16_t k = 0; k < batch; ++k) {
        if (i >= size_) bad_inflight("its last batch list leaves the ring");
        track_[i].inflight = 0;
        i = track_[i].next;
      }
      header_->used_idx = used_idx_;
    }
    // The region is the front-end's memory: each entry is read once into
    // a private list and sorted there (a comparator over shared counters
    // could see them change mid-sort).
    std::vector<Resubmit> order;
    order.reserve(size_);
    for (uint16_t i = 0; i < size_; ++i) {
      const Resubmit r{i, 0, std::atomic_ref<uint64_t>(track_[i].counter).load(std::memory_order_relaxed)};
      if (std::atomic_ref<uint8_t>(track_[i].inflight).load(std::memory_order_relaxed) == 0) continue;
      order.push_back(r);
      counter_ = std::max(counter_, r.counter + 1);
    }
    sort_by_counter(order);
    resubmit_.reserve(order.size());
    for (const Resubmit& r : order) resubmit_.push_back(r.head);
    recovered_ = resubmit_.size();
    last_avail_ = cached_avail_ = static_cast<uint16_t>(used_idx_ + resubmit_.size());
  }

  const GuestMemory& mem_;
  uint16_t size_;
  bool event_idx_;
  SplitDesc* desc_;
  uint16_t* avail_;  // flags, idx, ring[size], used_event
  uint8_t* used_;    // flags, idx, ring[size], avail_event
  uint16_t last_avail_ = 0;
  uint16_t cached_avail_ = 0;
  uint16_t used_idx_ = 0;
  uint16_t published_ = 0;  // the used index the driver sees
  uint16_t signalled_ = 0;
  // Inflight tracking, when the queue has a region.
  InflightSplitHeader* header_ = nullptr;
  InflightSplitDesc* track_ = nullptr;
  uint64_t counter_ = 1;
  std::vector<uint16_t> resubmit_;
  size_t resubmit_pos_ = 0;
  RingLog log_;
};

template <Barriers B>
class PackedQueue final : public Virtqueue {
 public:
  PackedQueue(const GuestMemory& mem, uint16_t size, const RingAddresses& rings, bool event_idx, uint32_t base,
              uint8_t* inflight, RingLog log)
      : mem_(mem), size_(size), event_idx_(event_idx), log_(log) {
    // The device writes used descriptors back into the ring (§2.8.2).
    desc_ = reinterpret_cast<PackedDesc*>(mem.translate_rw(rings.desc, 16ULL * size));
    driver_ = reinterpret_cast<EventSuppress*>(mem.translate(rings.driver, 4));
    device_ = reinterpret_cast<EventSuppress*>(mem.translate_rw(rings.device, 4));
    if (!desc_ || !driver_ || !device_) throw std::invalid_argument("packed ring parts are not in guest memory");
    if (rings.desc % 16 || rings.driver % 4 || rings.device % 4)
      throw std::invalid_argument("packed ring parts are misaligned (§2.8.10: 16, 4, 4)");
    if (misaligned(desc_, 16) || misaligned(driver_, 4) || misaligned(device_, 4))
      throw std::invalid_argument(kHostMisaligned);
    if (base == 0) {
      // Two positions read 0: a fresh ring (what some front-ends send for
      // one), and slot 0 on the second lap with both wrap counters 0 (where
      // GET_VRING_BASE, or this device's own stop, may leave it). Slot 0
      // tells them apart: its used bit is set only once the device has
      // gone round the ring (used 1/1 on the first lap, available 0/1 on
      // the second); a fresh ring's slot 0 is 0/0 or available 1/0.
      if (std::atomic_ref<uint16_t>(desc_[0].flags).load(std::memory_order_acquire) & kPackedUsed)
        avail_wrap_ = used_wrap_ = false;
    } else {
      next_avail_ = base & 0x7fffU;
      avail_wrap_ = (base >> 15U) & 1U;
      // The used half is optional (front-ends that send only the low half
      // mean "used where avail is", as at the start of a ring).
      const uint32_t used = (base >> 16U) != 0 ? base >> 16U : base & 0xffffU;
      next_used_ = signalled_ = used & 0x7fffU;
      used_wrap_ = (used >> 15U) & 1U;
      if (next_avail_ >= size_ || next_used_ >= size_) throw std::invalid_argument("packed ring base out of range");
    }
    if (inflight) recover(inflight);
  }

  void rewind(const Chain& c) override {
    if (c.resubmitted) {
      --resubmit_pos_;
      return;
    }
    if (track_) {
      // The chain's entries go back to the front of the free list.
      header_->free_head = c.inflight_entry;
      publish(header_->old_free_head, c.inflight_entry);
      publish<uint8_t>(track_[c.inflight_entry].inflight, 0);
    }
    if (next_avail_ < c.slots) {
      next_avail_ = static_cast<uint16_t>(next_avail_ + size_ - c.slots);
      avail_wrap_ = !avail_wrap_;
    } else {
      next_avail_ = static_cast<uint16_t>(next_avail_ - c.slots);
    }
  }
  uint32_t base() const override {
    return (next_avail_ | (avail_wrap_ ? 1U << 15U : 0U)) |
           (static_cast<uint32_t>(next_used_ | (used_wrap_ ? 1U << 15U : 0U)) << 16U);
  }

  uint16_t size() const override { return size_; }

  bool pop(Chain& c, std::span<Segment> segs) override {
    if (broken()) return false;
    stalled_ = false;
    if (resubmit_pos_ < resubmit_.size()) return pop_resubmitted(c, segs);
    const uint16_t flags = load_acquire<B>(desc_[next_avail_].flags);
    if (!available(flags, avail_wrap_)) return false;
    c = Chain{};
    RingError err = RingError::none;
    uint16_t idx = next_avail_;
    bool wrap = avail_wrap_;
    for (uint32_t n = 0;; ++n) {
      if (n >= size_) return fail(RingError::chain_too_long);
      PackedDesc d;
      std::memcpy(&d, &desc_[idx], sizeof d);
      // Descriptors after the head were written before the head was made
      // available (§2.8.6), but they must carry this lap's flags too.
      if (n > 0 && !available(d.flags, wrap)) return fail(RingError::bad_head);
      ++c.slots;
      if (++idx == size_) {
        idx = 0;
        wrap = !wrap;
      }
      if (d.flags & kDescIndirect) {
        if ((d.flags & kDescNext) || c.count > 0) return fail(RingError::bad_indirect);
        if (!add_indirect<PackedDesc>(mem_, d.addr, d.len, c, segs, err)) return fail_or_stall(err);
        c.id = d.id;
        break;
      }
      if (!add_segment(mem_, d.addr, d.len, d.flags & kDescWrite, c, segs, err)) return fail_or_stall(err);
      if (!(d.flags & kDescNext)) {
        c.id = d.id;  // the buffer id is in the chain's last descriptor
        break;
      }
    }
    if (track_ && !track_taken(c)) return false;
    next_avail_ = idx;
    avail_wrap_ = wrap;
    return true;
  }

  void publish_used() override {
    if (!pending_) return;
    store_release<B>(*pending_, pending_flags_);
    if (log_.log) log_.log->mark_host(pending_, 2);
    pending_ = nullptr;
  }

  void add_used(const Chain& c, uint32_t written) override {
    const uint16_t at = next_used_;
    const bool at_wrap = used_wrap_;
    // One used descriptor per buffer; the chain's other slots are skipped.
    uint32_t next = next_used_ + c.slots;
    if (next >= size_) {
      next -= size_;
      used_wrap_ = !used_wrap_;
    }
    next_used_ = static_cast<uint16_t>(next);
    if (track_) {
      // The spec's order: the chain's entries back on the free list and
      // the new used position, then the used descriptor, then the commit.
      const uint16_t last = std::atomic_ref<uint16_t>(track_[c.inflight_entry].last).load(std::memory_order_relaxed);
      if (last < size_) track_[last].next = header_->free_head;
      header_->free_head = c.inflight_entry;
      header_->used_wrap_counter = used_wrap_;
      publish(header_->used_idx, next_used_);
    }
    PackedDesc& d = desc_[at];
    d.id = c.id;
    d.len = written;
    uint16_t flags = at_wrap ? (kPackedAvail | kPackedUsed) : 0;
    if (written > 0) flags |= kDescWrite;
    if (!track_ && !pending_) {
      // The burst's first: its flags are what publish_used() stores.
      pending_ = &d.flags;
      pending_flags_ = flags;
      if (log_.log) log_.log->mark_host(&d, sizeof d);
      return;
    }
    if (!track_) {
      // Behind the first, which the driver reads before this one.
      std::atomic_ref<uint16_t>(d.flags).store(flags, std::memory_order_relaxed);
      if (log_.log) log_.log->mark_host(&d, sizeof d);
      return;
    }
    store_release<B>(d.flags, flags);
    if (log_.log) log_.log->mark_host(&d, sizeof d);
    publish<uint8_t>(track_[c.inflight_entry].inflight, 0);
    header_->old_free_head = header_->free_head;
    header_->old_used_wrap_counter = used_wrap_;
    publish(header_->old_used_idx, next_used_);
  }

  bool enable_kicks() override {
    if (event_idx_) {
      std::atomic_ref<uint16_t>(device_->off_wrap)
          .store(static_cast<uint16_t>(next_avail_ | (avail_wrap_ ? 1U << 15U : 0U)), std::memory_order_relaxed);
      std::atomic_ref<uint16_t>(device_->flags).store(kEventDesc, std::memory_order_relaxed);
    } else {
      std::atomic_ref<uint16_t>(device_->flags).store(kEventEnable, std::memory_order_relaxed);
    }
    if (log_.log) {  // the device event suppression: the packed ring's "used" area for the log
      if (log_.device_area == RingLog::kByHost)
        log_.log->mark_host(device_, sizeof *device_);
      else
        log_.log->mark_gpa(log_.device_area, sizeof *device_);
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);  // §2.8.21
    return available(load_acquire<B>(desc_[next_avail_].flags), avail_wrap_);
  }

  bool should_notify() override {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    const uint16_t old = signalled_;
    signalled_ = next_used_;
    const uint16_t flags = std::atomic_ref<uint16_t>(driver_->flags).load(std::memory_order_relaxed);
    if (flags == kEventDisable) return false;
    if (flags != kEventDesc || !event_idx_) return true;
    // §2.8.21: notify when the used index passes the driver's event offset;
    // an offset on the other lap is one ring size back.
    const uint16_t off_wrap = std::atomic_ref<uint16_t>(driver_->off_wrap).load(std::memory_order_relaxed);
    uint16_t event = off_wrap & 0x7fffU;
    if (static_cast<bool>(off_wrap >> 15U) != used_wrap_) event = static_cast<uint16_t>(event - size_);
    return need_event(event, next_used_, old);
  }

 private:
  static bool available(uint16_t flags, bool wrap) {
    return static_cast<bool>(flags & kPackedAvail) == wrap && static_cast<bool>(flags & kPackedUsed) != wrap;
  }

  // Records a chain just walked (its c.slots ring descriptors from
  // next_avail_) in the region: a head entry with counter, inflight, its
  // length and last entry; a copy of each descriptor, since the driver
  // may reuse ring slots once other buffers come back before this one.
  bool track_taken(Chain& c) {
    const uint16_t head = header_->old_free_head;
    if (head >= size_) return fail(RingError::chain_too_long);
    track_[head].num = 0;
    track_[head].counter = counter_++;
    publish<uint8_t>(track_[head].inflight, 1);
    uint16_t slot = next_avail_;
    for (uint16_t k = 0; k < c.slots; ++k) {
      const uint16_t free = header_->free_head;
      // More descriptors in flight than entries: the driver reused slots
      // still in flight.
      if (free >= size_) return fail(RingError::chain_too_long);
      PackedDesc d;
      std::memcpy(&d, &desc_[slot], sizeof d);
      if (k + 1 == c.slots) track_[head].last = free;
      ++track_[head].num;
      track_[free].addr = d.addr;
      track_[free].len = d.len;
      track_[free].flags = d.flags;
      track_[free].id = d.id;
      header_->free_head = track_[free].next;
      if (++slot == size_) slot = 0;
    }
    publish(header_->old_free_head, header_->free_head);
    c.inflight_entry = head;
    return true;
  }

  // A chain the previous back-end left in flight, from the region's copies.
  bool pop_resubmitted(Chain& c, std::span<Segment> segs) {
    const Resubmit r = resubmit_[resubmit_pos_];
    const uint16_t head = r.head;
    c = Chain{};
    RingError err = RingError::none;
    uint16_t e = head;
    for (uint16_t k = 0; k < r.num; ++k) {
      if (e >= size_) return fail(RingError::bad_head);
      InflightPackedDesc d;  // one copy of the entry, then only the copy
      std::memcpy(&d, &track_[e], sizeof d);
      if (d.flags & kDescIndirect) {
        if (c.count > 0) return fail(RingError::bad_indirect);
        if (!add_indirect<PackedDesc>(mem_, d.addr, d.len, c, segs, err)) return fail_or_stall(err);
      } else if (!add_segment(mem_, d.addr, d.len, d.flags & kDescWrite, c, segs, err)) {
        return fail_or_stall(err);
      }
      c.id = d.id;
      e = d.next;
    }
    c.slots = r.num;
    c.inflight_entry = head;
    c.resubmitted = true;
    ++resubmit_pos_;
    return true;
  }

  // The spec's reconnect steps for packed rings: a push half done is
  // either committed (its used descriptor reached the ring) or rolled
  // back; entries on the free list are not in flight; the rest are handed
  // out again by counter. The ring positions come from the region: used
  // where the last commit left it, avail that far ahead of it plus every
  // slot still in flight.
  void recover(uint8_t* region) {
    header_ = reinterpret_cast<InflightPackedHeader*>(region);
    track_ = reinterpret_cast<InflightPackedDesc*>(region + sizeof(InflightPackedHeader));
    if (header_->version != kInflightVersion || header_->desc_num != size_) {
      std::memset(region, 0, sizeof(InflightPackedHeader) + sizeof(InflightPackedDesc) * size_);
      for (uint16_t i = 0; i < size_; ++i) track_[i].next = static_cast<uint16_t>(i + 1);  // size_: the end
      header_->desc_num = size_;
      header_->used_idx = header_->old_used_idx = next_used_;
      header_->used_wrap_counter = header_->old_used_wrap_counter = used_wrap_;
      publish(header_->version, kInflightVersion);
      return;
    }
    if (header_->used_idx != header_->old_used_idx || header_->used_wrap_counter != header_->old_used_wrap_counter) {
      if (header_->old_used_idx >= size_) bad_inflight("its used index is outside the ring");
      const bool wrap = header_->old_used_wrap_counter != 0;
      const uint16_t flags = std::atomic_ref<uint16_t>(desc_[header_->old_used_idx].flags).load();
      if (!available(flags, wrap)) {  // the used descriptor was written: commit
        header_->old_free_head = header_->free_head;
        header_->old_used_idx = header_->used_idx;
        header_->old_used_wrap_counter = header_->used_wrap_counter;
      }
    }
    header_->free_head = header_->old_free_head;
    header_->used_idx = header_->old_used_idx;
    header_->used_wrap_counter = header_->old_used_wrap_counter;
    if (header_->used_idx >= size_) bad_inflight("its used index is outside the ring");
    uint16_t e = header_->free_head;
    for (uint32_t k = 0; e < size_; ++k) {
      if (k > size_) bad_inflight("its free list loops");
      track_[e].inflight = 0;
      e = track_[e].next;
    }
    // Each entry's count and counter are copied once, checked, and only the
    // copies used from here on: the front-end may rewrite the region at any
    // time, and a re-read count would walk past the ring.
    uint32_t slots = 0;
    resubmit_.reserve(size_);
    for (uint16_t i = 0; i < size_; ++i) {
      if (std::atomic_ref<uint8_t>(track_[i].inflight).load(std::memory_order_relaxed) == 0) continue;
      const Resubmit r{i, std::atomic_ref<uint16_t>(track_[i].num).load(std::memory_order_relaxed),
                       std::atomic_ref<uint64_t>(track_[i].counter).load(std::memory_order_relaxed)};
      if (r.num == 0 || r.num > size_) bad_inflight("an entry in flight has " + std::to_string(r.num) + " descriptors");
      slots += r.num;
      resubmit_.push_back(r);
      counter_ = std::max(counter_, r.counter + 1);
    }
    if (slots > size_)
      bad_inflight(std::to_string(slots) + " descriptors in flight in a ring of " + std::to_string(size_));
    sort_by_counter(resubmit_);
    recovered_ = resubmit_.size();
    next_used_ = signalled_ = header_->used_idx;
    used_wrap_ = header_->used_wrap_counter != 0;
    const uint32_t avail = next_used_ + slots;
    next_avail_ = static_cast<uint16_t>(avail >= size_ ? avail - size_ : avail);
    avail_wrap_ = avail >= size_ ? !used_wrap_ : used_wrap_;
  }

  const GuestMemory& mem_;
  uint16_t size_;
  bool event_idx_;
  PackedDesc* desc_;
  EventSuppress* driver_;
  EventSuppress* device_;
  uint16_t next_avail_ = 0;
  bool avail_wrap_ = true;
  uint16_t next_used_ = 0;
  bool used_wrap_ = true;
  // The burst's first used descriptor, whose flags publish_used() stores.
  uint16_t* pending_ = nullptr;
  uint16_t pending_flags_ = 0;
  uint16_t signalled_ = 0;
  // Inflight tracking, when the queue has a region.
  InflightPackedHeader* header_ = nullptr;
  InflightPackedDesc* track_ = nullptr;
  uint64_t counter_ = 1;
  std::vector<Resubmit> resubmit_;
  size_t resubmit_pos_ = 0;
  RingLog log_;
};

void check_size(uint16_t size, bool split) {
  if (size == 0 || size > kMaxQueueSize || (split && (size & (size - 1)) != 0))
    throw std::invalid_argument("queue size " + std::to_string(size) +
                                (split ? " must be a power of two up to 32768" : " must be 1..32768"));
}

}  // namespace

std::unique_ptr<Virtqueue> make_split_queue(const GuestMemory& mem, uint16_t size, const RingAddresses& rings,
                                            bool event_idx, Barriers barriers, uint32_t base, uint8_t* inflight,
                                            RingLog log) {
  check_size(size, true);
  if (barriers == Barriers::one_way)
    return std::make_unique<SplitQueue<Barriers::one_way>>(mem, size, rings, event_idx, base, inflight, log);
  return std::make_unique<SplitQueue<Barriers::full_fence>>(mem, size, rings, event_idx, base, inflight, log);
}

std::unique_ptr<Virtqueue> make_packed_queue(const GuestMemory& mem, uint16_t size, const RingAddresses& rings,
                                             bool event_idx, Barriers barriers, uint32_t base, uint8_t* inflight,
                                             RingLog log) {
  check_size(size, false);
  if (barriers == Barriers::one_way)
    return std::make_unique<PackedQueue<Barriers::one_way>>(mem, size, rings, event_idx, base, inflight, log);
  return std::make_unique<PackedQueue<Barriers::full_fence>>(mem, size, rings, event_idx, base, inflight, log);
}

}  // namespace sriovd::virtio
