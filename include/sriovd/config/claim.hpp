#pragma once
// A Kubernetes ResourceClaim's settings for a VF (DRA opaque parameters,
// `apiVersion: sriovd.io/v1alpha1, kind: VfConfig`), from the DeviceClass
// and the claim. Checked as the YAML's VF entries are (the same reader,
// the same messages); an error names where the parameters came from and
// the field.
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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

// One opaque config's `parameters` (JSON, as the API server stores it; a
// flat object). `source` names it in every message ("claim
// default/vm-a, config 1 (FromClass)"). Throws ConfigError listing every
// problem: an unknown field, a wrong apiVersion or kind, a bad value.
ClaimVfConfig parse_claim_vf_config(std::string_view parameters, const std::string& source);

// `c` as the parameters that parse_claim_vf_config reads back to it (the
// DRA driver's record of a prepared claim keeps them so).
std::string claim_vf_config_json(const ClaimVfConfig& c);

// `over` applied on `base`: each field `over` sets replaces `base`'s
// (DRA's order: the class's configs first, then the claim's, later ones
// winning). qos goes with the vlan it tags.
ClaimVfConfig merge(const ClaimVfConfig& base, const ClaimVfConfig& over);

// A VF a prepared claim holds, and what the claim asks of it.
struct ClaimedVf {
  std::string claim;  // "default/vm-a": its name in messages
  std::string uid;    // the VF's owner is "claim-<uid>"
  PfRef pf;
  uint16_t index = 0;
  ClaimVfConfig config;
  // vfio-user and virtio: the socket sriovd serves the VF (or its
  // virtio-net device) on.
  std::string socket;
};

// The VFs the DRA driver offers: of every configured PF, each VF below
// num_vfs that the YAML neither lists nor bridges to a virtio device.
std::vector<std::pair<PfRef, uint16_t>> dra_offered_vfs(const Config& yaml);

// The virtio device a claim with `driver: virtio` gets: "claim-" and the
// first 8 characters of its UID.
std::string claim_device_name(const std::string& uid);

// `yaml` (a valid config) with the claims' VFs in it, as if the file had
// listed them: each claimed VF an entry with the claim's settings and, by
// its driver, assigned to the claim with `export: none` (bound to
// vfio-pci), left to its own driver (netdev), exported over vfio-user on
// its socket, or bridged to a virtio-net device over vhost-user on its
// socket. Read by the same loader (every check the YAML gets), so the
// host's journalled apply and release treat them as they treat the YAML's.
// Throws std::runtime_error naming the claim when its VF is not one the
// driver offers (its PF not configured, its index not below num_vfs, the
// YAML lists or bridges it, another claim holds it), or what the claim
// asks cannot be done (mtu on a VF that is not bridged: its netdev's MTU is
// not set by this sriovd).
Config with_claims(const Config& yaml, const std::vector<ClaimedVf>& claims);

}  // namespace sriovd::config
