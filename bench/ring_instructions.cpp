// scripts/bench ring-instructions: instructions per packet on the device
// side of a virtqueue, counted by callgrind (repeatable, unlike time), for
// the two ways of handing buffers back: published per chain (each used
// entry made visible at once, what push() did for every packet) and per
// burst (add_used() for each, one publish_used() - what the net device
// does). One process per measurement, single-threaded and deterministic:
//   sriovd-bench-ring-instructions split|packed chain|burst
// runs kBursts bursts of kBurst one-segment chains; callgrind, told to
// count only the device's ring code (--toggle-collect='*Queue*'), gives the
// instructions, and scripts/bench divides by the chains (printed on stderr).
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "sriovd/guest/virtqueue.hpp"
#include "sriovd/virtio/net.hpp"

using namespace sriovd::virtio;
using namespace sriovd::guest;

namespace {
constexpr uint64_t kBase = 0x100000;
constexpr uint64_t kMem = 1U << 20U;
constexpr uint16_t kQueue = 256;
constexpr int kBurst = 64;
constexpr int kBursts = 2000;

template <typename Driver>
uint64_t run(bool packed, bool per_burst) {
  std::vector<uint8_t> ram(kMem + 64);
  auto* host = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(ram.data()) + 63) & ~uintptr_t{63});
  GuestMemory mem;
  mem.add_host_region(kBase, kMem, 0, host);
  Driver driver(host, kBase, kQueue);
  auto queue = packed ? make_packed_queue(mem, kQueue, driver.addresses(), true)
                      : make_split_queue(mem, kQueue, driver.addresses(), true);
  const Buffer buf{kBase + 0x80000, 64, false};
  std::array<Segment, 8> segs{};
  Chain c;
  uint64_t chains = 0;
  for (int b = 0; b < kBursts; ++b) {
    for (int i = 0; i < kBurst; ++i)
      if (driver.add(std::span<const Buffer>(&buf, 1)) < 0) return 0;
    if constexpr (std::is_same_v<Driver, SplitDriver>) driver.publish();
    // The device's pass, as NetDevice::do_tx makes it.
    while (queue->pop(c, segs)) {
      queue->add_used(c, 0);
      if (!per_burst) queue->publish_used();
      ++chains;
    }
    (void)queue->enable_kicks();
    queue->publish_used();
    (void)queue->should_notify();
    uint32_t id, len;
    while (driver.take_used(id, len)) {
    }
  }
  return chains;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 || (std::strcmp(argv[1], "split") != 0 && std::strcmp(argv[1], "packed") != 0) ||
      (std::strcmp(argv[2], "chain") != 0 && std::strcmp(argv[2], "burst") != 0)) {
    std::fprintf(stderr, "usage: %s split|packed chain|burst\n", argv[0]);
    return 64;
  }
  const bool packed = std::strcmp(argv[1], "packed") == 0;
  const bool per_burst = std::strcmp(argv[2], "burst") == 0;
  const uint64_t chains = packed ? run<PackedDriver>(true, per_burst) : run<SplitDriver>(false, per_burst);
  if (chains != static_cast<uint64_t>(kBurst) * kBursts) {
    std::fprintf(stderr, "ring-instructions: %llu chains served, %d expected\n",
                 static_cast<unsigned long long>(chains), kBurst * kBursts);
    return 1;
  }
  std::printf("%llu\n", static_cast<unsigned long long>(chains));
  return 0;
}
