#include "sriovd/util/pci_address.hpp"

#include <charconv>
#include <cstdio>

namespace sriovd {
namespace {

// Parses a hex number of min_digits..max_digits digits, nothing else.
bool parse_hex(std::string_view text, size_t min_digits, size_t max_digits, uint32_t& out) {
  if (text.size() < min_digits || text.size() > max_digits) return false;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), out, 16);
  return ec == std::errc{} && ptr == text.data() + text.size();
}

}  // namespace

std::optional<PciAddress> PciAddress::parse(std::string_view text) {
  PciAddress a;
  uint32_t domain = 0;
  const size_t first = text.find(':');
  if (first == std::string_view::npos) return std::nullopt;
  if (text.find(':', first + 1) != std::string_view::npos) {
    if (!parse_hex(text.substr(0, first), 4, 8, domain)) return std::nullopt;
    text.remove_prefix(first + 1);
  }
  // BB:DD.F
  if (text.size() != 7 || text[2] != ':' || text[5] != '.') return std::nullopt;
  uint32_t bus = 0, dev = 0, fn = 0;
  if (!parse_hex(text.substr(0, 2), 2, 2, bus) || !parse_hex(text.substr(3, 2), 2, 2, dev) ||
      !parse_hex(text.substr(6, 1), 1, 1, fn))
    return std::nullopt;
  if (dev > 31 || fn > 7) return std::nullopt;
  a.domain = domain;
  a.bus = static_cast<uint8_t>(bus);
  a.device = static_cast<uint8_t>(dev);
  a.function = static_cast<uint8_t>(fn);
  return a;
}

std::string PciAddress::to_string() const {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%04x:%02x:%02x.%x", domain, bus, device, function);
  return buf;
}

std::optional<MacAddress> MacAddress::parse(std::string_view text) {
  if (text.size() != 17) return std::nullopt;
  MacAddress m;
  for (size_t i = 0; i < 6; ++i) {
    if (i > 0 && text[i * 3 - 1] != ':') return std::nullopt;
    uint32_t v = 0;
    if (!parse_hex(text.substr(i * 3, 2), 2, 2, v)) return std::nullopt;
    m.octets[i] = static_cast<uint8_t>(v);
  }
  return m;
}

std::string MacAddress::to_string() const {
  char buf[18];
  std::snprintf(buf, sizeof buf, "%02x:%02x:%02x:%02x:%02x:%02x", octets[0], octets[1], octets[2], octets[3], octets[4],
                octets[5]);
  return buf;
}

}  // namespace sriovd
