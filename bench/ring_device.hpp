#pragma once
// The device side of a ring benchmark: a thread that takes every buffer the
// driver makes available and gives it straight back, until stopped.
#include <array>
#include <atomic>
#include <cstdint>
#include <thread>

#include "sriovd/virtio/ring.hpp"

namespace sriovd::bench {

class RingDevice {
 public:
  explicit RingDevice(virtio::Virtqueue& queue)
      : thread_([this, &queue] {
          std::array<virtio::Segment, 8> segs{};
          virtio::Chain c;
          uint64_t n = 0;
          while (!stop_.load(std::memory_order_relaxed)) {
            while (queue.pop(c, segs)) {
              queue.push(c, 0);
              ++n;
            }
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
