#pragma once
// The device IOTLB of VIRTIO_F_ACCESS_PLATFORM over vhost-user: every
// address in the rings is an IOVA the front-end's IOMMU translates; the
// front-end pushes translations (IOTLB_MSG UPDATE / INVALIDATE) and the
// device asks for what it lacks (a MISS on the back-end channel).
//
// Data plane: lookup() reads the current table without a lock - a sorted
// array published with a release store, searched with a per-thread
// last-hit cache (O(1) for the runs of buffers that share a mapping, and
// the ring metadata is translated once per queue start anyway). The
// control plane changes a staging table and publishes a copy of it once per
// burst of messages, keeping the old ones until reclaim(), which the owner
// calls when no worker runs.

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "sriovd/util/fd.hpp"

namespace sriovd::virtio {

// vhost_iotlb_msg permissions (linux/vhost_types.h).
inline constexpr uint8_t kIotlbRead = 1;
inline constexpr uint8_t kIotlbWrite = 2;

struct IotlbEntry {
  uint64_t iova = 0;
  uint64_t size = 0;
  uint64_t uaddr = 0;  // the front-end's virtual address (its memory table)
  uint8_t perm = 0;
};

class Iotlb {
 public:
  Iotlb();
  ~Iotlb();
  Iotlb(const Iotlb&) = delete;
  Iotlb& operator=(const Iotlb&) = delete;

  // At most this many translations (256 MiB of 4 KiB pages, far more of
  // huge ones): an update beyond it is refused, so a peer cannot make the
  // daemon hold more.
  static constexpr size_t kMaxEntries = 65536;

  // --- control plane ---
  // Changes go to a staging table (sorted; a binary search and one insert
  // or erase each, no copy of the whole table); readers see them once
  // publish() makes a copy current - one copy per burst of messages, not
  // one per update.
  // Adds a translation; one that overlaps existing ones replaces them.
  // Throws std::invalid_argument, naming it, for an empty entry, one
  // without permission, one whose IOVA or front-end range wraps, or one
  // past kMaxEntries.
  void update(const IotlbEntry& e);
  // Drops every translation overlapping [iova, iova + size).
  void invalidate(uint64_t iova, uint64_t size);
  void clear();
  // Makes the staged changes what lookups see (no-op when there are none).
  void publish();
  [[nodiscard]] bool staged() const { return staged_; }
  // Frees replaced tables: only while no thread can be in lookup().
  void reclaim();
  [[nodiscard]] size_t retired() const { return retired_.size(); }
  [[nodiscard]] size_t size() const;

  // --- data plane (any thread) ---
  // The front-end address of [iova, iova + len) if one entry covers it with
  // the permission asked for; false otherwise.
  bool lookup(uint64_t iova, uint64_t len, bool write, uint64_t& uaddr) const;
  // The same, giving the whole translation that covers the range (for a
  // caller that caches it): out.iova <= iova, and [iova, iova + len) inside.
  // `need`: kIotlbRead, kIotlbWrite or both (a ring part read and written).
  bool lookup_entry(uint64_t iova, uint64_t len, uint8_t need, IotlbEntry& out) const;
  // Changes with every table published: a cached translation is valid
  // only for the generation it was made under.
  [[nodiscard]] uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  // The first address of [iova, iova + len) that no entry translates with
  // that permission (what to ask the front-end for); iova + len if none.
  [[nodiscard]] uint64_t first_gap(uint64_t iova, uint64_t len, bool write) const;
  // Records a miss for the control plane to ask about (one outstanding at
  // a time; more are found again when the rings are retried) and signals
  // miss_fd().
  void report_miss(uint64_t iova, bool write);
  // Takes the outstanding miss, if any.
  bool take_miss(uint64_t& iova, uint8_t& perm);
  [[nodiscard]] int miss_fd() const { return miss_fd_.get(); }
  [[nodiscard]] uint64_t misses() const { return misses_.load(); }

 private:
  using Table = std::vector<IotlbEntry>;  // sorted by iova, no overlaps
  Table staging_;                         // the control plane's, changed in place
  bool staged_ = false;                   // staging_ differs from current_
  std::atomic<const Table*> current_;
  std::unique_ptr<Table> owned_;  // what current_ points at
  std::vector<std::unique_ptr<Table>> retired_;
  std::atomic<uint64_t> generation_;    // from next_translation_version(): unique in the process
  std::atomic<uint64_t> miss_slot_{0};  // iova | 1 (read) or | 2 (write) in the low bits; 0: none
  std::atomic<uint64_t> misses_{0};
  UniqueFd miss_fd_;
};

}  // namespace sriovd::virtio
