// VF settings over rtnetlink: the request encoding, and the errors a PF
// without SR-IOV support gives. There is no SR-IOV NIC model on these
// machines, so settings are never applied to a real VF here.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <linux/if_link.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <sched.h>

#include <cstring>
#include <map>

#include "sriovd/host/netlink_vf_link.hpp"
#include "support/process.hpp"

namespace sriovd::host {
namespace {

using ::testing::HasSubstr;

// The attributes of one nested level: type -> payload.
std::multimap<uint16_t, std::vector<uint8_t>> attributes(const uint8_t* data, size_t len) {
  std::multimap<uint16_t, std::vector<uint8_t>> out;
  while (len >= sizeof(nlattr)) {
    nlattr a;
    std::memcpy(&a, data, sizeof a);
    if (a.nla_len < sizeof a || a.nla_len > len) break;
    out.emplace(a.nla_type & NLA_TYPE_MASK, std::vector<uint8_t>(data + NLA_HDRLEN, data + a.nla_len));
    const size_t step = NLA_ALIGN(a.nla_len);
    if (step >= len) break;
    data += step;
    len -= step;
  }
  return out;
}

template <typename T>
T payload(const std::vector<uint8_t>& bytes) {
  T v{};
  EXPECT_GE(bytes.size(), sizeof v);
  std::memcpy(&v, bytes.data(), std::min(bytes.size(), sizeof v));
  return v;
}

TEST(NetlinkVfLink, EncodesEverySettingInOneVfInfo) {
  VfSettings s;
  s.mac = MacAddress::parse("02:00:00:00:00:2a");
  s.vlan = 100;
  s.qos = 3;
  s.trust = true;
  s.spoofchk = false;
  s.link_state = "disable";
  s.max_tx_rate = 10000;
  s.min_tx_rate = 500;
  const auto msg = NetlinkVfLink::encode(7, 3, s);
  nlmsghdr hdr;
  std::memcpy(&hdr, msg.data(), sizeof hdr);
  EXPECT_EQ(hdr.nlmsg_len, msg.size());
  EXPECT_TRUE(hdr.nlmsg_type == RTM_NEWLINK || hdr.nlmsg_type == RTM_SETLINK) << hdr.nlmsg_type;
  ifinfomsg ifi;
  std::memcpy(&ifi, msg.data() + NLMSG_HDRLEN, sizeof ifi);
  EXPECT_EQ(ifi.ifi_index, 7);

  const size_t attrs_at = NLMSG_HDRLEN + NLMSG_ALIGN(sizeof(ifinfomsg));
  auto top = attributes(msg.data() + attrs_at, msg.size() - attrs_at);
  ASSERT_EQ(top.count(IFLA_VFINFO_LIST), 1U);
  auto list_bytes = top.find(IFLA_VFINFO_LIST)->second;
  auto list = attributes(list_bytes.data(), list_bytes.size());
  ASSERT_EQ(list.count(IFLA_VF_INFO), 1U);
  auto info_bytes = list.find(IFLA_VF_INFO)->second;
  auto info = attributes(info_bytes.data(), info_bytes.size());

  auto mac = payload<ifla_vf_mac>(info.find(IFLA_VF_MAC)->second);
  EXPECT_EQ(mac.vf, 3U);
  EXPECT_EQ(MacAddress::parse("02:00:00:00:00:2a")->octets[5], mac.mac[5]);
  EXPECT_EQ(mac.mac[0], 0x02);
  // VLAN with QoS travels either as IFLA_VF_VLAN or in IFLA_VF_VLAN_LIST.
  if (info.count(IFLA_VF_VLAN_LIST)) {
    auto vl_bytes = info.find(IFLA_VF_VLAN_LIST)->second;
    auto vl = attributes(vl_bytes.data(), vl_bytes.size());
    auto v = payload<ifla_vf_vlan_info>(vl.find(IFLA_VF_VLAN_INFO)->second);
    EXPECT_EQ(v.vf, 3U);
    EXPECT_EQ(v.vlan, 100U);
    EXPECT_EQ(v.qos, 3U);
  } else {
    auto v = payload<ifla_vf_vlan>(info.find(IFLA_VF_VLAN)->second);
    EXPECT_EQ(v.vf, 3U);
    EXPECT_EQ(v.vlan, 100U);
    EXPECT_EQ(v.qos, 3U);
  }
  auto trust = payload<ifla_vf_trust>(info.find(IFLA_VF_TRUST)->second);
  EXPECT_EQ(trust.vf, 3U);
  EXPECT_EQ(trust.setting, 1U);
  auto spoof = payload<ifla_vf_spoofchk>(info.find(IFLA_VF_SPOOFCHK)->second);
  EXPECT_EQ(spoof.setting, 0U);
  auto state = payload<ifla_vf_link_state>(info.find(IFLA_VF_LINK_STATE)->second);
  EXPECT_EQ(state.link_state, static_cast<uint32_t>(IFLA_VF_LINK_STATE_DISABLE));
  auto rate = payload<ifla_vf_rate>(info.find(IFLA_VF_RATE)->second);
  EXPECT_EQ(rate.vf, 3U);
  EXPECT_EQ(rate.min_tx_rate, 500U);
  EXPECT_EQ(rate.max_tx_rate, 10000U);
}

TEST(NetlinkVfLink, UnknownLinkStateIsRefusedBeforeAnythingIsSent) {
  VfSettings s;
  s.link_state = "sideways";
  EXPECT_THROW(NetlinkVfLink::encode(1, 0, s), std::invalid_argument);
}

// A veth has no SR-IOV: every setting must fail with an error
// that names the PF, the VF and the setting. Runs in a network namespace of
// its own (this test process only), so the host's links are not touched.
TEST(NetlinkVfLink, APfWithoutSriovGivesAClearErrorNamingPfAndSetting) {
  if (::unshare(CLONE_NEWNET) != 0)
    GTEST_SKIP() << "needs root (CAP_SYS_ADMIN) for a private network namespace: " << std::strerror(errno);
  // veth, not dummy: this kernel has no dummy module.
  auto made = test::run({"/sbin/ip", "link", "add", "pfdummy0", "type", "veth", "peer", "name", "pfdummy1"});
  ASSERT_EQ(made.exit_code, 0) << made.output;
  NetlinkVfLink nl;
  try {
    (void)nl.get("pfdummy0", 0);
    FAIL() << "a veth reported a VF";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "PF pfdummy0: reports no VF 0 (no SR-IOV support, or the VF does not exist)");
  }
  VfSettings s;
  s.vlan = 100;
  try {
    nl.set("pfdummy0", 0, s);
    FAIL() << "a veth accepted a VF VLAN";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("PF pfdummy0: cannot set vlan 100 qos 0 of VF 0: "));
  }
  try {
    nl.set("nosuchpf0", 0, s);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("PF nosuchpf0: cannot read link: "));
  }
}

}  // namespace
}  // namespace sriovd::host
