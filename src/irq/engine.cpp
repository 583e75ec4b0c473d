#include "sriovd/irq/engine.hpp"

#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <stdexcept>

#include "sriovd/util/error.hpp"
#include "sriovd/util/eventfd.hpp"

namespace sriovd::irq {

namespace {

constexpr uint32_t kMasked = 1U << 0U;
constexpr uint32_t kPending = 1U << 1U;
constexpr uint32_t kLive = 1U << 2U;
// The VMM made its sink blocking (a write was interrupted by the peer I/O
// watchdog): nothing more is written to that sink; a new one clears it.
constexpr uint32_t kSinkBlocked = 1U << 3U;
constexpr uint32_t kSinkBlockedSaid = 1U << 4U;  // and housekeeping has logged it

// What another thread asked the relay thread to do with a route (Route::posts).
constexpr uint32_t kPostFire = 1U << 0U;    // trigger() off the data plane
constexpr uint32_t kPostReplay = 1U << 1U;  // unmask() found it pending

int64_t now_ns(std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now()) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

UniqueFd make_eventfd() {
  UniqueFd fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!fd) throw_errno("eventfd");
  return fd;
}

}  // namespace

const char* to_string(Mode m) { return m == Mode::direct ? "direct" : "relay"; }
const char* to_string(Policy p) {
  switch (p) {
    case Policy::direct: return "direct";
    case Policy::relay: return "relay";
    case Policy::adaptive: return "adaptive";
  }
  return "?";
}

struct Engine::Route {
  // Touched per interrupt: kept together, away from the cold fields.
  alignas(64) std::atomic<uint32_t> flags{0};
  std::atomic<int> sink{-1};
  // Deliveries under way (any thread): a replaced sink is closed only once
  // none of them can still hold its number.
  std::atomic<uint32_t> delivering{0};
  std::atomic<uint32_t> posts{0};  // kPost*: set, then the relay eventfd written
  std::atomic<Mode> mode{Mode::relay};
  std::atomic<uint64_t> fired{0}, delivered{0}, masked_pending{0}, replayed{0}, dropped{0};
  std::atomic<uint64_t> masks{0}, unmasks{0}, mode_switches{0};
  std::atomic<int64_t> last_mask_ns{0};

  alignas(64) UniqueFd relay;
  UniqueFd sink_owner;
  std::vector<UniqueFd> retired_sinks;  // closed once no delivery holds them
  std::mutex switch_mutex;              // mode switches only
  RouteSpec spec;
  RelayThread* thread = nullptr;
  RouteId id = 0;
};

struct Engine::RelayThread {
  UniqueFd epoll;
  UniqueFd wake;
  // Batches finished: bumped after a batch's events (the wake fd's drain
  // among them) are handled, so a bump seen after a wake was written proves
  // the thread has since been back in epoll_wait.
  std::atomic<uint64_t> generation{0};
  std::atomic<bool> stop{false};
  std::thread thread;
};

// Delivery that lands on a relay thread: how a thread that must not write
// a peer's eventfd (the control thread) triggers or replays a route. The
// relay eventfd is the engine's own, never full: the write cannot block.
void Engine::post(Route& r, uint32_t what) {
  r.posts.fetch_or(what, std::memory_order_release);
  own_eventfd_signal(r.relay.get());
}

Engine::Engine(EngineOptions options) : options_(std::move(options)) {
  const unsigned chunks = (options_.max_routes + kChunk - 1) / kChunk;
  chunks_ = std::make_unique<std::atomic<Route*>[]>(chunks);
  for (unsigned i = 0; i < chunks; ++i) chunks_[i].store(nullptr);
  for (unsigned i = 0; i < options_.relay_threads; ++i) {
    auto t = std::make_unique<RelayThread>();
    t->epoll.reset(::epoll_create1(EPOLL_CLOEXEC));
    if (!t->epoll) throw_errno("epoll_create1 for relay thread");
    t->wake = make_eventfd();
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = nullptr;  // the wake fd
    if (::epoll_ctl(t->epoll.get(), EPOLL_CTL_ADD, t->wake.get(), &ev) != 0) throw_errno("epoll_ctl wake fd");
    RelayThread* raw = t.get();
    t->thread = std::thread([this, raw] { relay_loop(*raw); });
    if (!options_.cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(options_.cpus[i % options_.cpus.size()], &set);
      if (int rc = pthread_setaffinity_np(t->thread.native_handle(), sizeof set, &set); rc != 0)
        throw SystemError(rc, "pinning relay thread " + std::to_string(i) + " to CPU " +
                                  std::to_string(options_.cpus[i % options_.cpus.size()]));
    }
    pthread_setname_np(t->thread.native_handle(), ("sriovd-relay" + std::to_string(i)).c_str());
    threads_.push_back(std::move(t));
  }
}

Engine::~Engine() {
  for (auto& t : threads_) {
    t->stop.store(true);
    own_eventfd_signal(t->wake.get());
  }
  for (auto& t : threads_) t->thread.join();
  const unsigned chunks = (options_.max_routes + kChunk - 1) / kChunk;
  for (unsigned i = 0; i < chunks; ++i) delete[] chunks_[i].load();
}

Engine::Route& Engine::at(RouteId id) const {
  Route* chunk = id < options_.max_routes ? chunks_[id >> kChunkBits].load(std::memory_order_acquire) : nullptr;
  if (!chunk) throw std::out_of_range("no interrupt route " + std::to_string(id));
  return chunk[id & (kChunk - 1)];
}

void Engine::relay_loop(RelayThread& t) {
  enroll_peer_io_thread();
  epoll_event events[64];
  const int timeout = options_.busy_poll ? 0 : -1;
  while (!t.stop.load(std::memory_order_relaxed)) {
    const int n = ::epoll_wait(t.epoll.get(), events, 64, timeout);
    for (int i = 0; i < n; ++i) {
      auto* r = static_cast<Route*>(events[i].data.ptr);
      if (!r) {
        own_eventfd_drain(t.wake.get());
        continue;
      }
      // Edge-triggered: every eventfd signal queues the route again, so the
      // counter need not be read back; that saves a syscall per interrupt
      // (one write to the sink is all the relay pays). A post that shared
      // the signal with the device's own merges with it, as two MSI-X
      // messages pending at once do.
      const uint32_t posts =
          r->posts.load(std::memory_order_acquire) ? r->posts.exchange(0, std::memory_order_acq_rel) : 0;
      if (posts & kPostReplay) replay(*r);
      if (!posts || (posts & kPostFire)) fire(*r, 1);
    }
    // Drain first, publish after: a wake written before the drain is
    // answered by this bump, one written after it by the next epoll_wait.
    // (Publishing before the drain lost a wake that landed in between.)
    t.generation.fetch_add(1, std::memory_order_release);
  }
}

// Lock-free: a masked fire latches the pending bit (latch()).
void Engine::fire(Route& r, uint64_t count) {
  r.fired.fetch_add(count, std::memory_order_relaxed);
  if (!(r.flags.load(std::memory_order_acquire) & kMasked)) {
    deliver(r);
    return;
  }
  r.masked_pending.fetch_add(1, std::memory_order_relaxed);
  latch(r);
}

// A masked vector's interrupt: the pending bit. If an unmask raced in
// between the caller's load and the latch, its replay may have missed the
// bit, so the latch claims it back and delivers.
void Engine::latch(Route& r) {
  r.flags.fetch_or(kPending, std::memory_order_acq_rel);
  if (!(r.flags.load(std::memory_order_acquire) & kMasked) &&
      (r.flags.fetch_and(~kPending, std::memory_order_acq_rel) & kPending))
    deliver(r);
}

// A pending interrupt the control thread's unmask found: delivered if the
// vector is still unmasked, pending again if it was masked meanwhile.
void Engine::replay(Route& r) {
  if (!(r.flags.load(std::memory_order_acquire) & kMasked)) {
    deliver(r);
    return;
  }
  latch(r);
}

void Engine::deliver(Route& r) {
  // seq_cst pairs with retire_sinks(): either it sees this delivery under
  // way, or this delivery sees the sink that replaced the old one.
  r.delivering.fetch_add(1, std::memory_order_seq_cst);
  const int fd = r.sink.load(std::memory_order_seq_cst);
  // Sinks were made non-blocking where they entered, but the VMM shares the
  // flag and may clear it: a counter it lets run full then costs it its own
  // interrupts (EAGAIN), and one it also made blocking is cut by the peer
  // I/O watchdog (EINTR) and written no more.
  const bool ok = fd >= 0 && !(r.flags.load(std::memory_order_relaxed) & kSinkBlocked) && peer_eventfd_write(fd);
  // (Only while that fd is still the sink: one replaced meanwhile is not
  // the new sink's fault.)
  if (!ok && fd >= 0 && errno == EINTR && r.sink.load(std::memory_order_relaxed) == fd)
    r.flags.fetch_or(kSinkBlocked, std::memory_order_relaxed);
  r.delivering.fetch_sub(1, std::memory_order_release);
  (ok ? r.delivered : r.dropped).fetch_add(1, std::memory_order_relaxed);
}

// After the sink was replaced: closes the old ones once no delivery can
// still be writing to them. A delivery is one non-blocking write, so a
// moment with none under way comes soon; when it does not come within a
// short spin (busy vectors delivering from several threads at once), the
// sinks wait for the next call or housekeeping(). Only a long list waits
// longer, and that too is bounded.
void Engine::retire_sinks(Route& r) {
  if (r.retired_sinks.empty()) return;
  const bool crowded = r.retired_sinks.size() >= 16;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(crowded ? 10 : 0);
  for (unsigned spin = 0;; ++spin) {
    if (r.delivering.load(std::memory_order_seq_cst) == 0) {
      r.retired_sinks.clear();
      return;
    }
    if (spin >= 1024) {
      if (std::chrono::steady_clock::now() >= deadline) return;
      std::this_thread::yield();
    }
  }
}

void Engine::switch_mode(Route& r, Mode to) {
  if (r.mode.load() == to || !r.spec.binder) return;
  const int fd = to == Mode::direct ? r.sink.load() : r.relay.get();
  if (to == Mode::direct && fd < 0) return;
  r.spec.binder->bind(r.spec.vector, fd);
  r.mode.store(to, std::memory_order_release);
  r.mode_switches.fetch_add(1, std::memory_order_relaxed);
}

RouteId Engine::add(const RouteSpec& spec) {
  std::lock_guard lock(control_mutex_);
  RouteId id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
  } else {
    if (next_id_ >= options_.max_routes)
      throw std::runtime_error("interrupt routes exhausted (" + std::to_string(options_.max_routes) + ")");
    id = next_id_++;
    if (!chunks_[id >> kChunkBits].load())
      chunks_[id >> kChunkBits].store(new Route[kChunk], std::memory_order_release);
  }
  Route& r = at(id);
  r.id = id;
  r.spec = spec;
  if (!r.spec.binder) r.spec.policy = Policy::relay;  // a device model has no source to bind
  r.relay = make_eventfd();
  r.flags.store(kMasked | kLive);
  r.posts.store(0);
  r.sink.store(-1);
  r.mode.store(Mode::relay);
  for (auto* c :
       {&r.fired, &r.delivered, &r.masked_pending, &r.replayed, &r.dropped, &r.masks, &r.unmasks, &r.mode_switches})
    c->store(0);
  r.last_mask_ns.store(0);
  if (!threads_.empty()) {
    r.thread = threads_[next_thread_++ % threads_.size()].get();
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLET;
    ev.data.ptr = &r;
    if (::epoll_ctl(r.thread->epoll.get(), EPOLL_CTL_ADD, r.relay.get(), &ev) != 0)
      throw_errno("epoll_ctl add route " + std::to_string(id));
  }
  if (r.spec.binder) r.spec.binder->bind(r.spec.vector, r.relay.get());
  ++live_;
  return id;
}

// Waits until every relay thread has come back to epoll_wait once, so no
// thread still holds a route pointer from before. The wake is written again
// now and then: the relay threads never block on a peer, so a thread that
// does not answer has lost a wake, and another one costs nothing.
void Engine::quiesce() {
  for (auto& t : threads_) {
    const uint64_t seen = t->generation.load(std::memory_order_acquire);
    auto rewake = std::chrono::steady_clock::now();
    while (t->generation.load(std::memory_order_acquire) == seen) {
      if (const auto now = std::chrono::steady_clock::now(); now >= rewake) {
        own_eventfd_signal(t->wake.get());
        rewake = now + std::chrono::milliseconds(10);
      }
      std::this_thread::yield();
    }
  }
}

void Engine::remove(RouteId id) {
  std::lock_guard lock(control_mutex_);
  Route& r = at(id);
  if (!(r.flags.load() & kLive)) throw std::out_of_range("interrupt route " + std::to_string(id) + " is not in use");
  r.flags.store(kMasked);
  if (r.thread) ::epoll_ctl(r.thread->epoll.get(), EPOLL_CTL_DEL, r.relay.get(), nullptr);
  quiesce();
  r.sink.store(-1, std::memory_order_seq_cst);
  if (r.sink_owner) r.retired_sinks.push_back(std::move(r.sink_owner));
  retire_sinks(r);
  r.relay.reset();
  r.spec = {};
  free_ids_.push_back(id);
  --live_;
}

void Engine::set_sink(RouteId id, UniqueFd sink) {
  std::lock_guard lock(control_mutex_);
  Route& r = at(id);
  std::lock_guard switching(r.switch_mutex);
  if (r.sink_owner) r.retired_sinks.push_back(std::move(r.sink_owner));
  r.sink_owner = std::move(sink);
  r.sink.store(r.sink_owner.valid() ? r.sink_owner.get() : -1, std::memory_order_seq_cst);
  r.flags.fetch_and(~(kSinkBlocked | kSinkBlockedSaid), std::memory_order_relaxed);
  if (r.mode.load() == Mode::direct) {
    // Rebind the device to the new sink (or back to the relay if none).
    r.mode.store(Mode::relay);
    if (r.sink_owner.valid()) {
      switch_mode(r, Mode::direct);
    } else if (r.spec.binder) {
      r.spec.binder->bind(r.spec.vector, r.relay.get());
      r.mode_switches.fetch_add(1, std::memory_order_relaxed);
    }
  } else if (r.spec.policy != Policy::relay && !(r.flags.load() & kMasked) && r.sink_owner.valid()) {
    switch_mode(r, Mode::direct);
  }
  retire_sinks(r);
}

int Engine::relay_fd(RouteId id) const { return at(id).relay.get(); }

// Only real transitions count as mask traffic: re-masking a masked vector
// (a function mask over vector masks, a reset) is no guest activity.
void Engine::mask(RouteId id) {
  Route& r = at(id);
  if (r.flags.fetch_or(kMasked, std::memory_order_acq_rel) & kMasked) return;
  r.masks.fetch_add(1, std::memory_order_relaxed);
  r.last_mask_ns.store(now_ns(), std::memory_order_relaxed);
  if (r.mode.load(std::memory_order_acquire) == Mode::direct) {
    // The kernel would keep signalling the VMM: the source must come back to
    // the relay, where the pending bit can be latched.
    std::lock_guard switching(r.switch_mutex);
    switch_mode(r, Mode::relay);
  }
}

void Engine::unmask(RouteId id) {
  Route& r = at(id);
  if (!(r.flags.fetch_and(~kMasked, std::memory_order_acq_rel) & kMasked)) return;
  r.unmasks.fetch_add(1, std::memory_order_relaxed);
  const int64_t now = now_ns();
  const int64_t previous = r.last_mask_ns.exchange(now, std::memory_order_relaxed);
  if (r.flags.fetch_and(~kPending, std::memory_order_acq_rel) & kPending) {
    r.replayed.fetch_add(1, std::memory_order_relaxed);
    // The control thread unmasks (a vfio-user table write) and must not
    // write the VMM's eventfd: the relay thread delivers it. There the
    // fire finds the vector unmasked - or masked again, and pending again.
    if (peer_io_thread() || threads_.empty()) {
      deliver(r);
    } else {
      post(r, kPostReplay);
    }
  }
  // direct: always back to the sink. adaptive: only if this vector had been
  // quiet (no mask traffic for adaptive_quiet) - a vector masked on every
  // interrupt stays in relay, where masks are flag flips.
  const bool go_direct = r.spec.policy == Policy::direct ||
                         (r.spec.policy == Policy::adaptive && now - previous >= options_.adaptive_quiet.count());
  if (go_direct && r.mode.load(std::memory_order_acquire) == Mode::relay) {
    std::lock_guard switching(r.switch_mutex);
    if (!(r.flags.load() & kMasked)) switch_mode(r, Mode::direct);
  }
}

void Engine::trigger(RouteId id) {
  Route& r = at(id);
  if (peer_io_thread() || threads_.empty()) {
    fire(r, 1);
  } else {
    post(r, kPostFire);
  }
}

bool Engine::pending(RouteId id) const { return at(id).flags.load(std::memory_order_acquire) & kPending; }
bool Engine::masked(RouteId id) const { return at(id).flags.load(std::memory_order_acquire) & kMasked; }
void Engine::clear_pending(RouteId id) { at(id).flags.fetch_and(~kPending, std::memory_order_acq_rel); }
void Engine::set_pending(RouteId id) { latch(at(id)); }
Mode Engine::mode(RouteId id) const { return at(id).mode.load(std::memory_order_acquire); }

void Engine::housekeeping(std::chrono::steady_clock::time_point now) {
  std::lock_guard lock(control_mutex_);
  const int64_t cutoff = now_ns(now) - options_.adaptive_quiet.count();
  for (RouteId id = 0; id < next_id_; ++id) {
    Route& r = at(id);
    if (!r.retired_sinks.empty()) {
      std::lock_guard switching(r.switch_mutex);
      retire_sinks(r);
    }
    if ((r.flags.load(std::memory_order_relaxed) & (kLive | kSinkBlocked | kSinkBlockedSaid)) ==
            (kLive | kSinkBlocked) &&
        !(r.flags.fetch_or(kSinkBlockedSaid, std::memory_order_relaxed) & kSinkBlockedSaid))
      spdlog::warn(
          "{} vector {}: the VMM made its interrupt eventfd blocking (a write to it waited and was cut "
          "short); no interrupt is written to it until it gives another",
          r.spec.device, r.spec.vector);
    const uint32_t f = r.flags.load(std::memory_order_acquire);
    if (!(f & kLive) || (f & kMasked) || r.spec.policy != Policy::adaptive || r.mode.load() != Mode::relay ||
        r.sink.load() < 0 || r.last_mask_ns.load(std::memory_order_relaxed) > cutoff)
      continue;
    std::lock_guard switching(r.switch_mutex);
    if (!(r.flags.load() & kMasked)) switch_mode(r, Mode::direct);
  }
}

RouteStats Engine::stats(RouteId id) const {
  const Route& r = at(id);
  return {r.fired.load(),   r.delivered.load(), r.masked_pending.load(), r.replayed.load(),
          r.dropped.load(), r.masks.load(),     r.unmasks.load(),        r.mode_switches.load()};
}

std::vector<RouteInfo> Engine::list() const {
  std::lock_guard lock(control_mutex_);
  std::vector<RouteInfo> out;
  for (RouteId id = 0; id < next_id_; ++id) {
    const Route& r = at(id);
    const uint32_t f = r.flags.load();
    if (!(f & kLive)) continue;
    out.push_back({id, r.spec.device, r.spec.vector, r.spec.policy, r.mode.load(), (f & kMasked) != 0,
                   (f & kPending) != 0, r.sink.load() >= 0, (f & kSinkBlocked) != 0, stats(id)});
  }
  return out;
}

size_t Engine::size() const {
  std::lock_guard lock(control_mutex_);
  return live_;
}

}  // namespace sriovd::irq
