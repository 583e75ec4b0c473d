// The guest's view of an exported device's config space.
#include <gtest/gtest.h>

#include <memory>

#include "sriovd/msix/msix.hpp"
#include "sriovd/pci/config_space.hpp"
#include "sriovd/pci/virtual_config.hpp"

namespace sriovd::pci {
namespace {

struct NoVectors : msix::VectorControl {
  void set_masked(unsigned, bool) override {}
  bool pending(unsigned) const override { return false; }
  void clear_pending(unsigned) override {}
};

class Exported : public ::testing::Test {
 protected:
  Exported() : msix(4, vectors) {
    EndpointSpec s;
    s.vendor = 0x8086;
    s.device = 0x154c;
    s.class_code = 0x020000;
    s.msix_vectors = 4;
    s.msix_bir = 0;
    bars[0] = {0x4000, false, true, false};  // 64-bit memory BAR0/1, 16 KiB
    bars[3] = {0x100, true, false, false};   // IO BAR3, 256 bytes
    cfg = std::make_unique<VirtualConfig>(make_endpoint_config(s), bars, &msix,
                                          [this](uint16_t c) { commands.push_back(c); });
  }
  NoVectors vectors;
  msix::MsixState msix;
  std::array<BarInfo, 6> bars{};
  std::vector<uint16_t> commands;
  std::unique_ptr<VirtualConfig> cfg;
};

TEST_F(Exported, IdentityIsTheDevicesAndReadOnly) {
  EXPECT_EQ(cfg->read(0, 4), 0x154c8086U);
  cfg->write(0, 4, 0xdeadbeef);
  EXPECT_EQ(cfg->read(0, 2), 0x8086U);
  EXPECT_EQ(cfg->read(0x0b, 1), 0x02U);  // class: network
}

TEST_F(Exported, BarSizingFollowsThePciProtocol) {
  // §6.2.5.1: write all ones, read back the size mask with the flag bits.
  cfg->write(0x10, 4, 0xffffffff);
  EXPECT_EQ(cfg->read(0x10, 4), 0xffffc004U);  // 16 KiB, 64-bit memory
  cfg->write(0x14, 4, 0xffffffff);
  EXPECT_EQ(cfg->read(0x14, 4), 0xffffffffU);
  cfg->write(0x10, 4, 0xfe000000);
  cfg->write(0x14, 4, 0x1);
  EXPECT_EQ(cfg->bar_address(0), 0x1fe000000ULL);
  cfg->write(0x1c, 4, 0xffffffff);
  EXPECT_EQ(cfg->read(0x1c, 4), 0xffffff01U);  // 256-byte IO BAR
  EXPECT_EQ(cfg->read(0x18, 4), 0U) << "absent BAR2 reads 0 and stays 0";
  cfg->write(0x18, 4, 0xffffffff);
  EXPECT_EQ(cfg->read(0x18, 4), 0U);
  cfg->write(0x30, 4, 0xffffffff);
  EXPECT_EQ(cfg->read(0x30, 4), 0U) << "no ROM";
}

TEST_F(Exported, CommandWritesReachTheDeviceMaskedToWhatIsAllowed) {
  cfg->write(0x04, 2, 0xffff);
  ASSERT_EQ(commands.size(), 1U);
  EXPECT_EQ(commands[0], 0x0407U);
  EXPECT_EQ(cfg->read(0x04, 2), 0x0407U);
  cfg->write(0x3c, 1, 0x0b);
  EXPECT_EQ(cfg->read(0x3c, 1), 0x0bU);
  EXPECT_EQ(commands.size(), 1U) << "interrupt line is not a command write";
}

TEST_F(Exported, MsixMessageControlBelongsToTheEmulation) {
  const auto layout = find_msix(make_endpoint_config(EndpointSpec{.msix_vectors = 4}));
  const uint32_t mc = layout->cap_offset + 2U;
  EXPECT_EQ(cfg->read(mc, 2), 3U) << "table size N-1, disabled";
  cfg->write(mc + 1, 1, 0xc0);  // byte write of the upper half: enable + function mask
  EXPECT_TRUE(msix.enabled());
  EXPECT_TRUE(msix.function_masked());
  EXPECT_EQ(cfg->read(mc, 2), 0xc003U);
  cfg->write(mc, 2, 0x8000);
  EXPECT_FALSE(msix.function_masked());
  cfg->write(layout->cap_offset, 4, 0x0000ffff);  // dword write: low half is ID/next (RO), MC cleared
  EXPECT_FALSE(msix.enabled());
  EXPECT_EQ(cfg->read(layout->cap_offset, 1), 0x11U);
}

TEST_F(Exported, BadAccessesReadAllOnesAndWriteNothing) {
  EXPECT_EQ(cfg->read(1, 2), 0xffffU);
  EXPECT_EQ(cfg->read(4096, 4), 0xffffffffU);
  EXPECT_EQ(cfg->read(0, 3), 0xffffffffU);
  cfg->write(0x02, 4, 0);
  EXPECT_EQ(cfg->read(0, 4), 0x154c8086U);
  EXPECT_TRUE(commands.empty());
}

}  // namespace
}  // namespace sriovd::pci
