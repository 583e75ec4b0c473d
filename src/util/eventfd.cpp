#include "sriovd/util/eventfd.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "sriovd/util/error.hpp"

namespace sriovd {

bool is_eventfd(int fd) {
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  char target[64];
  const ssize_t n = ::readlink(link.c_str(), target, sizeof target);
  static constexpr char kEventfd[] = "anon_inode:[eventfd]";
  return n == static_cast<ssize_t>(sizeof kEventfd - 1) && std::memcmp(target, kEventfd, sizeof kEventfd - 1) == 0;
}

UniqueFd checked_peer_eventfd(UniqueFd fd, const std::string& what) {
  if (!fd.valid()) return fd;
  if (!is_eventfd(fd.get())) throw std::invalid_argument(what + ": the fd is not an eventfd");
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || (!(flags & O_NONBLOCK) && ::fcntl(fd.get(), F_SETFL, flags | O_NONBLOCK) != 0))
    throw_errno(what + ": making the eventfd non-blocking");
  return fd;
}

namespace {

// One slot per enrolled thread. `calls` is odd while the thread is inside
// a call on a peer's eventfd; the watchdog interrupts a thread it finds
// inside the same call at two ticks in a row.
struct PeerIoSlot {
  std::atomic<pid_t> tid{0};  // 0: free
  std::atomic<uint64_t> calls{0};
};

constexpr size_t kMaxPeerIoThreads = 1024;
constexpr auto kWatchdogTick = std::chrono::milliseconds(25);

std::array<PeerIoSlot, kMaxPeerIoThreads> g_peer_io;
std::mutex g_peer_io_mutex;  // enrolment, leaving, and each watchdog tick
std::atomic<uint64_t> g_interruptions{0};

int interrupt_signal() { return SIGRTMIN + 5; }

void on_interrupt(int /*signo*/) {}  // the point is the EINTR

void watchdog() {
  pthread_setname_np(pthread_self(), "sriovd-peerio");
  std::array<uint64_t, kMaxPeerIoThreads> seen{};
  const pid_t pid = ::getpid();
  for (;;) {
    std::this_thread::sleep_for(kWatchdogTick);
    std::lock_guard lock(g_peer_io_mutex);
    for (size_t i = 0; i < kMaxPeerIoThreads; ++i) {
      const pid_t tid = g_peer_io[i].tid.load(std::memory_order_relaxed);
      const uint64_t calls = g_peer_io[i].calls.load(std::memory_order_relaxed);
      if (tid != 0 && (calls & 1U) && calls == seen[i]) {
        // Still inside the call it was in a tick ago. Leaving takes this
        // lock, so the tid is the enrolled thread's, not a reused one.
        g_interruptions.fetch_add(1, std::memory_order_relaxed);
        (void)::syscall(SYS_tgkill, pid, tid, interrupt_signal());
      }
      seen[i] = calls;
    }
  }
}

// Frees the slot when its thread ends.
struct Enrolment {
  PeerIoSlot* slot = nullptr;
  bool data_plane = false;
  uint64_t calls = 0;
  ~Enrolment() {
    if (!slot) return;
    std::lock_guard lock(g_peer_io_mutex);
    slot->tid.store(0, std::memory_order_relaxed);
    slot->calls.store(0, std::memory_order_relaxed);
  }
};

thread_local Enrolment t_enrolment;

void guard_this_thread() {
  if (t_enrolment.slot) return;
  std::lock_guard lock(g_peer_io_mutex);
  static bool started = false;
  if (!started) {
    struct sigaction sa {};
    sa.sa_handler = on_interrupt;
    sa.sa_flags = 0;  // no SA_RESTART: the interrupted call returns EINTR
    sigemptyset(&sa.sa_mask);
    if (::sigaction(interrupt_signal(), &sa, nullptr) != 0) throw_errno("installing the peer I/O watchdog's signal");
    std::thread(watchdog).detach();
    started = true;
  }
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, interrupt_signal());
  (void)::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  for (PeerIoSlot& s : g_peer_io) {
    if (s.tid.load(std::memory_order_relaxed) != 0) continue;
    s.calls.store(0, std::memory_order_relaxed);
    s.tid.store(static_cast<pid_t>(::syscall(SYS_gettid)), std::memory_order_relaxed);
    t_enrolment.slot = &s;
    return;
  }
  throw std::runtime_error("more than " + std::to_string(kMaxPeerIoThreads) + " threads do I/O on peers' eventfds");
}

template <typename Call>
bool guarded(Call call) {
  if (!t_enrolment.slot) guard_this_thread();
  PeerIoSlot& s = *t_enrolment.slot;
  s.calls.store(++t_enrolment.calls, std::memory_order_relaxed);
  const bool ok = call();
  const int saved = errno;
  s.calls.store(++t_enrolment.calls, std::memory_order_relaxed);
  errno = saved;
  return ok;
}

}  // namespace

bool peer_eventfd_write(int fd, uint64_t value) {
  return guarded([&] { return ::write(fd, &value, sizeof value) == sizeof value; });
}

bool peer_eventfd_read(int fd, uint64_t& value) {
  return guarded([&] { return ::read(fd, &value, sizeof value) == sizeof value; });
}

void enroll_peer_io_thread() {
  guard_this_thread();
  t_enrolment.data_plane = true;
}

bool peer_io_thread() { return t_enrolment.data_plane; }

uint64_t peer_io_interruptions() { return g_interruptions.load(std::memory_order_relaxed); }

}  // namespace sriovd
