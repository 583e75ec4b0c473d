// Live migration over vhost-user ("Migration" in the vhost-user spec): the
// front-end gives a dirty log (SET_LOG_BASE with LOG_SHMFD), turns on
// VHOST_F_LOG_ALL and VHOST_VRING_F_LOG, copies guest RAM while the device
// keeps writing packets into it, copies again every page the log marks,
// stops the rings (GET_VRING_BASE), copies the last marked pages. The test
// does what QEMU does, with traffic flowing into the guest the whole time,
// and then compares the copy with the source: a write the device did not
// log is a page that differs.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include "sriovd/guest/virtqueue.hpp"
#include "sriovd/util/unix_socket.hpp"
#include "sriovd/vhost_user/backend.hpp"
#include "sriovd/vhost_user/protocol.hpp"
#include "sriovd/virtio/net.hpp"
#include "support/process.hpp"
#include "support/temp_dir.hpp"
#include "vhost_user/harness.hpp"

namespace sriovd::vhost_user {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kRam = 1 << 20;
constexpr uint64_t kUser = 0x7f0000000000ULL;  // where the "front-end" has guest RAM
constexpr uint16_t kQueue = 64;
constexpr uint64_t kBufs = 0x40000;  // RX buffers, one 4 KiB page each
using sriovd::test::stream_byte;
using sriovd::test::StreamPort;
constexpr uint32_t kPayload = StreamPort::kPayload;
constexpr uint64_t kLogBytes = 4096;

bool eventually(const std::function<bool()>& f) { return sriovd::test::wait_until(f, 5s); }

class MigrationTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    virtio::NetConfig nc;
    nc.name = "vnet-migrate";
    nc.offloads = false;
    auto p = std::make_unique<StreamPort>();
    port = p.get();
    vu = std::make_unique<test::BackendRunner>(nc, std::move(p), dir.file("vnet.sock"));
    g = std::make_unique<test::GuestRings>(kRam, kQueue, packed());
    ram = g->ram;
    log_fd.reset(::memfd_create("log", MFD_CLOEXEC));
    ASSERT_EQ(::ftruncate(log_fd.get(), kLogBytes), 0);
    log = static_cast<uint8_t*>(::mmap(nullptr, kLogBytes, PROT_READ | PROT_WRITE, MAP_SHARED, log_fd.get(), 0));
  }
  void TearDown() override {
    stop_guest();
    port->flow(false);
    sock.reset();
    vu.reset();
    g.reset();
    ::munmap(log, kLogBytes);
  }
  bool packed() const { return GetParam(); }
  virtio::RingAddresses rings(unsigned q) const { return g->addresses(q); }

  void send(uint32_t request, const void* payload, uint32_t size, std::vector<int> fds = {}) {
    EXPECT_EQ(test::acked_request(sock.get(), request, payload, size, fds), 0) << request_name(request);
  }
  // SET_LOG_BASE is answered with an empty reply, which QEMU waits for.
  bool set_log_base(uint64_t size, uint64_t offset, int fd) {
    const LogDesc d{size, offset};
    Header h{kSetLogBase, kVersion, sizeof d};
    const iovec iov[2] = {{&h, sizeof h}, {const_cast<LogDesc*>(&d), sizeof d}};
    const int fds[] = {fd};
    if (send_with_fds(sock.get(), iov, fds) != static_cast<ssize_t>(sizeof h + sizeof d)) return false;
    Header r{};
    if (::recv(sock.get(), &r, sizeof r, MSG_WAITALL) != static_cast<ssize_t>(sizeof r)) return false;
    EXPECT_EQ(r.request, kSetLogBase);
    EXPECT_EQ(r.flags & kFlagReply, kFlagReply);
    EXPECT_EQ(r.size, 0U);
    return true;
  }
  uint64_t get_u64(uint32_t request) {
    Header h{request, kVersion, 0};
    EXPECT_EQ(::send(sock.get(), &h, sizeof h, MSG_NOSIGNAL), static_cast<ssize_t>(sizeof h));
    struct {
      Header h;
      uint64_t v;
    } __attribute__((packed)) r{};
    EXPECT_EQ(::recv(sock.get(), &r, sizeof r, MSG_WAITALL), static_cast<ssize_t>(sizeof r));
    return r.v;
  }
  uint32_t get_vring_base(unsigned q) {
    VringState s{q, 0};
    Header h{kGetVringBase, kVersion, sizeof s};
    const iovec iov[2] = {{&h, sizeof h}, {&s, sizeof s}};
    EXPECT_EQ(send_with_fds(sock.get(), iov, {}), static_cast<ssize_t>(sizeof h + sizeof s));
    struct {
      Header h;
      VringState s;
    } __attribute__((packed)) r{};
    EXPECT_EQ(::recv(sock.get(), &r, sizeof r, MSG_WAITALL), static_cast<ssize_t>(sizeof r));
    return r.s.num;
  }
  void set_features(bool log_all) {
    const uint64_t f = virtio::kVersion1 | kFeatureProtocolFeatures | (packed() ? virtio::kRingPacked : 0) |
                       (log_all ? kFeatureLogAll : 0);
    send(kSetFeatures, &f, 8);
  }
  VringAddr vring_addr(unsigned q, bool log_flag) const {
    const virtio::RingAddresses r = rings(q);
    return {q, log_flag ? kVringFlagLog : 0, kUser + r.desc, kUser + r.device, kUser + r.driver, r.device};
  }
  void set_vring_addr(unsigned q, bool log_flag) {
    const VringAddr a = vring_addr(q, log_flag);
    send(kSetVringAddr, &a, sizeof a);
  }

  // QEMU's start of a device: features, memory, rings, fds, enable.
  void connect(uint64_t proto = kProtoReplyAck | kProtoLogShmfd | kProtoRarp, bool log_all = false,
               bool wait_running = true) {
    sock = test::connect_frontend(dir.file(socket_name), 3);
    if (use_inflight) proto |= kProtoInflightShmfd;
    send(kSetProtocolFeatures, &proto, 8);
    if (use_inflight) give_inflight();
    set_features(log_all);
    MemTable t{};
    t.nregions = 1;
    t.regions[0] = {0, kRam, kUser, 0};
    send(kSetMemTable, &t, 8 + sizeof(MemRegion), {g->fd.get()});
    for (unsigned q = 0; q < 2; ++q)
      test::start_vring([this](auto... a) { send(a...); }, q, kQueue, vring_addr(q, log_all), bases[q], kicks[q],
                        calls[q]);
    if (wait_running) {
      ASSERT_TRUE(eventually([&] { return vu->device.running(); }));
    }
  }

  // INFLIGHT_SHMFD as a front-end that keeps the buffer does it: asked for
  // once, then handed to every back-end (the destination's too).
  void give_inflight() {
    if (!inflight_fd) {
      Header reply{};
      inflight_fd = test::get_inflight_fd(sock.get(), 2, kQueue, inflight_desc, reply);
      ASSERT_TRUE(inflight_fd.valid());
    }
    send(kSetInflightFd, &inflight_desc, sizeof inflight_desc, {inflight_fd.get()});
  }

  // The guest: keeps kQueue RX buffers posted, takes each packet back,
  // checks it is the next of the stream and posts the buffer again.
  void post(uint64_t gpa) {
    const guest::Buffer b{gpa, 2048, true};
    const int id = packed() ? g->rx_packed->add({&b, 1}) : g->rx_split->add({&b, 1});
    ASSERT_GE(id, 0);
    buffer_of[static_cast<uint32_t>(id)] = gpa;
    if (!packed()) g->rx_split->publish();
  }
  // Each packet must be the stream's next: a later one is a loss (gaps),
  // an earlier one, a repeat or a wrong byte is corrupt.
  void start_guest() {
    for (uint16_t i = 0; i < kQueue; ++i) post(kBufs + 0x1000ULL * i);
    resume_guest();
  }
  void resume_guest() {
    guest_stop.store(false);
    kick(0);
    guest = std::thread([this] {
      uint32_t id = 0, len = 0;
      while (!guest_stop.load()) {
        bool any = false;
        while (packed() ? g->rx_packed->take_used(id, len) : g->rx_split->take_used(id, len)) {
          any = true;
          const uint64_t gpa = buffer_of.at(id);
          uint32_t seq = 0;
          std::memcpy(&seq, ram + gpa + 12, 4);
          bool good = len == 12 + kPayload && (received.load() == 0 || seq > last_seq);
          for (uint32_t i = 4; good && i < kPayload; i += 97) good = ram[gpa + 12 + i] == stream_byte(seq, i);
          if (!good) corrupt.fetch_add(1);
          if (good && received.load() > 0) gaps.fetch_add(seq - last_seq - 1);
          last_seq = seq;
          received.fetch_add(1);
          post(gpa);
        }
        if (any) kick(0);
        std::this_thread::sleep_for(50us);
      }
    });
  }
  void stop_guest() {
    guest_stop.store(true);
    if (guest.joinable()) guest.join();
  }
  void kick(unsigned q) {
    const uint64_t one = 1;
    (void)::write(kicks[q].get(), &one, 8);
  }
  bool packets_flow(uint32_t more) {
    const uint32_t from = received.load();
    return eventually([&] { return received.load() >= from + more; });
  }

  // One round of the copy: every page marked since the last one, taken
  // from the log (cleared as QEMU does, with an atomic exchange) and
  // copied to the destination.
  unsigned sync_round() {
    unsigned pages = 0;
    for (uint64_t byte = 0; byte < kLogBytes; ++byte) {
      const uint8_t bits = std::atomic_ref<uint8_t>(log[byte]).exchange(0);
      for (unsigned b = 0; b < 8; ++b) {
        if (!(bits & (1U << b))) continue;
        const uint64_t page = byte * 8 + b;
        if (page * 4096 >= kRam) continue;
        std::memcpy(dest.data() + page * 4096, ram + page * 4096, 4096);
        ++pages;
      }
    }
    return pages;
  }
  unsigned log_bits() const {
    unsigned n = 0;
    for (uint64_t byte = 0; byte < kLogBytes; ++byte) n += static_cast<unsigned>(__builtin_popcount(log[byte]));
    return n;
  }

  sriovd::test::TempDir dir;
  StreamPort* port = nullptr;
  std::unique_ptr<test::BackendRunner> vu;
  std::unique_ptr<test::GuestRings> g;
  UniqueFd log_fd, sock;
  uint8_t* ram = nullptr;  // g's
  uint8_t* log = nullptr;
  std::vector<uint8_t> dest;
  UniqueFd kicks[2], calls[2];
  std::map<uint32_t, uint64_t> buffer_of;
  std::thread guest;
  std::atomic<bool> guest_stop{false};
  std::atomic<uint32_t> received{0}, corrupt{0}, gaps{0};
  uint32_t last_seq = 0;  // the guest thread's
  std::string socket_name = "vnet.sock";
  uint32_t bases[2] = {0, 0};  // what SET_VRING_BASE sends
  bool use_inflight = false;
  UniqueFd inflight_fd;
  InflightDesc inflight_desc{};

  // The whole of it, as QEMU does it: the source logs while the stream
  // flows, the VM stops (the guest, then GET_VRING_BASE), the destination
  // - another back-end, the guest's memory as the copy left it - gets a new
  // front-end with the bases the source returned, and the guest goes on.
  void migrate_and_go_on() {
    connect();
    start_guest();
    port->flow(true);
    ASSERT_TRUE(packets_flow(200));
    ASSERT_TRUE(set_log_base(kLogBytes, 0, log_fd.get()));
    set_features(true);
    set_vring_addr(0, true);
    set_vring_addr(1, true);
    ASSERT_TRUE(packets_flow(200));
    stop_guest();
    port->flow(false);
    bases[0] = get_vring_base(0);
    bases[1] = get_vring_base(1);
    EXPECT_FALSE(vu->device.running());
    const uint32_t before = received.load();
    const uint32_t generated = port->generated();
    // The destination host: its own sriovd, device and wire.
    auto source = std::move(vu);
    virtio::NetConfig nc;
    nc.name = "vnet-dest";
    nc.offloads = false;
    auto p = std::make_unique<StreamPort>();
    port = p.get();
    port->start_at(generated);
    socket_name = "vnet-dest.sock";
    vu = std::make_unique<test::BackendRunner>(nc, std::move(p), dir.file(socket_name));
    connect();
    resume_guest();
    port->flow(true);
    ASSERT_TRUE(packets_flow(300)) << "the destination's ring goes on from the source's bases";
    stop_guest();
    EXPECT_EQ(corrupt.load(), 0U) << "no repeat, nothing out of order, every byte as sent";
    EXPECT_LE(gaps.load(), 1U) << "at most the packet the source had in hand is lost";
    EXPECT_GT(received.load(), before + 300);
    EXPECT_EQ(vu->device.stats().queues[0].resubmitted, 0U) << "a clean stop leaves nothing in flight";
    source.reset();
  }
};

TEST_P(MigrationTest, TheDestinationGoesOnFromTheBasesTheSourceReturned) { migrate_and_go_on(); }

TEST_P(MigrationTest, TheDestinationGoesOnFromTheBasesTheSourceReturnedWithInflightBuffers) {
  use_inflight = true;
  migrate_and_go_on();
}

TEST_P(MigrationTest, TheBackEndOffersLoggingAndTheAnnouncement) {
  sock = test::connect_frontend(dir.file("vnet.sock"), 3);
  EXPECT_TRUE(get_u64(kGetFeatures) & kFeatureLogAll) << "without it QEMU refuses to migrate the VM";
  EXPECT_EQ(get_u64(kGetProtocolFeatures) & (kProtoLogShmfd | kProtoRarp), kProtoLogShmfd | kProtoRarp);
  EXPECT_TRUE(vu->device.offered_features() & virtio::kNetGuestAnnounce) << "the guest can announce itself";
}

// The whole copy, as QEMU makes it, with packets written into the guest
// from before logging starts until the rings stop.
TEST_P(MigrationTest, EveryPageTheDeviceWritesDuringTheCopyReachesTheDestination) {
  connect();
  start_guest();
  port->flow(true);
  ASSERT_TRUE(packets_flow(200));
  EXPECT_FALSE(vu->backend.logging());

  // Migration starts: the log, then logging on (features, then each ring).
  ASSERT_TRUE(set_log_base(kLogBytes, 0, log_fd.get()));
  set_features(true);
  set_vring_addr(0, true);
  set_vring_addr(1, true);
  ASSERT_TRUE(eventually([&] { return vu->device.running(); }));
  EXPECT_TRUE(vu->backend.logging());
  // The bulk copy, while the device writes on.
  dest.assign(ram, ram + kRam);
  for (int round = 0; round < 6; ++round) {
    ASSERT_TRUE(packets_flow(100)) << "round " << round;
    sync_round();
  }
  // The guest stops (the VM is paused), then the rings (GET_VRING_BASE),
  // then the last round of the log.
  stop_guest();
  port->flow(false);
  const uint32_t base0 = get_vring_base(0);
  (void)get_vring_base(1);
  EXPECT_FALSE(vu->device.running());
  sync_round();

  EXPECT_EQ(corrupt.load(), 0U) << "the guest saw the stream in order";
  unsigned differ = 0;
  for (uint64_t page = kBufs / 4096; page < (kBufs / 4096) + kQueue; ++page)
    if (std::memcmp(dest.data() + page * 4096, ram + page * 4096, 4096) != 0) ++differ;
  EXPECT_EQ(differ, 0U) << "RX buffer pages written during the copy and never logged";
  if (!packed()) {
    // The used ring (flags, index, elements, avail_event): the device's
    // bytes only (the avail ring on the same page is the guest's, which
    // the hypervisor logs, not the device).
    const virtio::RingAddresses r = rings(0);
    const uint64_t used_bytes = virtio::split_layout(kQueue).device_bytes;
    EXPECT_EQ(std::memcmp(dest.data() + r.device, ram + r.device, used_bytes), 0) << "the used ring";
    uint16_t used_idx = 0;
    std::memcpy(&used_idx, ram + r.device + 2, 2);
    EXPECT_EQ(static_cast<uint16_t>(base0), used_idx) << "stopped with nothing in flight: avail taken = used";
  }
  EXPECT_EQ(vu->backend.log_missed(), 0U);
  EXPECT_EQ(vu->backend.stats().log_bases, 1U);
}

TEST_P(MigrationTest, WithoutLogAllNothingIsLoggedAndWithItOffAgainNothingMore) {
  connect();
  ASSERT_TRUE(set_log_base(kLogBytes, 0, log_fd.get()));
  start_guest();
  port->flow(true);
  ASSERT_TRUE(packets_flow(200));
  EXPECT_EQ(log_bits(), 0U) << "a log given is not a log in use: LOG_ALL turns it on";
  set_features(true);
  set_vring_addr(0, true);
  ASSERT_TRUE(packets_flow(200));
  EXPECT_GT(log_bits(), 0U);
  // The migration is cancelled: logging off (features, rings), the log
  // cleared by the front-end; nothing is marked from then on.
  set_features(false);
  set_vring_addr(0, false);
  set_vring_addr(1, false);
  ASSERT_TRUE(eventually([&] { return vu->device.running(); }));
  EXPECT_FALSE(vu->backend.logging());
  std::memset(log, 0, kLogBytes);
  ASSERT_TRUE(packets_flow(200));
  EXPECT_EQ(log_bits(), 0U);
}

// QEMU starting a device in the middle of a migration (a back-end that
// reconnects) sends LOG_ALL before SET_LOG_BASE: until the log is there
// the device must not write, or the write is lost to the destination.
TEST_P(MigrationTest, LoggingAskedForBeforeTheLogArrivesHoldsTheDeviceUntilItDoes) {
  connect(kProtoReplyAck | kProtoLogShmfd | kProtoRarp, /*log_all=*/true, /*wait_running=*/false);
  start_guest();
  port->flow(true);
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(vu->device.running());
  EXPECT_EQ(received.load(), 0U);
  ASSERT_TRUE(set_log_base(kLogBytes, 0, log_fd.get()));
  ASSERT_TRUE(eventually([&] { return vu->device.running(); }));
  ASSERT_TRUE(packets_flow(100));
  EXPECT_GT(log_bits(), 0U);
}

// Each refusal ends that connection (and names the request); the daemon,
// the device and the socket stay for the next front-end.
TEST_P(MigrationTest, ALogTheBackEndCannotUseEndsTheConnectionNotTheDaemon) {
  struct Case {
    const char* name;
    uint64_t proto;
    uint64_t size;
    uint64_t offset;
    bool small_fd;
    const char* expect;
  } cases[] = {
      {"without LOG_SHMFD", kProtoReplyAck, kLogBytes, 0, false, "LOG_SHMFD"},
      {"empty", kProtoReplyAck | kProtoLogShmfd, 0, 0, false, "a log is 1 to"},
      {"past the fd's end", kProtoReplyAck | kProtoLogShmfd, kLogBytes, 4096, false, "SET_LOG_BASE of 4096 bytes"},
      {"too small for guest memory", kProtoReplyAck | kProtoLogShmfd, 8, 0, false, "covers guest addresses below"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    connect(c.proto, /*log_all=*/true, /*wait_running=*/false);
    const uint64_t before = vu->backend.stats().protocol_errors;
    (void)set_log_base(c.size, c.offset, log_fd.get());
    ASSERT_TRUE(eventually([&] { return !vu->backend.connected(); }));
    EXPECT_EQ(vu->backend.stats().protocol_errors, before + 1);
    EXPECT_NE(vu->backend.stats().last_error.find(c.expect), std::string::npos) << vu->backend.stats().last_error;
    EXPECT_FALSE(vu->backend.logging());
    sock.reset();
  }
  // And a front-end after them migrates as any other.
  connect();
  ASSERT_TRUE(set_log_base(kLogBytes, 0, log_fd.get()));
  set_features(true);
  start_guest();
  port->flow(true);
  ASSERT_TRUE(packets_flow(50));
  EXPECT_TRUE(vu->backend.logging());
}

// SET_LOG_FD: an eventfd the device signals once logged writes are
// published (a front-end may wait on it instead of polling the log). Not
// an eventfd: refused, the connection ends.
TEST_P(MigrationTest, TheLogFdIsSignalledWhenLoggedWritesArePublished) {
  connect();
  UniqueFd efd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  send(kSetLogFd, nullptr, 0, {efd.get()});
  ASSERT_TRUE(set_log_base(kLogBytes, 0, log_fd.get()));
  start_guest();
  port->flow(true);
  ASSERT_TRUE(packets_flow(100));
  uint64_t n = 0;
  EXPECT_EQ(::read(efd.get(), &n, sizeof n), -1) << "no logging yet, no signal";
  set_features(true);
  set_vring_addr(0, true);
  ASSERT_TRUE(packets_flow(100));
  ASSERT_EQ(::read(efd.get(), &n, sizeof n), static_cast<ssize_t>(sizeof n));
  EXPECT_GT(n, 0U);
  stop_guest();
  port->flow(false);
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  UniqueFd r(p[0]), w(p[1]);
  const Header h{kSetLogFd, kVersion, 0};
  const iovec iov[1] = {{const_cast<Header*>(&h), sizeof h}};
  const int fds[] = {r.get()};
  ASSERT_EQ(send_with_fds(sock.get(), iov, fds), static_cast<ssize_t>(sizeof h));
  ASSERT_TRUE(eventually([&] { return !vu->backend.connected(); }));
  EXPECT_NE(vu->backend.stats().last_error.find("SET_LOG_FD"), std::string::npos) << vu->backend.stats().last_error;
}

// SEND_RARP on the destination: a RARP for the guest's MAC leaves through
// the port (RFC 903: broadcast, ethertype 0x8035, request reverse, the
// MAC as sender and target).
TEST_P(MigrationTest, SendRarpAnnouncesTheGuestOnTheWire) {
  connect();
  const uint8_t mac[8] = {0x52, 0x54, 0x00, 0x12, 0x34, 0x56, 0, 0};
  send(kSendRarp, mac, 8);
  ASSERT_TRUE(eventually([&] { return !port->sent().empty(); }));
  const std::vector<uint8_t> f = port->sent().front();
  ASSERT_EQ(f.size(), 12U + 60U);
  const uint8_t* e = f.data() + 12;
  const std::vector<uint8_t> want = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x52, 0x54, 0x00, 0x12, 0x34, 0x56, 0x80, 0x35,
                                     0x00, 0x01, 0x08, 0x00, 6,    4,    0x00, 0x03, 0x52, 0x54, 0x00, 0x12, 0x34, 0x56,
                                     0,    0,    0,    0,    0x52, 0x54, 0x00, 0x12, 0x34, 0x56, 0,    0,    0,    0};
  EXPECT_EQ(std::vector<uint8_t>(e, e + want.size()), want);
  EXPECT_EQ(vu->backend.stats().rarps, 1U);
  // Not negotiated: the request is refused, the connection ends.
  sock.reset();
  ASSERT_TRUE(eventually([&] { return !vu->backend.connected(); }));
  connect(kProtoReplyAck);
  const Header h{kSendRarp, kVersion, 8};
  const iovec iov[2] = {{const_cast<Header*>(&h), sizeof h}, {const_cast<uint8_t*>(mac), 8}};
  ASSERT_EQ(send_with_fds(sock.get(), iov, {}), static_cast<ssize_t>(sizeof h + 8));
  ASSERT_TRUE(eventually([&] { return !vu->backend.connected(); }));
  EXPECT_NE(vu->backend.stats().last_error.find("RARP"), std::string::npos);
  EXPECT_EQ(port->sent().size(), 1U);
}

// Issue 39, c4: a RARP leaves only for the device's own MAC - here, a
// device given none, the first one the front-end announced - and a
// front-end that announces others in a loop gets none sent, a counter, and
// a handful of log lines a second, not one each.
TEST_P(MigrationTest, SendRarpForAnotherMacIsRefusedAndLogsAreLimited) {
  std::ostringstream lines;
  const auto previous = spdlog::default_logger();
  spdlog::set_default_logger(
      std::make_shared<spdlog::logger>("capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(lines)));
  connect();
  const uint8_t own[8] = {0x52, 0x54, 0x00, 0x12, 0x34, 0x56, 0, 0};
  send(kSendRarp, own, 8);
  ASSERT_TRUE(eventually([&] { return port->sent().size() == 1; }));
  uint8_t other[8] = {0x52, 0x54, 0x00, 0x99, 0x00, 0x00, 0, 0};
  const auto began = std::chrono::steady_clock::now();
  for (int i = 0; i < 500; ++i) {
    other[5] = static_cast<uint8_t>(i);
    send(kSendRarp, other, 8);
  }
  const uint8_t group[8] = {0x01, 0x00, 0x5e, 0x00, 0x00, 0x01, 0, 0};
  send(kSendRarp, group, 8);
  send(kSendRarp, own, 8);  // its own again: sent
  ASSERT_TRUE(eventually([&] { return port->sent().size() == 2; }));
  EXPECT_TRUE(vu->backend.connected()) << "a refused RARP is no reason to end the session";
  EXPECT_EQ(vu->backend.stats().rarps, 2U);
  EXPECT_EQ(vu->backend.stats().rarps_refused, 501U);
  spdlog::default_logger()->flush();
  spdlog::set_default_logger(previous);
  // At most kBurst lines in each second the flood lasted (begun seconds count whole).
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - began);
  const std::string text = lines.str();
  size_t n = 0;
  for (size_t at = text.find("SEND_RARP"); at != std::string::npos; at = text.find("SEND_RARP", at + 1)) ++n;
  EXPECT_LE(n, (static_cast<size_t>(seconds.count()) + 2) * LogLimit::kBurst) << "a log line per RARP asked for";
  EXPECT_NE(text.find("refused: not the device's MAC"), std::string::npos) << text.size() << " bytes: " << text;
}

// A device configured with a MAC announces that one only.
TEST_P(MigrationTest, SendRarpForADeviceWithAMacTakesOnlyThatMac) {
  vu.reset();
  virtio::NetConfig nc;
  nc.name = "vnet-migrate";
  nc.offloads = false;
  nc.mac = MacAddress{{0x02, 0x00, 0x00, 0x00, 0x00, 0x07}};
  auto p = std::make_unique<StreamPort>();
  port = p.get();
  vu = std::make_unique<test::BackendRunner>(nc, std::move(p), dir.file("vnet.sock"));
  connect();
  const uint8_t qemus[8] = {0x52, 0x54, 0x00, 0x12, 0x34, 0x56, 0, 0};
  send(kSendRarp, qemus, 8);
  const uint8_t own[8] = {0x02, 0x00, 0x00, 0x00, 0x00, 0x07, 0, 0};
  send(kSendRarp, own, 8);
  ASSERT_TRUE(eventually([&] { return port->sent().size() == 1; }));
  const std::vector<uint8_t> f = port->sent().front();
  EXPECT_EQ(std::vector<uint8_t>(f.begin() + 12 + 6, f.begin() + 12 + 12), std::vector<uint8_t>(own, own + 6))
      << "the RARP's source is the device's MAC";
  EXPECT_EQ(vu->backend.stats().rarps, 1U);
  EXPECT_EQ(vu->backend.stats().rarps_refused, 1U);
}

INSTANTIATE_TEST_SUITE_P(Rings, MigrationTest, ::testing::Values(false, true),
                         [](const auto& p) { return p.param ? "packed" : "split"; });

}  // namespace
}  // namespace sriovd::vhost_user
