#include "sriovd/guest/virtqueue.hpp"

#include <atomic>
#include <cstring>
#include <stdexcept>

namespace sriovd::guest {

namespace {

uint64_t align(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

void release_store(uint16_t& v, uint16_t x, virtio::Barriers b) {
  if (b == virtio::Barriers::full_fence) std::atomic_thread_fence(std::memory_order_seq_cst);
  std::atomic_ref<uint16_t>(v).store(
      x, b == virtio::Barriers::one_way ? std::memory_order_release : std::memory_order_relaxed);
  if (b == virtio::Barriers::full_fence) std::atomic_thread_fence(std::memory_order_seq_cst);
}

uint16_t acquire_load(uint16_t& v, virtio::Barriers b) {
  const uint16_t x = std::atomic_ref<uint16_t>(v).load(b == virtio::Barriers::one_way ? std::memory_order_acquire
                                                                                      : std::memory_order_relaxed);
  if (b == virtio::Barriers::full_fence) std::atomic_thread_fence(std::memory_order_seq_cst);
  return x;
}

}  // namespace

uint64_t SplitDriver::ring_bytes(uint16_t size) {
  const virtio::RingLayout l = virtio::split_layout(size);
  return align(l.desc_bytes, 16) + align(l.driver_bytes, 16) + l.device_bytes;
}

SplitDriver::SplitDriver(uint8_t* host, uint64_t gpa, uint16_t size, virtio::Barriers barriers)
    : barriers_(barriers), size_(size), chain_len_(size, 0) {
  const virtio::RingLayout l = virtio::split_layout(size);
  std::memset(host, 0, ring_bytes(size));
  rings_.desc = gpa;
  rings_.driver = gpa + align(l.desc_bytes, 16);
  rings_.device = rings_.driver + align(l.driver_bytes, 16);
  desc_ = reinterpret_cast<virtio::SplitDesc*>(host);
  avail_ = reinterpret_cast<uint16_t*>(host + (rings_.driver - gpa));
  used_ = host + (rings_.device - gpa);
  for (int i = size - 1; i >= 0; --i) free_.push_back(static_cast<uint16_t>(i));
}

int SplitDriver::add(std::span<const Buffer> chain) {
  if (chain.empty() || chain.size() > free_.size()) return -1;
  std::vector<uint16_t> ids;
  for (size_t i = 0; i < chain.size(); ++i) {
    ids.push_back(free_.back());
    free_.pop_back();
  }
  for (size_t i = 0; i < chain.size(); ++i) {
    virtio::SplitDesc& d = desc_[ids[i]];
    d.addr = chain[i].addr;
    d.len = chain[i].len;
    d.flags = static_cast<uint16_t>((chain[i].writable ? virtio::kDescWrite : 0) |
                                    (i + 1 < chain.size() ? virtio::kDescNext : 0));
    d.next = i + 1 < chain.size() ? ids[i + 1] : 0;
  }
  chain_len_[ids[0]] = static_cast<uint16_t>(chain.size());
  avail_[2 + avail_idx_ % size_] = ids[0];
  ++avail_idx_;
  return ids[0];
}

int SplitDriver::add_indirect(uint64_t table_gpa, uint8_t* table, std::span<const Buffer> chain) {
  if (chain.empty() || free_.empty()) return -1;
  for (size_t i = 0; i < chain.size(); ++i) {
    virtio::SplitDesc d{chain[i].addr, chain[i].len,
                        static_cast<uint16_t>((chain[i].writable ? virtio::kDescWrite : 0) |
                                              (i + 1 < chain.size() ? virtio::kDescNext : 0)),
                        static_cast<uint16_t>(i + 1)};
    std::memcpy(table + i * sizeof d, &d, sizeof d);
  }
  const uint16_t head = free_.back();
  free_.pop_back();
  desc_[head] = {table_gpa, static_cast<uint32_t>(chain.size() * sizeof(virtio::SplitDesc)), virtio::kDescIndirect, 0};
  chain_len_[head] = 1;
  avail_[2 + avail_idx_ % size_] = head;
  ++avail_idx_;
  return head;
}

void SplitDriver::publish() { release_store(avail_[1], avail_idx_, barriers_); }

bool SplitDriver::take_used(uint32_t& id, uint32_t& len) {
  const uint16_t used_idx = acquire_load(*reinterpret_cast<uint16_t*>(used_ + 2), barriers_);
  if (used_idx == last_used_) return false;
  virtio::UsedElem e;
  std::memcpy(&e, used_ + 4 + (last_used_ % size_) * sizeof e, sizeof e);
  ++last_used_;
  id = e.id;
  len = e.len;
  if (id >= size_) throw std::runtime_error("device returned descriptor " + std::to_string(id));
  // Give the chain's descriptors back.
  uint16_t i = static_cast<uint16_t>(id);
  for (uint16_t n = chain_len_[id]; n > 0; --n) {
    free_.push_back(i);
    i = desc_[i].next;
  }
  return true;
}

void SplitDriver::set_used_event(uint16_t v) { std::atomic_ref<uint16_t>(avail_[2 + size_]).store(v); }
void SplitDriver::set_no_interrupt(bool on) {
  std::atomic_ref<uint16_t>(avail_[0]).store(on ? virtio::kAvailNoInterrupt : 0);
}

uint64_t PackedDriver::ring_bytes(uint16_t size) { return 16ULL * size + 8; }

PackedDriver::PackedDriver(uint8_t* host, uint64_t gpa, uint16_t size, virtio::Barriers barriers)
    : barriers_(barriers), size_(size), id_slots_(size, 0), free_slots_(size) {
  std::memset(host, 0, ring_bytes(size));
  rings_.desc = gpa;
  rings_.driver = gpa + 16ULL * size;
  rings_.device = rings_.driver + 4;
  desc_ = reinterpret_cast<virtio::PackedDesc*>(host);
  driver_event_ = reinterpret_cast<virtio::EventSuppress*>(host + 16ULL * size);
  for (int i = size - 1; i >= 0; --i) free_ids_.push_back(static_cast<uint16_t>(i));
}

int PackedDriver::place(std::span<const virtio::PackedDesc> descs, uint16_t id) {
  const uint16_t head = next_avail_;
  uint16_t head_flags = 0;
  for (size_t i = 0; i < descs.size(); ++i) {
    virtio::PackedDesc& slot = desc_[next_avail_];
    const auto flags =
        static_cast<uint16_t>(descs[i].flags | (avail_wrap_ ? virtio::kPackedAvail : virtio::kPackedUsed));
    // Field by field: the head's flags word may be polled by the device
    // right now, and is written last, atomically.
    slot.addr = descs[i].addr;
    slot.len = descs[i].len;
    slot.id = id;
    if (i == 0)
      head_flags = flags;
    else
      slot.flags = flags;
    if (++next_avail_ == size_) {
      next_avail_ = 0;
      avail_wrap_ = !avail_wrap_;
    }
  }
  id_slots_[id] = static_cast<uint16_t>(descs.size());
  free_slots_ -= static_cast<uint32_t>(descs.size());
  release_store(desc_[head].flags, head_flags, barriers_);
  return id;
}

int PackedDriver::add(std::span<const Buffer> chain) {
  if (chain.empty() || chain.size() > free_slots_ || free_ids_.empty()) return -1;
  std::vector<virtio::PackedDesc> descs;
  for (size_t i = 0; i < chain.size(); ++i)
    descs.push_back({chain[i].addr, chain[i].len, 0,
                     static_cast<uint16_t>((chain[i].writable ? virtio::kDescWrite : 0) |
                                           (i + 1 < chain.size() ? virtio::kDescNext : 0))});
  const uint16_t id = free_ids_.back();
  free_ids_.pop_back();
  return place(descs, id);
}

int PackedDriver::add_indirect(uint64_t table_gpa, uint8_t* table, std::span<const Buffer> chain) {
  if (chain.empty() || free_slots_ == 0 || free_ids_.empty()) return -1;
  for (size_t i = 0; i < chain.size(); ++i) {
    virtio::PackedDesc d{chain[i].addr, chain[i].len, 0,
                         static_cast<uint16_t>(chain[i].writable ? virtio::kDescWrite : 0)};
    std::memcpy(table + i * sizeof d, &d, sizeof d);
  }
  const virtio::PackedDesc head{table_gpa, static_cast<uint32_t>(chain.size() * sizeof(virtio::PackedDesc)), 0,
                                virtio::kDescIndirect};
  const uint16_t id = free_ids_.back();
  free_ids_.pop_back();
  return place(std::span<const virtio::PackedDesc>(&head, 1), id);
}

bool PackedDriver::take_used(uint32_t& id, uint32_t& len) {
  const uint16_t flags = acquire_load(desc_[next_used_].flags, barriers_);
  const bool avail = flags & virtio::kPackedAvail, used = flags & virtio::kPackedUsed;
  if (avail != used || used != used_wrap_) return false;
  id = desc_[next_used_].id;
  len = desc_[next_used_].len;
  if (id >= size_) throw std::runtime_error("device returned buffer id " + std::to_string(id));
  uint32_t next = next_used_ + id_slots_[id];
  if (next >= size_) {
    next -= size_;
    used_wrap_ = !used_wrap_;
  }
  next_used_ = static_cast<uint16_t>(next);
  free_slots_ += id_slots_[id];
  free_ids_.push_back(static_cast<uint16_t>(id));
  return true;
}

void PackedDriver::set_event(uint16_t flags, uint16_t off_wrap) {
  std::atomic_ref<uint16_t>(driver_event_->off_wrap).store(off_wrap);
  std::atomic_ref<uint16_t>(driver_event_->flags).store(flags);
}

}  // namespace sriovd::guest
