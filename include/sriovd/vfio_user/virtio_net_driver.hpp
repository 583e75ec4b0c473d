#pragma once
// The guest side of virtio-net-pci over vfio-user: what a guest kernel's
// virtio-net driver does, in user space. Finds the virtio capabilities in
// config space, shares guest RAM (a memfd) with DMA_MAP, negotiates
// features, lays out the rings in that RAM, programs MSI-X (one vector per
// queue, eventfds through SET_IRQS), takes one doorbell eventfd per queue
// from GET_REGION_IO_FDS, and then bridges the device to a tap: frames the
// kernel sends on the tap go out on the TX queue, frames the device
// delivers on the RX queue go into the tap. With offloads negotiated,
// 64 KB TSO segments and partial checksums travel end to end.

#include <poll.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/vfio_user/client.hpp"
#include "sriovd/virtio/driver.hpp"
#include "sriovd/virtio/tap.hpp"

namespace sriovd::vfio_user {

struct VirtioNetDriverOptions {
  uint16_t queue_size = 256;
  bool packed = false;    // ask for VIRTIO_F_RING_PACKED (when offered)
  bool offloads = true;   // checksum and TSO both ways (when offered)
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
};

struct VirtioNetDriverStats {
  std::atomic<uint64_t> tx_packets{0}, tx_bytes{0}, rx_packets{0}, rx_bytes{0};
  std::atomic<uint64_t> interrupts{0}, kicks{0}, rx_dropped{0};
  std::atomic<uint64_t> iotlb_misses{0}, iotlb_updates{0}, iotlb_faults{0};  // faults: misses outside the window
};

class VirtioNetDriver {
 public:
  // virtio-net-pci over vfio-user (bring_up()).
  VirtioNetDriver(Client& client, VirtioNetDriverOptions options);
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
  void bridge(virtio::Tap& tap, const std::atomic<bool>& stop);
  // One frame (virtio-net header first) out on pair `pair`'s TX queue;
  // false when the ring is full.
  bool send(const uint8_t* frame, size_t size, unsigned pair = 0);
  // Waits up to timeout_ms for one received frame (header first) on any
  // pair; returns its size, 0 on timeout.
  size_t receive(uint8_t* out, size_t size, int timeout_ms);

  // One control command (§5.1.6.5); returns the device's ack (0: OK).
  uint8_t control(uint8_t cls, uint8_t cmd, const std::vector<uint8_t>& data);

  [[nodiscard]] uint64_t features() const { return features_; }
  [[nodiscard]] bool packed() const { return packed_; }
  [[nodiscard]] unsigned queue_pairs() const { return static_cast<unsigned>(pairs_.size()); }
  [[nodiscard]] const VirtioNetDriverStats& stats() const { return stats_; }
  [[nodiscard]] std::string mac() const;

 private:
  struct Cap {
    uint8_t bar = 0;
    uint32_t offset = 0;
    uint32_t length = 0;
  };
  class Ring;
  void find_caps();
  uint32_t common32(uint32_t off);
  void common_write(uint32_t off, uint64_t value, unsigned size);
  uint8_t status();
  void set_status(uint8_t s);
  // Queue pair p: queues 2p (RX) and 2p + 1 (TX), MSI-X vectors the same.
  struct Pair {
    std::unique_ptr<Ring> rx, tx;
    std::vector<uint16_t> tx_free;  // free TX buffer slots
  };
  [[nodiscard]] uint64_t tx_offset(unsigned pair, uint16_t slot) const;
  [[nodiscard]] uint64_t rx_offset(unsigned pair, uint16_t slot) const;
  [[nodiscard]] uint64_t command_page() const;
  void make_pairs(unsigned count);
  void post_rx(unsigned pair);
  void reclaim_tx(Pair& p);
  size_t take_rx(unsigned pair, uint8_t* out, size_t size, virtio::Tap* tap, unsigned tap_queue);
  void kick(unsigned q);

  void bring_up_pci();
  void bring_up_vhost_user();
  // Guest RAM for `pairs` queue pairs and a control queue.
  void map_ram(unsigned pairs);
  uint64_t vhost_request(uint32_t request, const void* payload, uint32_t size, const std::vector<int>& fds, bool reply,
                         uint32_t flags = 0);
  // The emulated IOMMU: answers the IOTLB misses waiting on the back-end
  // channel. Returns how many it answered.
  unsigned serve_iotlb();
  // Polls `fds` (and the back-end channel, served as it turns readable)
  // for up to timeout_ms; poll()'s result for `fds`.
  int wait(pollfd* fds, nfds_t count, int timeout_ms);

  Client* client_ = nullptr;
  std::string vhost_socket_;
  UniqueFd vhost_;  // the vhost-user connection
  UniqueFd backend_channel_;  // our end of SET_BACKEND_REQ_FD (IOTLB misses)
  uint64_t dma_base_ = 0;     // where guest RAM starts in the addresses the device is given
  VirtioNetDriverOptions options_;
  Cap common_, notify_, device_;
  uint32_t notify_multiplier_ = 0;
  uint64_t features_ = 0;
  bool packed_ = false;
  size_t hdr_len_ = 12;
  // Guest RAM.
  UniqueFd ram_fd_;
  uint8_t* ram_ = nullptr;
  uint64_t ram_size_ = 0;
  uint64_t ring_bytes_ = 0;  // one ring's room in guest RAM
  unsigned ram_pairs_ = 1;    // pairs guest RAM was laid out for
  std::vector<Pair> pairs_;
  std::unique_ptr<Ring> ctrl_;
  unsigned ctrl_index_ = 2;
  std::vector<UniqueFd> irq_fds_;   // MSI-X vector eventfds: queue q's is q, the control queue's last
  std::vector<UniqueFd> doorbells_;  // per queue, from GET_REGION_IO_FDS
  VirtioNetDriverStats stats_;
};

}  // namespace sriovd::vfio_user
