#pragma once
// Memory a peer shared (a VMM's guest RAM memfd, a vfio-user DMA window, a
// vhost-user dirty log or inflight buffer) stays the peer's: it can truncate
// or hole-punch the file under the daemon's mapping at any time, and the
// next touch of a page past the new end raises SIGBUS in whichever thread
// made it - a device's worker, the control thread. A mapping registered here
// survives that: the SIGBUS handler puts a private zero page of the
// mapping's own page size (4 KiB, or the huge page of a hugetlbfs file:
// a 4 KiB patch inside a hugetlb mapping is refused by the kernel) where the
// file's page was, notes the fault on the mapping, and the access goes on.
// The owner sees faulted() and fails its own device (NEEDS_RESET, the
// connection ended); the daemon and the other tenants do not notice. A
// SIGBUS anywhere else is what it always was: fatal.
//
// PeerMemory is the one way peer memory is mapped: the range checked
// against the fd (peer_memory_problem), mapped from its page-aligned start
// to exactly its end rounded to the backing's page size, registered, charged
// to the client's PeerMemoryQuota, and unmapped with exactly the length
// mapped (the result checked). No client can fill a table others need: the
// registry grows with what the quotas allow, and each client is held to its
// own share.
//
// The handler only reads the registry (atomics, blocks that are never
// freed) and makes one mmap system call; registration is control plane.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace sriovd {

class PeerMapping {
 public:
  PeerMapping() = default;
  // Registers [base, base + length), whose pages are `page` bytes (a power
  // of two; base and length multiples of it).
  PeerMapping(void* base, size_t length, size_t page);
  ~PeerMapping();
  PeerMapping(PeerMapping&& other) noexcept;
  PeerMapping& operator=(PeerMapping&& other) noexcept;
  PeerMapping(const PeerMapping&) = delete;
  PeerMapping& operator=(const PeerMapping&) = delete;

  // A page of it faulted (the peer shrank its file) since registration.
  [[nodiscard]] bool faulted() const;

 private:
  void release();
  void* slot_ = nullptr;  // its registry slot
};

// How many SIGBUS faults on peer mappings the process has absorbed.
uint64_t peer_mapping_faults();
// How many peer mappings are registered now (all clients).
size_t peer_mappings_registered();

// What one client (a vhost-user connection, a vfio-user session) may make
// the daemon map at once: config `peer_limits` (README, "Who may do what").
struct PeerMemoryLimits {
  uint32_t max_mappings = 1024;              // regions, windows, logs, inflight buffers
  uint64_t max_bytes = 1ULL << 40U;          // the sizes it declared (1 TiB)
  uint64_t max_address_space = 1ULL << 41U;  // what those take mapped, rounded to pages (2 TiB)
  bool operator==(const PeerMemoryLimits&) const = default;
};

// The limits a new client gets (the daemon sets them from its config; a
// reload applies to clients that connect after it).
void set_default_peer_memory_limits(const PeerMemoryLimits& limits);
PeerMemoryLimits default_peer_memory_limits();

// A mapping refused: the range does not fit its fd, a quota is full, or
// mmap failed. `error` is the errno a protocol reply carries (EINVAL,
// EDQUOT, mmap's).
class PeerMemoryError : public std::runtime_error {
 public:
  PeerMemoryError(int err, const std::string& what) : std::runtime_error(what), error(err) {}
  int error;
};

// One client's share. Control plane only (charged and released on the
// thread that serves the client's messages); outlives its mappings.
class PeerMemoryQuota {
 public:
  PeerMemoryQuota() : PeerMemoryQuota(default_peer_memory_limits()) {}
  explicit PeerMemoryQuota(const PeerMemoryLimits& limits) : limits_(limits) {}
  PeerMemoryQuota(const PeerMemoryQuota&) = delete;
  PeerMemoryQuota& operator=(const PeerMemoryQuota&) = delete;
  // Throws PeerMemoryError(EDQUOT) naming the limit, and charges nothing.
  void charge(uint64_t bytes, uint64_t address_space, const std::string& what);
  void release(uint64_t bytes, uint64_t address_space);
  [[nodiscard]] uint32_t mappings() const { return mappings_; }
  [[nodiscard]] uint64_t bytes() const { return bytes_; }
  [[nodiscard]] uint64_t address_space() const { return address_space_; }
  [[nodiscard]] const PeerMemoryLimits& limits() const { return limits_; }
  // A new client of the same export (a reload's limits apply to it); what
  // is still mapped stays charged.
  void set_limits(const PeerMemoryLimits& limits) { limits_ = limits; }
  // How many mappings were refused for a full quota.
  [[nodiscard]] uint64_t refused() const { return refused_; }

 private:
  PeerMemoryLimits limits_;
  uint32_t mappings_ = 0;
  uint64_t bytes_ = 0;
  uint64_t address_space_ = 0;
  uint64_t refused_ = 0;
};

class PeerMemory {
 public:
  PeerMemory() = default;
  // Maps [offset, offset + size) of `fd` with `prot` (PROT_NONE allowed),
  // charged to `quota` (may be null: not charged). Throws PeerMemoryError
  // whose message starts with `what`.
  PeerMemory(int fd, uint64_t offset, uint64_t size, int prot, PeerMemoryQuota* quota, const std::string& what);
  ~PeerMemory() { reset(); }
  PeerMemory(PeerMemory&& other) noexcept { *this = std::move(other); }
  PeerMemory& operator=(PeerMemory&& other) noexcept;
  PeerMemory(const PeerMemory&) = delete;
  PeerMemory& operator=(const PeerMemory&) = delete;

  // Unregisters, then unmaps exactly what was mapped; releases the charge.
  void reset();
  // The first byte of the range (offset), or null.
  [[nodiscard]] uint8_t* data() const { return base_ ? static_cast<uint8_t*>(base_) + skew_ : nullptr; }
  [[nodiscard]] uint64_t size() const { return size_; }
  [[nodiscard]] size_t mapped_length() const { return length_; }
  [[nodiscard]] size_t page_size() const { return page_; }
  [[nodiscard]] bool faulted() const { return guard_.faulted(); }
  [[nodiscard]] const PeerMapping& guard() const { return guard_; }
  [[nodiscard]] explicit operator bool() const { return base_ != nullptr; }

 private:
  void* base_ = nullptr;
  size_t length_ = 0;
  uint64_t skew_ = 0;
  uint64_t size_ = 0;
  size_t page_ = 0;
  PeerMapping guard_;
  PeerMemoryQuota* quota_ = nullptr;
};

// How many munmap calls on peer memory failed (never expected: each is a
// mapping's exact length; counted, and logged once by the owner).
uint64_t peer_unmap_failures();

// Why [offset, offset + size) of `fd` cannot back memory a peer shares;
// empty when it can. The one check of every such fd (vhost-user regions and
// the inflight buffer, vfio-user DMA windows): the range does not wrap, the
// fd is a regular file (memfd, tmpfs, hugetlbfs, a file on a local disk)
// that covers the range now, and its filesystem does not serve page faults
// from a user process or the network (FUSE - possibly the peer itself -
// NFS, SMB, 9p, Ceph): a worker touching such a page waits as long as that
// server likes. `page`, when given, is set to the file's page size (the
// huge page size on hugetlbfs).
std::string peer_memory_problem(int fd, uint64_t offset, uint64_t size, size_t* page = nullptr);

}  // namespace sriovd
