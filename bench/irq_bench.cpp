// scripts/bench irq: what the relay costs, measured against a baseline in the
// same run. Prints one JSON object (BENCH.md fields); human text to stderr.
//
// Ping-pong: one thread signals a source eventfd and spins until its sink
// eventfd is readable. "Direct" is the same with an echo thread standing in
// for the kernel's direct binding (two thread crossings, like the relay
// path); "relay" goes through the engine's relay thread, busy-polling or
// blocking in epoll. added = relay - direct, per percentile.
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "sriovd/irq/engine.hpp"

using namespace sriovd;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kWarmup = 2000;
constexpr int kSamples = 20000;

UniqueFd efd() { return UniqueFd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)); }

void put(int fd) {
  const uint64_t one = 1;
  (void)::write(fd, &one, sizeof one);
}

// Spins until fd has a count, and consumes it.
void spin_take(int fd) {
  uint64_t v;
  while (::read(fd, &v, sizeof v) != sizeof v) {
  }
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

std::vector<double> round_trips(int source, int sink) {
  std::vector<double> us;
  us.reserve(kSamples);
  for (int i = 0; i < kWarmup + kSamples; ++i) {
    const auto t0 = Clock::now();
    put(source);
    spin_take(sink);
    if (i >= kWarmup) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return us;
}

std::vector<double> direct_pingpong() {
  UniqueFd there = efd(), back = efd();
  std::atomic<bool> stop{false};
  std::thread echo([&] {
    uint64_t v;
    while (!stop.load(std::memory_order_relaxed))
      if (::read(there.get(), &v, sizeof v) == sizeof v) put(back.get());
  });
  auto us = round_trips(there.get(), back.get());
  stop = true;
  echo.join();
  return us;
}

std::vector<double> relay_pingpong(bool busy_poll) {
  irq::EngineOptions o;
  o.relay_threads = 1;
  o.busy_poll = busy_poll;
  irq::Engine engine(o);
  const irq::RouteId id = engine.add({"bench", 0, irq::Policy::relay, nullptr});
  UniqueFd sink = efd();
  const int sink_fd = sink.get();
  engine.set_sink(id, std::move(sink));
  engine.unmask(id);
  return round_trips(engine.relay_fd(id), sink_fd);
}

// 64 vectors on one relay thread, a producer on the other core.
double relay_throughput_64v() {
  irq::EngineOptions o;
  o.relay_threads = 1;
  o.busy_poll = true;
  irq::Engine engine(o);
  std::vector<irq::RouteId> ids;
  std::vector<int> sources;
  for (unsigned v = 0; v < 64; ++v) {
    ids.push_back(engine.add({"bench", v, irq::Policy::relay, nullptr}));
    engine.set_sink(ids.back(), efd());
    engine.unmask(ids.back());
    sources.push_back(engine.relay_fd(ids.back()));
  }
  const auto t0 = Clock::now();
  const auto end = t0 + std::chrono::seconds(1);
  while (Clock::now() < end)
    for (int s : sources) put(s);
  // Let the relay finish what was signalled.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  uint64_t delivered = 0;
  for (auto id : ids) delivered += engine.stats(id).delivered;
  return static_cast<double>(delivered) / std::chrono::duration<double>(end - t0).count();
}

// A mask + unmask pair on random routes among 16k: the route update cost.
double routes_16k_update_ns() {
  irq::EngineOptions o;
  o.relay_threads = 0;
  irq::Engine engine(o);
  std::vector<irq::RouteId> ids;
  for (unsigned v = 0; v < 16384; ++v) ids.push_back(engine.add({"bench", v, irq::Policy::relay, nullptr}));
  std::mt19937 rng(42);
  std::vector<irq::RouteId> order(1 << 20);
  for (auto& x : order) x = ids[rng() % ids.size()];
  const auto t0 = Clock::now();
  for (auto id : order) {
    engine.unmask(id);
    engine.mask(id);
  }
  return std::chrono::duration<double, std::nano>(Clock::now() - t0).count() /
         (2.0 * static_cast<double>(order.size()));
}

}  // namespace

int main() {
  std::fprintf(stderr, "irq bench: direct ping-pong...\n");
  const auto direct = direct_pingpong();
  std::fprintf(stderr, "irq bench: relay ping-pong, busy-poll...\n");
  const auto relay_busy = relay_pingpong(true);
  std::fprintf(stderr, "irq bench: relay ping-pong, blocking epoll...\n");
  const auto relay_block = relay_pingpong(false);
  std::fprintf(stderr, "irq bench: 64 vectors on one relay thread...\n");
  const double rate = relay_throughput_64v();
  std::fprintf(stderr, "irq bench: route updates among 16k routes...\n");
  const double update_ns = routes_16k_update_ns();

  const double d50 = percentile(direct, 0.50), d99 = percentile(direct, 0.99);
  nlohmann::json j = {
      {"direct_pingpong_us_p50", d50},
      {"direct_pingpong_us_p99", d99},
      {"relay_pingpong_us_p50", percentile(relay_busy, 0.50)},
      {"relay_added_us_p50", percentile(relay_busy, 0.50) - d50},
      {"relay_added_us_p99", percentile(relay_busy, 0.99) - d99},
      {"relay_added_us_p50_blocking", percentile(relay_block, 0.50) - d50},
      {"relay_irqs_per_sec_64v", rate},
      {"routes_16k_update_ns", update_ns},
      {"samples", kSamples},
  };
  std::printf("%s\n", j.dump(2).c_str());
  return 0;
}
