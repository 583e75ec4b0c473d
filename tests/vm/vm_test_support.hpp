#pragma once
// Helpers of the gtest binaries that run inside the real-kernel VM.
#include <poll.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>

#include "sriovd/util/pci_address.hpp"

namespace sriovd::vmtest {

// The vfio-pci device the scenario names in SRIOVD_VM_DEVICE.
inline PciAddress device_address() {
  const char* env = std::getenv("SRIOVD_VM_DEVICE");
  auto a = env ? PciAddress::parse(env) : std::nullopt;
  if (!a) throw std::runtime_error("set SRIOVD_VM_DEVICE to a vfio-pci device address");
  return *a;
}

// The eventfd's count once it is readable within `wait`; 0 if not.
inline uint64_t take(int fd, std::chrono::milliseconds wait = std::chrono::seconds(2)) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(wait.count())) != 1) return 0;
  uint64_t v = 0;
  return ::read(fd, &v, sizeof v) == sizeof v ? v : 0;
}

}  // namespace sriovd::vmtest
