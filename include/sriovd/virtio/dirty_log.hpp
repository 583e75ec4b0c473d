#pragma once
// Dirty page logging for live migration (the vhost-user spec, "Migration"):
// while the front-end copies the guest to another host, every page the
// device writes - received packets, used ring entries and index, packed
// descriptors, the event suppression it writes - is marked in a bitmap the
// front-end shares, one bit per 4 KiB guest page: bit (gpa / 4096) % 8 of
// byte gpa / 4096 / 8. The front-end copies marked pages again until the
// guest stops; a write the log misses leaves a stale page on the
// destination, which nobody notices until the guest reads it.
//
// A bit is set with an atomic OR after the write it marks (release: the
// data is visible before the bit), and before the used index or flags that
// hand the buffer back are published - the front-end clears bits
// concurrently (an atomic exchange) as it copies.
//
// The log is the front-end's memory (a memfd it may truncate: mapped under
// a PeerMapping guard by its owner, vhost_user::Backend). A DirtyLog is
// installed into the GuestMemory it covers (GuestMemory::set_dirty_log)
// with the device stopped; rings and workers take it when they start, so
// a device with no log pays one predictable branch per burst.

#include <atomic>
#include <cstdint>

namespace sriovd::virtio {

class GuestMemory;

class DirtyLog {
 public:
  static constexpr uint64_t kPage = 4096;
  // `bits`: the mapped log, `bytes` long, bit 0 for the page at `base`
  // (vhost-user's log starts at guest address 0; a vfio-user DMA log at
  // the first IOVA it tracks); `memory`: the guest memory whose host
  // pointers mark_host() turns back into guest addresses.
  DirtyLog(uint8_t* bits, uint64_t bytes, const GuestMemory& memory, uint64_t base = 0)
      : bits_(bits), bytes_(bytes), base_(base), memory_(memory) {}
  DirtyLog(const DirtyLog&) = delete;
  DirtyLog& operator=(const DirtyLog&) = delete;

  // [gpa, gpa + len) was written.
  void mark_gpa(uint64_t gpa, uint64_t len) const;
  // [p, p + len) was written through a pointer into guest memory (one
  // region's mapping, as GuestMemory::translate gave it): logged at the
  // guest address of that region and of every other region the front-end
  // maps at the same virtual address (the same memory seen at two guest
  // addresses; the spec's log is by guest physical address, and with an
  // IOTLB the address the device was given is an IOVA, never logged).
  void mark_host(const void* p, uint64_t len) const;
  // Guest addresses from base() up to covers() are in the log.
  [[nodiscard]] uint64_t covers() const { return base_ + bytes_ * 8 * kPage; }
  [[nodiscard]] uint64_t base() const { return base_; }
  [[nodiscard]] uint64_t bytes() const { return bytes_; }
  // Writes the log could not mark: past its end (a front-end that sized
  // it too small), or a pointer in no region. Each is a page the
  // destination may get stale; the owner shows the count.
  [[nodiscard]] uint64_t missed() const { return missed_.load(std::memory_order_relaxed); }
  // vhost-user SET_LOG_FD: an eventfd signalled after a burst of logged
  // writes is published (set with the device stopped; -1: none).
  void set_notify_fd(int fd) { notify_fd_ = fd; }
  void published() const;

 private:
  uint8_t* bits_;
  uint64_t bytes_;
  uint64_t base_;
  const GuestMemory& memory_;
  int notify_fd_ = -1;
  mutable std::atomic<bool> notify_blocked_{false};
  mutable std::atomic<uint64_t> missed_{0};
};

// How a ring logs what it writes into its device area (the used ring;
// packed: the device event suppression) and, packed, its descriptors.
// vhost-user: with VHOST_VRING_F_LOG the front-end gives the used ring's
// guest address for the log (log_guest_addr); with an IOTLB that address
// is an IOVA and the ring logs by its host pointer instead.
struct RingLog {
  static constexpr uint64_t kByHost = ~0ULL;
  const DirtyLog* log = nullptr;   // null: the ring logs nothing
  uint64_t device_area = kByHost;  // the device area's guest address in the log, or kByHost
};

}  // namespace sriovd::virtio
