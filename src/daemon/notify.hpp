#pragma once

#include <chrono>
#include <optional>
#include <string>

namespace sriovd::daemon {

// The sd_notify(3) protocol towards systemd. Every call is a no-op when the
// daemon was not started by systemd with Type=notify (no NOTIFY_SOCKET).
class SystemdNotifier {
 public:
  SystemdNotifier();

  void ready(const std::string& status);
  void reloading();
  void stopping();
  void status(const std::string& text);
  void watchdog_ping();

  // The interval at which to ping, half of WatchdogSec, when systemd asked
  // for pings.
  [[nodiscard]] std::optional<std::chrono::microseconds> watchdog_interval() const { return watchdog_interval_; }

 private:
  void send(const std::string& state);
  std::optional<std::chrono::microseconds> watchdog_interval_;
};

// The type of the job systemd runs for this process's unit now
// ("restart", "stop", ...), asked over D-Bus; "" when there is none or
// no one to ask.
std::string systemd_job_type();

}  // namespace sriovd::daemon
