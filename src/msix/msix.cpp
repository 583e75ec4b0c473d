#include "sriovd/msix/msix.hpp"

#include <stdexcept>
#include <string>

namespace sriovd::msix {

MsixState::MsixState(uint16_t vectors, VectorControl& control)
    : control_if_(control), entries_(vectors), irq_masked_(vectors, 0) {
  if (vectors == 0 || vectors > 2048)
    throw std::invalid_argument("MSI-X table size " + std::to_string(vectors) + " is outside 1..2048");
  for (unsigned v = 0; v < vectors; ++v) control_if_.set_masked(v, true);
}

uint16_t MsixState::read_message_control() const {
  // Table Size is N-1, read-only; bits 13:11 are reserved and read 0.
  return static_cast<uint16_t>((control_ & (kEnable | kFunctionMask)) | ((vectors() - 1U) & kTableSizeMask));
}

std::vector<bool> MsixState::masks() const {
  std::vector<bool> m(entries_.size());
  for (unsigned v = 0; v < entries_.size(); ++v) m[v] = effectively_masked(v);
  return m;
}

bool MsixState::effectively_masked(unsigned v) const {
  return !enabled() || function_masked() || irq_masked_.at(v) != 0 ||
         (table_forwarded_ && (entries_.at(v).control & kVectorMasked));
}

void MsixState::sync(const std::vector<bool>& before) {
  for (unsigned v = 0; v < entries_.size(); ++v) {
    const bool now = effectively_masked(v);
    if (now != before[v]) control_if_.set_masked(v, now);
  }
}

void MsixState::write_message_control(uint16_t value) {
  const auto before = masks();
  const bool was_enabled = enabled();
  control_ = value & (kEnable | kFunctionMask);
  // While MSI-X is disabled the function may not signal with it: what was
  // latched then is not a message the guest can be owed (as QEMU drops it).
  if (!was_enabled && enabled())
    for (unsigned v = 0; v < entries_.size(); ++v) control_if_.clear_pending(v);
  sync(before);
}

bool MsixState::valid_access(uint64_t offset, unsigned size, uint64_t limit) {
  if (size != 1 && size != 2 && size != 4 && size != 8) return false;
  if (offset % size != 0) return false;  // naturally aligned only
  return offset + size <= limit;
}

uint32_t MsixState::read_dword(unsigned vector, unsigned dword) const {
  const Entry& e = entries_[vector];
  switch (dword) {
    case 0: return static_cast<uint32_t>(e.address);
    case 1: return static_cast<uint32_t>(e.address >> 32U);
    case 2: return e.data;
    default: return e.control;
  }
}

void MsixState::write_dword(unsigned vector, unsigned dword, uint32_t value, bool notify) {
  Entry& e = entries_[vector];
  switch (dword) {
    case 0:  // Message Address: bits 1:0 are zero (DWORD-aligned), read-only here.
      e.address = (e.address & 0xffffffff00000000ULL) | (value & ~3U);
      control_if_.message_changed(vector, e.address, e.data);
      return;
    case 1:
      e.address = (e.address & 0xffffffffULL) | (static_cast<uint64_t>(value) << 32U);
      control_if_.message_changed(vector, e.address, e.data);
      return;
    case 2:
      e.data = value;
      control_if_.message_changed(vector, e.address, e.data);
      return;
    default: {
      const bool before = effectively_masked(vector);
      e.control = value & kVectorMasked;  // reserved bits 31:1 read as 0
      const bool now = effectively_masked(vector);
      if (notify && now != before) control_if_.set_masked(vector, now);
      return;
    }
  }
}

uint64_t MsixState::read_table(uint64_t offset, unsigned size) {
  if (!valid_access(offset, size, table_bytes())) {
    ++stats_.invalid;
    return size >= 8 ? ~0ULL : (1ULL << (8U * size)) - 1U;
  }
  const auto vector = static_cast<unsigned>(offset / kEntryBytes);
  const auto dword = static_cast<unsigned>((offset % kEntryBytes) / 4U);
  if (size == 8) return read_dword(vector, dword) | (static_cast<uint64_t>(read_dword(vector, dword + 1)) << 32U);
  const uint32_t d = read_dword(vector, dword);
  const unsigned shift = 8U * static_cast<unsigned>(offset % 4U);
  return size == 4 ? d : (d >> shift) & ((1U << (8U * size)) - 1U);
}

void MsixState::write_table(uint64_t offset, unsigned size, uint64_t value) {
  // §6.8.2: software uses aligned DWORD or QWORD accesses; anything else has
  // an undefined result, and here it changes nothing.
  if ((size != 4 && size != 8) || !valid_access(offset, size, table_bytes())) {
    ++stats_.invalid;
    return;
  }
  const auto vector = static_cast<unsigned>(offset / kEntryBytes);
  const auto dword = static_cast<unsigned>((offset % kEntryBytes) / 4U);
  if (!table_forwarded_) {
    // The first write from the client: from now on the table is the
    // guest's, and every vector's Mask Bit counts (most are still 1). One
    // transition per vector from before the write to after it: a first
    // write that unmasks a live vector must not mask it on the way.
    const auto before = masks();
    table_forwarded_ = true;
    write_dword(vector, dword, static_cast<uint32_t>(value), false);
    if (size == 8) write_dword(vector, dword + 1, static_cast<uint32_t>(value >> 32U), false);
    sync(before);
    return;
  }
  write_dword(vector, dword, static_cast<uint32_t>(value));
  if (size == 8) write_dword(vector, dword + 1, static_cast<uint32_t>(value >> 32U));
}

uint64_t MsixState::read_pba(uint64_t offset, unsigned size) {
  if (!valid_access(offset, size, pba_bytes())) {
    ++stats_.invalid;
    return size >= 8 ? ~0ULL : (1ULL << (8U * size)) - 1U;
  }
  uint64_t bits = 0;
  const unsigned first = static_cast<unsigned>(offset * 8U);
  for (unsigned i = 0; i < size * 8U; ++i) {
    const unsigned v = first + i;
    if (v < entries_.size() && control_if_.pending(v)) bits |= 1ULL << i;
  }
  return bits;
}

void MsixState::write_pba(uint64_t, unsigned, uint64_t) { ++stats_.pba_writes; }

void MsixState::set_vector_mask(unsigned vector, bool masked) {
  if (vector >= entries_.size()) throw std::out_of_range("MSI-X vector " + std::to_string(vector));
  const bool before = effectively_masked(vector);
  irq_masked_[vector] = masked ? 1 : 0;
  const bool now = effectively_masked(vector);
  if (now != before) control_if_.set_masked(vector, now);
}

MsixState::Snapshot MsixState::snapshot() const {
  Snapshot s{control_, table_forwarded_, entries_, irq_masked_, {}};
  for (unsigned v = 0; v < entries_.size(); ++v) s.pending.push_back(control_if_.pending(v));
  return s;
}

void MsixState::restore(const Snapshot& s) {
  const size_t n = entries_.size();
  if (s.entries.size() != n || s.irq_masked.size() != n || s.pending.size() != n)
    throw std::invalid_argument("MSI-X state of " + std::to_string(s.entries.size()) + " vectors for a function of " +
                                std::to_string(n));
  const auto before = masks();
  control_ = s.control & (kEnable | kFunctionMask);
  table_forwarded_ = s.table_forwarded;
  entries_ = s.entries;
  for (auto& e : entries_) e.control &= kVectorMasked;  // bits 31:1 are reserved
  irq_masked_ = s.irq_masked;
  for (unsigned v = 0; v < n; ++v) control_if_.clear_pending(v);
  sync(before);
  for (unsigned v = 0; v < n; ++v) {
    control_if_.message_changed(v, entries_[v].address, entries_[v].data);
    if (s.pending[v] && effectively_masked(v)) control_if_.set_pending(v);
  }
}

void MsixState::reset() {
  const auto before = masks();
  control_ = 0;
  table_forwarded_ = false;
  irq_masked_.assign(irq_masked_.size(), 0);
  for (unsigned v = 0; v < entries_.size(); ++v) {
    entries_[v] = Entry{};
    control_if_.clear_pending(v);
  }
  sync(before);
}

}  // namespace sriovd::msix
