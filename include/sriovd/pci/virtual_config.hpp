#pragma once
// The config space an exported device shows its guest: the device's own
// bytes where that is safe, and emulation where the guest must not touch
// the hardware: BARs (sized and placed in the guest's address space only),
// the MSI-X Message Control (owned by msix/), the ROM BAR, the interrupt
// line. Writes to read-only bits are ignored. Command register writes that
// the device needs (memory/IO decode, bus master, INTx disable) go through.

#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

namespace sriovd::msix {
class MsixState;
}

namespace sriovd::pci {

struct BarInfo {
  uint64_t size = 0;  // 0: no BAR
  bool io = false;
  bool is64 = false;  // this BAR and the next form one 64-bit BAR
  bool prefetchable = false;
};

// BAR i as `config` declares it (PCI 3.0 §6.2.5.1: IO or memory, 32 or
// 64 bits, prefetchable), with the size the device reports (VFIO's region
// size: config space alone cannot say it without a sizing write).
BarInfo decode_bar(std::span<const uint8_t> config, unsigned i, uint64_t size);

class VirtualConfig {
 public:
  // Forwards a write of the Command register to the device (VFIO config region).
  using CommandSink = std::function<void(uint16_t command)>;

  VirtualConfig(std::span<const uint8_t> device_config, const std::array<BarInfo, 6>& bars, msix::MsixState* msix,
                CommandSink command_sink);

  // Accesses of 1, 2 or 4 bytes, naturally aligned, inside the space;
  // anything else reads as all ones and writes nothing.
  [[nodiscard]] uint32_t read(uint32_t offset, unsigned size) const;
  void write(uint32_t offset, unsigned size, uint32_t value);

  // Where the guest placed BAR i (0 until programmed).
  [[nodiscard]] uint64_t bar_address(unsigned i) const;
  [[nodiscard]] size_t size() const { return bytes_.size(); }
  // The space as it is (Message Control excluded: MSI-X state has it), and
  // a saved one loaded back: only its guest-writable bits are taken (BAR
  // addresses, Command), the rest stays this device's; a shorter one is
  // the space's start. Throws std::invalid_argument on a larger one.
  [[nodiscard]] const std::vector<uint8_t>& bytes() const { return bytes_; }
  void load(std::span<const uint8_t> saved);

 private:
  [[nodiscard]] bool in_msix_control(uint32_t offset) const;
  std::vector<uint8_t> bytes_;
  std::vector<uint8_t> writable_;  // per-byte mask of guest-writable bits
  std::array<BarInfo, 6> bars_;
  msix::MsixState* msix_;
  uint16_t msix_control_ = 0;  // offset of Message Control, 0 if none
  CommandSink command_sink_;
};

}  // namespace sriovd::pci
