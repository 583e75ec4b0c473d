#include "sriovd/vfio/simulated.hpp"

#include <linux/vfio.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "sriovd/pci/config_space.hpp"
#include "sriovd/util/error.hpp"
#include "sriovd/util/eventfd.hpp"

namespace sriovd::vfio {

SimulatedDevice::SimulatedDevice(std::string name, uint16_t vendor, uint16_t device, uint16_t msix_vectors)
    : name_(std::move(name)), vector_fds_(msix_vectors) {
  bar0_fd_.reset(::memfd_create(("sriovd-sim-bar0-" + name_).c_str(), MFD_CLOEXEC));
  if (!bar0_fd_ || ::ftruncate(bar0_fd_.get(), kBar0Size) != 0) throw_errno(name_ + ": memfd for BAR0");
  void* bar = ::mmap(nullptr, kBar0Size, PROT_READ | PROT_WRITE, MAP_SHARED, bar0_fd_.get(), 0);
  if (bar == MAP_FAILED) throw_errno(name_ + ": mapping BAR0");
  bar0_ = static_cast<uint8_t*>(bar);
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

SimulatedDevice::~SimulatedDevice() {
  stop_generator();
  ::munmap(bar0_, kBar0Size);
}

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

bool SimulatedDevice::register_write(uint64_t offset, const void* data, size_t size) {
  if (size != 4 || (offset != kRegIcs && offset != kRegGenVectors && offset != kRegGenRate)) return false;
  uint32_t v;
  std::memcpy(&v, data, 4);
  if (offset == kRegGenRate) {
    gen_rate_.store(v);
    return true;
  }
  std::vector<uint32_t> vectors;
  for (uint32_t i = 0; i < std::min<size_t>(32, vector_fds_.size()); ++i)
    if (v & (1U << i)) vectors.push_back(i);
  if (offset == kRegIcs) {
    for (uint32_t i : vectors) trigger(kMsixIrq, i);
    generated_.fetch_add(vectors.size(), std::memory_order_relaxed);
  } else if (vectors.empty()) {
    stop_generator();
  } else {
    start_generator(std::move(vectors), gen_rate_.load());
  }
  return true;
}

bool SimulatedDevice::register_read(uint64_t offset, void* data, size_t size) {
  if (offset != kRegGenerated || (size != 8 && size != 4)) return false;
  const uint64_t n = generated_.load();
  std::memcpy(data, &n, size);
  return true;
}

void SimulatedDevice::read(uint32_t index, uint64_t offset, void* data, size_t size) {
  if (index == kBar0Region && register_read(offset, data, size)) return;
  std::lock_guard lock(mutex_);
  const size_t limit = index == kConfigRegion ? config_.size() : kBar0Size;
  if ((index != kConfigRegion && index != kBar0Region) || offset + size > limit)
    throw std::out_of_range(name_ + ": read outside region " + std::to_string(index));
  std::memcpy(data, (index == kConfigRegion ? config_.data() : bar0_) + offset, size);
}

void SimulatedDevice::write(uint32_t index, uint64_t offset, const void* data, size_t size) {
  if (index == kBar0Region && register_write(offset, data, size)) return;
  std::lock_guard lock(mutex_);
  const size_t limit = index == kConfigRegion ? config_.size() : kBar0Size;
  if ((index != kConfigRegion && index != kBar0Region) || offset + size > limit)
    throw std::out_of_range(name_ + ": write outside region " + std::to_string(index));
  std::memcpy((index == kConfigRegion ? config_.data() : bar0_) + offset, data, size);
}

IrqInfo SimulatedDevice::irq(uint32_t index) {
  if (index == kMsixIrq)
    return {index, VFIO_IRQ_INFO_EVENTFD | VFIO_IRQ_INFO_NORESIZE, static_cast<uint32_t>(vector_fds_.size())};
  if (index < num_irqs()) return {index, 0, 0};
  throw std::out_of_range(name_ + ": no IRQ index " + std::to_string(index));
}

// The kernel's cost of a SET_IRQS, as CPU time on the caller (a spin: the
// real ioctl does not sleep for it either).
void SimulatedDevice::spend_set_irqs_cost() const {
  const int64_t ns = set_irqs_cost_ns_.load(std::memory_order_relaxed);
  if (ns <= 0) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
  while (std::chrono::steady_clock::now() < until) __builtin_ia32_pause();
}

void SimulatedDevice::set_irq_eventfds(uint32_t index, uint32_t start, std::span<const int> fds) {
  set_irqs_calls_.fetch_add(1, std::memory_order_relaxed);
  spend_set_irqs_cost();
  if (index != kMsixIrq || start + fds.size() > vector_fds_.size())
    throw std::out_of_range(name_ + ": SET_IRQS outside the MSI-X vectors");
  std::lock_guard lock(mutex_);
  msix_enabled_ = true;
  for (size_t i = 0; i < fds.size(); ++i) vector_fds_[start + i].store(fds[i], std::memory_order_release);
}

void SimulatedDevice::disable_irqs(uint32_t index) {
  if (index != kMsixIrq) return;
  spend_set_irqs_cost();
  std::lock_guard lock(mutex_);
  msix_enabled_ = false;
  for (auto& fd : vector_fds_) fd.store(-1);
}

void SimulatedDevice::trigger(uint32_t index, uint32_t vector) {
  if (index != kMsixIrq || vector >= vector_fds_.size())
    throw std::out_of_range(name_ + ": no MSI-X vector " + std::to_string(vector));
  const int fd = vector_fds_[vector].load(std::memory_order_acquire);
  if (fd < 0) return;  // no eventfd: the interrupt goes nowhere, as in VFIO
  // The kernel signals without ever waiting; in direct mode this is the
  // VMM's eventfd, which it may have made blocking: a guarded write
  // (util/eventfd.hpp) is as close as user space comes.
  (void)peer_eventfd_write(fd);
}

void SimulatedDevice::reset() {
  stop_generator();
  gen_rate_.store(0);
  std::lock_guard lock(mutex_);
  std::memset(bar0_, 0, kBar0Size);
}

int SimulatedDevice::mmap_fd(uint32_t index, uint64_t& offset) {
  if (index != kBar0Region) return -1;
  offset = 0;
  return bar0_fd_.get();
}

void SimulatedDevice::map_dma(uint64_t iova, void* host, uint64_t size, bool writable) {
  std::lock_guard lock(mutex_);
  for (const Window& w : windows_)
    if (iova < w.iova + w.size && w.iova < iova + size)
      throw SystemError(EEXIST, name_ + ": DMA window at " + std::to_string(iova) + " overlaps one already mapped");
  windows_.push_back({iova, size, static_cast<uint8_t*>(host), writable});
}

void SimulatedDevice::unmap_dma(uint64_t iova, uint64_t size) {
  std::lock_guard lock(mutex_);
  for (auto it = windows_.begin(); it != windows_.end(); ++it)
    if (it->iova == iova && it->size == size) {
      windows_.erase(it);
      return;
    }
  throw SystemError(ENOENT, name_ + ": no DMA window at " + std::to_string(iova));
}

uint8_t* SimulatedDevice::dma_target(uint64_t iova, size_t size, bool write) {
  for (const Window& w : windows_)
    if (iova >= w.iova && size <= w.size && iova - w.iova <= w.size - size) {
      if (write && !w.writable) break;
      return w.host + (iova - w.iova);
    }
  throw std::out_of_range(name_ + ": DMA fault at " + std::to_string(iova) + " (+" + std::to_string(size) + ")");
}

void SimulatedDevice::dma_write(uint64_t iova, const void* data, size_t size) {
  std::lock_guard lock(mutex_);
  std::memcpy(dma_target(iova, size, true), data, size);
}

void SimulatedDevice::dma_read(uint64_t iova, void* data, size_t size) {
  std::lock_guard lock(mutex_);
  std::memcpy(data, dma_target(iova, size, false), size);
}

size_t SimulatedDevice::dma_windows() const {
  std::lock_guard lock(mutex_);
  return windows_.size();
}

void SimulatedDevice::start_generator(std::vector<uint32_t> vectors, double rate, unsigned burst) {
  stop_generator();
  generating_ = Generating{vectors, rate, burst};
  generator_stop_.store(false);
  generator_ = std::thread([this, vectors = std::move(vectors), rate, burst] {
    using Clock = std::chrono::steady_clock;
    const auto period = rate > 0
                            ? std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(1.0 / rate))
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
  generating_.reset();
}

std::vector<uint8_t> SimulatedDevice::freeze_for_handover(HandedFds& fds) {
  nlohmann::json j;
  {
    std::lock_guard lock(mutex_);
    j = {{"kind", "simulated"},
         {"name", name_},
         {"vectors", vector_fds_.size()},
         {"bar0", fds.add_fd(dup_fd(bar0_fd_.get(), "the simulated BAR0"))},
         {"config", config_},
         {"msix_enabled", msix_enabled_},
         {"generated", generated_.load()}};
  }
  if (generating_)
    j["generator"] = {{"vectors", generating_->vectors}, {"rate", generating_->rate}, {"burst", generating_->burst}};
  const std::string text = j.dump();
  return {text.begin(), text.end()};
}

void SimulatedDevice::take_over(UniqueFd bar0, std::vector<uint8_t> config, bool msix_enabled, uint64_t generated) {
  void* bar = ::mmap(nullptr, kBar0Size, PROT_READ | PROT_WRITE, MAP_SHARED, bar0.get(), 0);
  if (bar == MAP_FAILED) throw std::invalid_argument(name_ + ": the handed BAR0 cannot be mapped");
  std::lock_guard lock(mutex_);
  if (config.size() != config_.size())
    throw std::invalid_argument(name_ + ": a handed config space of " + std::to_string(config.size()) + " bytes");
  ::munmap(bar0_, kBar0Size);
  bar0_ = static_cast<uint8_t*>(bar);
  bar0_fd_ = std::move(bar0);
  config_ = std::move(config);
  msix_enabled_ = msix_enabled;
  generated_.store(generated);
}

}  // namespace sriovd::vfio
