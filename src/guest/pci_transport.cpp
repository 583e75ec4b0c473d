// virtio-pci (virtio 1.2 §4.1) over vfio-user, as a guest kernel drives it:
// the capabilities in config space, the common configuration in a BAR,
// guest RAM shared with DMA_MAP, one MSI-X vector per queue (eventfds
// through SET_IRQS), one doorbell eventfd per queue from GET_REGION_IO_FDS
// (REGION_WRITEs to the notify area without them).

#include <linux/vfio.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "sriovd/guest/vfio_user_client.hpp"
#include "sriovd/pci/config_space.hpp"
#include "sriovd/util/error.hpp"
#include "sriovd/virtio/net.hpp"
#include "transport.hpp"

namespace sriovd::guest {

namespace {

constexpr uint32_t kConfigRegion = VFIO_PCI_CONFIG_REGION_INDEX;
constexpr uint32_t kMsixIrq = VFIO_PCI_MSIX_IRQ_INDEX;
constexpr uint64_t kRamBase = 0x100000;  // guest physical address of the shared RAM
constexpr uint8_t kAcknowledge = 1, kDriver = 2, kDriverOk = 4, kFeaturesOk = 8;

// Common configuration (§4.1.4.3) offsets.
constexpr uint32_t kDeviceFeatureSelect = 0x00, kDeviceFeature = 0x04, kDriverFeatureSelect = 0x08,
                   kDriverFeature = 0x0c, kNumQueues = 0x10, kDeviceStatus = 0x14, kQueueSelect = 0x16,
                   kQueueSize = 0x18, kQueueMsixVector = 0x1a, kQueueEnable = 0x1c, kQueueDesc = 0x20,
                   kQueueDriver = 0x28, kQueueDevice = 0x30;

class PciTransport final : public Transport {
 public:
  PciTransport(VfioUserClient& client, const VirtioNetDriverOptions& options, VirtioNetDriverStats& stats)
      : c_(&client), options_(options), stats_(stats) {}
  ~PciTransport() override {
    stop_log_reader();
    try {
      if (found_) set_status(0);  // the device stops using guest RAM before it goes
    } catch (...) {
    }
  }

  uint64_t negotiate(uint64_t want) override {
    find_caps();
    // §3.1.1: reset, ACKNOWLEDGE, DRIVER, features, FEATURES_OK.
    set_status(0);
    set_status(kAcknowledge | kDriver);
    common_write(kDeviceFeatureSelect, 0, 4);
    uint64_t offered = common32(kDeviceFeature);
    common_write(kDeviceFeatureSelect, 1, 4);
    offered |= static_cast<uint64_t>(common32(kDeviceFeature)) << 32U;
    want |= virtio::kNetMac | virtio::kNetMtu | virtio::kNetStatus;
    if (options_.control_queue)
      want |= virtio::kNetCtrlVq | virtio::kNetCtrlRx | virtio::kNetCtrlMacAddr | virtio::kNetGuestAnnounce;
    if (options_.queue_pairs > 1) want |= virtio::kNetCtrlVq | virtio::kNetMq;
    const uint64_t features = offered & want;
    if (options_.queue_pairs > 1 && !(features & virtio::kNetMq))
      throw std::runtime_error("the device does not offer VIRTIO_NET_F_MQ (" + std::to_string(options_.queue_pairs) +
                               " queue pairs asked for)");
    common_write(kDriverFeatureSelect, 0, 4);
    common_write(kDriverFeature, features & 0xffffffffU, 4);
    common_write(kDriverFeatureSelect, 1, 4);
    common_write(kDriverFeature, features >> 32U, 4);
    set_status(kAcknowledge | kDriver | kFeaturesOk);
    if (!(status() & kFeaturesOk))
      throw std::runtime_error("the device refused the features (FEATURES_OK did not stick)");
    return features;
  }

  // As many as asked for and the device has (max_virtqueue_pairs, device
  // configuration offset 8, with MQ).
  unsigned queue_pairs(uint64_t features, unsigned asked) override {
    if (!(features & virtio::kNetMq)) return 1;
    uint16_t max_pairs = 0;
    c_->read(device_.bar, device_.offset + 8, {reinterpret_cast<uint8_t*>(&max_pairs), 2});
    return std::clamp<unsigned>(asked, 1, std::max<uint16_t>(max_pairs, 1));
  }

  // The control queue is the last one, after every data queue pair.
  unsigned control_queue(unsigned /*pairs*/) override { return (common32(kNumQueues) >> 16U) - 1; }

  uint64_t share(const GuestRam& ram) override {
    c_->dma_map(kRamBase, ram.size, ram.fd, 0);
    ram_size_ = ram.size;
    return kRamBase;
  }

  Started start(std::span<const QueueSetup> queues) override {
    Started s;
    program_msix(queues.size(), s.interrupts);
    for (const QueueSetup& q : queues) {
      common_write(kQueueSelect, q.index, 2);
      common_write(kQueueSize, q.size, 2);
      common_write(kQueueMsixVector, q.vector, 2);
      uint16_t vector = 0;
      c_->read(common_.bar, common_.offset + kQueueMsixVector, {reinterpret_cast<uint8_t*>(&vector), 2});
      if (vector != q.vector)
        throw std::runtime_error("queue " + std::to_string(q.index) + " refused MSI-X vector " +
                                 std::to_string(q.vector));
      common_write(kQueueDesc, q.rings.desc, 8);
      common_write(kQueueDriver, q.rings.driver, 8);
      common_write(kQueueDevice, q.rings.device, 8);
      common_write(kQueueEnable, 1, 2);
    }
    s.doorbells = doorbells();
    set_status(kAcknowledge | kDriver | kFeaturesOk | kDriverOk);
    if (!(status() & kDriverOk)) throw std::runtime_error("the device did not take DRIVER_OK");
    if (options_.dirty_log) start_log_reader();
    return s;
  }

  void notify(unsigned q) override {
    c_->write(notify_.bar, notify_.offset + q * notify_multiplier_, {reinterpret_cast<const uint8_t*>(&q), 2});
  }

  void mask_vector(unsigned v, bool masked) override {
    if (options_.keeps_msix_table) {
      c_->mask(kMsixIrq, v, masked);
      return;
    }
    const uint32_t control = masked ? 1U : 0U;
    const uint64_t at = msix_table_ + 16 * v + 12;
    if (options_.posted_mask_writes)
      c_->post_write(msix_bir_, at, {reinterpret_cast<const uint8_t*>(&control), sizeof control});
    else
      c_->write32(msix_bir_, at, control);
  }

  std::vector<UniqueFd> moved_to(VfioUserClient& to, const GuestRam& ram,
                                 std::span<const UniqueFd> interrupts) override {
    stop_log_reader();  // the source's log ended with the source
    c_ = &to;
    c_->dma_map(kRamBase, ram.size, ram.fd, 0);
    std::vector<int> fds;
    for (const UniqueFd& fd : interrupts) fds.push_back(fd.get());
    c_->set_irq_eventfds(kMsixIrq, 0, fds);
    return doorbells();
  }

  std::string mac() override {
    uint8_t m[6];
    c_->read(device_.bar, device_.offset, {m, 6});
    char out[18];
    std::snprintf(out, sizeof out, "%02x:%02x:%02x:%02x:%02x:%02x", m[0], m[1], m[2], m[3], m[4], m[5]);
    return out;
  }

 private:
  struct Cap {
    uint8_t bar = 0;
    uint32_t offset = 0;
    uint32_t length = 0;
  };

  // The first common, notify and device configuration capabilities (§4.1.4).
  void find_caps() {
    std::vector<uint8_t> cfg(256);
    c_->read(kConfigRegion, 0, cfg);
    const uint16_t vendor = pci::get16(cfg, 0);
    if (vendor != 0x1af4) throw std::runtime_error("not a virtio device (vendor " + std::to_string(vendor) + ")");
    bool have_common = false, have_notify = false, have_device = false;
    for (const auto& cap : pci::capabilities(cfg)) {
      if (cap.id != 0x09 || cap.offset + 16U > cfg.size()) continue;
      const Cap c{cfg[cap.offset + 4U], pci::get32(cfg, cap.offset + 8U), pci::get32(cfg, cap.offset + 12U)};
      switch (cfg[cap.offset + 3U]) {
        case 1:
          if (!have_common) common_ = c;
          have_common = true;
          break;
        case 2:
          if (cap.offset + 20U > cfg.size()) break;  // no room for notify_off_multiplier
          if (!have_notify) {
            notify_ = c;
            notify_multiplier_ = pci::get32(cfg, cap.offset + 16U);
          }
          have_notify = true;
          break;
        case 4:
          if (!have_device) device_ = c;
          have_device = true;
          break;
        default: break;
      }
    }
    if (!have_common || !have_notify || !have_device)
      throw std::runtime_error("the device lacks the common, notify or device configuration capability");
    found_ = true;
  }

  // Vector v: an eventfd, address and data programmed, then MSI-X enabled
  // and every vector unmasked.
  void program_msix(size_t nvec, std::vector<UniqueFd>& interrupts) {
    std::vector<uint8_t> cfg(256);
    c_->read(kConfigRegion, 0, cfg);
    const auto msix = pci::find_msix(cfg);
    if (!msix || msix->vectors < nvec) throw std::runtime_error("the device has too few MSI-X vectors");
    msix_bir_ = msix->table_bir;
    msix_table_ = msix->table_offset;
    std::vector<int> fds(nvec);
    for (unsigned v = 0; v < nvec; ++v) {
      interrupts.emplace_back(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
      if (!interrupts.back()) throw_errno("interrupt eventfd");
      fds[v] = interrupts.back().get();
      if (options_.keeps_msix_table) continue;  // the table is the VMM's (QEMU)
      c_->write32(msix->table_bir, msix->table_offset + 16 * v, 0xfee00000);
      c_->write32(msix->table_bir, msix->table_offset + 16 * v + 8, 0x30 + v);
    }
    c_->set_irq_eventfds(kMsixIrq, 0, fds);
    const uint32_t dw0 = c_->read32(kConfigRegion, msix->cap_offset);
    c_->write32(kConfigRegion, msix->cap_offset, (dw0 & 0x3fffffffU) | 0x80000000U);
    if (options_.keeps_msix_table) return;
    for (unsigned v = 0; v < nvec; ++v) c_->write32(msix->table_bir, msix->table_offset + 16 * v + 12, 0);
  }

  // One eventfd per queue where the server has them; none (REGION_WRITE
  // notifications) where it does not.
  std::vector<UniqueFd> doorbells() {
    std::vector<UniqueFd> out;
    try {
      auto io = c_->region_io_fds(notify_.bar);
      for (const auto& e : io.entries) {
        const uint64_t q = (e.offset - notify_.offset) / std::max<uint32_t>(notify_multiplier_, 1);
        if (e.fd_index >= io.fds.size() || q > 0xffff) continue;
        if (q >= out.size()) out.resize(q + 1);
        out[q] = UniqueFd(::dup(io.fds[e.fd_index].get()));
      }
    } catch (const vfio_user::Error&) {
      out.clear();
    }
    return out;
  }

  uint32_t common32(uint32_t off) { return c_->read32(common_.bar, common_.offset + off); }
  void common_write(uint32_t off, uint64_t value, unsigned size) {
    c_->write(common_.bar, common_.offset + off, {reinterpret_cast<const uint8_t*>(&value), size});
  }
  uint8_t status() {
    uint8_t s = 0;
    c_->read(common_.bar, common_.offset + kDeviceStatus, {&s, 1});
    return s;
  }
  void set_status(uint8_t s) { common_write(kDeviceStatus, s, 1); }

  // --dirty-log: the device's DMA log over guest RAM (DMA_LOGGING_START),
  // and a thread that takes the report every 10 ms as a migration's copy
  // does (the client serialises its requests).
  void start_log_reader() {
    const vfio_user::DmaRange ram{kRamBase, ram_size_};
    c_->dma_logging_start(4096, {&ram, 1});
    log_reader_ = std::thread([this] {
      while (!log_stop_.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        try {
          uint64_t pages = 0;
          for (const uint64_t w : c_->dma_logging_report(kRamBase, ram_size_, 4096))
            pages += static_cast<uint64_t>(__builtin_popcountll(w));
          stats_.dirty_pages.fetch_add(pages, std::memory_order_relaxed);
        } catch (const std::exception&) {
          return;  // the connection ended (the device went with it)
        }
      }
    });
  }
  void stop_log_reader() {
    log_stop_.store(true);
    if (log_reader_.joinable()) log_reader_.join();
  }

  VfioUserClient* c_;  // another one once the guest migrated (moved_to)
  VirtioNetDriverOptions options_;
  VirtioNetDriverStats& stats_;
  uint64_t ram_size_ = 0;
  std::thread log_reader_;
  std::atomic<bool> log_stop_{false};
  bool found_ = false;
  Cap common_, notify_, device_;
  uint32_t notify_multiplier_ = 0;
  uint8_t msix_bir_ = 0;  // where the MSI-X table is (program_msix)
  uint32_t msix_table_ = 0;
};

}  // namespace

std::unique_ptr<Transport> make_pci_transport(VfioUserClient& client, const VirtioNetDriverOptions& options,
                                              VirtioNetDriverStats& stats) {
  return std::make_unique<PciTransport>(client, options, stats);
}

}  // namespace sriovd::guest
