#pragma once
// What a port may hand the device that the driver did not negotiate, done
// in software: a packet with a partial checksum (VIRTIO_NET_HDR_F_NEEDS_CSUM)
// for a driver without VIRTIO_NET_F_GUEST_CSUM gets its checksum filled in;
// a TCP GSO packet (virtio 1.2 §5.1.6.2) for a driver without GUEST_TSO4/6
// is cut into gso_size segments, each a complete frame with its own IP
// length, IPv4 id and checksum, TCP sequence number, flags and checksum. A
// tap never needs this (TUNSETOFFLOAD follows the features); AF_PACKET on a
// VF's netdev hands over what GRO and local senders made. No allocation:
// segments are written into the caller's buffer.

#include <cstddef>
#include <cstdint>

namespace sriovd::virtio {

inline constexpr uint8_t kHdrNeedsCsum = 1, kHdrDataValid = 2;  // virtio_net_hdr flags
inline constexpr uint8_t kGsoNone = 0, kGsoTcpV4 = 1, kGsoUdp = 3, kGsoTcpV6 = 4, kGsoUdpL4 = 5, kGsoEcn = 0x80;

// Completes the partial checksum of [pkt, pkt + len) (12-byte virtio-net
// header first) in place and clears NEEDS_CSUM. false: csum_start/offset
// outside the packet.
bool complete_checksum(uint8_t* pkt, size_t len);

// Cuts one TCP GSO packet into segments.
class TcpSegmenter {
 public:
  // Takes the packet (12-byte virtio-net header first; it must stay in
  // place until the last segment is out). false: not TCP over IPv4/IPv6
  // behind Ethernet (with up to two VLAN tags), or malformed.
  bool start(const uint8_t* pkt, size_t len);
  // The next segment into out (a 12-byte header, zero but for `flags`,
  // then the frame); its size, or 0 when all are out (or out is too small).
  size_t next(uint8_t* out, size_t size, uint8_t flags);
  [[nodiscard]] bool active() const { return frame_ != nullptr; }
  void stop() { frame_ = nullptr; }

 private:
  const uint8_t* frame_ = nullptr;
  size_t frame_len_ = 0;
  size_t l3_ = 0, l4_ = 0, headers_ = 0;  // offsets in the frame; headers_ = payload start
  bool v6_ = false;
  uint16_t mss_ = 0;
  size_t at_ = 0;  // payload bytes already cut
  unsigned index_ = 0;
};

}  // namespace sriovd::virtio
