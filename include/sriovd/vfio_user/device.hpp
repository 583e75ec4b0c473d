#pragma once
// What a vfio-user server serves: a PCI device as VFIO describes one
// (regions, interrupts, reset) plus the client's DMA memory. Two adapters
// implement it: the VF proxy (a VFIO device, with its MSI-X trapped) and
// virtio-net-pci (a device model behind the virtio PCI transport). The
// server validates every message before it reaches an adapter; an adapter
// throws Error for a request that is well formed but cannot be done, and
// the client gets that errno in the reply.

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/util/handed_fds.hpp"
#include "sriovd/util/peer_mapping.hpp"
#include "sriovd/vfio/device.hpp"
#include "sriovd/vfio_user/protocol.hpp"

namespace sriovd::vfio_user {

struct RegionDescription {
  uint32_t flags = 0;  // VFIO_REGION_INFO_FLAG_READ | _WRITE | _MMAP
  uint64_t size = 0;
  int fd = -1;  // what the client mmaps (borrowed; -1: nothing)
  uint64_t fd_offset = 0;
  // With an fd: the parts the client may map, when not the whole region
  // (the pages of the MSI-X table and PBA are left out: they are trapped).
  std::vector<vfio::SparseArea> sparse;
};

// A doorbell the client may wire to an ioeventfd (GET_REGION_IO_FDS).
struct IoFd {
  uint64_t offset = 0;
  uint64_t size = 0;  // 0: any access size
  int fd = -1;        // borrowed
};

// One DMA window the client shared (DMA_MAP). `host` is null when the
// client sent no fd: the server reaches that memory with DMA_READ/WRITE.
struct DmaWindow {
  uint64_t iova = 0;
  uint64_t size = 0;
  uint8_t* host = nullptr;
  bool readable = false;
  bool writable = false;
  // The server's registration of the mapping against the client truncating
  // its file (null without a mapping); valid while the window is.
  const PeerMapping* guard = nullptr;
};

class Migratable;  // vfio_user/migration.hpp

class ExportedDevice {
 public:
  virtual ~ExportedDevice() = default;
  [[nodiscard]] virtual const std::string& name() const = 0;
  [[nodiscard]] virtual uint32_t num_regions() const { return 9; }  // 6 BARs, ROM, config, VGA
  [[nodiscard]] virtual uint32_t num_irqs() const { return 5; }     // INTx, MSI, MSI-X, ERR, REQ
  [[nodiscard]] virtual bool can_reset() const { return true; }

  virtual RegionDescription region(uint32_t index) = 0;
  virtual std::vector<IoFd> region_io_fds(uint32_t /*index*/) { return {}; }
  // [offset, offset + data.size()) is inside the region (the server checked).
  virtual void read(uint32_t region, uint64_t offset, std::span<uint8_t> data) = 0;
  virtual void write(uint32_t region, uint64_t offset, std::span<const uint8_t> data) = 0;

  virtual vfio::IrqInfo irq(uint32_t index) = 0;
  // TRIGGER with eventfds for [start, start + fds.size()); an invalid fd
  // de-assigns that vector. The range is inside the index (checked).
  virtual void set_irq_eventfds(uint32_t index, uint32_t start, std::vector<UniqueFd> fds) = 0;
  // DATA_NONE, count 0: every vector of the index loses its eventfd.
  virtual void disable_irqs(uint32_t index) = 0;
  virtual void mask_irq(uint32_t index, uint32_t vector, bool masked) = 0;
  // TRIGGER with DATA_NONE/BOOL: the client raises the interrupt itself.
  virtual void trigger_irq(uint32_t index, uint32_t vector) = 0;

  virtual void dma_mapped(const DmaWindow& /*window*/) {}
  virtual void dma_unmapped(const DmaWindow& /*window*/) {}

  // Live migration (DEVICE_FEATURE MIGRATION and the rest); null: the
  // device cannot be migrated and the features are refused (ENOTTY).
  virtual Migratable* migratable() { return nullptr; }

  // An upgrade in place (Server::freeze_for_handover): the device stops
  // and returns what its successor needs beyond the server's part, its fds
  // added to `fds` (named in the bytes by index). Throws HandoverRefused
  // when it cannot be handed over now (the default: never), running on as
  // it was. thaw(): the handover did not happen. take_over(): the
  // successor's, on a device whose client's DMA windows are mapped
  // (dma_mapped) and nothing else happened; throws std::invalid_argument
  // when the part does not fit, changing nothing.
  virtual std::vector<uint8_t> freeze_for_handover(HandedFds& /*fds*/) {
    throw HandoverRefused(name() + " cannot be handed over");
  }
  virtual void thaw() {}
  virtual void handed_over() {}
  virtual void take_over(std::span<const uint8_t> /*part*/, HandedFds& /*fds*/) {
    throw std::invalid_argument(name() + " cannot be taken over");
  }

  virtual void reset() = 0;
  // The client went away: drop every fd it gave and reset the device. Its
  // DMA windows are unmapped (dma_unmapped) after this returns, with the
  // device stopped.
  virtual void client_gone() = 0;
};

}  // namespace sriovd::vfio_user
