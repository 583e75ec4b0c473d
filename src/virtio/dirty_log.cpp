#include "sriovd/virtio/dirty_log.hpp"

#include <unistd.h>

#include "sriovd/virtio/guest_memory.hpp"

namespace sriovd::virtio {

void DirtyLog::mark_gpa(uint64_t gpa, uint64_t len) const {
  if (len == 0) return;
  const uint64_t first = gpa / kPage;
  const uint64_t last = (gpa + len - 1) / kPage;
  if (last < first || last / 8 >= bytes_) {  // wrapped, or past the log's end
    missed_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  for (uint64_t page = first; page <= last; ++page)
    std::atomic_ref<uint8_t>(bits_[page / 8])
        .fetch_or(static_cast<uint8_t>(1U << (page % 8)), std::memory_order_release);
}

void DirtyLog::mark_host(const void* p, uint64_t len) const {
  const auto* host = static_cast<const uint8_t*>(p);
  const auto& regions = memory_.regions();
  for (const MemoryRegion& r : regions) {
    if (host < r.host || host >= r.host + r.size) continue;
    const uint64_t offset = static_cast<uint64_t>(host - r.host);
    const uint64_t uva = r.user_addr + offset;
    bool marked = false;
    for (const MemoryRegion& alias : regions) {
      if (uva < alias.user_addr || uva - alias.user_addr >= alias.size) continue;
      mark_gpa(alias.guest_addr + (uva - alias.user_addr), len);
      marked = true;
    }
    if (!marked) mark_gpa(r.guest_addr + offset, len);  // (user_addr wrapped: the region itself)
    return;
  }
  missed_.fetch_add(1, std::memory_order_relaxed);
}

void DirtyLog::published() const {
  if (notify_fd_ < 0) return;
  const uint64_t one = 1;
  (void)::write(notify_fd_, &one, sizeof one);  // non-blocking (checked_peer_eventfd); a full count is no news
}

}  // namespace sriovd::virtio
