#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sriovd/host/vf_link.hpp"

struct nl_sock;  // libnl

namespace sriovd::host {

// VF settings over rtnetlink (RTM_SETLINK with IFLA_VFINFO_LIST) through
// libnl-route. Each setting goes in its own request, so an error names the
// setting the PF's driver refused.
class NetlinkVfLink : public VfLinkControl {
 public:
  NetlinkVfLink();
  ~NetlinkVfLink() override;
  NetlinkVfLink(const NetlinkVfLink&) = delete;
  NetlinkVfLink& operator=(const NetlinkVfLink&) = delete;

  VfSettings get(const std::string& pf_netdev, unsigned vf) override;
  void set(const std::string& pf_netdev, unsigned vf, const VfSettings& settings) override;

  // One request as it goes on the wire (for tests of the encoding): the
  // netlink message that sets `settings` (all of them in one IFLA_VF_INFO)
  // on VF `vf` of the link with `ifindex`.
  static std::vector<uint8_t> encode(int ifindex, unsigned vf, const VfSettings& settings);

 private:
  ::nl_sock* sock_ = nullptr;
};

}  // namespace sriovd::host
