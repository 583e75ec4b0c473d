#include "sriovd/util/session_threads.hpp"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <string>

#include <spdlog/spdlog.h>

#include "sriovd/util/eventfd.hpp"

namespace sriovd {

SessionThread::SessionThread(unsigned index, PollWindow::ns poll_window)
    : index_(index), work_(asio::make_work_guard(io_)), loop_(io_, poll_window) {
  std::promise<void> started;
  thread_ = std::thread([this, &started] {
    id_.store(std::this_thread::get_id());
    const std::string name = "sriovd-sess" + std::to_string(index_);
    (void)::pthread_setname_np(::pthread_self(), name.c_str());
    // It writes the VMMs' eventfds (a device model's interrupt, a replayed
    // one): through the peer I/O watchdog, and the engine delivers inline.
    try {
      enroll_peer_io_thread();
    } catch (const std::exception& e) {
      spdlog::error("session thread {}: {}", index_, e.what());
    }
    started.set_value();
    for (;;) {
      try {
        loop_.run();
        return;  // stopped
      } catch (const std::exception& e) {
        // A handler's exception that nothing caught: the peer code catches
        // its own, so this is a bug; the thread goes on serving the others.
        spdlog::error("session thread {}: a handler threw: {}", index_, e.what());
      }
    }
  });
  started.get_future().wait();
  has_cpu_clock_ = ::pthread_getcpuclockid(thread_.native_handle(), &cpu_clock_) == 0;
}

uint64_t SessionThread::cpu_ns() const {
  if (!has_cpu_clock_) return 0;
  timespec ts{};
  if (::clock_gettime(cpu_clock_, &ts) != 0) return 0;
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ULL + static_cast<uint64_t>(ts.tv_nsec);
}

SessionThread::~SessionThread() {
  work_.reset();
  io_.stop();
  if (thread_.joinable()) thread_.join();
}

void SessionThread::set_poll_window(PollWindow::ns window) {
  call([&] { loop_.set_max_window(window); });
}

unsigned SessionPool::usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

SessionPool::SessionPool(unsigned threads, PollWindow::ns poll_window) {
  const unsigned n = threads != 0 ? threads : usable_cpus();
  threads_.reserve(n);
  for (unsigned i = 0; i < n; ++i) threads_.push_back(std::make_unique<SessionThread>(i, poll_window));
}

SessionPool::~SessionPool() = default;

SessionPool::Lease SessionPool::lease() {
  SessionThread* best = threads_.front().get();
  for (const auto& t : threads_)
    if (t->sessions() < best->sessions()) best = t.get();
  return Lease(*best);
}

void SessionPool::set_poll_window(PollWindow::ns window) {
  for (auto& t : threads_) t->set_poll_window(window);
}

}  // namespace sriovd
