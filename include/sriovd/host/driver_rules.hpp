#pragma once
// What a PF driver does not take among the VF settings, for the drivers
// sriovd has been run on (README "VF settings by driver"): checked when a
// plan is made, so that a config asking a driver for what it refuses fails
// before anything on the host changes, naming the setting and the driver.
// A driver not listed is asked, and a refusal fails the transaction (rolled
// back) with the setting named.

#include <string>
#include <vector>

#include "sriovd/host/vf_link.hpp"

namespace sriovd::host {

struct DriverRules {
  bool link_state = true;        // IFLA_VF_LINK_STATE (auto/enable/disable)
  bool min_tx_rate = true;       // a non-zero minimum rate
  bool rate_needs_link = false;  // rates only while the PF has a link
};

// nullptr: a driver not known here.
const DriverRules* driver_rules(const std::string& pf_driver);

// Why `pf_driver` would refuse `want` (one line per setting; empty: nothing
// known to be refused).
std::vector<std::string> refused_settings(const std::string& pf_driver, const VfSettings& want, bool pf_link_up);

}  // namespace sriovd::host
