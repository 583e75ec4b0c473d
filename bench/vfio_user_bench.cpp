// scripts/bench vfio-user: what a vfio-user message costs through the
// server, against a baseline in the same run. A guest that masks on every
// interrupt makes one REGION_WRITE (the MSI-X Vector Control) per
// interrupt, so this is the server's data-plane path. Prints one JSON
// object; human text to stderr.
//
//  - echo: the same request/reply sizes over a socketpair to a thread that
//    reads and answers with plain recv/send (the floor: two thread
//    crossings and four syscalls per round trip);
//  - mask writes: REGION_WRITE of a vector's Vector Control (mask, unmask
//    alternately) through Server and VfProxy on a simulated VF, answered by
//    the server on its io_context thread;
//  - ratio = mask writes per second / echoes per second;
//  - posted: the same writes with No_reply (as QEMU sends BAR writes),
//    40 us apart so the server is asleep in epoll at each one: what one
//    costs the client (posted_write_us), against a plain send of the same
//    size into a socketpair whose reader is asleep in epoll the same way
//    (send_asleep_us: the wakeup alone); posted_ratio = the two (1: the
//    server adds nothing to the client's cost but its wakeup).
//  - polling: the server's loop polling up to 100 us after work
//    (control.poll_us, util/polling_loop.hpp), so it is awake at each
//    write: the posted writes again (posted_polling_us; polling_ratio =
//    posted_polling_us / posted_write_us) and the round trips again
//    (mask_polling_per_sec; mask_polling_ratio = that / mask writes).
// Medians of 5 runs of 20,000 round trips (or posted writes) each.
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "sriovd/irq/engine.hpp"
#include "sriovd/util/polling_loop.hpp"
#include "sriovd/vfio/simulated.hpp"
#include "sriovd/guest/vfio_user_client.hpp"
#include "sriovd/vfio_user/protocol.hpp"
#include "sriovd/vfio_user/server.hpp"
#include "sriovd/vfio_user/vf_proxy.hpp"

using namespace sriovd;
using namespace sriovd::vfio_user;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kRuns = 5;
constexpr int kTrips = 20000;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Round trips of a 16+20-byte request and a 16+16-byte reply over a socketpair.
double echo_per_sec() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) throw std::runtime_error("socketpair");
  UniqueFd a(sv[0]), b(sv[1]);
  std::thread echo([&] {
    uint8_t in[36], out[32] = {};
    for (int i = 0; i < kTrips; ++i) {
      size_t got = 0;
      while (got < sizeof in) {
        const ssize_t n = ::recv(b.get(), in + got, sizeof in - got, 0);
        if (n <= 0) return;
        got += static_cast<size_t>(n);
      }
      (void)::send(b.get(), out, sizeof out, MSG_NOSIGNAL);
    }
  });
  uint8_t req[36] = {}, rep[32];
  const auto t0 = Clock::now();
  for (int i = 0; i < kTrips; ++i) {
    (void)::send(a.get(), req, sizeof req, MSG_NOSIGNAL);
    size_t got = 0;
    while (got < sizeof rep) {
      const ssize_t n = ::recv(a.get(), rep + got, sizeof rep - got, 0);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
  }
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  echo.join();
  return kTrips / s;
}

constexpr auto kGap = std::chrono::microseconds(40);

// kTrips calls of `call`, each kGap after the last (so whoever reads at the
// other end is asleep again): the microseconds one takes, averaged.
template <typename Call>
double spaced_call_us(Call&& call) {
  Clock::duration in_call{};
  for (int i = 0; i < kTrips; ++i) {
    const auto end = Clock::now() + kGap;
    while (Clock::now() < end) {
    }
    const auto t0 = Clock::now();
    call(i);
    in_call += Clock::now() - t0;
  }
  return std::chrono::duration<double, std::micro>(in_call).count() / kTrips;
}

// A 16+20-byte send into a socketpair whose reader sleeps in epoll_wait
// between messages: the microseconds the send takes, averaged.
double send_asleep_us() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) throw std::runtime_error("socketpair");
  UniqueFd a(sv[0]), b(sv[1]);
  std::thread reader([&] {
    UniqueFd ep(::epoll_create1(EPOLL_CLOEXEC));
    epoll_event ev{EPOLLIN, {}};
    ::epoll_ctl(ep.get(), EPOLL_CTL_ADD, b.get(), &ev);
    uint8_t in[36 * 64];
    size_t total = 0;
    while (total < 36U * kTrips) {
      if (::epoll_wait(ep.get(), &ev, 1, 1000) <= 0) return;
      const ssize_t n = ::recv(b.get(), in, sizeof in, MSG_DONTWAIT);
      if (n > 0) total += static_cast<size_t>(n);
    }
  });
  uint8_t req[36] = {};
  const double us = spaced_call_us([&](int) { (void)::send(a.get(), req, sizeof req, MSG_NOSIGNAL); });
  reader.join();
  return us;
}

}  // namespace

int main() {
  // stdout is the JSON's alone (BENCH.md): the server's log lines go to stderr.
  spdlog::set_default_logger(spdlog::stderr_color_st("bench"));
  spdlog::set_level(spdlog::level::warn);
  const std::string socket = "/tmp/sriovd-bench-vfio-user-" + std::to_string(::getpid()) + ".sock";
  irq::EngineOptions o;
  o.relay_threads = 1;
  irq::Engine engine(o);
  auto dev = std::make_unique<vfio::SimulatedDevice>("0000:3b:02.0", 0x8086, 0x154c, 4);
  VfProxy proxy(std::move(dev), engine, irq::Policy::relay, "0000:3b:02.0", BarMapping::trapped);
  asio::io_context io;
  auto work = asio::make_work_guard(io);
  auto server = std::make_unique<Server>(io, socket, proxy);
  PollingLoop loop(io, std::chrono::microseconds(0));
  std::thread runner([&] { loop.run(); });
  // The loop's window and counters are its thread's: `fn` runs there, and
  // is waited for.
  const auto on_loop = [&](auto fn) {
    std::promise<decltype(fn())> done;
    asio::post(io, [&] { done.set_value(fn()); });
    return done.get_future().get();
  };
  const auto set_window = [&](std::chrono::microseconds w) { on_loop([&] { return (loop.set_max_window(w), 0); }); };
  const auto mask_writes_per_sec = [&](guest::VfioUserClient& c) {
    const auto t0 = Clock::now();
    for (int i = 0; i < kTrips; ++i) c.write32(0, 12, static_cast<uint32_t>(i & 1));  // vector 0's Vector Control
    return kTrips / std::chrono::duration<double>(Clock::now() - t0).count();
  };
  const auto posted_write_us = [&](guest::VfioUserClient& c) {
    const double us = spaced_call_us([&](int i) {
      const uint32_t v = static_cast<uint32_t>(i & 1);
      c.post_write(0, 12, {reinterpret_cast<const uint8_t*>(&v), sizeof v});
    });
    // A read flushes them: every one was served, in order (the last one,
    // i odd, masked).
    if (!(c.read32(0, 12) & 1U)) throw std::runtime_error("the last posted write did not take effect");
    return us;
  };

  std::vector<double> echo, mask, posted, asleep, posted_polling, mask_polling;
  {
    guest::VfioUserClient c(socket);
    for (int run = 0; run < kRuns; ++run) {
      std::fprintf(stderr, "vfio-user bench: run %d: echo baseline...\n", run + 1);
      echo.push_back(echo_per_sec());
      std::fprintf(stderr, "vfio-user bench: run %d: mask writes through the server...\n", run + 1);
      mask.push_back(mask_writes_per_sec(c));
      std::fprintf(stderr, "vfio-user bench: run %d: sends into a sleeping reader...\n", run + 1);
      asleep.push_back(send_asleep_us());
      std::fprintf(stderr, "vfio-user bench: run %d: posted mask writes into a sleeping server...\n", run + 1);
      posted.push_back(posted_write_us(c));
    }
    // The polling runs after every sleeping one: a phase that followed a
    // polling one ran slower (its echo baseline and mask writes 0.76-0.81 of
    // the ratio they have otherwise), which bent the sleeping figures.
    set_window(std::chrono::microseconds(100));
    for (int run = 0; run < kRuns; ++run) {
      std::fprintf(stderr, "vfio-user bench: run %d: the same into a polling server...\n", run + 1);
      posted_polling.push_back(posted_write_us(c));
      mask_polling.push_back(mask_writes_per_sec(c));
    }
    set_window(std::chrono::microseconds(0));
  }
  const PollStats polls = on_loop([&] { return loop.stats(); });
  io.stop();
  runner.join();
  server.reset();
  const double e = median(echo), m = median(mask), p = median(posted), a = median(asleep);
  const double pp = median(posted_polling), mp = median(mask_polling);
  const nlohmann::json j = {{"bench", "vfio-user"},         {"echo_roundtrips_per_sec", e},
                            {"mask_writes_per_sec", m},     {"ratio", m / e},
                            {"posted_write_us", p},         {"send_asleep_us", a},
                            {"posted_ratio", p / a},        {"posted_polling_us", pp},
                            {"polling_ratio", pp / p},      {"mask_polling_per_sec", mp},
                            {"mask_polling_ratio", mp / m}, {"polls", polls.polls},
                            {"poll_hits", polls.hits},      {"runs", kRuns},
                            {"roundtrips_per_run", kTrips}};
  std::printf("%s\n", j.dump(2).c_str());
  return 0;
}
