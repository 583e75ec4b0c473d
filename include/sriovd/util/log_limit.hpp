#pragma once
// A log line a peer can make the daemon write at will (a vhost-user
// SEND_RARP, a migration state change, DMA logging toggled, a refused
// message) goes out at most kBurst times a second per client and event;
// the lines held back are counted and said with the next one that goes
// out. One LogLimit per event in each client's session object; control
// plane only (no lock).

#include <chrono>
#include <cstdint>
#include <utility>

#include <spdlog/spdlog.h>

namespace sriovd {

class LogLimit {
 public:
  static constexpr unsigned kBurst = 10;
  // True: log now. `held` is then how many lines were held back since the
  // last one that went out (to be said with this one).
  bool allow(uint64_t& held) {
    const auto now = std::chrono::steady_clock::now();
    if (now - window_ >= std::chrono::seconds(1)) {
      window_ = now;
      logged_ = 0;
    }
    if (logged_ >= kBurst) {
      ++held_;
      ++held_total_;
      return false;
    }
    ++logged_;
    held = held_;
    held_ = 0;
    return true;
  }
  // Every line held back so far.
  [[nodiscard]] uint64_t held_total() const { return held_total_; }

 private:
  std::chrono::steady_clock::time_point window_{};
  unsigned logged_ = 0;
  uint64_t held_ = 0;
  uint64_t held_total_ = 0;
};

// Logs through `limit`: a line held back builds no text.
template <typename... Args>
void log_limited(LogLimit& limit, spdlog::level::level_enum level, fmt::format_string<Args...> format, Args&&... args) {
  uint64_t held = 0;
  if (!limit.allow(held)) return;
  if (held == 0)
    spdlog::log(level, format, std::forward<Args>(args)...);
  else
    spdlog::log(level, "{} ({} more like it not logged)", fmt::format(format, std::forward<Args>(args)...), held);
}

}  // namespace sriovd
