#pragma once
// The device side of a ring benchmark: a thread that takes every buffer the
// driver makes available and gives it straight back (in bursts, published
// once each), until stopped.
#include <array>
#include <atomic>
#include <cstdint>
#include <thread>

#include "sriovd/virtio/ring.hpp"

namespace sriovd::bench {

class RingDevice {
 public:
  static constexpr unsigned kBurst = 256;  // the net device's pass budget
  explicit RingDevice(virtio::Virtqueue& queue)
      : thread_([this, &queue] {
          std::array<virtio::Segment, 8> segs{};
          virtio::Chain c;
          uint64_t n = 0;
          while (!stop_.load(std::memory_order_relaxed)) {
            // As the net device does: a burst taken and handed back, then
            // published at once.
            unsigned burst = 0;
            while (burst < kBurst && queue.pop(c, segs)) {
              queue.add_used(c, 0);
              ++burst;
            }
            queue.publish_used();
            n += burst;
          }
          served_ = n;
        }) {}
  ~RingDevice() {
    if (thread_.joinable()) stop();
  }
  RingDevice(const RingDevice&) = delete;
  RingDevice& operator=(const RingDevice&) = delete;
  // Stops the thread; the buffers it served.
  uint64_t stop() {
    stop_ = true;
    thread_.join();
    return served_.load();
  }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> served_{0};
  std::thread thread_;
};

}  // namespace sriovd::bench
