// The simulated VF through the same interface as kernel VFIO, wired to the
// routing engine and MSI-X emulation as the VF proxy wires them.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "sriovd/msix/msix.hpp"
#include "sriovd/pci/config_space.hpp"
#include "sriovd/vfio/simulated.hpp"
#include "support/process.hpp"

namespace sriovd::vfio {
namespace {

using namespace std::chrono_literals;

uint64_t take(int fd, std::chrono::milliseconds wait = 2s) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(wait.count())) != 1) return 0;
  uint64_t v = 0;
  return ::read(fd, &v, sizeof v) == sizeof v ? v : 0;
}

TEST(SimulatedDevice, LooksLikeAVfioPciDevice) {
  SimulatedDevice d("0000:3b:02.0", 0x8086, 0x154c, 4);
  const IrqInfo msix = d.irq(kMsixIrq);
  EXPECT_EQ(msix.count, 4U);
  EXPECT_TRUE(msix.eventfd());
  EXPECT_TRUE(msix.noresize());
  const RegionInfo bar0 = d.region(kBar0Region);
  EXPECT_TRUE(bar0.mappable());
  ASSERT_EQ(bar0.sparse.size(), 1U);
  EXPECT_EQ(bar0.sparse[0].offset, 0x3000U);  // table and PBA pages are held back
  std::vector<uint8_t> config(4096);
  d.read(kConfigRegion, 0, config.data(), config.size());
  const auto layout = pci::find_msix(config);
  ASSERT_TRUE(layout);
  EXPECT_EQ(layout->vectors, 4);
  EXPECT_EQ(layout->table_bir, 0);
  EXPECT_EQ(layout->pba_offset, SimulatedDevice::kPbaOffset);
  EXPECT_THROW(d.read(kBar0Region, SimulatedDevice::kBar0Size, config.data(), 4), std::out_of_range);
}

TEST(SimulatedDevice, TriggerSignalsTheVectorsEventfdOnly) {
  SimulatedDevice d("vf", 0x8086, 0x154c, 4);
  UniqueFd a(::eventfd(0, EFD_NONBLOCK)), b(::eventfd(0, EFD_NONBLOCK));
  const int fds[2] = {a.get(), b.get()};
  d.set_irq_eventfds(kMsixIrq, 1, fds);
  d.trigger(kMsixIrq, 2);
  EXPECT_EQ(take(b.get()), 1U);
  EXPECT_EQ(take(a.get(), 10ms), 0U);
  d.trigger(kMsixIrq, 0);  // no eventfd: goes nowhere
  d.disable_irqs(kMsixIrq);
  d.trigger(kMsixIrq, 2);
  EXPECT_EQ(take(b.get(), 10ms), 0U);
}

// A VF's vectors through the engine: relay, direct bind (relay counters
// still), mask -> fire -> PBA -> unmask -> delivered once, adaptive.
class VfVectors : public ::testing::Test {
 protected:
  void SetUp() override {
    irq::EngineOptions o;
    o.relay_threads = 1;
    engine = std::make_unique<irq::Engine>(o);
    for (unsigned v = 0; v < 4; ++v) {
      ids.push_back(engine->add({"0000:3b:02.0", v, policy, &binder}));
      UniqueFd fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
      sinks.push_back(fd.get());
      engine->set_sink(ids.back(), std::move(fd));
    }
    vectors = std::make_unique<msix::RoutedVectors>(*engine, ids);
    msix = std::make_unique<msix::MsixState>(4, *vectors);
    msix->write_message_control(msix::kEnable);
  }
  void unmask(unsigned v) { msix->write_table(v * 16 + 12, 4, 0); }
  void mask(unsigned v) { msix->write_table(v * 16 + 12, 4, 1); }

  irq::Policy policy = irq::Policy::relay;
  SimulatedDevice dev{"0000:3b:02.0", 0x8086, 0x154c, 4};
  MsixVectors binder{dev};
  std::unique_ptr<irq::Engine> engine;
  std::vector<irq::RouteId> ids;
  std::vector<int> sinks;
  std::unique_ptr<msix::RoutedVectors> vectors;
  std::unique_ptr<msix::MsixState> msix;
};

TEST_F(VfVectors, RelayMaskPbaUnmask) {
  unmask(1);
  dev.trigger(kMsixIrq, 1);
  EXPECT_EQ(take(sinks[1]), 1U);
  EXPECT_EQ(engine->stats(ids[1]).fired, 1U);
  mask(1);
  dev.trigger(kMsixIrq, 1);
  ASSERT_TRUE(test::wait_until([&] { return msix->read_pba(0, 8) == (1U << 1U); }, 2s));
  EXPECT_EQ(take(sinks[1], 20ms), 0U);
  unmask(1);
  EXPECT_EQ(take(sinks[1]), 1U);
  EXPECT_EQ(msix->read_pba(0, 8), 0U);
  EXPECT_EQ(engine->stats(ids[1]).replayed, 1U);
}

class VfVectorsDirect : public VfVectors {
 protected:
  void SetUp() override {
    policy = irq::Policy::direct;
    VfVectors::SetUp();
  }
};

TEST_F(VfVectorsDirect, DirectBindBypassesTheRelay) {
  unmask(2);
  EXPECT_EQ(engine->mode(ids[2]), irq::Mode::direct);
  const uint64_t calls = dev.set_irqs_calls();
  for (int i = 0; i < 10; ++i) {
    dev.trigger(kMsixIrq, 2);
    EXPECT_EQ(take(sinks[2]), 1U);
  }
  EXPECT_EQ(engine->stats(ids[2]).fired, 0U) << "relay counters must not move in direct mode";
  EXPECT_EQ(dev.set_irqs_calls(), calls);
  // A mask costs a retarget (naive); the fire is then latched, not lost.
  mask(2);
  dev.trigger(kMsixIrq, 2);
  ASSERT_TRUE(test::wait_until([&] { return msix->read_pba(0, 8) == (1U << 2U); }, 2s));
  unmask(2);
  EXPECT_EQ(take(sinks[2]), 1U);
  EXPECT_EQ(dev.set_irqs_calls(), calls + 2);
}

TEST(MsixVectors, EnablesOnlyWhatIsUsedAndReenablesInOneBatchUnderNoresize) {
  SimulatedDevice d("vf", 0x8086, 0x154c, 8);
  MsixVectors v(d);
  EXPECT_EQ(v.enabled(), 0U);
  UniqueFd a(::eventfd(0, EFD_NONBLOCK)), b(::eventfd(0, EFD_NONBLOCK));
  v.bind(0, a.get());
  EXPECT_EQ(v.enabled(), 1U);
  EXPECT_EQ(v.reenables(), 0U);
  v.bind(3, b.get());  // NORESIZE: disable and enable 4 vectors in one call
  EXPECT_EQ(v.enabled(), 4U);
  EXPECT_EQ(v.reenables(), 1U);
  d.trigger(kMsixIrq, 0);
  d.trigger(kMsixIrq, 3);
  EXPECT_EQ(take(a.get()), 1U);
  EXPECT_EQ(take(b.get()), 1U);
  v.bind(2, a.get());  // within the enabled range: one vector, no re-enable
  EXPECT_EQ(v.reenables(), 1U);
  v.reserve(8);
  EXPECT_EQ(v.enabled(), 8U);
  EXPECT_THROW(v.reserve(9), std::out_of_range);
  v.disable();
  d.trigger(kMsixIrq, 0);
  EXPECT_EQ(take(a.get(), 10ms), 0U);
}

TEST(SimulatedDevice, GeneratorFiresAtTheAskedVectors) {
  SimulatedDevice d("vf", 0x8086, 0x154c, 4);
  UniqueFd fd(::eventfd(0, EFD_NONBLOCK));
  const int one[1] = {fd.get()};
  d.set_irq_eventfds(kMsixIrq, 3, one);
  d.start_generator({3}, 1000.0, 2);
  ASSERT_TRUE(test::wait_until([&] { return d.generated() >= 20; }, 5s));
  d.stop_generator();
  uint64_t v = 0;
  ASSERT_EQ(::read(fd.get(), &v, sizeof v), static_cast<ssize_t>(sizeof v));
  EXPECT_EQ(v, d.generated());
}

}  // namespace
}  // namespace sriovd::vfio
