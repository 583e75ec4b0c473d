#include "sriovd/host/netlink_vf_link.hpp"

#include <linux/if_link.h>
#include <netlink/errno.h>
#include <netlink/msg.h>
#include <netlink/netlink.h>
#include <netlink/route/link.h>
#include <netlink/route/link/sriov.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "sriovd/util/netlink.hpp"

namespace sriovd::host {

namespace {

struct VfDeleter {
  void operator()(rtnl_link_vf* v) const { rtnl_link_vf_put(v); }
};
using LinkPtr = nl::Link;
using VfPtr = std::unique_ptr<rtnl_link_vf, VfDeleter>;

const char* kLinkStates[] = {"auto", "enable", "disable"};  // IFLA_VF_LINK_STATE_* order

uint32_t link_state_value(const std::string& s) {
  for (uint32_t i = 0; i < 3; ++i)
    if (s == kLinkStates[i]) return i;
  throw std::invalid_argument("unknown VF link state '" + s + "'");
}

// One IFLA_VF_INFO carrying the fields that are set.
VfPtr make_vf(unsigned index, const VfSettings& s) {
  VfPtr vf(rtnl_link_vf_alloc());
  if (!vf) throw std::bad_alloc();
  rtnl_link_vf_set_index(vf.get(), index);
  if (s.mac) {
    nl::Addr addr(nl_addr_build(AF_LLC, s.mac->octets, 6));
    rtnl_link_vf_set_addr(vf.get(), addr.get());
  }
  if (s.vlan || s.qos) {
    nl_vf_vlans_t* vlans = nullptr;
    if (rtnl_link_vf_vlan_alloc(&vlans, 1) < 0) throw std::bad_alloc();
    vlans->vlans[0].vf_vlan = s.vlan.value_or(0);
    vlans->vlans[0].vf_vlan_qos = s.qos.value_or(0);
    vlans->vlans[0].vf_vlan_proto = 0x8100;  // ETH_P_8021Q
    rtnl_link_vf_set_vlans(vf.get(), vlans);
    rtnl_link_vf_vlan_put(vlans);
  }
  if (s.trust) rtnl_link_vf_set_trust(vf.get(), *s.trust ? 1 : 0);
  if (s.spoofchk) rtnl_link_vf_set_spoofchk(vf.get(), *s.spoofchk ? 1 : 0);
  if (s.link_state) rtnl_link_vf_set_linkstate(vf.get(), link_state_value(*s.link_state));
  if (s.max_tx_rate || s.min_tx_rate) {
    nl_vf_rate rate{};
    rate.api = RTNL_LINK_VF_RATE_API_NEW;
    rate.min_tx_rate = s.min_tx_rate.value_or(0);
    rate.max_tx_rate = s.max_tx_rate.value_or(0);
    rtnl_link_vf_set_rate(vf.get(), &rate);
  }
  return vf;
}

// libnl's error (-NLE_*) as the kernel's errno, for callers that retry.
int errno_of(int nl_err) {
  switch (-nl_err) {
    case NLE_INVAL: return EINVAL;
    case NLE_OPNOTSUPP: return EOPNOTSUPP;
    case NLE_PERM: return EPERM;
    case NLE_BUSY: return EBUSY;
    case NLE_RANGE: return ERANGE;
    case NLE_NODEV: return ENODEV;
    case NLE_AGAIN: return EAGAIN;
    default: return EIO;
  }
}

struct Request {
  const char* setting;  // VfSettingRefused::setting()
  std::string label;    // for messages
  VfSettings one;
};

// The settings split into the requests sriovd sends, each with its name for
// error messages. VLAN and QoS travel together (IFLA_VF_VLAN), as do the rates.
std::vector<Request> split(const VfSettings& s) {
  std::vector<Request> out;
  VfSettings one;
  if (s.mac) {
    one = {};
    one.mac = s.mac;
    out.push_back(Request{"mac", "mac " + s.mac->to_string(), one});
  }
  if (s.vlan || s.qos) {
    one = {};
    one.vlan = s.vlan.value_or(0);
    one.qos = s.qos.value_or(0);
    out.push_back(Request{"vlan", "vlan " + std::to_string(*one.vlan) + " qos " + std::to_string(*one.qos), one});
  }
  if (s.trust) {
    one = {};
    one.trust = s.trust;
    out.push_back(Request{"trust", std::string("trust ") + (*s.trust ? "on" : "off"), one});
  }
  if (s.spoofchk) {
    one = {};
    one.spoofchk = s.spoofchk;
    out.push_back(Request{"spoofchk", std::string("spoofchk ") + (*s.spoofchk ? "on" : "off"), one});
  }
  if (s.link_state) {
    one = {};
    one.link_state = s.link_state;
    out.push_back(Request{"link_state", "link_state " + *s.link_state, one});
  }
  if (s.max_tx_rate || s.min_tx_rate) {
    one = {};
    one.min_tx_rate = s.min_tx_rate.value_or(0);
    one.max_tx_rate = s.max_tx_rate.value_or(0);
    out.push_back(Request{
        "rate", "tx rate " + std::to_string(*one.min_tx_rate) + ".." + std::to_string(*one.max_tx_rate) + " Mbit/s",
        one});
  }
  return out;
}

}  // namespace

NetlinkVfLink::NetlinkVfLink() : sock_(nl_socket_alloc()) {
  if (!sock_) throw std::bad_alloc();
  if (int err = nl_connect(sock_, NETLINK_ROUTE); err < 0) {
    nl_socket_free(sock_);
    throw std::runtime_error(std::string("rtnetlink: ") + nl_geterror(err));
  }
}

NetlinkVfLink::~NetlinkVfLink() { nl_socket_free(sock_); }

VfSettings NetlinkVfLink::get(const std::string& pf_netdev, unsigned index) {
  rtnl_link* raw = nullptr;
  if (int err = rtnl_link_get_kernel(sock_, 0, pf_netdev.c_str(), &raw); err < 0)
    throw std::runtime_error("PF " + pf_netdev + ": cannot read link: " + nl_geterror(err));
  LinkPtr link(raw);
  // Asked first: libnl 3.7's rtnl_link_vf_get() crashes on a link that
  // carries no VF list at all.
  uint32_t num_vf = 0;
  if (rtnl_link_get_num_vf(link.get(), &num_vf) < 0 || index >= num_vf)
    throw std::runtime_error("PF " + pf_netdev + ": reports no VF " + std::to_string(index) +
                             " (no SR-IOV support, or the VF does not exist)");
  VfPtr vf(rtnl_link_vf_get(link.get(), index));
  if (!vf)
    throw std::runtime_error("PF " + pf_netdev + ": reports no VF " + std::to_string(index) +
                             " (no SR-IOV support, or the VF does not exist)");
  VfSettings s;
  nl_addr* addr = nullptr;
  if (rtnl_link_vf_get_addr(vf.get(), &addr) == 0 && addr && nl_addr_get_len(addr) >= 6) {
    MacAddress mac;
    std::memcpy(mac.octets, nl_addr_get_binary_addr(addr), 6);
    s.mac = mac;
  }
  nl_vf_vlans_t* vlans = nullptr;
  if (rtnl_link_vf_get_vlans(vf.get(), &vlans) == 0 && vlans && vlans->size > 0) {
    s.vlan = static_cast<uint16_t>(vlans->vlans[0].vf_vlan);
    s.qos = static_cast<uint8_t>(vlans->vlans[0].vf_vlan_qos);
  } else {
    s.vlan = 0;
    s.qos = 0;
  }
  uint32_t v = 0;
  if (rtnl_link_vf_get_trust(vf.get(), &v) == 0) s.trust = v != 0;
  if (rtnl_link_vf_get_spoofchk(vf.get(), &v) == 0) s.spoofchk = v != 0;
  // The kernel sends a link state and the rates for every VF, but libnl
  // 3.7 keeps only non-zero ones: a zero (link state "auto", no rate) reads
  // as absent, and must read as zero, or a restore would not know the
  // original value and leave a rate set.
  s.link_state = "auto";
  if (rtnl_link_vf_get_linkstate(vf.get(), &v) == 0 && v < 3) s.link_state = kLinkStates[v];
  s.max_tx_rate = 0;
  s.min_tx_rate = 0;
  nl_vf_rate rate{};
  if (rtnl_link_vf_get_rate(vf.get(), &rate) == 0) {
    s.max_tx_rate = rate.api == RTNL_LINK_VF_RATE_API_OLD ? rate.rate : rate.max_tx_rate;
    s.min_tx_rate = rate.api == RTNL_LINK_VF_RATE_API_OLD ? 0 : rate.min_tx_rate;
  }
  return s;
}

void NetlinkVfLink::set(const std::string& pf_netdev, unsigned index, const VfSettings& settings) {
  rtnl_link* raw = nullptr;
  if (int err = rtnl_link_get_kernel(sock_, 0, pf_netdev.c_str(), &raw); err < 0)
    throw std::runtime_error("PF " + pf_netdev + ": cannot read link: " + nl_geterror(err));
  LinkPtr orig(raw);
  for (const auto& [setting, what, one] : split(settings)) {
    LinkPtr change(rtnl_link_alloc());
    VfPtr vf = make_vf(index, one);
    if (int err = rtnl_link_vf_add(change.get(), vf.get()); err < 0)
      throw std::runtime_error("PF " + pf_netdev + ": VF " + std::to_string(index) + ": " + nl_geterror(err));
    if (int err = rtnl_link_change(sock_, orig.get(), change.get(), 0); err < 0)
      throw VfSettingRefused(setting, errno_of(err),
                             "PF " + pf_netdev + ": cannot set " + what + " of VF " + std::to_string(index) + ": " +
                                 nl_geterror(err) +
                                 (err == -NLE_OPNOTSUPP ? " (the PF's driver does not take this setting)" : ""));
  }
}

std::vector<uint8_t> NetlinkVfLink::encode(int ifindex, unsigned index, const VfSettings& settings) {
  LinkPtr orig(rtnl_link_alloc());
  rtnl_link_set_ifindex(orig.get(), ifindex);
  LinkPtr change(rtnl_link_alloc());
  VfPtr vf = make_vf(index, settings);
  if (int err = rtnl_link_vf_add(change.get(), vf.get()); err < 0)
    throw std::runtime_error(std::string("encoding VF settings: ") + nl_geterror(err));
  nl_msg* raw = nullptr;
  if (int err = rtnl_link_build_change_request(orig.get(), change.get(), 0, &raw); err < 0)
    throw std::runtime_error(std::string("encoding VF settings: ") + nl_geterror(err));
  nl::Msg msg(raw);
  const nlmsghdr* hdr = nlmsg_hdr(msg.get());
  const auto* bytes = reinterpret_cast<const uint8_t*>(hdr);
  return {bytes, bytes + hdr->nlmsg_len};
}

}  // namespace sriovd::host
