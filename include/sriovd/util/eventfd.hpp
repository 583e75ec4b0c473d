#pragma once
// Eventfds that come from a peer (vhost-user kick/call/err, vfio-user
// SET_IRQS): checked where they enter, so nothing after can block on them.

#include <unistd.h>

#include <cstdint>
#include <string>

#include "sriovd/util/fd.hpp"

namespace sriovd {

// True when `fd` is an eventfd (its /proc/self/fd link says so).
[[nodiscard]] bool is_eventfd(int fd);

// Refuses (std::invalid_argument naming `what`) an fd that is not an
// eventfd, and makes it non-blocking. The flag is on the open file the peer
// shares: an eventfd it reads blocking would see EAGAIN - QEMU, DPDK and
// cloud-hypervisor all use theirs non-blocking. A blocking fd here would let
// the peer stop a worker's read or the relay's write for as long as it liked.
UniqueFd checked_peer_eventfd(UniqueFd fd, const std::string& what);

// Reads and writes on an eventfd a peer shares - one it gave (call and kick
// fds, SET_IRQS) or one it was given (doorbells). The flag set above does
// not hold: the peer shares the open file and may clear O_NONBLOCK at any
// moment, then fill the counter (a write blocks) or drain it between our
// epoll_wait and read (a read blocks). No reopening gets a file of our own
// (an eventfd cannot be opened through /proc), and RWF_NOWAIT is refused.
//
// So the calling thread is enrolled with a watchdog: each call is
// bracketed by two relaxed stores, and one still inside the kernel two
// ticks later (25-50 ms) is interrupted by a signal whose handler does not
// restart it. The call then fails with EINTR: the peer made the file
// blocking and the caller stops using it. Calls that do not block are not
// affected (a signal only cuts a wait short).
//
// true: the 8 bytes moved. false with errno: EAGAIN (counter full, or
// empty to read), EINTR (the peer made it blocking), EBADF...
bool peer_eventfd_write(int fd, uint64_t value = 1);
bool peer_eventfd_read(int fd, uint64_t& value);

// An eventfd of our own (non-blocking, never a peer's): a signal that
// cannot be added finds the counter full (EAGAIN), which wakes the reader
// all the same; a drain that reads nothing finds it empty. Neither has an
// error worth a branch at its call site.
inline void own_eventfd_signal(int fd) {
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(fd, &one, sizeof one);
}
inline void own_eventfd_drain(int fd) {
  uint64_t count = 0;
  [[maybe_unused]] const ssize_t n = ::read(fd, &count, sizeof count);
}

// Data-plane threads (relay, queue workers) enroll when they start, and
// peer_io_thread() is true on them: the engine delivers inline only there
// and any other thread (the control thread) posts the delivery to a relay
// thread, so the control thread never writes a peer's eventfd. A call from
// a thread not enrolled still works (it is guarded from then on; the first
// one takes a lock) - the simulated kernel signals from any thread.
void enroll_peer_io_thread();
[[nodiscard]] bool peer_io_thread();

// Calls the watchdog has interrupted since start (for tests and status).
[[nodiscard]] uint64_t peer_io_interruptions();

}  // namespace sriovd
