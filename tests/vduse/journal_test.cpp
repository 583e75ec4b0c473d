// The VDUSE journal and what a start does with it on a kernel without VDUSE
// (this host's; vm.vduse runs the devices themselves on the 6.12 guest).

#include <unistd.h>

#include <fstream>

#include <gtest/gtest.h>

#include "sriovd/vduse/backend.hpp"
#include "support/temp_dir.hpp"

namespace sriovd::vduse {
namespace {

TEST(VduseJournal, AMissingJournalNamesNothing) {
  test::TempDir dir;
  EXPECT_TRUE(read_journal(dir.file("vduse-devices")).empty());
  EXPECT_TRUE(Backend::remove_left_over(dir.file("vduse-devices"), {}).empty());
}

TEST(VduseJournal, NamesAreReadOnePerLine) {
  test::TempDir dir;
  dir.write("vduse-devices", "vd0\n\nvb1\n");
  EXPECT_EQ(read_journal(dir.file("vduse-devices")), (std::vector<std::string>{"vd0", "vb1"}));
}

// A kernel without VDUSE has none of the devices a journal names (another
// boot, the module gone): they are forgotten, the kept one stays listed.
TEST(VduseJournal, WithoutVduseTheJournalsDevicesAreForgotten) {
  if (::access("/dev/vduse/control", F_OK) == 0) GTEST_SKIP() << "this kernel has VDUSE (vm.vduse covers a real one)";
  test::TempDir dir;
  dir.write("vduse-devices", "vd0\nvb1\nkeep0\n");
  EXPECT_EQ(Backend::remove_left_over(dir.file("vduse-devices"), {"keep0"}), (std::vector<std::string>{"vd0", "vb1"}));
  EXPECT_EQ(read_journal(dir.file("vduse-devices")), (std::vector<std::string>{"keep0"}));
}

TEST(VduseAvailable, AKernelWithoutVduseSaysWhatToLoad) {
  if (::access("/dev/vduse/control", F_OK) == 0) GTEST_SKIP() << "this kernel has VDUSE";
  std::string why;
  EXPECT_FALSE(available(Bind::netdev, why));
  EXPECT_NE(why.find("modprobe vduse"), std::string::npos) << why;
}

}  // namespace
}  // namespace sriovd::vduse
