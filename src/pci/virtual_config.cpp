#include "sriovd/pci/virtual_config.hpp"

#include <stdexcept>
#include <string>

#include "sriovd/msix/msix.hpp"
#include "sriovd/pci/config_space.hpp"

namespace sriovd::pci {

BarInfo decode_bar(std::span<const uint8_t> config, unsigned i, uint64_t size) {
  const uint32_t reg = get32(config, 0x10 + 4U * i);
  BarInfo b;
  b.size = size;
  b.io = reg & 1U;
  b.is64 = !b.io && ((reg >> 1U) & 3U) == 2U;
  b.prefetchable = !b.io && (reg & 8U);
  return b;
}

namespace {

constexpr uint32_t kCommand = 0x04;
constexpr uint16_t kCommandWritable = 0x0001 | 0x0002 | 0x0004 | 0x0400;  // IO, memory, bus master, INTx disable
constexpr uint32_t kBar0 = 0x10;
constexpr uint32_t kRomBar = 0x30;
constexpr uint32_t kInterruptLine = 0x3c;

void put32(std::vector<uint8_t>& v, uint32_t off, uint32_t x) {
  for (unsigned i = 0; i < 4; ++i) v[off + i] = static_cast<uint8_t>(x >> (8U * i));
}

}  // namespace

VirtualConfig::VirtualConfig(std::span<const uint8_t> device_config, const std::array<BarInfo, 6>& bars,
                             msix::MsixState* msix, CommandSink command_sink)
    : bytes_(device_config.begin(), device_config.end()),
      writable_(bytes_.size(), 0),
      bars_(bars),
      msix_(msix),
      command_sink_(std::move(command_sink)) {
  if (bytes_.size() < 256) throw std::invalid_argument("config space shorter than 256 bytes");
  writable_[kCommand] = static_cast<uint8_t>(kCommandWritable);
  writable_[kCommand + 1] = static_cast<uint8_t>(kCommandWritable >> 8U);
  // BARs: the guest writes addresses; the low flag bits and the bits below
  // the size stay as the hardware would have them (PCI 3.0 §6.2.5.1).
  for (unsigned i = 0; i < 6; ++i) {
    const uint32_t off = kBar0 + 4 * i;
    const BarInfo& b = bars_[i];
    if (b.size == 0) {
      put32(bytes_, off, 0);
      continue;
    }
    const uint32_t flags = b.io ? 0x1U : ((b.is64 ? 0x4U : 0U) | (b.prefetchable ? 0x8U : 0U));
    put32(bytes_, off, flags);
    const uint32_t mask = static_cast<uint32_t>(~(b.size - 1)) & (b.io ? ~0x3U : ~0xfU);
    put32(writable_, off, mask);
    if (b.is64 && i < 5) {
      put32(bytes_, off + 4, 0);
      put32(writable_, off + 4, static_cast<uint32_t>(~(b.size - 1) >> 32U));
      bars_[i + 1] = BarInfo{};
      ++i;
    }
  }
  put32(bytes_, kRomBar, 0);  // no ROM is exposed
  writable_[kInterruptLine] = 0xff;
  if (auto layout = find_msix(bytes_)) msix_control_ = static_cast<uint16_t>(layout->cap_offset + 2);
}

bool VirtualConfig::in_msix_control(uint32_t offset) const {
  return msix_ && msix_control_ && offset >= msix_control_ && offset < msix_control_ + 2U;
}

uint32_t VirtualConfig::read(uint32_t offset, unsigned size) const {
  if ((size != 1 && size != 2 && size != 4) || offset % size != 0 || offset + size > bytes_.size())
    return size == 1 ? 0xffU : size == 2 ? 0xffffU : 0xffffffffU;
  uint32_t v = 0;
  for (unsigned i = 0; i < size; ++i) {
    const uint32_t at = offset + i;
    uint8_t b = bytes_[at];
    if (in_msix_control(at)) b = static_cast<uint8_t>(msix_->read_message_control() >> (8U * (at - msix_control_)));
    v |= static_cast<uint32_t>(b) << (8U * i);
  }
  return v;
}

void VirtualConfig::write(uint32_t offset, unsigned size, uint32_t value) {
  if ((size != 1 && size != 2 && size != 4) || offset % size != 0 || offset + size > bytes_.size()) return;
  bool command = false;
  bool msix_control = false;
  uint16_t mc = msix_ ? msix_->read_message_control() : 0;
  for (unsigned i = 0; i < size; ++i) {
    const uint32_t at = offset + i;
    const auto b = static_cast<uint8_t>(value >> (8U * i));
    if (in_msix_control(at)) {
      // Only Enable and Function Mask (upper byte) are writable.
      const unsigned shift = 8U * (at - msix_control_);
      mc = static_cast<uint16_t>((mc & ~(0xffU << shift)) | (static_cast<unsigned>(b) << shift));
      msix_control = true;
      continue;
    }
    bytes_[at] = static_cast<uint8_t>((bytes_[at] & ~writable_[at]) | (b & writable_[at]));
    if (at == kCommand || at == kCommand + 1) command = true;
  }
  if (msix_control) msix_->write_message_control(mc);
  if (command && command_sink_) command_sink_(static_cast<uint16_t>(bytes_[kCommand] | (bytes_[kCommand + 1] << 8U)));
}

void VirtualConfig::load(std::span<const uint8_t> saved) {
  if (saved.size() > bytes_.size())
    throw std::invalid_argument("config space of " + std::to_string(saved.size()) + " bytes for one of " +
                                std::to_string(bytes_.size()));
  for (size_t at = 0; at < saved.size(); ++at)
    bytes_[at] = static_cast<uint8_t>((bytes_[at] & ~writable_[at]) | (saved[at] & writable_[at]));
  if (command_sink_) command_sink_(static_cast<uint16_t>(bytes_[kCommand] | (bytes_[kCommand + 1] << 8U)));
}

uint64_t VirtualConfig::bar_address(unsigned i) const {
  if (i >= 6 || bars_[i].size == 0) return 0;
  const uint32_t off = kBar0 + 4 * i;
  uint64_t lo = read(off, 4) & (bars_[i].io ? ~0x3U : ~0xfU);
  if (bars_[i].is64 && i < 5) lo |= static_cast<uint64_t>(read(off + 4, 4)) << 32U;
  return lo;
}

}  // namespace sriovd::pci
