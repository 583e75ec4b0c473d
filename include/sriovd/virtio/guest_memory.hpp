#pragma once
// Guest memory as a vhost-user front-end shares it: regions of guest
// physical addresses backed by fds the daemon maps. translate() is the one
// place a guest address becomes a pointer, and it checks the whole range.

#include <sys/uio.h>

#include <cstdint>
#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/virtio/iotlb.hpp"

namespace sriovd::virtio {

struct MemoryRegion {
  uint64_t guest_addr = 0;
  uint64_t size = 0;
  uint64_t user_addr = 0;  // the front-end's virtual address (vhost-user ring addresses use it)
  uint8_t* host = nullptr;
};

class GuestMemory {
 public:
  GuestMemory() = default;
  ~GuestMemory();
  GuestMemory(const GuestMemory&) = delete;
  GuestMemory& operator=(const GuestMemory&) = delete;

  // Maps `size` bytes of `fd` from `mmap_offset` as guest [guest_addr, +size).
  // Throws on overlap, zero size, or a failed mmap.
  void add_fd_region(uint64_t guest_addr, uint64_t size, uint64_t user_addr, int fd, uint64_t mmap_offset);
  // Memory the caller owns (tests, the in-process front-end).
  void add_host_region(uint64_t guest_addr, uint64_t size, uint64_t user_addr, void* host);
  void clear();
  // Unmaps the region at [guest_addr, guest_addr + size) that add_*_region
  // made (vhost-user REM_MEM_REG); false if there is none.
  bool remove_region(uint64_t guest_addr, uint64_t size);

  // Pointer to [gpa, gpa+len) if it lies inside one region; nullptr if not.
  // With an IOTLB (VIRTIO_F_ACCESS_PLATFORM) the address is an IOVA: the
  // IOTLB gives the front-end address (checking `device_writes` against
  // the entry's permission), and the memory table the pointer.
  [[nodiscard]] uint8_t* translate(uint64_t gpa, uint64_t len, bool device_writes = false) const;
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

 private:
  struct Mapping {
    void* base = nullptr;
    size_t length = 0;
  };
  [[nodiscard]] uint8_t* translate_gpa(uint64_t gpa, uint64_t len) const;
  std::vector<MemoryRegion> regions_;
  Iotlb* iotlb_ = nullptr;
  uint64_t epoch_ = 1;  // changes with the regions: cached translations check it
  std::vector<Mapping> mappings_;
  mutable size_t last_hit_ = 0;
};

}  // namespace sriovd::virtio
