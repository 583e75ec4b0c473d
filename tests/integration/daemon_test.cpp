// The sriovd process as a user meets it: started with a config file, driven
// over its control socket by sriovctl and by raw clients, reloaded, stopped.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <sys/stat.h>

#include <fstream>
#include <sys/un.h>
#include <sys/wait.h>
#include <poll.h>
#include <unistd.h>
#include <linux/vfio.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>

#include "sriovd/control/client.hpp"
#include "sriovd/util/fd.hpp"
#include "sriovd/util/unix_socket.hpp"
#include "sriovd/guest/vfio_user_client.hpp"
#include "sriovd/guest/virtio_net_driver.hpp"
#include "sriovd/irq/engine.hpp"
#include "sriovd/vfio_user/server.hpp"
#include "sriovd/vhost_user/backend.hpp"
#include "sriovd/virtio/device.hpp"
#include "integration/daemon_fixture.hpp"
#include "support/process.hpp"
#include "support/temp_dir.hpp"

namespace sriovd {
namespace {

using control::json;
using namespace std::chrono_literals;
using ::testing::HasSubstr;
using ::testing::Not;

// Writes `bytes` bytes with no newline, as far as the daemon lets it, and
// returns what came back before the daemon closed the connection.
std::string flood_line(const std::string& path, size_t bytes) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, path.c_str());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return "";
  }
  const std::string chunk(4096, 'x');
  for (size_t sent = 0; sent < bytes;) {
    const ssize_t n = ::send(fd, chunk.data(), std::min(chunk.size(), bytes - sent), MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  std::string reply;
  char buf[512];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) reply.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return reply;
}

using test::config_text;
using test::Daemon;

TEST_F(Daemon, AnswersStatusVersionAndDevices) {
  write_config(2);
  start();
  json status = request({{"cmd", "status"}});
  ASSERT_TRUE(status["ok"]) << status;
  EXPECT_EQ(status["result"]["host"], "simulated");
  EXPECT_EQ(status["result"]["state"], "running");
  EXPECT_EQ(status["result"]["pid"], daemon_->pid());
  EXPECT_EQ(status["result"]["vfs"], 2);

  json devices = request({{"cmd", "devices"}});
  ASSERT_TRUE(devices["ok"]) << devices;
  const json& pf = devices["result"]["physical_functions"][0];
  EXPECT_EQ(pf["pf"], "0000:3b:00.0");
  ASSERT_EQ(pf["vfs"].size(), 2U);
  EXPECT_EQ(pf["vfs"][0]["owner"], "vm1");
  EXPECT_EQ(pf["vfs"][0]["mac"], "02:00:00:00:00:01");
  // And what the PF's driver holds for it, read back from the host.
  EXPECT_EQ(pf["vfs"][0]["settings"]["mac"], "02:00:00:00:00:01") << pf["vfs"][0];
  EXPECT_EQ(pf["vfs"][1]["settings"]["vlan"], 0) << pf["vfs"][1];  // none: 0, as the kernel says it

  json version = request({{"cmd", "version"}, {"id", 7}});
  EXPECT_EQ(version["id"], 7);
  EXPECT_EQ(version["result"]["config_schema"], 1);
}

TEST_F(Daemon, ControlSocketIsMode0660) {
  write_config(1);
  start();
  struct stat st {};
  ASSERT_EQ(::stat(socket().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660U);
}

// The daemon answers a version request (false on any failure).
bool answers(const std::string& socket) {
  try {
    control::Client c(socket, 2s);
    return c.request({{"cmd", "version"}}).value("ok", false);
  } catch (const std::exception&) {
    return false;
  }
}

// A line the daemon sends on `fd` within 5 s (empty: none).
std::string read_line(int fd) {
  std::string line;
  char c = 0;
  pollfd p{fd, POLLIN, 0};
  while (::poll(&p, 1, 5000) == 1 && ::read(fd, &c, 1) == 1 && c != '\n') line += c;
  return line;
}

// Hostile peers, round 2 (issue 24, item 5) and round 3 (issue 39, f1):
// idle control connections are capped, and no number of them keeps the
// operator out: 64 idle connections made `sriovctl status` fail until they
// went. A new connection takes the place of the longest waiting one (of
// its own user past a user's share of 16), which is told why and closed.
TEST_F(Daemon, IdleControlConnectionsNeverKeepTheOperatorOut) {
  write_config(1);
  start();
  std::vector<UniqueFd> idle;
  for (int i = 0; i < 100; ++i) idle.push_back(connect_unix(socket(), "control socket"));
  EXPECT_TRUE(answers(socket())) << "the operator was kept out by idle connections";
  // The oldest gave their places (this test is one user: its share is 16).
  const std::string told = read_line(idle.front().get());
  EXPECT_THAT(told, HasSubstr("another needed its place")) << told;
  EXPECT_THAT(told, HasSubstr("\"ok\":false"));
  control::Client c(socket(), 5s);
  const json stats = c.request({{"cmd", "stats"}});
  ASSERT_TRUE(stats.value("ok", false)) << stats.dump();
  EXPECT_LE(stats["result"]["control"].value("active", 0U), 17U) << "a user held more than its share";
  EXPECT_GE(stats["result"]["control"].value("evicted", 0U), 84U);
}

// A request nesting 30,000 arrays (the reply echoes "id", printed
// recursively) is refused before it is parsed; the daemon goes on.
TEST_F(Daemon, DeeplyNestedRequestIsRefused) {
  write_config(1);
  start();
  const std::string deep = "{\"cmd\":\"version\",\"id\":" + std::string(30000, '[') + std::string(30000, ']') + "}";
  control::Client c(socket(), 5s);
  const json reply = c.request(json::parse("{\"cmd\":\"version\"}"));
  ASSERT_TRUE(reply.value("ok", false));
  UniqueFd raw = connect_unix(socket(), "control socket");
  const std::string line = deep + "\n";
  ASSERT_EQ(::write(raw.get(), line.data(), line.size()), static_cast<ssize_t>(line.size()));
  const std::string answer = read_line(raw.get());
  EXPECT_THAT(answer, HasSubstr("deeper than 64 levels")) << answer.substr(0, 200);
  EXPECT_TRUE(request({{"cmd", "version"}}).value("ok", false));
  EXPECT_TRUE(daemon_->running());
}

// Out of fds (EMFILE): the listener waits before it accepts again instead
// of failing in a loop (a core and ~730,000 log lines a second before),
// and serves again once fds are free.
TEST_F(Daemon, AcceptBacksOffWhenTheDaemonIsOutOfFds) {
  if (::access("/usr/bin/prlimit", X_OK) != 0) GTEST_SKIP() << "prlimit (util-linux) is not installed";
  write_config(1);
  start();
  // Its fd limit: what it holds now and 8 more, fewer than the 16 control
  // connections one user may hold (which would otherwise take the places of
  // older ones before the fds ran out).
  size_t held = 0;
  for ([[maybe_unused]] const auto& e :
       std::filesystem::directory_iterator("/proc/" + std::to_string(daemon_->pid()) + "/fd"))
    ++held;
  const std::string limit = "--nofile=" + std::to_string(held + 8) + ":" + std::to_string(held + 8);
  ASSERT_EQ(test::run({"/usr/bin/prlimit", "--pid", std::to_string(daemon_->pid()), limit}).exit_code, 0);
  std::vector<UniqueFd> conns;
  for (int i = 0; i < 70; ++i) conns.push_back(connect_unix(socket(), "control socket"));
  ASSERT_TRUE(test::wait_until([&] { return daemon_->log().find("accept failed") != std::string::npos; }, 5s))
      << "the daemon never ran out of fds; raise the connection count";
  // A second of being out of fds: the failure is logged once, not per try.
  const auto until = std::chrono::steady_clock::now() + 1s;
  test::wait_until([&] { return std::chrono::steady_clock::now() >= until; }, 2s);
  size_t failures = 0;
  for (size_t at = 0; (at = daemon_->log().find("accept failed", at)) != std::string::npos; ++at) ++failures;
  EXPECT_EQ(failures, 1U) << daemon_->log();
  conns.clear();
  EXPECT_TRUE(test::wait_until([&] { return answers(socket()); }, 5s));
  EXPECT_TRUE(test::wait_until([&] { return daemon_->log().find("accepting again") != std::string::npos; }, 5s));
}

TEST_F(Daemon, SriovctlPrintsTablesAndJson) {
  write_config(2);
  start();
  auto status = ctl({"status"});
  EXPECT_EQ(status.exit_code, 0) << status.output;
  EXPECT_THAT(status.output, HasSubstr("host:            simulated"));
  auto devices = ctl({"devices"});
  EXPECT_EQ(devices.exit_code, 0) << devices.output;
  EXPECT_THAT(devices.output, HasSubstr("PF            VF  ADDRESS       DRIVER    GROUP  MAC"));
  EXPECT_THAT(devices.output, ::testing::ContainsRegex(
                                  "0000:3b:00.0  0   0000:3b:02.0  vfio-pci  [0-9]+ +02:00:00:00:00:01  -     vm1"));
  auto as_json = ctl({"--json", "devices"});
  ASSERT_EQ(as_json.exit_code, 0);
  json parsed = json::parse(as_json.output);
  EXPECT_EQ(parsed["physical_functions"][0]["num_vfs"], 2);
  // Global options after the subcommand too, as users type them.
  auto after = test::run({SRIOVCTL_BIN, "devices", "--json", "--socket", socket(), "-t", "5"});
  ASSERT_EQ(after.exit_code, 0) << after.output;
  EXPECT_EQ(json::parse(after.output)["physical_functions"][0]["num_vfs"], 2);
  for (const char* cmd : {"routes", "stats", "version"}) {
    auto r = ctl({cmd});
    EXPECT_EQ(r.exit_code, 0) << cmd << ": " << r.output;
  }
}

TEST_F(Daemon, ReloadAppliesAGoodFileAndRefusesABadOne) {
  write_config(2);
  start();
  // A good file, through sriovctl.
  write_config(3);
  auto ok = ctl({"reload"});
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_EQ(request({{"cmd", "status"}})["result"]["vfs"], 3);

  // A bad file: the reply names the line, the running state stays.
  dir_.write("sriovd.yaml", config_text(socket(), 3) + "        vlan: 9999\n");
  auto bad = ctl({"reload"});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.output, HasSubstr(config_path() + ":16:15: physical_functions[0].vfs[0].vlan: "
                                                    "expected an integer from 0 to 4095, got '9999'"));
  json status = request({{"cmd", "status"}})["result"];
  EXPECT_EQ(status["vfs"], 3);
  EXPECT_EQ(status["reloads"]["ok"], 1);
  EXPECT_EQ(status["reloads"]["failed"], 1);
  json raw = request({{"cmd", "reload"}});
  EXPECT_FALSE(raw["ok"]);
  EXPECT_EQ(raw["error"]["diagnostics"][0]["line"], 16);
}

// control.poll_us: applied to the running loop by a reload and shown in
// status and stats; a thread that may poll still answers; 0 stops polls.
TEST_F(Daemon, ReloadSetsTheControlThreadsPollWindow) {
  write_config(1);
  start();
  json loop = request({{"cmd", "status"}})["result"]["control_loop"];
  EXPECT_EQ(loop["poll_us"], 0);
  EXPECT_EQ(loop["polls"], 0);
  write_config(1, "  poll_us: 1000\n");
  ASSERT_EQ(ctl({"reload"}).exit_code, 0);
  // The loop's own window (whether it finds work polling is
  // util/polling_loop_test's, and mask-iperf's with a real guest).
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(request({{"cmd", "version"}})["ok"]);
  loop = request({{"cmd", "status"}})["result"]["control_loop"];
  EXPECT_EQ(loop["poll_us"], 1000);
  EXPECT_GE(loop["polls"].get<uint64_t>(), loop["hits"].get<uint64_t>());
  EXPECT_EQ(request({{"cmd", "stats"}})["result"]["control_loop"]["poll_us"], 1000);
  write_config(1);
  ASSERT_EQ(ctl({"reload"}).exit_code, 0);
  const uint64_t polls = request({{"cmd", "status"}})["result"]["control_loop"]["polls"].get<uint64_t>();
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(request({{"cmd", "status"}})["ok"]);
  loop = request({{"cmd", "status"}})["result"]["control_loop"];
  EXPECT_EQ(loop["poll_us"], 0);
  EXPECT_FALSE(loop["polling"].get<bool>());
  EXPECT_EQ(loop["polls"].get<uint64_t>(), polls);
}

TEST_F(Daemon, SighupReloadsAndABadFileChangesNothing) {
  write_config(2);
  start();
  write_config(4);
  daemon_->signal(SIGHUP);
  EXPECT_TRUE(test::wait_until([&] { return request({{"cmd", "status"}})["result"]["vfs"] == 4; }, 5s));
  dir_.write("sriovd.yaml", "version: 1\nhost: [\n");
  daemon_->signal(SIGHUP);
  EXPECT_TRUE(test::wait_until([&] { return request({{"cmd", "status"}})["result"]["reloads"]["failed"] == 1; }, 5s));
  EXPECT_EQ(request({{"cmd", "status"}})["result"]["vfs"], 4);
  EXPECT_TRUE(daemon_->running());
}

TEST_F(Daemon, ReloadRefusesAChangeThatNeedsARestart) {
  write_config(2);
  start();
  dir_.write("sriovd.yaml", config_text(dir_.file("run/other.sock"), 2));
  json reply = request({{"cmd", "reload"}});
  EXPECT_FALSE(reply["ok"]);
  EXPECT_THAT(reply["error"]["message"].get<std::string>(), HasSubstr("control.socket changes"));
  EXPECT_EQ(request({{"cmd", "status"}})["result"]["control_socket"], socket());
}

TEST_F(Daemon, ServesManyClientsAtOnce) {
  write_config(2);
  start();
  constexpr int kClients = 16;
  constexpr int kRequests = 50;
  std::atomic<int> good{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; ++t)
    threads.emplace_back([&, t] {
      control::Client c(socket(), 10s);
      for (int i = 0; i < kRequests; ++i) {
        json reply = c.request({{"cmd", i % 2 ? "status" : "devices"}, {"id", t * 1000 + i}});
        if (reply["ok"] == true && reply["id"] == t * 1000 + i) ++good;
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(good.load(), kClients * kRequests);
  json stats = request({{"cmd", "stats"}})["result"]["control"];
  EXPECT_GE(stats["requests"].get<int>(), kClients * kRequests);
  EXPECT_GE(stats["connections"].get<int>(), kClients);
}

TEST_F(Daemon, MalformedRequestsGetClearErrorsAndTheDaemonLives) {
  write_config(1);
  start();
  control::Client c(socket(), 5s);
  json r = json::parse(c.send_raw("this is not json\n"));
  EXPECT_EQ(r["error"]["code"], "bad_json");
  r = json::parse(c.send_raw("[1,2]\n"));
  EXPECT_EQ(r["error"]["code"], "bad_request");
  r = json::parse(c.send_raw("{\"cmd\": 5}\n"));
  EXPECT_EQ(r["error"]["code"], "bad_request");
  r = c.request({{"cmd", "frobnicate"}});
  EXPECT_EQ(r["error"]["code"], "unknown_command");
  EXPECT_THAT(r["error"]["message"].get<std::string>(), HasSubstr("unknown command 'frobnicate'"));
  r = c.request({{"cmd", "udev-event"}, {"action", "add"}, {"device", "not-an-address"}});
  EXPECT_EQ(r["error"]["code"], "bad_request");
  // The same connection still works after errors.
  EXPECT_TRUE(c.request({{"cmd", "version"}})["ok"]);

  // An endless line: an error, then the daemon closes that connection only
  // (our writes past the limit then fail with EPIPE, which is the point).
  EXPECT_EQ(json::parse(flood_line(socket(), 70 * 1024))["error"]["code"], "line_too_long");
  EXPECT_TRUE(request({{"cmd", "status"}})["ok"]);
  EXPECT_TRUE(daemon_->running());
}

TEST_F(Daemon, PeerOutsideTheAllowListIsRefused) {
  write_config(1, "  allowed_uids: [" + std::to_string(::getuid() + 4242) + "]\n");
  daemon_ = std::make_unique<test::Process>(std::vector<std::string>{SRIOVD_BIN, "--config", config_path()},
                                            dir_.file("sriovd.log"));
  ASSERT_TRUE(test::wait_until([&] { return std::filesystem::exists(socket()); }, 10s));
  json reply;
  ASSERT_TRUE(test::wait_until(
      [&] {
        try {
          reply = request({{"cmd", "status"}});
          return true;
        } catch (const std::exception&) {
          return false;
        }
      },
      5s));
  EXPECT_FALSE(reply["ok"]);
  EXPECT_EQ(reply["error"]["code"], "permission_denied");
  EXPECT_THAT(reply["error"]["message"].get<std::string>(),
              HasSubstr("refused uid " + std::to_string(::getuid()) + ": not in control.allowed_uids"));
  EXPECT_TRUE(daemon_->running());

  // Allowing this uid through a reload (SIGHUP: no client can ask) opens the door.
  write_config(1, "  allowed_uids: [" + std::to_string(::getuid()) + "]\n");
  daemon_->signal(SIGHUP);
  EXPECT_TRUE(test::wait_until(
      [&] {
        try {
          return request({{"cmd", "status"}})["ok"] == true;
        } catch (const std::exception&) {
          return false;
        }
      },
      5s));
}

TEST_F(Daemon, SigtermEndsItWithinASecondWithExitZero) {
  write_config(2);
  start();
  control::Client idle(socket(), 5s);  // an open connection must not hold it up
  const auto t0 = std::chrono::steady_clock::now();
  daemon_->signal(SIGTERM);
  auto status = daemon_->wait_for(1s);
  ASSERT_TRUE(status) << "still running 1 s after SIGTERM";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  ASSERT_TRUE(WIFEXITED(*status));
  EXPECT_EQ(WEXITSTATUS(*status), 0);
  EXPECT_FALSE(std::filesystem::exists(socket())) << "control socket left behind";
}

TEST_F(Daemon, SigintStopsItToo) {
  write_config(1);
  start();
  daemon_->signal(SIGINT);
  auto status = daemon_->wait_for(2s);
  ASSERT_TRUE(status);
  EXPECT_EQ(WEXITSTATUS(*status), 0);
}

// sd_notify(3) as systemd receives it: a datagram socket in NOTIFY_SOCKET.
TEST_F(Daemon, TellsSystemdReadyReloadingWatchdogAndStopping) {
  write_config(1);
  const std::string notify_path = dir_.file("notify.sock");
  UniqueFd notify(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, notify_path.c_str());
  ASSERT_EQ(::bind(notify.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  std::vector<std::string> seen;
  auto next_message = [&](const std::string& prefix) {
    for (int i = 0; i < 50; ++i) {
      pollfd p{notify.get(), POLLIN, 0};
      if (::poll(&p, 1, 100) != 1) continue;
      char buf[512];
      const ssize_t n = ::recv(notify.get(), buf, sizeof buf, 0);
      if (n <= 0) continue;
      seen.emplace_back(buf, static_cast<size_t>(n));
      if (seen.back().rfind(prefix, 0) == 0) return true;
    }
    return false;
  };
  daemon_ = std::make_unique<test::Process>(
      std::vector<std::string>{SRIOVD_BIN, "--config", config_path()}, dir_.file("sriovd.log"),
      std::vector<std::string>{"NOTIFY_SOCKET=" + notify_path, "WATCHDOG_USEC=200000"});
  ASSERT_TRUE(next_message("READY=1")) << daemon_->log();
  EXPECT_NE(seen.back().find("STATUS=1 PF(s), 1 VF(s)"), std::string::npos) << seen.back();
  ASSERT_TRUE(next_message("WATCHDOG=1")) << "no watchdog ping within 5 s at WATCHDOG_USEC=200000";
  daemon_->signal(SIGHUP);
  ASSERT_TRUE(next_message("RELOADING=1"));
  EXPECT_NE(seen.back().find("MONOTONIC_USEC="), std::string::npos);
  ASSERT_TRUE(next_message("READY=1"));
  daemon_->signal(SIGTERM);
  ASSERT_TRUE(next_message("STOPPING=1"));
  auto status = daemon_->wait_for(5s);
  ASSERT_TRUE(status);
  EXPECT_EQ(WEXITSTATUS(*status), 0);
}

TEST_F(Daemon, InvalidConfigAtStartupExits78AndCreatesNothing) {
  dir_.write("sriovd.yaml", config_text(socket(), 2) + "bogus: 1\n");
  test::Process p({SRIOVD_BIN, "--config", config_path()}, dir_.file("sriovd.log"));
  auto status = p.wait_for(5s);
  ASSERT_TRUE(status);
  EXPECT_EQ(WEXITSTATUS(*status), 78);
  EXPECT_THAT(p.log(), HasSubstr(config_path() + ":16:1: unknown key 'bogus'"));
  EXPECT_FALSE(std::filesystem::exists(dir_.file("run"))) << "a bad config touched the host";
}

TEST_F(Daemon, StaleSocketIsReplacedButALiveDaemonIsNot) {
  write_config(1);
  // A socket file nobody listens on, as a crashed daemon leaves it.
  std::filesystem::create_directories(dir_.file("run"));
  {
    int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strcpy(addr.sun_path, socket().c_str());
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ::close(fd);
  }
  start();
  // A second daemon on the same socket refuses to start and leaves the first alone.
  test::Process second({SRIOVD_BIN, "--config", config_path()}, dir_.file("second.log"));
  auto status = second.wait_for(5s);
  ASSERT_TRUE(status);
  EXPECT_EQ(WEXITSTATUS(*status), 1);
  EXPECT_THAT(second.log(), HasSubstr("another server is already answering on control socket " + socket()));
  EXPECT_TRUE(request({{"cmd", "status"}})["ok"]);
}

TEST_F(Daemon, LogsForJournaldUnlessForeground) {
  write_config(1);
  start();
  EXPECT_THAT(daemon_->log(), HasSubstr("<6>sriovd 0.1.0 ready"));
  daemon_->signal(SIGTERM);
  daemon_->wait_for(2s);
  daemon_.reset();
  std::filesystem::remove(dir_.file("sriovd.log"));
  start({"--foreground", "--log-level", "debug"});
  const std::string log = daemon_->log();
  EXPECT_THAT(log, ::testing::ContainsRegex("[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9:.]+ info  sriovd 0.1.0 ready"));
  EXPECT_EQ(request({{"cmd", "status"}})["result"]["log_level"], "debug");
}

// The udev rules run exactly these sriovctl command lines; run them the way
// udev would, against a sysfs tree where 0000:3b:02.1 is VF 1 of the PF.
TEST_F(Daemon, UdevRuleCommandsReportManagedVfs) {
  namespace fs = std::filesystem;
  const fs::path sys = dir_.file("sys");
  fs::create_directories(sys / "devices/pci0000:3a/0000:3b:00.0");
  fs::create_directories(sys / "devices/pci0000:3a/0000:3b:02.1");
  fs::create_directories(sys / "devices/pci0000:3a/0000:5e:02.0");
  fs::create_directories(sys / "bus/pci/devices");
  for (const char* d : {"0000:3b:00.0", "0000:3b:02.1", "0000:5e:02.0"})
    fs::create_symlink(std::string("../../../devices/pci0000:3a/") + d, sys / "bus/pci/devices" / d);
  fs::create_symlink("../0000:3b:00.0", sys / "devices/pci0000:3a/0000:3b:02.1/physfn");
  fs::create_symlink("../0000:3b:02.1", sys / "devices/pci0000:3a/0000:3b:00.0/virtfn1");
  write_config(2);
  start();

  const std::string rules = test::read_file(std::string(SRIOVD_BINARY_DIR) + "/test-units/90-sriovd.rules");
  std::smatch add, remove;
  ASSERT_TRUE(std::regex_search(rules, add, std::regex(R"re(IMPORT\{program\}="(\S+) ([^"]*add %k)")re")));
  ASSERT_TRUE(std::regex_search(rules, remove, std::regex(R"re(RUN\+="(\S+) ([^"]*remove %k[^"]*)")re")));
  EXPECT_EQ(add[1].str(), SRIOVCTL_BIN);
  auto udev_run = [&](std::string args, const std::string& kernel, const std::string& pf) {
    args = std::regex_replace(args, std::regex("%k"), kernel);
    args = std::regex_replace(args, std::regex(R"(\$env\{SRIOVD_PF\})"), pf);
    std::vector<std::string> argv = {SRIOVCTL_BIN, "--socket", socket()};
    std::istringstream words(args);
    for (std::string w; words >> w;) argv.push_back(w);
    return test::run(argv);
  };
  auto managed = udev_run(add[2].str(), "0000:3b:02.1", "");
  EXPECT_EQ(managed.exit_code, 0) << managed.output;
  EXPECT_EQ(managed.output, "SRIOVD_MANAGED=1\nSRIOVD_PF=0000:3b:00.0\nSRIOVD_VF_INDEX=1\n");
  auto foreign = udev_run(add[2].str(), "0000:5e:02.0", "");
  EXPECT_EQ(foreign.output, "SRIOVD_MANAGED=0\n");
  // On remove sysfs is gone; the PF comes from udev's database.
  fs::remove_all(sys / "bus/pci/devices/0000:3b:02.1");
  auto gone = udev_run(remove[2].str(), "0000:3b:02.1", "0000:3b:00.0");
  EXPECT_EQ(gone.exit_code, 0) << gone.output;
  json events = request({{"cmd", "status"}})["result"]["udev_events"];
  ASSERT_EQ(events.size(), 3U);
  EXPECT_EQ(events[2]["action"], "remove");
  EXPECT_EQ(events[2]["managed"], true);
}

// --- the host layer as the daemon drives it (simulated host) ---

const json* find_vf(const json& devices, unsigned index) {
  for (const auto& vf : devices["physical_functions"][0]["vfs"])
    if (vf["index"] == index) return &vf;
  return nullptr;
}

TEST_F(Daemon, StartupAppliesTheConfigToTheHost) {
  write_config(2);
  start();
  json devices = request({{"cmd", "devices"}})["result"];
  const json& pf = devices["physical_functions"][0];
  EXPECT_EQ(pf["active_vfs"], 2);
  EXPECT_EQ(pf["driver"], "i40e");
  const json* vf0 = find_vf(devices, 0);
  ASSERT_TRUE(vf0);
  EXPECT_EQ((*vf0)["address"], "0000:3b:02.0");
  EXPECT_EQ((*vf0)["driver"], "vfio-pci");
  EXPECT_EQ((*vf0)["state"], "assigned");
  EXPECT_EQ((*vf0)["group_viable"], true);
  EXPECT_EQ((*vf0)["msix_vectors"], 4);
  const json* vf1 = find_vf(devices, 1);
  EXPECT_EQ((*vf1)["driver"], "iavf");  // not assigned: its own driver
  EXPECT_EQ((*vf1)["state"], "host");
}

TEST_F(Daemon, PlanShowsAReloadWithoutActing) {
  write_config(2);
  start();
  write_config(3);
  auto plan = ctl({"plan"});
  EXPECT_EQ(plan.exit_code, 0) << plan.output;
  EXPECT_THAT(plan.output, HasSubstr("0000:3b:00.0: sriov_numvfs 2 -> 3"));
  EXPECT_EQ(request({{"cmd", "devices"}})["result"]["physical_functions"][0]["active_vfs"], 2);
  auto reload = ctl({"reload"});
  EXPECT_EQ(reload.exit_code, 0) << reload.output;
  EXPECT_THAT(reload.output, HasSubstr("sriov_numvfs 2 -> 3"));
  EXPECT_EQ(request({{"cmd", "devices"}})["result"]["physical_functions"][0]["active_vfs"], 3);
  EXPECT_THAT(ctl({"plan"}).output, HasSubstr("(nothing to change)"));
}

TEST_F(Daemon, ReleaseGivesOneVfBackToTheHost) {
  write_config(2);
  start();
  auto r = ctl({"release", "0000:3b:00.0", "0"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("0000:3b:00.0 VF 0: driver vfio-pci -> (its own driver)"));
  json devices = request({{"cmd", "devices"}})["result"];
  EXPECT_EQ((*find_vf(devices, 0))["driver"], "iavf");
  EXPECT_EQ((*find_vf(devices, 0))["state"], "released");
  auto bad = ctl({"release", "--device", "0000:3b:00.0"});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.output, HasSubstr("0000:3b:00.0 is not a VF"));
}

// Issue 25 item 5: a PF is named as an operator names it - by netdev or by
// address, whichever way the config names it - and alone it releases every
// VF the config assigns on it.
TEST_F(Daemon, ReleaseByPfNetdevOrAddressAndAWholePf) {
  // The PF named by netdev in the file.
  std::string by_netdev =
      config_text(socket(), 3) + "      - index: 1\n        assign: {owner: vm2, socket: " + socket() + ".vf1}\n";
  by_netdev.replace(by_netdev.find("  - address: \"0000:3b:00.0\"\n    num_vfs"), 27, "  - netdev: simpf0\n");
  dir_.write("sriovd.yaml", by_netdev);
  start();
  auto by_address = ctl({"release", "0000:3b:00.0", "1"});
  EXPECT_EQ(by_address.exit_code, 0) << by_address.output;
  json devices = request({{"cmd", "devices"}})["result"];
  EXPECT_EQ((*find_vf(devices, 1))["state"], "released");
  ASSERT_EQ(ctl({"reload"}).exit_code, 0);
  auto whole = ctl({"release", "simpf0"});
  EXPECT_EQ(whole.exit_code, 0) << whole.output;
  EXPECT_THAT(whole.output, HasSubstr("0000:3b:00.0 VF 0, 0000:3b:00.0 VF 1"));
  devices = request({{"cmd", "devices"}})["result"];
  EXPECT_EQ((*find_vf(devices, 0))["state"], "released");
  EXPECT_EQ((*find_vf(devices, 1))["state"], "released");
  EXPECT_EQ((*find_vf(devices, 0))["driver"], "iavf");
  auto unknown = ctl({"release", "simpf9"});
  EXPECT_EQ(unknown.exit_code, 1);
  EXPECT_THAT(unknown.output, HasSubstr("PF 'simpf9' is not configured"));
}

// Issue 25 item 11: the VF's driver rebound makes a new netdev (a new
// ifindex) under a running bridged device: the device follows it.
TEST_F(Daemon, ABridgedVfsNetdevMadeAnewIsFollowed) {
  const std::string ns = "sriovd-fw" + std::to_string(::getpid());
  test::TestNetns netns(ns);
  if (!netns.add()) GTEST_SKIP() << "needs root for a network namespace (ip netns add): " << netns.why;
  dir_.write("sriovd.yaml", config_text(socket(), 2) +
                                "virtio_devices:\n  - {name: vfb0, type: net, transport: vhost-user, socket: " +
                                dir_.file("run/vfb0.sock") + ", backend: {type: vf, pf: \"0000:3b:00.0\", vf: 1}}\n");
  auto device = [&] { return request({{"cmd", "devices"}})["result"]["virtio_devices"][0]; };
  start({}, netns.exec());
  const json before = device();
  ASSERT_NE(before.value("state", ""), "not served") << daemon_->log();
  const unsigned old_index = before["backend"].value("ifindex", 0U);
  ASSERT_NE(old_index, 0U) << before.dump();
  // The VF's netdev goes, as when its driver is unbound; the simulated host
  // makes a new one when the VF is asked for it again (a driver bound anew).
  const std::string netdev = before["backend"].value("netdev", "");
  ASSERT_EQ(test::run({"/sbin/ip", "-n", ns, "link", "del", netdev}).exit_code, 0);
  json now;
  for (int i = 0; i < 100; ++i) {
    now = device();
    if (now["backend"].value("ifindex", 0U) != 0 && now["backend"].value("ifindex", 0U) != old_index &&
        now.value("state", "") != "not served")
      break;
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_NE(now["backend"].value("ifindex", 0U), old_index) << now.dump() << daemon_->log();
  EXPECT_NE(now.value("state", ""), "not served") << now.dump();
  EXPECT_THAT(daemon_->log(), HasSubstr("restarting the device on it"));
  daemon_->signal(SIGTERM);
  ASSERT_TRUE(daemon_->wait_for(10s));
}

TEST_F(Daemon, AReloadThatFailsOnTheHostRollsBackAndKeepsTheOldConfig) {
  write_config(2);
  start();
  // The third VF's binding will fail: the kernel refuses its driver_override.
  auto f = ctl({"simulate-fault", "0000:3b:02.2/driver_override", "--errno", "16"});
  ASSERT_EQ(f.exit_code, 0) << f.output;
  dir_.write("sriovd.yaml", config_text(socket(), 3) +
                                "      - index: 2\n        assign: {owner: vm3, socket: " + socket() + ".vf2}\n");
  auto reload = ctl({"reload"});
  EXPECT_EQ(reload.exit_code, 1);
  EXPECT_THAT(reload.output, HasSubstr("rolled back"));
  EXPECT_THAT(reload.output, HasSubstr("Device or resource busy"));
  json status = request({{"cmd", "status"}})["result"];
  EXPECT_EQ(status["vfs"], 2);
  json devices = request({{"cmd", "devices"}})["result"];
  EXPECT_EQ(devices["physical_functions"][0]["active_vfs"], 2);
  EXPECT_EQ((*find_vf(devices, 0))["driver"], "vfio-pci");
}

// transport: vduse on a kernel without VDUSE: the device is not served and
// says what to load; nothing is recorded as made; the other devices serve.
TEST_F(Daemon, VduseDeviceWithoutVduseIsNotServedSayingWhy) {
  if (::access("/dev/vduse/control", F_OK) == 0)
    GTEST_SKIP() << "this kernel has VDUSE: vm.vduse tests the device itself (6.12 guest)";
  if (::access("/dev/net/tun", R_OK | W_OK) != 0) GTEST_SKIP() << "needs /dev/net/tun (and root) for tap backends";
  const std::string tag = std::to_string(::getpid() % 100000);
  dir_.write("sriovd.yaml", config_text(socket(), 1) + "virtio_devices:\n" +
                                "  - {name: vq0, type: net, transport: vduse, backend: {type: tap, name: vq" + tag +
                                "}}\n  - {name: vu0, type: net, transport: vhost-user, socket: " +
                                dir_.file("run/vu0.sock") + ", backend: {type: tap, name: vu" + tag + "}}\n");
  start();
  std::map<std::string, json> by_name;
  const json devices = request({{"cmd", "devices"}});
  for (const auto& d : devices["result"]["virtio_devices"]) by_name[d["name"].get<std::string>()] = d;
  EXPECT_EQ(by_name["vq0"]["state"], "not served") << by_name["vq0"].dump();
  const std::string reason = by_name["vq0"].value("reason", "");
  EXPECT_NE(reason.find("/dev/vduse/control"), std::string::npos) << reason;
  EXPECT_NE(reason.find("modprobe vduse"), std::string::npos) << reason;
  EXPECT_EQ(by_name["vq0"]["transport"], "vduse");
  EXPECT_EQ(by_name["vu0"]["state"], "listening") << by_name["vu0"].dump();
  // Nothing was made, so nothing is journalled for a later start to remove.
  const std::string journal = dir_.file("state/vduse-devices");
  EXPECT_TRUE(!std::filesystem::exists(journal) || std::filesystem::file_size(journal) == 0);
}

// A reload starts the virtio devices the file adds, restarts those it
// changes, stops those it drops, and leaves the others connected; one that
// could not be served is tried again.
TEST_F(Daemon, ReloadStartsRestartsAndStopsVirtioDevices) {
  if (::access("/dev/net/tun", R_OK | W_OK) != 0) GTEST_SKIP() << "needs /dev/net/tun (and root) for tap backends";
  const std::string ns = "sriovd-rl" + std::to_string(::getpid());
  const std::string tag = std::to_string(::getpid() % 100000);
  auto device = [&](const std::string& name, int queues, const std::string& netns, const std::string& extra = "") {
    return "  - {name: " + name + ", type: net, transport: vhost-user, socket: " + dir_.file("run/" + name + ".sock") +
           ", queues: " + std::to_string(queues) + extra + ", backend: {type: tap, name: rl" + name + tag +
           ", netns: " + netns + "}}\n";
  };
  auto configure = [&](const std::string& devices) {
    dir_.write("sriovd.yaml", config_text(socket(), 1) + "virtio_devices:\n" + devices);
  };
  auto virtio = [&] {
    std::map<std::string, json> by_name;
    const json devices = request({{"cmd", "devices"}});
    for (const auto& d : devices["result"]["virtio_devices"]) by_name[d["name"].get<std::string>()] = d;
    return by_name;
  };
  test::TestNetns netns(ns);
  // a0's namespace does not exist yet: a0 is not served.
  configure(device("a0", 1, ns) + device("b0", 1, "sriovd-nonexistent"));
  start();
  ASSERT_EQ(virtio()["a0"]["state"], "not served") << virtio()["a0"].dump();
  ASSERT_TRUE(netns.add()) << netns.why;
  // Unchanged settings, now servable: the reload serves a0. b0 goes, c0 comes.
  configure(device("a0", 1, ns) + device("c0", 1, ns));
  ASSERT_EQ(request({{"cmd", "reload"}})["ok"], true);
  auto now = virtio();
  EXPECT_EQ(now["a0"]["state"], "listening") << now["a0"].dump();
  EXPECT_EQ(now["c0"]["state"], "listening") << now["c0"].dump();
  EXPECT_FALSE(now.count("b0"));
  EXPECT_FALSE(std::filesystem::exists(dir_.file("run/b0.sock")));
  EXPECT_EQ(test::run({"/sbin/ip", "-n", ns, "link", "show", "rla0" + tag}).exit_code, 0);
  // A front-end on c0 stays connected through a reload that changes a0 only.
  {
    UniqueFd front(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string c0 = dir_.file("run/c0.sock");
    ASSERT_LT(c0.size(), sizeof addr.sun_path);
    std::strcpy(addr.sun_path, c0.c_str());
    ASSERT_EQ(::connect(front.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << std::strerror(errno);
    ASSERT_TRUE(test::wait_until([&] { return virtio()["c0"]["state"] == "connected"; }, 5s));
    configure(device("a0", 2, ns) + device("c0", 1, ns));
    ASSERT_EQ(request({{"cmd", "reload"}})["ok"], true);
    // A new tap of the same name once the old one is closed (off the
    // control thread: util/retirer.hpp): at once, or started when it is.
    ASSERT_TRUE(test::wait_until([&] { return virtio()["a0"]["state"] == "listening"; }, 10s)) << virtio()["a0"].dump();
    now = virtio();
    EXPECT_EQ(now["a0"]["queue_pairs"], 2);
    EXPECT_EQ(now["c0"]["state"], "connected") << "an unchanged device keeps its front-end";
    EXPECT_EQ(now["c0"]["vhost_user"]["connections"], 1);
  }
  // A change that leaves the tap's own settings (name, namespace, queues)
  // as they were keeps the tap itself: the same link, addresses and all.
  const auto ifindex = [&] {
    const auto r = test::run({"/sbin/ip", "-n", ns, "-j", "link", "show", "rla0" + tag});
    return r.exit_code == 0 ? json::parse(r.output)[0]["ifindex"].get<int>() : -1;
  };
  const int before = ifindex();
  ASSERT_GT(before, 0);
  configure(device("a0", 2, ns, ", queue_size: 512") + device("c0", 1, ns));
  ASSERT_EQ(request({{"cmd", "reload"}})["ok"], true);
  now = virtio();
  EXPECT_EQ(now["a0"]["state"], "listening") << now["a0"].dump();
  EXPECT_EQ(now["a0"]["queue_size"], 512) << now["a0"].dump();
  EXPECT_EQ(ifindex(), before) << "the changed device got a new tap";
  // Dropping a0 deletes its tap (closed off the control thread: soon after
  // the reload's answer).
  configure(device("c0", 1, ns));
  ASSERT_EQ(request({{"cmd", "reload"}})["ok"], true);
  EXPECT_FALSE(virtio().count("a0"));
  EXPECT_TRUE(test::wait_until(
      [&] {
        return test::run({"/sbin/ip", "-n", ns, "link", "show", "rla0" + tag}).exit_code != 0;
      },
      10s));
  EXPECT_FALSE(std::filesystem::exists(dir_.file("run/a0.sock")));
}

TEST_F(Daemon, SigtermReleasesTheHostBeforeExiting) {
  write_config(2);
  start();
  daemon_->signal(SIGTERM);
  auto status = daemon_->wait_for(5s);
  ASSERT_TRUE(status);
  EXPECT_EQ(WEXITSTATUS(*status), 0);
  EXPECT_THAT(daemon_->log(), HasSubstr("host released: "));
  EXPECT_THAT(daemon_->log(), HasSubstr("0000:3b:00.0: sriov_numvfs 2 -> 0"));
  json journal = json::parse(test::read_file(dir_.file("state/state-simulated.json")));
  EXPECT_TRUE(journal["ledger"].empty());
  EXPECT_TRUE(journal["txn"].is_null());
}

// A VF's netdev through a macvtap: the link is there while the device is
// served and goes with a clean stop; one a crash (SIGKILL) leaves is
// deleted by the next start, here one where the device is no longer
// configured. The daemon runs in a network namespace of the test's (ip
// netns exec gives it that namespace's sysfs), so the links are the test's.
TEST_F(Daemon, MacvtapOfACrashedRunIsDeletedAtTheNextStart) {
  const std::string ns = "sriovd-it" + std::to_string(::getpid());
  test::TestNetns netns(ns);
  if (!netns.add()) GTEST_SKIP() << "needs root for a network namespace (ip netns add): " << netns.why;
  const std::vector<std::string> in_ns = netns.exec();
  auto configure = [&](bool with_device) { write_vf_device_config("mvt0", "macvtap", with_device); };
  auto macvtaps = [&] { return test::run({"/sbin/ip", "-n", ns, "-d", "link", "show", "type", "macvtap"}).output; };
  auto stop = [&](int signo) {
    daemon_->signal(signo);
    ASSERT_TRUE(daemon_->wait_for(10s));
  };

  // The link of the device as `sriovctl devices` shows it.
  auto served_link = [&] {
    const json dev = request({{"cmd", "devices"}})["result"]["virtio_devices"][0];
    EXPECT_EQ(dev["backend"]["via"], "macvtap");
    return dev["backend"].value("macvtap", "");
  };

  configure(true);
  start({}, in_ns);
  std::string link = served_link();
  ASSERT_FALSE(link.empty()) << daemon_->log();
  EXPECT_THAT(macvtaps(), HasSubstr(link + "@"));
  EXPECT_THAT(macvtaps(), HasSubstr("alias sriovd:" + dir_.file("state") + " mvt0"));
  stop(SIGTERM);
  EXPECT_THAT(macvtaps(), Not(HasSubstr(link + "@"))) << "a clean stop deletes the link";

  start({}, in_ns);
  link = served_link();  // the simulated VF's netdev is made anew: another ifindex
  ASSERT_THAT(macvtaps(), HasSubstr(link + "@"));
  stop(SIGKILL);
  ASSERT_THAT(macvtaps(), HasSubstr(link + "@")) << "a crash leaves it";

  configure(false);
  start({}, in_ns);
  EXPECT_THAT(macvtaps(), Not(HasSubstr(link + "@")));
  EXPECT_THAT(daemon_->log(), HasSubstr("deleted macvtap " + link));
  stop(SIGTERM);
}

// backend.via: af_xdp - sriovd's XDP program on the VF's netdev while the
// device is served, the sockets' mode in `sriovctl devices`, and the
// program a SIGKILLed run left found by its owner and removed at the next
// start (the simulated VF's netdev is a veth, which has native XDP).
TEST_F(Daemon, XdpProgramOfACrashedRunIsRemovedAtTheNextStart) {
  const std::string ns = "sriovd-xd" + std::to_string(::getpid());
  test::TestNetns netns(ns);
  if (!netns.add()) GTEST_SKIP() << "needs root for a network namespace (ip netns add): " << netns.why;
  const std::vector<std::string> in_ns = netns.exec();
  auto configure = [&](bool with_device) { write_vf_device_config("xd0", "af_xdp", with_device); };
  auto xdp_of = [&](const std::string& dev) {
    return test::run({"/sbin/ip", "-n", ns, "-d", "link", "show", "dev", dev}).output;
  };
  configure(true);
  start({}, in_ns);
  const json dev = request({{"cmd", "devices"}})["result"]["virtio_devices"][0];
  ASSERT_NE(dev.value("state", ""), "not served") << dev.dump() << daemon_->log();
  EXPECT_EQ(dev["backend"]["via"], "af_xdp");
  EXPECT_EQ(dev["backend"]["xdp_mode"], "copy") << "a veth has no zero-copy AF_XDP";
  EXPECT_EQ(dev["backend"]["xdp_received"].size(), 4U) << "a socket per RX queue of the simulated VF's netdev";
  const std::string netdev = dev["backend"].value("netdev", "");
  EXPECT_THAT(xdp_of(netdev), HasSubstr("prog/xdp id"));
  const auto table = test::run({SRIOVCTL_BIN, "--socket", socket(), "devices"});
  EXPECT_THAT(table.output, HasSubstr("af_xdp (copy)"));
  daemon_->signal(SIGKILL);
  ASSERT_TRUE(daemon_->wait_for(10s));
  ASSERT_THAT(xdp_of(netdev), HasSubstr("prog/xdp id")) << "a crash leaves the program";

  configure(false);
  start({}, in_ns);
  EXPECT_THAT(xdp_of(netdev), Not(HasSubstr("prog/xdp"))) << daemon_->log();
  EXPECT_THAT(daemon_->log(), HasSubstr("removed the XDP program an earlier run left on " + netdev +
                                        " (sriovd:" + dir_.file("state") + " xd0)"));
  daemon_->signal(SIGTERM);
  ASSERT_TRUE(daemon_->wait_for(10s));
}

// Issue 11, item 17: a SIGKILLed daemon (as the watchdog does after a hang)
// left its simulated VF netdevs (veths) behind; the next start could not
// create them and the VF-backed device stayed "not served". The veth names
// its maker in its alias: a dead one's is made anew. A device that cannot
// be served says why in `sriovctl devices`.
TEST_F(Daemon, SimulatedVfNetdevsOfACrashedRunAreMadeAnew) {
  const std::string ns = "sriovd-vt" + std::to_string(::getpid());
  test::TestNetns netns(ns);
  if (!netns.add()) GTEST_SKIP() << "needs root for a network namespace (ip netns add): " << netns.why;
  const std::vector<std::string> in_ns = netns.exec();
  dir_.write("sriovd.yaml", config_text(socket(), 2) +
                                "virtio_devices:\n  - {name: vfb0, type: net, transport: vhost-user, socket: " +
                                dir_.file("run/vfb0.sock") + ", backend: {type: vf, pf: \"0000:3b:00.0\", vf: 1}}\n");
  auto state = [&] { return request({{"cmd", "devices"}})["result"]["virtio_devices"][0].value("state", ""); };
  start({}, in_ns);
  ASSERT_NE(state(), "not served") << daemon_->log();
  daemon_->signal(SIGKILL);
  ASSERT_TRUE(daemon_->wait_for(10s));
  const auto left = test::run({"/sbin/ip", "-n", ns, "-d", "link", "show"}).output;
  ASSERT_THAT(left, HasSubstr("alias sriovd-sim pid=")) << "a crash leaves the veth, with its owner";
  start({}, in_ns);
  EXPECT_NE(state(), "not served") << daemon_->log();
  // A link of that name that is not sriovd's is named, never taken over.
  daemon_->signal(SIGKILL);
  ASSERT_TRUE(daemon_->wait_for(10s));
  std::istringstream links(test::run({"/sbin/ip", "-n", ns, "-o", "link", "show"}).output);
  int renamed = 0;
  for (std::string line; std::getline(links, line);) {
    if (line.find("alias sriovd-sim pid=") == std::string::npos) continue;
    const auto from = line.find(": ") + 2;
    const std::string name = line.substr(from, line.find('@', from) - from);
    ASSERT_EQ(test::run({"/sbin/ip", "-n", ns, "link", "set", name, "alias", "someone-else"}).exit_code, 0) << name;
    ++renamed;
  }
  ASSERT_EQ(renamed, 2) << "the VF's side and the wire side";
  start({}, in_ns);
  EXPECT_EQ(state(), "not served");
  const auto shown = test::run({SRIOVCTL_BIN, "--socket", socket(), "devices"});
  EXPECT_THAT(shown.output, HasSubstr("not served: ")) << shown.output;
  EXPECT_THAT(shown.output, HasSubstr("is not sriovd's")) << shown.output;
  daemon_->signal(SIGTERM);
  ASSERT_TRUE(daemon_->wait_for(10s));
}

TEST(SriovdCli, CheckConfigVersionAndUsage) {
  auto ok = test::run({SRIOVD_BIN, "--check-config", std::string(SRIOVD_SOURCE_DIR) + "/config/demo.yaml"});
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_THAT(ok.output, HasSubstr("OK (host simulated"));
  test::TempDir dir;
  const std::string bad = dir.write("bad.yaml", "version: 1\nhost: system\nlog_level: loud\n");
  auto r = test::run({SRIOVD_BIN, "--check-config", bad});
  EXPECT_EQ(r.exit_code, 78);
  EXPECT_THAT(r.output, HasSubstr(bad + ":3:12: log_level: expected one of"));
  // A DRA driver without a way to the API server: refused by name, at the
  // check and at the start, with nothing changed.
  std::ifstream demo(std::string(SRIOVD_SOURCE_DIR) + "/config/demo.yaml");
  std::stringstream text;
  text << demo.rdbuf();
  std::string with_dra = text.str();
  with_dra += with_dra.find("\nkubernetes:") == std::string::npos ? "kubernetes:\n  dra: {}\n" : "";
  const std::string dra = dir.write("dra.yaml", with_dra);
  auto d = test::run(
      {"/usr/bin/env", "-u", "KUBECONFIG", "-u", "KUBERNETES_SERVICE_HOST", SRIOVD_BIN, "--check-config", dra});
  EXPECT_EQ(d.exit_code, 78) << d.output;
  EXPECT_THAT(d.output, HasSubstr("kubernetes.dra (line ")) << d.output;
  EXPECT_THAT(d.output, HasSubstr("no kubeconfig (kubernetes.dra.kubeconfig, $KUBECONFIG)")) << d.output;
  auto s = test::run(
      {"/usr/bin/env", "KUBECONFIG=" + dir.file("no-such-kubeconfig"), SRIOVD_BIN, "--config", dra, "--foreground"});
  EXPECT_EQ(s.exit_code, 78) << s.output;
  EXPECT_THAT(s.output, HasSubstr(dir.file("no-such-kubeconfig"))) << s.output;
  EXPECT_THAT(s.output, HasSubstr("; nothing was changed")) << s.output;
  auto v = test::run({SRIOVD_BIN, "--version"});
  EXPECT_EQ(v.exit_code, 0);
  EXPECT_THAT(v.output, HasSubstr("sriovd 0.1.0"));
  EXPECT_EQ(test::run({SRIOVD_BIN, "--no-such-flag"}).exit_code, 64);
  EXPECT_EQ(test::run({SRIOVD_BIN, "--log-level", "loud"}).exit_code, 64);
}

// The shipped bash completion, driven as bash drives it: subcommands and
// options come from the binary's own --help.
TEST(SriovctlCli, BashCompletionOffersSubcommandsOptionsAndArguments) {
  auto complete = [](const std::string& words, int cword) {
    const std::string script = "source " + std::string(SRIOVD_SOURCE_DIR) +
                               "/scripts/bash-completion/sriovctl; COMP_WORDS=(" + SRIOVCTL_BIN + " " + words +
                               "); COMP_CWORD=" + std::to_string(cword) + "; _sriovctl; echo \"${COMPREPLY[*]}\"";
    return test::run({"/bin/bash", "-c", script}).output;
  };
  EXPECT_EQ(complete("''", 1),
            "status devices routes stats reload plan claims version release simulate-fault simulate-interrupt "
            "simulate-link upgrade udev-event\n");
  EXPECT_EQ(complete("de", 1), "devices\n");
  EXPECT_EQ(complete("upgrade --f", 2), "--force\n");
  EXPECT_EQ(complete("upgrade --b", 2), "--binary\n");
  EXPECT_EQ(complete("devices --js", 2), "--json\n");
  EXPECT_EQ(complete("simulate-fault --ti", 2), "--times --timeout\n");
  EXPECT_EQ(complete("udev-event re", 2), "remove\n");
}

TEST(SriovctlCli, NoDaemonIsAClearError) {
  auto r = test::run({SRIOVCTL_BIN, "--socket", "/tmp/no-such-sriovd.sock", "status"});
  EXPECT_EQ(r.exit_code, 69);
  EXPECT_THAT(r.output, HasSubstr("cannot connect to /tmp/no-such-sriovd.sock (is sriovd running?)"));
}

// --- VFs exported over vfio-user by the daemon ---

json export_of(const json& devices, const std::string& sock) {
  for (const auto& e : devices["result"]["vfio_user_exports"])
    if (e["socket"] == sock) return e;
  return json();
}

TEST_F(Daemon, AssignedVfIsServedOverVfioUserAndReleasedWithIt) {
  write_config(2);
  start();
  const std::string vf0 = socket() + ".vf0";
  {
    guest::VfioUserClient c(vf0);
    EXPECT_EQ(c.device_info().num_regions, 9U);
    EXPECT_EQ(c.read32(VFIO_PCI_CONFIG_REGION_INDEX, 0) & 0xffff, 0x8086U);
    EXPECT_EQ(c.irq_info(VFIO_PCI_MSIX_IRQ_INDEX).count, 4U);  // msix_vectors_per_vf
    const json e = export_of(request({{"cmd", "devices"}}), vf0);
    EXPECT_EQ(e["state"], "connected") << e.dump();
    EXPECT_EQ(e["vf"], "0000:3b:02.0");
    EXPECT_EQ(e["msix_policy"], "adaptive");
    // Giving the VF back ends the export first: the client sees the end.
    const json r = request({{"cmd", "release"}, {"pf", "0000:3b:00.0"}, {"vf", 0}});
    ASSERT_TRUE(r.value("ok", false)) << r.dump();
    EXPECT_THROW(c.device_info(), std::exception);
  }
  EXPECT_FALSE(std::filesystem::exists(vf0));
  EXPECT_TRUE(export_of(request({{"cmd", "devices"}}), vf0).is_null());
  ASSERT_TRUE(request({{"cmd", "reload"}}).value("ok", false));
  ASSERT_TRUE(std::filesystem::exists(vf0));
  guest::VfioUserClient again(vf0);
  EXPECT_EQ(again.device_info().num_irqs, 5U);
}

// Issue 11, item 16: each export has its own socket access - owner, group,
// mode and the peer uids admitted - separate from the control API's, set at
// creation and applied to a running export by a reload. A VMM allowed on
// its socket may not use the control API, and the reverse.
TEST_F(Daemon, EachExportHasItsOwnSocketAccessAndAReloadAppliesIt) {
  auto configure = [&](const std::string& access) {
    std::string text = config_text(socket(), 2, "  allowed_uids: [0]\n");
    const std::string plain = "assign: {owner: vm1, socket: " + socket() + ".vf0}";
    text.replace(text.find(plain), plain.size(),
                 "assign: {owner: vm1, socket: " + socket() + ".vf0, access: " + access + "}");
    dir_.write("sriovd.yaml", text);
  };
  const std::string vf0 = socket() + ".vf0";
  configure("{user: nobody, group: nogroup, mode: \"0600\", allowed_uids: [65534]}");
  start();
  struct stat st {};
  ASSERT_EQ(::stat(vf0.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600U);
  EXPECT_EQ(st.st_uid, 65534U);
  // The test runs as root: on the control API's list, not on the export's.
  EXPECT_THROW(guest::VfioUserClient c(vf0), std::exception);
  json e = export_of(request({{"cmd", "devices"}}), vf0);
  EXPECT_EQ(e["vfio_user"]["refused_peers"], 1) << e.dump();
  EXPECT_THAT(e["vfio_user"].value("last_error", ""), HasSubstr("refused uid 0: not in the export's allowed_uids"));
  // A reload gives the running export its new access.
  configure("{mode: \"0660\", allowed_uids: [0]}");
  ASSERT_TRUE(request({{"cmd", "reload"}}).value("ok", false));
  ASSERT_EQ(::stat(vf0.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660U);
  guest::VfioUserClient c(vf0);
  EXPECT_EQ(c.device_info().num_regions, 9U);
}

// Issue 24 item 9: a VMM that can write its socket's directory (libvirt
// and KubeVirt keep one per VM) puts a symlink to a root-only file where
// its socket was. The next routine reload gives the access to the socket
// the daemon made - not to the file at the end of the symlink - and
// stopping the export leaves the VMM's symlink alone.
TEST_F(Daemon, AReloadNeverFollowsWhatAPeerPutAtItsSocketPath) {
  const std::string vm_dir = dir_.file("vm1");
  ASSERT_EQ(::mkdir(vm_dir.c_str(), 0777), 0);
  ASSERT_EQ(::chmod(vm_dir.c_str(), 0777), 0);  // the VMM's own directory: it may rename in it
  const std::string vf0 = vm_dir + "/vf0.sock";
  auto configure = [&](const std::string& mode) {
    std::string text = config_text(socket(), 2, "  allowed_uids: [0]\n");
    const std::string plain = "assign: {owner: vm1, socket: " + socket() + ".vf0}";
    text.replace(
        text.find(plain), plain.size(),
        "assign: {owner: vm1, socket: " + vf0 + ", access: {user: nobody, group: nogroup, mode: \"" + mode + "\"}}");
    dir_.write("sriovd.yaml", text);
  };
  configure("0660");
  start();
  struct stat st {};
  ASSERT_EQ(::stat(vf0.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 65534U);
  const ino_t socket_ino = st.st_ino;
  // The secret: root's, 0600. The VMM's swap: its socket moved aside, a
  // symlink to the secret in its place.
  const std::string secret = dir_.file("shadow");
  dir_.write("shadow", "root:x:0:0\n");
  ASSERT_EQ(::chmod(secret.c_str(), 0600), 0);
  ASSERT_EQ(::rename(vf0.c_str(), (vm_dir + "/moved.sock").c_str()), 0);
  ASSERT_EQ(::symlink(secret.c_str(), vf0.c_str()), 0);
  configure("0666");
  ASSERT_TRUE(request({{"cmd", "reload"}}).value("ok", false));
  ASSERT_EQ(::stat(secret.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 0U) << "the reload gave the file behind the symlink to the VMM";
  EXPECT_EQ(st.st_mode & 0777, 0600U) << "the reload changed the mode of the file behind the symlink";
  // The socket itself, wherever the VMM moved it, has the new mode.
  ASSERT_EQ(::stat((vm_dir + "/moved.sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_ino, socket_ino);
  EXPECT_EQ(st.st_mode & 0777, 0666U);
  // The export goes: the daemon removes its socket only, not the symlink
  // (which is the VMM's) nor the secret.
  dir_.write("sriovd.yaml", config_text(socket(), 2, "  allowed_uids: [0]\n"));  // the export moves elsewhere
  ASSERT_TRUE(request({{"cmd", "reload"}}).value("ok", false));
  struct stat lst {};
  EXPECT_EQ(::lstat(vf0.c_str(), &lst), 0) << "the VMM's symlink was removed";
  EXPECT_TRUE(S_ISLNK(lst.st_mode));
  EXPECT_EQ(::stat(secret.c_str(), &st), 0);
}

namespace {
// A TCP connection to 127.0.0.1:port (blocking, with send/receive timeouts).
UniqueFd tcp_to(int port, int timeout_ms = 3000) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) fd.reset();
  return fd;
}

// GET /metrics; the whole answer, or "" if none came within the timeout.
std::string scrape(int port) {
  UniqueFd fd = tcp_to(port);
  if (!fd) return "";
  const std::string req = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  if (::send(fd.get(), req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) return "";
  std::string out;
  char buf[65536];
  for (ssize_t n; (n = ::recv(fd.get(), buf, sizeof buf, 0)) > 0;) out.append(buf, static_cast<size_t>(n));
  return out;
}
}  // namespace

// Issue 24 item 11: any local user blinded /metrics with a few slow
// connections (one civetweb worker, a 30 s request timeout: 24 of them, 0
// of 4 scrapes answered in 20 s). Now 300 connections that never finish
// their request, and one that sends too much, leave every scrape answered.
TEST_F(Daemon, SlowAndOversizedMetricsClientsDoNotBlindTheEndpoint) {
  write_config(1, "metrics: {listen: \"127.0.0.1:0\"}\n");
  start();
  const int port = request({{"cmd", "status"}})["result"]["metrics"].value("port", 0);
  ASSERT_GT(port, 0);
  std::vector<UniqueFd> slow;
  for (int i = 0; i < 300; ++i) {
    UniqueFd fd = tcp_to(port);
    ASSERT_TRUE(fd.valid()) << "connection " << i;
    (void)::send(fd.get(), "GET /met", 8, MSG_NOSIGNAL);  // and nothing more
    slow.push_back(std::move(fd));
  }
  UniqueFd big = tcp_to(port);
  const std::string huge = "GET /metrics HTTP/1.1\r\nX-Pad: " + std::string(20000, 'a');
  (void)::send(big.get(), huge.data(), huge.size(), MSG_NOSIGNAL);
  for (int i = 0; i < 4; ++i) {
    const std::string got = scrape(port);
    EXPECT_EQ(got.rfind("HTTP/1.1 200 OK", 0), 0U) << "scrape " << i << ": " << got.substr(0, 80);
    EXPECT_NE(got.find("sriovd_vf_info"), std::string::npos) << "scrape " << i;
  }
  const std::string got = scrape(port);
  EXPECT_NE(got.find("sriovd_metrics_connections_closed_total{reason=\"pushed_out\"}"), std::string::npos);
  EXPECT_EQ(got.find("sriovd_metrics_connections_closed_total{reason=\"too_large\"} 0"), std::string::npos)
      << "the oversized request was not closed";
  // The slow ones go at their deadline; the daemon answers on.
  slow.clear();
  EXPECT_EQ(scrape(port).rfind("HTTP/1.1 200 OK", 0), 0U);
  // Not GET /metrics: an answer that says so.
  UniqueFd other = tcp_to(port);
  (void)::send(other.get(), "POST /x HTTP/1.1\r\n\r\n", 21, MSG_NOSIGNAL);
  char buf[64] = {};
  ASSERT_GT(::recv(other.get(), buf, sizeof buf - 1, 0), 0);
  EXPECT_EQ(std::string(buf).rfind("HTTP/1.1 405", 0), 0U) << buf;
}

// Issue 26: counters go by their tables (util/counters.hpp). Every counter
// of a virtio device's queues, of its vhost-user connection, of a VF
// export's vfio-user server and interrupts is in the devices JSON and in
// Prometheus under the same name with the same value - none on one side only,
// none reading 0 there for a key renamed here.
TEST_F(Daemon, EveryCounterIsInTheDevicesJsonAndInPrometheusAlike) {
  const std::string ns = "sriovd-ct" + std::to_string(::getpid());
  test::TestNetns netns(ns);
  if (!netns.add()) GTEST_SKIP() << "needs root for a network namespace (ip netns add): " << netns.why;
  if (::access("/dev/net/tun", R_OK | W_OK) != 0) GTEST_SKIP() << "needs /dev/net/tun (and root) for a tap backend";
  const std::string vfb = dir_.file("run/vfb0.sock");
  dir_.write("sriovd.yaml", config_text(socket(), 2) + "metrics: {listen: \"127.0.0.1:0\"}\n" +
                                "virtio_devices:\n  - {name: vfb0, type: net, transport: vhost-user, socket: " + vfb +
                                ", backend: {type: tap, name: ct" + std::to_string(::getpid() % 100000) +
                                ", netns: " + ns + "}}\n");
  start();
  const int port = request({{"cmd", "status"}})["result"]["metrics"].value("port", 0);
  ASSERT_GT(port, 0);
  guest::VfioUserClient vf(socket() + ".vf0");  // the export counts a connection and its messages
  guest::VirtioNetDriver d(vfb, {.queue_size = 64, .packed = false, .offloads = false});
  d.bring_up();
  std::vector<uint8_t> f(12 + 60, 0xff);
  std::memset(f.data(), 0, 12);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(d.send(f.data(), f.size()));
  auto devices = [&] { return request({{"cmd", "devices"}})["result"]; };
  ASSERT_TRUE(
      test::wait_until([&] { return devices()["virtio_devices"][0]["queues"][1].value("packets", 0) == 5; }, 5s))
      << devices()["virtio_devices"][0].dump();
  // The tap's kernel side may still send (IPv6 router solicitations, MLD
  // after it came up): a pair of reads with no packet between them.
  json now;
  std::string metrics;
  ASSERT_TRUE(test::wait_until(
      [&] {
        now = devices();
        metrics = scrape(port);
        return devices() == now;
      },
      10s))
      << "the counters never held still";
  // The value of the series `name` whose labels include every one given.
  auto sample = [&](const std::string& name, const std::vector<std::string>& labels) -> std::optional<double> {
    std::istringstream lines(metrics);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind(name + "{", 0) != 0) continue;
      const std::string set = line.substr(0, line.find('}') + 1);
      if (std::all_of(labels.begin(), labels.end(),
                      [&](const std::string& l) { return set.find(l) != std::string::npos; }))
        return std::stod(line.substr(line.rfind(' ') + 1));
    }
    return std::nullopt;
  };
  auto same = [&](const json& values, const std::string& key, const std::string& metric,
                  const std::vector<std::string>& labels) {
    ASSERT_TRUE(values.contains(key)) << key << " missing from " << values.dump();
    const auto m = sample(metric, labels);
    ASSERT_TRUE(m.has_value()) << metric << " missing";
    EXPECT_EQ(*m, values[key].get<double>()) << metric;
  };
  const json& dev = now["virtio_devices"][0];
  for (unsigned q = 0; q < 2; ++q)
    for (const auto& c : virtio::kQueueCounters)
      same(dev["queues"][q], c.name, std::string("sriovd_virtio_queue_") + c.name + "_total",
           {"device=\"vfb0\"", "queue=\"" + std::to_string(q) + "\""});
  for (const auto& c : vhost_user::kBackendCounters)
    same(dev["vhost_user"], c.name, std::string("sriovd_virtio_") + c.name + "_total", {"device=\"vfb0\""});
  for (const auto& c : vhost_user::kMigrationCounters)
    same(dev["vhost_user"]["migration"], c.name, std::string("sriovd_vhost_user_") + c.name + "_total",
         {"device=\"vfb0\""});
  EXPECT_EQ(dev["vhost_user"]["migration"]["logging"], false);
  EXPECT_EQ(*sample("sriovd_vhost_user_logging", {"device=\"vfb0\""}), 0);
  const json& exp = now["vfio_user_exports"][0];
  for (const auto& c : vfio_user::kServerCounters)
    same(exp["vfio_user"], c.name, std::string("sriovd_export_") + c.name + "_total", {"vf=\"0\""});
  for (const auto& c : irq::kRouteCounters)
    same(exp["interrupts"], c.name, std::string("sriovd_export_interrupts_") + c.name + "_total", {"vf=\"0\""});
  EXPECT_EQ(dev["queues"][1]["packets"], 5);
  EXPECT_GT(exp["vfio_user"]["messages"].get<int>(), 0);
  EXPECT_GT(*sample("sriovd_virtio_queue_kicks_total", {"device=\"vfb0\"", "queue=\"1\""}), 0);
}

// Issue 27: a virtio-net-pci device moves from one sriovd to another (two
// hosts, their taps in one namespace) with sriovd's vfio-user client as
// the VMM: what the operator sees on the source while it happens (the
// devices JSON, Prometheus and sriovctl agree), the state taken on the
// destination, the guest announced on the destination's wire, and frames
// from that wire reaching the guest.
TEST_F(Daemon, AVirtioPciDeviceMigratesToAnotherSriovd) {
  const std::string ns = "sriovd-mg" + std::to_string(::getpid());
  test::TestNetns netns(ns);
  if (!netns.add()) GTEST_SKIP() << "needs root for a network namespace (ip netns add): " << netns.why;
  if (::access("/dev/net/tun", R_OK | W_OK) != 0) GTEST_SKIP() << "needs /dev/net/tun (and root) for tap backends";
  const std::string id = std::to_string(::getpid() % 100000);
  const std::string tap_a = "mga" + id, tap_b = "mgb" + id;
  auto device = [&](const std::string& sock, const std::string& tap) {
    // A MAC of its own: the destination announces only the device's MAC.
    return "virtio_devices:\n  - {name: vp0, type: net, transport: vfio-user, socket: " + sock +
           ", mac: \"02:00:00:00:0a:01\", backend: {type: tap, name: " + tap + ", netns: " + ns + "}}\n";
  };
  const std::string sock_a = dir_.file("run/vp0.sock");
  dir_.write("sriovd.yaml", config_text(socket(), 2) + "metrics: {listen: \"127.0.0.1:0\"}\n" + device(sock_a, tap_a));
  start();
  // The destination host: another sriovd with its own state, sysfs and sockets.
  const std::string control_b = dir_.file("b/run/control.sock"), sock_b = dir_.file("b/run/vp0.sock");
  dir_.write("b/sriovd.yaml", config_text(control_b, 2) + device(sock_b, tap_b));
  test::Process daemon_b({SRIOVD_BIN, "--config", dir_.file("b/sriovd.yaml"), "--sysfs-root", dir_.file("b/sys")},
                         dir_.file("b/sriovd.log"));
  auto request_b = [&](const json& req) {
    control::Client c(control_b, 5s);
    return c.request(req);
  };
  ASSERT_TRUE(test::wait_until(
      [&] {
        try {
          return request_b({{"cmd", "devices"}})["result"]["virtio_devices"][0].value("state", "") == "listening";
        } catch (const std::exception&) {
          return false;
        }
      },
      10s))
      << daemon_b.log();
  const int port = request({{"cmd", "status"}})["result"]["metrics"].value("port", 0);
  auto pci = [](const json& devices) { return devices["result"]["virtio_devices"][0]; };

  guest::VfioUserClient ca(sock_a);
  std::optional<guest::VfioUserClient> cb;  // the destination's VMM side: outlives the driver that moves to it
  guest::VirtioNetDriver d(ca, {.queue_size = 64, .packed = false, .offloads = false});
  d.bring_up();
  const std::string mac = d.mac();
  EXPECT_EQ(pci(request({{"cmd", "devices"}}))["vfio_user"]["migration"]["state"], "RUNNING");
  const vfio_user::DmaRange ram{d.ram_iova(), d.ram().size()};
  ca.dma_logging_start(4096, {&ram, 1});
  EXPECT_THAT(ctl({"devices"}).output, HasSubstr("(migrating: DMA logging)"));
  EXPECT_EQ(ca.set_mig_state(3), 3U);  // STOP_COPY
  const json m = pci(request({{"cmd", "devices"}}))["vfio_user"]["migration"];
  EXPECT_EQ(m["state"], "STOP_COPY") << m.dump();
  EXPECT_EQ(m["dma_logging"], true);
  EXPECT_THAT(ctl({"devices"}).output, HasSubstr("(migration: STOP_COPY)"));
  const std::string metrics = scrape(port);
  EXPECT_THAT(metrics, HasSubstr("sriovd_vfio_user_migration_state{device=\"vp0\"} 3"));
  EXPECT_THAT(metrics, HasSubstr("sriovd_vfio_user_dma_logging{device=\"vp0\"} 1"));
  for (const auto& c : vfio_user::kMigrationCounters)
    EXPECT_THAT(metrics, HasSubstr(std::string("sriovd_vfio_user_migration_") + c.name + "_total{device=\"vp0\"} " +
                                   std::to_string(m[c.name].get<uint64_t>())))
        << c.name;
  const std::vector<uint8_t> state = ca.mig_read_all();
  (void)ca.dma_logging_report(ram.iova, ram.length, 4096);
  ca.dma_logging_stop();

  // The destination's wire is watched for the guest's announcement.
  test::Process sniff(
      {"/sbin/ip", "netns", "exec", ns, "python3", SRIOVD_SOURCE_DIR "/tests/interop/sniff.py", tap_b, mac},
      dir_.file("sniff.log"));
  ASSERT_TRUE(test::wait_until([&] { return sniff.log().find("ready") != std::string::npos; }, 10s)) << sniff.log();
  cb.emplace(sock_b);
  d.moved_to(*cb);
  EXPECT_EQ(cb->set_mig_state(4), 4U);  // RESUMING
  cb->mig_write_all(state);
  EXPECT_EQ(cb->set_mig_state(2), 2U);  // RUNNING
  const json on_b = pci(request_b({{"cmd", "devices"}}));
  EXPECT_EQ(on_b["state"], "running") << on_b.dump();
  EXPECT_EQ(on_b["vfio_user"]["migration"]["loaded_bytes"], state.size());
  EXPECT_TRUE(test::wait_until([&] { return sniff.log().find(tap_b + " 0x8035 " + mac) != std::string::npos; }, 5s))
      << "no RARP for " << mac << " on the destination's wire: " << sniff.log();
  // A frame from the destination's wire reaches the guest.
  std::string eth;
  for (char c : mac)
    if (c != ':') eth += c;
  eth +=
      "020000000099"
      "88b5";
  for (int i = 0; i < 60; ++i) eth += "a5";
  const test::RunResult sent =
      test::run({"/sbin/ip", "netns", "exec", ns, "python3", "-c",
                 "import socket,sys; s=socket.socket(socket.AF_PACKET,socket.SOCK_RAW); s.bind((sys.argv[1],0)); "
                 "s.send(bytes.fromhex(sys.argv[2]))",
                 tap_b, eth});
  ASSERT_EQ(sent.exit_code, 0) << sent.output;
  std::vector<uint8_t> out(4096);
  size_t got = 0;
  for (int i = 0; i < 20 && got != 12 + eth.size() / 2; ++i) got = d.receive(out.data(), out.size(), 500);
  EXPECT_EQ(got, 12 + eth.size() / 2) << "the frame sent on the destination's tap";
  EXPECT_EQ(out[12 + 12], 0x88);
  EXPECT_EQ(out[12 + 13], 0xb5);
  // The source's VMM resets its side (as QEMU's exit leaves it): RUNNING again.
  ca.reset();
  EXPECT_EQ(pci(request({{"cmd", "devices"}}))["vfio_user"]["migration"]["state"], "RUNNING");
}

// The metrics endpoint keeps nothing pending on the control thread's
// io_context once the daemon stops: with it on (and scraped), SIGTERM ends
// the daemon. (Found by the systemd VM test: the stop hung until systemd's
// SIGKILL, 30 s later.)
TEST_F(Daemon, StopsOnSigtermWithMetricsServed) {
  write_config(1, "metrics: {listen: \"127.0.0.1:0\"}\n");
  start();
  const int port = request({{"cmd", "status"}})["result"]["metrics"].value("port", 0);
  ASSERT_EQ(scrape(port).rfind("HTTP/1.1 200 OK", 0), 0U);
  UniqueFd idle = tcp_to(port);  // and a client that is still connected
  daemon_->signal(SIGTERM);
  EXPECT_TRUE(daemon_->wait_for(10s)) << "sriovd did not stop:\n" << daemon_->log();
}

// Issue 24, "also seen": an upgrade does not restart the daemon (by
// design: a restart under QEMU's vfio-user client kills its device), so
// the status says when the binary it runs was replaced.
TEST_F(Daemon, StatusSaysWhenTheBinaryWasReplaced) {
  write_config(1);
  const std::string copy = dir_.file("sriovd-old");
  std::filesystem::copy_file(SRIOVD_BIN, copy);
  std::filesystem::permissions(copy, std::filesystem::perms::owner_all);
  // sh drops the fixture's binary ($1) and execs the copy: the PID stays the daemon's.
  start({}, {"/bin/sh", "-c", "shift; exec " + copy + " \"$@\"", "sh"});
  EXPECT_FALSE(request({{"cmd", "status"}})["result"].value("binary_replaced", true));
  std::filesystem::remove(copy);
  EXPECT_TRUE(request({{"cmd", "status"}})["result"].value("binary_replaced", false));
}

// A VMM that dies mid-storm (SIGKILL) leaves nothing behind in the daemon:
// its routes go, the export listens again, and the next client is served.
TEST_F(Daemon, VfioUserClientCrashAndReconnect) {
  write_config(1);
  start();
  const std::string vf0 = socket() + ".vf0";
  test::Process guest({SRIOVD_GUEST_BIN, "msix-storm", "--socket", vf0, "--seconds", "60", "--rate", "20000"},
                      dir_.file("guest.log"));
  ASSERT_TRUE(test::wait_until(
      [&] {
        return export_of(request({{"cmd", "devices"}}), vf0).value("state", "") == "connected";
      },
      10s))
      << guest.log();
  ASSERT_TRUE(test::wait_until(
      [&] {
        return export_of(request({{"cmd", "devices"}}), vf0)["interrupts"].value("delivered", 0) > 100;
      },
      10s));
  guest.signal(SIGKILL);
  ASSERT_TRUE(guest.wait_for(5s));
  ASSERT_TRUE(test::wait_until(
      [&] {
        return export_of(request({{"cmd", "devices"}}), vf0).value("state", "") == "listening";
      },
      5s));
  const json routes = request({{"cmd", "routes"}});  // kept: a range over a temporary's member would dangle
  ASSERT_TRUE(routes["result"]["routes"].is_array()) << routes.dump();
  for (const auto& r : routes["result"]["routes"]) EXPECT_NE(r["device"], "0000:3b:02.0") << r.dump();
  const test::RunResult again =
      test::run({SRIOVD_GUEST_BIN, "--json", "msix-storm", "--socket", vf0, "--seconds", "1"});
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_GT(json::parse(again.output.substr(again.output.find('{')))["handled"].get<uint64_t>(), 0U) << again.output;
  EXPECT_EQ(export_of(request({{"cmd", "devices"}}), vf0)["vfio_user"]["connections"], 2);
}

// A malformed vfio-user message ends that connection, never the daemon.
TEST_F(Daemon, MalformedVfioUserMessageFailsOnlyThatConnection) {
  write_config(1);
  start();
  const std::string vf0 = socket() + ".vf0";
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, vf0.c_str());
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  const uint32_t garbage[8] = {0x00040001, 0xffffffff, 0, 0, 1, 2, 3, 4};  // VERSION of 4 GiB
  ASSERT_GT(::send(fd, garbage, sizeof garbage, MSG_NOSIGNAL), 0);
  char buf[64];
  pollfd p{fd, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 5000), 1);
  EXPECT_LE(::recv(fd, buf, sizeof buf, 0), 0);  // closed
  ::close(fd);
  EXPECT_TRUE(request({{"cmd", "version"}}).value("ok", false));
  guest::VfioUserClient c(vf0);
  EXPECT_EQ(c.device_info().num_regions, 9U);
  EXPECT_GE(export_of(request({{"cmd", "devices"}}), vf0)["vfio_user"]["protocol_errors"].get<int>(), 1);
}

// Issue 41: `sriovctl upgrade` execs the binary in place (the same PID)
// and hands the vhost-user device over: the front-end keeps its connection
// and its rings (frames sent after the upgrade go through), the tap is the
// same interface (its ifindex), and the new instance says what it took
// over. A successor that cannot read the handover is found out first: the
// upgrade is refused and the running sriovd goes on.
TEST_F(Daemon, AnUpgradeInPlaceKeepsEveryFrontEndAndItsTap) {
  test::TestNetns netns("sriovd-up" + std::to_string(::getpid()));
  const std::string id = std::to_string(::getpid() % 100000);
  const std::string tap = "up" + id, pci_tap = "upp" + id;
  if (const auto why = write_tap_device_config(netns, tap, pci_tap)) GTEST_SKIP() << *why;
  const std::string& ns = netns.name;
  const std::string vfb = dir_.file("run/vfb0.sock");
  start();
  const int pid = request({{"cmd", "status"}})["result"].value("pid", 0);
  auto ifindex = [&](const std::string& name) {
    const auto r = test::run({"/sbin/ip", "-n", ns, "-o", "link", "show", "dev", name});
    return r.exit_code == 0 ? r.output.substr(0, r.output.find(':')) : std::string("none");
  };
  const std::string index_before = ifindex(tap), pci_index_before = ifindex(pci_tap);
  ASSERT_NE(index_before, "none");
  ASSERT_NE(pci_index_before, "none");
  guest::VirtioNetDriver d(vfb, {.queue_size = 64, .packed = false, .offloads = false});
  d.bring_up();
  // The VMM of vp0: sriovd's own vfio-user client and guest driver.
  guest::VfioUserClient client(dir_.file("run/vp0.sock"));
  guest::VirtioNetDriver dp(client, {.queue_size = 64, .packed = true, .offloads = false});
  dp.bring_up();
  std::vector<uint8_t> f(12 + 60, 0xff);
  std::memset(f.data(), 0, 12);
  auto tx_packets = [&](int device) {
    return request({{"cmd", "devices"}})["result"]["virtio_devices"][device]["queues"][1].value("packets", 0);
  };
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(d.send(f.data(), f.size()));
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(dp.send(f.data(), f.size()));
  ASSERT_TRUE(test::wait_until([&] { return tx_packets(0) == 5 && tx_packets(1) == 4; }, 5s));
  // The VMM of VF 0's export: vector 1 armed as a guest driver arms it,
  // the VF's interrupts counted on its eventfd.
  const std::string vf = request({{"cmd", "devices"}})["result"]["vfio_user_exports"][0].value("vf", "");
  guest::VfioUserClient vfc(socket() + ".vf0");
  UniqueFd vf_irq(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  vfc.write32(0, 16 + 0, 0xfee00000);
  vfc.write32(0, 16 + 8, 0x4001);
  const int irq_fds[1] = {vf_irq.get()};
  vfc.set_irq_eventfds(VFIO_PCI_MSIX_IRQ_INDEX, 1, irq_fds);
  constexpr uint32_t kMsixCap = 0x7c;  // the simulated VF's
  vfc.write32(VFIO_PCI_CONFIG_REGION_INDEX, kMsixCap,
              (vfc.read32(VFIO_PCI_CONFIG_REGION_INDEX, kMsixCap) & 0xffffU) | (0x8000U << 16U));
  vfc.write32(0, 16 + 12, 0);
  auto vf_interrupts = [&] {
    pollfd p{vf_irq.get(), POLLIN, 0};
    uint64_t n = 0;
    if (::poll(&p, 1, 2000) == 1 && ::read(vf_irq.get(), &n, sizeof n) != sizeof n) n = 0;
    return n;
  };
  ASSERT_EQ(ctl({"simulate-interrupt", vf, "1"}).exit_code, 0);
  ASSERT_EQ(vf_interrupts(), 1U);

  // Refused: a binary that does not read this handover; nothing changes.
  const auto refused = ctl({"upgrade", "--binary", "/bin/true"});
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_NE(refused.output.find("upgrade refused"), std::string::npos) << refused.output;
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(d.send(f.data(), f.size()));
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(dp.send(f.data(), f.size()));
  ASSERT_TRUE(test::wait_until([&] { return tx_packets(0) == 7 && tx_packets(1) == 6; }, 5s))
      << "serving on after a refused upgrade";

  const auto up = ctl({"upgrade"});
  ASSERT_EQ(up.exit_code, 0) << up.output << daemon_->log();
  EXPECT_NE(up.output.find("took over 2 virtio device(s) and 1 VF export(s)"), std::string::npos) << up.output;
  const json status = request({{"cmd", "status"}})["result"];
  EXPECT_EQ(status.value("pid", 0), pid) << "the same process";
  EXPECT_EQ(status["handover"]["virtio_devices"], json::array({"vfb0", "vp0"})) << status.dump();
  EXPECT_EQ(status["handover"]["vf_exports"], json::array({vf})) << status.dump();
  // The VF's VMM noticed nothing: its vector fires through the successor.
  ASSERT_EQ(ctl({"simulate-interrupt", vf, "1"}).exit_code, 0);
  EXPECT_EQ(vf_interrupts(), 1U);
  EXPECT_EQ(vfc.read32(0, 16 + 8), 0x4001U) << "the table as the guest wrote it";
  const json vf_export = request({{"cmd", "devices"}})["result"]["vfio_user_exports"][0];
  EXPECT_EQ(vf_export.value("state", ""), "connected") << vf_export.dump();
  EXPECT_EQ(ifindex(tap), index_before) << "the same tap";
  EXPECT_EQ(ifindex(pci_tap), pci_index_before) << "the same tap";
  // The front-ends noticed nothing: the same connections, rings and memory.
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(d.send(f.data(), f.size()));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(dp.send(f.data(), f.size()));
  ASSERT_TRUE(test::wait_until([&] { return tx_packets(0) == 5 && tx_packets(1) == 3; }, 5s))
      << request({{"cmd", "devices"}})["result"]["virtio_devices"].dump() << daemon_->log();
  const json devices = request({{"cmd", "devices"}})["result"]["virtio_devices"];
  EXPECT_EQ(devices[0]["vhost_user"].value("connections", 0), 1) << devices.dump();
  EXPECT_EQ(devices[0]["vhost_user"].value("protocol_errors", 0), 0) << devices.dump();
  EXPECT_EQ(devices[1].value("state", ""), "running") << devices.dump();
  EXPECT_EQ(devices[1]["vfio_user"].value("connections", 0), 1) << devices.dump();
  EXPECT_EQ(devices[1]["vfio_user"].value("protocol_errors", 0), 0) << devices.dump();
  // The device still answers the client's register reads (BAR0's MAC).
  EXPECT_EQ(dp.mac().size(), 17U);
  const std::string log = daemon_->log();
  EXPECT_NE(log.find("vfb0: front-end taken over from the previous sriovd"), std::string::npos) << log;
  EXPECT_NE(log.find("vp0: client (pid " + std::to_string(::getpid()) + ") taken over from the previous sriovd"),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find("front-end disconnected"), std::string::npos) << log;
  EXPECT_EQ(log.find("client disconnected"), std::string::npos) << log;
}

// Issue 41: a device bridged to a VF through a macvtap keeps the link
// through an upgrade (its queue fds are handed over, the link is not made
// anew), and the VF's netdev stays the same: the front-end's frames go on
// reaching the VF.
TEST_F(Daemon, AnUpgradeKeepsAMacvtapAndItsVf) {
  const std::string ns = "sriovd-um" + std::to_string(::getpid());
  test::TestNetns netns(ns);
  if (!netns.add()) GTEST_SKIP() << "needs root for a network namespace (ip netns add): " << netns.why;
  write_vf_device_config("mvt0", "macvtap", true);
  start({}, netns.exec());
  auto backend = [&] { return request({{"cmd", "devices"}})["result"]["virtio_devices"][0]["backend"]; };
  auto ifindex = [&](const std::string& name) {
    const auto r = test::run({"/sbin/ip", "-n", ns, "-o", "link", "show", "dev", name});
    return r.exit_code == 0 ? r.output.substr(0, r.output.find(':')) : std::string("none");
  };
  const json before = backend();
  const std::string link = before.value("macvtap", ""), vf_netdev = before.value("netdev", "");
  ASSERT_FALSE(link.empty()) << before.dump();
  const std::string link_index = ifindex(link), vf_index = ifindex(vf_netdev);
  ASSERT_NE(link_index, "none");
  guest::VirtioNetDriver d(dir_.file("run/mvt0.sock"), {.queue_size = 64, .packed = false, .offloads = false});
  d.bring_up();
  std::vector<uint8_t> f(12 + 60, 0xff);
  std::memset(f.data(), 0, 12);
  auto tx_packets = [&] {
    return request({{"cmd", "devices"}})["result"]["virtio_devices"][0]["queues"][1].value("packets", 0);
  };
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(d.send(f.data(), f.size()));
  ASSERT_TRUE(test::wait_until([&] { return tx_packets() == 3; }, 5s));
  const auto up = ctl({"upgrade"});
  ASSERT_EQ(up.exit_code, 0) << up.output << daemon_->log();
  EXPECT_EQ(backend().value("macvtap", ""), link) << "the same link";
  EXPECT_EQ(ifindex(link), link_index) << "not made anew";
  EXPECT_EQ(ifindex(vf_netdev), vf_index) << "the VF's netdev as it was";
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(d.send(f.data(), f.size()));
  ASSERT_TRUE(test::wait_until([&] { return tx_packets() == 4; }, 5s)) << daemon_->log();
  EXPECT_EQ(daemon_->log().find("deleted macvtap"), std::string::npos) << daemon_->log();
}

// Issue 41: a handover that fails loses nothing. A successor that cannot
// read this handover's version is found out before the exec: refused, the
// running sriovd goes on. A successor killed in the middle of its takeover
// (SIGKILL while it waits to take over): the front-end's connection ends
// as after any crash, and a clean start converges - the device is served
// again on its socket and a front-end that connects again gets traffic
// through the tap.
TEST_F(Daemon, AFailedHandoverLosesNothing) {
  test::TestNetns netns("sriovd-uf" + std::to_string(::getpid()));
  const std::string tap = "uf" + std::to_string(::getpid() % 100000);
  if (const auto why = write_tap_device_config(netns, tap)) GTEST_SKIP() << *why;
  const std::string vfb = dir_.file("run/vfb0.sock");
  start({"--test-stop-before-takeover"});
  const int pid = request({{"cmd", "status"}})["result"].value("pid", 0);
  auto tx_packets = [&] {
    return request({{"cmd", "devices"}})["result"]["virtio_devices"][0]["queues"][1].value("packets", 0);
  };
  std::vector<uint8_t> f(12 + 60, 0xff);
  std::memset(f.data(), 0, 12);
  {
    guest::VirtioNetDriver d(vfb, {.queue_size = 64, .packed = false, .offloads = false});
    d.bring_up();
    ASSERT_TRUE(d.send(f.data(), f.size()));
    ASSERT_TRUE(test::wait_until([&] { return tx_packets() == 1; }, 5s));

    // A successor from the future: it reads version 4 only.
    dir_.write("future-sriovd", "#!/bin/sh\n[ \"$1\" = --handover-version ] && echo 4 && exit 0\nexit 1\n");
    ASSERT_EQ(::chmod(dir_.file("future-sriovd").c_str(), 0755), 0);
    const auto refused = ctl({"upgrade", "--binary", dir_.file("future-sriovd")});
    EXPECT_EQ(refused.exit_code, 1) << refused.output;
    EXPECT_NE(refused.output.find("reads handovers of version 4; this sriovd writes version 3"), std::string::npos)
        << refused.output;
    ASSERT_TRUE(d.send(f.data(), f.size()));
    ASSERT_TRUE(test::wait_until([&] { return tx_packets() == 2; }, 5s)) << "serving on after the refusal";

    // The successor stops itself before its takeover; killed there.
    try {
      (void)request({{"cmd", "upgrade"}});
    } catch (const std::exception&) {
      // the exec may close the connection before the reply
    }
    const auto stopped = [&] {
      std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
      std::string line;
      std::getline(stat, line);
      const auto close = line.rfind(')');
      return close != std::string::npos && line.size() > close + 2 && line[close + 2] == 'T';
    };
    ASSERT_TRUE(test::wait_until(stopped, 10s)) << daemon_->log();
    daemon_->signal(SIGKILL);
    ASSERT_TRUE(daemon_->wait_for(5s).has_value());
  }
  // A clean start: the device is served again, a front-end that connects
  // again gets its traffic through.
  start();
  guest::VirtioNetDriver again(vfb, {.queue_size = 64, .packed = false, .offloads = false});
  again.bring_up();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(again.send(f.data(), f.size()));
  ASSERT_TRUE(test::wait_until([&] { return tx_packets() == 3; }, 5s)) << daemon_->log();
  const json status = request({{"cmd", "status"}})["result"];
  EXPECT_TRUE(status["handover"].is_null()) << status.dump();
}

}  // namespace
}  // namespace sriovd
