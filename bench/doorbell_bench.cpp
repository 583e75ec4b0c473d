// scripts/bench vfio-user (its doorbell part) and scripts/bench tenants:
// what a doorbell costs the server on its session thread, and how the
// session threads share a host's tenants. Prints one JSON object; human
// text to stderr.
//
// A doorbell is what QEMU's vfio-user client sends for a guest's queue
// notify: a posted REGION_WRITE (No_reply) of 4 bytes into the notify
// window, which the device turns into one write to the queue worker's
// kick eventfd. The device here is that and nothing else (DoorbellDevice:
// a 4 KiB BAR whose writes kick an eventfd), behind the real Server on a
// real SessionThread, so what is measured is the server's path.
//
//  doorbells (scripts/bench vfio-user):
//   - cpu_per_doorbell_us: the session thread's CPU time (its thread CPU
//     clock) over a storm of posted writes, per write; against
//     echo_cpu_per_doorbell_us: a thread that reads the same bytes from a
//     socketpair with plain recv, one message at a time, and kicks an
//     eventfd per message (the floor: no protocol, no batching).
//   - latency p50/p99: a doorbell sent (the client's clock) to its kick
//     seen by the worker thread (which waits in poll on the eventfd),
//     one at a time, 50 us apart; against the same through the echo;
//     sparse_cpu_per_doorbell_us: the session thread's CPU per doorbell
//     then (each one wakes it from epoll, as QEMU's sparse doorbells do),
//     against the echo thread's (woken from recv).
//  tenants (scripts/bench tenants):
//   - for 1 and 2 session threads, 1, 2, 4 and 8 clients storming
//     doorbells (each sends 256 at a time, as a client whose guest has
//     many queues would): the aggregate doorbells/s the devices saw;
//     scaling = the rate with 2 threads / with 1, at each client count;
//   - a quiet tenant on its own export reading a register (a round trip),
//     alone and beside 8 storming clients, its export on a thread of its
//     own and on the storm's thread: its p99, and the ratio.
#include <linux/vfio.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "sriovd/guest/vfio_user_client.hpp"
#include "sriovd/util/session_threads.hpp"
#include "sriovd/vfio_user/protocol.hpp"
#include "sriovd/vfio_user/server.hpp"
#include "support/bar_device.hpp"

using namespace sriovd;
using namespace sriovd::vfio_user;
using Clock = std::chrono::steady_clock;

namespace {

// A device whose BAR0 writes are doorbells: each one kicks the eventfd
// its worker waits on (what virtio-pci's notify does), and is counted.
class DoorbellDevice : public test::BarDevice {
 public:
  DoorbellDevice() : BarDevice("doorbell"), kick_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    if (!kick_) throw std::runtime_error("eventfd");
  }
  void write(uint32_t, uint64_t, std::span<const uint8_t>) override {
    const uint64_t one = 1;
    (void)!::write(kick_.get(), &one, sizeof one);
    counted_.fetch_add(1, std::memory_order_relaxed);
  }
  [[nodiscard]] uint64_t counted() const { return counted_.load(std::memory_order_relaxed); }
  [[nodiscard]] int kick() const { return kick_.get(); }

 private:
  std::atomic<uint64_t> counted_{0};
  UniqueFd kick_;
};

using Export = test::SessionExport<DoorbellDevice>;
using test::Doorbell;
using test::doorbell;

void send_all(int fd, const void* data, size_t size) {
  if (!test::send_all(fd, data, size)) throw std::runtime_error(std::string("send: ") + std::strerror(errno));
}

double thread_cpu_us(pthread_t t) {
  clockid_t id;
  if (::pthread_getcpuclockid(t, &id) != 0) throw std::runtime_error("pthread_getcpuclockid");
  timespec ts{};
  ::clock_gettime(id, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

// The kicks a worker thread sees (it waits in poll, as a queue worker does).
class Worker {
 public:
  explicit Worker(int kick) : kick_(kick), thread_([this] { run(); }) {}
  ~Worker() {
    stop_ = true;
    thread_.join();
  }
  [[nodiscard]] uint64_t kicks() const { return kicks_.load(std::memory_order_acquire); }
  [[nodiscard]] Clock::time_point last() const { return Clock::time_point(Clock::duration(last_.load())); }
  bool wait_for(uint64_t n, std::chrono::milliseconds limit) const {
    const auto end = Clock::now() + limit;
    while (kicks() < n)
      if (Clock::now() > end) return false;
    return true;
  }

 private:
  void run() {
    while (!stop_) {
      pollfd p{kick_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      uint64_t v = 0;
      if (::read(kick_, &v, sizeof v) != sizeof v) continue;
      last_.store(Clock::now().time_since_epoch().count());
      kicks_.fetch_add(v, std::memory_order_release);
    }
  }
  int kick_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> kicks_{0};
  std::atomic<Clock::rep> last_{0};
  std::thread thread_;
};

// The echo floor: a thread that reads 36-byte messages one at a time and
// kicks an eventfd for each.
class Echo {
 public:
  Echo() : kick_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) throw std::runtime_error("socketpair");
    a_.reset(sv[0]);
    b_.reset(sv[1]);
    thread_ = std::thread([this] { run(); });
  }
  ~Echo() {
    a_.reset();
    thread_.join();
  }
  [[nodiscard]] int client() const { return a_.get(); }
  [[nodiscard]] int kick() const { return kick_.get(); }
  pthread_t native() { return thread_.native_handle(); }

 private:
  void run() {
    Doorbell m;
    for (;;) {
      size_t got = 0;
      while (got < sizeof m) {
        const ssize_t n = ::recv(b_.get(), reinterpret_cast<uint8_t*>(&m) + got, sizeof m - got, 0);
        if (n <= 0) return;
        got += static_cast<size_t>(n);
      }
      const uint64_t one = 1;
      (void)!::write(kick_.get(), &one, sizeof one);
    }
  }
  UniqueFd kick_, a_, b_;
  std::thread thread_;
};

constexpr size_t kBatch = 256;

// A storm of `total` doorbells in batches of kBatch sends.
void storm(int fd, uint64_t total) {
  std::vector<Doorbell> batch(kBatch, doorbell());
  for (uint64_t sent = 0; sent < total;) {
    const uint64_t n = std::min<uint64_t>(kBatch, total - sent);
    send_all(fd, batch.data(), n * sizeof(Doorbell));
    sent += n;
  }
}

// Batches of kBatch doorbells until `stop`, or until the socket is shut
// down under it (the run is over).
void storm_until(int fd, const std::atomic<bool>& stop) {
  std::vector<Doorbell> batch(kBatch, doorbell());
  try {
    while (!stop.load(std::memory_order_relaxed)) send_all(fd, batch.data(), batch.size() * sizeof(Doorbell));
  } catch (const std::exception&) {
  }
}

std::string socket_path(const std::string& what, int i) {
  return "/tmp/sriovd-bench-doorbell-" + std::to_string(::getpid()) + "-" + what + std::to_string(i) + ".sock";
}

nlohmann::json doorbells(int runs, uint64_t per_run) {
  SessionPool pool(1, std::chrono::microseconds(0));
  SessionThread& t = pool.at(0);
  const pthread_t native = t.call([] { return ::pthread_self(); });
  Export ex(t, socket_path("one", 0));
  Worker worker(ex.device.kick());
  guest::VfioUserClient c(socket_path("one", 0));
  Echo echo;
  Worker echo_worker(echo.kick());

  std::vector<double> cpu, echo_cpu, lat, echo_lat, sparse_cpu, echo_sparse_cpu;
  constexpr int kSparse = 2000;
  uint64_t expect = 0, echo_expect = 0;
  for (int run = 0; run < runs; ++run) {
    std::fprintf(stderr, "doorbells: run %d: a storm through the server...\n", run + 1);
    double before = thread_cpu_us(native);
    storm(c.fd(), per_run);
    expect += per_run;
    if (!worker.wait_for(expect, std::chrono::seconds(30))) throw std::runtime_error("the server lost doorbells");
    cpu.push_back((thread_cpu_us(native) - before) / static_cast<double>(per_run));

    std::fprintf(stderr, "doorbells: run %d: the same through the echo...\n", run + 1);
    before = thread_cpu_us(echo.native());
    storm(echo.client(), per_run);
    echo_expect += per_run;
    if (!echo_worker.wait_for(echo_expect, std::chrono::seconds(30)))
      throw std::runtime_error("the echo lost doorbells");
    echo_cpu.push_back((thread_cpu_us(echo.native()) - before) / static_cast<double>(per_run));

    std::fprintf(stderr, "doorbells: run %d: latency, one at a time...\n", run + 1);
    const Doorbell one = doorbell();
    const double server_before = thread_cpu_us(native), echo_before = thread_cpu_us(echo.native());
    for (int i = 0; i < kSparse; ++i) {
      for (auto* w : {&worker, &echo_worker}) {
        const int fd = w == &worker ? c.fd() : echo.client();
        uint64_t& n = w == &worker ? expect : echo_expect;
        const auto gap = Clock::now() + std::chrono::microseconds(50);
        while (Clock::now() < gap) {
        }
        const auto t0 = Clock::now();
        send_all(fd, &one, sizeof one);
        ++n;
        if (!w->wait_for(n, std::chrono::seconds(5))) throw std::runtime_error("a doorbell was lost");
        (w == &worker ? lat : echo_lat).push_back(std::chrono::duration<double, std::micro>(w->last() - t0).count());
      }
    }
    sparse_cpu.push_back((thread_cpu_us(native) - server_before) / kSparse);
    echo_sparse_cpu.push_back((thread_cpu_us(echo.native()) - echo_before) / kSparse);
  }
  const auto med = [](std::vector<double> v) { return percentile(std::move(v), 0.5); };
  const double c50 = med(cpu), e50 = med(echo_cpu);
  const double p50 = percentile(lat, 0.5), p99 = percentile(lat, 0.99);
  const double ep50 = percentile(echo_lat, 0.5), ep99 = percentile(echo_lat, 0.99);
  const double s50 = med(sparse_cpu), es50 = med(echo_sparse_cpu);
  return {{"sparse_cpu_per_doorbell_us", s50},
          {"echo_sparse_cpu_per_doorbell_us", es50},
          {"sparse_cpu_ratio", s50 / es50},
          {"cpu_per_doorbell_us", c50},
          {"echo_cpu_per_doorbell_us", e50},
          {"cpu_ratio", c50 / e50},
          {"latency_p50_us", p50},
          {"latency_p99_us", p99},
          {"echo_latency_p50_us", ep50},
          {"echo_latency_p99_us", ep99},
          {"latency_p99_ratio", p99 / ep99},
          {"goal_cpu_per_doorbell_us", 3.0},
          {"runs", runs},
          {"doorbells_per_run", per_run}};
}

// Round trips of a quiet tenant (a 4-byte register read) for `seconds`,
// 200 us apart (asleep, leaving the CPU to the others).
std::vector<double> quiet_trips(guest::VfioUserClient& c, double seconds) {
  std::vector<double> us;
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < end) {
    const auto t0 = Clock::now();
    (void)c.read32(0, 0);
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return us;
}

// Storming clients on their own exports of `pool` (each doorbell kicks an
// eventfd that no worker waits on: the server's work, not a worker's
// wakeup), each sending from a
// thread at the lowest priority (nice 19): on a machine with as few cores
// as session threads, the clients get what the server leaves, so what is
// measured is the server's rate, not the scheduler's split.
class Storm {
 public:
  // On the pool's threads as the daemon balances them, or all on `only`.
  Storm(SessionPool& pool, unsigned clients, const std::string& what, SessionThread* only = nullptr) {
    for (unsigned i = 0; i < clients; ++i) {
      leases_.push_back(only ? SessionPool::Lease(*only) : pool.lease());
      const std::string path = socket_path(what, static_cast<int>(i));
      exports_.push_back(std::make_unique<Export>(*leases_.back(), path));
      conns_.push_back(std::make_unique<guest::VfioUserClient>(path));
    }
  }
  ~Storm() { stop(); }
  void start() {
    for (auto& c : conns_)
      senders_.emplace_back([this, fd = c->fd()] {
        (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
        storm_until(fd, stop_);
      });
  }
  void stop() {
    stop_ = true;
    for (auto& c : conns_) ::shutdown(c->fd(), SHUT_RDWR);
    for (auto& t : senders_) t.join();
    senders_.clear();
  }
  [[nodiscard]] uint64_t counted() const {
    uint64_t n = 0;
    for (const auto& e : exports_) n += e->device.counted();
    return n;
  }

 private:
  std::vector<SessionPool::Lease> leases_;
  std::vector<std::unique_ptr<Export>> exports_;
  std::vector<std::unique_ptr<guest::VfioUserClient>> conns_;
  std::atomic<bool> stop_{false};
  std::vector<std::thread> senders_;
};

nlohmann::json tenants(double seconds) {
  nlohmann::json out = nlohmann::json::object();
  nlohmann::json rates = nlohmann::json::object();
  for (unsigned threads : {1U, 2U}) {
    for (unsigned clients : {1U, 2U, 4U, 8U}) {
      std::fprintf(stderr, "tenants: %u session thread(s), %u storming client(s)...\n", threads, clients);
      SessionPool pool(threads, std::chrono::microseconds(0));
      Storm storm(pool, clients, "t");
      storm.start();
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds) / 4);  // the sockets filled
      const uint64_t before = storm.counted();
      const auto t0 = Clock::now();
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
      const double rate =
          static_cast<double>(storm.counted() - before) / std::chrono::duration<double>(Clock::now() - t0).count();
      storm.stop();
      rates[std::to_string(threads) + "_threads"][std::to_string(clients) + "_clients"] = rate;
    }
  }
  for (unsigned clients : {1U, 2U, 4U, 8U}) {
    const std::string k = std::to_string(clients) + "_clients";
    out["scaling_2_over_1"][k] = rates["2_threads"][k].get<double>() / rates["1_threads"][k].get<double>();
  }
  out["doorbells_per_sec"] = rates;

  // The quiet tenant, alone and beside 8 storming clients: on a thread of
  // its own (the storm on the other: what the threads isolate), and on the
  // storm's thread (what the turns bound: 8 turns of at most 20 us).
  for (const bool shared : {false, true}) {
    std::fprintf(stderr, "tenants: a quiet tenant alone, then beside 8 storming clients on %s...\n",
                 shared ? "its thread" : "another thread");
    SessionPool pool(2, std::chrono::microseconds(0));
    const std::string tag = shared ? "qs" : "qo";
    SessionPool::Lease quiet_lease(pool.at(0));
    Export quiet(*quiet_lease, socket_path(tag, 0));
    guest::VfioUserClient qc(socket_path(tag, 0));
    Storm storm(pool, 8, tag + "s", &pool.at(shared ? 0 : 1));
    const std::vector<double> alone = quiet_trips(qc, seconds);
    storm.start();
    const std::vector<double> beside = quiet_trips(qc, seconds);
    storm.stop();
    const double a99 = percentile(alone, 0.99), b99 = percentile(beside, 0.99);
    out[shared ? "quiet_on_the_storms_thread" : "quiet_on_its_own_thread"] = {
        {"alone_p50_us", percentile(alone, 0.5)},
        {"alone_p99_us", a99},
        {"beside_storm_p50_us", percentile(beside, 0.5)},
        {"beside_storm_p99_us", b99},
        {"p99_ratio", b99 / a99},
        {"trips_alone", alone.size()},
        {"trips_beside", beside.size()}};
  }
  out["cpus"] = SessionPool::usable_cpus();
  out["seconds"] = seconds;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  spdlog::set_default_logger(spdlog::stderr_color_mt("bench"));
  spdlog::set_level(spdlog::level::err);
  const std::string what = argc > 1 ? argv[1] : "doorbells";
  const double seconds = argc > 2 ? std::stod(argv[2]) : 2.0;
  try {
    nlohmann::json j;
    if (what == "doorbells") {
      j = doorbells(5, 200000);
      j["bench"] = "doorbells";
    } else if (what == "tenants") {
      j = tenants(seconds);
      j["bench"] = "tenants";
    } else {
      std::fprintf(stderr, "usage: sriovd-bench-doorbell doorbells | tenants [SECONDS]\n");
      return 64;
    }
    std::printf("%s\n", j.dump(2).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "doorbell bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
