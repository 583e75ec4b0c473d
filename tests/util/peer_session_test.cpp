// The session skeleton the three servers share (util/peer_session): what
// each of them relies on, tested once here against real sockets.
#include "sriovd/util/peer_session.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <future>
#include <thread>

#include <gtest/gtest.h>

#include "sriovd/util/unix_socket.hpp"
#include "support/temp_dir.hpp"
#include "support/process.hpp"

namespace sriovd {
namespace {

using namespace std::chrono_literals;

// A frame: a 4-byte payload length, then the payload.
FramedReader reader(size_t max_fds = 4) {
  return FramedReader(4, max_fds, [](std::span<const uint8_t> h) {
    uint32_t n;
    std::memcpy(&n, h.data(), 4);
    if (n > 1024) throw FramingError("a payload of " + std::to_string(n) + " bytes");
    return size_t{n};
  });
}

std::vector<uint8_t> frame(const std::string& text) {
  std::vector<uint8_t> f(4 + text.size());
  const auto n = static_cast<uint32_t>(text.size());
  std::memcpy(f.data(), &n, 4);
  std::memcpy(f.data() + 4, text.data(), text.size());
  return f;
}

// An io_context on its own thread; the test thread is the peer.
struct Loop {
  Loop() : thread([this] { io.run(); }) {}
  ~Loop() {
    io.stop();
    thread.join();
  }
  template <typename F>
  auto on_loop(F f) {
    std::packaged_task<decltype(f())()> task(std::move(f));
    auto result = task.get_future();
    asio::post(io, [&] { task(); });
    return result.get();
  }
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  std::thread thread;
};

struct Pair {
  Pair() {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) throw std::runtime_error("socketpair");
    ours = UniqueFd(sv[0]);
    theirs = UniqueFd(sv[1]);
  }
  UniqueFd ours, theirs;
};

bool closed_by_peer(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 5000) != 1) return false;
  char buf[64];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT)) > 0) {
  }
  return n == 0 || (n < 0 && errno == ECONNRESET);
}

// Messages split anywhere, fds with any part: each comes whole, with its
// own fds, in order.
TEST(FramedReader, ReassemblesMessagesSplitAnywhereWithTheirFds) {
  Pair p;
  FramedReader r = reader();
  auto a = frame("first");
  auto b = frame("second message");
  UniqueFd efd(::eventfd(0, EFD_CLOEXEC));
  // "first" in three parts, the fd with the middle one; then all of "second" with half of nothing.
  const int fds[1] = {efd.get()};
  ASSERT_EQ(::send(p.theirs.get(), a.data(), 2, 0), 2);
  EXPECT_EQ(r.read(p.ours.get()), FramedReader::Status::again);
  EXPECT_TRUE(r.partial());
  const iovec mid{a.data() + 2, 4};
  ASSERT_EQ(send_with_fds(p.theirs.get(), std::span<const iovec>(&mid, 1), fds), 4);
  ASSERT_EQ(::send(p.theirs.get(), a.data() + 6, a.size() - 6, 0), static_cast<ssize_t>(a.size() - 6));
  ASSERT_EQ(::send(p.theirs.get(), b.data(), b.size(), 0), static_cast<ssize_t>(b.size()));
  uint8_t hdr[4];
  std::vector<uint8_t> payload;
  std::vector<UniqueFd> got_fds;
  ASSERT_EQ(r.read(p.ours.get()), FramedReader::Status::message);
  r.take(hdr, payload, got_fds);
  EXPECT_EQ(std::string(payload.begin(), payload.end()), "first");
  EXPECT_EQ(got_fds.size(), 1U);
  ASSERT_EQ(r.read(p.ours.get()), FramedReader::Status::message);
  r.take(hdr, payload, got_fds);
  EXPECT_EQ(std::string(payload.begin(), payload.end()), "second message");
  EXPECT_TRUE(got_fds.empty()) << "an fd of the first message went with the second";
  EXPECT_EQ(r.read(p.ours.get()), FramedReader::Status::again);
  EXPECT_FALSE(r.partial());
  p.theirs.reset();
  EXPECT_EQ(r.read(p.ours.get()), FramedReader::Status::closed);
}

// The fd cap is over all the parts of one message, not per sendmsg.
TEST(FramedReader, TheFdCapCountsEveryPartOfAMessage) {
  Pair p;
  FramedReader r = reader(2);
  auto a = frame("0123456789");
  UniqueFd efd(::eventfd(0, EFD_CLOEXEC));
  const int fds[2] = {efd.get(), efd.get()};
  bool threw = false;
  for (size_t i = 0; i < a.size() && !threw; ++i) {
    const iovec one{a.data() + i, 1};
    ASSERT_EQ(send_with_fds(p.theirs.get(), std::span<const iovec>(&one, 1), fds), 1);
    try {
      (void)r.read(p.ours.get());
    } catch (const FramingError& e) {
      threw = true;
      EXPECT_NE(std::string(e.what()).find("more than 2 fds"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(threw) << "a message trickled a byte at a time collected fds with every part";
}

TEST(FramedReader, AnImpossibleSizeIsAFramingError) {
  Pair p;
  FramedReader r = reader();
  const uint32_t huge = 1 << 20;
  ASSERT_EQ(::send(p.theirs.get(), &huge, 4, 0), 4);
  EXPECT_THROW((void)r.read(p.ours.get()), FramingError);
}

// A burst of small messages costs a few reads, not two per message.
TEST(FramedReader, ABurstIsReadInFewSystemCalls) {
  Pair p;
  FramedReader r = reader();
  std::vector<uint8_t> burst;
  for (int i = 0; i < 200; ++i) {
    auto f = frame("doorbell " + std::to_string(i));
    burst.insert(burst.end(), f.begin(), f.end());
  }
  ASSERT_EQ(::send(p.theirs.get(), burst.data(), burst.size(), 0), static_cast<ssize_t>(burst.size()));
  uint8_t hdr[4];
  std::vector<uint8_t> payload;
  std::vector<UniqueFd> fds;
  for (int i = 0; i < 200; ++i) {
    ASSERT_EQ(r.read(p.ours.get()), FramedReader::Status::message) << i;
    r.take(hdr, payload, fds);
    ASSERT_EQ(std::string(payload.begin(), payload.end()), "doorbell " + std::to_string(i));
  }
  EXPECT_LE(r.reads(), 2U) << "200 messages of " << burst.size() << " bytes in all";
  EXPECT_FALSE(r.buffered());
  EXPECT_EQ(r.read(p.ours.get()), FramedReader::Status::again);
}

// Fds sent with a later message of a batch belong to that message, not to
// the one being framed when the read brought them.
TEST(FramedReader, FdsReadAheadGoWithTheMessageThatCarriedThem) {
  Pair p;
  FramedReader r = reader();
  auto a = frame("no fds");
  auto b = frame("two fds");
  auto c = frame("none again");
  UniqueFd e1(::eventfd(0, EFD_CLOEXEC)), e2(::eventfd(0, EFD_CLOEXEC));
  const int fds[2] = {e1.get(), e2.get()};
  ASSERT_EQ(::send(p.theirs.get(), a.data(), a.size(), 0), static_cast<ssize_t>(a.size()));
  const iovec bv{b.data(), b.size()};
  ASSERT_EQ(send_with_fds(p.theirs.get(), std::span<const iovec>(&bv, 1), fds), static_cast<ssize_t>(b.size()));
  ASSERT_EQ(::send(p.theirs.get(), c.data(), c.size(), 0), static_cast<ssize_t>(c.size()));
  uint8_t hdr[4];
  std::vector<uint8_t> payload;
  std::vector<UniqueFd> got;
  const std::pair<std::string, size_t> want[] = {{"no fds", 0}, {"two fds", 2}, {"none again", 0}};
  for (const auto& [text, n] : want) {
    ASSERT_EQ(r.read(p.ours.get()), FramedReader::Status::message) << text;
    r.take(hdr, payload, got);
    EXPECT_EQ(std::string(payload.begin(), payload.end()), text);
    EXPECT_EQ(got.size(), n) << text;
  }
}

// Messages read ahead past a batch's 64 are served though the socket has
// nothing new to wake the loop for them.
TEST(PeerConnection, MessagesReadAheadAreServedWithoutMoreData) {
  Loop loop;
  Pair p;
  std::atomic<int> messages{0};
  auto owned = std::make_unique<PeerConnection>(
      loop.io, reader(), 1s,
      [&](FramedReader& r) {
        uint8_t h[4];
        std::vector<uint8_t> payload;
        std::vector<UniqueFd> fds;
        r.take(h, payload, fds);
        ++messages;
      },
      [](const std::string&, EndCause) {});
  PeerConnection& conn = *owned;
  loop.on_loop([&] {
    conn.adopt(std::move(p.ours));
    return 0;
  });
  std::vector<uint8_t> burst;
  for (int i = 0; i < 500; ++i) {
    auto f = frame("x");
    burst.insert(burst.end(), f.begin(), f.end());
  }
  ASSERT_EQ(::send(p.theirs.get(), burst.data(), burst.size(), 0), static_cast<ssize_t>(burst.size()));
  EXPECT_TRUE(test::wait_until([&] { return messages == 500; }, 5s)) << messages << " of 500 served";
  loop.on_loop([&] {
    owned.reset();
    return 0;
  });
}

// A half message ends the connection at its deadline, with the reason;
// meanwhile the loop serves other work; a whole message in time is handled.
TEST(PeerConnection, AHalfMessageEndsAtItsDeadlineWithoutHoldingTheLoop) {
  Loop loop;
  Pair p;
  std::atomic<int> messages{0};
  std::promise<std::pair<std::string, EndCause>> ended;
  auto owned = std::make_unique<PeerConnection>(
      loop.io, reader(), 300ms,
      [&](FramedReader& r) {
        uint8_t h[4];
        std::vector<uint8_t> payload;
        std::vector<UniqueFd> fds;
        r.take(h, payload, fds);
        ++messages;
      },
      [&](const std::string& why, EndCause cause) {
        ended.set_value({why, cause});
      });
  PeerConnection& conn = *owned;
  loop.on_loop([&] {
    conn.adopt(std::move(p.ours));
    return 0;
  });
  auto whole = frame("in time");
  ASSERT_EQ(::send(p.theirs.get(), whole.data(), whole.size(), 0), static_cast<ssize_t>(whole.size()));
  ASSERT_TRUE(test::wait_until([&] { return messages == 1; }, 5s));
  auto half = frame("never finished");
  ASSERT_EQ(::send(p.theirs.get(), half.data(), 6, 0), 6);
  EXPECT_TRUE(loop.on_loop([&] { return conn.connected(); })) << "the loop waited for the rest of the message";
  auto end = ended.get_future();
  ASSERT_EQ(end.wait_for(10s), std::future_status::ready);
  const auto [why, cause] = end.get();
  EXPECT_EQ(cause, EndCause::framing);
  EXPECT_NE(why.find("not complete within 300 ms (6 of 18 bytes)"), std::string::npos) << why;
  EXPECT_TRUE(closed_by_peer(p.theirs.get()));
  loop.on_loop([&] {
    owned.reset();  // on its own thread, as a server's is
    return 0;
  });
}

// A handler that throws ends only that connection, with its text.
TEST(PeerConnection, AHandlerThatThrowsEndsTheConnection) {
  Loop loop;
  Pair p;
  std::promise<std::string> ended;
  auto owned = std::make_unique<PeerConnection>(
      loop.io, reader(), 1s, [&](FramedReader&) { throw std::runtime_error("refused by the handler"); },
      [&](const std::string& why, EndCause cause) {
        EXPECT_EQ(cause, EndCause::local);
        ended.set_value(why);
      });
  PeerConnection& conn = *owned;
  loop.on_loop([&] {
    conn.adopt(std::move(p.ours));
    return 0;
  });
  auto m = frame("x");
  ASSERT_EQ(::send(p.theirs.get(), m.data(), m.size(), 0), static_cast<ssize_t>(m.size()));
  auto end = ended.get_future();
  ASSERT_EQ(end.wait_for(10s), std::future_status::ready);
  EXPECT_EQ(end.get(), "refused by the handler");
  EXPECT_TRUE(closed_by_peer(p.theirs.get()));
  loop.on_loop([&] {
    owned.reset();
    return 0;
  });
}

// The listener: admitted peers reach the server, refused ones are told
// (when the server wants) and counted; the one-client policy; the socket
// file goes with the listener.
TEST(UnixListener, AdmitsChecksAndRefusesWithTheReason) {
  test::TempDir dir;
  const std::string path = dir.file("s.sock");
  Loop loop;
  std::atomic<int> admitted{0};
  std::atomic<bool> busy{false};
  std::vector<uid_t> nobody_but = {::getuid() + 4242};
  auto listener = loop.on_loop([&] {
    return std::make_unique<UnixListener>(
        loop.io, path, UnixListener::Options{"test socket", "the test's list", 0660, {}},
        [&](UniqueFd, const ucred& peer) {
          EXPECT_EQ(peer.uid, ::getuid());
          ++admitted;
        },
        [&] { return busy.load(); },
        [&](UniqueFd fd, const std::string& why) { (void)::send(fd.get(), why.data(), why.size(), MSG_NOSIGNAL); });
  });
  { UniqueFd c = connect_unix(path, "test socket"); }
  ASSERT_TRUE(test::wait_until([&] { return admitted == 1; }, 5s));
  busy = true;
  UniqueFd second = connect_unix(path, "test socket");
  char why[256] = {};
  pollfd pf{second.get(), POLLIN, 0};
  ASSERT_EQ(::poll(&pf, 1, 5000), 1);
  ASSERT_GT(::recv(second.get(), why, sizeof why - 1, 0), 0);
  EXPECT_NE(std::string(why).find("while one is connected"), std::string::npos) << why;
  busy = false;
  loop.on_loop([&] {
    listener->set_allowed_uids(nobody_but);
    return 0;
  });
  UniqueFd third = connect_unix(path, "test socket");
  std::memset(why, 0, sizeof why);
  pollfd pt{third.get(), POLLIN, 0};
  ASSERT_EQ(::poll(&pt, 1, 5000), 1);
  ASSERT_GT(::recv(third.get(), why, sizeof why - 1, 0), 0);
  EXPECT_NE(std::string(why).find("refused uid " + std::to_string(::getuid()) + ": not in the test's list"),
            std::string::npos)
      << why;
  EXPECT_EQ(loop.on_loop([&] { return listener->refused(); }), 2U);
  EXPECT_EQ(admitted, 1);
  loop.on_loop([&] {
    listener.reset();
    return 0;
  });
  EXPECT_NE(::access(path.c_str(), F_OK), 0) << "the socket file outlived its listener";
}

TEST(PeerRefusal, FailsClosedOnUnknownCredentials) {
  EXPECT_NE(peer_refusal(std::nullopt, {}, "x").find("credentials the kernel cannot give"), std::string::npos);
  const ucred root{1, 0, 0};
  const uid_t only[] = {1000};
  EXPECT_EQ(peer_refusal(root, {}, "x"), "");
  EXPECT_NE(peer_refusal(root, only, "the list").find("refused uid 0: not in the list"), std::string::npos);
}

}  // namespace
}  // namespace sriovd

namespace sriovd {
namespace {

// Issue 24 item 9, at the source: a SocketFile's access goes to the socket
// it made, whatever its path holds later, and its mode does not depend on
// the process's umask (which it no longer changes).
TEST(SocketFileAttack, AccessGoesToTheSocketNotToWhatItsPathHoldsNow) {
  test::TempDir dir;
  const std::string path = dir.file("vm.sock");
  const mode_t old_mask = ::umask(077);
  SocketFile file(path, {std::nullopt, std::nullopt, 0666}, "test socket");
  EXPECT_EQ(::umask(old_mask), 077U) << "the umask was changed";
  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0666U) << "the umask cut the mode";
  for (const auto& e : std::filesystem::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().filename().string(), "vm.sock") << "a private directory was left behind";
  const std::string secret = dir.file("secret");
  dir.write("secret", "x");
  ASSERT_EQ(::chmod(secret.c_str(), 0600), 0);
  ASSERT_EQ(::rename(path.c_str(), dir.file("moved").c_str()), 0);
  ASSERT_EQ(::symlink(secret.c_str(), path.c_str()), 0);
  file.set_access({65534, 65534, 0640});
  ASSERT_EQ(::stat(secret.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600U);
  EXPECT_EQ(st.st_uid, ::geteuid());
  ASSERT_EQ(::stat(dir.file("moved").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640U);
  EXPECT_EQ(st.st_uid, 65534U);
  file.remove();
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << "remove() took the symlink that is not its socket";
  EXPECT_EQ(::lstat(dir.file("moved").c_str(), &st), 0);
}

TEST(SocketFileAttack, ASocketStillInPlaceIsRemovedAndALiveOneRefused) {
  test::TempDir dir;
  const std::string path = dir.file("a.sock");
  SocketFile file(path, {std::nullopt, std::nullopt, 0600}, "test socket");
  EXPECT_THROW(SocketFile(path, {std::nullopt, std::nullopt, 0600}, "second"), std::exception)
      << "a live server's socket was replaced";
  UniqueFd fd = file.take_listener();
  ASSERT_TRUE(fd.valid());
  UniqueFd c = connect_unix(path, "test socket");
  EXPECT_TRUE(c.valid());
  file.remove();
  struct stat st {};
  EXPECT_NE(::lstat(path.c_str(), &st), 0);
}

}  // namespace
}  // namespace sriovd

namespace sriovd {
namespace {

// Issue 24, "also seen": a reply larger than the socket buffer. It goes in
// pieces as the peer reads, fds with the first byte; and a peer that drains
// it one buffer at a time just inside a per-wait timeout cannot stretch it
// past the deadline (SO_SNDTIMEO would give it a second per buffer).
TEST(SendAllWithin, ALargeReplyGoesWholeToAReaderAndNotPastTheDeadlineToATrickler) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  UniqueFd ours(sv[0]), peer(sv[1]);
  const int small = 16384;
  ::setsockopt(ours.get(), SOL_SOCKET, SO_SNDBUF, &small, sizeof small);
  std::vector<uint8_t> body(1 << 20);
  for (size_t i = 0; i < body.size(); ++i) body[i] = static_cast<uint8_t>(i * 7);
  uint32_t header = 0xabcd;
  const iovec iov[2] = {{&header, sizeof header}, {body.data(), body.size()}};
  UniqueFd passed(::eventfd(0, EFD_CLOEXEC));
  const int fd = passed.get();
  // A reader: everything arrives, in order, with the fd.
  auto reader = std::async(std::launch::async, [&] {
    std::vector<uint8_t> got;
    std::vector<UniqueFd> fds;
    bool truncated = false;
    std::vector<uint8_t> buf(65536);
    while (got.size() < sizeof header + body.size()) {
      const ssize_t n = recv_with_fds(peer.get(), buf.data(), buf.size(), fds, 0, truncated);
      if (n <= 0) break;
      got.insert(got.end(), buf.begin(), buf.begin() + n);
    }
    return std::pair{got, fds.size()};
  });
  ASSERT_EQ(send_all_within(ours.get(), iov, std::span<const int>(&fd, 1), std::chrono::seconds(5)),
            static_cast<ssize_t>(sizeof header + body.size()));
  const auto [got, nfds] = reader.get();
  ASSERT_EQ(got.size(), sizeof header + body.size());
  EXPECT_EQ(std::memcmp(got.data() + sizeof header, body.data(), body.size()), 0);
  EXPECT_EQ(nfds, 1U);
  // A trickler: one small read every 300 ms. The send gives up at its
  // deadline (ETIMEDOUT), not a second per buffer later.
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    std::vector<uint8_t> buf(4096);
    while (!stop) {
      (void)::recv(peer.get(), buf.data(), buf.size(), MSG_DONTWAIT);
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
  });
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(send_all_within(ours.get(), iov, {}, std::chrono::milliseconds(500)), -1);
  EXPECT_EQ(errno, ETIMEDOUT);
  const auto took = std::chrono::steady_clock::now() - t0;
  stop = true;
  trickle.join();
  EXPECT_LT(took, std::chrono::seconds(3)) << "the deadline did not hold";
}

}  // namespace
}  // namespace sriovd

namespace sriovd {
namespace {

// Issue 39, a4: a peer that never reads its replies held the loop 1 s per
// reply (every other tenant waited), then was dropped, reconnected and did
// it again. Now a reply its socket does not take is queued: the loop goes
// on serving the others while that peer stays connected with its replies
// waiting and its further requests unread; once it reads, everything is
// delivered in order and its requests are served again; and a peer that
// lets more than kMaxQueuedBytes wait is dropped.
struct Replier {
  Replier(Loop& loop, size_t reply_bytes, std::chrono::milliseconds deadline = 10s)
      : conn(
            loop.io, reader(), deadline,
            [this, reply_bytes](FramedReader& r) {
              uint8_t h[4];
              std::vector<uint8_t> payload;
              std::vector<UniqueFd> fds;
              r.take(h, payload, fds);
              ++requests;
              std::vector<uint8_t> reply(reply_bytes, static_cast<uint8_t>(requests.load()));
              const iovec iov[1] = {{reply.data(), reply.size()}};
              conn.send(iov, {});
            },
            [this](const std::string& why, EndCause) {
              std::lock_guard lock(mutex);
              ended = why;
            }) {}
  PeerConnection conn;
  std::atomic<int> requests{0};
  std::mutex mutex;
  std::string ended;
};

TEST(PeerConnection, APeerThatDoesNotReadHoldsNobodyElse) {
  Loop loop;
  Pair slow, quick;
  Replier a(loop, 64 * 1024), b(loop, 16);
  loop.on_loop([&] {
    a.conn.adopt(std::move(slow.ours));
    b.conn.adopt(std::move(quick.ours));
    return 0;
  });
  // The slow peer asks 16 times for 64 KiB and reads nothing.
  const auto ask = frame("reply please");
  for (int i = 0; i < 16; ++i)
    ASSERT_EQ(::send(slow.theirs.get(), ask.data(), ask.size(), 0), static_cast<ssize_t>(ask.size()));
  ASSERT_TRUE(test::wait_until([&] { return loop.on_loop([&] { return a.conn.queued_bytes(); }) > 0; }, 5s));
  // The other tenant's round trips go on meanwhile.
  for (int i = 0; i < 20; ++i) {
    ASSERT_EQ(::send(quick.theirs.get(), ask.data(), ask.size(), 0), static_cast<ssize_t>(ask.size()));
    uint8_t r[16];
    pollfd p{quick.theirs.get(), POLLIN, 0};
    ASSERT_EQ(::poll(&p, 1, 5000), 1) << "the other tenant waited for the one that does not read";
    ASSERT_EQ(::recv(quick.theirs.get(), r, sizeof r, MSG_WAITALL), 16);
  }
  EXPECT_TRUE(loop.on_loop([&] { return a.conn.connected(); })) << "dropped for not reading within a moment";
  EXPECT_LT(a.requests.load(), 16) << "requests were served while replies waited";
  // It reads: every reply comes, in order, and its requests are served.
  std::vector<uint8_t> got;
  std::vector<uint8_t> buf(64 * 1024);
  while (got.size() < 16U * 64 * 1024) {
    pollfd p{slow.theirs.get(), POLLIN, 0};
    ASSERT_EQ(::poll(&p, 1, 5000), 1) << "got " << got.size() << " bytes of replies";
    const ssize_t n = ::recv(slow.theirs.get(), buf.data(), buf.size(), 0);
    ASSERT_GT(n, 0);
    got.insert(got.end(), buf.begin(), buf.begin() + n);
  }
  for (int i = 0; i < 16; ++i) ASSERT_EQ(got[static_cast<size_t>(i) * 64 * 1024], i + 1) << "reply " << i;
  EXPECT_EQ(a.requests.load(), 16);
}

// Why a connection whose peer asked once for a reply of `reply_bytes`, and
// read none of it, was ended.
std::string ended_after_one_unread_reply(size_t reply_bytes, std::chrono::milliseconds deadline) {
  Loop loop;
  Pair slow;
  Replier a(loop, reply_bytes, deadline);
  loop.on_loop([&] {
    a.conn.adopt(std::move(slow.ours));
    return 0;
  });
  const auto ask = frame("reply please");
  if (::send(slow.theirs.get(), ask.data(), ask.size(), 0) != static_cast<ssize_t>(ask.size())) return "no request";
  if (!test::wait_until([&] { return !loop.on_loop([&] { return a.conn.connected(); }); }, 10s))
    return "still connected";
  std::lock_guard lock(a.mutex);
  return a.ended;
}

TEST(PeerConnection, APeerThatLetsRepliesWaitPastTheDeadlineIsDropped) {
  const std::string why = ended_after_one_unread_reply(1000 * 1000, 300ms);
  EXPECT_NE(why.find("did not read what it was sent within 300 ms"), std::string::npos) << why;
}

TEST(PeerConnection, AReplyPastWhatMayWaitEndsTheConnection) {
  const std::string why = ended_after_one_unread_reply(PeerConnection::kMaxQueuedBytes + (1U << 20U), 10s);
  EXPECT_NE(why.find("does not read what it is sent"), std::string::npos) << why;
}

}  // namespace
}  // namespace sriovd
