// scripts/bench iotlb: descriptors per second through a split virtqueue
// with the device translating every buffer address, IOTLB off (guest
// physical addresses through the memory table) against IOTLB on
// (VIRTIO_F_ACCESS_PLATFORM: IOVAs through the device IOTLB, then the
// memory table), in one run, interleaved. Two IOTLB shapes: one entry for
// all of RAM (a guest with iommu=pt, or 2 MB static maps), and one entry
// per 4 KiB page with buffers spread over 64 pages (a guest in strict
// mode: every descriptor lands in another entry). Buffers cycle over 64
// pages in every variant. Nine interleaved rounds; the ratios are medians
// of per-round ratios. One JSON object.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "ring_device.hpp"
#include "sriovd/guest/virtqueue.hpp"
#include "sriovd/virtio/iotlb.hpp"

using namespace sriovd::virtio;
using namespace sriovd::guest;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint64_t kBase = 0x100000;        // guest physical / IOVA of RAM
constexpr uint64_t kUser = 0x7f0000000000;  // the front-end's address of RAM
constexpr uint64_t kMem = 1U << 20U;
constexpr uint16_t kQueue = 256;
constexpr unsigned kPages = 64;

enum class Mode { off, one_entry, page_entries };

double run_once(Mode mode, double seconds) {
  std::vector<uint8_t> ram(kMem + 64);
  auto* host = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(ram.data()) + 63) & ~uintptr_t{63});
  GuestMemory mem;
  mem.add_host_region(kBase, kMem, kUser, host);
  Iotlb iotlb;
  if (mode == Mode::one_entry) iotlb.update({kBase, kMem, kUser, kIotlbRead | kIotlbWrite});
  if (mode == Mode::page_entries)
    for (uint64_t off = 0; off < kMem; off += 4096)
      iotlb.update({kBase + off, 4096, kUser + off, kIotlbRead | kIotlbWrite});
  iotlb.publish();
  if (mode != Mode::off) mem.set_iotlb(&iotlb);
  SplitDriver driver(host, kBase, kQueue);
  auto queue = make_split_queue(mem, kQueue, driver.addresses(), false);
  sriovd::bench::RingDevice device(*queue);
  unsigned page = 0;
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  const auto t0 = Clock::now();
  while (Clock::now() < end) {
    for (int i = 0; i < 32; ++i) {
      const Buffer buf{kBase + 0x40000 + 4096ULL * (page++ % kPages), 64, false};
      if (driver.add(std::span<const Buffer>(&buf, 1)) < 0) break;
    }
    driver.publish();
    uint32_t id, len;
    while (driver.take_used(id, len)) {
    }
  }
  const uint64_t served = device.stop();
  if (queue->broken()) {
    std::fprintf(stderr, "iotlb bench: the ring broke (%s)\n", to_string(queue->error()));
    std::exit(1);
  }
  return static_cast<double>(served) / std::chrono::duration<double>(Clock::now() - t0).count() / 1e6;
}

}  // namespace

int main() {
  constexpr int kRuns = 9;
  std::fprintf(stderr, "iotlb bench: IOTLB off / one entry / page entries, interleaved, %d runs of 0.4 s...\n", kRuns);
  // Each ratio comes from runs taken back to back, so that the machine's
  // drift cancels; the figure is the median ratio.
  std::vector<double> off, one, pages, r_one, r_pages;
  for (int i = 0; i < kRuns; ++i) {
    off.push_back(run_once(Mode::off, 0.4));
    one.push_back(run_once(Mode::one_entry, 0.4));
    pages.push_back(run_once(Mode::page_entries, 0.4));
    r_one.push_back(one.back() / off.back());
    r_pages.push_back(pages.back() / off.back());
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double m_off = median(off), m_one = median(one), m_pages = median(pages);
  nlohmann::json j = {
      {"iotlb_off_mdesc_per_sec", m_off},
      {"iotlb_on_mdesc_per_sec", m_one},
      {"iotlb_on_vs_off", median(r_one)},
      {"iotlb_page_entries_mdesc_per_sec", m_pages},
      {"iotlb_page_entries_vs_off", median(r_pages)},
      {"target_on_vs_off", 0.98},
      {"queue_size", kQueue},
      {"runs", kRuns},
  };
  std::printf("%s\n", j.dump(2).c_str());
  return 0;
}
