#include "sriovd/pci/config_space.hpp"

#include <algorithm>
#include <cstdio>
#include <set>

namespace sriovd::pci {

namespace {

std::string hex2(unsigned v) {
  char b[8];
  std::snprintf(b, sizeof b, "%02x", v);
  return b;
}

uint16_t rd16(std::span<const uint8_t> c, size_t off) {
  return off + 2 <= c.size() ? static_cast<uint16_t>(c[off] | (c[off + 1] << 8U)) : 0;
}
uint32_t rd32(std::span<const uint8_t> c, size_t off) {
  return off + 4 <= c.size() ? static_cast<uint32_t>(rd16(c, off) | (static_cast<uint32_t>(rd16(c, off + 2)) << 16U))
                             : 0;
}

}  // namespace

std::vector<Capability> capabilities(std::span<const uint8_t> config) {
  std::vector<Capability> out;
  if (config.size() < 64 || !(rd16(config, 0x06) & 0x0010)) return out;  // Status: Capabilities List
  std::set<uint16_t> seen;
  uint16_t off = config[0x34] & 0xfcU;
  while (off >= 0x40 && off + 2U <= std::min<size_t>(config.size(), 256) && seen.insert(off).second) {
    out.push_back({config[off], off, false});
    off = config[off + 1] & 0xfcU;
  }
  if (config.size() < 4096) return out;
  off = 0x100;
  seen.clear();
  while (off >= 0x100 && off + 4U <= config.size() && seen.insert(off).second) {
    const uint32_t hdr = rd32(config, off);
    if (hdr == 0 || hdr == 0xffffffffU) break;
    out.push_back({static_cast<uint16_t>(hdr & 0xffffU), off, true});
    off = static_cast<uint16_t>((hdr >> 20U) & 0xffcU);
  }
  return out;
}

namespace {

// The bytes a standard capability occupies, from its own header. An ID
// whose size this does not know counts as its 2-byte header only.
unsigned capability_bytes(std::span<const uint8_t> c, unsigned at) {
  switch (c[at]) {
    case 0x01: return 8;  // Power Management (PCI PM 1.2 §3.2)
    case 0x05: {          // MSI (PCI 3.0 §6.8.1): 64-bit address, per-vector masking
      if (at + 4U > c.size()) return 0;
      const unsigned control = rd16(c, at + 2);
      return 10U + ((control & 0x80U) ? 4U : 0U) + ((control & 0x100U) ? 10U : 0U);
    }
    case 0x09: return c[at + 2];  // vendor-specific: its length byte
    case kCapPciExpress: {        // PCIe 3.0 §7.8: v1 endpoint 0x24, v2 0x3c
      if (at + 4U > c.size()) return 0;
      return (rd16(c, at + 2) & 0xfU) >= 2 ? kPciExpressV2Bytes : 0x24U;
    }
    case kCapMsix: return 12;  // PCI 3.0 §6.8.2
    default: return 2;
  }
}

}  // namespace

std::vector<std::string> capability_problems(std::span<const uint8_t> config) {
  std::vector<std::string> out;
  const auto name = [](unsigned id, unsigned at) {
    char b[48];
    std::snprintf(b, sizeof b, "capability 0x%02x at 0x%02x", id, at);
    return std::string(b);
  };
  if (config.size() < 256) return {"config space of " + std::to_string(config.size()) + " bytes"};
  if (!(rd16(config, 0x06) & 0x0010)) return out;    // no list: nothing to check
  std::vector<std::pair<unsigned, unsigned>> taken;  // [begin, end) of each capability
  std::set<unsigned> seen;
  unsigned at = config[0x34];
  while (at != 0) {
    if (at % 4 != 0 || at < 0x40 || at > 0xfc) {
      out.push_back("capability pointer 0x" + hex2(at) + " is not a dword in 0x40..0xfc");
      break;
    }
    if (!seen.insert(at).second) {
      out.push_back("the capability list loops back to 0x" + hex2(at));
      break;
    }
    const unsigned bytes = capability_bytes(config, at);
    if (bytes < 2) out.push_back(name(config[at], at) + ": length " + std::to_string(bytes));
    const unsigned end = at + std::max(bytes, 2U);
    if (end > 256) out.push_back(name(config[at], at) + " of " + std::to_string(bytes) + " bytes runs past 0xff");
    for (const auto& [b, e] : taken)
      if (at < e && b < end) out.push_back(name(config[at], at) + " overlaps the one at 0x" + hex2(b));
    taken.emplace_back(at, end);
    at = config[at + 1];
  }
  return out;
}

std::optional<MsixLayout> find_msix(std::span<const uint8_t> config) {
  for (const auto& cap : capabilities(config)) {
    if (cap.extended || cap.id != kCapMsix || cap.offset + 12U > config.size()) continue;
    MsixLayout m;
    m.cap_offset = cap.offset;
    m.vectors = static_cast<uint16_t>((rd16(config, cap.offset + 2) & 0x7ffU) + 1U);
    const uint32_t table = rd32(config, cap.offset + 4);
    const uint32_t pba = rd32(config, cap.offset + 8);
    m.table_bir = static_cast<uint8_t>(table & 7U);
    m.table_offset = table & ~7U;
    m.pba_bir = static_cast<uint8_t>(pba & 7U);
    m.pba_offset = pba & ~7U;
    return m;
  }
  return std::nullopt;
}

std::vector<std::pair<uint64_t, uint64_t>> MsixLayout::trapped_pages(uint8_t bir) const {
  std::vector<std::pair<uint64_t, uint64_t>> pages;
  auto add = [&](uint64_t begin, uint64_t len) {
    const uint64_t b = begin / kPage * kPage;
    const uint64_t e = (begin + len + kPage - 1) / kPage * kPage;
    pages.emplace_back(b, e);
  };
  if (table_bir == bir) add(table_offset, table_bytes());
  if (pba_bir == bir) add(pba_offset, pba_bytes());
  std::sort(pages.begin(), pages.end());
  // Merge overlapping or touching ranges.
  std::vector<std::pair<uint64_t, uint64_t>> merged;
  for (const auto& p : pages) {
    if (!merged.empty() && p.first <= merged.back().second)
      merged.back().second = std::max(merged.back().second, p.second);
    else
      merged.push_back(p);
  }
  return merged;
}

std::vector<uint8_t> make_endpoint_config(const EndpointSpec& s) {
  std::vector<uint8_t> c(4096, 0);
  auto put16 = [&](size_t off, unsigned v) { pci::put16(c, off, static_cast<uint16_t>(v)); };
  auto put32 = [&](size_t off, unsigned v) { pci::put32(c, off, v); };
  put16(0x00, s.vendor);
  put16(0x02, s.device);
  put16(0x06, 0x0010);  // Status: Capabilities List
  c[0x09] = static_cast<uint8_t>(s.class_code);
  c[0x0a] = static_cast<uint8_t>(s.class_code >> 8U);
  c[0x0b] = static_cast<uint8_t>(s.class_code >> 16U);
  // PCI Express capability, version 2, endpoint: 0x3c bytes (PCIe 3.0
  // §7.8), so it ends at 0x7b and MSI-X goes after it. (Placed inside it,
  // a VMM that emulates Link Control 2 / Status 2 at +0x30 overwrites the
  // MSI-X header, and the guest sees no MSI-X.)
  constexpr unsigned kMsixAt = 0x40 + kPciExpressV2Bytes;
  c[0x34] = 0x40;
  c[0x40] = kCapPciExpress;
  c[0x41] = s.msix_vectors ? kMsixAt : 0x00;
  put16(0x42, 0x0002);  // version 2, endpoint
  if (s.msix_vectors) {
    c[kMsixAt] = kCapMsix;
    put16(kMsixAt + 2, (s.msix_vectors - 1U) & 0x7ffU);
    put32(kMsixAt + 4, s.msix_table_offset | s.msix_bir);
    put32(kMsixAt + 8, s.msix_pba_offset | s.msix_bir);
  }
  if (s.total_vfs > 0) {
    put32(0x100, kExtCapSriov | (1U << 16U));
    put16(0x108, s.num_vfs ? 0x0009 : 0);  // VF Enable | VF MSE
    put16(0x10c, s.total_vfs);
    put16(0x10e, s.total_vfs);
    put16(0x110, s.num_vfs);
    put16(0x114, s.first_vf_offset);
    put16(0x116, s.vf_stride);
    put16(0x11a, s.vf_device);
  }
  return c;
}

}  // namespace sriovd::pci
