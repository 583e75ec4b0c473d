#include "sriovd/virtio/guest_memory.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <stdexcept>

#include "sriovd/util/error.hpp"

namespace sriovd::virtio {

namespace {

// The last IOVA translation this thread made, straight to a host pointer:
// the part of an IOTLB entry inside one memory region. Valid while the
// memory (epoch) and the IOTLB (generation) are what they were.
struct IovaCache {
  const void* mem = nullptr;
  uint64_t epoch = 0;
  uint64_t generation = 0;
  uint64_t iova = 0;
  uint64_t size = 0;
  uint8_t* host = nullptr;
  uint8_t perm = 0;
};
thread_local IovaCache t_iova;

}  // namespace

GuestMemory::~GuestMemory() { clear(); }

void GuestMemory::clear() {
  for (const auto& m : mappings_) ::munmap(m.base, m.length);
  mappings_.clear();
  regions_.clear();
  last_hit_ = 0;
  ++epoch_;
}

bool GuestMemory::remove_region(uint64_t guest_addr, uint64_t size) {
  for (auto it = regions_.begin(); it != regions_.end(); ++it) {
    if (it->guest_addr != guest_addr || it->size != size) continue;
    uint8_t* host = it->host;
    regions_.erase(it);
    for (auto m = mappings_.begin(); m != mappings_.end(); ++m) {
      auto* base = static_cast<uint8_t*>(m->base);
      if (host >= base && host < base + m->length) {
        ::munmap(m->base, m->length);
        mappings_.erase(m);
        break;
      }
    }
    last_hit_ = 0;
    ++epoch_;
    return true;
  }
  return false;
}

void GuestMemory::add_host_region(uint64_t guest_addr, uint64_t size, uint64_t user_addr, void* host) {
  if (size == 0) throw std::invalid_argument("guest memory region of size 0");
  if (guest_addr + size < guest_addr) throw std::invalid_argument("guest memory region wraps around");
  for (const auto& r : regions_)
    if (guest_addr < r.guest_addr + r.size && r.guest_addr < guest_addr + size)
      throw std::invalid_argument("guest memory regions overlap at 0x" + std::to_string(guest_addr));
  regions_.push_back({guest_addr, size, user_addr, static_cast<uint8_t*>(host)});
  ++epoch_;
}

void GuestMemory::add_fd_region(uint64_t guest_addr, uint64_t size, uint64_t user_addr, int fd, uint64_t mmap_offset) {
  void* p = ::mmap(nullptr, size + mmap_offset, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw_errno("mapping guest memory region of " + std::to_string(size) + " bytes");
  try {
    add_host_region(guest_addr, size, user_addr, static_cast<uint8_t*>(p) + mmap_offset);
  } catch (...) {
    ::munmap(p, size + mmap_offset);
    throw;
  }
  mappings_.push_back({p, size + mmap_offset});
}

uint8_t* GuestMemory::translate(uint64_t gpa, uint64_t len, bool device_writes) const {
  if (!iotlb_) return translate_gpa(gpa, len);
  const uint64_t generation = iotlb_->generation();
  const uint8_t need = device_writes ? kIotlbWrite : kIotlbRead;
  IovaCache& c = t_iova;
  if (c.mem == this && c.epoch == epoch_ && c.generation == generation && gpa >= c.iova && len <= c.size &&
      gpa - c.iova <= c.size - len && (c.perm & need))
    return c.host + (gpa - c.iova);
  IotlbEntry e;
  if (!iotlb_->lookup_entry(gpa, len, device_writes, e)) return nullptr;
  const uint64_t u = e.uaddr + (gpa - e.iova);
  for (const auto& r : regions_) {
    if (u < r.user_addr || len > r.size || u - r.user_addr > r.size - len) continue;
    const uint64_t begin = std::max(e.uaddr, r.user_addr);
    const uint64_t end = std::min(e.uaddr + e.size, r.user_addr + r.size);
    c = {this, epoch_, generation, e.iova + (begin - e.uaddr), end - begin, r.host + (begin - r.user_addr), e.perm};
    return r.host + (u - r.user_addr);
  }
  return nullptr;
}

bool GuestMemory::iotlb_miss(uint64_t iova, uint64_t len, bool device_writes) const {
  if (!iotlb_) return false;
  uint64_t uaddr = 0;
  if (iotlb_->lookup(iova, len, device_writes, uaddr)) return false;  // translated, but outside the memory table
  // Ask for the first page not translated: a buffer over two pages may
  // have its first one already. Translated all through but not contiguous
  // in the front-end's memory (two RAM blocks) is not a miss: a segment
  // is one pointer, so such a buffer is refused as a bad address.
  const uint64_t gap = iotlb_->first_gap(iova, len, device_writes);
  if (gap == iova + len) return false;
  iotlb_->report_miss(gap, device_writes);
  return true;
}

uint8_t* GuestMemory::translate_gpa(uint64_t gpa, uint64_t len) const {
  auto inside = [&](const MemoryRegion& r) {
    return gpa >= r.guest_addr && len <= r.size && gpa - r.guest_addr <= r.size - len;
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
