// scripts/bench hostile: what one hostile vfio-user client costs another
// tenant of the same daemon (issue 39). The exports are served on one
// io_context thread, as the daemon serves every export on its control
// thread. A quiet tenant makes round trips (a config-space read of a VF
// export) and its latency is measured alone, then beside each attacker:
//  - noread: asks for replies and never reads them, reconnecting whenever
//    it is dropped (each of its replies held the control thread 1 s before
//    the fix: the quiet tenant's round trip went from 0.2 ms to 996 ms);
//  - dmalog: a virtio-net-pci export's client that logs 8 TiB of DMA and
//    asks for the whole report at 1 GiB pages in a loop (0.4 s of the
//    control thread each before: another tenant waited 25 s).
// Prints one JSON object: quiet_p50_us / quiet_p99_us alone and beside each
// attacker, p99 ratios (goal <= 2), and the attackers' counts. The
// attackers' own client threads share the machine's 2 cores with the rest.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "sriovd/guest/vfio_user_client.hpp"
#include "sriovd/vfio_user/migration.hpp"
#include "sriovd/vfio_user/virtio_pci.hpp"
#include "sriovd/virtio/net.hpp"
#include "support/pair_port.hpp"
#include "sriovd/irq/engine.hpp"
#include "sriovd/vfio/simulated.hpp"
#include "sriovd/vfio_user/protocol.hpp"
#include "sriovd/vfio_user/server.hpp"
#include "sriovd/vfio_user/vf_proxy.hpp"

using namespace sriovd;
using namespace sriovd::vfio_user;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kTrips = 3000;
constexpr int kRuns = 3;

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

// Round trip times (us) of a config-space read.
std::vector<double> round_trips(guest::VfioUserClient& c) {
  std::vector<double> us;
  us.reserve(kTrips);
  for (int i = 0; i < kTrips; ++i) {
    const auto t0 = Clock::now();
    if (c.read32(vfio::kConfigRegion, 0) != 0x154c8086U) throw std::runtime_error("a wrong config read");
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return us;
}

// Asks for 4 KiB replies (GET_REGION_INFO with a 4064-byte argsz) and
// reads none, until the server drops it; then again, until `stop`.
void attack(const std::string& socket, const std::atomic<bool>& stop, std::atomic<int>& sessions) {
  std::vector<uint8_t> msg(sizeof(Header) + 4064, 0);
  while (!stop.load()) {
    try {
      guest::VfioUserClient c(socket);
      ++sessions;
      timeval tv{0, 100000};  // blocked sends look at `stop` again
      (void)::setsockopt(c.fd(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
      for (uint16_t id = 1000; !stop.load(); ++id) {
        const Header h{id, kDeviceGetRegionInfo, static_cast<uint32_t>(msg.size()), kTypeCommand, 0};
        std::memcpy(msg.data(), &h, sizeof h);
        const RegionInfo q{4064, 0, 0, 0, 0, 0};
        std::memcpy(msg.data() + sizeof h, &q, sizeof q);
        const ssize_t n = ::send(c.fd(), msg.data(), msg.size(), MSG_NOSIGNAL);
        if (n < 0 && errno == EAGAIN) continue;
        if (n != static_cast<ssize_t>(msg.size())) break;  // dropped: connect again
      }
    } catch (const std::exception&) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // busy: a client is still being let go
    }
  }
}

// Logs DMA over 8 TiB and asks for all of it, report after report.
void dma_log_attack(const std::string& socket, const std::atomic<bool>& stop, std::atomic<int>& reports) {
  guest::VfioUserClient c(socket);
  const DmaRange all{0, DmaLog::kMaxSpan};
  (void)c.dma_logging_start(4096, {&all, 1});
  while (!stop.load()) {
    (void)c.dma_logging_report(0, DmaLog::kMaxSpan, 1ULL << 30U);
    ++reports;
  }
}

}  // namespace

int main() {
  spdlog::set_default_logger(spdlog::stderr_color_st("bench"));
  spdlog::set_level(spdlog::level::err);
  const std::string base = "/tmp/sriovd-bench-hostile-" + std::to_string(::getpid());
  irq::EngineOptions o;
  o.relay_threads = 1;
  irq::Engine engine(o);
  VfProxy quiet_vf(std::make_unique<vfio::SimulatedDevice>("0000:3b:02.0", 0x8086, 0x154c, 4), engine,
                   irq::Policy::relay, "0000:3b:02.0", BarMapping::trapped);
  VfProxy hostile_vf(std::make_unique<vfio::SimulatedDevice>("0000:3b:02.1", 0x8086, 0x154c, 4), engine,
                     irq::Policy::relay, "0000:3b:02.1", BarMapping::trapped);
  asio::io_context io;
  auto work = asio::make_work_guard(io);
  auto quiet_server = std::make_unique<Server>(io, base + "-quiet.sock", quiet_vf);
  auto hostile_server = std::make_unique<Server>(io, base + "-hostile.sock", hostile_vf);
  virtio::NetConfig nc;
  nc.name = "vnet-hostile";
  virtio::NetDevice net(nc, engine, std::make_unique<test::PairPort>());
  VirtioPci pci(net, engine, nc.name);
  auto logging_server = std::make_unique<Server>(io, base + "-dmalog.sock", pci);
  std::thread runner([&] { io.run(); });

  std::vector<double> alone, attacked, logged;
  std::atomic<int> sessions{0}, reports{0};
  {
    guest::VfioUserClient quiet(base + "-quiet.sock");
    for (int run = 0; run < kRuns; ++run) {
      std::fprintf(stderr, "hostile bench: run %d: the quiet tenant alone...\n", run + 1);
      for (double us : round_trips(quiet)) alone.push_back(us);
      std::fprintf(stderr, "hostile bench: run %d: beside a client that never reads its replies...\n", run + 1);
      std::atomic<bool> stop{false};
      std::thread attacker([&] { attack(base + "-hostile.sock", stop, sessions); });
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // its replies wait by now
      for (double us : round_trips(quiet)) attacked.push_back(us);
      stop.store(true);
      attacker.join();
      std::fprintf(stderr, "hostile bench: run %d: beside a client asking for 8 TiB DMA logging reports...\n", run + 1);
      stop.store(false);
      std::thread logger([&] { dma_log_attack(base + "-dmalog.sock", stop, reports); });
      while (reports.load() == 0) std::this_thread::yield();
      for (double us : round_trips(quiet)) logged.push_back(us);
      stop.store(true);
      logger.join();
    }
  }
  io.stop();
  runner.join();
  quiet_server.reset();
  hostile_server.reset();
  logging_server.reset();
  const double p50a = percentile(alone, 0.5), p99a = percentile(alone, 0.99);
  const double p50h = percentile(attacked, 0.5), p99h = percentile(attacked, 0.99);
  const nlohmann::json j = {{"bench", "hostile"},
                            {"attackers",
                             "noread: never reads its replies, reconnects when dropped; dmalog: 8 TiB "
                             "DMA logging reports in a loop"},
                            {"quiet_p50_us_alone", p50a},
                            {"quiet_p99_us_alone", p99a},
                            {"quiet_p50_us_attacked", p50h},
                            {"quiet_p99_us_attacked", p99h},
                            {"quiet_max_us_attacked", percentile(attacked, 1.0)},
                            {"p99_ratio", p99h / p99a},
                            {"attacker_sessions", sessions.load()},
                            {"quiet_p50_us_dmalog", percentile(logged, 0.5)},
                            {"quiet_p99_us_dmalog", percentile(logged, 0.99)},
                            {"dmalog_p99_ratio", percentile(logged, 0.99) / p99a},
                            {"dmalog_reports", reports.load()},
                            {"runs", kRuns},
                            {"roundtrips_per_run", kTrips}};
  std::printf("%s\n", j.dump(2).c_str());
  return 0;
}
