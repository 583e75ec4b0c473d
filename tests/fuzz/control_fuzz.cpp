// The control API as a client on its socket meets it: the whole daemon
// (a simulated host with a PF, its VFs, one exported over vfio-user) runs in
// this process, and each input is one connection that sends the input's
// bytes - request lines, mostly JSON the fuzzer builds from the seeds'
// commands and fields, and anything else. Whatever comes:
//  - every request line gets exactly one reply line, a JSON object with a
//    boolean "ok" and, when it is false, an error with a string code and
//    message; a line over the limit gets one error and the connection ends;
//  - the connection is answered within the deadline (a hang is a finding);
//  - the daemon still answers the next client afterwards.
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "fuzz/socket_peer.hpp"
#include "sriovd/config/loader.hpp"
#include "sriovd/control/protocol.hpp"
#include "sriovd/daemon/daemon.hpp"
#include "sriovd/util/unix_socket.hpp"

namespace {

using namespace sriovd;
using nlohmann::json;

void check(bool ok) {
  if (!ok) std::abort();
}

struct World;
World& world();

struct World {
  World() {
    spdlog::set_level(spdlog::level::off);
    dir = fuzz::socket_dir("ctl");
    socket = (dir / "control.sock").string();
    const std::string config = dir / "sriovd.yaml";
    std::ofstream(config) << "version: 1\nhost: simulated\nlog_level: off\nstate_dir: " << (dir / "state").string()
                          << "\nsimulated:\n  physical_functions:\n    - address: \"0000:3b:00.0\"\n"
                             "      vendor_id: 0x8086\n      device_id: 0x1572\n      total_vfs: 4\n"
                             "      msix_vectors_per_vf: 4\n      netdev: simpf0\n"
                             "control:\n  socket: "
                          << socket
                          << "\ninterrupts:\n  relay_threads: 1\nphysical_functions:\n  - address: \"0000:3b:00.0\"\n"
                             "    num_vfs: 3\n    vfs:\n      - index: 0\n        mac: \"02:00:00:00:00:01\"\n"
                             "        assign:\n          owner: vm1\n          export: vfio-user\n          socket: "
                          << (dir / "vf0.sock").string() << "\n      - index: 1\n        vlan: 7\n";
    daemon::Options o;
    o.config_path = config;
    d = new daemon::Daemon(o, config::load(config));  // lives for the process: the fuzzer may stop anywhere
    runner = std::thread([this] { d->run(); });
    // At exit the daemon stops as it does under systemd - SIGTERM (its own
    // handler, installed after the fuzzer's), the host restored - before
    // anything it uses is destroyed.
    std::atexit([] {
      ::kill(::getpid(), SIGTERM);
      world().runner.join();
    });
  }
  std::filesystem::path dir;
  std::string socket;
  daemon::Daemon* d = nullptr;
  std::thread runner;
};

World& world() {
  static World* w = new World();
  return *w;
}

// Sends `bytes`, half-closes, and reads every reply line until the daemon
// closes or `limit` passes.
std::vector<std::string> converse(const std::string& bytes, std::chrono::milliseconds limit) {
  UniqueFd fd = connect_unix(world().socket, "control socket");
  size_t sent = 0;
  std::string in;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  bool half_closed = false;
  for (;;) {
    if (sent < bytes.size()) {
      const ssize_t n = ::send(fd.get(), bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) sent += static_cast<size_t>(n);
      if (n < 0 && errno != EAGAIN) sent = bytes.size();  // the daemon closed (a line over the limit)
    }
    if (sent == bytes.size() && !half_closed) {
      ::shutdown(fd.get(), SHUT_WR);
      half_closed = true;
    }
    pollfd p{fd.get(), POLLIN, 0};
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    check(left.count() > 0);  // a hang is a finding
    if (::poll(&p, 1, sent < bytes.size() ? 1 : static_cast<int>(left.count())) == 1) {
      char buf[65536];
      const ssize_t n = ::recv(fd.get(), buf, sizeof buf, 0);
      if (n <= 0) break;
      in.append(buf, static_cast<size_t>(n));
    }
  }
  std::vector<std::string> lines;
  for (size_t at = 0; at < in.size();) {
    const size_t nl = in.find('\n', at);
    check(nl != std::string::npos);  // every reply is a whole line
    lines.push_back(in.substr(at, nl - at));
    at = nl + 1;
  }
  return lines;
}

void check_reply(const std::string& line) {
  const json r = json::parse(line, nullptr, false);
  check(!r.is_discarded() && r.is_object());
  check(r.contains("ok") && r["ok"].is_boolean());
  if (!r["ok"].get<bool>()) {
    check(r.contains("error") && r["error"].is_object());
    check(r["error"].contains("code") && r["error"]["code"].is_string());
    check(r["error"].contains("message") && r["error"]["message"].is_string());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)world();
  std::string text(reinterpret_cast<const char*>(data), size);
  if (text.empty() || text.back() != '\n') text += '\n';
  // The requests the daemon should answer: one per line that is not blank,
  // as long as no line is over the limit (that one is answered, and ends it).
  size_t requests = 0;
  bool too_long = false;
  for (size_t at = 0; at < text.size() && !too_long;) {
    const size_t nl = text.find('\n', at);
    std::string line = text.substr(at, nl - at);
    if (line.size() + 1 > control::kMaxLineBytes) too_long = true;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (too_long || line.find_first_not_of(" \t") != std::string::npos) ++requests;
    at = nl + 1;
  }
  // A reload or a release takes the host layer through a transaction: give
  // each line its time, a generous bound for a sanitizer build.
  const auto replies = converse(text, std::chrono::milliseconds(5000 + 2000 * static_cast<long>(requests)));
  for (const auto& r : replies) check_reply(r);
  if (too_long)
    check(replies.size() <= requests);
  else
    check(replies.size() == requests);
  // And the daemon is still there for the next client.
  const auto after = converse("{\"cmd\":\"version\"}\n", std::chrono::seconds(10));
  check(after.size() == 1);
  check(json::parse(after[0])["ok"] == true);
  return 0;
}
