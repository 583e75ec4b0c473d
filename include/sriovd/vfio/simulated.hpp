#pragma once
// The simulated VF of `host: simulated`: the same Device interface as
// kernel VFIO, with a config space carrying an MSI-X capability, a BAR0
// holding the MSI-X table and PBA, per-vector eventfds as SET_IRQS leaves
// them, and an interrupt generator for tests, benchmarks and the demo.

#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/vfio/device.hpp"

namespace sriovd::vfio {

class SimulatedDevice : public Device {
 public:
  static constexpr uint64_t kBar0Size = 0x4000;
  static constexpr uint64_t kTableOffset = 0x0000;  // in BAR0
  static constexpr uint64_t kPbaOffset = 0x2000;
  // The device's own registers, in the BAR0 page between the table and the
  // PBA (not mappable, so every access reaches the device), as a NIC has
  // an interrupt cause register for driver self-tests:
  static constexpr uint64_t kRegIcs = 0x1000;         // write: fire the vectors whose bits are set
  static constexpr uint64_t kRegGenVectors = 0x1010;  // write: generator on those vectors (0: stop)
  static constexpr uint64_t kRegGenRate = 0x1014;     // interrupts/s for the generator (0: flat out)
  static constexpr uint64_t kRegGenerated = 0x1018;   // read: interrupts generated (64-bit)

  SimulatedDevice(std::string name, uint16_t vendor, uint16_t device, uint16_t msix_vectors);
  ~SimulatedDevice() override;

  [[nodiscard]] const std::string& name() const override { return name_; }
  [[nodiscard]] uint32_t num_regions() const override { return 9; }
  [[nodiscard]] uint32_t num_irqs() const override { return 5; }
  RegionInfo region(uint32_t index) override;
  void read(uint32_t region, uint64_t offset, void* data, size_t size) override;
  void write(uint32_t region, uint64_t offset, const void* data, size_t size) override;
  IrqInfo irq(uint32_t index) override;
  void set_irq_eventfds(uint32_t index, uint32_t start, std::span<const int> fds) override;
  void disable_irqs(uint32_t index) override;
  void trigger(uint32_t index, uint32_t vector) override;
  void reset() override;
  // BAR0 lives in a memfd, so a vfio-user client can map it as it would
  // map a real BAR through the VFIO device fd.
  int mmap_fd(uint32_t region, uint64_t& offset) override;
  void map_dma(uint64_t iova, void* host, uint64_t size, bool writable) override;
  void unmap_dma(uint64_t iova, uint64_t size) override;

  // The device's own DMA into the windows it was given (what a NIC does
  // when it writes a received packet): throws std::out_of_range outside
  // them, as an IOMMU fault would stop it.
  void dma_write(uint64_t iova, const void* data, size_t size);
  void dma_read(uint64_t iova, void* data, size_t size);
  [[nodiscard]] size_t dma_windows() const;

  // The interrupt generator: fires `vectors` round-robin, `burst` at a
  // time, `rate` bursts per second (0: as fast as it can), until stopped.
  void start_generator(std::vector<uint32_t> vectors, double rate, unsigned burst = 1);
  void stop_generator();
  [[nodiscard]] uint64_t generated() const { return generated_.load(); }
  // SET_IRQS calls so far (what a naive mask costs).
  [[nodiscard]] uint64_t set_irqs_calls() const { return set_irqs_calls_.load(); }
  // CPU time each SET_IRQS spends on the calling thread, as the real
  // kernel's does (its irq teardown and setup); 0 (the default here): none.
  void set_set_irqs_cost(std::chrono::nanoseconds cost) { set_irqs_cost_ns_.store(cost.count()); }

  // Handover: BAR0's memfd, the config space, whether MSI-X is on, the
  // generator's settings and count; a successor's device takes them
  // (adopt_device) and its generator goes on.
  std::vector<uint8_t> freeze_for_handover(HandedFds& fds) override;
  void take_over(UniqueFd bar0, std::vector<uint8_t> config, bool msix_enabled, uint64_t generated);

 private:
  std::string name_;
  std::vector<uint8_t> config_;
  UniqueFd bar0_fd_;
  uint8_t* bar0_ = nullptr;  // kBar0Size bytes, MAP_SHARED on bar0_fd_
  mutable std::mutex mutex_;
  struct Window {
    uint64_t iova;
    uint64_t size;
    uint8_t* host;
    bool writable;
  };
  std::vector<Window> windows_;
  uint8_t* dma_target(uint64_t iova, size_t size, bool write);
  bool register_write(uint64_t offset, const void* data, size_t size);
  bool register_read(uint64_t offset, void* data, size_t size);
  void spend_set_irqs_cost() const;
  std::atomic<uint32_t> gen_rate_{0};
  std::vector<std::atomic<int>> vector_fds_;
  bool msix_enabled_ = false;
  std::atomic<uint64_t> generated_{0};
  std::atomic<uint64_t> set_irqs_calls_{0};
  std::atomic<int64_t> set_irqs_cost_ns_{0};
  std::atomic<bool> generator_stop_{false};
  std::thread generator_;
  // What the running generator was started with (a handover restarts it).
  struct Generating {
    std::vector<uint32_t> vectors;
    double rate = 0;
    unsigned burst = 1;
  };
  std::optional<Generating> generating_;
};

}  // namespace sriovd::vfio
