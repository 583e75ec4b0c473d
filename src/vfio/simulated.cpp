#include "sriovd/vfio/simulated.hpp"

#include <linux/vfio.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <stdexcept>

#include "sriovd/pci/config_space.hpp"

namespace sriovd::vfio {

SimulatedDevice::SimulatedDevice(std::string name, uint16_t vendor, uint16_t device, uint16_t msix_vectors)
    : name_(std::move(name)), bar0_(kBar0Size, 0), vector_fds_(msix_vectors) {
  pci::EndpointSpec spec;
  spec.vendor = vendor;
  spec.device = device;
  spec.class_code = 0x020000;
  spec.msix_vectors = msix_vectors;
  spec.msix_bir = 0;
  spec.msix_table_offset = kTableOffset;
  spec.msix_pba_offset = kPbaOffset;
  config_ = pci::make_endpoint_config(spec);
  for (auto& fd : vector_fds_) fd.store(-1);
}

SimulatedDevice::~SimulatedDevice() { stop_generator(); }

RegionInfo SimulatedDevice::region(uint32_t index) {
  constexpr uint32_t rw = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;
  if (index == kBar0Region) {
    RegionInfo r{index, rw | VFIO_REGION_INFO_FLAG_MMAP, kBar0Size, 0, {}, false};
    // As vfio-pci reports a BAR with the MSI-X table in it: the pages
    // holding table and PBA are not in the mappable areas.
    r.sparse.push_back({0x3000, kBar0Size - 0x3000});
    return r;
  }
  if (index == kConfigRegion) return {index, rw, config_.size(), 0, {}, false};
  if (index < num_regions()) return {index, 0, 0, 0, {}, false};  // absent BARs, ROM, VGA
  throw std::out_of_range(name_ + ": no region " + std::to_string(index));
}

void SimulatedDevice::read(uint32_t index, uint64_t offset, void* data, size_t size) {
  std::lock_guard lock(mutex_);
  const std::vector<uint8_t>& mem = index == kConfigRegion ? config_ : bar0_;
  if ((index != kConfigRegion && index != kBar0Region) || offset + size > mem.size())
    throw std::out_of_range(name_ + ": read outside region " + std::to_string(index));
  std::memcpy(data, mem.data() + offset, size);
}

void SimulatedDevice::write(uint32_t index, uint64_t offset, const void* data, size_t size) {
  std::lock_guard lock(mutex_);
  std::vector<uint8_t>& mem = index == kConfigRegion ? config_ : bar0_;
  if ((index != kConfigRegion && index != kBar0Region) || offset + size > mem.size())
    throw std::out_of_range(name_ + ": write outside region " + std::to_string(index));
  std::memcpy(mem.data() + offset, data, size);
}

IrqInfo SimulatedDevice::irq(uint32_t index) {
  if (index == kMsixIrq)
    return {index, VFIO_IRQ_INFO_EVENTFD | VFIO_IRQ_INFO_NORESIZE, static_cast<uint32_t>(vector_fds_.size())};
  if (index < num_irqs()) return {index, 0, 0};
  throw std::out_of_range(name_ + ": no IRQ index " + std::to_string(index));
}

void SimulatedDevice::set_irq_eventfds(uint32_t index, uint32_t start, std::span<const int> fds) {
  set_irqs_calls_.fetch_add(1, std::memory_order_relaxed);
  if (index != kMsixIrq || start + fds.size() > vector_fds_.size())
    throw std::out_of_range(name_ + ": SET_IRQS outside the MSI-X vectors");
  std::lock_guard lock(mutex_);
  msix_enabled_ = true;
  for (size_t i = 0; i < fds.size(); ++i) vector_fds_[start + i].store(fds[i], std::memory_order_release);
}

void SimulatedDevice::disable_irqs(uint32_t index) {
  if (index != kMsixIrq) return;
  std::lock_guard lock(mutex_);
  msix_enabled_ = false;
  for (auto& fd : vector_fds_) fd.store(-1);
}

void SimulatedDevice::trigger(uint32_t index, uint32_t vector) {
  if (index != kMsixIrq || vector >= vector_fds_.size())
    throw std::out_of_range(name_ + ": no MSI-X vector " + std::to_string(vector));
  const int fd = vector_fds_[vector].load(std::memory_order_acquire);
  if (fd < 0) return;  // no eventfd: the interrupt goes nowhere, as in VFIO
  const uint64_t one = 1;
  (void)::write(fd, &one, sizeof one);
}

void SimulatedDevice::reset() {
  std::lock_guard lock(mutex_);
  std::fill(bar0_.begin(), bar0_.end(), 0);
}

void SimulatedDevice::start_generator(std::vector<uint32_t> vectors, double rate, unsigned burst) {
  stop_generator();
  generator_stop_.store(false);
  generator_ = std::thread([this, vectors = std::move(vectors), rate, burst] {
    using Clock = std::chrono::steady_clock;
    const auto period = rate > 0 ? std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(1.0 / rate))
                                 : Clock::duration::zero();
    auto next = Clock::now();
    size_t i = 0;
    while (!generator_stop_.load(std::memory_order_relaxed)) {
      for (unsigned b = 0; b < burst; ++b) {
        trigger(kMsixIrq, vectors[i++ % vectors.size()]);
        generated_.fetch_add(1, std::memory_order_relaxed);
      }
      if (period.count() > 0) {
        next += period;
        std::this_thread::sleep_until(next);
      }
    }
  });
}

void SimulatedDevice::stop_generator() {
  generator_stop_.store(true);
  if (generator_.joinable()) generator_.join();
}

}  // namespace sriovd::vfio
