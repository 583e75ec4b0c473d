// Churn (issue 11): the daemon with a VF export and two virtio devices
// (vhost-user and virtio-net-pci over vfio-user, tap backends in a network
// namespace of the test's) while, all at once: the config is reloaded -
// good, bad, devices changed and dropped; VMMs (sriovd-guest processes)
// connect, move traffic and interrupts, are SIGKILLed and come back; udev
// events arrive; and once the daemon itself is SIGKILLed and started again.
// Through all of it every control request is answered within 1 s; after it
// the daemon's fds, threads and RSS are what they were after the warm-up
// round, a SIGTERM ends it cleanly and nothing it made is left in the
// namespace. SRIOVD_CHURN_SECONDS sets the length (scripts/soak --minutes).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "integration/daemon_fixture.hpp"
#include "sriovd/control/client.hpp"
#include "support/process.hpp"

namespace sriovd {
namespace {

using control::json;
using namespace std::chrono_literals;
using ::testing::HasSubstr;

size_t count_dir(const std::string& path) {
  std::error_code ec;
  size_t n = 0;
  for (auto it = std::filesystem::directory_iterator(path, ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec))
    ++n;
  return n;
}

size_t rss_kib(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stoul(line.substr(6));
  return 0;
}

struct Usage {
  size_t fds, threads, rss;
  std::vector<std::string> fd_targets;  // what they are, for a failure message
};
Usage usage(pid_t pid) {
  const std::string p = "/proc/" + std::to_string(pid);
  Usage u{count_dir(p + "/fd"), count_dir(p + "/task"), rss_kib(pid), {}};
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(p + "/fd", ec))
    u.fd_targets.push_back(std::filesystem::read_symlink(e.path(), ec).string());
  std::sort(u.fd_targets.begin(), u.fd_targets.end());
  return u;
}

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += "\n  " + s;
  return out;
}

class Churn : public test::Daemon {
 protected:
  std::string ns = "sriovd-ch" + std::to_string(::getpid());
  std::vector<std::string> in_ns() const { return test::TestNetns::exec_in(ns); }

  // `variant` 0: every device; 1: the vhost-user device changed (restarts)
  // and the virtio-pci one dropped; 2: a file that does not parse.
  std::string config(int variant) const {
    if (variant == 2) return "version: 1\nhost: [simulated\n";
    std::string text = test::config_text(socket(), 3);
    text +=
        "virtio_devices:\n"
        "  - {name: vu0, type: net, transport: vhost-user, socket: " +
        dir_.file("run/vu0.sock") + ", queue_size: " + (variant == 1 ? "512" : "256") +
        ", backend: {type: tap, name: chvu0}}\n";
    if (variant == 0)
      text += "  - {name: vp0, type: net, transport: vfio-user, socket: " + dir_.file("run/vp0.sock") +
              ", backend: {type: tap, name: chvp0}}\n";
    return text;
  }

  // A control request, timed: the longest one so far is kept. Requests that
  // overlap the daemon's SIGKILL and restart (`era` moved, or the daemon was
  // down) are not counted: the killed one cannot answer, and the new one
  // answers once its startup is done.
  json timed(const json& req) {
    const unsigned era_before = era.load();
    const auto t0 = std::chrono::steady_clock::now();
    json r;
    try {
      control::Client c(socket(), 5s);
      r = c.request(req);
    } catch (const std::exception& e) {
      r = {{"ok", false}, {"transport_error", e.what()}};
    }
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    if (era.load() != era_before || (era_before & 1U)) return r;
    std::lock_guard lock(mutex);
    const std::string cmd = req.value("cmd", "");
    slowest_by_cmd[cmd] = std::max(slowest_by_cmd[cmd], static_cast<long>(ms));
    if (ms > slowest_ms) {
      slowest_ms = ms;
      slowest = req.dump();
    }
    if (r.contains("transport_error")) ++unanswered;
    return r;
  }

  std::atomic<unsigned> era{0};  // odd while the daemon is being killed and restarted
  std::mutex mutex;
  long slowest_ms = 0;
  std::string slowest;
  std::map<std::string, long> slowest_by_cmd;
  int unanswered = 0;
};

TEST_F(Churn, ReloadsClientsCrashesAndUdevEventsTogether) {
  test::TestNetns netns(ns);
  if (!netns.add()) GTEST_SKIP() << "needs root for a network namespace (ip netns add): " << netns.why;
  if (::access("/dev/net/tun", R_OK | W_OK) != 0) GTEST_SKIP() << "needs /dev/net/tun for the tap backends";
  const char* env = std::getenv("SRIOVD_CHURN_SECONDS");
  const auto length = std::chrono::seconds(env ? std::max(10, std::atoi(env)) : 40);

  dir_.write("sriovd.yaml", config(0));
  start({}, in_ns());

  std::atomic<bool> stop{false};
  std::atomic<bool> daemon_down{false};
  std::atomic<bool> paused{false};  // actors hold off while the test takes a measurement
  std::atomic<unsigned> guests_started{0}, reloads{0}, udev_events{0};
  // VMMs: each round a guest on one of the sockets, killed after a while.
  auto vmm = [&](int which) {
    std::mt19937 rng(static_cast<unsigned>(which) + 7);
    while (!stop.load()) {
      if (paused.load()) {
        std::this_thread::sleep_for(50ms);
        continue;
      }
      std::vector<std::string> argv;
      if (which == 0)
        argv = {SRIOVD_GUEST_BIN, "virtio-net", "--vhost-user", dir_.file("run/vu0.sock"),
                "--netns",        ns,           "--tap",        "chg" + std::to_string(which)};
      else if (which == 1)
        argv = {SRIOVD_GUEST_BIN, "virtio-net", "--socket", dir_.file("run/vp0.sock"),
                "--netns",        ns,           "--tap",    "chg" + std::to_string(which)};
      else
        argv = {SRIOVD_GUEST_BIN, "msix-storm", "--socket", socket() + ".vf0", "--seconds", "30", "--rate", "2000"};
      {
        test::Process guest(argv, dir_.file("guest" + std::to_string(which) + ".log"));
        ++guests_started;
        std::this_thread::sleep_for(std::chrono::milliseconds(200 + rng() % 800));
        guest.signal(SIGKILL);  // a VMM that crashes; the destructor reaps it
      }
    }
  };
  auto reloader = [&] {
    std::mt19937 rng(3);
    while (!stop.load()) {
      if (!daemon_down.load() && !paused.load()) {
        dir_.write("sriovd.yaml", config(static_cast<int>(rng() % 3)));
        const json r = timed({{"cmd", "reload"}});
        if (r.contains("ok")) ++reloads;
      }
      std::this_thread::sleep_for(300ms);
    }
  };
  auto udev = [&] {
    const char* actions[] = {"add", "remove", "change", "bind", "unbind"};
    for (unsigned i = 0; !stop.load(); ++i) {
      if (!daemon_down.load() && !paused.load()) {
        (void)timed({{"cmd", "udev-event"}, {"action", actions[i % 5]}, {"device", "0000:3b:02.2"}});
        ++udev_events;
      }
      std::this_thread::sleep_for(150ms);
    }
  };
  auto prober = [&] {
    while (!stop.load()) {
      if (!daemon_down.load()) (void)timed({{"cmd", "devices"}});
      std::this_thread::sleep_for(100ms);
    }
  };

  // Warm-up: one round of everything, then the baseline.
  std::vector<std::thread> actors;
  for (int w = 0; w < 3; ++w) actors.emplace_back(vmm, w);
  actors.emplace_back(reloader);
  actors.emplace_back(udev);
  actors.emplace_back(prober);
  std::this_thread::sleep_for(length / 2);

  // The daemon itself is SIGKILLed (as the watchdog would) and started again:
  // it must converge to the file as it is.
  ++era;
  daemon_down.store(true);
  daemon_->signal(SIGKILL);
  ASSERT_TRUE(daemon_->wait_for(10s));
  dir_.write("sriovd.yaml", config(0));
  start({}, in_ns());
  daemon_down.store(false);
  ++era;
  const auto served = [&] {
    const json d = timed({{"cmd", "devices"}});
    if (!d.value("ok", false)) return false;
    int n = 0;
    for (const auto& v : d["result"]["virtio_devices"]) n += v.value("state", "") != "not served";
    return n == 2;
  };
  ASSERT_TRUE(test::wait_until(served, 10s)) << "the restarted daemon did not serve both devices";
  // A quiet moment, as at the end: the baseline.
  const auto quiet = [&] {
    paused.store(true);
    std::this_thread::sleep_for(1500ms);  // the VMM rounds under way finish
    dir_.write("sriovd.yaml", config(0));
    EXPECT_TRUE(timed({{"cmd", "reload"}}).value("ok", false));
    EXPECT_TRUE(test::wait_until(served, 10s));
  };
  quiet();
  const Usage base = usage(daemon_->pid());
  paused.store(false);
  std::this_thread::sleep_for(length / 2);
  stop.store(true);
  for (auto& a : actors) a.join();
  quiet();
  Usage now{};
  const bool steady = test::wait_until(
      [&] {
        now = usage(daemon_->pid());
        return now.fds <= base.fds && now.threads <= base.threads;
      },
      10s);
  EXPECT_TRUE(steady) << "fds " << base.fds << " -> " << now.fds << ", threads " << base.threads << " -> "
                      << now.threads << "\nbefore:" << joined(base.fd_targets) << "\nafter:" << joined(now.fd_targets);
  EXPECT_LT(now.rss, base.rss + 32 * 1024) << "RSS " << base.rss << " -> " << now.rss << " KiB";
  {
    std::lock_guard lock(mutex);
    EXPECT_EQ(unanswered, 0) << "control requests that got no answer";
    EXPECT_LE(slowest_ms, 1000) << "the slowest control request took " << slowest_ms << " ms: " << slowest;
  }
  EXPECT_GT(guests_started.load(), 6U);
  EXPECT_GT(reloads.load(), 3U);
  EXPECT_GT(udev_events.load(), 3U);
  for (const auto& [cmd, ms] : slowest_by_cmd) std::printf("churn: slowest %s: %ld ms\n", cmd.c_str(), ms);
  std::printf(
      "churn: %u guests started and killed, %u reloads, %u udev events, slowest request %ld ms; "
      "fds %zu -> %zu, threads %zu -> %zu, RSS %zu -> %zu KiB\n",
      guests_started.load(), reloads.load(), udev_events.load(), slowest_ms, base.fds, now.fds, base.threads,
      now.threads, base.rss, now.rss);

  daemon_->signal(SIGTERM);
  const auto status = daemon_->wait_for(20s);
  ASSERT_TRUE(status.has_value()) << "SIGTERM did not end the daemon";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << daemon_->log();
  const auto links = test::run({"/sbin/ip", "-n", ns, "link", "show"}).output;
  EXPECT_THAT(links, ::testing::Not(HasSubstr("chvu0"))) << links;
  EXPECT_THAT(links, ::testing::Not(HasSubstr("chvp0"))) << links;
  EXPECT_THAT(links, ::testing::Not(HasSubstr("sriovd-sim"))) << links;
}

}  // namespace
}  // namespace sriovd
