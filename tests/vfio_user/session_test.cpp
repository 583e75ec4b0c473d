// vfio-user servers on session threads (util/session_threads): a tenant's
// flood does not starve another on the same thread, a tenant stuck in its
// device holds nobody on another thread, and a doorbell costs no
// allocation on the path from the socket to the device.
#include <gtest/gtest.h>
#include <linux/vfio.h>
#include <sys/socket.h>

#include <array>
#include <atomic>
#include <cstring>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "sriovd/guest/vfio_user_client.hpp"
#include "sriovd/util/session_threads.hpp"
#include "sriovd/vfio_user/protocol.hpp"
#include "sriovd/vfio_user/server.hpp"
#include "support/alloc_count.hpp"
#include "support/bar_device.hpp"
#include "support/process.hpp"
#include "support/temp_dir.hpp"

namespace sriovd::vfio_user {
namespace {

using namespace std::chrono_literals;

// A write counts as a doorbell; a write at 0x100 waits until the test
// lets it go (a device stuck in its handler).
class CountingDevice : public test::BarDevice {
 public:
  CountingDevice() : BarDevice("counting") {}
  void write(uint32_t, uint64_t offset, std::span<const uint8_t>) override {
    if (offset == 0x100) {
      std::unique_lock lock(mutex_);
      stuck_ = true;
      cv_.wait(lock, [&] { return released_; });
      return;
    }
    writes.fetch_add(1, std::memory_order_relaxed);
  }
  bool stuck() {
    std::lock_guard lock(mutex_);
    return stuck_;
  }
  void release() {
    std::lock_guard lock(mutex_);
    released_ = true;
    cv_.notify_all();
  }
  std::atomic<uint64_t> writes{0};

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stuck_ = false;
  bool released_ = false;
};

using Export = test::SessionExport<CountingDevice>;
using test::Doorbell;
using test::doorbell;
using test::send_all;

// A flooding client sends doorbells without pause; another tenant on the
// same thread is served between its batches, while the flood goes on.
TEST(SessionThreads, AFloodingTenantDoesNotStarveAnotherOnItsThread) {
  test::TempDir dir;
  SessionPool pool(1, 0us);
  Export loud(pool.at(0), dir.file("loud.sock"));
  Export quiet(pool.at(0), dir.file("quiet.sock"));
  guest::VfioUserClient flood(dir.file("loud.sock"));
  guest::VfioUserClient other(dir.file("quiet.sock"));
  std::atomic<bool> stop{false};
  std::thread sender([&] {
    std::vector<Doorbell> batch(256, doorbell());
    while (!stop && send_all(flood.fd(), batch.data(), batch.size() * sizeof(Doorbell))) {
    }
  });
  ASSERT_TRUE(test::wait_until([&] { return loud.device.writes > 10000; }, 30s));
  for (int i = 0; i < 200; ++i) (void)other.read32(0, 0);
  const uint64_t during = loud.device.writes;
  // The flood was still being served after the other tenant's 200 trips:
  // they were not answered only once it stopped.
  EXPECT_TRUE(test::wait_until([&] { return loud.device.writes > during + 10000; }, 30s));
  stop = true;
  ::shutdown(flood.fd(), SHUT_RDWR);
  sender.join();
}

// A tenant whose device handler is stuck holds its own thread only.
TEST(SessionThreads, ATenantStuckInItsDeviceHoldsNobodyOnAnotherThread) {
  test::TempDir dir;
  SessionPool pool(2, 0us);
  auto l1 = pool.lease();
  auto l2 = pool.lease();
  ASSERT_NE(l1->index(), l2->index());
  Export stuck(*l1, dir.file("stuck.sock"));
  Export fine(*l2, dir.file("fine.sock"));
  guest::VfioUserClient a(dir.file("stuck.sock"));
  guest::VfioUserClient b(dir.file("fine.sock"));
  const uint32_t v = 1;
  a.post_write(0, 0x100, {reinterpret_cast<const uint8_t*>(&v), sizeof v});
  ASSERT_TRUE(test::wait_until([&] { return stuck.device.stuck(); }, 10s));
  for (int i = 0; i < 100; ++i) b.write32(0, 0x10, 1);
  EXPECT_EQ(fine.device.writes, 100U);
  stuck.device.release();
  EXPECT_EQ(a.read32(0, 0), 0U);  // and the stuck one goes on
}

// From the socket to the device, a doorbell allocates nothing on the
// session thread (the read-ahead buffer, the message buffers kept).
TEST(SessionThreads, ADoorbellStormAllocatesNothing) {
  test::TempDir dir;
  SessionPool pool(1, 0us);
  Export ex(pool.at(0), dir.file("d.sock"));
  guest::VfioUserClient c(dir.file("d.sock"));
  std::vector<Doorbell> batch(256, doorbell());
  ASSERT_TRUE(send_all(c.fd(), batch.data(), batch.size() * sizeof(Doorbell)));  // warm up
  ASSERT_TRUE(test::wait_until([&] { return ex.device.writes == 256; }, 10s));
  pool.at(0).call([] {
    test::alloc_count::count = 0;
    test::alloc_count::thread = std::this_thread::get_id();
  });
  for (int i = 0; i < 40; ++i) ASSERT_TRUE(send_all(c.fd(), batch.data(), batch.size() * sizeof(Doorbell)));
  ASSERT_TRUE(test::wait_until([&] { return ex.device.writes == 256U * 41; }, 30s));
  const uint64_t allocations = pool.at(0).call([] {
    test::alloc_count::thread = std::thread::id();
    return test::alloc_count::count.load();
  });
  EXPECT_EQ(allocations, 0U) << "allocations on the session thread for 10240 doorbells";
}

}  // namespace
}  // namespace sriovd::vfio_user
