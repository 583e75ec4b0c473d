#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/virtio/port.hpp"

namespace sriovd::ports {

// How a PacketSocket moves frames: memory-mapped rings shared with the
// kernel (no system call per received frame; transmitted frames queued in
// the TX ring and handed over with one send() per batch), or one
// readv/writev per frame.
//   v3: TPACKET_V3 - received frames packed into blocks; the kernel hands
//       a block over when it is full or after the block timeout (1 ms, up to
//       one timer tick: a frame on a quiet link can wait that long).
//   v2: TPACKET_V2 - one slot per frame, each handed over at once.
enum class PacketRing : uint8_t { v3, v2, off };
const char* to_string(PacketRing);

// A netdev (a VF's, for the VF-to-virtio bridge) through an AF_PACKET
// socket with PACKET_VNET_HDR. The kernel's header there is the 10-byte
// struct virtio_net_hdr; the device's is the 12-byte v1 header, so the two
// bytes of num_buffers are dropped on the way out and left for the device
// to fill on the way in.
class PacketSocket : public virtio::PacketPort {
 public:
  // `queues` sockets; with more than one they form a PACKET_FANOUT_HASH
  // group, so the kernel spreads received flows over the queue pairs.
  // `mtu` sizes the ring slots; larger frames (TSO, GRO) take the way
  // around the rings, in their turn.
  explicit PacketSocket(const std::string& ifname, unsigned queues = 1, PacketRing ring = PacketRing::v2,
                        unsigned mtu = 1500);
  ~PacketSocket() override;
  PacketSocket(const PacketSocket&) = delete;
  PacketSocket& operator=(const PacketSocket&) = delete;

  [[nodiscard]] const std::string& name() const override { return name_; }
  [[nodiscard]] unsigned queues() const override { return static_cast<unsigned>(queues_.size()); }
  [[nodiscard]] int fd(unsigned q) const override { return queues_.at(q).fd.get(); }
  [[nodiscard]] int room_fd(unsigned q) const override {
    return queues_.at(q).side ? queues_.at(q).side.get() : queues_.at(q).fd.get();
  }
  ssize_t send(unsigned q, const iovec* iov, int count) override;
  void flush(unsigned q) override;
  ssize_t recv(unsigned q, uint8_t* buf, size_t size) override;
  void set_offloads(unsigned) override {}
  // The netdev's IFF_RUNNING (carrier and up): a VF whose link goes down.
  [[nodiscard]] bool link_up() const override;
  int take_error(unsigned q) override;
  // Frames dropped because the netdev was down when they were flushed.
  [[nodiscard]] uint64_t dropped_down() const { return dropped_down_; }
  [[nodiscard]] PacketRing ring() const { return ring_; }

 private:
  struct Queue {
    UniqueFd fd;
    // With rings: the transmit-only socket (it receives nothing, and is
    // waited on only when full) of the TX ring. Frames larger than a TX
    // slot - TSO segments - go through `fd` after the ring is flushed.
    UniqueFd side;
    size_t rx_len = 0, tx_len = 0;  // the two mappings
    // RX: v3 blocks, or v2 frame slots.
    uint8_t* rx = nullptr;
    uint32_t rx_unit = 0;   // block (v3) or frame (v2) size
    uint32_t rx_count = 0;  // blocks or frames
    uint32_t rx_next = 0;
    // v3: the block being read.
    uint8_t* pkt = nullptr;
    uint32_t pkts_left = 0;
    // TX frame slots.
    uint8_t* tx = nullptr;
    uint32_t tx_frame = 0;
    uint32_t tx_count = 0;
    uint32_t tx_next = 0;
    // The slot the kernel sends next: it walks the ring from there while
    // slots are SEND_REQUEST. [tx_head, tx_next) is handed over, not sent.
    uint32_t tx_head = 0;
    bool tx_pending = false;
  };
  // The handed-over slots back to AVAILABLE (their frames dropped), when
  // the kernel refused the whole send (netdev down or gone).
  void drop_pending(Queue& q);
  void setup_rings(Queue& q, unsigned mtu);
  ssize_t recv_v3(Queue& q, uint8_t* buf, size_t size);
  ssize_t recv_v2(Queue& q, uint8_t* buf, size_t size);
  ssize_t read_whole(Queue& q, uint8_t* buf, size_t size);
  ssize_t send_ring(Queue& q, const iovec* iov, int count);
  static ssize_t send_plain(int fd, const iovec* iov, int count);

  std::string name_;
  PacketRing ring_;
  std::vector<Queue> queues_;
  uint64_t dropped_down_ = 0;  // worker thread only
};

}  // namespace sriovd::ports
