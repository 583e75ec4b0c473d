#include "sriovd/virtio/guest_memory.hpp"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>

#include "sriovd/util/error.hpp"
#include "sriovd/util/hex.hpp"

namespace sriovd::virtio {

namespace {

// The last IOVA translation this thread made, straight to a host pointer:
// the part of an IOTLB entry inside one memory region. Valid while the
// memory (epoch) and the IOTLB (generation) are what they were.
struct IovaCache {
  uint64_t epoch = 0;  // unique per map version (next_translation_version), so no object check
  uint64_t generation = 0;
  uint64_t iova = 0;
  uint64_t size = 0;
  uint8_t* host = nullptr;
  uint8_t perm = 0;
};
thread_local IovaCache t_iova;

std::atomic<uint64_t> g_version{1};

}  // namespace

uint64_t next_translation_version() { return g_version.fetch_add(1, std::memory_order_relaxed); }

GuestMemory::~GuestMemory() { clear(); }

void GuestMemory::clear() {
  mappings_.clear();  // each unregistered, then unmapped
  guards_.clear();
  regions_.clear();
  last_hit_ = 0;
  epoch_ = next_translation_version();
}

bool GuestMemory::remove_region(uint64_t guest_addr, uint64_t size) {
  for (auto it = regions_.begin(); it != regions_.end(); ++it) {
    if (it->guest_addr != guest_addr || it->size != size) continue;
    uint8_t* host = it->host;
    regions_.erase(it);
    for (auto m = mappings_.begin(); m != mappings_.end(); ++m) {
      if (m->data() == host) {
        mappings_.erase(m);
        break;
      }
    }
    last_hit_ = 0;
    epoch_ = next_translation_version();
    return true;
  }
  return false;
}

bool GuestMemory::faulted() const {
  for (const auto& m : mappings_)
    if (m.faulted()) return true;
  for (const PeerMapping* g : guards_)
    if (g->faulted()) return true;
  return false;
}

void GuestMemory::add_host_region(uint64_t guest_addr, uint64_t size, uint64_t user_addr, void* host, uint8_t perm,
                                  const PeerMapping* guard) {
  const std::string what = "guest memory region [" + hex(guest_addr) + ", +" + hex(size) + ")";
  if (size == 0) throw std::invalid_argument(what + " is empty");
  if (guest_addr > UINT64_MAX - size) throw std::invalid_argument(what + " wraps around");
  if (user_addr > UINT64_MAX - size)
    throw std::invalid_argument(what + " at front-end address " + hex(user_addr) + " wraps around");
  for (const auto& r : regions_)
    if (guest_addr < r.guest_addr + r.size && r.guest_addr < guest_addr + size)
      throw std::invalid_argument(what + " overlaps [" + hex(r.guest_addr) + ", +" + hex(r.size) + ")");
  regions_.push_back({guest_addr, size, user_addr, static_cast<uint8_t*>(host), perm});
  if (guard) guards_.push_back(guard);
  epoch_ = next_translation_version();
}

void GuestMemory::add_fd_region(uint64_t guest_addr, uint64_t size, uint64_t user_addr, int fd, uint64_t mmap_offset) {
  const std::string what =
      "guest memory region [" + hex(guest_addr) + ", +" + hex(size) + ") at fd offset " + hex(mmap_offset);
  // The peer may truncate the file under this mapping at any time: a fault
  // there fails the device, not the daemon (util/peer_mapping.hpp).
  PeerMemory map(fd, mmap_offset, size, PROT_READ | PROT_WRITE, quota_, what);
  mappings_.reserve(mappings_.size() + 1);
  add_host_region(guest_addr, size, user_addr, map.data());
  mappings_.push_back(std::move(map));
}

uint8_t* GuestMemory::translate_perm(uint64_t gpa, uint64_t len, uint8_t need) const {
  if (!iotlb_) return translate_gpa(gpa, len, need);
  const uint64_t generation = iotlb_->generation();
  IovaCache& c = t_iova;
  if (c.epoch == epoch_ && c.generation == generation && gpa >= c.iova && len <= c.size &&
      gpa - c.iova <= c.size - len && (c.perm & need) == need)
    return c.host + (gpa - c.iova);
  IotlbEntry e;
  if (!iotlb_->lookup_entry(gpa, len, need, e)) return nullptr;
  const uint64_t u = e.uaddr + (gpa - e.iova);
  for (const auto& r : regions_) {
    if (u < r.user_addr || len > r.size || u - r.user_addr > r.size - len || (r.perm & need) != need) continue;
    // Entries are checked not to wrap when they arrive (Iotlb::update).
    const uint64_t begin = std::max(e.uaddr, r.user_addr);
    const uint64_t end = std::min(e.uaddr + e.size, r.user_addr + r.size);
    c = {epoch_,
         generation,
         e.iova + (begin - e.uaddr),
         end - begin,
         r.host + (begin - r.user_addr),
         static_cast<uint8_t>(e.perm & r.perm)};
    return r.host + (u - r.user_addr);
  }
  return nullptr;
}

bool GuestMemory::iotlb_miss(uint64_t iova, uint64_t len, bool device_writes) const {
  if (!iotlb_) return false;
  // The caller's translate() failed on the table published then; the
  // control thread may have published another since (the answer to an
  // earlier miss for the same page, found by another ring): what is judged
  // here is the table as it is now, each look on one table.
  for (int look = 0; look < 2; ++look) {
    uint64_t uaddr = 0;
    if (iotlb_->lookup(iova, len, device_writes, uaddr)) {
      // Translated now. Outside the memory table: a bad address. Inside:
      // it arrived after the caller looked; ask once more, so that the
      // answer's publication wakes the stalled ring (a second update for
      // the page is harmless).
      if (!translate_user(uaddr, len)) return false;
      iotlb_->report_miss(iova, device_writes);
      return true;
    }
    // Ask for the first page not translated: a buffer over two pages may
    // have its first one already.
    const uint64_t gap = iotlb_->first_gap(iova, len, device_writes);
    if (gap != iova + len) {
      iotlb_->report_miss(gap, device_writes);
      return true;
    }
    // Translated all through but by no single entry: not contiguous in the
    // front-end's memory (two RAM blocks; a segment is one pointer, so such
    // a buffer is refused as a bad address) - unless the table changed
    // between the two looks, which the second finds.
  }
  return false;
}

uint8_t* GuestMemory::translate_gpa(uint64_t gpa, uint64_t len, uint8_t need) const {
  auto inside = [&](const MemoryRegion& r) {
    return gpa >= r.guest_addr && len <= r.size && gpa - r.guest_addr <= r.size - len && (r.perm & need) == need;
  };
  if (last_hit_ < regions_.size() && inside(regions_[last_hit_]))
    return regions_[last_hit_].host + (gpa - regions_[last_hit_].guest_addr);
  for (size_t i = 0; i < regions_.size(); ++i)
    if (inside(regions_[i])) {
      last_hit_ = i;
      return regions_[i].host + (gpa - regions_[i].guest_addr);
    }
  return nullptr;
}

uint8_t* GuestMemory::translate_user(uint64_t uva, uint64_t len) const {
  for (const auto& r : regions_)
    if (uva >= r.user_addr && len <= r.size && uva - r.user_addr <= r.size - len) return r.host + (uva - r.user_addr);
  return nullptr;
}

bool GuestMemory::user_to_guest(uint64_t uva, uint64_t len, uint64_t& gpa) const {
  for (const auto& r : regions_)
    if (uva >= r.user_addr && len <= r.size && uva - r.user_addr <= r.size - len) {
      gpa = r.guest_addr + (uva - r.user_addr);
      return true;
    }
  return false;
}

}  // namespace sriovd::virtio
