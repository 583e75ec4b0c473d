// The control thread's loop (util/polling_loop): when it polls, and that a
// loop that polls still runs every handler and still stops.
#include "sriovd/util/polling_loop.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <thread>

#include <gtest/gtest.h>

#include "sriovd/util/fd.hpp"

namespace sriovd {
namespace {

using namespace std::chrono_literals;

// Whether the window polls after each of `gaps` (in microseconds).
std::vector<bool> polling_after(PollWindow& w, const std::vector<int>& gaps) {
  std::vector<bool> out;
  for (int g : gaps) {
    w.work_after(std::chrono::microseconds(g));
    out.push_back(w.polling());
  }
  return out;
}

TEST(PollWindow, OffWithoutAWindow) {
  PollWindow w;
  for (int i = 0; i < 50; ++i) w.work_after(0us);
  EXPECT_FALSE(w.polling());
  EXPECT_EQ(w.window(), 0ns);
}

TEST(PollWindow, ACloseGapTurnsItOnALongOneOff) {
  PollWindow w(50us);
  EXPECT_FALSE(w.polling());  // cold: the first piece of work is followed by sleep
  w.work_after(20us);
  EXPECT_TRUE(w.polling());
  EXPECT_EQ(w.window(), 50us);
  w.work_after(5000us);
  EXPECT_FALSE(w.polling());
  // A peer whose messages all come further apart than the window never
  // makes the thread poll.
  PollWindow sparse(50us);
  for (bool on : polling_after(sparse, std::vector<int>(100, 60))) EXPECT_FALSE(on);
}

TEST(PollWindow, MaskThenUnmaskKeepsItPolling) {
  // Mask, unmask 20 us later, the next interrupt 300 us after that: half
  // the gaps fit, and from the second interrupt on the loop polls after
  // every gap (the long one too: the unmask-to-mask wait is what it pays).
  PollWindow w(50us);
  std::vector<int> gaps;
  for (int i = 0; i < 50; ++i) gaps.insert(gaps.end(), {20, 300});
  const std::vector<bool> on = polling_after(w, gaps);
  for (size_t i = 2; i < on.size(); ++i) EXPECT_TRUE(on[i]) << "after gap " << i;
}

TEST(PollWindow, RareCloseGapsPollRarely) {
  // One gap in twenty fits: the loop polls after few of them.
  PollWindow w(50us);
  std::vector<int> gaps;
  for (int i = 0; i < 20; ++i) {
    gaps.push_back(10);
    gaps.insert(gaps.end(), 19, 1000);
  }
  const std::vector<bool> on = polling_after(w, gaps);
  EXPECT_LE(std::count(on.begin(), on.end(), true), 40);  // 400 gaps
  EXPECT_GT(std::count(on.begin(), on.end(), true), 0);
}

TEST(PollWindow, ANewWindowStartsCold) {
  PollWindow w(50us);
  w.work_after(10us);
  ASSERT_TRUE(w.polling());
  w.set_max(100us);
  EXPECT_FALSE(w.polling());
  w.set_max(0us);
  w.work_after(10us);
  EXPECT_FALSE(w.polling());
}

// A loop serving one end of a socket pair: each byte is answered with a
// byte; the other end sends the next byte as soon as the answer comes.
struct PingPong {
  asio::io_context io;
  UniqueFd ours, theirs;
  std::unique_ptr<asio::posix::stream_descriptor> watch;

  PingPong() {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv), 0);
    ours.reset(sv[0]);
    theirs.reset(sv[1]);
    watch = std::make_unique<asio::posix::stream_descriptor>(io, ours.get());
    arm();
  }
  ~PingPong() {
    if (watch) (void)watch->release();
  }
  void arm() {
    watch->async_wait(asio::posix::stream_descriptor::wait_read, [this](boost::system::error_code ec) {
      if (ec) return;
      char c;
      while (::recv(ours.get(), &c, 1, 0) == 1) (void)::send(ours.get(), &c, 1, MSG_NOSIGNAL);
      if (::recv(ours.get(), &c, 1, MSG_PEEK) == 0) return;  // the peer is gone: no more work
      arm();
    });
  }
  // The peer's side: `rounds` bytes, each sent `pause` after the last
  // one's answer came (blocking, with a deadline per answer); then it
  // closes. The pause lets the loop run out of work first (a byte already
  // there when it looks is work it has not run out of).
  void play(int rounds, std::chrono::microseconds pause = 0us) {
    for (int i = 0; i < rounds; ++i) {
      std::this_thread::sleep_for(pause);
      char c = 'x';
      ASSERT_EQ(::send(theirs.get(), &c, 1, MSG_NOSIGNAL), 1);
      pollfd p{theirs.get(), POLLIN, 0};
      ASSERT_EQ(::poll(&p, 1, 5000), 1) << "no answer to byte " << i;
      ASSERT_EQ(::recv(theirs.get(), &c, 1, 0), 1);
    }
    theirs.reset();
  }
};

// Runs `loop` on a thread; true when it returned within 10 s.
bool run_to_end(PollingLoop& loop) {
  auto done = std::async(std::launch::async, [&] { loop.run(); });
  return done.wait_for(10s) == std::future_status::ready;
}

TEST(PollingLoop, PollsBetweenCloseMessagesAndEndsWithTheWork) {
  PingPong pp;
  // A window no scheduler delay reaches: the first gap (slept through)
  // fits and turns polling on, and from then on every byte is found by
  // polling, however loaded the machine. The last window ends when the
  // peer has gone and the loop is out of work.
  PollingLoop loop(pp.io, 10s);
  std::thread peer([&] { pp.play(300, 100us); });
  const bool ended = run_to_end(loop);
  peer.join();
  ASSERT_TRUE(ended) << "the loop did not return when its work was done";
  // Up to 301 pieces of work (300 bytes, the end of stream; a byte that
  // came while the loop was still running the last is part of that
  // piece): every one after the first found by a poll, and no poll that
  // found nothing.
  EXPECT_GT(loop.stats().hits, 0U);
  EXPECT_LE(loop.stats().hits, 300U);
  EXPECT_EQ(loop.stats().polls, loop.stats().hits);
  EXPECT_GT(loop.stats().polled_ns, 0U);
  EXPECT_TRUE(loop.window().polling());
}

TEST(PollingLoop, WithoutAWindowItNeverPolls) {
  PingPong pp;
  PollingLoop loop(pp.io, 0us);
  std::thread peer([&] { pp.play(100); });
  const bool ended = run_to_end(loop);
  peer.join();
  ASSERT_TRUE(ended);
  EXPECT_EQ(loop.stats().polls, 0U);
  EXPECT_EQ(loop.stats().hits, 0U);
}

TEST(PollingLoop, StopsWhilePolling) {
  asio::io_context io;
  auto guard = asio::make_work_guard(io);  // never out of work: only stop() ends it
  // A window longer than the test's deadline: only stop() can end the
  // poll it is in when told.
  PollingLoop loop(io, 30s);
  std::atomic<int> ran{0};
  auto done = std::async(std::launch::async, [&] { loop.run(); });
  // Close posts keep it polling; then it is told to stop from this thread.
  for (int i = 0; i < 200; ++i) {
    asio::post(io, [&] { ran.fetch_add(1); });
    std::this_thread::sleep_for(10us);
  }
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (ran.load() < 200 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(ran.load(), 200);
  io.stop();
  EXPECT_EQ(done.wait_for(10s), std::future_status::ready) << "the loop did not stop";
}

}  // namespace
}  // namespace sriovd
