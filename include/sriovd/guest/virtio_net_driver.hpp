#pragma once
// A guest's virtio-net driver in user space, on either transport: what a
// guest kernel's virtio-net driver does over virtio-pci (here over
// vfio-user: capabilities in config space, guest RAM shared with DMA_MAP,
// MSI-X through SET_IRQS, doorbells from GET_REGION_IO_FDS), or what a VMM
// does as a vhost-user front-end (memory table, vring addresses, kick and
// call eventfds, an emulated IOMMU answering IOTLB misses). The driver owns
// guest RAM, the rings and the buffers; a Transport carries the rest. It
// bridges the device to a tap: frames the kernel sends on the tap go out on
// the TX queue, frames the device delivers on the RX queue go into the tap.
// With offloads negotiated, 64 KB TSO segments and partial checksums travel
// end to end.

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/guest/vfio_user_client.hpp"
#include "sriovd/ports/tap.hpp"

namespace sriovd::guest {

class Transport;  // how the device is reached (src/guest/transport.hpp)

struct VirtioNetDriverOptions {
  uint16_t queue_size = 256;
  bool packed = false;         // ask for VIRTIO_F_RING_PACKED (when offered)
  bool offloads = true;        // checksum and TSO both ways (when offered)
  bool control_queue = false;  // negotiate CTRL_VQ, CTRL_RX, CTRL_MAC_ADDR and set the queue up
  // virtio-net-pci: more than one asks for VIRTIO_NET_F_MQ (and the control
  // queue), sets up min(this, the device's max_virtqueue_pairs) pairs and
  // turns them on with VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET. vhost-user: one.
  uint16_t queue_pairs = 1;
  // vhost-user: be a guest behind an IOMMU. VIRTIO_F_ACCESS_PLATFORM is
  // negotiated, rings and buffers are given as IOVAs (a window of their
  // own, not the guest-physical addresses), and the back-end's IOTLB misses
  // are answered with updates of iommu_page bytes, as a vIOMMU does.
  bool iommu = false;
  uint32_t iommu_page = 4096;
  // Be a VMM in the middle of a live migration. vhost-user: give the
  // back-end a dirty log (LOG_SHMFD, SET_LOG_BASE), turn on
  // VHOST_F_LOG_ALL and VHOST_VRING_F_LOG, and take the marked pages every
  // 10 ms as a migration's copy does (atomic exchange), counted.
  // virtio-pci over vfio-user: DMA_LOGGING_START over guest RAM and a
  // DMA_LOGGING_REPORT every 10 ms, counted the same way.
  bool dirty_log = false;
  // virtio-pci: acknowledge each interrupt as RHEL 5's 2.6.18 MSI code does:
  // the vector masked (its MSI-X Vector Control, a REGION_WRITE) before the
  // queue is served and unmasked after - two trapped writes per interrupt.
  bool mask_every_interrupt = false;
  // ...and send those writes posted (No_reply), as QEMU's vfio-user client
  // sends BAR writes: the driver does not wait for the server's answer.
  bool posted_mask_writes = false;
  // virtio-pci: keep the MSI-X table in the VMM, as QEMU does for every
  // VFIO device: no table write reaches the server, vectors are wired with
  // SET_IRQS TRIGGER and MSI-X enabled in config space; a mask is a
  // SET_IRQS MASK/UNMASK.
  bool keeps_msix_table = false;
};

struct VirtioNetDriverStats {
  std::atomic<uint64_t> tx_packets{0}, tx_bytes{0}, rx_packets{0}, rx_bytes{0};
  std::atomic<uint64_t> interrupts{0}, kicks{0}, rx_dropped{0};
  std::atomic<uint64_t> mask_writes{0};  // Vector Control writes (mask_every_interrupt)
  std::atomic<uint64_t> mask_ns{0};      // the time the driver spent on them, in all
  std::atomic<uint64_t> iotlb_misses{0}, iotlb_updates{0}, iotlb_faults{0};  // faults: misses outside the window
  std::atomic<uint64_t> dirty_pages{0};  // --dirty-log: pages the back-end marked, as taken from the log
};

class VirtioNetDriver {
 public:
  // virtio-net-pci over vfio-user (bring_up()).
  VirtioNetDriver(VfioUserClient& client, VirtioNetDriverOptions options);
  // The same driver as a vhost-user front-end (the VMM's side of vhost-user:
  // memory table, vring addresses, kick and call eventfds) on `socket`.
  VirtioNetDriver(std::string vhost_user_socket, VirtioNetDriverOptions options);
  ~VirtioNetDriver();

  // Reset, negotiate, set up the queue pairs, DRIVER_OK (vhost-user: the
  // vrings enabled). Throws with the step that failed.
  void bring_up();
  // Moves frames between the device and `tap` until `stop` is set: pair i
  // with tap queue i when the tap has one per pair, else every pair with
  // the tap's first queue.
  void bridge(ports::Tap& tap, const std::atomic<bool>& stop);
  // One frame (virtio-net header first) out on pair `pair`'s TX queue;
  // false when the ring is full.
  bool send(const uint8_t* frame, size_t size, unsigned pair = 0);
  // Waits up to timeout_ms for one received frame (header first) on any
  // pair; returns its size, 0 on timeout.
  size_t receive(uint8_t* out, size_t size, int timeout_ms);

  // One control command (§5.1.6.5); returns the device's ack (0: OK).
  uint8_t control(uint8_t cls, uint8_t cmd, const std::vector<uint8_t>& data);

  // Live migration as the VMM makes it (virtio-pci over vfio-user): the
  // device is now the one `to` reaches, its state restored from the
  // source's. Guest RAM is shared with it, its vectors wired to the
  // driver's interrupt eventfds, its doorbells taken; the guest itself
  // does nothing else (it does not know it moved).
  void moved_to(VfioUserClient& to);
  // Guest RAM as the VMM sees it (what a migration copies), and where it
  // starts in the addresses the device is given.
  [[nodiscard]] std::span<uint8_t> ram() const { return {ram_, ram_size_}; }
  [[nodiscard]] uint64_t ram_iova() const { return dma_base_; }
  // The parts of guest RAM only the device writes (offsets into ram()):
  // every RX buffer, and each split ring's used ring. What a migration's
  // dirty log alone must bring over - the guest's own writes are its
  // hypervisor's to track.
  struct Area {
    uint64_t offset = 0;
    uint64_t size = 0;
  };
  [[nodiscard]] std::vector<Area> device_only_areas() const;

  [[nodiscard]] uint64_t features() const { return features_; }
  [[nodiscard]] bool packed() const { return packed_; }
  [[nodiscard]] unsigned queue_pairs() const { return static_cast<unsigned>(pairs_.size()); }
  [[nodiscard]] const VirtioNetDriverStats& stats() const { return stats_; }
  [[nodiscard]] std::string mac() const;

 private:
  void timed_mask(unsigned vector, bool masked);
  class Ring;
  // Queue pair p: queues 2p (RX) and 2p + 1 (TX), interrupts the same.
  struct Pair {
    std::unique_ptr<Ring> rx, tx;
    std::vector<uint16_t> tx_free;  // free TX buffer slots
  };
  [[nodiscard]] uint64_t tx_offset(unsigned pair, uint16_t slot) const;
  [[nodiscard]] uint64_t rx_offset(unsigned pair, uint16_t slot) const;
  [[nodiscard]] uint64_t command_page() const;
  // Guest RAM for `pairs` queue pairs and a control queue.
  void map_ram(unsigned pairs);
  void make_pairs(unsigned count);
  void post_rx(unsigned pair);
  void reclaim_tx(Pair& p);
  size_t take_rx(unsigned pair, uint8_t* out, size_t size, ports::Tap* tap, unsigned tap_queue);
  void kick(unsigned q);

  VirtioNetDriverOptions options_;
  VirtioNetDriverStats stats_;
  std::unique_ptr<Transport> transport_;
  uint64_t dma_base_ = 0;  // where guest RAM starts in the addresses the device is given
  uint64_t features_ = 0;
  bool packed_ = false;
  // Guest RAM.
  UniqueFd ram_fd_;
  uint8_t* ram_ = nullptr;
  uint64_t ram_size_ = 0;
  uint64_t ring_bytes_ = 0;  // one ring's room in guest RAM
  unsigned ram_pairs_ = 1;   // pairs guest RAM was laid out for
  std::vector<Pair> pairs_;
  std::unique_ptr<Ring> ctrl_;
  unsigned ctrl_index_ = 2;
  std::vector<UniqueFd> irq_fds_;    // per interrupt: queue q's is q, the control queue's last
  std::vector<UniqueFd> doorbells_;  // per queue, where the transport has them
};

}  // namespace sriovd::guest
