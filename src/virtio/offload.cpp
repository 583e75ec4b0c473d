#include "sriovd/virtio/offload.hpp"

#include <arpa/inet.h>

#include <algorithm>
#include <cstring>

namespace sriovd::virtio {

namespace {

constexpr size_t kHeader = 12;
constexpr uint8_t kTcpFin = 0x01, kTcpPsh = 0x08, kTcpCwr = 0x80;

// RFC 1071 one's complement sum, big-endian words.
uint32_t add_sum(uint32_t sum, const uint8_t* p, size_t len) {
  for (; len > 1; p += 2, len -= 2) sum += static_cast<uint32_t>(p[0] << 8U | p[1]);
  if (len) sum += static_cast<uint32_t>(p[0] << 8U);
  return sum;
}
uint16_t fold(uint32_t sum) {
  while (sum >> 16U) sum = (sum & 0xffffU) + (sum >> 16U);
  return static_cast<uint16_t>(~sum & 0xffffU);
}
uint16_t get16(const uint8_t* p) { return static_cast<uint16_t>(p[0] << 8U | p[1]); }
void put16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v >> 8U);
  p[1] = static_cast<uint8_t>(v);
}
uint32_t get32(const uint8_t* p) { return static_cast<uint32_t>(get16(p)) << 16U | get16(p + 2); }
void put32(uint8_t* p, uint32_t v) {
  put16(p, static_cast<uint16_t>(v >> 16U));
  put16(p + 2, static_cast<uint16_t>(v));
}

}  // namespace

bool complete_checksum(uint8_t* pkt, size_t len) {
  uint16_t start = 0, offset = 0;
  std::memcpy(&start, pkt + 6, 2);
  std::memcpy(&offset, pkt + 8, 2);
  if (len < kHeader) return false;
  const size_t frame = len - kHeader;
  if (start > frame || offset + 2U > frame - start) return false;
  uint8_t* data = pkt + kHeader + start;
  // The field holds the pseudo-header sum; the rest is summed over it
  // (a zero result is sent as 0xffff, the same in one's complement and
  // what UDP needs).
  const uint16_t csum = fold(add_sum(0, data, frame - start));
  put16(data + offset, csum == 0 ? 0xffff : csum);
  pkt[0] = static_cast<uint8_t>(pkt[0] & ~kHdrNeedsCsum);
  return true;
}

bool TcpSegmenter::start(const uint8_t* pkt, size_t len) {
  frame_ = nullptr;
  if (len < kHeader + 14) return false;
  uint16_t mss = 0;
  std::memcpy(&mss, pkt + 4, 2);
  const uint8_t* f = pkt + kHeader;
  const size_t n = len - kHeader;
  size_t l3 = 14;
  uint16_t type = get16(f + 12);
  for (int tags = 0; (type == 0x8100 || type == 0x88a8) && tags < 2; ++tags) {
    if (n < l3 + 4) return false;
    type = get16(f + l3 + 2);
    l3 += 4;
  }
  size_t l4 = 0;
  bool v6 = false;
  if (type == 0x0800) {
    if (n < l3 + 20 || (f[l3] >> 4U) != 4) return false;
    const size_t ihl = (f[l3] & 0xfU) * 4U;
    if (ihl < 20 || n < l3 + ihl || f[l3 + 9] != 6) return false;  // TCP, no fragments of it
    l4 = l3 + ihl;
  } else if (type == 0x86dd) {
    if (n < l3 + 40 || (f[l3] >> 4U) != 6 || f[l3 + 6] != 6) return false;  // TCP right after the fixed header
    l4 = l3 + 40;
    v6 = true;
  } else {
    return false;
  }
  if (n < l4 + 20) return false;
  const size_t tcp_len = (f[l4 + 12] >> 4U) * 4U;
  if (tcp_len < 20 || n < l4 + tcp_len || mss == 0) return false;
  frame_ = f;
  frame_len_ = n;
  l3_ = l3;
  l4_ = l4;
  headers_ = l4 + tcp_len;
  v6_ = v6;
  mss_ = mss;
  at_ = 0;
  index_ = 0;
  return true;
}

size_t TcpSegmenter::next(uint8_t* out, size_t size, uint8_t flags) {
  if (!frame_) return 0;
  const size_t payload = frame_len_ - headers_;
  if (index_ > 0 && at_ >= payload) {  // all cut (a packet without payload: one segment)
    frame_ = nullptr;
    return 0;
  }
  const size_t chunk = std::min<size_t>(mss_, payload - at_);
  const size_t total = kHeader + headers_ + chunk;
  if (total > size) {
    frame_ = nullptr;
    return 0;
  }
  const bool last = at_ + chunk >= payload;
  std::memset(out, 0, kHeader);
  out[0] = flags;
  uint8_t* f = out + kHeader;
  std::memcpy(f, frame_, headers_);
  std::memcpy(f + headers_, frame_ + headers_ + at_, chunk);
  uint8_t* ip = f + l3_;
  uint8_t* tcp = f + l4_;
  const size_t tcp_bytes = headers_ - l4_ + chunk;
  uint32_t pseudo = 0;
  if (v6_) {
    put16(ip + 4, static_cast<uint16_t>(tcp_bytes));
    pseudo = add_sum(0, ip + 8, 32);  // source and destination
  } else {
    put16(ip + 2, static_cast<uint16_t>(l4_ - l3_ + tcp_bytes));
    put16(ip + 4, static_cast<uint16_t>(get16(frame_ + l3_ + 4) + index_));
    put16(ip + 10, 0);
    put16(ip + 10, fold(add_sum(0, ip, l4_ - l3_)));
    pseudo = add_sum(0, ip + 12, 8);
  }
  pseudo += 6U + static_cast<uint32_t>(tcp_bytes);
  put32(tcp + 4, get32(frame_ + l4_ + 4) + static_cast<uint32_t>(at_));
  uint8_t tcp_flags = frame_[l4_ + 13];
  if (!last) tcp_flags = static_cast<uint8_t>(tcp_flags & ~(kTcpFin | kTcpPsh));
  if (index_ > 0) tcp_flags = static_cast<uint8_t>(tcp_flags & ~kTcpCwr);
  tcp[13] = tcp_flags;
  put16(tcp + 16, 0);
  put16(tcp + 16, fold(add_sum(pseudo, tcp, tcp_bytes)));
  at_ += chunk;
  ++index_;
  return total;
}

}  // namespace sriovd::virtio
