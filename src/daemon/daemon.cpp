#include "sriovd/daemon/daemon.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <net/if.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <thread>
#include <utility>

#include <spdlog/spdlog.h>

#include "control_server.hpp"
#include "dra_driver.hpp"
#include "daemon_internal.hpp"
#include "handover.hpp"
#include "host_service.hpp"
#include "metrics.hpp"
#include "notify.hpp"
#include "vf_exports.hpp"
#include "virtio_exports.hpp"
#include "sriovd/config/loader.hpp"
#include "logging.hpp"
#include "sriovd/util/peer_mapping.hpp"
#include "sriovd/util/unix_socket.hpp"
#include "sriovd/vfio/holders.hpp"
#include "sriovd/host/sysfs.hpp"
#include "sriovd/version.hpp"
#include "sriovd/virtio/net.hpp"

namespace sriovd::daemon {

using control::json;

namespace {

constexpr size_t kUdevEventsKept = 16;

// peer_limits: the share each client that connects from now on gets.
void apply_peer_limits(const config::PeerLimits& l) {
  set_default_peer_memory_limits({l.max_mappings, l.max_mib << 20U, l.max_address_space_mib << 20U});
}

}  // namespace

size_t count_vfs(const config::Config& cfg) {
  size_t n = 0;
  for (const auto& pf : cfg.physical_functions) n += pf.num_vfs;
  return n;
}

std::string summary(const config::Config& cfg) {
  return std::to_string(cfg.physical_functions.size()) + " PF(s), " + std::to_string(count_vfs(cfg)) + " VF(s), " +
         std::to_string(cfg.virtio_devices.size()) + " virtio device(s), host " + config::to_string(cfg.host);
}

Daemon::Daemon(Options options, config::Config config)
    : options_(std::move(options)),
      yaml_(config),
      config_(std::move(config)),
      loop_(io_, std::chrono::microseconds(config_.control.poll_us)),
      signals_(io_, SIGTERM, SIGINT, SIGHUP),
      watchdog_timer_(io_),
      housekeeping_timer_(io_),
      notifier_(std::make_unique<SystemdNotifier>()),
      started_(std::chrono::steady_clock::now()) {
  register_commands();
  retirer_.set_on_gone([this](const std::string& key) {
    asio::post(io_, [this, key] {
      if (!stopping_) virtio_->start_waiting_for(key, config_);
    });
  });
  apply_peer_limits(config_.peer_limits);
  irq::EngineOptions irq_options;
  irq_options.relay_threads = config_.interrupts.relay_threads;
  irq_options.busy_poll = config_.interrupts.busy_poll;
  irq_options.cpus.assign(config_.interrupts.cpus.begin(), config_.interrupts.cpus.end());
  irq_ = std::make_unique<irq::Engine>(irq_options);
  // The control socket first: it refuses to start a second daemon, which
  // must not get as far as touching the host.
  control_ = std::make_unique<ControlServer>(
      io_, config_.control, [this](const json& req, const PeerCredentials& peer) { return handle(req, peer); });
  if (!config_.metrics.listen.empty())  // before the host is touched: a port in use fails the start cleanly
    metrics_ = std::make_unique<MetricsServer>(io_, config_.metrics.listen, [this] { return metrics_snapshot(); });
  // An upgrade in place (exec) or a restart by systemd with its fd store:
  // what the predecessor handed over is taken by the exports that fit it;
  // anything wrong with it and they start afresh. Read before the host is:
  // a simulated host goes on as its predecessor left it.
  std::optional<Handover> handed = take_handover();
  // The DRA claims prepared before this start are the host's as much as
  // the file's VFs are: what runs is the file's config with them.
  const std::string records = config_.state_dir + "/dra-claims.json";
  const std::vector<ClaimRecord> prepared = read_claim_records(records);
  if (!prepared.empty() && yaml_.kubernetes.dra.enabled) {
    std::vector<config::ClaimedVf> claims;
    for (const ClaimRecord& r : prepared) claims.insert(claims.end(), r.vfs.begin(), r.vfs.end());
    config_ = config::with_claims(yaml_, claims);
  } else if (!prepared.empty()) {
    spdlog::warn("dra: {} claim(s) were prepared and kubernetes.dra is no longer configured: their VFs are restored",
                 prepared.size());
  }
  try {
    host_ = std::make_unique<HostService>(config_, options_.sysfs_root, handed ? handed->simulated_host : "");
  } catch (const std::invalid_argument& e) {
    handover_status_ = {{"error", e.what()}};
    spdlog::error("upgrade: the handover cannot be taken ({}); every device starts afresh", e.what());
    handed.reset();
    host_ = std::make_unique<HostService>(config_, options_.sysfs_root);
  }
  sessions_ = std::make_unique<SessionPool>(config_.control.session_threads,
                                            std::chrono::microseconds(config_.control.poll_us));
  virtio_ = std::make_unique<VirtioExports>(*sessions_, *irq_, retirer_, *host_);
  vf_exports_ = std::make_unique<VfExports>(*sessions_, *irq_, *host_, options_.sysfs_root);
  host_->set_release_check([this](const PciAddress& vf) { return vf_exports_->release_holders(vf); });
  // Before the host changes: a DRA driver that cannot be set up (its
  // kubeconfig, its sockets) fails the start with nothing touched.
  if (yaml_.kubernetes.dra.enabled) dra_ = make_dra(prepared);
  host_->start(config_, options_.test_stop_before_step);
  if (!prepared.empty() && !dra_) {
    write_claim_records(records, {});
    for (const ClaimRecord& r : prepared)
      std::filesystem::remove(yaml_.kubernetes.cdi_dir + "/" + yaml_.kubernetes.dra.driver + "-claim-" + r.ref.uid +
                              ".json");
  }
  std::vector<std::string> handed_macvtaps;  // their links stay
  if (handed) {
    for (const HandedVirtio& v : handed->virtio)
      if (!v.macvtap_lower.empty()) handed_macvtaps.push_back(v.name);
    virtio_->take_handover(std::move(handed->virtio));
    vf_exports_->take_handover(std::move(handed->vf_exports));
  }
  VirtioExports::remove_left_over(config_.state_dir, handed_macvtaps);
  vf_exports_->sync(config_);
  virtio_->start(config_);
  update_k8s();
}

Daemon::~Daemon() = default;

std::string Daemon::cannot_serve(const config::Config& config) {
  if (!config.kubernetes.dra.enabled) return "";
  try {
    (void)dra_api_config(config.kubernetes.dra);
  } catch (const std::exception& e) {
    return "kubernetes.dra (line " + std::to_string(config.kubernetes.dra.where.line) + "): " + e.what();
  }
  return "";
}

std::optional<config::Config> Daemon::kept_at_stop(const config::Config& yaml,
                                                   const std::vector<config::ClaimedVf>& claims) {
  if (claims.empty()) return std::nullopt;
  config::Config kept = yaml;
  for (auto& pf : kept.physical_functions) pf.vfs.clear();
  kept.virtio_devices.clear();
  kept.kubernetes.pools.clear();
  return config::with_claims(kept, claims);
}

std::vector<host::Step> Daemon::converge_to(config::Config next, bool keep_released,
                                            std::optional<size_t> stop_before_step) {
  vf_exports_->drop(&next, config_);
  virtio_->drop(&next);
  virtio_->wait_for_vf_ports();
  std::vector<host::Step> steps;
  try {
    steps = keep_released ? host_->reconcile(next, stop_before_step) : host_->apply(next);
  } catch (...) {
    vf_exports_->sync(config_);  // the host is as it was: so are the exports
    virtio_->start(config_);
    throw;
  }
  config_ = std::move(next);
  vf_exports_->sync(config_);
  virtio_->start(config_);
  return steps;
}

std::unique_ptr<DraDriver> Daemon::make_dra(std::vector<ClaimRecord> prepared) {
  DraDriver::Hooks hooks;
  // A claim's VFs go through the same journalled apply as the file's.
  hooks.apply_claims = [this](const std::vector<config::ClaimedVf>& claims) {
    converge_to(config::with_claims(yaml_, claims), true, std::exchange(options_.test_stop_before_claim_step, {}));
    update_k8s();
  };
  return std::make_unique<DraDriver>(io_, yaml_, std::move(prepared), std::move(hooks));
}

void Daemon::update_dra() {
  if (!yaml_.kubernetes.dra.enabled) {
    if (dra_) {
      dra_->remove_slices();
      dra_.reset();
    }
    return;
  }
  if (!dra_) dra_ = make_dra(read_claim_records(yaml_.state_dir + "/dra-claims.json"));
  dra_->update(yaml_, devices_json(), host_->simulated() ? host_->simulated()->root() : options_.sysfs_root);
}

std::optional<Handover> Daemon::take_handover() {
  try {
    std::optional<Handover> handed =
        options_.handover_fd ? std::optional(Handover::read(*options_.handover_fd)) : Handover::from_fd_store();
    if (!handed) return std::nullopt;  // a plain start
    if (options_.test_stop_before_takeover) {
      spdlog::warn("upgrade: stopping myself before the takeover as --test-stop-before-takeover asked");
      ::raise(SIGSTOP);
    }
    handover_status_ = handed->summary();
    spdlog::info("upgrade: taking over from sriovd pid {}: {}", handed->from_pid, handover_status_.dump());
    return handed;
  } catch (const std::exception& e) {
    handover_status_ = {{"error", e.what()}};
    spdlog::error("upgrade: the handover cannot be taken ({}); every device starts afresh", e.what());
    return std::nullopt;
  }
}

struct Daemon::PendingUpgrade {
  std::string binary;
  Handover handover;
  UniqueFd manifest;
  asio::steady_timer timer;
};

namespace {

// Runs `argv` (a binary and its arguments) with its stdout and stderr
// captured, for at most `limit`; its exit status, or -1 when it did not
// finish in time (it is killed) or could not be run.
int run_captured(const std::vector<std::string>& argv, std::chrono::milliseconds limit, std::string& out) {
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return -1;
  UniqueFd rd(pipe_fds[0]), wr(pipe_fds[1]);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, wr.get(), STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, wr.get(), STDERR_FILENO);
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, argv[0].c_str(), &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  wr.reset();
  if (rc != 0) {
    out = std::string("cannot run ") + argv[0] + ": " + std::strerror(rc);
    return -1;
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  char buf[4096];
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{rd.get(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    const ssize_t n = ::read(rd.get(), buf, sizeof buf);
    if (n <= 0) break;
    if (out.size() < 65536) out.append(buf, static_cast<size_t>(n));
  }
  int status = 0;
  if (::waitpid(pid, &status, WNOHANG) == 0) {
    // Still running past its time (or its output closed early): given
    // until the deadline, then killed.
    while (std::chrono::steady_clock::now() < deadline && ::waitpid(pid, &status, WNOHANG) == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (::waitpid(pid, &status, WNOHANG) == 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      out += " (killed: no answer within " + std::to_string(limit.count()) + " ms)";
      return -1;
    }
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string trimmed(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

}  // namespace

json Daemon::upgrade(const json& req) {
  if (upgrading_) return control::make_error(control::errc::kFailed, "an upgrade is already under way");
  if (stopping_) return control::make_error(control::errc::kFailed, "sriovd is stopping");
  const std::string binary = req.value("binary", options_.binary);
  const bool force = req.value("force", false);
  const auto refuse = [&](const std::string& why) {
    spdlog::warn("upgrade to {} refused: {}", binary, why);
    return control::make_error(control::errc::kFailed, "upgrade refused (this sriovd goes on): " + why);
  };
  if (binary.empty() || binary.front() != '/') return refuse("the binary must be an absolute path: '" + binary + "'");
  // The successor reads what this one writes, and takes the config on disk.
  std::string out;
  const int version_rc = run_captured({binary, "--handover-version"}, std::chrono::seconds(10), out);
  const std::string reads = trimmed(out);
  if (version_rc != 0) return refuse(binary + " --handover-version: " + reads);
  if (reads.empty()) return refuse(binary + " --handover-version printed nothing: not an sriovd that can take over");
  if (!reads_handover_version(reads, kHandoverVersion))
    return refuse(binary + " reads handovers of version " + reads + "; this sriovd writes version " +
                  std::to_string(kHandoverVersion));
  out.clear();
  if (run_captured({binary, "--check-config", options_.config_path}, std::chrono::seconds(30), out) != 0)
    return refuse(binary + " does not take " + options_.config_path + ": " + trimmed(out));
  // A device that cannot be handed over now refuses the upgrade, or with
  // --force is served afresh by the successor (its client's connection
  // ends): `cut` names them.
  std::vector<std::string> cut;
  auto pending = std::make_unique<PendingUpgrade>(PendingUpgrade{binary, {}, {}, asio::steady_timer(io_)});
  pending->handover.from_pid = ::getpid();
  try {
    freeze_for_handover(pending->handover, force, cut);
  } catch (const std::exception& e) {
    return refuse(e.what() + std::string(" (--force upgrades anyway, serving it afresh)"));
  }
  try {
    pending->manifest = pending->handover.write();
  } catch (const std::exception& e) {
    pending->handover.keep_from_exec();
    thaw_handover();
    return refuse(e.what());
  }
  json result = {{"binary", binary}, {"handover", pending->handover.summary()}, {"served_afresh", cut}};
  // The reply goes out first; the exec on the loop's next turns.
  upgrading_ = std::move(pending);
  upgrading_->timer.expires_after(std::chrono::milliseconds(20));
  upgrading_->timer.async_wait([this](boost::system::error_code ec) {
    if (!ec) exec_successor();
  });
  return control::make_result(std::move(result));
}

void Daemon::exec_successor() {
  PendingUpgrade& p = *upgrading_;
  // Nothing but what is handed over crosses the exec: every other fd is
  // closed by it (sockets Boost.Asio opened without close-on-exec too: a
  // listening port kept would make the successor's bind fail).
  std::vector<int> keep = p.handover.fd_numbers();
  keep.push_back(p.manifest.get());
  std::vector<int> flagged;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (const dirent* ent = ::readdir(d)) {
      const int fd = std::atoi(ent->d_name);
      if (fd < 3 || fd == ::dirfd(d) || std::find(keep.begin(), keep.end(), fd) != keep.end()) continue;
      const int flags = ::fcntl(fd, F_GETFD);
      if (flags >= 0 && !(flags & FD_CLOEXEC) && ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC) == 0) flagged.push_back(fd);
    }
    ::closedir(d);
  }
  std::vector<std::string> args = options_.argv;
  for (size_t i = 0; i < args.size(); ++i)
    if (args[i] == "--handover-fd" && i + 1 < args.size()) {
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(i), args.begin() + static_cast<std::ptrdiff_t>(i) + 2);
      break;
    }
  if (args.empty()) args.push_back(p.binary);
  args.push_back("--handover-fd");
  args.push_back(std::to_string(p.manifest.get()));
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  spdlog::info("upgrade: exec {} with {} virtio device(s) handed over", p.binary, p.handover.virtio.size());
  notifier_->reloading();
  spdlog::default_logger()->flush();
  ::execv(p.binary.c_str(), argv.data());
  const int err = errno;
  for (int fd : flagged) ::fcntl(fd, F_SETFD, ::fcntl(fd, F_GETFD) & ~FD_CLOEXEC);
  p.handover.keep_from_exec();
  thaw_handover();
  spdlog::error("upgrade: exec {} failed: {}; this sriovd goes on", p.binary, std::strerror(err));
  notifier_->ready(summary(config_));
  upgrading_.reset();
}

int Daemon::run() {
  wait_for_signal();
  // At once: an upgraded successor (the same PID) must not leave systemd's
  // watchdog waiting a whole interval after its predecessor's last ping.
  if (notifier_->watchdog_interval()) notifier_->watchdog_ping();
  arm_watchdog();
  arm_housekeeping();
  spdlog::info("sriovd {} ready: {}", kVersion, summary(config_));
  notifier_->ready(summary(config_));
  loop_.run();
  spdlog::info("sriovd stopped");
  return exit_code_;
}

void Daemon::wait_for_signal() {
  signals_.async_wait([this](boost::system::error_code ec, int signo) {
    if (ec) return;
    if (signo == SIGHUP) {
      reload("SIGHUP");
      wait_for_signal();
      return;
    }
    shutdown(signo == SIGTERM ? "SIGTERM" : "SIGINT");
  });
}

void Daemon::arm_watchdog() {
  const auto interval = notifier_->watchdog_interval();
  if (!interval) return;
  watchdog_timer_.expires_after(*interval);
  watchdog_.due = std::chrono::steady_clock::now() + *interval;
  watchdog_timer_.async_wait([this, interval = *interval](boost::system::error_code ec) {
    if (ec || stopping_) return;
    notifier_->watchdog_ping();
    const auto delay = std::chrono::steady_clock::now() - watchdog_.due;
    ++watchdog_.pings;
    if (delay > interval / 2) ++watchdog_.late;
    watchdog_.max_delay = std::max(watchdog_.max_delay, std::chrono::duration_cast<std::chrono::nanoseconds>(delay));
    arm_watchdog();
  });
}

// The adaptive policy's way back to direct bind, and nothing per interrupt.
void Daemon::arm_housekeeping() {
  housekeeping_timer_.expires_after(std::chrono::milliseconds(50));
  housekeeping_timer_.async_wait([this](boost::system::error_code ec) {
    if (ec || stopping_) return;
    irq_->housekeeping();
    // The device plugin's health follows the host twice a second.
    if (config_.kubernetes.enabled && ++k8s_ticks_ % 10 == 0) update_k8s();
    if (++housekeeping_ticks_ % 20 == 0) virtio_->follow_vf_netdevs(config_);
    // Link status follows the backend's carrier (a VF whose link drops).
    virtio_->poll_links();
    arm_housekeeping();
  });
}

// SIGTERM from systemd for a `systemctl restart` (the unit's job is a
// restart, asked over D-Bus): the vhost-user devices go to the fd store
// for the instance systemd starts next, and the host stays as it is for
// it. Any doubt (no systemd, no bus, another job, a refusal) is a stop.
bool Daemon::hand_over_to_fd_store() {
  if (!::getenv("NOTIFY_SOCKET")) return false;
  const std::string job = systemd_job_type();
  if (job != "restart" && job != "try-restart" && job != "reload-or-restart") {
    if (!job.empty()) spdlog::info("systemd job {}: a stop, not a handover", job);
    return false;
  }
  // What cannot be handed over now is served afresh by the next sriovd (a
  // restart is a restart): the rest is handed over.
  std::vector<std::string> cut;
  Handover h;
  h.from_pid = ::getpid();
  try {
    freeze_for_handover(h, true, cut);
  } catch (const std::exception& e) {
    spdlog::warn("restart by systemd: no handover ({}): the devices' clients see their connections end", e.what());
    return false;
  }
  try {
    h.store();
  } catch (const std::exception& e) {
    thaw_handover();
    spdlog::warn("restart by systemd: no handover ({}; FileDescriptorStoreMax= in the unit?)", e.what());
    return false;
  }
  virtio_->handed_over();
  vf_exports_->handed_over();
  host_->keep_for_successor();
  for (const auto& c : cut) spdlog::warn("restart by systemd: not handed over ({}): its client is cut", c);
  spdlog::info(
      "restart by systemd: {} virtio device(s) and {} VF export(s) in the fd store for the next sriovd; the host stays "
      "as it is",
      h.virtio.size(), h.vf_exports.size());
  return true;
}

void Daemon::freeze_for_handover(Handover& h, bool force, std::vector<std::string>& cut) {
  h.simulated_host = host_->simulated_state();
  h.virtio = virtio_->freeze_for_handover(force, cut);
  try {
    h.vf_exports = vf_exports_->freeze_for_handover(force, cut);
  } catch (...) {
    virtio_->thaw();
    throw;
  }
}

void Daemon::thaw_handover() {
  virtio_->thaw();
  vf_exports_->thaw();
}

void Daemon::shutdown(const char* why) {
  if (stopping_) return;
  stopping_ = true;
  spdlog::info("{}: stopping", why);
  if (upgrading_) {
    // Stopped between an upgrade's reply and its exec: no exec; the
    // devices' duplicates are closed with it.
    upgrading_->handover.keep_from_exec();
    upgrading_.reset();
    thaw_handover();  // the exports end as at any stop
  }
  if (dra_) dra_->stop();  // no claim is prepared or unprepared from here on
  const bool handed = std::string_view(why) == "SIGTERM" && hand_over_to_fd_store();
  notifier_->stopping();
  if (handed) {
    // The successor takes the host as it is: nothing is released, the
    // journal stays.
    vf_exports_->drop(nullptr, config_);
    virtio_->drop(nullptr);
    virtio_->wait_for_vf_ports();
    control_->stop();
    metrics_.reset();
    boost::system::error_code ignored;
    signals_.cancel(ignored);
    watchdog_timer_.cancel();
    housekeeping_timer_.cancel();
    return;
  }
  vf_exports_->drop(nullptr, config_);
  // Before the host is released: a VF's netdev must outlive the device
  // bridged to it (and the device's macvtap is deleted by sriovd, not by
  // the VF going away).
  virtio_->drop(nullptr);
  virtio_->wait_for_vf_ports();
  try {
    // A prepared DRA claim outlives sriovd: its pod or VM keeps the VF, its
    // settings and its driver until the kubelet unprepares it.
    const std::vector<config::ClaimedVf> claims = dra_ ? dra_->claimed() : std::vector<config::ClaimedVf>();
    if (const auto kept = kept_at_stop(yaml_, claims)) {
      const auto steps = host_->reconcile(*kept);
      spdlog::info("host released: {} change(s) undone; {} VF(s) of prepared DRA claims keep theirs", steps.size(),
                   claims.size());
    } else {
      const auto steps = host_->release_all();
      spdlog::info("host released: {} change(s) undone", steps.size());
    }
  } catch (const std::exception& e) {
    // The release transaction rolled itself back: the host stays as
    // configured and the journal keeps what to undo at the next start.
    spdlog::error("host release failed: {}", e.what());
    exit_code_ = 1;
  }
  control_->stop();
  metrics_.reset();  // its accept would keep the io_context running
  boost::system::error_code ignored;
  signals_.cancel(ignored);
  watchdog_timer_.cancel();
  housekeeping_timer_.cancel();
}

json Daemon::reload(const std::string& trigger) {
  spdlog::info("{}: reloading {}", trigger, options_.config_path);
  notifier_->reloading();
  json result;
  try {
    config::Config next = config::load(options_.config_path);
    if (const std::string no = cannot_serve(next); !no.empty()) throw std::runtime_error(no);
    const std::vector<config::ClaimedVf> claims = dra_ ? dra_->claimed() : std::vector<config::ClaimedVf>();
    if (!next.kubernetes.dra.enabled && !claims.empty())
      throw std::runtime_error("kubernetes.dra is removed while " + std::to_string(claims.size()) +
                               " VF(s) of prepared claims are held (sriovctl claims): the kubelet unprepares them "
                               "first, or a restart restores them");
    if (next.kubernetes.dra.enabled && yaml_.kubernetes.dra.enabled && next.kubernetes.dra != yaml_.kubernetes.dra)
      throw std::runtime_error("kubernetes.dra (driver, node, kubeconfig, directories) changes: that needs a restart");
    if (next.host != config_.host)
      throw std::runtime_error(std::string("host changes from ") + config::to_string(config_.host) + " to " +
                               config::to_string(next.host) + ": that needs a restart");
    if (next.control.socket != config_.control.socket)
      throw std::runtime_error("control.socket changes from " + config_.control.socket + " to " + next.control.socket +
                               ": that needs a restart");
    if (next.state_dir != config_.state_dir) throw std::runtime_error("state_dir changes: that needs a restart");
    if (next.interrupts.relay_threads != config_.interrupts.relay_threads ||
        next.interrupts.cpus != config_.interrupts.cpus || next.interrupts.busy_poll != config_.interrupts.busy_poll)
      throw std::runtime_error("interrupts (relay threads, CPUs, busy-poll) change: that needs a restart");
    if (next.kubernetes.enabled && config_.kubernetes.enabled &&
        (next.kubernetes.device_plugin_dir != config_.kubernetes.device_plugin_dir ||
         next.kubernetes.cdi_dir != config_.kubernetes.cdi_dir))
      throw std::runtime_error("kubernetes.device_plugin_dir or cdi_dir changes: that needs a restart");
    if (next.metrics != config_.metrics)
      throw std::runtime_error("metrics (listen address) changes: that needs a restart");
    if (next.control.session_threads != config_.control.session_threads)
      throw std::runtime_error("control.session_threads changes: that needs a restart");
    // A reload that would take a prepared claim's VF is refused here,
    // naming the claim.
    config::Config with = config::with_claims(next, claims);
    const std::vector<host::Step> steps = converge_to(std::move(with), false);
    yaml_ = std::move(next);
    apply_peer_limits(config_.peer_limits);
    control_->update_access(config_.control);
    loop_.set_max_window(std::chrono::microseconds(config_.control.poll_us));
    sessions_->set_poll_window(std::chrono::microseconds(config_.control.poll_us));
    if (!options_.log_level) set_log_level(config_.log_level);
    ++reloads_.ok;
    reloads_.last_error.clear();
    update_k8s();
    try {
      update_dra();
    } catch (const std::exception& e) {
      spdlog::error("dra: {}", e.what());
    }
    spdlog::info("reloaded: {}", summary(config_));
    result = control::make_result({{"reloaded", true}, {"summary", summary(config_)}, {"changes", steps_json(steps)}});
  } catch (const config::ConfigError& e) {
    ++reloads_.failed;
    reloads_.last_error = e.what();
    spdlog::error("reload refused, running configuration unchanged:\n{}", e.what());
    json diags = json::array();
    for (const auto& d : e.diagnostics())
      diags.push_back({{"file", d.file}, {"line", d.line}, {"column", d.column}, {"message", d.message}});
    result = control::make_error(control::errc::kFailed,
                                 "reload refused, running configuration unchanged: " + std::string(e.what()));
    result["error"]["diagnostics"] = diags;
  } catch (const std::exception& e) {
    ++reloads_.failed;
    reloads_.last_error = e.what();
    spdlog::error("reload refused, running configuration unchanged: {}", e.what());
    result = control::make_error(control::errc::kFailed,
                                 "reload refused, running configuration unchanged: " + std::string(e.what()));
  }
  notifier_->ready(summary(config_));
  return result;
}

void Daemon::register_commands() {
  commands_["version"] = [](const json&, const PeerCredentials&) {
    return control::make_result({{"version", kVersion}, {"config_schema", kConfigSchemaVersion}});
  };
  commands_["status"] = [this](const json&, const PeerCredentials&) { return control::make_result(status_json()); };
  commands_["devices"] = [this](const json&, const PeerCredentials&) {
    return control::make_result(devices_json(true));
  };
  commands_["routes"] = [this](const json&, const PeerCredentials&) { return control::make_result(routes_json()); };
  commands_["stats"] = [this](const json&, const PeerCredentials&) { return control::make_result(stats_json()); };
  commands_["reload"] = [this](const json&, const PeerCredentials& peer) {
    return reload("control request from pid " + std::to_string(peer.pid));
  };
  commands_["udev-event"] = [this](const json& req, const PeerCredentials&) { return udev_event(req); };
  commands_["plan"] = [this](const json&, const PeerCredentials&) {
    // What a reload of the file on disk would change, without acting.
    config::Config next = config::load(options_.config_path);
    return control::make_result({{"config", options_.config_path}, {"steps", steps_json(host_->plan(next))}});
  };
  commands_["release"] = [this](const json& req, const PeerCredentials&) { return release(req); };
  commands_["simulate-fault"] = [this](const json& req, const PeerCredentials&) { return simulate_fault(req); };
  commands_["simulate-link"] = [this](const json& req, const PeerCredentials&) { return simulate_link(req); };
  commands_["simulate-interrupt"] = [this](const json& req, const PeerCredentials&) { return simulate_interrupt(req); };
  commands_["upgrade"] = [this](const json& req, const PeerCredentials&) { return upgrade(req); };
  commands_["claims"] = [this](const json&, const PeerCredentials&) {
    if (!dra_) return control::make_error(control::errc::kBadRequest, "claims: kubernetes.dra is not configured");
    return control::make_result({{"driver", yaml_.kubernetes.dra.driver}, {"claims", dra_->claims_json()}});
  };
}

json Daemon::handle(const json& request, const PeerCredentials& peer) {
  const std::string cmd = request["cmd"].get<std::string>();
  auto it = commands_.find(cmd);
  if (it == commands_.end()) {
    std::string known;
    for (const auto& [name, fn] : commands_) known += (known.empty() ? "" : ", ") + name;
    return control::make_error(control::errc::kUnknownCommand, "unknown command '" + cmd + "' (known: " + known + ")");
  }
  return it->second(request, peer);
}

// Gives VFs back to the host until the next reload: one VF (by its own
// address, or PF and index), or every VF of a PF the config assigns (PF
// alone). A PF is named as the config names it, by address or by netdev,
// either way round.
json Daemon::release(const json& req) {
  std::optional<PciAddress> pf;
  std::vector<unsigned> indices;
  if (req.contains("device")) {
    auto dev = req["device"].is_string() ? PciAddress::parse(req["device"].get<std::string>()) : std::nullopt;
    if (!dev) return control::make_error(control::errc::kBadRequest, "release: \"device\" must be a PCI address");
    auto id = host::resolve_vf(host_->simulated() ? host_->simulated()->root() : options_.sysfs_root, *dev);
    if (!id) return control::make_error(control::errc::kBadRequest, "release: " + dev->to_string() + " is not a VF");
    pf = id->pf;
    indices.push_back(id->index);
  } else if (req.contains("pf") && req["pf"].is_string() && (!req.contains("vf") || req["vf"].is_number_unsigned())) {
    const std::string name = req["pf"].get<std::string>();
    const config::PfConfig* cfg = nullptr;
    for (const auto& p : config_.physical_functions) {
      const auto addr = host_->pf_address(p.ref);
      if (p.ref.netdev == name || (addr && addr->to_string() == name) || (addr && host_->pf_netdev(*addr) == name)) {
        cfg = &p;
        pf = addr;
      }
    }
    if (!cfg || !pf)
      return control::make_error(control::errc::kBadRequest, "release: PF '" + name + "' is not configured");
    if (req.contains("vf")) {
      indices.push_back(req["vf"].get<unsigned>());
    } else {
      for (const auto& vf : cfg->vfs)
        if (vf.assign) indices.push_back(vf.index);
      if (indices.empty())
        return control::make_error(control::errc::kBadRequest, "release: PF '" + name + "' has no assigned VF");
    }
  } else {
    return control::make_error(control::errc::kBadRequest,
                               "release: give {\"device\": VF address}, {\"pf\": PF, \"vf\": index} or {\"pf\": PF}");
  }
  // sriovd lets go of the VFs before the host layer takes them off vfio-pci.
  const PciAddress pf_addr = *pf;
  vf_exports_->release(pf_addr, indices);
  std::vector<host::Step> steps;
  try {
    virtio_->wait_for_vf_ports();
    steps = host_->release_vfs(config_, pf_addr, indices);
  } catch (...) {
    vf_exports_->sync(config_);
    throw;
  }
  std::string released;
  for (unsigned i : indices)
    released += (released.empty() ? "" : ", ") + pf_addr.to_string() + " VF " + std::to_string(i);
  return control::make_result({{"released", released}, {"changes", steps_json(steps)}});
}

// Simulated host only: a PF's link goes down or comes back (the carrier
// its netdev reports), as a cable or a switch port would make it.
json Daemon::simulate_link(const json& req) {
  host::SimulatedKernel* sim = host_->simulated();
  if (!sim) return control::make_error(control::errc::kBadRequest, "simulate-link: only with host: simulated");
  const auto pf =
      req.contains("pf") && req["pf"].is_string() ? PciAddress::parse(req["pf"].get<std::string>()) : std::nullopt;
  if (!pf || !req.contains("up") || !req["up"].is_boolean())
    return control::make_error(control::errc::kBadRequest,
                               "simulate-link: give {\"pf\": PF address, \"up\": true|false}");
  sim->set_pf_link(*pf, req["up"].get<bool>());
  update_k8s();
  return control::make_result({{"pf", pf->to_string()}, {"link", req["up"].get<bool>() ? "up" : "down"}});
}

// Simulated host only: inject a fault into a sysfs write or VF setting.
json Daemon::simulate_fault(const json& req) {
  host::SimulatedKernel* sim = host_->simulated();
  if (!sim) return control::make_error(control::errc::kBadRequest, "simulate-fault: only with host: simulated");
  if (!req.contains("path") || !req["path"].is_string())
    return control::make_error(control::errc::kBadRequest, "simulate-fault: \"path\" (a substring) is required");
  host::SimulatedKernel::Fault f;
  f.path_contains = req["path"].get<std::string>();
  f.error = req.value("errno", EIO);
  f.skip = req.value("skip", 0U);
  f.times = req.value("times", 1U);
  sim->inject(f);
  return control::make_result({{"injected", f.path_contains}, {"errno", f.error}});
}

// Simulated host only: an exported VF raises MSI-X vector N, as its
// device would (the interrupt takes the export's route and policy).
json Daemon::simulate_interrupt(const json& req) {
  if (!host_->simulated())
    return control::make_error(control::errc::kBadRequest, "simulate-interrupt: only with host: simulated");
  if (!req.contains("device") || !req["device"].is_string() || !req.contains("vector") ||
      !req["vector"].is_number_unsigned())
    return control::make_error(control::errc::kBadRequest,
                               "simulate-interrupt: \"device\" (a VF address) and \"vector\" are required");
  const std::string device = req["device"].get<std::string>();
  const auto vector = req["vector"].get<uint64_t>();
  std::string why;
  unsigned vectors = 0;
  bool wired = false;
  const bool served = vf_exports_->with_proxy(device, why, [&](vfio_user::VfProxy& proxy) {
    vectors = proxy.msix_layout().vectors;
    if (vector >= vectors) return;
    wired = proxy.route(static_cast<unsigned>(vector)).has_value();
    if (wired) proxy.device().trigger(vfio::kMsixIrq, static_cast<unsigned>(vector));
  });
  if (!served) return control::make_error(control::errc::kBadRequest, "simulate-interrupt: " + why);
  if (vector >= vectors)
    return control::make_error(control::errc::kBadRequest,
                               "simulate-interrupt: " + device + " has " + std::to_string(vectors) + " MSI-X vectors");
  return control::make_result({{"device", device}, {"vector", vector}, {"raised", wired}});
}

// A VF came or went (udev/90-sriovd.rules runs `sriovctl udev-event`).
// Answers whether the VF belongs to a configured PF.
json Daemon::udev_event(const json& req) {
  const std::string action = req.value("action", "");
  const std::string device = req.value("device", "");
  if (action != "add" && action != "remove" && action != "change" && action != "bind" && action != "unbind")
    return control::make_error(control::errc::kBadRequest,
                               "udev-event: \"action\" must be add, remove, change, bind or unbind");
  auto vf_addr = PciAddress::parse(device);
  if (!vf_addr)
    return control::make_error(control::errc::kBadRequest,
                               "udev-event: \"device\" must be a PCI address, got '" + device + "'");
  // On remove the sysfs node is gone; udev passes the PF it remembered.
  std::optional<PciAddress> pf_addr;
  std::optional<unsigned> index;
  const std::string sysfs_root = host_->simulated() ? host_->simulated()->root() : options_.sysfs_root;
  if (auto id = host::resolve_vf(sysfs_root, *vf_addr)) {
    pf_addr = id->pf;
    index = id->index;
  } else if (req.contains("pf") && req["pf"].is_string()) {
    pf_addr = PciAddress::parse(req["pf"].get<std::string>());
  }
  bool managed = false;
  if (pf_addr) {
    for (const auto& pf : config_.physical_functions) {
      std::optional<PciAddress> configured = pf.ref.address;
      if (!configured && !pf.ref.netdev.empty()) configured = host::pci_address_of_netdev(sysfs_root, pf.ref.netdev);
      if (configured == pf_addr) managed = true;
    }
  }
  ++udev_events_total_;
  udev_events_.push_back({action, vf_addr->to_string(), pf_addr ? pf_addr->to_string() : "", managed});
  if (udev_events_.size() > kUdevEventsKept) udev_events_.pop_front();
  spdlog::info("udev: {} {} (PF {}){}", action, vf_addr->to_string(), pf_addr ? pf_addr->to_string() : "unknown",
               managed ? ", managed" : ", not ours");
  if (managed && action == "add") {
    // A VF of ours appeared (a PF came back, VFs were re-created): bring it
    // to what the config says, after this reply has gone to udev.
    asio::post(io_, [this] {
      try {
        const auto steps = host_->reconcile(config_);
        spdlog::info("udev: reconciled, {} change(s)", steps.size());
        vf_exports_->sync(config_);
        update_k8s();
      } catch (const std::exception& e) {
        spdlog::error("udev: reconcile failed: {}", e.what());
      }
    });
  }
  // The device plugin tells the kubelet of a VF that went at once.
  if (managed && config_.kubernetes.enabled) asio::post(io_, [this] { update_k8s(); });
  json result = {{"managed", managed}, {"device", vf_addr->to_string()}};
  if (pf_addr) result["pf"] = pf_addr->to_string();
  if (index) result["vf_index"] = *index;
  return control::make_result(result);
}

}  // namespace sriovd::daemon
