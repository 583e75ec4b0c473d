#include "sriovd/virtio/dirty_log.hpp"

#include <cerrno>

#include <algorithm>

#include "sriovd/util/eventfd.hpp"
#include "sriovd/virtio/guest_memory.hpp"

namespace sriovd::virtio {

void DirtyLog::mark_gpa(uint64_t gpa, uint64_t len) const {
  if (len == 0) return;
  if (gpa < base_) {  // before the log's start
    missed_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const uint64_t first = (gpa - base_) / kPage;
  const uint64_t last = (gpa - base_ + len - 1) / kPage;
  if (last < first || last / 8 >= bytes_) {  // wrapped, or past the log's end
    missed_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  // One atomic OR per byte of the log: a 64 KiB write is two or three.
  for (uint64_t page = first; page <= last;) {
    const uint64_t byte = page / 8;
    const uint64_t end = std::min(last, byte * 8 + 7);  // the last page in this byte
    const auto bits = static_cast<uint8_t>(((1U << (end - page + 1)) - 1U) << (page % 8));
    std::atomic_ref<uint8_t>(bits_[byte]).fetch_or(bits, std::memory_order_release);
    page = end + 1;
  }
}

void DirtyLog::mark_host(const void* p, uint64_t len) const {
  const auto* host = static_cast<const uint8_t*>(p);
  const auto& regions = memory_.regions();
  // A run of bytes may go on into another region's mapping that happens to
  // follow in the address space: each region's part at its own address.
  while (len > 0) {
    const MemoryRegion* in = nullptr;
    for (const MemoryRegion& r : regions)
      if (host >= r.host && host < r.host + r.size) in = &r;
    if (!in) {
      missed_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    const uint64_t offset = static_cast<uint64_t>(host - in->host);
    const uint64_t n = std::min(len, in->size - offset);
    const uint64_t uva = in->user_addr + offset;
    bool marked = false;
    for (const MemoryRegion& alias : regions) {
      if (uva < alias.user_addr || uva - alias.user_addr >= alias.size) continue;
      mark_gpa(alias.guest_addr + (uva - alias.user_addr), n);
      marked = true;
    }
    if (!marked) mark_gpa(in->guest_addr + offset, n);  // (user_addr wrapped: the region itself)
    host += n;
    len -= n;
  }
}

void DirtyLog::published() const {
  if (notify_fd_ < 0 || notify_blocked_.load(std::memory_order_relaxed)) return;
  // The front-end shares the file: one it made blocking (and filled) is
  // cut by the peer I/O watchdog and written no more; a full count is no news.
  if (!peer_eventfd_write(notify_fd_) && errno == EINTR) notify_blocked_.store(true, std::memory_order_relaxed);
}

}  // namespace sriovd::virtio
