// Reads and writes on an eventfd a peer shares, when the peer has made it
// blocking after the daemon checked it (issue 24 items 1 and 2).
#include "sriovd/util/eventfd.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <future>
#include <thread>

namespace sriovd {
namespace {

using namespace std::chrono_literals;

UniqueFd blocking_eventfd(uint64_t count) {
  UniqueFd fd(::eventfd(0, EFD_CLOEXEC));
  if (count) {
    EXPECT_EQ(::write(fd.get(), &count, sizeof count), 8);
  }
  return fd;
}

// A call that has not come back within `t` fails the test; the fd is then
// unblocked by the caller's cleanup so that the thread ends.
template <typename F>
auto within(F fn, std::chrono::milliseconds t, const UniqueFd& unblock) {
  auto f = std::async(std::launch::async, std::move(fn));
  if (f.wait_for(t) != std::future_status::ready) {
    ADD_FAILURE() << "the call blocked";
    uint64_t v = 1;
    (void)::write(unblock.get(), &v, sizeof v);  // a blocked read
    (void)::read(unblock.get(), &v, sizeof v);   // a blocked write
  }
  return f.get();
}

TEST(PeerEventfd, AWriteTheFullCounterWouldBlockIsCutShort) {
  const UniqueFd fd = blocking_eventfd(0xfffffffffffffffeULL);
  const uint64_t before = peer_io_interruptions();
  const auto [ok, err] = within(
      [&] {
        const bool r = peer_eventfd_write(fd.get());
        return std::pair{r, errno};
      },
      3s, fd);
  EXPECT_FALSE(ok);
  EXPECT_EQ(err, EINTR);
  EXPECT_GT(peer_io_interruptions(), before);
}

TEST(PeerEventfd, AReadOfADrainedBlockingCounterIsCutShort) {
  const UniqueFd fd = blocking_eventfd(0);
  const auto [ok, err] = within(
      [&] {
        uint64_t v = 0;
        const bool r = peer_eventfd_read(fd.get(), v);
        return std::pair{r, errno};
      },
      3s, fd);
  EXPECT_FALSE(ok);
  EXPECT_EQ(err, EINTR);
}

// The watchdog cuts only a wait: calls that do not block, on enrolled
// threads that then sit in other waits for several ticks, are not touched.
TEST(PeerEventfd, CallsThatDoNotBlockAreNotDisturbed) {
  const UniqueFd fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  std::thread t([&] {
    enroll_peer_io_thread();
    EXPECT_TRUE(peer_io_thread());
    for (int i = 0; i < 1000; ++i) {
      ASSERT_TRUE(peer_eventfd_write(fd.get(), 2));
      uint64_t v = 0;
      ASSERT_TRUE(peer_eventfd_read(fd.get(), v));
      ASSERT_EQ(v, 2U);
    }
    uint64_t v = 0;
    EXPECT_FALSE(peer_eventfd_read(fd.get(), v));
    EXPECT_EQ(errno, EAGAIN);
    std::this_thread::sleep_for(150ms);  // several watchdog ticks outside any call
    EXPECT_TRUE(peer_eventfd_write(fd.get()));
  });
  t.join();
  EXPECT_FALSE(peer_io_thread()) << "this thread never enrolled as a data-plane thread";
}

// Threads come and go (workers of devices that start and stop): a slot is
// given back when its thread ends.
TEST(PeerEventfd, EndedThreadsGiveTheirSlotBack) {
  const UniqueFd fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  for (int i = 0; i < 3000; ++i) {
    std::thread t([&] {
      enroll_peer_io_thread();
      EXPECT_TRUE(peer_eventfd_write(fd.get()));
    });
    t.join();
  }
}

}  // namespace
}  // namespace sriovd
