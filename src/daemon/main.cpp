// sriovd: the SR-IOV device assignment daemon.
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <iostream>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "sriovd/config/loader.hpp"
#include "sriovd/daemon/daemon.hpp"
#include "handover.hpp"
#include "logging.hpp"
#include "sriovd/host/host_control.hpp"
#include "sriovd/host/netlink_vf_link.hpp"
#include "sriovd/host/reconciler.hpp"
#include "sriovd/host/state.hpp"
#include "sriovd/version.hpp"

namespace {

constexpr const char* kDefaultConfig = "/etc/sriovd/sriovd.yaml";

// Exit codes, as in sysexits(3) where one fits.
constexpr int kExitUsage = 64;
constexpr int kExitConfig = 78;  // EX_CONFIG
constexpr int kExitFailure = 1;

// --check-config on the host the file is for (host: system, every PF
// present): what applying it would meet that the file alone cannot say - a
// setting the PF's driver refuses, a num_vfs above sriov_totalvfs, VFs in
// use by others. Reads only. "" when it would apply; the reason otherwise.
std::string check_on_this_host(const sriovd::config::Config& cfg, const std::string& sysfs_root) {
  using namespace sriovd;
  if (cfg.host != config::HostMode::system || cfg.physical_functions.empty()) return "";
  host::RealSysfs sysfs(sysfs_root);
  host::NetlinkVfLink vf_link;
  host::HostControl control(sysfs, vf_link);
  for (const auto& pf : cfg.physical_functions) {
    const auto addr = pf.ref.address ? pf.ref.address : control.resolve_netdev(pf.ref.netdev);
    if (!addr || !control.exists(*addr)) {
      std::printf("note: PF %s is not on this host: its driver's rules are not checked\n", pf.ref.to_string().c_str());
      return "";
    }
  }
  // Planned with the journal of the daemon that may be running (what it
  // changed is its own, not someone else's); plan() only reads it.
  std::unique_ptr<host::Reconciler> reconciler;
  try {
    reconciler = std::make_unique<host::Reconciler>(control, host::StateFile(cfg.state_dir + "/state.json"));
  } catch (const std::exception& e) {
    std::printf("note: cannot read the journal (%s): the host is not checked\n", e.what());
    return "";
  }
  std::string problem;
  try {
    (void)reconciler->plan(cfg);
  } catch (const std::exception& e) {
    problem = e.what();
  }
  return problem;
}

// --check-config FILE: validated, and planned against this host when its
// PFs are here; nothing is touched.
int check_config(const std::string& check_path, const std::string& sysfs_root) {
  try {
    const auto cfg = sriovd::config::load(check_path);
    if (const std::string no = sriovd::daemon::Daemon::cannot_serve(cfg); !no.empty()) {
      std::fprintf(stderr, "%s: valid, but %s\n", check_path.c_str(), no.c_str());
      return kExitConfig;
    }
    if (const std::string problem = check_on_this_host(cfg, sysfs_root); !problem.empty()) {
      std::fprintf(stderr, "%s: valid, but this host cannot apply it: %s\n", check_path.c_str(), problem.c_str());
      return kExitConfig;
    }
    std::printf("%s: OK (host %s, %zu PF(s), %zu virtio device(s))\n", check_path.c_str(),
                sriovd::config::to_string(cfg.host), cfg.physical_functions.size(), cfg.virtio_devices.size());
    return 0;
  } catch (const sriovd::config::ConfigError& e) {
    for (const auto& d : e.diagnostics()) std::fprintf(stderr, "%s\n", d.to_string().c_str());
    std::fprintf(stderr, "%s: %zu error(s)\n", check_path.c_str(), e.diagnostics().size());
    return kExitConfig;
  }
}

// --pending-restore FILE: what the journal still has to give back.
int pending_restore(const std::string& pending_path) {
  try {
    const auto journal = sriovd::host::StateFile(pending_path).load();
    if (journal.ledger.empty() && !journal.txn) {
      std::printf("%s: nothing to give back\n", pending_path.c_str());
      return 0;
    }
    std::printf("%s: %zu original value(s) to restore%s\n", pending_path.c_str(), journal.ledger.entries().size(),
                journal.txn ? ", and a transaction that did not finish" : "");
    for (const auto& [key, original] : journal.ledger.entries())
      std::printf("  %s: %s\n", key.to_json().dump().c_str(), original.dump().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sriovd: %s: %s\n", pending_path.c_str(), e.what());
    return 1;
  }
}

// The binary's path as it is now (an upgrade exec's the file that is at
// this path then: the new package's).
std::string self_binary() {
  char target[4096];
  const ssize_t n = ::readlink("/proc/self/exe", target, sizeof target - 1);
  if (n <= 0) return "";
  std::string path(target, static_cast<size_t>(n));
  static constexpr std::string_view kDeleted = " (deleted)";
  if (path.ends_with(kDeleted)) path.resize(path.size() - kDeleted.size());
  return path;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sriovd - SR-IOV device assignment daemon"};
  std::string config_path = kDefaultConfig;
  std::string check_path;
  std::string log_level;
  std::string sysfs_root = "/sys";
  bool foreground = false;
  bool version = false;
  app.add_option("-c,--config", config_path, "configuration file")->capture_default_str();
  app.add_option("--check-config", check_path, "validate FILE and exit; touches nothing");
  std::string pending_path;
  app.add_option("--pending-restore", pending_path,
                 "say what the journal FILE (STATE_DIR/state.json) still has to give back to the host; exit 0 if "
                 "nothing, 1 if something (the package's removal asks this)");
  app.add_flag("-f,--foreground", foreground,
               "log for a terminal (timestamps) instead of for journald (<N> priorities)");
  app.add_option("-l,--log-level", log_level, "trace, debug, info, warn, error, critical or off; overrides the file");
  app.add_option("--sysfs-root", sysfs_root, "where sysfs is mounted (tests)")->capture_default_str();
  app.add_flag("-V,--version", version, "print the version and exit");
  int test_stop_before_step = -1;
  app.add_option("--test-stop-before-step", test_stop_before_step,
                 "crash tests: SIGSTOP before step N of the first apply")
      ->group("");  // hidden
  int test_stop_claim_step = -1;
  app.add_option("--test-stop-before-claim-step", test_stop_claim_step,
                 "crash tests: SIGSTOP before step N of the first DRA claim's prepare or unprepare")
      ->group("");  // hidden
  int handover_fd = -1;
  app.add_option("--handover-fd", handover_fd, "an upgrade in place: the predecessor's handover manifest")
      ->group("");  // hidden: given by the predecessor's exec
  bool stop_before_takeover = false;
  app.add_flag("--test-stop-before-takeover", stop_before_takeover,
               "crash tests: an upgraded successor stops itself (SIGSTOP) before it takes over")
      ->group("");  // hidden
  bool handover_version = false;
  app.add_flag("--handover-version", handover_version,
               "print the versions of the handover this binary takes over from (an upgrade in place) and exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : kExitUsage;
  }

  if (handover_version) {
    std::printf("%s\n", sriovd::daemon::handover_versions_read().c_str());
    return 0;
  }
  if (version) {
    std::printf("sriovd %s (config schema %d)\n", sriovd::kVersion, sriovd::kConfigSchemaVersion);
    return 0;
  }
  if (!log_level.empty() && !sriovd::daemon::valid_log_level(log_level)) {
    std::fprintf(stderr, "sriovd: --log-level: unknown level '%s' (trace, debug, info, warn, error, critical, off)\n",
                 log_level.c_str());
    return kExitUsage;
  }

  if (!check_path.empty()) return check_config(check_path, sysfs_root);
  if (!pending_path.empty()) return pending_restore(pending_path);

  const auto style =
      foreground || ::isatty(STDERR_FILENO) ? sriovd::daemon::LogStyle::human : sriovd::daemon::LogStyle::journal;
  sriovd::daemon::setup_logging(style, log_level.empty() ? "info" : log_level);

  sriovd::config::Config cfg;
  try {
    cfg = sriovd::config::load(config_path);
  } catch (const sriovd::config::ConfigError& e) {
    spdlog::critical("invalid configuration, nothing was changed:\n{}", e.what());
    return kExitConfig;
  }
  if (const std::string no = sriovd::daemon::Daemon::cannot_serve(cfg); !no.empty()) {
    spdlog::critical("{}: {}; nothing was changed", config_path, no);
    return kExitConfig;
  }
  if (log_level.empty()) sriovd::daemon::set_log_level(cfg.log_level);

  try {
    sriovd::daemon::Options options;
    options.config_path = config_path;
    if (!log_level.empty()) options.log_level = log_level;
    options.sysfs_root = sysfs_root;
    if (test_stop_before_step >= 0) options.test_stop_before_step = static_cast<size_t>(test_stop_before_step);
    if (handover_fd >= 0) options.handover_fd = handover_fd;
    if (test_stop_claim_step >= 0) options.test_stop_before_claim_step = static_cast<size_t>(test_stop_claim_step);
    options.test_stop_before_takeover = stop_before_takeover;
    options.binary = self_binary();
    options.argv.assign(argv, argv + argc);
    sriovd::daemon::Daemon daemon(std::move(options), std::move(cfg));
    return daemon.run();
  } catch (const std::exception& e) {
    spdlog::critical("{}", e.what());
    return kExitFailure;
  }
}
