#include <gtest/gtest.h>

#include "sriovd/pci/config_space.hpp"

namespace sriovd::pci {
namespace {

TEST(ConfigSpace, WalksStandardAndExtendedChains) {
  EndpointSpec s;
  s.vendor = 0x8086;
  s.device = 0x1572;
  s.msix_vectors = 64;
  s.total_vfs = 8;
  const auto c = make_endpoint_config(s);
  const auto caps = capabilities(c);
  ASSERT_EQ(caps.size(), 3U);
  EXPECT_EQ(caps[0].id, kCapPciExpress);
  EXPECT_EQ(caps[1].id, kCapMsix);
  EXPECT_EQ(caps[1].offset, 0x7c);
  EXPECT_TRUE(caps[2].extended);
  EXPECT_EQ(caps[2].id, kExtCapSriov);
}

TEST(ConfigSpace, FindsTheMsixLayout) {
  EndpointSpec s;
  s.msix_vectors = 129;
  s.msix_bir = 3;
  s.msix_table_offset = 0x1000;
  s.msix_pba_offset = 0x3000;
  const auto m = find_msix(make_endpoint_config(s));
  ASSERT_TRUE(m);
  EXPECT_EQ(m->vectors, 129);
  EXPECT_EQ(m->table_bir, 3);
  EXPECT_EQ(m->table_offset, 0x1000U);
  EXPECT_EQ(m->pba_offset, 0x3000U);
  EXPECT_EQ(m->table_bytes(), 129U * 16U);
  EXPECT_EQ(m->pba_bytes(), 24U);
  // Table 0x1000..0x1810 in one page, the PBA in another.
  const auto pages = m->trapped_pages(3);
  ASSERT_EQ(pages.size(), 2U);
  EXPECT_EQ(pages[0], (std::pair<uint64_t, uint64_t>{0x1000, 0x2000}));
  EXPECT_EQ(pages[1], (std::pair<uint64_t, uint64_t>{0x3000, 0x4000}));
  MsixLayout adjacent = *m;
  adjacent.pba_offset = 0x1810;  // right after the table: one range
  EXPECT_EQ(adjacent.trapped_pages(3).size(), 1U);
  EXPECT_TRUE(m->trapped_pages(0).empty());
}

TEST(ConfigSpace, TableAndPbaInDifferentPagesAreTrappedApart) {
  MsixLayout m;
  m.vectors = 4;
  m.table_bir = 0;
  m.pba_bir = 0;
  m.table_offset = 0;
  m.pba_offset = 0x8000;
  const auto pages = m.trapped_pages(0);
  ASSERT_EQ(pages.size(), 2U);
  EXPECT_EQ(pages[0], (std::pair<uint64_t, uint64_t>{0, 0x1000}));
  EXPECT_EQ(pages[1], (std::pair<uint64_t, uint64_t>{0x8000, 0x9000}));
}

TEST(ConfigSpace, AMalformedChainEndsTheWalkWithoutReadingOutside) {
  EndpointSpec s;
  s.msix_vectors = 4;
  auto c = make_endpoint_config(s);
  c[0x71] = 0x40;  // MSI-X points back to the first capability: a loop
  EXPECT_EQ(capabilities(c).size(), 2U);
  c[0x41] = 0xff;  // the last dword of the standard space, low bits ignored
  const auto caps = capabilities(c);
  ASSERT_EQ(caps.size(), 2U);
  EXPECT_EQ(caps[1].offset, 0xfc);
  std::vector<uint8_t> tiny(32, 0xff);
  EXPECT_TRUE(capabilities(tiny).empty());
  EXPECT_FALSE(find_msix(tiny));
  auto ext = make_endpoint_config(EndpointSpec{});
  ext[0x100] = 0x10;
  ext[0x102] = 0x01;
  ext[0x103] = 0x10;  // next = 0x100: a loop in the extended chain
  EXPECT_EQ(capabilities(ext).size(), 2U);
}

TEST(ConfigSpace, NoCapabilitiesListBitNoCapabilities) {
  auto c = make_endpoint_config(EndpointSpec{.msix_vectors = 4});
  c[0x06] = 0;
  EXPECT_TRUE(capabilities(c).empty());
}

// Every config space the project emits is well formed: a VF's (MSI-X),
// a PF's (SR-IOV too), a device without MSI-X.
TEST(CapabilityProblems, NoneInWhatTheProjectEmits) {
  for (const EndpointSpec& s :
       {EndpointSpec{.msix_vectors = 8}, EndpointSpec{.msix_vectors = 64, .total_vfs = 8}, EndpointSpec{}}) {
    const auto c = make_endpoint_config(s);
    EXPECT_EQ(capability_problems(c), std::vector<std::string>{});
  }
}

// The layout that hid MSI-X from QEMU's guests: MSI-X at 0x70, inside a
// PCI Express v2 capability at 0x40 (0x3c bytes, to 0x7b).
TEST(CapabilityProblems, FindsAnOverlapALoopAndABadPointer) {
  auto c = make_endpoint_config(EndpointSpec{.msix_vectors = 8});
  c[0x41] = 0x70;
  c[0x70] = kCapMsix;
  c[0x71] = 0;
  auto p = capability_problems(c);
  ASSERT_EQ(p.size(), 1U);
  EXPECT_NE(p[0].find("overlaps"), std::string::npos) << p[0];

  c = make_endpoint_config(EndpointSpec{.msix_vectors = 8});
  c[0x7d] = 0x40;  // MSI-X points back at the PCIe capability
  p = capability_problems(c);
  ASSERT_FALSE(p.empty());
  EXPECT_NE(p.back().find("loops"), std::string::npos) << p.back();

  c = make_endpoint_config(EndpointSpec{.msix_vectors = 8});
  c[0x34] = 0x22;
  p = capability_problems(c);
  ASSERT_EQ(p.size(), 1U);
  EXPECT_NE(p[0].find("not a dword"), std::string::npos) << p[0];

  c = make_endpoint_config(EndpointSpec{.msix_vectors = 8});
  c[0x7d] = 0xf8;  // a vendor capability of 16 bytes at 0xf8 runs past 0xff
  c[0xf8] = 0x09;
  c[0xfa] = 16;
  p = capability_problems(c);
  ASSERT_EQ(p.size(), 1U);
  EXPECT_NE(p[0].find("runs past"), std::string::npos) << p[0];
}

}  // namespace
}  // namespace sriovd::pci
