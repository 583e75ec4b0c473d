#pragma once
// The control thread's event loop, with adaptive polling (control.poll_us).
//
// A VMM's vfio-user message into a thread asleep in epoll pays for that
// thread's wakeup: the sender's send() sends the reschedule IPI, which in a
// VM is an exit (a posted MSI-X mask write measured here: 9-10 us into a
// sleeping server, 1.1-1.3 us into one that is awake, scripts/bench
// vfio-user; 11-13 against ~5 us under mask-iperf's load). A guest that masks and
// unmasks its vector on every interrupt sends two such writes per
// interrupt, the second a few tens of microseconds after the first. So
// after work the loop keeps polling its io_context for up to a window
// before it sleeps: a message inside the window wakes nobody.
//
// Polling burns the CPU it waits on, so it is earned: work found while
// polling, or coming within the window after the loop went to sleep,
// counts for polling, a longer gap against, and the loop polls while an
// eighth or more of the recent gaps fit (an exponential average over ~8
// gaps). The guest above fits about half: mask, then unmask soon after,
// then a long wait for the next interrupt. A peer that sends once a
// millisecond, or a daemon with nothing to do, turns it off within a gap
// or two; when it is off, the gaps are still measured across the sleep,
// so close messages turn it on again. Between looks the thread yields, so
// a data-plane thread runnable on the same CPU goes first (and a thread
// that is runnable, not asleep, costs a sender no wakeup either).
//
// Cost bound: at most one window of polling per piece of work (the yields
// between looks may stretch it in wall time, not in CPU), and it stops
// within a gap or two once fewer than about one gap in ten fits. A peer can
// make the thread poll by sending often; it could make it work by sending
// often anyway.

#include <atomic>
#include <chrono>
#include <cstdint>

#include "sriovd/util/asio.hpp"

namespace sriovd {

struct PollStats {
  uint64_t polls = 0;      // windows polled
  uint64_t hits = 0;       // windows in which work came
  uint64_t polled_ns = 0;  // wall time spent polling (yields to other threads included)
};

// Whether to poll, and how long: the policy apart from the clock.
class PollWindow {
 public:
  using ns = std::chrono::nanoseconds;
  explicit PollWindow(ns max_window = ns{0}) : max_(max_window) {}

  // A reload's window; 0 turns polling off.
  void set_max(ns max_window);
  [[nodiscard]] ns max() const { return max_; }
  // How long to poll before sleeping now: max() while polling pays, else 0.
  [[nodiscard]] ns window() const { return polling() ? max_ : ns{0}; }
  [[nodiscard]] bool polling() const { return max_.count() > 0 && score_ >= kOn; }
  // Work came `gap` after the loop last ran out of it (polling or not).
  void work_after(ns gap);
  [[nodiscard]] uint32_t score() const { return score_; }

  static constexpr uint32_t kFull = 1024;
  static constexpr uint32_t kOn = kFull / 8;  // one fitting gap from cold turns it on

 private:
  ns max_;
  uint32_t score_ = 0;  // kFull * the recent fraction of gaps within max_
};

// Runs `io` on the calling thread until it is stopped or out of work, like
// io_context::run(), polling as `window` says.
class PollingLoop {
 public:
  PollingLoop(asio::io_context& io, PollWindow::ns max_window) : io_(io), window_(max_window) {}
  void run();

  // Control thread only (a reload, the status views).
  void set_max_window(PollWindow::ns w) { window_.set_max(w); }
  [[nodiscard]] const PollWindow& window() const { return window_; }
  [[nodiscard]] const PollStats& stats() const { return stats_; }
  // The same counts, readable from any thread (a session thread's loop,
  // read by the control thread's status).
  [[nodiscard]] PollStats shared_stats() const {
    return {shared_polls_.load(std::memory_order_relaxed), shared_hits_.load(std::memory_order_relaxed),
            shared_polled_ns_.load(std::memory_order_relaxed)};
  }

 private:
  bool poll_for(std::chrono::steady_clock::time_point until, std::chrono::steady_clock::time_point& found);
  void account(std::chrono::steady_clock::time_point from, std::chrono::steady_clock::time_point to, bool hit);

  asio::io_context& io_;
  PollWindow window_;
  PollStats stats_;
  // Copies of stats_ for other threads, stored once per polling window.
  std::atomic<uint64_t> shared_polls_{0}, shared_hits_{0}, shared_polled_ns_{0};
};

}  // namespace sriovd
