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
#include <mutex>
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
  // An upgrade in place: the VFIO device as the kernel holds it (MSI-X on,
  // the IOMMU's mappings kept: vfio::Device::freeze_for_handover), the
  // config space and MSI-X state, each vector's client eventfd, and an
  // eventfd per vector in use that the device signals from the freeze on:
  // the successor rebinds each vector on its own (MSI-X never off) and
  // delivers what was counted meanwhile. adopt_device(): the successor's
  // VFIO device, from the part, before its proxy is made.
  std::vector<uint8_t> freeze_for_handover(HandedFds& fds) override;
  void thaw() override;
  void handed_over() override;
  void take_over(std::span<const uint8_t> part, HandedFds& fds) override;
  static std::unique_ptr<vfio::Device> adopt_device(std::span<const uint8_t> part, HandedFds& fds,
                                                    const std::string& what);

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
    // A restored state's pending bit (a vector with no route has none).
    void set_pending(unsigned v) override;
    // Counters of every route this export has had, gone ones included.
    [[nodiscard]] irq::RouteStats totals() const;

   private:
    irq::Engine& engine_;
    std::vector<std::optional<irq::RouteId>> routes_;
    std::vector<bool> masked_;  // the effective mask, kept while no route exists
    irq::RouteStats retired_;   // of routes already removed
  };

  // Between the engine and the VFIO vectors: every rebinding passes here
  // and is remembered; while a handover is prepared, none reaches the
  // device (it signals the handover's eventfds), and thaw() applies the
  // last one asked for.
  class Gate : public irq::SourceBinder {
   public:
    Gate(vfio::MsixVectors& to, size_t vectors) : to_(to), wanted_(vectors, -1) {}
    void bind(unsigned vector, int eventfd) override;
    void disable();
    void freeze();
    void thaw();
    [[nodiscard]] bool frozen() const;

   private:
    vfio::MsixVectors& to_;
    mutable std::mutex mutex_;  // the engine's housekeeping (control thread) and masks (session thread)
    bool frozen_ = false;
    std::vector<int> wanted_;
  };

  enum class Area { device, table, pba };
  void deliver_captured(std::vector<UniqueFd>& captured);
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
  Gate gate_;
  std::vector<UniqueFd> sinks_;     // each vector's client eventfd (the engine's copy in use), for a handover
  std::vector<UniqueFd> captured_;  // while frozen: what the device signals instead
  bool handed_ = false;
  size_t dma_windows_ = 0;
  uint64_t dma_bytes_ = 0;
  uint64_t dma_limit_ = UINT64_MAX;
};

}  // namespace sriovd::vfio_user
