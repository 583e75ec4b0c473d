// Software offloads for drivers that did not negotiate them: TCP GSO
// packets cut into segments that are each a valid frame (lengths, IPv4 id
// and header checksum, sequence numbers, flags, TCP checksum verified
// independently here), and partial checksums completed.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "sriovd/virtio/offload.hpp"

namespace sriovd::virtio {
namespace {

uint32_t sum16(const uint8_t* p, size_t n, uint32_t s = 0) {
  for (; n > 1; p += 2, n -= 2) s += static_cast<uint32_t>(p[0] << 8U | p[1]);
  if (n) s += static_cast<uint32_t>(p[0] << 8U);
  while (s >> 16U) s = (s & 0xffffU) + (s >> 16U);
  return s;
}
uint16_t be16(const uint8_t* p) { return static_cast<uint16_t>(p[0] << 8U | p[1]); }
uint32_t be32(const uint8_t* p) { return static_cast<uint32_t>(be16(p)) << 16U | be16(p + 2); }

// header (12) + Ethernet [+ VLAN] + IPv4/IPv6 + TCP (20) + payload.
std::vector<uint8_t> gso_packet(bool v6, bool vlan, size_t payload, uint16_t mss, uint8_t tcp_flags) {
  std::vector<uint8_t> p(12, 0);
  p[0] = kHdrNeedsCsum;
  p[1] = v6 ? kGsoTcpV6 : kGsoTcpV4;
  std::memcpy(p.data() + 4, &mss, 2);
  const uint8_t mac[12] = {2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1};
  p.insert(p.end(), mac, mac + 12);
  if (vlan) p.insert(p.end(), {0x81, 0x00, 0x00, 0x64});
  if (v6) {
    p.insert(p.end(), {0x86, 0xdd, 0x60, 0, 0, 0, 0, 0, 6, 64});
    for (int i = 0; i < 32; ++i) p.push_back(static_cast<uint8_t>(i < 16 ? 0x20 + i : 0x40 + i));
  } else {
    p.insert(p.end(), {0x08, 0x00, 0x45, 0, 0, 0, 0x12, 0x34, 0x40, 0, 64, 6, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2});
  }
  const uint8_t tcp[20] = {0x13, 0x88, 0xc3, 0x50,      0x10, 0x00, 0x00, 0x00, 0, 0,
                           0,    1,    0x50, tcp_flags, 0xff, 0xff, 0,    0,    0, 0};
  p.insert(p.end(), tcp, tcp + 20);
  for (size_t i = 0; i < payload; ++i) p.push_back(static_cast<uint8_t>(i * 7 + 3));
  return p;
}

class Segmentation : public ::testing::TestWithParam<std::pair<bool, bool>> {};

TEST_P(Segmentation, EachSegmentIsAValidFrame) {
  const auto [v6, vlan] = GetParam();
  constexpr size_t kPayload = 5000;
  constexpr uint16_t kMss = 1448;
  const auto pkt = gso_packet(v6, vlan, kPayload, kMss, 0x19);  // FIN | PSH | ACK
  const size_t l3 = 12 + 14 + (vlan ? 4 : 0);
  const size_t l4 = l3 + (v6 ? 40 : 20);
  const size_t headers = l4 + 20;
  TcpSegmenter cut;
  ASSERT_TRUE(cut.start(pkt.data(), pkt.size()));
  std::vector<uint8_t> out(2048), payload;
  unsigned n = 0;
  while (const size_t len = cut.next(out.data(), out.size(), kHdrDataValid)) {
    SCOPED_TRACE("segment " + std::to_string(n));
    const bool last = payload.size() + kMss >= kPayload;
    ASSERT_EQ(len, headers + (last ? kPayload - payload.size() : kMss));
    EXPECT_EQ(out[0], kHdrDataValid);
    EXPECT_EQ(out[1], kGsoNone);
    const uint8_t* ip = out.data() + l3;
    const uint8_t* tcp = out.data() + l4;
    const size_t tcp_bytes = len - l4;
    uint32_t pseudo = 0;
    if (v6) {
      EXPECT_EQ(be16(ip + 4), tcp_bytes);
      pseudo = sum16(ip + 8, 32);
    } else {
      EXPECT_EQ(be16(ip + 2), len - l3);
      EXPECT_EQ(be16(ip + 4), 0x1234 + n);
      EXPECT_EQ(sum16(ip, 20), 0xffffU) << "IPv4 header checksum";
      pseudo = sum16(ip + 12, 8);
    }
    EXPECT_EQ(sum16(tcp, tcp_bytes, pseudo + 6 + static_cast<uint32_t>(tcp_bytes)), 0xffffU) << "TCP checksum";
    EXPECT_EQ(be32(tcp + 4), 0x10000000U + payload.size());
    EXPECT_EQ(tcp[13], last ? 0x19 : 0x10) << "FIN and PSH on the last segment only";
    payload.insert(payload.end(), out.begin() + static_cast<long>(headers), out.begin() + static_cast<long>(len));
    ++n;
  }
  EXPECT_EQ(n, 4U);
  ASSERT_EQ(payload.size(), kPayload);
  EXPECT_TRUE(std::equal(payload.begin(), payload.end(), pkt.begin() + static_cast<long>(headers)));
}

INSTANTIATE_TEST_SUITE_P(Frames, Segmentation,
                         ::testing::Values(std::pair{false, false}, std::pair{true, false}, std::pair{false, true},
                                           std::pair{true, true}),
                         [](const auto& param_info) {
                           return std::string(param_info.param.first ? "ipv6" : "ipv4") +
                                  (param_info.param.second ? "_vlan" : "");
                         });

TEST(Segmentation, RefusesWhatIsNotTcp) {
  auto pkt = gso_packet(false, false, 3000, 1448, 0x10);
  pkt[12 + 14 + 9] = 17;  // UDP
  TcpSegmenter cut;
  EXPECT_FALSE(cut.start(pkt.data(), pkt.size()));
  EXPECT_FALSE(cut.start(pkt.data(), 20));  // truncated
  auto no_mss = gso_packet(false, false, 3000, 0, 0x10);
  EXPECT_FALSE(cut.start(no_mss.data(), no_mss.size()));  // gso_size 0
  auto arp = gso_packet(false, false, 100, 1448, 0x10);
  arp[12 + 12] = 0x08;
  arp[12 + 13] = 0x06;
  EXPECT_FALSE(cut.start(arp.data(), arp.size()));
}

TEST(Segmentation, OutputTooSmallEndsTheCut) {
  const auto pkt = gso_packet(false, false, 3000, 1448, 0x10);
  TcpSegmenter cut;
  ASSERT_TRUE(cut.start(pkt.data(), pkt.size()));
  std::vector<uint8_t> out(100);
  EXPECT_EQ(cut.next(out.data(), out.size(), 0), 0U);
  EXPECT_FALSE(cut.active());
}

TEST(CompleteChecksum, FillsThePartialChecksumOfAUdpDatagram) {
  // IPv4/UDP, the checksum field holding the pseudo-header sum as a
  // sender with CHECKSUM_PARTIAL leaves it.
  std::vector<uint8_t> p(12, 0);
  p[0] = kHdrNeedsCsum;
  const uint16_t start = 14 + 20, offset = 6;
  std::memcpy(p.data() + 6, &start, 2);
  std::memcpy(p.data() + 8, &offset, 2);
  const uint8_t eth_ip[34] = {2,  0, 0, 0, 0, 2,  2,  0, 0, 0,  0, 1, 0x08, 0x00, 0x45, 0, 0,
                              48, 0, 0, 0, 0, 64, 17, 0, 0, 10, 0, 0, 1,    10,   0,    0, 2};
  p.insert(p.end(), eth_ip, eth_ip + 34);
  const uint16_t udp_len = 28;
  p.insert(p.end(), {0x30, 0x39, 0x00, 0x35, 0, static_cast<uint8_t>(udp_len), 0, 0});
  for (int i = 0; i < 20; ++i) p.push_back(static_cast<uint8_t>(i + 1));
  uint8_t* udp = p.data() + 12 + start;
  const uint32_t pseudo = sum16(p.data() + 12 + 26, 8) + 17 + udp_len;
  const uint32_t folded = sum16(nullptr, 0, pseudo);
  udp[6] = static_cast<uint8_t>(folded >> 8U);
  udp[7] = static_cast<uint8_t>(folded);
  ASSERT_TRUE(complete_checksum(p.data(), p.size()));
  EXPECT_EQ(p[0] & kHdrNeedsCsum, 0);
  EXPECT_EQ(sum16(udp, udp_len, pseudo), 0xffffU);
  // An offset outside the packet is refused.
  const uint16_t far = 4000;
  std::memcpy(p.data() + 6, &far, 2);
  EXPECT_FALSE(complete_checksum(p.data(), p.size()));
}

}  // namespace
}  // namespace sriovd::virtio
