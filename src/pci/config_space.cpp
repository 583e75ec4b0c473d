#include "sriovd/pci/config_space.hpp"

#include <algorithm>
#include <set>

namespace sriovd::pci {

namespace {

uint16_t rd16(std::span<const uint8_t> c, size_t off) {
  return off + 2 <= c.size() ? static_cast<uint16_t>(c[off] | (c[off + 1] << 8U)) : 0;
}
uint32_t rd32(std::span<const uint8_t> c, size_t off) {
  return off + 4 <= c.size() ? static_cast<uint32_t>(rd16(c, off) | (static_cast<uint32_t>(rd16(c, off + 2)) << 16U)) : 0;
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
  c[0x34] = 0x40;
  c[0x40] = kCapPciExpress;
  c[0x41] = s.msix_vectors ? 0x70 : 0x00;
  put16(0x42, 0x0002);  // version 2, endpoint
  if (s.msix_vectors) {
    c[0x70] = kCapMsix;
    put16(0x72, (s.msix_vectors - 1U) & 0x7ffU);
    put32(0x74, s.msix_table_offset | s.msix_bir);
    put32(0x78, s.msix_pba_offset | s.msix_bir);
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
