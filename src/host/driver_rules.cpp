#include "sriovd/host/driver_rules.hpp"

namespace sriovd::host {

namespace {

// igb (Intel 82576, checked on QEMU 10's model with Linux 6.1 and 6.12): no
// ndo_set_vf_link_state, so every link state - "auto" too - is EOPNOTSUPP;
// ndo_set_vf_rate refuses a minimum rate and any rate while the link is
// down (EINVAL). It takes mac, vlan/qos, spoofchk, trust and max_tx_rate.
constexpr DriverRules kIgb{false, false, true};

}  // namespace

const DriverRules* driver_rules(const std::string& pf_driver) {
  if (pf_driver == "igb") return &kIgb;
  return nullptr;
}

std::vector<std::string> refused_settings(const std::string& pf_driver, const VfSettings& want, bool pf_link_up) {
  std::vector<std::string> out;
  const DriverRules* rules = driver_rules(pf_driver);
  if (!rules) return out;
  if (want.link_state && !rules->link_state)
    out.push_back("link_state " + *want.link_state + ": the " + pf_driver +
                  " driver takes no VF link state (leave link_state out)");
  if (want.min_tx_rate.value_or(0) != 0 && !rules->min_tx_rate)
    out.push_back("min_tx_rate " + std::to_string(*want.min_tx_rate) + ": the " + pf_driver +
                  " driver takes no minimum rate (leave it out or 0)");
  if (want.max_tx_rate.value_or(0) != 0 && rules->rate_needs_link && !pf_link_up)
    out.push_back("max_tx_rate " + std::to_string(*want.max_tx_rate) + ": the " + pf_driver +
                  " driver takes rates only while the PF has a link, and it has none now");
  return out;
}

}  // namespace sriovd::host
