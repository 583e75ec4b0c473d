#include "notify.hpp"

#include <time.h>
#include <unistd.h>

#include <systemd/sd-bus.h>
#include <systemd/sd-daemon.h>
#include <systemd/sd-login.h>

#include <cstdlib>
#include <cstring>
#include <memory>

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

namespace sriovd::daemon {

namespace {

struct BusCloser {
  void operator()(sd_bus* b) const { sd_bus_flush_close_unref(b); }
};
using Bus = std::unique_ptr<sd_bus, BusCloser>;

// A service of a user manager (systemd --user) has $MANAGERPID; the system
// manager sets none. The job to ask for is the manager's that started us.
bool run_by_user_manager() { return ::getenv("MANAGERPID") != nullptr; }

// The manager's bus (the system's, or the user's), or its own socket where
// there is no bus daemon (a minimal host or session; as systemctl does).
Bus open_manager_bus() {
  const bool user = run_by_user_manager();
  sd_bus* b = nullptr;
  if ((user ? sd_bus_open_user(&b) : sd_bus_open_system(&b)) >= 0) return Bus(b);
  std::string address = "unix:path=/run/systemd/private";
  if (user) {
    const char* runtime = ::getenv("XDG_RUNTIME_DIR");
    if (!runtime || runtime[0] != '/') return nullptr;
    address = std::string("unix:path=") + runtime + "/systemd/private";
  }
  if (sd_bus_new(&b) < 0) return nullptr;
  Bus bus(b);
  if (sd_bus_set_address(b, address.c_str()) < 0 || sd_bus_start(b) < 0) return nullptr;
  return bus;
}

// This process's unit as its manager names it: a user manager's unit is
// below user@UID.service in a session, at the top where the manager is the
// only one (a container's).
std::string own_unit() {
  char* unit_raw = nullptr;
  if (run_by_user_manager() && sd_pid_get_user_unit(0, &unit_raw) >= 0 && unit_raw) {
    std::string unit(unit_raw);
    std::free(unit_raw);
    return unit;
  }
  if (sd_pid_get_unit(0, &unit_raw) < 0 || !unit_raw) return "";
  std::string unit(unit_raw);
  std::free(unit_raw);
  return unit;
}

}  // namespace

std::string systemd_job_type() {
  const std::string unit = own_unit();
  if (unit.empty()) return "";
  Bus bus = open_manager_bus();
  if (!bus) {
    spdlog::warn("systemd: no bus to ask what {}'s job is", unit);
    return "";
  }
  constexpr const char* kService = "org.freedesktop.systemd1";
  sd_bus_error error = SD_BUS_ERROR_NULL;
  sd_bus_message* reply = nullptr;
  std::string type;
  const char* unit_path = nullptr;
  if (sd_bus_call_method(bus.get(), kService, "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager",
                         "GetUnit", &error, &reply, "s", unit.c_str()) >= 0 &&
      sd_bus_message_read(reply, "o", &unit_path) >= 0) {
    const std::string path(unit_path);
    sd_bus_message_unref(reply);
    reply = nullptr;
    // Only the main process of the service: a process that merely runs in
    // a unit's cgroup (a test under a CI runner's unit) is not what a
    // restart of that unit restarts.
    uint32_t main_pid = 0;
    if (sd_bus_get_property_trivial(bus.get(), kService, path.c_str(), "org.freedesktop.systemd1.Service", "MainPID",
                                    &error, 'u', &main_pid) < 0 ||
        main_pid != static_cast<uint32_t>(::getpid())) {
      sd_bus_error_free(&error);
      return "";
    }
    uint32_t job_id = 0;
    const char* job_path = nullptr;
    if (sd_bus_get_property(bus.get(), kService, path.c_str(), "org.freedesktop.systemd1.Unit", "Job", &error, &reply,
                            "(uo)") >= 0 &&
        sd_bus_message_read(reply, "(uo)", &job_id, &job_path) >= 0 && job_id != 0) {
      char* t = nullptr;
      if (sd_bus_get_property_string(bus.get(), kService, job_path, "org.freedesktop.systemd1.Job", "JobType", &error,
                                     &t) >= 0 &&
          t) {
        type = t;
        std::free(t);
      }
    }
  }
  if (sd_bus_error_is_set(&error)) spdlog::warn("systemd: asking for {}'s job: {}", unit, error.message);
  sd_bus_error_free(&error);
  sd_bus_message_unref(reply);
  return type;
}

}  // namespace sriovd::daemon
