#pragma once
// A device as VFIO presents it: regions, interrupts, reset. Two
// implementations share this interface: the kernel's VFIO (KernelDevice)
// and the simulated VF of `host: simulated` (SimulatedDevice), so that
// everything above runs unchanged on either.

#include <cstdint>
#include <mutex>
#include <span>
#include <memory>
#include <string>
#include <vector>

#include "sriovd/irq/source_binder.hpp"
#include "sriovd/util/handed_fds.hpp"

namespace sriovd::vfio {

// VFIO's fixed region and IRQ indexes for PCI devices (linux/vfio.h).
inline constexpr uint32_t kBar0Region = 0;
inline constexpr uint32_t kConfigRegion = 7;
inline constexpr uint32_t kMsixIrq = 2;

struct SparseArea {
  uint64_t offset = 0;
  uint64_t size = 0;
};

struct RegionInfo {
  uint32_t index = 0;
  uint32_t flags = 0;  // VFIO_REGION_INFO_FLAG_*
  uint64_t size = 0;
  uint64_t offset = 0;             // of the region in the device fd
  std::vector<SparseArea> sparse;  // mmap-able parts, when the region has holes
  bool msix_mappable = false;      // the kernel lets the MSI-X table be mapped
  [[nodiscard]] bool readable() const;
  [[nodiscard]] bool writable() const;
  [[nodiscard]] bool mappable() const;
};

struct IrqInfo {
  uint32_t index = 0;
  uint32_t flags = 0;  // VFIO_IRQ_INFO_*
  uint32_t count = 0;
  [[nodiscard]] bool eventfd() const;
  [[nodiscard]] bool maskable() const;
  // Set: the vector count fixed when MSI-X is enabled cannot grow without a
  // disable and re-enable.
  [[nodiscard]] bool noresize() const;
};

class Device {
 public:
  virtual ~Device() = default;
  [[nodiscard]] virtual const std::string& name() const = 0;
  [[nodiscard]] virtual uint32_t num_regions() const = 0;
  [[nodiscard]] virtual uint32_t num_irqs() const = 0;
  virtual RegionInfo region(uint32_t index) = 0;
  virtual void read(uint32_t region, uint64_t offset, void* data, size_t size) = 0;
  virtual void write(uint32_t region, uint64_t offset, const void* data, size_t size) = 0;
  virtual IrqInfo irq(uint32_t index) = 0;
  // VFIO_DEVICE_SET_IRQS, DATA_EVENTFD|ACTION_TRIGGER for [start, start+n):
  // fd -1 de-assigns a vector. The first call with start 0 enables the index.
  virtual void set_irq_eventfds(uint32_t index, uint32_t start, std::span<const int> fds) = 0;
  // DATA_NONE|ACTION_TRIGGER, count 0: disables the whole index.
  virtual void disable_irqs(uint32_t index) = 0;
  // DATA_NONE|ACTION_TRIGGER on one vector: the kernel signals its eventfd
  // as if the device had raised it (loopback).
  virtual void trigger(uint32_t index, uint32_t vector) = 0;
  virtual void reset() = 0;
  // The fd through which the region can be mmap()ed and the offset of the
  // region in it; -1 when it cannot be mapped.
  virtual int mmap_fd(uint32_t /*region*/, uint64_t& /*offset*/) { return -1; }
  // Lets the device DMA to [iova, iova + size), backed by `host`
  // (VFIO_IOMMU_MAP_DMA for a kernel device).
  virtual void map_dma(uint64_t iova, void* host, uint64_t size, bool writable) = 0;
  virtual void unmap_dma(uint64_t iova, uint64_t size) = 0;

  // An upgrade in place (daemon/handover.hpp): what a successor needs to go
  // on with the device as it stands (MSI-X enabled, the IOMMU's mappings
  // kept), its fds added to `fds`. Throws HandoverRefused when it cannot be
  // handed over (the default). thaw(): the handover did not happen.
  // handed_over(): the successor has it; this object's end changes nothing
  // of it (no reset, no IOMMU or interrupt change).
  virtual std::vector<uint8_t> freeze_for_handover(HandedFds& /*fds*/) {
    throw HandoverRefused(name() + " cannot be handed over");
  }
  virtual void thaw() {}
  virtual void handed_over() {}
};

// A successor's device from its predecessor's part (freeze_for_handover of
// a kernel or simulated device); throws std::invalid_argument naming
// `what` when the part does not fit, or what the kernel refuses.
std::unique_ptr<Device> adopt_device(std::span<const uint8_t> part, HandedFds& fds, const std::string& what);

// The device's MSI-X vectors as VFIO has them enabled. Only vectors in use
// are enabled: the first use enables MSI-X with just enough vectors; a
// vector beyond them is added one at a time when the kernel can resize, and
// with one batched disable + re-enable (all eventfds in one SET_IRQS) when
// it reports NORESIZE.
class MsixVectors : public irq::SourceBinder {
 public:
  explicit MsixVectors(Device& device);
  // irq::SourceBinder: vector's eventfd (-1: none).
  void bind(unsigned vector, int eventfd) override;
  // Enables at least `count` vectors at once (a VMM that knows how many it
  // will use saves the re-enables).
  void reserve(unsigned count);
  void disable();
  // A successor's: `count` vectors are enabled already (the device was
  // handed over with MSI-X on): each is rebound on its own, nothing is
  // disabled and enabled again.
  void adopt_enabled(unsigned count);

  [[nodiscard]] unsigned enabled() const {
    std::lock_guard lock(mutex_);
    return static_cast<unsigned>(fds_.size());
  }
  [[nodiscard]] unsigned capacity() const { return info_.count; }
  [[nodiscard]] uint64_t reenables() const {
    std::lock_guard lock(mutex_);
    return reenables_;
  }

 private:
  void grow(size_t had);
  // The engine binds from the thread that masks (the export's session
  // thread) and from its housekeeping (the control thread): a mode switch,
  // never per interrupt.
  mutable std::mutex mutex_;
  Device& device_;
  IrqInfo info_;
  std::vector<int> fds_;  // one per enabled vector
  uint64_t reenables_ = 0;
};

}  // namespace sriovd::vfio
