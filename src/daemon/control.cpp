// The control API's views of the daemon: what `sriovctl status`, `devices`,
// `routes` and `stats` show. Read-only; on the control thread.
#include <unistd.h>

#include <algorithm>
#include <variant>

#include <spdlog/spdlog.h>

#include "control_server.hpp"
#include "dra_driver.hpp"
#include "daemon_internal.hpp"
#include "host_service.hpp"
#include "metrics.hpp"
#include "notify.hpp"
#include "vf_exports.hpp"
#include "virtio_exports.hpp"
#include "sriovd/daemon/daemon.hpp"
#include "sriovd/vfio/holders.hpp"
#include "sriovd/version.hpp"
#include "sriovd/virtio/net.hpp"

namespace sriovd::daemon {

using control::json;

namespace {

// The binary this process runs was replaced or removed since it started
// (a package upgrade: the daemon is not restarted under running VMs).
bool binary_replaced() {
  char target[4096];
  const ssize_t n = ::readlink("/proc/self/exe", target, sizeof target - 1);
  static constexpr std::string_view kDeleted = " (deleted)";
  return n > 0 && std::string_view(target, static_cast<size_t>(n)).ends_with(kDeleted);
}

}  // namespace

json Daemon::status_json() const {
  const auto uptime = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - started_);
  json events = json::array();
  for (const auto& e : udev_events_)
    events.push_back({{"action", e.action}, {"device", e.device}, {"pf", e.pf}, {"managed", e.managed}});
  return {
      {"version", kVersion},
      {"binary_replaced", binary_replaced()},
      {"pid", ::getpid()},
      {"state", stopping_ ? "stopping" : "running"},
      {"host", config::to_string(config_.host)},
      {"config", options_.config_path},
      {"control_socket", config_.control.socket},
      {"control_loop", control_loop_json()},
      {"session_threads", session_threads_json()},
      {"log_level", spdlog::level::to_string_view(spdlog::get_level()).data()},
      {"uptime_s", uptime.count()},
      {"physical_functions", config_.physical_functions.size()},
      {"vfs", count_vfs(config_)},
      {"virtio_devices", config_.virtio_devices.size()},
      {"watchdog_usec", notifier_->watchdog_interval() ? notifier_->watchdog_interval()->count() * 2 : 0},
      {"reloads", {{"ok", reloads_.ok}, {"failed", reloads_.failed}, {"last_error", reloads_.last_error}}},
      {"handover", handover_status_},
      {"udev_events", events},
      {"kubernetes", k8s_ ? k8s_->status() : json(nullptr)},
      {"dra", dra_ ? dra_->status() : json(nullptr)},
      {"metrics", metrics_ ? json{{"listen", metrics_->listen()}, {"port", metrics_->port()}} : json(nullptr)},
  };
}

// The control thread's polling (control.poll_us): whether it polls now,
// how often that found work, the CPU it spent.
json Daemon::control_loop_json() const {
  const PollStats& s = loop_.stats();
  return {{"poll_us", std::chrono::duration_cast<std::chrono::microseconds>(loop_.window().max()).count()},
          {"score", loop_.window().score()},
          {"polling", loop_.window().polling()},
          {"polls", s.polls},
          {"hits", s.hits},
          {"polled_us", s.polled_ns / 1000}};
}

// The session threads: how many exports each serves, the CPU it has used
// (read from the kernel: a status never waits for a session thread).
json Daemon::session_threads_json() const {
  json out = json::array();
  for (size_t i = 0; i < sessions_->size(); ++i) {
    const SessionThread& t = sessions_->at(i);
    const PollStats polls = t.poll_stats();
    out.push_back({{"thread", i},
                   {"sessions", t.sessions()},
                   {"cpu_ms", t.cpu_ns() / 1000000},
                   {"polls", polls.polls},
                   {"hits", polls.hits},
                   {"polled_us", polls.polled_ns / 1000}});
  }
  return out;
}

json Daemon::devices_json(bool read_settings) const {
  json out = host_->devices_json(config_, read_settings);
  out["virtio_devices"] = virtio_->devices_json(config_);
  out["vfio_user_exports"] = vf_exports_->exports_json();
  // VFs no export serves any more whose device fd a VMM still holds: they
  // stay on vfio-pci, out of use, until it lets go.
  out["held_vfs"] = vf_exports_->held_json();
  return out;
}

json Daemon::routes_json() const {
  json routes = json::array();
  for (const auto& r : irq_->list()) {
    json j = counters_json(r.stats, irq::kRouteCounters);
    j.update({{"id", r.id},
              {"device", r.device},
              {"vector", r.vector},
              {"policy", irq::to_string(r.policy)},
              {"mode", irq::to_string(r.mode)},
              {"masked", r.masked},
              {"pending", r.pending},
              {"sink", r.has_sink},
              {"sink_blocked", r.sink_blocked}});
    routes.push_back(std::move(j));
  }
  return {
      {"routes", routes}, {"relay_threads", irq_->options().relay_threads}, {"busy_poll", irq_->options().busy_poll}};
}

json Daemon::stats_json() const {
  irq::RouteStats sum;
  uint64_t count = 0;
  for (const auto& r : irq_->list()) {
    ++count;
    for (const auto& c : irq::kRouteCounters) sum.*c.field += r.stats.*c.field;
  }
  json totals = counters_json(sum, irq::kRouteCounters);
  totals["routes"] = count;
  const auto& c = control_->stats();
  return {{"control",
           {{"connections", c.connections},
            {"active", c.active},
            {"requests", c.requests},
            {"errors", c.errors},
            {"rejected_peers", c.rejected_peers},
            {"evicted", c.evicted}}},
          {"control_loop", control_loop_json()},
          {"reloads", {{"ok", reloads_.ok}, {"failed", reloads_.failed}}},
          {"udev_events", udev_events_total_},
          {"routes", totals}};
}

}  // namespace sriovd::daemon
