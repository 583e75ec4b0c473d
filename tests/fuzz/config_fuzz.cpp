// The YAML loader on any text: it either returns a Config that its own
// emitter writes back to the same values, or throws ConfigError with
// diagnostics that name a position. Anything else (another exception, a
// crash, a hang) is a finding.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "sriovd/config/loader.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::string again;
  try {
    // What the loader accepted, the emitter must write so it reads back.
    again = sriovd::config::to_yaml(sriovd::config::parse(text, "fuzz.yaml"));
  } catch (const sriovd::config::ConfigError& e) {
    if (e.diagnostics().empty()) std::abort();  // an error that says nothing
    return 0;
  }
  try {
    (void)sriovd::config::parse(again, "emitted.yaml");
  } catch (const sriovd::config::ConfigError&) {
    std::abort();  // accepted, emitted, and then refused: the round trip is broken
  }
  return 0;
}
