#pragma once
// What the virtio tests share: 1 MiB of "guest RAM" at guest address kGuestBase, 64-byte aligned, as the
// device's GuestMemory sees it: what the virtio tests lay rings and buffers in.
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include "sriovd/virtio/guest_memory.hpp"

namespace sriovd::test {

inline constexpr uint64_t kGuestBase = 0x10000;
inline constexpr uint64_t kGuestRamSize = 1U << 20U;

struct GuestRam {
  GuestRam() : ram(kGuestRamSize + 64) {
    host = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(ram.data()) + 63) & ~uintptr_t{63});
    mem.add_host_region(kGuestBase, kGuestRamSize, 0x7f0000000000ULL, host);
  }
  uint8_t* at(uint64_t gpa) { return host + (gpa - kGuestBase); }
  std::vector<uint8_t> ram;
  uint8_t* host;
  virtio::GuestMemory mem;
};

// Typed tests over both ring layouts: false_type split, true_type packed.
using RingKinds = ::testing::Types<std::false_type, std::true_type>;
class RingKindNames {
 public:
  template <typename T>
  static std::string GetName(int) {
    return T::value ? "Packed" : "Split";
  }
};

}  // namespace sriovd::test
