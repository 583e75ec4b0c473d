#pragma once
// PCI configuration space: the capability chain, the MSI-X capability's
// layout (PCI Local Bus 3.0 §6.8.2) and a builder for simulated devices.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace sriovd::pci {

inline constexpr uint8_t kCapPciExpress = 0x10;
inline constexpr uint8_t kCapMsix = 0x11;
inline constexpr uint16_t kExtCapSriov = 0x0010;
inline constexpr uint32_t kPage = 4096;
inline constexpr unsigned kPciExpressV2Bytes = 0x3c;

// Little-endian fields of a config space (PCI is little-endian), written
// and read byte by byte: no alignment or host byte order assumed.
inline void put8(std::span<uint8_t> c, size_t at, uint8_t v) { c[at] = v; }
inline void put16(std::span<uint8_t> c, size_t at, uint16_t v) {
  c[at] = static_cast<uint8_t>(v);
  c[at + 1] = static_cast<uint8_t>(v >> 8U);
}
inline void put32(std::span<uint8_t> c, size_t at, uint32_t v) {
  put16(c, at, static_cast<uint16_t>(v));
  put16(c, at + 2, static_cast<uint16_t>(v >> 16U));
}
inline uint16_t get16(std::span<const uint8_t> c, size_t at) {
  return static_cast<uint16_t>(c[at] | (static_cast<uint32_t>(c[at + 1]) << 8U));
}
inline uint32_t get32(std::span<const uint8_t> c, size_t at) {
  return c[at] | (static_cast<uint32_t>(c[at + 1]) << 8U) | (static_cast<uint32_t>(c[at + 2]) << 16U) |
         (static_cast<uint32_t>(c[at + 3]) << 24U);
}

struct Capability {
  uint16_t id = 0;
  uint16_t offset = 0;
  bool extended = false;
};

// The standard chain (from 0x34) and, when the space is 4 KiB, the extended
// one (from 0x100). A malformed chain (a loop, an offset out of range) ends
// the walk; it never reads outside `config`.
std::vector<Capability> capabilities(std::span<const uint8_t> config);

struct MsixLayout {
  uint16_t cap_offset = 0;
  uint16_t vectors = 0;
  uint8_t table_bir = 0;
  uint32_t table_offset = 0;
  uint8_t pba_bir = 0;
  uint32_t pba_offset = 0;

  [[nodiscard]] uint32_t table_bytes() const { return vectors * 16U; }
  [[nodiscard]] uint32_t pba_bytes() const { return ((vectors + 63U) / 64U) * 8U; }
  // The page-aligned [begin, end) of a BAR that holds the table and/or PBA:
  // what must be trapped rather than mapped to the client.
  [[nodiscard]] std::vector<std::pair<uint64_t, uint64_t>> trapped_pages(uint8_t bir) const;
};

std::optional<MsixLayout> find_msix(std::span<const uint8_t> config);

// What is wrong with the standard capability list, one line each (empty:
// well formed): a pointer that is not a dword in 0x40..0xfc, a loop, a
// capability that runs past the 256-byte space or overlaps another, by
// the sizes its own header gives (PM, MSI, PCIe v1/v2, MSI-X, vendor).
std::vector<std::string> capability_problems(std::span<const uint8_t> config);

struct EndpointSpec {
  uint16_t vendor = 0;
  uint16_t device = 0;
  uint32_t class_code = 0;
  uint16_t msix_vectors = 0;  // 0: no MSI-X capability
  uint8_t msix_bir = 3;
  uint32_t msix_table_offset = 0;
  uint32_t msix_pba_offset = 0x2000;
  // SR-IOV PF fields (total_vfs 0: no SR-IOV capability)
  uint16_t total_vfs = 0;
  uint16_t num_vfs = 0;
  uint16_t first_vf_offset = 0x10;
  uint16_t vf_stride = 1;
  uint16_t vf_device = 0;
};

// A 4 KiB config space: header type 0, a PCI Express endpoint capability,
// MSI-X when asked, and the SR-IOV extended capability for a PF.
std::vector<uint8_t> make_endpoint_config(const EndpointSpec& spec);

}  // namespace sriovd::pci
