#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "sriovd/config/claim.hpp"
#include "sriovd/config/config.hpp"
#include "sriovd/host/reconciler.hpp"
#include "sriovd/control/protocol.hpp"
#include "sriovd/irq/engine.hpp"
#include "sriovd/k8s/device_plugin.hpp"
#include "sriovd/util/polling_loop.hpp"
#include "sriovd/util/session_threads.hpp"
#include "sriovd/util/retirer.hpp"
#include "sriovd/util/asio.hpp"

namespace prometheus {
struct MetricFamily;
}

namespace sriovd::daemon {

// The daemon's own parts (src/daemon/): the control socket's server, the
// host service and sd_notify.
class ControlServer;
class DraDriver;
struct ClaimRecord;
class HostService;
class MetricsServer;
class SystemdNotifier;
class VfExports;
class VirtioExports;
struct PeerCredentials;

struct Options {
  std::string config_path;
  std::optional<std::string> log_level;  // --log-level overrides the file
  std::string sysfs_root = "/sys";       // resolves udev events in system mode
  // Crash tests: the daemon stops itself (SIGSTOP) before this step of its
  // first apply, so a test can SIGKILL it mid-transaction.
  std::optional<size_t> test_stop_before_step;
  // ... and before this step of the first DRA claim's apply (a prepare or
  // an unprepare).
  std::optional<size_t> test_stop_before_claim_step;
  // An upgrade in place: the predecessor's handover manifest (handover.hpp).
  std::optional<int> handover_fd;
  // Crash tests: a successor stops itself (SIGSTOP) before it takes over.
  bool test_stop_before_takeover = false;
  // How this process was started, for the exec of an upgrade: the binary's
  // path as it was then (the package may replace the file) and argv.
  std::string binary;
  std::vector<std::string> argv;
};

struct Handover;

// The daemon's control thread: owns the io_context, the signals, the control
// API, the host layer and the running configuration. Construction applies
// the config to the host (throwing, with the host rolled back, if it
// cannot); run() serves until SIGTERM/SIGINT, releases the host and returns
// the process exit code.
class Daemon {
 public:
  Daemon(Options options, config::Config config);
  ~Daemon();

  // Why a valid config cannot be served as it is, "" when it can: the DRA
  // driver's way to the API server (a kubeconfig that cannot be read, no
  // service account). Refused at --check-config, at start and at a reload,
  // with nothing changed.
  static std::string cannot_serve(const config::Config& config);
  // The configs a stop leaves the host at: PFs keep their VFs, only the
  // prepared claims' VFs keep their settings and drivers (a stop never
  // undoes a claim); none when nothing is prepared (all is released).
  static std::optional<config::Config> kept_at_stop(const config::Config& yaml,
                                                    const std::vector<config::ClaimedVf>& claims);

  int run();

 private:
  using Command = std::function<control::json(const control::json&, const PeerCredentials&)>;

  void register_commands();
  void wait_for_signal();
  void arm_watchdog();
  void arm_housekeeping();
  void shutdown(const char* why);

  // The host, the exports and the virtio devices converged to `next` (the
  // file's config with the prepared claims in it); on failure all is as it
  // was and this throws. keep_released: VFs released by `sriovctl release`
  // stay released (a claim's apply), else a reload's fresh start.
  std::vector<host::Step> converge_to(config::Config next, bool keep_released,
                                      std::optional<size_t> stop_before_step = std::nullopt);
  // The DRA driver (kubernetes.dra) as `yaml_` asks: made, kept, or gone.
  void update_dra();
  std::unique_ptr<DraDriver> make_dra(std::vector<ClaimRecord> prepared);

  // Re-reads the config file; a file that fails validation, or that changes
  // what cannot change while running, leaves everything as it was.
  control::json reload(const std::string& trigger);

  control::json handle(const control::json& request, const PeerCredentials& peer);
  control::json status_json() const;
  // read_settings: each VF's settings as the PF's driver holds them, read
  // back (a netlink request per VF: for `devices`, not for every scrape).
  control::json devices_json(bool read_settings = false) const;
  control::json stats_json() const;
  // The kubelet device plugin's pools as the host is now (kubernetes.cpp):
  // members from the config, health from devices_json().
  std::vector<k8s::Pool> k8s_pools() const;
  void update_k8s();
  // What a Prometheus scrape gets (metrics.cpp); on the control thread.
  std::vector<prometheus::MetricFamily> metrics_snapshot() const;
  control::json routes_json() const;
  // Prometheus families of the routes (metrics.cpp).
  void route_metrics(std::vector<prometheus::MetricFamily>& out) const;
  control::json control_loop_json() const;
  control::json session_threads_json() const;
  control::json udev_event(const control::json& request);
  control::json release(const control::json& request);
  control::json simulate_fault(const control::json& request);
  control::json simulate_link(const control::json& request);
  control::json simulate_interrupt(const control::json& request);
  // `sriovctl upgrade` (handover.hpp): checks the successor binary, freezes
  // what is handed over, replies, and exec's it on the next turn.
  control::json upgrade(const control::json& request);
  void exec_successor();
  bool hand_over_to_fd_store();
  // Every virtio device and VF export frozen into `h` (see their
  // freeze_for_handover: `force`, `cut`); thaw_handover(): it did not happen.
  void freeze_for_handover(Handover& h, bool force, std::vector<std::string>& cut);
  // The predecessor's handover (--handover-fd or systemd's fd store), or
  // none; handover_status_ says which, or why it cannot be taken.
  std::optional<Handover> take_handover();
  void thaw_handover();

  Options options_;
  // The file's config, and what runs: it with the prepared DRA claims' VFs
  // (config::with_claims).
  config::Config yaml_;
  config::Config config_;
  asio::io_context io_;
  PollingLoop loop_;  // runs io_ (control.poll_us)
  // Closes the ports of stopped virtio devices (taps, AF_PACKET and AF_XDP
  // sockets, macvtaps) off the control thread; outlives virtio_, and io_
  // outlives it (its on_gone posts there).
  Retirer retirer_;
  asio::signal_set signals_;
  asio::steady_timer watchdog_timer_;
  // The watchdog's pings: when the next is due, how many were sent, how
  // many more than half an interval late (systemd kills at two intervals),
  // and the latest one (sriovd_watchdog_* metrics: a stalled control thread).
  struct WatchdogStats {
    std::chrono::steady_clock::time_point due;
    uint64_t pings = 0;
    uint64_t late = 0;
    std::chrono::nanoseconds max_delay{0};
  } watchdog_;
  asio::steady_timer housekeeping_timer_;
  std::unique_ptr<SystemdNotifier> notifier_;
  std::unique_ptr<irq::Engine> irq_;
  // The threads that serve the VMMs' sessions: after the engine (their
  // devices use it), before the exports (which live on them).
  std::unique_ptr<SessionPool> sessions_;
  std::unique_ptr<HostService> host_;
  // The virtio devices, their transports and ports (src/daemon/virtio_exports.hpp).
  std::unique_ptr<VirtioExports> virtio_;
  unsigned housekeeping_ticks_ = 0;
  // The VF exports over vfio-user (src/daemon/vf_exports.hpp).
  std::unique_ptr<VfExports> vf_exports_;
  std::unique_ptr<ControlServer> control_;
  int exit_code_ = 0;
  std::map<std::string, Command> commands_;
  std::chrono::steady_clock::time_point started_;
  bool stopping_ = false;
  // An upgrade between its reply and its exec; what this process took
  // over at its start (status), or why it could not.
  struct PendingUpgrade;
  std::unique_ptr<PendingUpgrade> upgrading_;
  control::json handover_status_;

  struct ReloadStats {
    uint64_t ok = 0;
    uint64_t failed = 0;
    std::string last_error;
  } reloads_;

  struct UdevEvent {
    std::string action;
    std::string device;
    std::string pf;
    bool managed = false;
  };
  std::deque<UdevEvent> udev_events_;  // the most recent few, for `status`
  uint64_t udev_events_total_ = 0;
  std::unique_ptr<k8s::NodeAgent> k8s_;  // with a kubernetes section
  unsigned k8s_ticks_ = 0;
  mutable std::map<std::pair<std::string, uint16_t>, std::string> k8s_ids_;  // (PF, VF index) -> address last seen
  // The DRA driver: after the host and the exports (its claims' applies
  // use them), before the metrics.
  std::unique_ptr<DraDriver> dra_;
  // Last, so it goes first: its scrapes read everything above.
  std::unique_ptr<MetricsServer> metrics_;
};

}  // namespace sriovd::daemon
