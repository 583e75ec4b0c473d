#include "logging.hpp"

#include <memory>
#include <stdexcept>

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

namespace sriovd::daemon {
namespace {

// "%*" in a pattern: the syslog priority of the message as journald reads it
// from a stream (sd-daemon(3) "<N>" prefixes).
class SyslogPriorityFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    static constexpr const char* kPrefix[] = {"<7>", "<7>", "<6>", "<4>", "<3>", "<2>", "<6>"};
    const auto level = static_cast<size_t>(msg.level);
    const char* p = kPrefix[level < 7 ? level : 6];
    dest.append(p, p + 3);
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<SyslogPriorityFlag>(); }
};

spdlog::level::level_enum parse_level(const std::string& level) {
  if (!valid_log_level(level)) throw std::invalid_argument("unknown log level '" + level + "'");
  return spdlog::level::from_str(level);
}

}  // namespace

bool valid_log_level(const std::string& level) {
  for (const char* name : {"trace", "debug", "info", "warn", "error", "critical", "off"})
    if (level == name) return true;
  return false;
}

void setup_logging(LogStyle style, const std::string& level) {
  auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>("sriovd", sink);
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  if (style == LogStyle::journal) {
    formatter->add_flag<SyslogPriorityFlag>('*').set_pattern("%*%v");
  } else {
    formatter->set_pattern("%Y-%m-%d %H:%M:%S.%e %-5l %v");
  }
  logger->set_formatter(std::move(formatter));
  logger->set_level(parse_level(level));
  logger->flush_on(spdlog::level::trace);
  spdlog::set_default_logger(std::move(logger));
}

void set_log_level(const std::string& level) { spdlog::set_level(parse_level(level)); }

}  // namespace sriovd::daemon
