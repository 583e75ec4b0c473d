#include <gtest/gtest.h>

#include "sriovd/util/pci_address.hpp"

namespace sriovd {
namespace {

TEST(PciAddress, ParsesFullAndShortForms) {
  auto a = PciAddress::parse("0000:3b:00.1");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->bus, 0x3b);
  EXPECT_EQ(a->function, 1);
  EXPECT_EQ(a->to_string(), "0000:3b:00.1");
  EXPECT_EQ(PciAddress::parse("3b:1f.7")->to_string(), "0000:3b:1f.7");
  // VMD domains have five hex digits.
  EXPECT_EQ(PciAddress::parse("10000:01:00.0")->to_string(), "10000:01:00.0");
}

TEST(PciAddress, RejectsMalformed) {
  for (const char* bad : {"", "0000:3b:00", "0000:3b:20.0", "0000:3b:00.8", "zz:00.0", "0000:3b:00.0x", "000:3b:00.0",
                          "0000:3b:0.0", "0000:3b:00.0:1"})
    EXPECT_FALSE(PciAddress::parse(bad)) << bad;
}

TEST(MacAddress, ParsesAndFormats) {
  auto m = MacAddress::parse("02:AB:cd:00:00:01");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->to_string(), "02:ab:cd:00:00:01");
  EXPECT_FALSE(m->is_multicast());
  EXPECT_TRUE(MacAddress::parse("01:00:5e:00:00:01")->is_multicast());
  EXPECT_TRUE(MacAddress::parse("00:00:00:00:00:00")->is_zero());
  for (const char* bad : {"", "02:00:00:00:00", "02-00-00-00-00-01", "02:00:00:00:00:0g", "02:00:00:00:00:001"})
    EXPECT_FALSE(MacAddress::parse(bad)) << bad;
}

}  // namespace
}  // namespace sriovd
