#include "sriovd/ports/packet_socket.hpp"

#include <arpa/inet.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "sriovd/ports/netdev.hpp"
#include "sriovd/util/error.hpp"
#include "sriovd/virtio/offload.hpp"

namespace sriovd::ports {

namespace {
constexpr size_t kKernelHeader = 10;  // struct virtio_net_hdr
constexpr size_t kDeviceHeader = 12;  // struct virtio_net_hdr_v1
constexpr int kMaxIov = 66;
// Ring geometry: 4 MiB of receive ring and 512 transmit slots per queue.
// A v3 block holds any frame (a 64 KB GSO packet too); a v2 slot holds an
// MTU-sized frame, and a larger one (GRO, a local TSO sender) waits whole
// on the socket's queue (PACKET_COPY_THRESH), read in its turn.
constexpr uint32_t kBlock = 1U << 16U;
constexpr uint32_t kV3Block = 1U << 18U;
constexpr uint32_t kRxBytes = 4U << 20U;
constexpr uint32_t kTxSlots = 512;
constexpr unsigned kRetireMs = 1;  // v3 block timeout

uint32_t status_of(const uint32_t& s) { return std::atomic_ref<const uint32_t>(s).load(std::memory_order_acquire); }
void give_back(uint32_t& s, uint32_t v) { std::atomic_ref<uint32_t>(s).store(v, std::memory_order_release); }

// The smallest power of two >= n (n > 0).
uint32_t pow2_at_least(uint32_t n) {
  uint32_t p = 1;
  while (p < n) p <<= 1U;
  return p;
}
}  // namespace

const char* to_string(PacketRing r) {
  switch (r) {
    case PacketRing::v3: return "v3";
    case PacketRing::v2: return "v2";
    case PacketRing::off: return "off";
  }
  return "?";
}

PacketSocket::PacketSocket(const std::string& ifname, unsigned queues, PacketRing ring, unsigned mtu)
    : name_(ifname), ring_(ring) {
  if (queues == 0) throw std::invalid_argument("AF_PACKET port for " + ifname + " with no queue");
  const unsigned index = ::if_nametoindex(ifname.c_str());
  if (index == 0) throw_errno("netdev " + ifname);
  // One fanout group per port: the id only has to be unique among groups.
  const int group = static_cast<int>((static_cast<unsigned>(::getpid()) ^ (index << 8U)) & 0xffffU);
  queues_.resize(queues);
  for (unsigned qi = 0; qi < queues; ++qi) {
    Queue& q = queues_[qi];
    q.fd.reset(::socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK | SOCK_CLOEXEC, htons(ETH_P_ALL)));
    if (!q.fd) throw_errno("AF_PACKET socket for " + ifname);
    const int fd = q.fd.get();
    int one = 1;
    if (::setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) != 0)
      throw_errno("PACKET_VNET_HDR on " + ifname);
    (void)::setsockopt(fd, SOL_PACKET, PACKET_QDISC_BYPASS, &one, sizeof one);
    // What the host itself (or another queue) transmits on the VF goes to
    // the wire, not back to the guest.
    if (::setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one) != 0)
      throw_errno("PACKET_IGNORE_OUTGOING on " + ifname);
    // The socket's own queue holds as much as a ring (without rings every
    // frame, with them the ones larger than a slot); CAP_NET_ADMIN may
    // exceed rmem_max, without it the kernel's limit stands.
    const int queue_bytes = static_cast<int>(kRxBytes);
    if (::setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &queue_bytes, sizeof queue_bytes) != 0)
      (void)::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &queue_bytes, sizeof queue_bytes);
    if (ring_ != PacketRing::off) {
      // Transmit through a socket of its own (protocol 0: bound to the
      // netdev, it receives nothing), which nobody waits on unless it is
      // full: each sent frame's skb, freed, wakes the waiters of the socket
      // that sent it, and the receiving socket has the worker's epoll.
      q.side.reset(::socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      if (!q.side) throw_errno("AF_PACKET transmit socket for " + ifname);
      if (::setsockopt(q.side.get(), SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) != 0)
        throw_errno("PACKET_VNET_HDR on the transmit socket of " + ifname);
      (void)::setsockopt(q.side.get(), SOL_PACKET, PACKET_QDISC_BYPASS, &one, sizeof one);
      setup_rings(q, mtu);
      sockaddr_ll side{};
      side.sll_family = AF_PACKET;
      side.sll_ifindex = static_cast<int>(index);
      if (::bind(q.side.get(), reinterpret_cast<sockaddr*>(&side), sizeof side) != 0)
        throw_errno("binding the transmit socket to " + ifname);
    }
    sockaddr_ll addr{};
    addr.sll_family = AF_PACKET;
    addr.sll_protocol = htons(ETH_P_ALL);
    addr.sll_ifindex = static_cast<int>(index);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) throw_errno("binding AF_PACKET to " + ifname);
    if (queues > 1) {
      const int fanout = group | ((PACKET_FANOUT_HASH | PACKET_FANOUT_FLAG_DEFRAG) << 16);
      if (::setsockopt(fd, SOL_PACKET, PACKET_FANOUT, &fanout, sizeof fanout) != 0)
        throw_errno("PACKET_FANOUT for queue " + std::to_string(qi) + " of " + ifname);
    }
  }
}

PacketSocket::~PacketSocket() {
  for (Queue& q : queues_) {
    if (q.rx) ::munmap(q.rx, q.rx_len);
    if (q.tx) ::munmap(q.tx, q.tx_len);
  }
}

// The RX ring on the receiving socket, the TX ring on the transmitting
// one, each mapped.
void PacketSocket::setup_rings(Queue& q, unsigned mtu) {
  const int version = ring_ == PacketRing::v3 ? TPACKET_V3 : TPACKET_V2;
  for (const int fd : {q.fd.get(), q.side.get()})
    if (::setsockopt(fd, SOL_PACKET, PACKET_VERSION, &version, sizeof version) != 0)
      throw_errno("PACKET_VERSION " + std::string(to_string(ring_)) + " on " + name_);
  int one = 1;
  // A malformed frame in the TX ring is skipped, not a stop of the ring.
  (void)::setsockopt(q.side.get(), SOL_PACKET, PACKET_LOSS, &one, sizeof one);
  if (ring_ == PacketRing::v2 && ::setsockopt(q.fd.get(), SOL_PACKET, PACKET_COPY_THRESH, &one, sizeof one) != 0)
    throw_errno("PACKET_COPY_THRESH on " + name_);
  const uint32_t hdr = ring_ == PacketRing::v3 ? TPACKET3_HDRLEN : TPACKET2_HDRLEN;
  // A slot holds the ring header, the kernel's alignment slack, the
  // virtio-net header and a VLAN-tagged frame of the MTU.
  const uint32_t slot = std::max<uint32_t>(2048, pow2_at_least(hdr + 16 + kKernelHeader + 18 + mtu));
  const uint32_t block = std::max(kBlock, slot);
  tpacket_req3 rx{};
  rx.tp_block_size = ring_ == PacketRing::v3 ? kV3Block : block;
  rx.tp_block_nr = std::max<uint32_t>(4, kRxBytes / block);
  rx.tp_frame_size = slot;
  rx.tp_frame_nr = rx.tp_block_size / slot * rx.tp_block_nr;
  if (ring_ == PacketRing::v3) rx.tp_retire_blk_tov = kRetireMs;
  tpacket_req3 tx{};
  tx.tp_block_size = block;
  tx.tp_block_nr = std::max<uint32_t>(1, kTxSlots * slot / block);
  tx.tp_frame_size = slot;
  tx.tp_frame_nr = tx.tp_block_size / slot * tx.tp_block_nr;
  const socklen_t len = ring_ == PacketRing::v3 ? sizeof(tpacket_req3) : sizeof(tpacket_req);
  if (::setsockopt(q.fd.get(), SOL_PACKET, PACKET_RX_RING, &rx, len) != 0) throw_errno("PACKET_RX_RING on " + name_);
  if (::setsockopt(q.side.get(), SOL_PACKET, PACKET_TX_RING, &tx, len) != 0) throw_errno("PACKET_TX_RING on " + name_);
  q.rx_len = static_cast<size_t>(rx.tp_block_size) * rx.tp_block_nr;
  q.tx_len = static_cast<size_t>(tx.tp_block_size) * tx.tp_block_nr;
  void* p = ::mmap(nullptr, q.rx_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, q.fd.get(), 0);
  if (p == MAP_FAILED) throw_errno("mapping the AF_PACKET RX ring of " + name_);
  q.rx = static_cast<uint8_t*>(p);
  p = ::mmap(nullptr, q.tx_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, q.side.get(), 0);
  if (p == MAP_FAILED) throw_errno("mapping the AF_PACKET TX ring of " + name_);
  q.tx = static_cast<uint8_t*>(p);
  q.rx_unit = ring_ == PacketRing::v3 ? rx.tp_block_size : rx.tp_frame_size;
  q.rx_count = ring_ == PacketRing::v3 ? rx.tp_block_nr : rx.tp_frame_nr;
  q.tx_frame = tx.tp_frame_size;
  q.tx_count = tx.tp_frame_nr;
}

ssize_t PacketSocket::send(unsigned qi, const iovec* iov, int count) {
  Queue& q = queues_[qi];
  if (!q.tx) return send_plain(q.fd.get(), iov, count);
  const ssize_t n = send_ring(q, iov, count);
  if (n >= 0 || errno != EMSGSIZE) return n;
  // Too large for a slot (a TSO segment): after what the ring holds, so
  // the order stays, through the receiving socket (the transmitting one
  // sends only from its ring).
  flush(qi);
  return send_plain(q.fd.get(), iov, count);
}

// One writev: the first 10 of the guest's 12 header bytes, then
// everything after the 12.
ssize_t PacketSocket::send_plain(int fd, const iovec* iov, int count) {
  uint8_t header[kDeviceHeader];
  iovec out[kMaxIov];
  int n = 1;
  size_t skip = kDeviceHeader, copied = 0;
  for (int i = 0; i < count && n < kMaxIov; ++i) {
    const auto* base = static_cast<const uint8_t*>(iov[i].iov_base);
    size_t len = iov[i].iov_len;
    if (skip > 0) {
      const size_t take = std::min(skip, len);
      std::memcpy(header + copied, base, take);
      copied += take;
      skip -= take;
      base += take;
      len -= take;
    }
    if (len > 0) out[n++] = {const_cast<uint8_t*>(base), len};
  }
  if (copied < kDeviceHeader) return -1;
  out[0] = {header, kKernelHeader};
  const ssize_t sent = ::writev(fd, out, n);
  return sent < static_cast<ssize_t>(kKernelHeader) ? -1 : sent - static_cast<ssize_t>(kKernelHeader);
}

// Into the next TX slot: ring header, the kernel's virtio-net header, the
// frame; handed to the kernel (SEND_REQUEST) for the next flush.
ssize_t PacketSocket::send_ring(Queue& q, const iovec* iov, int count) {
  uint8_t* slot = q.tx + static_cast<size_t>(q.tx_next) * q.tx_frame;
  const bool v3 = ring_ == PacketRing::v3;
  uint32_t& status =
      v3 ? reinterpret_cast<tpacket3_hdr*>(slot)->tp_status : reinterpret_cast<tpacket2_hdr*>(slot)->tp_status;
  if (status_of(status) != TP_STATUS_AVAILABLE) {
    flush(static_cast<unsigned>(&q - queues_.data()));
    if (status_of(status) != TP_STATUS_AVAILABLE) {
      errno = EAGAIN;
      return -1;
    }
  }
  const size_t data_off = (v3 ? TPACKET3_HDRLEN : TPACKET2_HDRLEN) - sizeof(sockaddr_ll);
  uint8_t* out = slot + data_off;
  const size_t room = q.tx_frame - data_off;
  size_t skip = kDeviceHeader - kKernelHeader;  // num_buffers: not the kernel's
  size_t at = 0, header = 0;
  for (int i = 0; i < count; ++i) {
    const auto* src = static_cast<const uint8_t*>(iov[i].iov_base);
    size_t len = iov[i].iov_len;
    while (len > 0) {
      if (header < kKernelHeader) {  // the first 10 bytes go as they are
        const size_t take = std::min(len, kKernelHeader - header);
        std::memcpy(out + at, src, take);
        at += take;
        header += take;
        src += take;
        len -= take;
        continue;
      }
      if (skip > 0) {
        const size_t take = std::min(len, skip);
        skip -= take;
        src += take;
        len -= take;
        continue;
      }
      if (at + len > room) {
        errno = EMSGSIZE;
        return -1;
      }
      std::memcpy(out + at, src, len);
      at += len;
      len = 0;
    }
  }
  if (header < kKernelHeader || skip > 0) {
    errno = EINVAL;
    return -1;
  }
  // A frame without GSO goes whole into the skb's head: the kernel copies
  // hdr_len bytes (at least the Ethernet header) there and attaches the
  // rest as a fragment of the ring's page, which veth - and any path that
  // may not keep user pages - copies again into a new page per frame
  // (skb_copy_ubufs: a page allocated and freed per 64-byte frame).
  // hdr_len is a hint the kernel checks against the frame (<= its length).
  if (out[1] == virtio::kGsoNone) {
    const auto frame = static_cast<uint16_t>(at - kKernelHeader);
    out[2] = static_cast<uint8_t>(frame & 0xffU);
    out[3] = static_cast<uint8_t>(frame >> 8U);
  }
  if (v3)
    reinterpret_cast<tpacket3_hdr*>(slot)->tp_len = static_cast<uint32_t>(at);
  else
    reinterpret_cast<tpacket2_hdr*>(slot)->tp_len = static_cast<uint32_t>(at);
  give_back(status, TP_STATUS_SEND_REQUEST);
  if (++q.tx_next == q.tx_count) q.tx_next = 0;
  q.tx_pending = true;
  return static_cast<ssize_t>(at - kKernelHeader);
}

void PacketSocket::flush(unsigned qi) {
  Queue& q = queues_[qi];
  if (!q.tx_pending) return;
  q.tx_pending = false;
  // Sends every SEND_REQUEST slot from the kernel's position on; frames
  // the kernel refuses one by one are skipped (PACKET_LOSS) and their slots
  // come back. A netdev that is down (or gone) refuses the whole send
  // before any slot: those frames are dropped here, as a NIC without link
  // drops them - kept, they would fill the ring, and a full ring whose
  // sends always fail stops the queue for good.
  if (::send(q.side.get(), nullptr, 0, MSG_DONTWAIT) < 0 && (errno == ENETDOWN || errno == ENXIO || errno == ENODEV)) {
    drop_pending(q);
    return;
  }
  const bool v3 = ring_ == PacketRing::v3;
  while (q.tx_head != q.tx_next) {
    uint8_t* slot = q.tx + static_cast<size_t>(q.tx_head) * q.tx_frame;
    const uint32_t& status =
        v3 ? reinterpret_cast<tpacket3_hdr*>(slot)->tp_status : reinterpret_cast<tpacket2_hdr*>(slot)->tp_status;
    if (status_of(status) == TP_STATUS_SEND_REQUEST) {
      q.tx_pending = true;  // the queue was busy: asked again at the next flush
      break;
    }
    if (++q.tx_head == q.tx_count) q.tx_head = 0;
  }
}

void PacketSocket::drop_pending(Queue& q) {
  const bool v3 = ring_ == PacketRing::v3;
  while (q.tx_next != q.tx_head) {
    q.tx_next = q.tx_next == 0 ? q.tx_count - 1 : q.tx_next - 1;
    uint8_t* slot = q.tx + static_cast<size_t>(q.tx_next) * q.tx_frame;
    uint32_t& status =
        v3 ? reinterpret_cast<tpacket3_hdr*>(slot)->tp_status : reinterpret_cast<tpacket2_hdr*>(slot)->tp_status;
    give_back(status, TP_STATUS_AVAILABLE);
    ++dropped_down_;
  }
}

int PacketSocket::take_error(unsigned qi) {
  Queue& q = queues_[qi];
  int first = 0;
  for (int fd : {q.fd.get(), q.side.get()}) {
    if (fd < 0) continue;
    int err = 0;
    socklen_t len = sizeof err;
    if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err != 0 && first == 0) first = err;
  }
  return first;
}

ssize_t PacketSocket::recv(unsigned qi, uint8_t* buf, size_t size) {
  Queue& q = queues_[qi];
  if (size <= kDeviceHeader) return -1;
  if (ring_ == PacketRing::v3) return recv_v3(q, buf, size);
  if (ring_ == PacketRing::v2) return recv_v2(q, buf, size);
  return read_whole(q, buf, size);
}

// One frame from the socket's queue (no ring, or one too large for a
// slot): the kernel's 10-byte header, then the frame after the device's 12.
ssize_t PacketSocket::read_whole(Queue& q, uint8_t* buf, size_t size) {
  iovec in[2] = {{buf, kKernelHeader}, {buf + kDeviceHeader, size - kDeviceHeader}};
  msghdr msg{};
  msg.msg_iov = in;
  msg.msg_iovlen = 2;
  const ssize_t n = ::recvmsg(q.fd.get(), &msg, MSG_DONTWAIT);
  if (n <= static_cast<ssize_t>(kKernelHeader) || (msg.msg_flags & MSG_TRUNC)) return -1;
  std::memset(buf + kKernelHeader, 0, kDeviceHeader - kKernelHeader);  // num_buffers: the device's
  return n + static_cast<ssize_t>(kDeviceHeader - kKernelHeader);
}

namespace {
// A received frame at `frame` (the kernel's virtio-net header just before
// it) into buf as the device's header and the frame; -1: it did not fit
// the ring slot or buf, and is dropped.
ssize_t take_frame(const uint8_t* frame, uint32_t snaplen, uint32_t len, uint8_t* buf, size_t size) {
  if (snaplen < len || kDeviceHeader + snaplen > size) return -1;
  std::memcpy(buf, frame - kKernelHeader, kKernelHeader);
  std::memset(buf + kKernelHeader, 0, kDeviceHeader - kKernelHeader);
  std::memcpy(buf + kDeviceHeader, frame, snaplen);
  return static_cast<ssize_t>(kDeviceHeader + snaplen);
}
}  // namespace

// TPACKET_V3: blocks the kernel fills with frames and hands over whole;
// each goes back once its last frame is read.
ssize_t PacketSocket::recv_v3(Queue& q, uint8_t* buf, size_t size) {
  for (;;) {
    auto* block = reinterpret_cast<tpacket_block_desc*>(q.rx + static_cast<size_t>(q.rx_next) * q.rx_unit);
    if (!q.pkt) {
      if (!(status_of(block->hdr.bh1.block_status) & TP_STATUS_USER)) {
        errno = EAGAIN;
        return -1;
      }
      q.pkts_left = block->hdr.bh1.num_pkts;
      q.pkt = reinterpret_cast<uint8_t*>(block) + block->hdr.bh1.offset_to_first_pkt;
    }
    ssize_t n = -1;
    if (q.pkts_left > 0) {
      const auto* h = reinterpret_cast<const tpacket3_hdr*>(q.pkt);
      n = take_frame(q.pkt + h->tp_mac, h->tp_snaplen, h->tp_len, buf, size);
      q.pkt += h->tp_next_offset;
      --q.pkts_left;
    }
    if (q.pkts_left == 0) {
      give_back(block->hdr.bh1.block_status, TP_STATUS_KERNEL);
      if (++q.rx_next == q.rx_count) q.rx_next = 0;
      q.pkt = nullptr;
    }
    if (n >= 0) return n;
  }
}

// TPACKET_V2: one slot per frame, handed over as soon as it is written.
ssize_t PacketSocket::recv_v2(Queue& q, uint8_t* buf, size_t size) {
  for (;;) {
    auto* h = reinterpret_cast<tpacket2_hdr*>(q.rx + static_cast<size_t>(q.rx_next) * q.rx_unit);
    const uint32_t status = status_of(h->tp_status);
    if (!(status & TP_STATUS_USER)) {
      errno = EAGAIN;
      return -1;
    }
    ssize_t n = -1;
    if (!(status & TP_STATUS_COPY)) {
      n = take_frame(reinterpret_cast<uint8_t*>(h) + h->tp_mac, h->tp_snaplen, h->tp_len, buf, size);
    } else {
      // Too large for a slot: the whole frame is next on the socket's queue.
      n = read_whole(q, buf, size);
    }
    give_back(h->tp_status, TP_STATUS_KERNEL);
    if (++q.rx_next == q.rx_count) q.rx_next = 0;
    if (n >= 0) return n;
  }
}

bool PacketSocket::link_up() const { return netdev_running(queues_[0].fd.get(), name_); }

}  // namespace sriovd::ports
