#pragma once
// Guest memory as a vhost-user front-end shares it: regions of guest
// physical addresses backed by fds the daemon maps. translate() is the one
// place a guest address becomes a pointer, and it checks the whole range.

#include <sys/uio.h>

#include <cstdint>
#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/util/peer_mapping.hpp"
#include "sriovd/virtio/dirty_log.hpp"
#include "sriovd/virtio/iotlb.hpp"

namespace sriovd::virtio {

struct MemoryRegion {
  uint64_t guest_addr = 0;
  uint64_t size = 0;
  uint64_t user_addr = 0;  // the front-end's virtual address (vhost-user ring addresses use it)
  uint8_t* host = nullptr;
  uint8_t perm = kIotlbRead | kIotlbWrite;  // what the device may do here (a vfio-user window's flags)
};

// A process-wide counter for the versions of memory maps and IOTLB tables:
// a cached translation names the version it was made under, and no two
// objects ever share one (a new GuestMemory at a freed one's address must
// not hit the old one's cache entries).
uint64_t next_translation_version();

class GuestMemory {
 public:
  GuestMemory() = default;
  ~GuestMemory();
  GuestMemory(const GuestMemory&) = delete;
  GuestMemory& operator=(const GuestMemory&) = delete;

  // The one place a peer's memory enters (vhost-user regions): maps `size`
  // bytes of `fd` from `mmap_offset` as guest [guest_addr, +size) (a
  // PeerMemory, charged to the quota set_quota gave). Throws, naming the
  // region: std::invalid_argument on a zero size, a wrapping guest or
  // front-end range, overlap; PeerMemoryError on an fd that is not a regular
  // file (memfd, hugetlbfs, tmpfs) or does not cover offset + size, a full
  // quota (EDQUOT) or a failed mmap.
  void add_fd_region(uint64_t guest_addr, uint64_t size, uint64_t user_addr, int fd, uint64_t mmap_offset);
  // The client's share that add_fd_region charges (null: none); it
  // outlives this memory's regions.
  void set_quota(PeerMemoryQuota* quota) { quota_ = quota; }
  // Memory mapped by the caller (tests, the in-process front-end, a
  // vfio-user DMA window the server mapped with `perm`'s protection).
  // `guard`: the caller's registration of that mapping against its peer
  // truncating it (PeerMapping), which faulted() then also watches.
  void add_host_region(uint64_t guest_addr, uint64_t size, uint64_t user_addr, void* host,
                       uint8_t perm = kIotlbRead | kIotlbWrite, const PeerMapping* guard = nullptr);
  // The peer shrank a file under one of the mappings (a page of it now
  // reads as zeros): the device on this memory is to fail, not go on.
  [[nodiscard]] bool faulted() const;
  void clear();
  // Unmaps the region at [guest_addr, guest_addr + size) that add_*_region
  // made (vhost-user REM_MEM_REG); false if there is none.
  bool remove_region(uint64_t guest_addr, uint64_t size);

  // Pointer to [gpa, gpa+len) if it lies inside one region; nullptr if not.
  // With an IOTLB (VIRTIO_F_ACCESS_PLATFORM) the address is an IOVA: the
  // IOTLB gives the front-end address (checking `device_writes` against
  // the entry's permission), and the memory table the pointer.
  // Either way the region must allow the access (a read-only vfio-user
  // window is never written through).
  [[nodiscard]] uint8_t* translate(uint64_t gpa, uint64_t len, bool device_writes = false) const {
    return translate_perm(gpa, len, device_writes ? kIotlbWrite : kIotlbRead);
  }
  // For ring parts the device reads and writes (used ring, packed ring).
  [[nodiscard]] uint8_t* translate_rw(uint64_t gpa, uint64_t len) const {
    return translate_perm(gpa, len, kIotlbRead | kIotlbWrite);
  }
  [[nodiscard]] uint8_t* translate_perm(uint64_t gpa, uint64_t len, uint8_t need) const;
  // After translate() failed: was it an IOTLB miss (then reported to the
  // IOTLB, and worth a retry once it is answered) rather than a bad address?
  [[nodiscard]] bool iotlb_miss(uint64_t iova, uint64_t len, bool device_writes) const;
  void set_iotlb(Iotlb* iotlb) { iotlb_ = iotlb; }
  [[nodiscard]] bool has_iotlb() const { return iotlb_ != nullptr; }
  // The same for a front-end virtual address (vhost-user vring addresses).
  [[nodiscard]] uint8_t* translate_user(uint64_t uva, uint64_t len) const;
  // A front-end virtual address as a guest address (vhost-user ring
  // addresses are virtual); false when no region holds [uva, uva+len).
  [[nodiscard]] bool user_to_guest(uint64_t uva, uint64_t len, uint64_t& gpa) const;
  [[nodiscard]] const std::vector<MemoryRegion>& regions() const { return regions_; }
  // The dirty log the device marks its writes in (virtio/dirty_log.hpp),
  // or null. Changed only with the device on this memory stopped: rings
  // and workers take it when they start.
  void set_dirty_log(const DirtyLog* log) { log_ = log; }
  [[nodiscard]] const DirtyLog* dirty_log() const { return log_; }

 private:
  [[nodiscard]] uint8_t* translate_gpa(uint64_t gpa, uint64_t len, uint8_t need) const;
  std::vector<MemoryRegion> regions_;
  Iotlb* iotlb_ = nullptr;
  const DirtyLog* log_ = nullptr;
  uint64_t epoch_ = next_translation_version();  // changes with the regions: cached translations check it
  std::vector<PeerMemory> mappings_;
  PeerMemoryQuota* quota_ = nullptr;
  std::vector<const PeerMapping*> guards_;  // of host regions mapped by others
  mutable size_t last_hit_ = 0;
};

}  // namespace sriovd::virtio
