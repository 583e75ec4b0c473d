#include "notify.hpp"

#include <time.h>

#include <systemd/sd-daemon.h>

#include <spdlog/spdlog.h>

namespace sriovd::daemon {

SystemdNotifier::SystemdNotifier() {
  uint64_t usec = 0;
  if (sd_watchdog_enabled(0, &usec) > 0 && usec > 0) watchdog_interval_ = std::chrono::microseconds(usec / 2);
}

void SystemdNotifier::send(const std::string& state) {
  const int rc = sd_notify(0, state.c_str());
  if (rc < 0) spdlog::warn("sd_notify({}) failed: {}", state, std::strerror(-rc));
}

void SystemdNotifier::ready(const std::string& text) { send("READY=1\nSTATUS=" + text); }

void SystemdNotifier::reloading() {
  // Type=notify-reload (systemd 253+) wants MONOTONIC_USEC with RELOADING=1;
  // older managers ignore the extra field.
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  const auto usec = static_cast<uint64_t>(ts.tv_sec) * 1000000U + static_cast<uint64_t>(ts.tv_nsec) / 1000U;
  send("RELOADING=1\nMONOTONIC_USEC=" + std::to_string(usec));
}

void SystemdNotifier::stopping() { send("STOPPING=1"); }
void SystemdNotifier::status(const std::string& text) { send("STATUS=" + text); }
void SystemdNotifier::watchdog_ping() { send("WATCHDOG=1"); }

}  // namespace sriovd::daemon
