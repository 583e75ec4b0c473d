#include "sriovd/virtio/iotlb.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "sriovd/util/error.hpp"
#include "sriovd/util/eventfd.hpp"
#include "sriovd/virtio/guest_memory.hpp"

namespace sriovd::virtio {

namespace {

// The last entry this thread hit, per table: consecutive buffers usually
// share a mapping, so most lookups are one range check.
struct LastHit {
  const void* table = nullptr;
  size_t index = 0;
};
thread_local LastHit t_last;

}  // namespace

Iotlb::Iotlb() : owned_(std::make_unique<Table>()), generation_(next_translation_version()) {
  current_.store(owned_.get());
  miss_fd_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!miss_fd_) throw_errno("eventfd for IOTLB misses");
}

Iotlb::~Iotlb() = default;

void Iotlb::publish() {
  if (!staged_) return;
  auto next = std::make_unique<Table>(staging_);
  current_.store(next.get(), std::memory_order_release);
  generation_.store(next_translation_version(), std::memory_order_release);
  retired_.push_back(std::move(owned_));
  owned_ = std::move(next);
  staged_ = false;
}

namespace {
// The first entry of a sorted table that ends after `iova`.
std::vector<IotlbEntry>::iterator first_ending_after(std::vector<IotlbEntry>& t, uint64_t iova) {
  return std::partition_point(t.begin(), t.end(), [&](const IotlbEntry& x) { return x.iova + x.size <= iova; });
}
}  // namespace

void Iotlb::update(const IotlbEntry& e) {
  if (e.size == 0 || e.iova > UINT64_MAX - e.size || e.uaddr > UINT64_MAX - e.size ||
      !(e.perm & (kIotlbRead | kIotlbWrite)))
    throw std::invalid_argument("IOTLB update of " + std::to_string(e.size) + " bytes at IOVA " +
                                std::to_string(e.iova) + " (front-end address " + std::to_string(e.uaddr) +
                                ", permission " + std::to_string(e.perm) + "): empty, without permission, or wrapping");
  // The entries it overlaps are one run of the sorted table: replaced by it.
  auto from = first_ending_after(staging_, e.iova);
  auto to = std::partition_point(from, staging_.end(), [&](const IotlbEntry& x) { return x.iova < e.iova + e.size; });
  if (from == to && staging_.size() >= kMaxEntries)
    throw std::invalid_argument("IOTLB update at IOVA " + std::to_string(e.iova) + ": the table holds " +
                                std::to_string(kMaxEntries) + " translations already");
  from = staging_.erase(from, to);
  staging_.insert(from, e);
  staged_ = true;
}

void Iotlb::invalidate(uint64_t iova, uint64_t size) {
  const uint64_t end = size > UINT64_MAX - iova ? UINT64_MAX : iova + size;  // a range to the top is the top
  auto from = first_ending_after(staging_, iova);
  auto to = std::partition_point(from, staging_.end(), [&](const IotlbEntry& x) { return x.iova < end; });
  if (from == to) return;
  staging_.erase(from, to);
  staged_ = true;
}

void Iotlb::clear() {
  staging_.clear();
  staged_ = true;
  publish();
}

void Iotlb::reclaim() { retired_.clear(); }

size_t Iotlb::size() const { return staging_.size(); }

bool Iotlb::lookup_entry(uint64_t iova, uint64_t len, uint8_t need, IotlbEntry& out) const {
  const Table* t = current_.load(std::memory_order_acquire);
  auto covers = [&](const IotlbEntry& e) {
    return iova >= e.iova && len <= e.size && iova - e.iova <= e.size - len && (e.perm & need) == need;
  };
  if (t_last.table == t && t_last.index < t->size() && covers((*t)[t_last.index])) {
    out = (*t)[t_last.index];
    return true;
  }
  // The last entry starting at or below iova.
  auto it = std::upper_bound(t->begin(), t->end(), iova, [](uint64_t v, const IotlbEntry& e) { return v < e.iova; });
  if (it == t->begin()) return false;
  --it;
  if (covers(*it)) {
    t_last = {t, static_cast<size_t>(it - t->begin())};
    out = *it;
    return true;
  }
  // A range over several entries (a ring in page-sized mappings) is one
  // range if they follow each other in IOVA and in the front-end's space.
  if (iova - it->iova >= it->size || (it->perm & need) != need) return false;
  const uint64_t start = it->uaddr + (iova - it->iova);
  uint64_t covered = it->size - (iova - it->iova);
  uint8_t perm = it->perm;
  for (auto next = it + 1; covered < len; ++next) {
    if (next == t->end() || next->iova != iova + covered || next->uaddr != start + covered ||
        (next->perm & need) != need)
      return false;
    covered += next->size;
    perm &= next->perm;
  }
  out = {iova, covered, start, perm};
  return true;
}

bool Iotlb::lookup(uint64_t iova, uint64_t len, bool write, uint64_t& uaddr) const {
  IotlbEntry e;
  if (!lookup_entry(iova, len, write ? kIotlbWrite : kIotlbRead, e)) return false;
  uaddr = e.uaddr + (iova - e.iova);
  return true;
}

uint64_t Iotlb::first_gap(uint64_t iova, uint64_t len, bool write) const {
  const Table* t = current_.load(std::memory_order_acquire);
  const uint8_t need = write ? kIotlbWrite : kIotlbRead;
  uint64_t at = iova;
  const uint64_t end = iova + len;
  while (at < end) {
    auto it = std::upper_bound(t->begin(), t->end(), at, [](uint64_t v, const IotlbEntry& e) { return v < e.iova; });
    if (it == t->begin()) return at;
    --it;
    if (at - it->iova >= it->size || !(it->perm & need)) return at;
    at = it->iova + it->size;
  }
  return end;
}

void Iotlb::report_miss(uint64_t iova, bool write) {
  misses_.fetch_add(1, std::memory_order_relaxed);
  uint64_t expected = 0;
  // Page-aligned IOVA with the permission in the low bits.
  const uint64_t slot = (iova & ~0xfffULL) | (write ? kIotlbWrite : kIotlbRead);
  if (miss_slot_.compare_exchange_strong(expected, slot)) {
    own_eventfd_signal(miss_fd_.get());
  }
}

bool Iotlb::take_miss(uint64_t& iova, uint8_t& perm) {
  own_eventfd_drain(miss_fd_.get());
  const uint64_t slot = miss_slot_.exchange(0);
  if (slot == 0) return false;
  iova = slot & ~0xfffULL;
  perm = static_cast<uint8_t>(slot & 0x3U);
  return true;
}

}  // namespace sriovd::virtio
