// Inflight I/O tracking (INFLIGHT_SHMFD): the front-end keeps the buffer
// GET_INFLIGHT_FD gave it and hands it to whichever back-end starts next.
// A crash is made exactly: while the device is inside a transmit (a
// buffer taken, not returned), the test copies guest RAM and the inflight
// buffer - what a SIGKILL at that instant would leave - lets the device
// finish, then puts the copies back and connects again. The buffer that
// was in flight must be handed out again first, and nothing twice.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "sriovd/util/peer_mapping.hpp"
#include "sriovd/util/unix_socket.hpp"
#include "sriovd/vhost_user/backend.hpp"
#include "sriovd/vhost_user/protocol.hpp"
#include "sriovd/guest/virtqueue.hpp"
#include "sriovd/virtio/net.hpp"
#include "support/peer_backing.hpp"
#include "support/process.hpp"
#include "support/temp_dir.hpp"
#include "vhost_user/harness.hpp"

namespace sriovd::vhost_user {
namespace {

using namespace std::chrono_literals;

// Records what the device transmits; while held, a transmit waits inside
// send() (the device has the buffer and has not returned it).
class HoldingPort : public test::EventPort {
 public:
  HoldingPort() : EventPort("hold0") {}
  ssize_t send(unsigned, const iovec* iov, int count) override {
    std::unique_lock lock(mutex_);
    ++entered_;
    changed_.notify_all();
    changed_.wait(lock, [&] { return !hold_; });
    // The first payload byte (after the 12-byte header) names the packet.
    size_t skip = 12;
    for (int i = 0; i < count; ++i) {
      if (iov[i].iov_len > skip) {
        sent_.push_back(static_cast<const uint8_t*>(iov[i].iov_base)[skip]);
        break;
      }
      skip -= iov[i].iov_len;
    }
    changed_.notify_all();
    return 72;
  }

  void hold(bool on) {
    std::lock_guard lock(mutex_);
    hold_ = on;
    changed_.notify_all();
  }
  bool wait_entered(unsigned n) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, 3s, [&] { return entered_ >= n; });
  }
  bool wait_sent(size_t n) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, 3s, [&] { return sent_.size() >= n; });
  }
  std::vector<uint8_t> sent() {
    std::lock_guard lock(mutex_);
    return sent_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool hold_ = false;
  unsigned entered_ = 0;
  std::vector<uint8_t> sent_;
};

bool eventually(const std::function<bool()>& f) { return sriovd::test::wait_until(f, 3s); }

constexpr uint64_t kRam = 1 << 20;
constexpr uint16_t kQueue = 64;
constexpr uint64_t kBufs = 0x40000;  // packet buffers, one 4 KiB page each

class InflightFixture : public ::testing::Test {
 protected:
  [[nodiscard]] virtual bool packed() const = 0;
  // What the front-end backs guest RAM with (hugetlb: 2 MiB of it).
  [[nodiscard]] virtual sriovd::test::Backing backing() const { return sriovd::test::Backing::memfd; }
  void SetUp() override {
    UniqueFd ram_fd;
    size_t ram_size = kRam;
    if (backing() != sriovd::test::Backing::memfd) {
      if (backing() == sriovd::test::Backing::hugetlb_memfd || backing() == sriovd::test::Backing::hugetlbfs_file) {
        pages = std::make_unique<sriovd::test::HugePages>(4);
        if (!pages->ok()) GTEST_SKIP() << "no huge pages: " << pages->why();
        ram_size = sriovd::test::kHugePage;
      }
      if (backing() == sriovd::test::Backing::hugetlbfs_file) {
        mount = std::make_unique<sriovd::test::HugetlbfsMount>();
        if (mount->dir().empty()) GTEST_SKIP() << "cannot mount a hugetlbfs (needs root)";
      }
      ram_fd = sriovd::test::make_backing(backing(), ram_size, mount ? mount->dir() : "");
      ASSERT_TRUE(ram_fd.valid()) << sriovd::test::backing_name(backing());
    }
    virtio::NetConfig nc;
    nc.name = "vnet-inflight";
    nc.offloads = false;
    auto p = std::make_unique<HoldingPort>();
    port = p.get();
    vu = std::make_unique<test::BackendRunner>(nc, std::move(p), dir.file("vnet.sock"));
    device = &vu->device;
    backend = &vu->backend;
    g = std::make_unique<test::GuestRings>(ram_size, kQueue, packed(), std::move(ram_fd));
    ram = g->ram;
  }
  void TearDown() override {
    port->hold(false);
    sock.reset();
    vu.reset();
    g.reset();
    if (inflight) ::munmap(inflight, inflight_size);
  }

  // A back-end that ends the connection (hangup_ok) makes the rest of
  // the sequence no-ops instead of failures.
  void send(uint32_t request, const void* payload, uint32_t size, std::vector<int> fds = {}) {
    if (hung_up) return;
    const int64_t status = test::acked_request(sock.get(), request, payload, size, fds);
    if (status < 0 && hangup_ok) {
      hung_up = true;
      return;
    }
    EXPECT_EQ(status, 0) << request_name(request);
  }

  // What QEMU does when a vhost-user back-end (re)starts: the inflight
  // buffer first (asked for once, then always handed back), then the
  // features, memory and rings. `base` is what the front-end believes.
  void connect(uint32_t base) {
    sock = test::connect_frontend(dir.file("vnet.sock"), 3);
    const uint64_t proto = kProtoReplyAck | kProtoInflightShmfd;
    send(kSetProtocolFeatures, &proto, 8);
    if (!inflight_fd) {
      Header reply{};
      InflightDesc got{};
      inflight_fd = test::get_inflight_fd(sock.get(), 2, kQueue, got, reply);
      ASSERT_TRUE(inflight_fd.valid());
      EXPECT_EQ(reply.flags & kFlagReply, kFlagReply);
      EXPECT_EQ(got.num_queues, 2);
      EXPECT_EQ(got.queue_size, kQueue);
      EXPECT_GE(got.mmap_size, 2 * virtio::inflight_queue_bytes(kQueue));
      EXPECT_TRUE(::fcntl(inflight_fd.get(), F_GET_SEALS) & F_SEAL_SHRINK)
          << "the buffer cannot shrink under a mapping";
      inflight_desc = got;
      inflight_size = got.mmap_size;
      inflight = static_cast<uint8_t*>(
          ::mmap(nullptr, inflight_size, PROT_READ | PROT_WRITE, MAP_SHARED, inflight_fd.get(), 0));
      ASSERT_NE(inflight, MAP_FAILED);
    }
    send(kSetInflightFd, &inflight_desc, sizeof inflight_desc, {inflight_fd.get()});
    const uint64_t features = virtio::kVersion1 | kFeatureProtocolFeatures | (packed() ? virtio::kRingPacked : 0);
    send(kSetFeatures, &features, 8);
    MemTable t{};
    t.nregions = 1;
    t.regions[0] = {0, kRam, 0x7f0000000000ULL, 0};
    send(kSetMemTable, &t, 8 + sizeof(MemRegion), {g->fd.get()});
    for (unsigned q = 0; q < 2; ++q) {
      const auto r = g->addresses(q);
      const uint64_t u = 0x7f0000000000ULL;
      test::start_vring([this](auto... a) { send(a...); }, q, kQueue,
                        VringAddr{q, 0, u + r.desc, u + r.device, u + r.driver, 0}, base, kicks[q], calls[q]);
    }
    if (!hangup_ok) {
      ASSERT_TRUE(eventually([&] { return device->running(); }));
    }
  }

  // Packet `n`: a TX buffer whose first payload byte is n. Records the
  // descriptor head (split) in heads[n].
  void transmit(uint8_t n) {
    const uint64_t gpa = kBufs + 0x1000ULL * n;
    std::memset(ram + gpa, 0, 12);
    std::memset(ram + gpa + 12, n, 60);
    const guest::Buffer b{gpa, 72, false};
    if (packed()) {
      ASSERT_GE(g->tx_packed->add({&b, 1}), 0);
    } else {
      const int head = g->tx_split->add({&b, 1});
      ASSERT_GE(head, 0);
      heads[n] = static_cast<uint16_t>(head);
      g->tx_split->publish();
    }
    const uint64_t one = 1;
    ASSERT_EQ(::write(kicks[1].get(), &one, 8), 8);
  }
  // Waits until the driver has taken back exactly n more used TX buffers.
  bool take_used(unsigned n) {
    unsigned got = 0;
    uint32_t id = 0, len = 0;
    eventually([&] {
      while (packed() ? g->tx_packed->take_used(id, len) : g->tx_split->take_used(id, len)) ++got;
      return got >= n;
    });
    std::this_thread::sleep_for(20ms);  // and nothing more comes
    while (packed() ? g->tx_packed->take_used(id, len) : g->tx_split->take_used(id, len)) ++got;
    return got == n;
  }
  std::vector<uint8_t> sent() { return port->sent(); }
  // The spec's split layout: a 16-byte header, then 16 bytes per descriptor
  // whose first byte is the inflight mark.
  // Queue 1 (TX) has the second region.
  static uint8_t* tx_region(uint8_t* buffer) { return buffer + virtio::inflight_queue_bytes(kQueue); }
  static uint8_t& split_mark(uint8_t* buffer, uint16_t head) { return tx_region(buffer)[16 + 16 * head]; }
  static unsigned split_marked(uint8_t* buffer) {
    unsigned n = 0;
    for (uint16_t i = 0; i < kQueue; ++i) n += split_mark(buffer, i) != 0;
    return n;
  }

  std::unique_ptr<sriovd::test::HugePages> pages;
  std::unique_ptr<sriovd::test::HugetlbfsMount> mount;
  sriovd::test::TempDir dir;
  HoldingPort* port = nullptr;
  std::unique_ptr<test::BackendRunner> vu;
  virtio::NetDevice* device = nullptr;
  Backend* backend = nullptr;
  std::unique_ptr<test::GuestRings> g;
  UniqueFd sock, inflight_fd;
  uint8_t* ram = nullptr;  // g's
  uint8_t* inflight = nullptr;
  size_t inflight_size = 0;
  InflightDesc inflight_desc{};
  UniqueFd kicks[2], calls[2];
  bool hangup_ok = false, hung_up = false;
  uint16_t heads[256] = {};
};

class InflightTest : public InflightFixture, public ::testing::WithParamInterface<bool> {
 protected:
  [[nodiscard]] bool packed() const override { return GetParam(); }
};

// Guest RAM on each backing a front-end may use (issue 39, c2).
class GuestRamBackingTest : public InflightFixture, public ::testing::WithParamInterface<sriovd::test::Backing> {
 protected:
  [[nodiscard]] bool packed() const override { return false; }
  [[nodiscard]] sriovd::test::Backing backing() const override { return GetParam(); }
};

TEST_P(InflightTest, BufferInFlightAtACrashIsHandedOutAgainFirst) {
  connect(0);
  port->hold(true);
  transmit(1);
  transmit(2);
  transmit(3);
  ASSERT_TRUE(port->wait_entered(1));
  // The instant of the crash: packet 1 taken and inside the port, 2 and 3
  // still in the ring. This is what the process would leave behind.
  std::vector<uint8_t> ram_copy(ram, ram + kRam);
  std::vector<uint8_t> inflight_copy(inflight, inflight + inflight_size);
  if (!packed()) {
    EXPECT_EQ(split_mark(inflight_copy.data(), heads[1]), 1) << "packet 1's head marked in flight";
    EXPECT_EQ(split_marked(inflight_copy.data()), 1U) << "and nothing else";
  }
  port->hold(false);
  ASSERT_TRUE(port->wait_sent(3));
  EXPECT_EQ(sent(), (std::vector<uint8_t>{1, 2, 3}));
  if (!packed()) {
    ASSERT_TRUE(eventually([&] { return split_marked(inflight) == 0; })) << "returned buffers leave the region";
  }

  // The back-end dies there; the front-end still has its RAM and the
  // inflight buffer as they were, and connects to the next back-end with
  // the base it last knew (nothing, as GET_VRING_BASE never answered).
  sock.reset();
  ASSERT_TRUE(eventually([&] { return !backend->connected(); }));
  std::memcpy(ram, ram_copy.data(), kRam);
  std::memcpy(inflight, inflight_copy.data(), inflight_size);
  connect(0);
  // Packet 1 again (it never completed), then 2 and 3 once each.
  ASSERT_TRUE(port->wait_sent(6));
  EXPECT_EQ(sent(), (std::vector<uint8_t>{1, 2, 3, 1, 2, 3}));
  EXPECT_EQ(device->stats(1).resubmitted.load(), 1U);
  ASSERT_TRUE(take_used(3));
  // And the ring goes on from there.
  transmit(4);
  ASSERT_TRUE(port->wait_sent(7));
  EXPECT_EQ(sent().back(), 4);
  ASSERT_TRUE(take_used(1));
  EXPECT_FALSE(device->broken());
}

// A clean restart (nothing in flight) resubmits nothing and carries on at
// the ring's position, whatever base the front-end sends.
TEST_P(InflightTest, NothingInFlightMeansNothingTwice) {
  connect(0);
  transmit(1);
  transmit(2);
  ASSERT_TRUE(port->wait_sent(2));
  ASSERT_TRUE(take_used(2));
  sock.reset();
  ASSERT_TRUE(eventually([&] { return !backend->connected(); }));
  connect(0);
  transmit(3);
  ASSERT_TRUE(port->wait_sent(3));
  EXPECT_EQ(sent(), (std::vector<uint8_t>{1, 2, 3}));
  EXPECT_EQ(device->stats(1).resubmitted.load(), 0U);
  ASSERT_TRUE(take_used(1));
}

// Issue 11, item 4: the front-end truncates guest RAM under a running
// device. The worker's next look at the ring took SIGBUS and killed the
// daemon; now the device fails (NEEDS_RESET) and the process goes on, and
// the next front-end is served.
TEST_P(InflightTest, GuestRamTruncatedUnderARunningDeviceBreaksOnlyThatDevice) {
  connect(0);
  transmit(1);
  ASSERT_TRUE(port->wait_sent(1));
  ASSERT_EQ(::ftruncate(g->fd.get(), 0), 0);  // from here on the test does not touch `ram` either
  const uint64_t one = 1;
  ASSERT_EQ(::write(kicks[1].get(), &one, 8), 8);
  ASSERT_TRUE(eventually([&] { return device->broken(); })) << "the device did not notice its memory went";
  EXPECT_TRUE(backend->connected());  // a broken device is the front-end's to reset
  sock.reset();
  ASSERT_TRUE(eventually([&] { return !backend->connected(); }));
  EXPECT_FALSE(device->broken()) << "a reset device starts clean";
}

// c2: the same for every backing - a hugetlb file truncated under the
// worker killed the daemon (the handler's 4 KiB patch was refused inside
// the hugetlb mapping).
TEST_P(GuestRamBackingTest, GuestRamTruncatedUnderARunningDeviceBreaksOnlyThatDevice) {
  connect(0);
  transmit(1);
  ASSERT_TRUE(port->wait_sent(1));
  ASSERT_EQ(::ftruncate(g->fd.get(), 0), 0);
  const uint64_t one = 1;
  ASSERT_EQ(::write(kicks[1].get(), &one, 8), 8);
  ASSERT_TRUE(eventually([&] { return device->broken(); })) << "the device did not notice its memory went";
  sock.reset();
  ASSERT_TRUE(eventually([&] { return !backend->connected(); }));
  EXPECT_FALSE(device->broken()) << "a reset device starts clean";
}

INSTANTIATE_TEST_SUITE_P(EveryBacking, GuestRamBackingTest,
                         ::testing::Values(sriovd::test::Backing::memfd, sriovd::test::Backing::hugetlb_memfd,
                                           sriovd::test::Backing::hugetlbfs_file, sriovd::test::Backing::tmpfs_file),
                         [](const auto& p) { return std::string(sriovd::test::backing_name(p.param)); });

// The same for an inflight buffer of the front-end's own that cannot be
// sealed (a memfd made without sealing): truncated under a running device,
// the worker's next mark lands on a zero page instead of a SIGBUS, and the
// session ends at the front-end's next message; the daemon goes on.
TEST_P(InflightTest, AnInflightBufferTruncatedUnderTheDeviceEndsOnlyThatSession) {
  const uint64_t bytes = 2 * virtio::inflight_queue_bytes(kQueue);
  inflight_fd.reset(::memfd_create("unsealable-inflight", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(inflight_fd.get(), static_cast<off_t>(bytes)), 0);
  inflight_desc = InflightDesc{bytes, 0, 2, kQueue, 0};
  connect(0);
  transmit(1);
  ASSERT_TRUE(port->wait_sent(1));
  // Counted from before the truncation: the worker may still be clearing
  // chain 1's mark when the pages go, and that first touch is the fault
  // (the zero page put in its place does not fault again).
  const uint64_t faults = peer_mapping_faults();
  ASSERT_EQ(::ftruncate(inflight_fd.get(), 0), 0);
  transmit(2);  // the worker marks the chain in the buffer that is gone
  ASSERT_TRUE(eventually([&] { return peer_mapping_faults() != faults; })) << "the worker never touched the buffer";
  const int64_t status = test::acked_request(sock.get(), kGetFeatures, nullptr, 0, {});
  (void)status;  // a reply or a hangup: what counts is the connection after it
  ASSERT_TRUE(eventually([&] { return !backend->connected(); })) << "the session went on over a truncated buffer";
  EXPECT_NE(backend->stats().last_error.find("truncated its inflight buffer"), std::string::npos)
      << backend->stats().last_error;
}

// Item 10: a guest that keeps its TX ring full. A driver thread puts every
// buffer back as soon as it is used, so the worker never runs out of work;
// the front-end leaves, and the stop still comes within the deadline (the
// worker's pass has a budget and looks at its stop event between passes):
// the device is stopped, not wedged.
TEST_P(InflightTest, AGuestThatKeepsItsRingFullCannotHoldOffTheStop) {
  connect(0);
  std::atomic<bool> driving{true};
  std::atomic<unsigned> reposted{0};
  std::thread driver([&] {
    // One buffer per descriptor, all posted at once, each re-posted when used.
    for (uint8_t n = 0; n < kQueue; ++n) transmit(n);
    uint32_t id = 0, len = 0;
    while (driving) {
      bool any = false;
      while (packed() ? g->tx_packed->take_used(id, len) : g->tx_split->take_used(id, len)) {
        any = true;
        transmit(static_cast<uint8_t>(reposted++ % kQueue));
      }
      if (!any) std::this_thread::yield();
    }
  });
  ASSERT_TRUE(eventually([&] { return reposted > 4 * kQueue; })) << "the ring never went round";
  sock.reset();  // the front-end goes while its ring is full
  const bool stopped = sriovd::test::wait_until([&] { return !vu->on_io([&] { return backend->connected(); }); }, 10s);
  driving = false;
  driver.join();
  ASSERT_TRUE(stopped);
  EXPECT_FALSE(vu->on_io([&] { return device->wedged() || device->running(); }))
      << "a full ring kept the worker from its stop event";
}

// A worker that does not stop at all (here: stuck in the port's send, which
// no real port does - its fds are non-blocking) costs its device, not the
// control thread: stop() gives up after its deadline, the device is
// wedged and serves no front-end, and once the worker is out the device is
// released and serves again.
TEST_P(InflightTest, AWorkerThatDoesNotStopWedgesItsDeviceNotTheDaemon) {
  connect(0);
  port->hold(true);
  transmit(1);
  ASSERT_TRUE(port->wait_entered(1));
  sock.reset();
  ASSERT_TRUE(sriovd::test::wait_until([&] { return !vu->on_io([&] { return backend->connected(); }); }, 10s))
      << "the control thread waited for the stuck worker";
  EXPECT_TRUE(vu->on_io([&] { return device->wedged() && device->broken(); }));
  // A front-end meanwhile is told why and let go.
  hangup_ok = true;
  hung_up = false;
  connect(0);
  EXPECT_TRUE(hung_up) << "a front-end was served by a wedged device";
  ASSERT_TRUE(sriovd::test::wait_until([&] { return !vu->on_io([&] { return backend->connected(); }); }, 10s));
  EXPECT_NE(vu->on_io([&] { return backend->stats().last_error; }).find("has not stopped"), std::string::npos);
  port->hold(false);  // the worker comes out
  ASSERT_TRUE(port->wait_sent(1));
  // Sent is not yet out: the worker still finishes the chain and exits,
  // and a front-end that comes before that is turned away as above.
  ASSERT_TRUE(sriovd::test::wait_until([&] { return vu->on_io([&] { return device->reap(); }); }, 10s))
      << "the worker did not come out after its frame went";
  hangup_ok = false;
  hung_up = false;
  connect(0);
  EXPECT_FALSE(vu->on_io([&] { return device->wedged(); }));
  EXPECT_TRUE(vu->on_io([&] { return device->running(); }));
}

// Issue 39, item 6: memory is never unmapped under a worker that did not
// stop. A SET_MEM_TABLE (or REM_MEM_REG) while the worker is stuck with a
// frame of guest RAM in hand unmapped that RAM, and the worker's next touch
// was a SEGV (no SIGBUS handler catches that). Now the change is refused,
// the session ends, and the worker finishes over memory still mapped.
TEST_P(InflightTest, NewMemoryWhileAWorkerIsStuckLeavesTheOldMapped) {
  connect(0);
  port->hold(true);
  transmit(1);
  ASSERT_TRUE(port->wait_entered(1));
  UniqueFd other(::memfd_create("other-ram", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(other.get(), kRam), 0);
  MemTable t{};
  t.nregions = 1;
  t.regions[0] = {0, kRam, reinterpret_cast<uint64_t>(ram), 0};
  hangup_ok = true;
  send(kSetMemTable, &t, 8 + sizeof(MemRegion), {other.get()});
  ASSERT_TRUE(sriovd::test::wait_until([&] { return !vu->on_io([&] { return backend->connected(); }); }, 10s));
  EXPECT_NE(
      vu->on_io([&] { return backend->stats().last_error; }).find("SET_MEM_TABLE: the device's worker did not stop"),
      std::string::npos)
      << vu->on_io([&] { return backend->stats().last_error; });
  port->hold(false);  // the worker reads its frame from guest RAM: still mapped
  ASSERT_TRUE(port->wait_sent(1));
  ASSERT_TRUE(sriovd::test::wait_until([&] { return vu->on_io([&] { return device->reap(); }); }, 10s));
}

INSTANTIATE_TEST_SUITE_P(Rings, InflightTest, ::testing::Values(false, true),
                         [](const auto& param_info) { return param_info.param ? "packed" : "split"; });

// Split rings: a crash between publishing the used index and clearing the
// batch's inflight marks must not send the packet again (the spec's "last
// batch" step), and a region that contradicts the ring ends the connection.
class InflightSplitTest : public InflightTest {};

TEST_P(InflightSplitTest, HalfPublishedBatchIsFinishedNotResent) {
  connect(0);
  transmit(1);
  transmit(2);
  ASSERT_TRUE(port->wait_sent(2));
  ASSERT_TRUE(eventually([&] { return split_marked(inflight) == 0; }));
  sock.reset();
  ASSERT_TRUE(eventually([&] { return !backend->connected(); }));
  // As if the back-end died right after the used index went to 2: packet
  // 2's head still marked, the region's used index one behind, that head
  // the last batch.
  split_mark(inflight, heads[2]) = 1;
  const uint16_t one = 1;
  std::memcpy(tx_region(inflight) + 14, &one, 2);       // used_idx
  std::memcpy(tx_region(inflight) + 12, &heads[2], 2);  // last_batch_head
  connect(2);
  transmit(3);
  ASSERT_TRUE(port->wait_sent(3));
  EXPECT_EQ(sent(), (std::vector<uint8_t>{1, 2, 3}));
  EXPECT_EQ(device->stats(1).resubmitted.load(), 0U);
  // The region was read, not started afresh: the batch was finished and
  // the counters of what went before are still there.
  EXPECT_TRUE(eventually([&] {
    uint16_t used_idx = 0;
    std::memcpy(&used_idx, tx_region(inflight) + 14, 2);
    return used_idx == 3;
  }));
  uint64_t counter = 0;
  std::memcpy(&counter, tx_region(inflight) + 16 + 16 * heads[1] + 8, 8);
  EXPECT_NE(counter, 0U);
}

TEST_P(InflightSplitTest, RegionThatContradictsTheRingEndsTheConnection) {
  connect(0);
  transmit(1);
  ASSERT_TRUE(port->wait_sent(1));
  sock.reset();
  ASSERT_TRUE(eventually([&] { return !backend->connected(); }));
  const uint16_t far = 200;                        // the ring's used index is 1: 201 "behind"
  std::memcpy(tx_region(inflight) + 14, &far, 2);  // used_idx
  // Start the queues: the device refuses the region, the connection ends
  // with the reason, and the daemon goes on.
  hangup_ok = true;
  connect(0);
  char c;
  EXPECT_LE(::recv(sock.get(), &c, 1, 0), 0) << "the back-end hangs up";
  ASSERT_TRUE(eventually([&] { return !backend->connected(); }));
  EXPECT_FALSE(device->running());
  const std::string last = vu->on_io([&] { return backend->stats().last_error; });
  EXPECT_NE(last.find("inflight region left by the previous back-end is inconsistent"), std::string::npos) << last;
}

INSTANTIATE_TEST_SUITE_P(Rings, InflightSplitTest, ::testing::Values(false), [](const auto&) { return "split"; });

}  // namespace
}  // namespace sriovd::vhost_user
