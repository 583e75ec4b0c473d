#pragma once
// The VF proxy: a VFIO device (a VF on vfio-pci, or the simulated VF)
// exported over vfio-user. The client sees the device's config space
// through pci::VirtualConfig and reaches its BARs through the server, or,
// when the operator allows it (BarMapping::device_fd), maps them through
// the device's own fd (zero-copy) except the pages that hold the MSI-X
// table and PBA, which are always trapped and served by msix::MsixState. Each vector the client gives
// an eventfd becomes a route of the interrupt engine, with the VF's policy
// (direct / relay / adaptive): VFIO's vector is bound to the route's relay
// fd or, in direct mode, to the client's eventfd itself. DMA windows the
// client shares are mapped into the device's IOMMU.

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sriovd/irq/engine.hpp"
#include "sriovd/msix/msix.hpp"
#include "sriovd/pci/config_space.hpp"
#include "sriovd/pci/virtual_config.hpp"
#include "sriovd/vfio/device.hpp"
#include "sriovd/vfio_user/device.hpp"

namespace sriovd::vfio_user {

// How the client reaches the BARs. trapped: every access is a REGION_READ/
// WRITE served here, and no fd of the device leaves the daemon. device_fd:
// the areas outside the MSI-X pages are mmap-able through the VFIO device
// fd itself, handed to the client - zero-copy, but with it the VMM can
// issue VFIO ioctls past this proxy (README, "bar_access").
enum class BarMapping { trapped, device_fd };

class VfProxy : public ExportedDevice {
 public:
  // `label` names the routes in listings (the VF's PCI address).
  VfProxy(std::unique_ptr<vfio::Device> device, irq::Engine& engine, irq::Policy policy, std::string label,
          BarMapping bars = BarMapping::trapped);
  ~VfProxy() override;

  [[nodiscard]] const std::string& name() const override { return label_; }
  RegionDescription region(uint32_t index) override;
  void read(uint32_t region, uint64_t offset, std::span<uint8_t> data) override;
  void write(uint32_t region, uint64_t offset, std::span<const uint8_t> data) override;
  vfio::IrqInfo irq(uint32_t index) override;
  void set_irq_eventfds(uint32_t index, uint32_t start, std::vector<UniqueFd> fds) override;
  void disable_irqs(uint32_t index) override;
  void mask_irq(uint32_t index, uint32_t vector, bool masked) override;
  void trigger_irq(uint32_t index, uint32_t vector) override;
  void dma_mapped(const DmaWindow& window) override;
  void dma_unmapped(const DmaWindow& window) override;
  void reset() override;
  void client_gone() override;

  [[nodiscard]] vfio::Device& device() { return *device_; }
  [[nodiscard]] const msix::MsixState& msix() const { return *msix_; }
  [[nodiscard]] const pci::MsixLayout& msix_layout() const { return layout_; }
  // The route of a vector with an eventfd (nullopt: none given).
  [[nodiscard]] std::optional<irq::RouteId> route(unsigned vector) const { return vectors_.route(vector); }
  [[nodiscard]] irq::RouteStats interrupt_totals() const { return vectors_.totals(); }
  [[nodiscard]] uint64_t vfio_reenables() const { return binder_.reenables(); }
  [[nodiscard]] unsigned vfio_enabled_vectors() const { return binder_.enabled(); }
  [[nodiscard]] size_t dma_windows() const { return dma_windows_; }
  // The most bytes of client memory mapped for DMA at once (the kernel pins
  // them, charged to the daemon): a DMA_MAP past it is refused (ENOSPC).
  void set_dma_limit(uint64_t bytes) { dma_limit_ = bytes; }
  [[nodiscard]] uint64_t dma_bytes() const { return dma_bytes_; }
  [[nodiscard]] BarMapping bar_mapping() const { return bar_mapping_; }

 private:
  // msix::VectorControl over routes that exist only for vectors in use.
  class Vectors : public msix::VectorControl {
   public:
    Vectors(irq::Engine& engine, size_t count) : engine_(engine), routes_(count), masked_(count, true) {}
    void set_masked(unsigned v, bool masked) override;
    [[nodiscard]] bool pending(unsigned v) const override;
    void clear_pending(unsigned v) override;
    [[nodiscard]] std::optional<irq::RouteId> route(unsigned v) const { return routes_.at(v); }
    void attach(unsigned v, irq::RouteId id);
    void detach(unsigned v);
    void reset_masks() { masked_.assign(masked_.size(), true); }
    // Counters of every route this export has had, gone ones included.
    [[nodiscard]] irq::RouteStats totals() const;

   private:
    irq::Engine& engine_;
    std::vector<std::optional<irq::RouteId>> routes_;
    std::vector<bool> masked_;  // the effective mask, kept while no route exists
    irq::RouteStats retired_;   // of routes already removed
  };

  enum class Area { device, table, pba };
  Area classify(uint32_t region, uint64_t offset, size_t size) const;
  void bar_access(uint32_t region, uint64_t offset, uint8_t* data, size_t size, bool write);
  void drop_routes();
  void build_config();

  std::unique_ptr<vfio::Device> device_;
  irq::Engine& engine_;
  irq::Policy policy_;
  BarMapping bar_mapping_;
  std::string label_;
  std::vector<uint8_t> device_config_;
  pci::MsixLayout layout_;
  std::array<pci::BarInfo, 6> bars_{};
  Vectors vectors_;
  std::unique_ptr<msix::MsixState> msix_;
  std::unique_ptr<pci::VirtualConfig> config_;
  vfio::MsixVectors binder_;
  size_t dma_windows_ = 0;
  uint64_t dma_bytes_ = 0;
  uint64_t dma_limit_ = UINT64_MAX;
};

}  // namespace sriovd::vfio_user
