#pragma once
// Memory a peer shared (a VMM's guest RAM memfd, a vfio-user DMA window)
// stays the peer's: it can truncate the file under the daemon's mapping at
// any time, and the next touch of a page past the new end raises SIGBUS in
// whichever thread made it - a device's worker, the control thread. A
// mapping registered here survives that: the SIGBUS handler puts a private
// zero page where the file's page was, notes the fault on the mapping, and
// the access goes on. The owner sees faulted() and fails its own device
// (NEEDS_RESET, the connection ended); the daemon and the other tenants do
// not notice. A SIGBUS anywhere else is what it always was: fatal.
//
// The handler only reads the registry (atomics, fixed slots) and makes one
// mmap system call; registration is control plane.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace sriovd {

class PeerMapping {
 public:
  PeerMapping() = default;
  // Registers [base, base + length); throws std::runtime_error when every
  // slot is taken (kMaxPeerMappings: more than the daemon's caps allow).
  PeerMapping(void* base, size_t length);
  ~PeerMapping();
  PeerMapping(PeerMapping&& other) noexcept;
  PeerMapping& operator=(PeerMapping&& other) noexcept;
  PeerMapping(const PeerMapping&) = delete;
  PeerMapping& operator=(const PeerMapping&) = delete;

  // A page of it faulted (the peer shrank its file) since registration.
  [[nodiscard]] bool faulted() const;

  static constexpr size_t kMaxPeerMappings = 1024;

 private:
  void release();
  int slot_ = -1;
};

// How many SIGBUS faults on peer mappings the process has absorbed.
uint64_t peer_mapping_faults();

// Why [offset, offset + size) of `fd` cannot back memory a peer shares;
// empty when it can. The one check of every such fd (vhost-user regions and
// the inflight buffer, vfio-user DMA windows): the range does not wrap, the
// fd is a regular file (memfd, tmpfs, hugetlbfs, a file on a local disk)
// that covers the range now, and its filesystem does not serve page faults
// from a user process or the network (FUSE - possibly the peer itself -
// NFS, SMB, 9p, Ceph): a worker touching such a page waits as long as that
// server likes.
std::string peer_memory_problem(int fd, uint64_t offset, uint64_t size);

}  // namespace sriovd
