#pragma once
// A Kubernetes ResourceClaim's settings for a VF (DRA opaque parameters,
// `apiVersion: sriovd.io/v1alpha1, kind: VfConfig`), from the DeviceClass
// and the claim. Checked as the YAML's VF entries are (the same reader,
// the same messages); an error names where the parameters came from and
// the field.
#include <optional>
#include <string>
#include <string_view>

#include "sriovd/config/config.hpp"

namespace sriovd::config {

inline constexpr const char* kVfConfigApiVersion = "sriovd.io/v1alpha1";
inline constexpr const char* kVfConfigKind = "VfConfig";

// What the claim's pod or VM gets the VF as: bound to vfio-pci (a VM or
// DPDK), to its own kernel driver (a netdev), exported by sriovd over
// vfio-user, or bridged by sriovd to a virtio-net device over vhost-user.
enum class ClaimDriver { vfio_pci, netdev, vfio_user, virtio };
const char* to_string(ClaimDriver);

struct ClaimVfConfig {
  VfConfig settings;  // index and assign unused
  std::optional<uint16_t> mtu;
  std::optional<ClaimDriver> driver;
  bool operator==(const ClaimVfConfig& o) const {
    const auto tie = [](const ClaimVfConfig& c) {
      const VfConfig& s = c.settings;
      return std::tie(s.mac, s.vlan, s.qos, s.trust, s.spoofchk, s.link_state, s.max_tx_rate, s.min_tx_rate, c.mtu,
                      c.driver);
    };
    return tie(*this) == tie(o);
  }
};

// One opaque config's `parameters` (JSON, as the API server stores it;
// YAML is read too). `source` names it in every message ("claim
// default/vm-a, config 1 (FromClass)"). Throws ConfigError listing every
// problem: an unknown field, a wrong apiVersion or kind, a bad value.
ClaimVfConfig parse_claim_vf_config(std::string_view parameters, const std::string& source);

// `over` applied on `base`: each field `over` sets replaces `base`'s
// (DRA's order: the class's configs first, then the claim's, later ones
// winning). qos goes with the vlan it tags.
ClaimVfConfig merge(const ClaimVfConfig& base, const ClaimVfConfig& over);

}  // namespace sriovd::config
