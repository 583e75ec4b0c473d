#pragma once
// MSI-X emulation, PCI Local Bus 3.0 §6.8.2, written once for the VF proxy
// and for virtio-pci. It holds the shadow table and Message Control; the
// pending bits live with the interrupt routes, where a fire on a masked
// vector latches them without taking any lock.

#include <cstdint>
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
  // The guest programmed an entry (for a device model that needs it).
  virtual void message_changed(unsigned /*vector*/, uint64_t /*address*/, uint32_t /*data*/) {}
};

// The routing engine as VectorControl: vector i is routes[i].
class RoutedVectors : public VectorControl {
 public:
  RoutedVectors(irq::Engine& engine, std::vector<irq::RouteId> routes)
      : engine_(engine), routes_(std::move(routes)) {}
  void set_masked(unsigned v, bool masked) override {
    if (masked)
      engine_.mask(routes_.at(v));
    else
      engine_.unmask(routes_.at(v));
  }
  [[nodiscard]] bool pending(unsigned v) const override { return engine_.pending(routes_.at(v)); }
  void clear_pending(unsigned v) override { engine_.clear_pending(routes_.at(v)); }
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

  // A mask from outside the table: vfio-user SET_IRQS MASK/UNMASK.
  void set_vector_mask(unsigned vector, bool masked);

  // Function reset: every vector masked, MSI-X disabled, no pending bits.
  void reset();

  [[nodiscard]] bool enabled() const { return control_ & kEnable; }
  [[nodiscard]] bool function_masked() const { return control_ & kFunctionMask; }
  [[nodiscard]] bool effectively_masked(unsigned vector) const;
  [[nodiscard]] const Entry& entry(unsigned vector) const { return entries_.at(vector); }
  [[nodiscard]] const AccessStats& stats() const { return stats_; }

 private:
  void write_dword(unsigned vector, unsigned dword, uint32_t value);
  [[nodiscard]] uint32_t read_dword(unsigned vector, unsigned dword) const;
  // Tells VectorControl about every vector whose effective mask changed.
  void sync(const std::vector<bool>& before);
  [[nodiscard]] std::vector<bool> masks() const;
  static bool valid_access(uint64_t offset, unsigned size, uint64_t limit);

  VectorControl& control_if_;
  std::vector<Entry> entries_;
  uint16_t control_ = 0;  // enable and function mask; table size is derived
  AccessStats stats_;
};

}  // namespace sriovd::msix
