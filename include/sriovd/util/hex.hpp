#pragma once
// Addresses and sizes in messages as a reader expects them: "0x1000".
#include <cstdint>
#include <cstdio>
#include <string>

namespace sriovd {

inline std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace sriovd
