// Runs inside the real-kernel VM (tests/vm, scenario vfio-irq.sh) against a
// device bound to vfio-pci: SRIOVD_VM_DEVICE names it. Kernel VFIO, the
// routing engine and MSI-X emulation together, with the kernel's loopback
// trigger standing in for the device raising a vector.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <functional>

#include "sriovd/msix/msix.hpp"
#include "sriovd/pci/config_space.hpp"
#include "sriovd/util/error.hpp"
#include "support/process.hpp"
#include "vm/vm_test_support.hpp"
#include "sriovd/vfio/kernel.hpp"

namespace sriovd::vfio {
namespace {

using namespace std::chrono_literals;

using vmtest::device_address;
using vmtest::take;

bool wait_for(const std::function<bool()>& cond) { return test::wait_until(cond, 2s); }

class Vfio : public ::testing::Test {
 protected:
  void SetUp() override { dev = KernelDevice::open(device_address()); }
  // Routes for the first n vectors under `policy`, with MSI-X emulated.
  void route(unsigned n, irq::Policy policy) {
    vectors = std::make_unique<MsixVectors>(*dev);
    vectors->reserve(n);
    irq::EngineOptions o;
    o.relay_threads = 1;
    o.adaptive_quiet = 100ms;
    engine = std::make_unique<irq::Engine>(o);
    for (unsigned v = 0; v < n; ++v) {
      ids.push_back(engine->add({dev->name(), v, policy, vectors.get()}));
      UniqueFd fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
      sinks.push_back(fd.get());
      engine->set_sink(ids.back(), std::move(fd));
    }
    routed = std::make_unique<msix::RoutedVectors>(*engine, ids);
    table = std::make_unique<msix::MsixState>(static_cast<uint16_t>(n), *routed);
    table->write_message_control(msix::kEnable);
  }
  void TearDown() override {
    table.reset();
    routed.reset();
    engine.reset();
    if (vectors) vectors->disable();
  }
  void unmask(unsigned v) { table->write_table(v * 16 + 12, 4, 0); }
  void mask(unsigned v) { table->write_table(v * 16 + 12, 4, 1); }

  std::unique_ptr<KernelDevice> dev;
  std::unique_ptr<MsixVectors> vectors;
  std::unique_ptr<irq::Engine> engine;
  std::vector<irq::RouteId> ids;
  std::vector<int> sinks;
  std::unique_ptr<msix::RoutedVectors> routed;
  std::unique_ptr<msix::MsixState> table;
};

TEST_F(Vfio, DeviceRegionsAndMsixInfoAgreeWithConfigSpace) {
  const RegionInfo cfg = dev->region(kConfigRegion);
  ASSERT_TRUE(cfg.readable());
  std::vector<uint8_t> config(std::min<uint64_t>(cfg.size, 4096));
  dev->read(kConfigRegion, 0, config.data(), config.size());
  const auto layout = pci::find_msix(config);
  ASSERT_TRUE(layout);
  const IrqInfo irq = dev->irq(kMsixIrq);
  EXPECT_EQ(irq.count, layout->vectors);
  EXPECT_TRUE(irq.eventfd());
  std::printf("device %s: %u MSI-X vectors, NORESIZE %d, table BAR%u+0x%x, PBA BAR%u+0x%x\n", dev->name().c_str(),
              irq.count, irq.noresize() ? 1 : 0, layout->table_bir, layout->table_offset, layout->pba_bir,
              layout->pba_offset);
  const RegionInfo bar = dev->region(layout->table_bir);
  EXPECT_GT(bar.size, layout->table_offset);
  // BAR mmap through the device fd works (the zero-copy path for clients).
  if (bar.mappable()) {
    void* p = ::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, dev->fd(), static_cast<off_t>(bar.offset));
    EXPECT_NE(p, MAP_FAILED);
    if (p != MAP_FAILED) ::munmap(p, 4096);
  }
}

TEST_F(Vfio, LoopbackTriggerThroughTheRelay) {
  route(1, irq::Policy::relay);
  unmask(0);
  dev->trigger(kMsixIrq, 0);
  EXPECT_EQ(take(sinks[0]), 1U);
  EXPECT_TRUE(wait_for([&] { return engine->stats(ids[0]).delivered == 1; }));
  EXPECT_EQ(engine->stats(ids[0]).fired, 1U);
}

TEST_F(Vfio, DirectBindLeavesTheRelayOut) {
  route(1, irq::Policy::direct);
  unmask(0);
  ASSERT_EQ(engine->mode(ids[0]), irq::Mode::direct);
  for (int i = 0; i < 10; ++i) {
    dev->trigger(kMsixIrq, 0);
    EXPECT_EQ(take(sinks[0]), 1U);
  }
  EXPECT_EQ(engine->stats(ids[0]).fired, 0U) << "relay counters must not move in direct mode";
}

TEST_F(Vfio, MaskTriggerPbaUnmaskDeliversOnce) {
  route(1, irq::Policy::relay);
  unmask(0);
  mask(0);
  dev->trigger(kMsixIrq, 0);
  ASSERT_TRUE(wait_for([&] { return table->read_pba(0, 8) == 1U; }));
  EXPECT_EQ(take(sinks[0], 50ms), 0U);
  unmask(0);
  EXPECT_EQ(take(sinks[0]), 1U);
  EXPECT_EQ(take(sinks[0], 50ms), 0U);
  EXPECT_EQ(table->read_pba(0, 8), 0U);
  EXPECT_EQ(engine->stats(ids[0]).replayed, 1U);
}

TEST_F(Vfio, MaskInDirectModeIsLatchedNotLost) {
  route(1, irq::Policy::direct);
  unmask(0);
  mask(0);  // retargets the vector to the relay
  dev->trigger(kMsixIrq, 0);
  ASSERT_TRUE(wait_for([&] { return table->read_pba(0, 8) == 1U; }));
  unmask(0);
  EXPECT_EQ(take(sinks[0]), 1U);
  EXPECT_EQ(engine->mode(ids[0]), irq::Mode::direct);
}

TEST_F(Vfio, AdaptiveFollowsTheMaskRate) {
  route(1, irq::Policy::adaptive);
  unmask(0);
  EXPECT_EQ(engine->mode(ids[0]), irq::Mode::direct);
  for (int i = 0; i < 50; ++i) {
    dev->trigger(kMsixIrq, 0);
    EXPECT_EQ(take(sinks[0]), 1U);
    mask(0);
    unmask(0);
  }
  EXPECT_EQ(engine->mode(ids[0]), irq::Mode::relay);
  EXPECT_EQ(engine->stats(ids[0]).mode_switches, 2U) << "one retarget in, none per interrupt";
  engine->housekeeping(std::chrono::steady_clock::now() + 1s);
  EXPECT_EQ(engine->mode(ids[0]), irq::Mode::direct);
  dev->trigger(kMsixIrq, 0);
  EXPECT_EQ(take(sinks[0]), 1U);
}

TEST_F(Vfio, EveryVectorHasItsOwnRoute) {
  const unsigned n = dev->irq(kMsixIrq).count;
  ASSERT_GE(n, 2U) << "multi-vector cases need the PF";
  route(n, irq::Policy::relay);
  for (unsigned v = 0; v < n; ++v) unmask(v);
  for (unsigned v = 0; v < n; ++v) {
    dev->trigger(kMsixIrq, v);
    EXPECT_EQ(take(sinks[v]), 1U) << "vector " << v;
    for (unsigned w = 0; w < n; ++w)
      if (w != v) {
        EXPECT_EQ(take(sinks[w], 0ms), 0U) << "vector " << w << " fired for " << v;
      }
  }
}

TEST_F(Vfio, DmaMapAndUnmap) {
  const size_t size = 2 * 4096;
  void* mem = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  dev->container().map_dma(0x100000, mem, size);
  EXPECT_THROW(dev->container().map_dma(0x100000, mem, size), SystemError) << "overlapping IOVA must fail";
  dev->container().unmap_dma(0x100000, size);
  ::munmap(mem, size);
}

TEST_F(Vfio, ResetWhenTheDeviceOffersIt) {
  try {
    dev->reset();
  } catch (const std::runtime_error& e) {
    // A device without FLR says so; only a failing ioctl is an error.
    EXPECT_NE(std::string(e.what()).find("does not support"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace sriovd::vfio
