#pragma once
// virtio-pci over vfio-user: the virtio 1.2 PCI transport (§4.1) in front of
// a virtio::Device (virtio/device.hpp), whose type gives the PCI device id
// (0x1040 + its virtio id) and class code; virtio-net-pci today. BAR0 holds the common,
// ISR, device and notify structures; every queue has its own doorbell
// (notify_off_multiplier 4), so a client can wire one zero-length
// ioeventfd per queue (GET_REGION_IO_FDS) and the queue is known from the
// address alone - the doorbell eventfd *is* the queue's kick fd. BAR1 holds
// the MSI-X table and PBA, emulated by the same msix::MsixState as the VF
// proxy's; each vector is a route of the shared interrupt engine, and a
// queue's used-buffer notification triggers the route of the vector the
// driver chose for it.

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "sriovd/util/log_limit.hpp"
#include "sriovd/irq/engine.hpp"
#include "sriovd/msix/msix.hpp"
#include "sriovd/pci/virtual_config.hpp"
#include "sriovd/virtio/guest_memory.hpp"
#include "sriovd/virtio/device.hpp"
#include "sriovd/vfio_user/device.hpp"
#include "sriovd/vfio_user/migration.hpp"

namespace sriovd::vfio_user {

class VirtioPci : public ExportedDevice, public Migratable {
 public:
  // BAR0 layout.
  static constexpr uint64_t kBar0Size = 0x4000;
  static constexpr uint64_t kCommonOffset = 0x0000;
  static constexpr uint64_t kCommonSize = 0x40;
  static constexpr uint64_t kIsrOffset = 0x1000;
  static constexpr uint64_t kDeviceOffset = 0x2000;
  // Room for a device type's configuration; the capability names the
  // device's own size (config_size), whatever its type.
  static constexpr uint64_t kDeviceWindow = 0x1000;
  static constexpr uint64_t kNotifyOffset = 0x3000;
  static constexpr uint32_t kNotifyMultiplier = 4;
  // BAR1: MSI-X.
  static constexpr uint64_t kBar1Size = 0x1000;
  static constexpr uint64_t kPbaOffset = 0x800;
  static constexpr uint16_t kNoVector = 0xffff;  // VIRTIO_MSI_NO_VECTOR
  // Where the capabilities sit in config space.
  static constexpr uint32_t kCapMsix = 0x40;
  static constexpr uint32_t kCapPciCfg = 0x90;
  static constexpr size_t kConfigSaved = 256;  // config space in a saved state

  VirtioPci(virtio::Device& device, irq::Engine& engine, std::string name);
  ~VirtioPci() override;

  [[nodiscard]] const std::string& name() const override { return name_; }
  RegionDescription region(uint32_t index) override;
  std::vector<IoFd> region_io_fds(uint32_t index) override;
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
  // An upgrade in place: the device's state (save_state), whether it ran,
  // each queue's doorbell and each vector's eventfd. The successor checks
  // the eventfds again, restores the state on the mapped windows, runs the
  // device and raises each queue's vector once (an interrupt owed).
  // Refused during a live migration.
  std::vector<uint8_t> freeze_for_handover(HandedFds& fds) override;
  void thaw() override;
  void take_over(std::span<const uint8_t> part, HandedFds& fds) override;

  // Live migration over vfio-user (vfio_user/migration.hpp): the state is
  // save_state()'s, serialised; stopped, nothing runs until RUNNING (a
  // driver's DRIVER_OK, a restored state's resume, a link change's
  // interrupt wait for it); the DMA log is installed into guest memory and
  // every ring, as vhost-user's dirty log is.
  Migratable* migratable() override { return this; }
  void mig_stop() override;
  void mig_run() override;
  std::vector<uint8_t> mig_save() override;
  void mig_prepare_resume() override;
  void mig_load(std::span<const uint8_t> data) override;
  [[nodiscard]] const virtio::GuestMemory& dma_memory() const override { return memory_; }
  void set_dma_log(const virtio::DirtyLog* log) override;
  [[nodiscard]] bool quiesced() const { return quiesced_; }

  [[nodiscard]] uint8_t status() const { return status_; }
  // The device configuration changed (the link): config_generation moves
  // and the configuration vector fires (§4.1.4.3, §4.1.5.3).
  void config_changed();
  [[nodiscard]] const msix::MsixState& msix() const { return *msix_; }
  [[nodiscard]] irq::RouteId vector_route(unsigned v) const { return routes_.at(v); }
  // The DMA windows the client has mapped.
  [[nodiscard]] const std::vector<DmaWindow>& dma_windows() const { return windows_; }

  // The device's state with this transport's in DeviceState::transport
  // (common configuration, each queue's registers, the config space's
  // writable bits, the MSI-X table, masks and pending bits). The device
  // stops; it stays stopped (the source of a migration does not go on).
  [[nodiscard]] virtio::DeviceState save_state();
  // Into a transport whose client has not started a driver (a migration's
  // destination: its DMA windows come before the state). Everything is
  // checked before anything changes (std::invalid_argument names what is
  // wrong); a device the driver had started then runs from where it stood,
  // once guest memory is mapped.
  void restore_state(const virtio::DeviceState& state);

 private:
  struct QueueRegs {
    uint16_t size = 0;
    uint16_t msix_vector = kNoVector;
    bool enabled = false;
    uint64_t desc = 0, driver = 0, device = 0;
  };
  [[nodiscard]] uint32_t device_config_length() const;
  uint64_t bar0_read(uint64_t offset, unsigned size);
  void bar0_write(uint64_t offset, unsigned size, uint64_t value);
  uint64_t common_read(uint64_t offset, unsigned size);
  void common_write(uint64_t offset, unsigned size, uint64_t value);
  uint32_t config_read(uint32_t offset, unsigned size);
  void config_write(uint32_t offset, unsigned size, uint32_t value);
  void set_status(uint8_t status);
  void start_device();
  void connect_queue(unsigned i);
  // Kicks and interrupts of the enabled queues wired, the device started
  // (queue registers and bases are the device's own: a restored state's).
  void resume_device();
  void virtio_reset();
  void rebuild_memory();
  std::unique_ptr<pci::VirtualConfig> make_config();
  void stop_device();
  void remap_running_device();
  void new_doorbells();
  [[nodiscard]] std::string in_unmapped_window(uint64_t iova) const;
  void access(uint32_t region, uint64_t offset, uint8_t* data, size_t size, bool write);

  virtio::Device& device_;
  irq::Engine& engine_;
  std::string name_;
  LogLimit driver_ready_log_;  // a guest resets and starts its driver at will
  unsigned num_queues_;
  std::vector<irq::RouteId> routes_;  // one per MSI-X vector
  msix::RoutedVectors vectors_;
  std::unique_ptr<msix::MsixState> msix_;
  std::unique_ptr<pci::VirtualConfig> config_;
  std::vector<uint8_t> config_bytes_;
  std::vector<UniqueFd> kicks_;  // one doorbell eventfd per queue, new for each client
  std::vector<UniqueFd> sinks_;  // each vector's eventfd (the engine's copy in use), for a handover
  bool frozen_ = false, ran_at_freeze_ = false;
  bool announce_on_resume_ = true;  // not after a handover: the guest has not moved
  // Common configuration (§4.1.4.3).
  uint32_t device_feature_select_ = 0;
  uint32_t driver_feature_select_ = 0;
  uint64_t driver_features_ = 0;
  uint16_t config_msix_vector_ = kNoVector;
  uint8_t status_ = 0;
  uint8_t config_generation_ = 0;
  uint16_t queue_select_ = 0;
  std::vector<QueueRegs> queues_;
  // The PCI configuration access capability's window (§4.1.4.9).
  uint8_t cfg_bar_ = 0;
  uint32_t cfg_offset_ = 0, cfg_length_ = 0;
  // DMA windows, as guest memory for the rings and buffers.
  std::vector<DmaWindow> windows_;
  bool resume_pending_ = false;  // restored as started, waiting for guest memory (or RUNNING)
  // Migration: stopped (STOP, STOP_COPY, RESUMING), and what waits for RUNNING.
  bool quiesced_ = false;
  bool ran_at_stop_ = false;         // the device ran when it stopped
  bool start_pending_ = false;       // DRIVER_OK came while stopped
  bool config_irq_pending_ = false;  // a configuration change came while stopped
  const virtio::DirtyLog* dma_log_ = nullptr;
  void check_queues_agree(const std::vector<QueueRegs>& queues, const virtio::DeviceState& state,
                          virtio::StateReader& r) const;
  void wire_queue_log(unsigned q);
  virtio::GuestMemory memory_;
};

}  // namespace sriovd::vfio_user
