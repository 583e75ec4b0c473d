#pragma once
// The data-path threads that serve the VMMs' sessions (vfio-user,
// vhost-user): a small pool sized to the CPUs (control.session_threads),
// each thread with its own io_context and polling loop (control.poll_us).
//
// Ownership is by thread, not by lock: an export (its device, transport
// and server) is made, served and destroyed on the one session thread it
// is given, so every message of its peer - a doorbell, a DMA map, a
// migration step - is handled there, never on the control thread and
// never beside another thread touching the same device. The control
// thread reaches an export only through call(), which runs a function on
// the export's thread and waits for it (status, metrics, a reload's
// access, a link change, the export's end). Tenants on different threads
// share nothing but the interrupt engine (lock-free on the data path) and
// the peer-memory registry (a lock per mapping made, none per access);
// tenants on one thread take turns (64 messages or 20 us each).

#include <time.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "sriovd/util/asio.hpp"
#include "sriovd/util/polling_loop.hpp"

namespace sriovd {

class SessionThread {
 public:
  SessionThread(unsigned index, PollWindow::ns poll_window);
  ~SessionThread();  // ends the loop (what is still posted is dropped) and joins
  SessionThread(const SessionThread&) = delete;
  SessionThread& operator=(const SessionThread&) = delete;

  [[nodiscard]] asio::io_context& io() { return io_; }
  [[nodiscard]] unsigned index() const { return index_; }
  [[nodiscard]] bool on_this_thread() const { return std::this_thread::get_id() == id_.load(); }
  // Exports given to this thread now (SessionPool balances by it).
  [[nodiscard]] unsigned sessions() const { return sessions_.load(std::memory_order_relaxed); }

  // Runs `fn` on this thread, waits for it and returns what it returns
  // (or throws what it threw). On this thread itself it runs inline.
  // Handlers posted before it run first, in order: an object this thread
  // owns is alive for a call made before its destruction was asked.
  template <typename Fn>
  auto call(Fn&& fn) -> std::invoke_result_t<Fn&> {
    using R = std::invoke_result_t<Fn&>;
    if (on_this_thread()) return fn();
    std::packaged_task<R()> task([&fn]() -> R { return fn(); });
    std::future<R> done = task.get_future();
    asio::post(io_, [&task] { task(); });
    return done.get();
  }

  // control.poll_us after a reload.
  void set_poll_window(PollWindow::ns window);
  // The CPU time the thread has used (its thread CPU clock; any thread).
  [[nodiscard]] uint64_t cpu_ns() const;
  // Its loop's polling (control.poll_us; any thread).
  [[nodiscard]] PollStats poll_stats() const { return loop_.shared_stats(); }

 private:
  friend class SessionPool;
  unsigned index_;
  std::atomic<unsigned> sessions_{0};
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  PollingLoop loop_;
  std::atomic<std::thread::id> id_{};
  clockid_t cpu_clock_{};
  bool has_cpu_clock_ = false;
  std::thread thread_;
};

class SessionPool {
 public:
  // `threads` 0: one per CPU this process may run on (its affinity mask).
  SessionPool(unsigned threads, PollWindow::ns poll_window);
  ~SessionPool();
  SessionPool(const SessionPool&) = delete;
  SessionPool& operator=(const SessionPool&) = delete;

  // A session thread given to one export while the lease lives: the
  // pool's least loaded (the lowest index among equals).
  class Lease {
   public:
    Lease() = default;
    explicit Lease(SessionThread& t) : thread_(&t) { t.sessions_.fetch_add(1, std::memory_order_relaxed); }
    ~Lease() { reset(); }
    Lease(Lease&& o) noexcept : thread_(std::exchange(o.thread_, nullptr)) {}
    Lease& operator=(Lease&& o) noexcept {
      if (this != &o) {
        reset();
        thread_ = std::exchange(o.thread_, nullptr);
      }
      return *this;
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    void reset() {
      if (thread_) thread_->sessions_.fetch_sub(1, std::memory_order_relaxed);
      thread_ = nullptr;
    }
    [[nodiscard]] SessionThread* get() const { return thread_; }
    SessionThread* operator->() const { return thread_; }
    SessionThread& operator*() const { return *thread_; }
    explicit operator bool() const { return thread_ != nullptr; }

   private:
    SessionThread* thread_ = nullptr;
  };
  [[nodiscard]] Lease lease();

  [[nodiscard]] size_t size() const { return threads_.size(); }
  [[nodiscard]] SessionThread& at(size_t i) { return *threads_.at(i); }
  [[nodiscard]] const SessionThread& at(size_t i) const { return *threads_.at(i); }
  void set_poll_window(PollWindow::ns window);

  // The CPUs this process may run on (sched_getaffinity), at least 1.
  static unsigned usable_cpus();

 private:
  std::vector<std::unique_ptr<SessionThread>> threads_;
};

// An object that lives on a session thread: made there (make_on_session)
// and deleted there, whoever drops the last reference (a reset, a vector
// of exports shifting, a destructor on the control thread).
struct SessionDeleter {
  SessionThread* thread = nullptr;
  template <typename T>
  void operator()(T* p) const {
    if (thread)
      thread->call([p] { delete p; });
    else
      delete p;
  }
};
template <typename T>
using OnSession = std::unique_ptr<T, SessionDeleter>;

// Runs `make` (which returns a std::unique_ptr<T>) on `thread` and keeps
// what it made for that thread to delete.
template <typename Make>
auto make_on_session(SessionThread& thread, Make&& make) {
  auto made = thread.call(std::forward<Make>(make));
  using T = typename decltype(made)::element_type;
  return OnSession<T>(made.release(), SessionDeleter{&thread});
}

}  // namespace sriovd
