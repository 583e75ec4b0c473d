#pragma once
// The driver (guest) side of a virtqueue, virtio 1.2 §2.7.13 and §2.8.20:
// what the test front-end, the tests and the ring benchmark use to play the
// guest. Rings are laid out in memory the caller provides.

#include <cstdint>
#include <span>
#include <vector>

#include "sriovd/virtio/ring.hpp"

namespace sriovd::guest {

struct Buffer {
  uint64_t addr = 0;  // guest physical
  uint32_t len = 0;
  bool writable = false;  // device-writable
};

class SplitDriver {
 public:
  // Lays out desc, avail and used from `host` (guest address `gpa`), which
  // must hold virtio::split_ring_bytes(size) bytes, 16-byte aligned.
  SplitDriver(uint8_t* host, uint64_t gpa, uint16_t size, virtio::Barriers barriers = virtio::Barriers::one_way);
  static uint64_t ring_bytes(uint16_t size);

  [[nodiscard]] virtio::RingAddresses addresses() const { return rings_; }
  // Adds a chain; returns its head, or -1 when the ring has no room.
  int add(std::span<const Buffer> chain);
  // An indirect chain: the table (at table_gpa, host pointer table) holds it.
  int add_indirect(uint64_t table_gpa, uint8_t* table, std::span<const Buffer> chain);
  void publish();  // makes what was added visible (release store of avail idx)
  // Takes one used element; false when none.
  bool take_used(uint32_t& id, uint32_t& len);
  void set_used_event(uint16_t v);
  void set_no_interrupt(bool on);

  // Raw access, for malformed-ring tests.
  virtio::SplitDesc* desc() { return desc_; }
  uint16_t* avail() { return avail_; }  // flags, idx, ring[], used_event
  [[nodiscard]] uint16_t size() const { return size_; }

 private:
  virtio::Barriers barriers_;
  uint16_t size_;
  virtio::RingAddresses rings_;
  virtio::SplitDesc* desc_;
  uint16_t* avail_;
  uint8_t* used_;
  std::vector<uint16_t> free_;
  std::vector<uint16_t> chain_len_;
  uint16_t avail_idx_ = 0;
  uint16_t last_used_ = 0;
};

class PackedDriver {
 public:
  PackedDriver(uint8_t* host, uint64_t gpa, uint16_t size, virtio::Barriers barriers = virtio::Barriers::one_way);
  static uint64_t ring_bytes(uint16_t size);

  [[nodiscard]] virtio::RingAddresses addresses() const { return rings_; }
  // Writes the chain with the head's flags last (release): available at once.
  int add(std::span<const Buffer> chain);
  int add_indirect(uint64_t table_gpa, uint8_t* table, std::span<const Buffer> chain);
  bool take_used(uint32_t& id, uint32_t& len);
  void set_event(uint16_t flags, uint16_t off_wrap = 0);

  virtio::PackedDesc* desc() { return desc_; }
  [[nodiscard]] uint16_t size() const { return size_; }

 private:
  int place(std::span<const virtio::PackedDesc> descs, uint16_t id);
  virtio::Barriers barriers_;
  uint16_t size_;
  virtio::RingAddresses rings_;
  virtio::PackedDesc* desc_;
  virtio::EventSuppress* driver_event_;
  std::vector<uint16_t> free_ids_;
  std::vector<uint16_t> id_slots_;
  uint16_t next_avail_ = 0;
  bool avail_wrap_ = true;
  uint16_t next_used_ = 0;
  bool used_wrap_ = true;
  uint32_t free_slots_;
};

}  // namespace sriovd::guest
