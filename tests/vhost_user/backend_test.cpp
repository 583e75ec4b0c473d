// The vhost-user back-end against a hand-written front-end: well-formed
// messages get their replies; each malformed one ends only that connection,
// counted and logged, and the next front-end is served.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <future>
#include <optional>
#include <thread>

#include "sriovd/util/error.hpp"
#include "sriovd/util/unix_socket.hpp"
#include "sriovd/vhost_user/backend.hpp"
#include "sriovd/vhost_user/protocol.hpp"
#include "sriovd/virtio/net.hpp"
#include "vhost_user/harness.hpp"
#include "support/process.hpp"
#include "support/temp_dir.hpp"

namespace sriovd::vhost_user {
namespace {

// A packet port with nowhere to send: the protocol is what is under test.
class NullPort : public test::EventPort {
 public:
  NullPort() : EventPort("null0", 2) {}
};

class Frontend {
 public:
  explicit Frontend(const std::string& path) : fd_(test::connect_frontend(path)) {}
  void send(uint32_t request, const void* payload, uint32_t size, std::vector<int> fds = {},
            uint32_t flags = kVersion) {
    Header h{request, flags, size};
    std::vector<uint8_t> bytes(sizeof h + size);
    std::memcpy(bytes.data(), &h, sizeof h);
    if (size) std::memcpy(bytes.data() + sizeof h, payload, size);
    const iovec iov{bytes.data(), bytes.size()};
    ASSERT_EQ(send_with_fds(fd_.get(), {&iov, 1}, fds), static_cast<ssize_t>(bytes.size()));
  }
  // The u64 reply to `request`; nullopt when the back-end hung up instead.
  std::optional<uint64_t> reply_u64() {
    Header h{};
    if (::recv(fd_.get(), &h, sizeof h, MSG_WAITALL) != sizeof h) return std::nullopt;
    uint64_t v = 0;
    if (h.size != sizeof v || ::recv(fd_.get(), &v, sizeof v, MSG_WAITALL) != sizeof v) return std::nullopt;
    return v;
  }
  // Any reply's payload; nullopt when the back-end hung up instead.
  std::optional<std::vector<uint8_t>> reply_bytes() {
    Header h{};
    if (::recv(fd_.get(), &h, sizeof h, MSG_WAITALL) != sizeof h) return std::nullopt;
    std::vector<uint8_t> v(h.size);
    if (h.size && ::recv(fd_.get(), v.data(), v.size(), MSG_WAITALL) != static_cast<ssize_t>(v.size()))
      return std::nullopt;
    return v;
  }
  // A header alone, claiming `size` payload bytes.
  void send_header(uint32_t request, uint32_t size) {
    Header h{request, kVersion, size};
    ASSERT_EQ(::send(fd_.get(), &h, sizeof h, MSG_NOSIGNAL), static_cast<ssize_t>(sizeof h));
  }
  [[nodiscard]] int fd() const { return fd_.get(); }
  bool closed_by_peer() {
    char c;
    const ssize_t n = ::recv(fd_.get(), &c, 1, 0);
    return n == 0 || (n < 0 && errno == ECONNRESET);
  }

 private:
  UniqueFd fd_;
};

class BackendTest : public ::testing::Test {
 protected:
  static virtio::NetConfig config() {
    virtio::NetConfig nc;
    nc.name = "vnet-test";
    return nc;
  }
  template <typename F>
  auto on_io(F fn) {
    return vu.on_io(fn);
  }

  sriovd::test::TempDir dir;
  test::BackendRunner vu{config(), std::make_unique<NullPort>(), dir.file("vnet.sock")};
  Backend* backend = &vu.backend;
  virtio::NetDevice* device = &vu.device;
};

TEST_F(BackendTest, AnswersFeatureQueries) {
  Frontend f(dir.file("vnet.sock"));
  f.send(kGetFeatures, nullptr, 0);
  auto features = f.reply_u64();
  ASSERT_TRUE(features);
  EXPECT_TRUE(*features & virtio::kVersion1);
  EXPECT_TRUE(*features & kFeatureProtocolFeatures);
  f.send(kGetProtocolFeatures, nullptr, 0);
  auto proto = f.reply_u64();
  ASSERT_TRUE(proto);
  EXPECT_TRUE(*proto & kProtoReplyAck);
  const uint64_t ack = kProtoReplyAck;
  f.send(kSetProtocolFeatures, &ack, sizeof ack);
  const uint64_t features_set = virtio::kVersion1 | kFeatureProtocolFeatures;
  f.send(kSetFeatures, &features_set, sizeof features_set, {}, kVersion | kFlagNeedReply);
  EXPECT_EQ(f.reply_u64(), 0U) << "REPLY_ACK: success";
  f.send(kGetQueueNum, nullptr, 0);
  EXPECT_EQ(f.reply_u64(), 1U);
}

// GET_CONFIG reads the virtio-net config space (§5.1.4) the device keeps;
// SET_CONFIG is refused (nothing there is writable) without ending anything.
TEST_F(BackendTest, GetConfigReadsTheNetConfigSpace) {
  Frontend f(dir.file("vnet.sock"));
  const uint64_t proto = kProtoReplyAck | kProtoConfig;
  f.send(kSetProtocolFeatures, &proto, sizeof proto);
  uint8_t req[12 + 12] = {};
  const uint32_t size = 12;
  std::memcpy(req + 4, &size, 4);
  f.send(kGetConfig, req, sizeof req);
  auto reply = f.reply_bytes();
  ASSERT_TRUE(reply);
  ASSERT_EQ(reply->size(), sizeof req);
  uint16_t status = 0, pairs = 0, mtu = 0;
  std::memcpy(&status, reply->data() + 12 + 6, 2);
  std::memcpy(&pairs, reply->data() + 12 + 8, 2);
  std::memcpy(&mtu, reply->data() + 12 + 10, 2);
  EXPECT_EQ(status, 1);  // VIRTIO_NET_S_LINK_UP
  EXPECT_EQ(pairs, 1);
  EXPECT_EQ(mtu, 1500);
  f.send(kSetConfig, req, sizeof req, {}, kVersion | kFlagNeedReply);
  EXPECT_EQ(f.reply_u64(), 1U);  // refused: virtio-net takes no write
  uint8_t past[12 + 8] = {};
  const uint32_t at = 8, eight = 8;  // 8 bytes from offset 8: past the 12 of the configuration
  std::memcpy(past, &at, 4);
  std::memcpy(past + 4, &eight, 4);
  f.send(kSetConfig, past, sizeof past, {}, kVersion | kFlagNeedReply);
  EXPECT_EQ(f.reply_u64(), 1U);  // refused, not fatal
  f.send(kGetQueueNum, nullptr, 0);
  EXPECT_EQ(f.reply_u64(), 1U);  // the connection goes on
}

// CONFIGURE_MEM_SLOTS: regions come and go one at a time.
TEST_F(BackendTest, MemorySlotsAreAddedAndRemoved) {
  Frontend f(dir.file("vnet.sock"));
  const uint64_t proto = kProtoReplyAck | kProtoConfigureMemSlots;
  f.send(kSetProtocolFeatures, &proto, sizeof proto);
  f.send(kGetMaxMemSlots, nullptr, 0);
  EXPECT_EQ(f.reply_u64(), kMaxRegions);
  UniqueFd mem(::memfd_create("slot", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(mem.get(), 2 << 20), 0);
  SingleMemRegion a{0, {0x0, 1 << 20, 0x7f0000000000, 0}};
  SingleMemRegion b{0, {0x100000, 1 << 20, 0x7f0000100000, 1 << 20}};
  f.send(kAddMemReg, &a, sizeof a, {mem.get()}, kVersion | kFlagNeedReply);
  EXPECT_EQ(f.reply_u64(), 0U);
  f.send(kAddMemReg, &b, sizeof b, {mem.get()}, kVersion | kFlagNeedReply);
  EXPECT_EQ(f.reply_u64(), 0U);
  f.send(kRemMemReg, &a, sizeof a, {}, kVersion | kFlagNeedReply);
  EXPECT_EQ(f.reply_u64(), 0U);
  // Removing it twice is a protocol error: that connection ends.
  f.send(kRemMemReg, &a, sizeof a, {}, kVersion | kFlagNeedReply);
  EXPECT_TRUE(f.closed_by_peer());
  const std::string last = on_io([&] { return backend->stats().last_error; });
  EXPECT_NE(last.find("REM_MEM_REG of a region that was not added"), std::string::npos) << last;
}

struct Malformed {
  const char* name;
  std::function<void(Frontend&)> send;
  const char* reason;
};

TEST_F(BackendTest, EachMalformedMessageEndsOnlyItsConnection) {
  UniqueFd e1(::eventfd(0, 0)), e2(::eventfd(0, 0));
  const uint64_t u64 = 0;
  const std::vector<Malformed> cases = {
      {"short payload", [&](Frontend& f) { f.send(kSetFeatures, &u64, 4); }, "SET_FEATURES (2) with 4 payload bytes"},
      {"fds where none belong", [&](Frontend& f) { f.send(kSetFeatures, &u64, 8, {e1.get()}); },
       "SET_FEATURES (2) with 1 fds, expected 0"},
      {"two kick fds",
       [&](Frontend& f) {
         f.send(kSetVringKick, &u64, 8, {e1.get(), e2.get()});
       },
       "SET_VRING_KICK (12) with 2 fds"},
      {"unknown request", [&](Frontend& f) { f.send(99, nullptr, 0); }, "request unknown (99) is not served"},
      {"bad version", [&](Frontend& f) { f.send(kGetFeatures, nullptr, 0, {}, 0x2); }, "unsupported protocol version"},
      {"huge payload", [&](Frontend& f) { f.send_header(kSetMemTable, 5000); }, "a payload of 5000 bytes"},
      {"queue out of range",
       [&](Frontend& f) {
         VringState s{7, 256};
         f.send(kSetVringNum, &s, sizeof s);
       },
       "for queue 7 of 2"},
      {"memory table with no fds",
       [&](Frontend& f) {
         MemTable t{};
         t.nregions = 1;
         t.regions[0] = {0, 4096, 0, 0};
         f.send(kSetMemTable, &t, 8 + sizeof(MemRegion));
       },
       "SET_MEM_TABLE with 0 fds for 1 regions"},
      {"inflight buffer for no queue",
       [&](Frontend& f) {
         InflightDesc d{0, 0, 0, 256, 0};
         f.send(kGetInflightFd, &d, sizeof d);
       },
       "GET_INFLIGHT_FD for 0 queues"},
      {"inflight buffer too small",
       [&](Frontend& f) {
         UniqueFd m(::memfd_create("inflight", MFD_CLOEXEC));
         ASSERT_EQ(::ftruncate(m.get(), 4096), 0);
         InflightDesc d{4096, 0, 2, 256, 0};
         f.send(kSetInflightFd, &d, sizeof d, {m.get()});
       },
       "SET_INFLIGHT_FD of 4096 bytes at offset 0: 2 queues of 256 need"},
      {"inflight buffer without its fd",
       [&](Frontend& f) {
         InflightDesc d{1 << 20, 0, 2, 256, 0};
         f.send(kSetInflightFd, &d, sizeof d);
       },
       "SET_INFLIGHT_FD (32) with 0 fds, expected 1"},
      {"ring outside memory",
       [&](Frontend& f) {
         VringAddr a{0, 0, 0x1000, 0x2000, 0x3000, 0};
         f.send(kSetVringAddr, &a, sizeof a);
       },
       "a ring outside the shared memory"},
      // Issue 11, item 1: offset + size wrapping made one mapped page claim 2^63 bytes.
      {"memory region whose offset and size wrap",
       [&](Frontend& f) {
         UniqueFd m(::memfd_create("wrap", MFD_CLOEXEC));
         ASSERT_EQ(::ftruncate(m.get(), 4096), 0);
         MemTable t{};
         t.nregions = 1;
         t.regions[0] = {0, 1ULL << 63U, 0x7f0000000000, (1ULL << 63U) + 0x1000};
         f.send(kSetMemTable, &t, 8 + sizeof(MemRegion), {m.get()});
       },
       "wraps"},
      // Item 4: a region larger than its memfd took SIGBUS on the first touch.
      {"memory region larger than its memfd",
       [&](Frontend& f) {
         UniqueFd m(::memfd_create("small", MFD_CLOEXEC));
         ASSERT_EQ(::ftruncate(m.get(), 4096), 0);
         SingleMemRegion r{0, {0, 1 << 20, 0x7f0000000000, 0}};
         f.send(kAddMemReg, &r, sizeof r, {m.get()});
       },
       "its file has only 0x1000 bytes"},
      // Item 7: kick and call fds must be eventfds.
      {"kick fd that is a pipe",
       [&](Frontend& f) {
         int p[2];
         ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
         UniqueFd r(p[0]), w(p[1]);
         const uint64_t q0 = 0;
         f.send(kSetVringKick, &q0, sizeof q0, {r.get()});
       },
       "SET_VRING_KICK (12) for queue 0: the fd is not an eventfd"},
      // Item 13: IOTLB messages only when ACCESS_PLATFORM was negotiated.
      {"IOTLB update without ACCESS_PLATFORM",
       [&](Frontend& f) {
         IotlbMsg m{0x1000, 0x1000, 0x7f0000000000, 3, kIotlbUpdate, {}};
         f.send(kIotlbMsg, &m, sizeof m);
       },
       "IOTLB_MSG without VIRTIO_F_ACCESS_PLATFORM"},
      // Item 12: the fds of one message are capped over all its parts.
      {"fds trickled with a message a byte at a time",
       [&](Frontend& f) {
         Header h{kSetFeatures, kVersion, 8};
         uint8_t bytes[sizeof h + 8] = {};
         std::memcpy(bytes, &h, sizeof h);
         std::vector<int> eight(8, e1.get());
         for (size_t i = 0; i < 3; ++i) {
           const iovec iov{bytes + i, 1};
           if (send_with_fds(f.fd(), {&iov, 1}, eight) != 1) break;  // refused by now
         }
       },
       "more than 8 fds with one message"},
  };
  uint64_t errors = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    {
      Frontend f(dir.file("vnet.sock"));
      c.send(f);
      EXPECT_TRUE(f.closed_by_peer());
    }
    ++errors;
    EXPECT_EQ(on_io([&] { return backend->stats().protocol_errors; }), errors);
    const std::string last = on_io([&] { return backend->stats().last_error; });
    EXPECT_NE(last.find(c.reason), std::string::npos) << last;
    // The next front-end is served as if nothing happened.
    Frontend next(dir.file("vnet.sock"));
    next.send(kGetFeatures, nullptr, 0);
    EXPECT_TRUE(next.reply_u64().has_value());
  }
}

// Item 7: one blocking eventfd given as the RX and the TX kick of a pair
// woke the worker for both; the first read drained it and the second
// blocked forever, and the next stop() joined that worker. Kick and call
// fds are made non-blocking where they enter (the flag is on the shared
// open file, so the front-end's own copy shows it).
TEST_F(BackendTest, KickAndCallFdsAreMadeNonBlocking) {
  Frontend f(dir.file("vnet.sock"));
  UniqueFd kick(::eventfd(0, EFD_CLOEXEC)), call(::eventfd(0, EFD_CLOEXEC));
  ASSERT_FALSE(::fcntl(kick.get(), F_GETFL) & O_NONBLOCK);
  const uint64_t proto = kProtoReplyAck;
  f.send(kSetProtocolFeatures, &proto, sizeof proto);
  for (uint64_t q : {0ULL, 1ULL}) {
    f.send(kSetVringKick, &q, sizeof q, {kick.get()}, kVersion | kFlagNeedReply);
    EXPECT_EQ(f.reply_u64(), 0U);
  }
  const uint64_t q0 = 0;
  f.send(kSetVringCall, &q0, sizeof q0, {call.get()}, kVersion | kFlagNeedReply);
  EXPECT_EQ(f.reply_u64(), 0U);
  EXPECT_TRUE(::fcntl(kick.get(), F_GETFL) & O_NONBLOCK);
  EXPECT_TRUE(::fcntl(call.get(), F_GETFL) & O_NONBLOCK);
}

// The queues' call routes are the back-end's (the transport's, as
// virtio-pci's MSI-X routes are): one per queue, masked without a call fd,
// unmasked with its sink when SET_VRING_CALL gives one, masked and without
// a sink again when the front-end leaves, gone with the back-end.
TEST(BackendCalls, EachQueueHasACallRouteOwnedByTheBackEnd) {
  sriovd::test::TempDir dir;
  irq::EngineOptions eo;
  eo.relay_threads = 0;
  irq::Engine engine(eo);
  virtio::NetConfig nc;
  nc.name = "vnet-test";
  virtio::NetDevice device(nc, engine, std::make_unique<NullPort>());
  EXPECT_TRUE(engine.list().empty()) << "the device model makes no routes of its own";
  asio::io_context io;
  auto work = asio::make_work_guard(io);
  auto backend = std::make_unique<Backend>(io, dir.file("vnet.sock"), device, engine);
  std::thread runner([&] { io.run(); });
  auto routes = engine.list();
  EXPECT_EQ(routes.size(), device.num_queues());
  for (const auto& r : routes) {
    EXPECT_EQ(r.device, "vnet-test");
    EXPECT_TRUE(r.masked);
    EXPECT_FALSE(r.has_sink);
  }
  {
    Frontend f(dir.file("vnet.sock"));
    UniqueFd call(::eventfd(0, EFD_CLOEXEC));
    const uint64_t proto = kProtoReplyAck;
    f.send(kSetProtocolFeatures, &proto, sizeof proto);
    const uint64_t q1 = 1;
    f.send(kSetVringCall, &q1, sizeof q1, {call.get()}, kVersion | kFlagNeedReply);
    EXPECT_EQ(f.reply_u64(), 0U);
    for (const auto& r : engine.list()) {
      EXPECT_EQ(r.has_sink, r.vector == 1) << "queue " << r.vector;
      EXPECT_EQ(r.masked, r.vector != 1) << "queue " << r.vector;
    }
  }
  // The front-end left: no sinks, masked (asked on the io thread, which
  // handles the hang-up).
  EXPECT_TRUE(sriovd::test::wait_until(
      [&] {
        std::promise<bool> done;
        asio::post(io, [&] {
          bool clean = !backend->connected();
          for (const auto& r : engine.list()) clean = clean && !r.has_sink && r.masked;
          done.set_value(clean);
        });
        return done.get_future().get();
      },
      std::chrono::seconds(2)));
  io.stop();
  runner.join();
  backend.reset();
  EXPECT_TRUE(engine.list().empty()) << "the back-end's routes go with it";
}

// Item 16: vhost-user sockets checked no peer credentials. A front-end
// whose uid is not on the device's list is refused at once; a reload's new
// list applies to the next one.
TEST(BackendPeers, AFrontEndNotOnTheAllowListIsRefused) {
  sriovd::test::TempDir dir;
  virtio::NetConfig nc;
  nc.name = "vnet-peers";
  test::BackendRunner vu(nc, std::make_unique<NullPort>(), dir.file("p.sock"), Backend::Mode::server,
                         {::getuid() + 4242});
  {
    Frontend f(dir.file("p.sock"));
    EXPECT_TRUE(f.closed_by_peer());
  }
  EXPECT_EQ(vu.on_io([&] { return vu.backend.stats().refused_peers; }), 1U);
  EXPECT_EQ(vu.on_io([&] { return vu.backend.stats().connections; }), 0U);
  vu.on_io([&] {
    vu.backend.set_allowed_uids({::getuid()});
    return 0;
  });
  Frontend f(dir.file("p.sock"));
  f.send(kGetFeatures, nullptr, 0);
  EXPECT_TRUE(f.reply_u64().has_value());
}

// Item 12: every SET_VRING_ERR fd used to be kept for the connection's
// life; now one per queue, the last one given.
TEST_F(BackendTest, VringErrorFdsDoNotPileUp) {
  auto open_fds = [] {
    size_t n = 0;
    for (int fd = 0; fd < 4096; ++fd)
      if (::fcntl(fd, F_GETFD) >= 0) ++n;
    return n;
  };
  Frontend f(dir.file("vnet.sock"));
  const uint64_t proto = kProtoReplyAck;
  f.send(kSetProtocolFeatures, &proto, sizeof proto);
  f.send(kGetFeatures, nullptr, 0);  // a round trip: the connection is accepted
  ASSERT_TRUE(f.reply_u64().has_value());
  const size_t before = open_fds();
  for (int i = 0; i < 200; ++i) {
    UniqueFd err(::eventfd(0, EFD_CLOEXEC));
    const uint64_t q = i % 2;
    f.send(kSetVringErr, &q, sizeof q, {err.get()}, kVersion | kFlagNeedReply);
    ASSERT_EQ(f.reply_u64(), 0U);
  }
  EXPECT_LE(open_fds(), before + 2) << "the back-end keeps every SET_VRING_ERR fd";
}

// Client mode: the front-end listens (as QEMU with server=on does), sriovd
// connects, and connects again after the front-end dropped it.
// A port that records which of its queues the device steers traffic to.
class SteerPort : public test::EventPort {
 public:
  SteerPort() : EventPort("steer0", 2) {}
  void set_active_queues(unsigned n) override { active.store(n); }
  std::atomic<unsigned> active{0};
};

// Over vhost-user the VMM's control queue is its own: the pairs in use are
// those whose RX vring it enabled, and only their port queues get traffic
// (a flow steered to a pair nobody reads would be lost).
TEST(BackendSteering, PortQueuesFollowTheEnabledRxVrings) {
  sriovd::test::TempDir dir;
  virtio::NetConfig nc;
  nc.name = "vnet-mq";
  nc.queue_pairs = 2;
  auto owned = std::make_unique<SteerPort>();
  SteerPort& port = *owned;
  test::BackendRunner vu{nc, std::move(owned), dir.file("mq.sock")};
  EXPECT_EQ(port.active.load(), 1U) << "nothing enabled yet: the first pair";
  Frontend f(dir.file("mq.sock"));
  const uint64_t ack = kProtoReplyAck;
  f.send(kSetProtocolFeatures, &ack, sizeof ack);
  const uint64_t features = virtio::kVersion1 | kFeatureProtocolFeatures | virtio::kNetMq;
  f.send(kSetFeatures, &features, sizeof features, {}, kVersion | kFlagNeedReply);
  ASSERT_EQ(f.reply_u64(), 0U);
  auto enable = [&](uint32_t q, uint32_t on) {
    const VringState s{q, on};
    f.send(kSetVringEnable, &s, sizeof s, {}, kVersion | kFlagNeedReply);
    ASSERT_EQ(f.reply_u64(), 0U) << "vring " << q;
  };
  enable(0, 1);
  enable(1, 1);
  EXPECT_EQ(port.active.load(), 1U);
  enable(3, 1);
  EXPECT_EQ(port.active.load(), 1U) << "a TX vring alone adds no receiving pair";
  enable(2, 1);
  EXPECT_EQ(port.active.load(), 2U);
  enable(2, 0);
  EXPECT_EQ(port.active.load(), 1U);
}

// Item 9: a VMM that listens with a full backlog and never accepts. The
// connect was blocking, on the control thread (here: in the constructor);
// now it fails at once, is tried again every second, and the io thread
// stays free.
TEST(BackendClientMode, AListenerThatNeverAcceptsDoesNotBlock) {
  sriovd::test::TempDir dir;
  const std::string path = dir.file("stuck.sock");
  UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strcpy(a.sun_path, path.c_str());
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(listener.get(), 0), 0);
  // Fill the backlog with connections nobody accepts.
  std::vector<UniqueFd> fillers;
  for (int i = 0; i < 8; ++i) {
    try {
      fillers.push_back(connect_unix(path, "filler", true));
    } catch (const SystemError&) {
      break;  // full
    }
  }
  ASSERT_LT(fillers.size(), 8U) << "the backlog never filled";
  virtio::NetConfig nc;
  nc.name = "client-stuck";
  auto made = std::async(std::launch::async, [&] {
    return std::make_unique<test::BackendRunner>(nc, std::make_unique<NullPort>(), path, Backend::Mode::client);
  });
  ASSERT_EQ(made.wait_for(std::chrono::seconds(10)), std::future_status::ready)
      << "connecting to a listener that never accepts blocked";
  auto vu = made.get();
  EXPECT_EQ(vu->on_io([&] { return vu->backend.stats().connections; }), 0U);
  fillers.clear();
}

TEST(BackendClientMode, ConnectsRetriesAndReconnects) {
  sriovd::test::TempDir dir;
  const std::string path = dir.file("vmm.sock");
  virtio::NetConfig nc;
  nc.name = "client-test";
  // sriovd starts first: nothing listens yet, so it keeps trying.
  test::BackendRunner vu(nc, std::make_unique<NullPort>(), path, Backend::Mode::client);
  UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strcpy(a.sun_path, path.c_str());
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(listener.get(), 1), 0);
  timeval tv{5, 0};
  ::setsockopt(listener.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  for (int round = 0; round < 2; ++round) {
    UniqueFd conn(::accept(listener.get(), nullptr, nullptr));
    ASSERT_TRUE(conn.valid()) << "round " << round << ": sriovd did not connect within 5 s";
    Header h{kGetFeatures, kVersion, 0};
    ASSERT_EQ(::send(conn.get(), &h, sizeof h, MSG_NOSIGNAL), static_cast<ssize_t>(sizeof h));
    Header reply{};
    uint64_t features = 0;
    timeval rtv{2, 0};
    ::setsockopt(conn.get(), SOL_SOCKET, SO_RCVTIMEO, &rtv, sizeof rtv);
    ASSERT_EQ(::recv(conn.get(), &reply, sizeof reply, MSG_WAITALL), static_cast<ssize_t>(sizeof reply));
    ASSERT_EQ(::recv(conn.get(), &features, sizeof features, MSG_WAITALL), static_cast<ssize_t>(sizeof features));
    EXPECT_TRUE(features & virtio::kVersion1);
    // Dropping the connection makes sriovd come back.
  }
}

}  // namespace
}  // namespace sriovd::vhost_user
