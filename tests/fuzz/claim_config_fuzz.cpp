// A claim's VfConfig parameters (DRA opaque parameters: whatever a user who
// may create ResourceClaims wrote) on any bytes: a ClaimVfConfig, or a
// ConfigError whose diagnostics say something. What was accepted must also
// fit a config as a claimed VF (the loader reads it back) or be refused
// there by name. Anything else (another exception, a crash, a hang, deep
// recursion) is a finding.
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string_view>

#include "sriovd/config/claim.hpp"
#include "sriovd/config/loader.hpp"

namespace {

const sriovd::config::Config& base() {
  static const sriovd::config::Config c = sriovd::config::parse(R"(version: 1
host: simulated
state_dir: /tmp/sriovd-fuzz-claim
simulated:
  physical_functions:
    - {address: "0000:3b:00.0", netdev: ens1f0, total_vfs: 4}
physical_functions:
  - {address: "0000:3b:00.0", num_vfs: 4}
)",
                                                                "fuzz-base.yaml");
  return c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  sriovd::config::ClaimedVf claimed;
  try {
    claimed.config = sriovd::config::parse_claim_vf_config(text, "claim fuzz/x");
  } catch (const sriovd::config::ConfigError& e) {
    if (e.diagnostics().empty()) std::abort();  // an error that says nothing
    return 0;
  }
  claimed.claim = "fuzz/x";
  claimed.uid = "0123456789abcdef";
  claimed.pf = base().physical_functions[0].ref;
  claimed.index = 2;
  claimed.socket = "/tmp/sriovd-fuzz-claim/x.sock";
  try {
    (void)sriovd::config::with_claims(base(), {claimed});
  } catch (const std::runtime_error& e) {
    if (std::string_view(e.what()).find("claim fuzz/x") == std::string_view::npos &&
        std::string_view(e.what()).find("do not fit") == std::string_view::npos)
      std::abort();  // refused without naming the claim
  }
  return 0;
}
