#pragma once

#include <compare>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace sriovd {

// A PCI function address in the kernel's sysfs spelling, DDDD:BB:DD.F.
struct PciAddress {
  uint32_t domain = 0;
  uint8_t bus = 0;
  uint8_t device = 0;    // 0..31
  uint8_t function = 0;  // 0..7

  // Accepts "DDDD:BB:DD.F" and the short "BB:DD.F" (domain 0).
  static std::optional<PciAddress> parse(std::string_view text);
  [[nodiscard]] std::string to_string() const;

  auto operator<=>(const PciAddress&) const = default;
};

// A 48-bit Ethernet address.
struct MacAddress {
  uint8_t octets[6] = {};

  // Accepts "xx:xx:xx:xx:xx:xx" (hex, either case).
  static std::optional<MacAddress> parse(std::string_view text);
  [[nodiscard]] std::string to_string() const;
  [[nodiscard]] bool is_multicast() const { return (octets[0] & 1U) != 0; }
  [[nodiscard]] bool is_zero() const {
    for (auto o : octets)
      if (o != 0) return false;
    return true;
  }

  auto operator<=>(const MacAddress&) const = default;
};

}  // namespace sriovd
