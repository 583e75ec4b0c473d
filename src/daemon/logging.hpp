#pragma once

#include <string>

namespace sriovd::daemon {

enum class LogStyle {
  human,    // timestamps and level names, for a terminal (--foreground)
  journal,  // "<N>" syslog priority prefixes, no timestamps: journald adds its own
};

// Points spdlog's default logger at stderr in the given style. Throws
// std::invalid_argument for an unknown level name.
void setup_logging(LogStyle style, const std::string& level);
void set_log_level(const std::string& level);

// True when `level` is one of trace, debug, info, warn, error, critical, off.
bool valid_log_level(const std::string& level);

}  // namespace sriovd::daemon
