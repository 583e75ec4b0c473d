// A back-end handed over to a successor (an upgrade in place): the
// front-end keeps its connection, its memory and its rings; every packet
// it queued goes out once, whether the predecessor or the successor sent
// it; a message it was half-way through sending is read whole by the
// successor; the socket file stays and takes new connections; an
// interrupt owed is delivered. And a handover that does not happen leaves
// the back-end serving as before.
#include <gtest/gtest.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>

#include "sriovd/vhost_user/backend.hpp"
#include "sriovd/vhost_user/protocol.hpp"
#include "support/process.hpp"
#include "support/temp_dir.hpp"
#include "vhost_user/harness.hpp"

namespace sriovd::vhost_user {
namespace {

using namespace std::chrono_literals;

// Records the first payload byte of each packet the device transmits,
// in a list both ports of the test share (the predecessor's and the
// successor's device each own one).
struct Sent {
  std::mutex mutex;
  std::vector<uint8_t> ids;
  size_t size() {
    std::lock_guard lock(mutex);
    return ids.size();
  }
};
class RecordingPort : public test::EventPort {
 public:
  RecordingPort(Sent& sent, std::string name) : EventPort(std::move(name)), sent_(sent) {}
  ssize_t send(unsigned, const iovec* iov, int count) override {
    const auto p = gather(iov, count);
    std::lock_guard lock(sent_.mutex);
    if (p.size() > 12) sent_.ids.push_back(p[12]);
    return static_cast<ssize_t>(p.size());
  }

 private:
  Sent& sent_;
};

constexpr uint64_t kRam = 1 << 20;
constexpr uint16_t kQueue = 64;
constexpr uint64_t kUser = 0x7f0000000000ULL;
constexpr uint64_t kBufs = 0x40000;

class HandoverTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    nc.name = "vnet-handover";
    nc.offloads = false;
    a = std::make_unique<test::BackendRunner>(nc, std::make_unique<RecordingPort>(sent, "a0"), path());
    g = std::make_unique<test::GuestRings>(kRam, kQueue, GetParam());
    sock = test::connect_frontend(path(), 3);
    const uint64_t proto = kProtoReplyAck;
    request(kSetProtocolFeatures, &proto, 8);
    const uint64_t features = virtio::kVersion1 | kFeatureProtocolFeatures | (GetParam() ? virtio::kRingPacked : 0);
    request(kSetFeatures, &features, 8);
    MemTable t{};
    t.nregions = 1;
    t.regions[0] = {0, kRam, kUser, 0};
    request(kSetMemTable, &t, 8 + sizeof(MemRegion), {g->fd.get()});
    for (unsigned q = 0; q < 2; ++q) {
      const auto r = g->addresses(q);
      test::start_vring([this](auto... args) { request(args...); }, q, kQueue,
                        VringAddr{q, 0, kUser + r.desc, kUser + r.device, kUser + r.driver, 0}, 0, kicks[q], calls[q]);
    }
    ASSERT_TRUE(sriovd::test::wait_until([&] { return a->device.running(); }, 3s));
  }
  std::string path() { return dir.file("vnet.sock"); }
  // Why a's back-end refuses to freeze ("" if it froze).
  std::string refusal() {
    return a->on_io([&]() -> std::string {
      try {
        (void)a->backend.freeze_for_handover();
        return "";
      } catch (const HandoverRefused& e) {
        return e.what();
      }
    });
  }
  void request(uint32_t req, const void* payload, uint32_t size, std::vector<int> fds = {}) {
    EXPECT_EQ(test::acked_request(sock.get(), req, payload, size, fds), 0) << request_name(req);
  }
  void transmit(uint8_t n) {
    const uint64_t gpa = kBufs + 0x1000ULL * n;
    std::memset(g->ram + gpa, 0, 12);
    std::memset(g->ram + gpa + 12, n, 60);
    const guest::Buffer buf{gpa, 72, false};
    if (GetParam()) {
      ASSERT_GE(g->tx_packed->add({&buf, 1}), 0);
    } else {
      ASSERT_GE(g->tx_split->add({&buf, 1}), 0);
      g->tx_split->publish();
    }
    const uint64_t one = 1;
    ASSERT_EQ(::write(kicks[1].get(), &one, 8), 8);
  }
  unsigned used = 0;
  bool take_used(unsigned n) {
    uint32_t id = 0, len = 0;
    return sriovd::test::wait_until(
        [&] {
          while (GetParam() ? g->tx_packed->take_used(id, len) : g->tx_split->take_used(id, len)) ++used;
          return used >= n;
        },
        3s);
  }
  // The successor's socket takes a new front-end once this one goes (one
  // front-end at a time).
  void expect_a_new_front_end_served() {
    sock.reset();
    ASSERT_TRUE(sriovd::test::wait_until([&] { return !b->on_io([&] { return b->backend.connected(); }); }, 3s));
    UniqueFd again = test::connect_frontend(path(), 3);
    const uint64_t proto = kProtoReplyAck;
    EXPECT_EQ(test::acked_request(again.get(), kSetProtocolFeatures, &proto, 8, {}), 0);
  }
  // Hands a's back-end over to a new one, through the bytes and fd list
  // an exec would carry, as the daemon does; a is gone after it.
  void hand_over() {
    BackendHandover h = a->on_io([&] { return a->backend.freeze_for_handover(); });
    const std::vector<uint8_t> bytes = h.serialize();
    std::vector<UniqueFd> fds = std::move(h.fds);
    a->on_io([&] {
      a->backend.handed_over();
      return 0;
    });
    a.reset();  // the predecessor's exec: everything of it is gone
    if (remove_socket_before_successor) ::unlink(path().c_str());
    BackendHandover got = BackendHandover::parse(bytes, fds.size(), "the test's handover");
    got.fds = std::move(fds);
    b = std::make_unique<test::BackendRunner>(nc, std::make_unique<RecordingPort>(sent, "b0"), path(), std::move(got));
  }

  bool remove_socket_before_successor = false;
  virtio::NetConfig nc;
  sriovd::test::TempDir dir;
  Sent sent;
  std::unique_ptr<test::BackendRunner> a, b;
  std::unique_ptr<test::GuestRings> g;
  UniqueFd sock;
  UniqueFd kicks[2], calls[2];
};

TEST_P(HandoverTest, TheFrontEndKeepsItsConnectionAndEveryPacketGoesOnce) {
  for (uint8_t n = 1; n <= 5; ++n) transmit(n);
  ASSERT_TRUE(take_used(5));
  // Queued right before the freeze: some go out before it, the rest after.
  for (uint8_t n = 6; n <= 8; ++n) transmit(n);
  // Half a message in flight (GET_FEATURES's header, 6 of 12 bytes): the
  // predecessor has read it; the successor must finish it.
  const Header get{kGetFeatures, kVersion, 0};
  ASSERT_TRUE(sriovd::test::wait_until([&] { return sent.size() >= 5; }, 3s));
  ASSERT_EQ(::send(sock.get(), &get, 6, 0), 6);
  std::this_thread::sleep_for(20ms);
  uint64_t drained = 0;
  (void)::read(calls[1].get(), &drained, 8);
  hand_over();
  ASSERT_EQ(::send(sock.get(), reinterpret_cast<const uint8_t*>(&get) + 6, sizeof get - 6, 0),
            static_cast<ssize_t>(sizeof get - 6));
  Header reply{};
  uint64_t features = 0;
  ASSERT_EQ(::recv(sock.get(), &reply, sizeof reply, MSG_WAITALL), static_cast<ssize_t>(sizeof reply))
      << "the successor answers the message the predecessor had half read";
  ASSERT_EQ(::recv(sock.get(), &features, 8, MSG_WAITALL), 8);
  EXPECT_EQ(reply.request, kGetFeatures);
  EXPECT_NE(features & virtio::kVersion1, 0U);
  // An interrupt the predecessor may have owed is delivered.
  EXPECT_TRUE(sriovd::test::wait_until(
      [&] {
        uint64_t v = 0;
        return ::read(calls[1].get(), &v, 8) == 8;
      },
      3s));
  for (uint8_t n = 9; n <= 12; ++n) transmit(n);
  ASSERT_TRUE(take_used(12));
  ASSERT_TRUE(sriovd::test::wait_until([&] { return sent.size() >= 12; }, 3s));
  std::this_thread::sleep_for(20ms);
  std::vector<uint8_t> ids;
  {
    std::lock_guard lock(sent.mutex);
    ids = sent.ids;
  }
  std::vector<uint8_t> want;
  for (uint8_t n = 1; n <= 12; ++n) want.push_back(n);
  EXPECT_EQ(ids, want) << "each packet once, in order, across the handover";
  EXPECT_TRUE(b->on_io([&] { return b->backend.connected(); }));
  EXPECT_EQ(b->on_io([&] { return b->backend.stats().connections; }), 1U);
  // The socket file is still there and takes a new front-end when this
  // one goes (one front-end at a time).
  struct stat st {};
  ASSERT_EQ(::lstat(path().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  expect_a_new_front_end_served();
}

TEST_P(HandoverTest, AHandoverThatDoesNotHappenLeavesItServing) {
  for (uint8_t n = 1; n <= 3; ++n) transmit(n);
  ASSERT_TRUE(take_used(3));
  BackendHandover h = a->on_io([&] { return a->backend.freeze_for_handover(); });
  EXPECT_FALSE(a->device.running()) << "frozen: the data path waits";
  EXPECT_NE(refusal(), "") << "a second freeze";
  h = BackendHandover{};  // the duplicates it held are closed: the front-end sees nothing of it
  a->on_io([&] {
    a->backend.thaw();
    return 0;
  });
  for (uint8_t n = 4; n <= 6; ++n) transmit(n);
  ASSERT_TRUE(take_used(6));
  const uint64_t proto = kProtoReplyAck;
  request(kSetProtocolFeatures, &proto, 8);
  EXPECT_EQ(sent.size(), 6U);
}

TEST_P(HandoverTest, ALiveMigrationIsNotHandedOver) {
  // VHOST_F_LOG_ALL: the device logs its writes for a migration.
  const uint64_t features =
      virtio::kVersion1 | kFeatureProtocolFeatures | kFeatureLogAll | (GetParam() ? virtio::kRingPacked : 0);
  request(kSetFeatures, &features, 8);
  const std::string why = refusal();
  EXPECT_NE(why.find("migration"), std::string::npos) << why;
  const uint64_t proto = kProtoReplyAck;
  request(kSetProtocolFeatures, &proto, 8);  // still served
}

TEST_P(HandoverTest, ASocketFileGoneMeanwhileIsMadeAnewAndTheConnectionGoesOn) {
  for (uint8_t n = 1; n <= 2; ++n) transmit(n);
  ASSERT_TRUE(take_used(2));
  remove_socket_before_successor = true;
  hand_over();
  for (uint8_t n = 3; n <= 4; ++n) transmit(n);
  ASSERT_TRUE(take_used(4)) << "the front-end's connection outlives its socket file";
  struct stat st {};
  ASSERT_EQ(::lstat(path().c_str(), &st), 0) << "listening anew at the path";
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  expect_a_new_front_end_served();
}

INSTANTIATE_TEST_SUITE_P(Rings, HandoverTest, ::testing::Values(false, true),
                         [](const auto& param_info) { return param_info.param ? "packed" : "split"; });

TEST(BackendHandoverBytes, AnotherVersionOrAnFdPastTheListIsRefusedByName) {
  BackendHandover h;
  h.device = {1, 2, 3};
  h.connection = 0;
  std::vector<uint8_t> bytes = h.serialize();
  EXPECT_NO_THROW((void)BackendHandover::parse(bytes, 1, "x"));
  try {
    (void)BackendHandover::parse(bytes, 0, "vnet0's handover");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("vnet0's handover"), std::string::npos) << e.what();
  }
  bytes[0] = 2;  // version 2
  EXPECT_THROW((void)BackendHandover::parse(bytes, 1, "x"), std::invalid_argument);
  bytes.resize(10);
  EXPECT_THROW((void)BackendHandover::parse(bytes, 1, "x"), std::invalid_argument);
}

}  // namespace
}  // namespace sriovd::vhost_user
