#pragma once
// MSI-X emulation, PCI Local Bus 3.0 §6.8.2, written once for the VF proxy
// and for virtio-pci. It holds the shadow table and Message Control; the
// pending bits live with the interrupt routes, where a fire on a masked
// vector latches them without taking any lock.
//
// It serves two kinds of vfio-user client with one set of rules:
//  - a client that forwards the guest's table writes (sriovd-guest,
//    libvfio-user-style clients): the table here *is* the guest's, and its
//    Mask Bits gate delivery as §6.8.2.9 says;
//  - a client that keeps the table itself, as QEMU does for every VFIO
//    device: table writes never arrive, the vector is wired with SET_IRQS
//    TRIGGER and, as with kernel VFIO (linux/vfio.h), stays live unless
//    SET_IRQS MASKs it; the client holds what the guest masked.
// So a vector is held (its message latched in the PBA, sent on unmask) while
//   MSI-X is disabled or function-masked (Message Control reaches the server
//   from both kinds: config space writes are forwarded), or
//   SET_IRQS MASKed it (a mask of its own, cleared by UNMASK, by a reset,
//   and never shown in the table), or
//   its table Mask Bit is set and the client has written the table since
//   the last reset (the first table write marks a table-forwarding client).
// A TRIGGER eventfd only names where messages go; it never unmasks.

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "sriovd/irq/engine.hpp"

namespace sriovd::msix {

// Message Control (§6.8.2.3), the upper 16 bits of the capability's dword 0.
inline constexpr uint16_t kEnable = 1U << 15U;
inline constexpr uint16_t kFunctionMask = 1U << 14U;
inline constexpr uint16_t kTableSizeMask = 0x07ff;
// Vector Control (§6.8.2.9): bit 0 is Mask Bit; bits 31:1 are reserved.
inline constexpr uint32_t kVectorMasked = 1U;
inline constexpr unsigned kEntryBytes = 16;

// What the emulation needs from the interrupt side, per vector.
class VectorControl {
 public:
  virtual ~VectorControl() = default;
  // The effective mask (vector mask, function mask or MSI-X disabled) changed.
  virtual void set_masked(unsigned vector, bool masked) = 0;
  [[nodiscard]] virtual bool pending(unsigned vector) const = 0;
  virtual void clear_pending(unsigned vector) = 0;
  // Sets the pending bit of a vector that is masked (a restored state's);
  // where pending bits live in hardware they cannot be set: throws.
  virtual void set_pending(unsigned /*vector*/) {
    throw std::logic_error("MSI-X: these vectors' pending bits cannot be set");
  }
  // The guest programmed an entry (for a device model that needs it).
  virtual void message_changed(unsigned /*vector*/, uint64_t /*address*/, uint32_t /*data*/) {}
};

// The routing engine as VectorControl: vector i is routes[i].
class RoutedVectors : public VectorControl {
 public:
  RoutedVectors(irq::Engine& engine, std::vector<irq::RouteId> routes) : engine_(engine), routes_(std::move(routes)) {}
  void set_masked(unsigned v, bool masked) override {
    if (masked)
      engine_.mask(routes_.at(v));
    else
      engine_.unmask(routes_.at(v));
  }
  [[nodiscard]] bool pending(unsigned v) const override { return engine_.pending(routes_.at(v)); }
  void clear_pending(unsigned v) override { engine_.clear_pending(routes_.at(v)); }
  void set_pending(unsigned v) override { engine_.set_pending(routes_.at(v)); }
  [[nodiscard]] irq::RouteId route(unsigned v) const { return routes_.at(v); }

 private:
  irq::Engine& engine_;
  std::vector<irq::RouteId> routes_;
};

struct Entry {
  uint64_t address = 0;
  uint32_t data = 0;
  uint32_t control = kVectorMasked;
};

struct AccessStats {
  uint64_t invalid = 0;     // misaligned, wrong size or out of range (ignored)
  uint64_t pba_writes = 0;  // the PBA is read-only (ignored)
};

class MsixState {
 public:
  MsixState(uint16_t vectors, VectorControl& control);

  [[nodiscard]] uint16_t vectors() const { return static_cast<uint16_t>(entries_.size()); }
  [[nodiscard]] uint32_t table_bytes() const { return vectors() * kEntryBytes; }
  // QWORDs of pending bits, 64 vectors each (§6.8.2.10).
  [[nodiscard]] uint32_t pba_bytes() const { return ((vectors() + 63U) / 64U) * 8U; }

  [[nodiscard]] uint16_t read_message_control() const;
  void write_message_control(uint16_t value);

  // offset from the start of the table (or PBA); size 1, 2, 4 or 8.
  [[nodiscard]] uint64_t read_table(uint64_t offset, unsigned size);
  void write_table(uint64_t offset, unsigned size, uint64_t value);
  [[nodiscard]] uint64_t read_pba(uint64_t offset, unsigned size);
  void write_pba(uint64_t offset, unsigned size, uint64_t value);

  // A mask from outside the table: vfio-user SET_IRQS MASK/UNMASK. It
  // does not change the table's Mask Bit (the guest's, or nobody's).
  void set_vector_mask(unsigned vector, bool masked);

  // Everything a function's MSI-X holds, for a saved device state: Message
  // Control, the table, SET_IRQS masks, the pending bits.
  struct Snapshot {
    uint16_t control = 0;
    bool table_forwarded = false;
    std::vector<Entry> entries;
    std::vector<uint8_t> irq_masked;
    std::vector<bool> pending;
  };
  [[nodiscard]] Snapshot snapshot() const;
  // Into a function with as many vectors (std::invalid_argument otherwise);
  // the masks reach the interrupt side, then the pending bits of vectors
  // that are masked are set again.
  void restore(const Snapshot& s);

  // Function reset: every vector masked, MSI-X disabled, no pending bits,
  // no SET_IRQS masks, and the table governs again only once written.
  void reset();

  [[nodiscard]] bool enabled() const { return control_ & kEnable; }
  [[nodiscard]] bool function_masked() const { return control_ & kFunctionMask; }
  [[nodiscard]] bool effectively_masked(unsigned vector) const;
  // The client has written the table since the last reset: its Mask Bits count.
  [[nodiscard]] bool table_forwarded() const { return table_forwarded_; }
  [[nodiscard]] bool irq_masked(unsigned vector) const { return irq_masked_.at(vector) != 0; }
  [[nodiscard]] const Entry& entry(unsigned vector) const { return entries_.at(vector); }
  [[nodiscard]] const AccessStats& stats() const { return stats_; }

 private:
  // notify: tell VectorControl when the vector's effective mask changes
  // (false while the caller syncs a whole change at once).
  void write_dword(unsigned vector, unsigned dword, uint32_t value, bool notify = true);
  [[nodiscard]] uint32_t read_dword(unsigned vector, unsigned dword) const;
  // Tells VectorControl about every vector whose effective mask changed.
  void sync(const std::vector<bool>& before);
  [[nodiscard]] std::vector<bool> masks() const;
  static bool valid_access(uint64_t offset, unsigned size, uint64_t limit);

  VectorControl& control_if_;
  std::vector<Entry> entries_;
  std::vector<uint8_t> irq_masked_;  // SET_IRQS MASK, per vector
  bool table_forwarded_ = false;
  uint16_t control_ = 0;  // enable and function mask; table size is derived
  AccessStats stats_;
};

}  // namespace sriovd::msix
