#include "sriovd/util/polling_loop.hpp"

#include <sched.h>

namespace sriovd {

void PollWindow::set_max(ns max_window) {
  if (max_window == max_) return;
  max_ = max_window;
  score_ = 0;  // what fit the old window says nothing about the new one
}

void PollWindow::work_after(ns gap) {
  if (max_.count() <= 0) return;
  // score += (target - score) / 8, in integers: the last ~8 gaps.
  if (gap <= max_)
    score_ += (kFull - score_ + 7) / 8;
  else
    score_ -= (score_ + 7) / 8;
}

// A gap starts when the loop has run everything that was ready (poll()
// until it finds nothing), so handlers queued together, or coming while
// it runs them, count as one piece of work.
void PollingLoop::run() {
  using clock = std::chrono::steady_clock;
  while (!io_.stopped()) {
    if (window_.max().count() <= 0) {
      // control.poll_us 0: io_context::run(), a handler at a time (a
      // reload's window is looked at after each) - no extra look at the
      // reactor per wakeup, no clock.
      if (io_.run_one() == 0) break;
      continue;
    }
    while (io_.poll() > 0) {
    }
    if (io_.stopped()) break;
    const clock::time_point idle = clock::now();
    const PollWindow::ns window = window_.window();
    clock::time_point found;
    if (window.count() > 0 && poll_for(idle + window, found)) {
      account(idle, found, true);
      // Found by polling, however long the yields between looks took:
      // it cost its sender no wakeup.
      window_.work_after(PollWindow::ns{0});
      continue;
    }
    if (window.count() > 0) account(idle, clock::now(), false);
    if (io_.run_one() == 0) break;  // stopped, or nothing left to wait for
    window_.work_after(clock::now() - idle);
  }
}

// Runs one ready handler if one comes before `until` (`found`: when the
// look that found it began); yields between looks.
bool PollingLoop::poll_for(std::chrono::steady_clock::time_point until, std::chrono::steady_clock::time_point& found) {
  for (;;) {
    found = std::chrono::steady_clock::now();
    if (io_.poll_one() > 0) return true;
    if (io_.stopped() || found >= until) return false;
    ::sched_yield();
  }
}

void PollingLoop::account(std::chrono::steady_clock::time_point from, std::chrono::steady_clock::time_point to,
                          bool hit) {
  ++stats_.polls;
  if (hit) ++stats_.hits;
  stats_.polled_ns += static_cast<uint64_t>(std::chrono::duration_cast<PollWindow::ns>(to - from).count());
  shared_polls_.store(stats_.polls, std::memory_order_relaxed);
  shared_hits_.store(stats_.hits, std::memory_order_relaxed);
  shared_polled_ns_.store(stats_.polled_ns, std::memory_order_relaxed);
}

}  // namespace sriovd
