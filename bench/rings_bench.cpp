// scripts/bench rings: descriptors per second through a virtqueue, driver
// and device on their own threads, split vs packed, one-way barriers vs full
// fences. Median of three runs each; one JSON object on stdout.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "ring_device.hpp"
#include "sriovd/guest/virtqueue.hpp"

using namespace sriovd::virtio;
using namespace sriovd::guest;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kBase = 0x100000;
constexpr uint64_t kMem = 1U << 20U;
constexpr uint16_t kQueue = 256;

template <typename Driver>
double run_once(bool packed, Barriers barriers, double seconds) {
  std::vector<uint8_t> ram(kMem + 64);
  auto* host = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(ram.data()) + 63) & ~uintptr_t{63});
  GuestMemory mem;
  mem.add_host_region(kBase, kMem, 0, host);
  Driver driver(host, kBase, kQueue, barriers);
  auto queue = packed ? make_packed_queue(mem, kQueue, driver.addresses(), false, barriers)
                      : make_split_queue(mem, kQueue, driver.addresses(), false, barriers);
  sriovd::bench::RingDevice device(*queue);
  const Buffer buf{kBase + 0x80000, 64, false};
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  const auto t0 = Clock::now();
  while (Clock::now() < end) {
    for (int i = 0; i < 32 && driver.add(std::span<const Buffer>(&buf, 1)) >= 0; ++i) {
    }
    if constexpr (std::is_same_v<Driver, SplitDriver>) driver.publish();
    uint32_t id, len;
    while (driver.take_used(id, len)) {
    }
  }
  const uint64_t served = device.stop();
  return static_cast<double>(served) / std::chrono::duration<double>(Clock::now() - t0).count() / 1e6;
}

double median_of_3(bool packed, Barriers b) {
  std::vector<double> v;
  for (int i = 0; i < 3; ++i)
    v.push_back(packed ? run_once<PackedDriver>(true, b, 0.5) : run_once<SplitDriver>(false, b, 0.5));
  std::sort(v.begin(), v.end());
  return v[1];
}

}  // namespace

int main() {
  std::fprintf(stderr, "rings bench: split, packed; one-way barriers and full fences...\n");
  nlohmann::json j = {
      {"split_mdesc_per_sec", median_of_3(false, Barriers::one_way)},
      {"packed_mdesc_per_sec", median_of_3(true, Barriers::one_way)},
      {"split_fullfence_mdesc_per_sec", median_of_3(false, Barriers::full_fence)},
      {"packed_fullfence_mdesc_per_sec", median_of_3(true, Barriers::full_fence)},
      {"queue_size", kQueue},
      {"runs", 3},
  };
  std::printf("%s\n", j.dump(2).c_str());
  return 0;
}
