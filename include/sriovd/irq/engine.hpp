#pragma once
// The interrupt routing engine: every guest-visible vector is one route,
// source -> state -> sink. Sources are a device's interrupt eventfd (a VFIO
// vector) or a device model calling trigger(); the sink is the eventfd the
// VMM gave (vfio-user SET_IRQS, vhost-user call fd).
//
// Data plane: relay threads wait in epoll on the routes' relay eventfds. A
// fire on an unmasked route is one atomic load and one eventfd write to the
// sink, bracketed by a per-route count of deliveries under way (the grace
// period that lets set_sink/remove close a replaced sink whatever thread
// delivers: relay, a device's worker, the control thread replaying at
// unmask); a fire on a masked route latches the pending bit, and unmask
// replays it. Nothing on that path allocates, locks or logs. Sinks are
// made non-blocking where a peer's fd enters, but the peer shares that
// flag: writes to them go through the peer I/O watchdog
// (util/eventfd.hpp), and only data-plane threads write them - trigger()
// and a replaying unmask() on any other thread (the control thread) post
// the delivery to the route's relay thread.
//
// Modes: in relay mode the device signals the route's relay eventfd; in
// direct mode the device signals the sink itself (VFIO SET_IRQS with the
// VMM's fd), so the kernel wakes the VMM with no hop through sriovd. A mask
// in direct mode has to move the source back to the relay (an ioctl): the
// policy decides when that cost is worth paying.

#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "sriovd/irq/source_binder.hpp"
#include "sriovd/util/counters.hpp"
#include "sriovd/util/fd.hpp"

namespace sriovd::irq {

using RouteId = uint32_t;

enum class Mode : uint8_t { relay, direct };

// direct: bind to the sink whenever unmasked; every mask/unmask retargets
//         the source (one SET_IRQS each), as QEMU did before lazy release.
// relay:  always through the relay; mask/unmask are flag flips.
// adaptive: direct until the vector is masked; then relay (flag flips) for
//         as long as masks keep coming; back to direct after a quiet period.
enum class Policy : uint8_t { direct, relay, adaptive };

const char* to_string(Mode);
const char* to_string(Policy);

struct RouteSpec {
  std::string device;  // for listings: "0000:3b:02.0" or a virtio device name
  unsigned vector = 0;
  Policy policy = Policy::relay;
  SourceBinder* binder = nullptr;  // null: the source is trigger() (a device model)
};

struct RouteStats {
  uint64_t fired = 0;           // interrupts seen by the relay or trigger()
  uint64_t delivered = 0;       // signals written to the sink
  uint64_t masked_pending = 0;  // fires that found the vector masked
  uint64_t replayed = 0;        // pending interrupts delivered at unmask
  uint64_t dropped = 0;         // fires with no sink, or a failed sink write
  uint64_t masks = 0;
  uint64_t unmasks = 0;
  uint64_t mode_switches = 0;  // source retargeted between relay and sink
};

inline constexpr Counter<RouteStats> kRouteCounters[] = {
    {"fired", "interrupts the source raised (relay or trigger)", &RouteStats::fired},
    {"delivered", "interrupts delivered to the sink (the VMM)", &RouteStats::delivered},
    {"masked_pending", "interrupts held while the vector was masked", &RouteStats::masked_pending},
    {"replayed", "held interrupts delivered at unmask", &RouteStats::replayed},
    {"dropped", "interrupts with no sink, or a failed sink write", &RouteStats::dropped},
    {"masks", "vector masks", &RouteStats::masks},
    {"unmasks", "vector unmasks", &RouteStats::unmasks},
    {"mode_switches", "switches between direct and relay (adaptive policy)", &RouteStats::mode_switches},
};

struct RouteInfo {
  RouteId id = 0;
  std::string device;
  unsigned vector = 0;
  Policy policy = Policy::relay;
  Mode mode = Mode::relay;
  bool masked = true;
  bool pending = false;
  bool has_sink = false;
  bool sink_blocked = false;  // the VMM made its eventfd blocking: written no more
  RouteStats stats;
};

struct EngineOptions {
  unsigned relay_threads = 1;
  std::vector<int> cpus;   // relay thread i runs on cpus[i % n]; empty: no pinning
  bool busy_poll = false;  // spin in epoll_wait(0) instead of sleeping
  // adaptive: a route in relay that has seen no mask/unmask for this long
  // goes back to direct at the next housekeeping().
  std::chrono::nanoseconds adaptive_quiet{std::chrono::milliseconds(200)};
  unsigned max_routes = 1U << 16U;
};

class Engine {
 public:
  explicit Engine(EngineOptions options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // --- control plane ---
  // A new route starts masked with no sink (an MSI-X vector after reset).
  RouteId add(const RouteSpec& spec);
  void remove(RouteId id);
  // Takes ownership of the VMM's eventfd (invalid: no sink). In direct or
  // adaptive policy an unmasked route is bound to it at once.
  void set_sink(RouteId id, UniqueFd sink);
  // The eventfd the device signals in relay mode (owned by the engine).
  [[nodiscard]] int relay_fd(RouteId id) const;
  // adaptive: routes quiet for adaptive_quiet go back to direct. Also closes
  // replaced sinks that a busy route could not close at once.
  void housekeeping(std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now());

  // --- data plane (any thread, lock-free unless a mode switch is due) ---
  void mask(RouteId id);
  void unmask(RouteId id);
  void trigger(RouteId id);
  [[nodiscard]] bool pending(RouteId id) const;
  [[nodiscard]] bool masked(RouteId id) const;
  // Function reset: drops the pending bit.
  void clear_pending(RouteId id);
  // A restored state's pending bit, set at once (trigger() may go through a
  // relay thread): latched on a masked route, delivered on an unmasked one.
  void set_pending(RouteId id);

  // --- observation ---
  [[nodiscard]] Mode mode(RouteId id) const;
  [[nodiscard]] RouteStats stats(RouteId id) const;
  [[nodiscard]] std::vector<RouteInfo> list() const;
  [[nodiscard]] size_t size() const;
  [[nodiscard]] const EngineOptions& options() const { return options_; }

 private:
  struct Route;
  struct RelayThread;

  Route& at(RouteId id) const;
  void fire(Route& r, uint64_t count);
  void deliver(Route& r);
  void latch(Route& r);
  void replay(Route& r);
  void post(Route& r, uint32_t what);
  void retire_sinks(Route& r);
  void switch_mode(Route& r, Mode to);
  void quiesce();
  void relay_loop(RelayThread& t);

  static constexpr unsigned kChunkBits = 8;
  static constexpr unsigned kChunk = 1U << kChunkBits;

  EngineOptions options_;
  // Routes live in fixed chunks that never move: a RouteId is an index, and
  // relay threads hold Route pointers in epoll without any lock.
  std::unique_ptr<std::atomic<Route*>[]> chunks_;
  mutable std::mutex control_mutex_;  // add/remove/set_sink: control plane only
  std::vector<RouteId> free_ids_;
  RouteId next_id_ = 0;
  size_t live_ = 0;
  std::vector<std::unique_ptr<RelayThread>> threads_;
  unsigned next_thread_ = 0;
};

}  // namespace sriovd::irq
