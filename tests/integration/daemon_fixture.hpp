#pragma once
// What the tests of the sriovd process share: a config of the simulated host
// and a fixture that starts the daemon, talks to its control socket and ends
// it by PID.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sriovd/control/client.hpp"
#include "support/process.hpp"
#include "support/temp_dir.hpp"

namespace sriovd::test {

using control::json;
using namespace std::chrono_literals;

// The test's daemon keeps its state (and its simulated sysfs tree) beside
// its control socket, in the test's own directory.
inline std::string config_text(const std::string& socket, int num_vfs, const std::string& extra_control = "") {
  const std::string dir = std::filesystem::path(socket).parent_path().parent_path().string();
  return "version: 1\n"
         "host: simulated\n"
         "state_dir: " +
         dir +
         "/state\n"
         "simulated:\n"
         "  physical_functions:\n"
         "    - {address: \"0000:3b:00.0\", netdev: simpf0, total_vfs: 8, msix_vectors_per_vf: 4}\n"
         "control:\n"
         "  socket: " +
         socket + "\n" + extra_control +
         "physical_functions:\n"
         "  - address: \"0000:3b:00.0\"\n"
         "    num_vfs: " +
         std::to_string(num_vfs) +
         "\n"
         "    vfs:\n"
         "      - index: 0\n"
         "        mac: \"02:00:00:00:00:01\"\n"
         "        assign: {owner: vm1, socket: " +
         socket + ".vf0}\n";
}

// A network namespace of the test's own, deleted (by name) with this object.
// `add()` makes it; false (and `why`) when it cannot be made - no root.
struct TestNetns {
  explicit TestNetns(std::string n) : name(std::move(n)) {}
  ~TestNetns() { run({"/sbin/ip", "netns", "del", name}); }
  TestNetns(const TestNetns&) = delete;
  TestNetns& operator=(const TestNetns&) = delete;
  bool add() {
    const RunResult r = run({"/sbin/ip", "netns", "add", name});
    why = r.output;
    return r.exit_code == 0;
  }
  // What runs a command (the daemon) inside it; its PID stays the command's.
  [[nodiscard]] std::vector<std::string> exec() const { return exec_in(name); }
  static std::vector<std::string> exec_in(const std::string& ns) { return {"/sbin/ip", "netns", "exec", ns}; }
  std::string name;
  std::string why;
};

class Daemon : public ::testing::Test {
 protected:
  std::string socket() const { return dir_.file("run/control.sock"); }
  std::string config_path() const { return dir_.file("sriovd.yaml"); }

  void write_config(int num_vfs, const std::string& extra_control = "") {
    dir_.write("sriovd.yaml", config_text(socket(), num_vfs, extra_control));
  }

  // Two VFs and, `with_device`, a vhost-user device `name` bridged to VF 1's
  // netdev through `via` (af_packet, macvtap, af_xdp).
  void write_vf_device_config(const std::string& name, const std::string& via, bool with_device) {
    std::string text = config_text(socket(), 2);
    if (with_device)
      text += "virtio_devices:\n  - {name: " + name +
              ", type: net, transport: vhost-user, socket: " + dir_.file("run/" + name + ".sock") +
              ", backend: {type: vf, pf: \"0000:3b:00.0\", vf: 1, via: " + via + "}}\n";
    dir_.write("sriovd.yaml", text);
  }

  // vfb0, a vhost-user device on tap `tap` in `netns` (added here), beside
  // config_text's VF, and with `pci_tap` vp0 too, virtio-net-pci over
  // vfio-user on that tap; the reason when this machine cannot (not root,
  // no /dev/net/tun).
  std::optional<std::string> write_tap_device_config(TestNetns& netns, const std::string& tap,
                                                     const std::string& pci_tap = "") {
    if (!netns.add()) return "needs root for a network namespace (ip netns add): " + netns.why;
    if (::access("/dev/net/tun", R_OK | W_OK) != 0)
      return std::string("needs /dev/net/tun (and root) for a tap backend");
    std::string text =
        config_text(socket(), 2) +
        "virtio_devices:\n  - {name: vfb0, type: net, transport: vhost-user, socket: " + dir_.file("run/vfb0.sock") +
        ", backend: {type: tap, name: " + tap + ", netns: " + netns.name + "}}\n";
    if (!pci_tap.empty())
      text += "  - {name: vp0, type: net, transport: vfio-user, socket: " + dir_.file("run/vp0.sock") +
              ", backend: {type: tap, name: " + pci_tap + ", netns: " + netns.name + "}}\n";
    dir_.write("sriovd.yaml", text);
    return std::nullopt;
  }

  // Starts sriovd and waits until its control socket answers.
  // `wrapper` goes in front of the command (one that execs it, so the PID
  // stays the daemon's: ip netns exec).
  void start(std::vector<std::string> extra_args = {}, std::vector<std::string> wrapper = {}) {
    std::vector<std::string> argv = std::move(wrapper);
    for (const auto& a : {std::string(SRIOVD_BIN), std::string("--config"), config_path(), std::string("--sysfs-root"),
                          dir_.file("sys")})
      argv.push_back(a);
    argv.insert(argv.end(), extra_args.begin(), extra_args.end());
    daemon_ = std::make_unique<test::Process>(argv, dir_.file("sriovd.log"));
    const bool up = test::wait_until(
        [&] {
          try {
            control::Client c(socket(), 1s);
            return c.request({{"cmd", "version"}}).value("ok", false);
          } catch (const std::exception&) {
            return false;
          }
        },
        10s);
    ASSERT_TRUE(up) << "sriovd did not come up:\n" << daemon_->log();
  }

  json request(const json& req) {
    control::Client c(socket(), 5s);
    return c.request(req);
  }

  test::RunResult ctl(std::vector<std::string> args) {
    std::vector<std::string> argv = {SRIOVCTL_BIN, "--socket", socket()};
    argv.insert(argv.end(), args.begin(), args.end());
    return test::run(argv);
  }

  void TearDown() override {
    if (daemon_ && HasFailure()) std::cerr << "--- sriovd log ---\n" << daemon_->log();
  }

  test::TempDir dir_;
  std::unique_ptr<test::Process> daemon_;
};

}  // namespace sriovd::test
