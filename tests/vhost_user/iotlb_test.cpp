// VIRTIO_F_ACCESS_PLATFORM over vhost-user: every address the driver
// writes is an IOVA. The back-end translates through the device IOTLB the
// front-end fills (IOTLB_MSG UPDATE/INVALIDATE) and asks for what it lacks
// with a MISS on the back-end channel; a stalled ring resumes once the
// answer comes. Here the test plays QEMU with a vIOMMU, byte for byte.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "sriovd/util/unix_socket.hpp"
#include "sriovd/vhost_user/backend.hpp"
#include "sriovd/vhost_user/protocol.hpp"
#include "sriovd/guest/virtqueue.hpp"
#include "sriovd/virtio/iotlb.hpp"
#include "sriovd/guest/virtio_net_driver.hpp"
#include "sriovd/virtio/net.hpp"
#include "vhost_user/harness.hpp"
#include "support/temp_dir.hpp"
#include "support/process.hpp"

namespace sriovd::vhost_user {
namespace {

using namespace std::chrono_literals;

// Records what the device transmits.
class RecordingPort : public test::EventPort {
 public:
  RecordingPort() : EventPort("rec0") {}
  ssize_t send(unsigned, const iovec* iov, int count) override {
    auto p = gather(iov, count);
    std::lock_guard lock(mutex_);
    sent_.push_back(std::move(p));
    return static_cast<ssize_t>(sent_.back().size());
  }
  size_t count() {
    std::lock_guard lock(mutex_);
    return sent_.size();
  }
  std::vector<uint8_t> last() {
    std::lock_guard lock(mutex_);
    return sent_.empty() ? std::vector<uint8_t>{} : sent_.back();
  }

 private:
  std::mutex mutex_;
  std::vector<std::vector<uint8_t>> sent_;
};

bool wait_for(const std::function<bool()>& f) { return sriovd::test::wait_until(f, 2s); }

class IotlbTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kUaddr = 0x7f0000000000ULL;  // the front-end's address of its RAM
  static constexpr uint64_t kRingIova = 0x100000;
  static constexpr uint64_t kBufIova = 0x200000;
  static constexpr uint64_t kBufOffset = 0x20000;  // in the RAM fd
  static constexpr uint16_t kQueue = 64;

  void SetUp() override {
    virtio::NetConfig nc;
    nc.name = "vnet-iommu";
    nc.access_platform = true;
    nc.offloads = false;
    auto p = std::make_unique<RecordingPort>();
    port = p.get();
    vu = std::make_unique<test::BackendRunner>(nc, std::move(p), dir.file("vnet.sock"));
    device = &vu->device;
    ram_fd.reset(::memfd_create("ram", MFD_CLOEXEC));
    ASSERT_EQ(::ftruncate(ram_fd.get(), 1 << 20), 0);
    ram = static_cast<uint8_t*>(::mmap(nullptr, 1 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, ram_fd.get(), 0));
    sock = test::connect_frontend(dir.file("vnet.sock"));
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    backend_channel.reset(sv[0]);
    UniqueFd theirs(sv[1]);
    timeval tv{2, 0};
    ::setsockopt(backend_channel.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);

    const uint64_t proto = kProtoReplyAck | kProtoBackendReq;
    send(kSetProtocolFeatures, &proto, 8);
    const uint64_t features = virtio::kVersion1 | virtio::kAccessPlatform | kFeatureProtocolFeatures;
    send(kSetFeatures, &features, 8);
    send(kSetBackendReqFd, nullptr, 0, {theirs.get()});
    MemTable t{};
    t.nregions = 1;
    t.regions[0] = {0, 1 << 20, kUaddr, 0};
    send(kSetMemTable, &t, 8 + sizeof(MemRegion), {ram_fd.get()});
    // The rings' IOVAs are known before the queues start, as QEMU does.
    iotlb(kIotlbUpdate, kRingIova, 0x10000, kUaddr, 3);
    rx = std::make_unique<guest::SplitDriver>(ram, kRingIova, kQueue);
    tx = std::make_unique<guest::SplitDriver>(ram + 0x4000, kRingIova + 0x4000, kQueue);
    for (unsigned q = 0; q < 2; ++q) {
      const auto r = (q == 0 ? rx : tx)->addresses();
      test::start_vring([this](auto... a) { send(a...); }, q, kQueue, VringAddr{q, 0, r.desc, r.device, r.driver, 0}, 0,
                        kicks[q], calls[q]);
    }
    ASSERT_TRUE(wait_for([&] { return device->running(); }));
  }
  void TearDown() override {
    sock.reset();
    vu.reset();
    ::munmap(ram, 1 << 20);
  }
  // Sends a message with NEED_REPLY and checks its ack (0).
  void send(uint32_t request, const void* payload, uint32_t size, std::vector<int> fds = {}) {
    EXPECT_EQ(test::acked_request(sock.get(), request, payload, size, fds), 0) << request_name(request);
  }
  void iotlb(uint8_t type, uint64_t iova, uint64_t size, uint64_t uaddr, uint8_t perm) {
    IotlbMsg m{iova, size, uaddr, perm, type, {}};
    send(kIotlbMsg, &m, sizeof m);
  }
  // A TX packet in a buffer at IOVA kBufIova (RAM offset kBufOffset).
  void transmit(uint8_t fill) {
    std::memset(ram + kBufOffset, 0, 12);
    std::memset(ram + kBufOffset + 12, fill, 60);
    const guest::Buffer b{kBufIova, 72, false};
    ASSERT_GE(tx->add({&b, 1}), 0);
    tx->publish();
    const uint64_t one = 1;
    ASSERT_EQ(::write(kicks[1].get(), &one, 8), 8);
  }
  // The next MISS on the back-end channel.
  bool miss(uint64_t& iova, uint8_t& perm) {
    Header h{};
    IotlbMsg m{};
    if (::recv(backend_channel.get(), &h, sizeof h, MSG_WAITALL) != sizeof h) return false;
    if (h.request != kBackendIotlbMsg || h.size != sizeof m) return false;
    if (::recv(backend_channel.get(), &m, sizeof m, MSG_WAITALL) != sizeof m) return false;
    iova = m.iova;
    perm = m.perm;
    return m.type == kIotlbMiss;
  }

  sriovd::test::TempDir dir;
  RecordingPort* port = nullptr;
  std::unique_ptr<test::BackendRunner> vu;
  virtio::NetDevice* device = nullptr;
  UniqueFd ram_fd, sock, backend_channel;
  uint8_t* ram = nullptr;
  std::unique_ptr<guest::SplitDriver> rx, tx;
  UniqueFd kicks[2], calls[2];
};

TEST_F(IotlbTest, MissIsAskedForAndTheRingResumesWhenAnswered) {
  transmit(0x11);
  uint64_t iova = 0;
  uint8_t perm = 0;
  ASSERT_TRUE(miss(iova, perm));
  EXPECT_EQ(iova, kBufIova);
  EXPECT_EQ(perm, virtio::kIotlbRead);  // the device reads a TX buffer
  EXPECT_EQ(port->count(), 0U);         // stalled, not dropped, not broken
  EXPECT_FALSE(device->broken());
  iotlb(kIotlbUpdate, kBufIova, 0x1000, kUaddr + kBufOffset, virtio::kIotlbRead);
  ASSERT_TRUE(wait_for([&] { return port->count() == 1; }));
  const auto p = port->last();
  ASSERT_EQ(p.size(), 72U);
  EXPECT_EQ(p[12], 0x11);
  uint32_t id = 0, len = 0;
  ASSERT_TRUE(wait_for([&] { return tx->take_used(id, len); }));
}

TEST_F(IotlbTest, InvalidationTakesTheTranslationAway) {
  iotlb(kIotlbUpdate, kBufIova, 0x1000, kUaddr + kBufOffset, virtio::kIotlbRead);
  transmit(0x22);
  ASSERT_TRUE(wait_for([&] { return port->count() == 1; }));
  iotlb(kIotlbInvalidate, kBufIova, 0x1000, 0, 0);
  transmit(0x33);
  uint64_t iova = 0;
  uint8_t perm = 0;
  ASSERT_TRUE(miss(iova, perm));
  EXPECT_EQ(iova, kBufIova);
  EXPECT_EQ(port->count(), 1U);
  iotlb(kIotlbUpdate, kBufIova, 0x1000, kUaddr + kBufOffset, virtio::kIotlbRead);
  ASSERT_TRUE(wait_for([&] { return port->count() == 2; }));
  EXPECT_EQ(port->last()[12], 0x33);
}

// A translation the front-end gave for reading only does not let the
// device write: a device-writable buffer there misses (asks for write).
TEST_F(IotlbTest, PermissionsAreChecked) {
  virtio::Iotlb t;
  t.update({0x1000, 0x1000, 0x5000, virtio::kIotlbRead});
  t.publish();
  uint64_t u = 0;
  EXPECT_TRUE(t.lookup(0x1800, 16, false, u));
  EXPECT_EQ(u, 0x5800U);
  EXPECT_FALSE(t.lookup(0x1800, 16, true, u));
  EXPECT_FALSE(t.lookup(0x1ff8, 16, false, u));  // runs past the entry
  // Two entries that follow each other in both spaces make one range.
  t.update({0x2000, 0x1000, 0x6000, virtio::kIotlbRead});
  t.publish();
  EXPECT_TRUE(t.lookup(0x1ff8, 16, false, u));
  EXPECT_EQ(u, 0x5ff8U);
  t.update({0x3000, 0x1000, 0x9000, virtio::kIotlbRead});  // not contiguous in the front-end's space
  t.publish();
  EXPECT_FALSE(t.lookup(0x2ff8, 16, false, u));
  // A miss is asked for where translation stops, not where the buffer starts.
  EXPECT_EQ(t.first_gap(0x2ff8, 16, false), 0x3008U);  // all translated, only not contiguous: no gap
  EXPECT_EQ(t.first_gap(0x3ff8, 16, false), 0x4000U);
  EXPECT_EQ(t.first_gap(0x1800, 16, true), 0x1800U);   // read-only: a write needs this page
  EXPECT_EQ(t.first_gap(0x1800, 16, false), 0x1810U);  // fully translated
  t.invalidate(0x1000, 0x1000);
  t.publish();
  EXPECT_FALSE(t.lookup(0x1800, 16, false, u));
  EXPECT_TRUE(t.lookup(0x2800, 16, false, u));
  EXPECT_EQ(t.size(), 2U);
}

TEST_F(IotlbTest, MalformedIotlbMessageEndsTheConnection) {
  IotlbMsg m{0x1000, 0, 0, 3, kIotlbUpdate, {}};  // size 0
  Header h{kIotlbMsg, kVersion, sizeof m};
  std::vector<uint8_t> bytes(sizeof h + sizeof m);
  std::memcpy(bytes.data(), &h, sizeof h);
  std::memcpy(bytes.data() + sizeof h, &m, sizeof m);
  ASSERT_EQ(::send(sock.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
  char c;
  EXPECT_LE(::recv(sock.get(), &c, 1, 0), 0);
  EXPECT_FALSE(device->running());
}

// Hands every transmitted packet back as received: the front-end sees
// its own frames come back through RX.
class LoopPort : public test::EventPort {
 public:
  LoopPort() : EventPort("loop0") {}
  ssize_t send(unsigned, const iovec* iov, int count) override {
    auto p = gather(iov, count);
    std::lock_guard lock(mutex_);
    const auto n = static_cast<ssize_t>(p.size());
    packets_.push_back(std::move(p));
    signal();
    return n;
  }
  ssize_t recv(unsigned, uint8_t* buf, size_t size) override {
    std::lock_guard lock(mutex_);
    if (packets_.empty()) {
      drain();
      return -1;
    }
    auto p = std::move(packets_.front());
    packets_.pop_front();
    const size_t n = std::min(size, p.size());
    std::memcpy(buf, p.data(), n);
    return static_cast<ssize_t>(n);
  }

 private:
  std::mutex mutex_;
  std::deque<std::vector<uint8_t>> packets_;
};

// sriovd-guest's vhost-user front-end as a guest behind an IOMMU: it gives
// IOVAs (not where its RAM is), and the only way the device learns them is
// the misses it asks and the updates the front-end's emulated IOMMU sends.
TEST(IotlbFrontEnd, GuestBehindAnEmulatedIommuMovesTrafficThroughMissesAndUpdates) {
  for (const bool packed : {false, true}) {
    SCOPED_TRACE(packed ? "packed" : "split");
    sriovd::test::TempDir dir;
    virtio::NetConfig nc;
    nc.name = "vnet-viommu";
    nc.access_platform = true;
    test::BackendRunner vu(nc, std::make_unique<LoopPort>(), dir.file("vnet.sock"));
    virtio::NetDevice& device = vu.device;
    {
      guest::VirtioNetDriverOptions opts;
      opts.queue_size = 64;
      opts.packed = packed;
      opts.iommu = true;
      guest::VirtioNetDriver driver(dir.file("vnet.sock"), opts);
      ASSERT_NO_THROW(driver.bring_up());
      EXPECT_TRUE(driver.features() & virtio::kAccessPlatform);
      EXPECT_EQ(driver.packed(), packed);
      std::vector<uint8_t> out(70000);
      for (unsigned i = 0; i < 40; ++i) {
        std::vector<uint8_t> frame(12 + 60 + i * 37, static_cast<uint8_t>(i + 1));
        std::memset(frame.data(), 0, 12);
        ASSERT_TRUE(driver.send(frame.data(), frame.size())) << "frame " << i;
        const size_t got = driver.receive(out.data(), out.size(), 3000);
        ASSERT_EQ(got, frame.size()) << "frame " << i << ": misses " << driver.stats().iotlb_misses.load()
                                     << " updates " << driver.stats().iotlb_updates.load() << " faults "
                                     << driver.stats().iotlb_faults.load() << " device tx "
                                     << device.stats(1).packets.load() << " rx " << device.stats(0).packets.load()
                                     << " rx dropped " << device.stats(0).dropped.load();
        EXPECT_EQ(std::memcmp(out.data() + 12, frame.data() + 12, frame.size() - 12), 0) << "frame " << i;
      }
      const auto& st = driver.stats();
      EXPECT_GT(st.iotlb_updates.load(), 3U) << "rings and buffers were all asked for";
      EXPECT_EQ(st.iotlb_updates.load(), st.iotlb_misses.load());
      EXPECT_EQ(st.iotlb_faults.load(), 0U);
      EXPECT_FALSE(device.broken());
    }
  }
}

}  // namespace
}  // namespace sriovd::vhost_user
