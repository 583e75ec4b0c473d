#include <gtest/gtest.h>

#include <filesystem>

#include "sriovd/host/sysfs.hpp"
#include "support/temp_dir.hpp"

namespace sriovd::host {
namespace {

namespace fs = std::filesystem;

// A sysfs tree laid out as the kernel does it: devices under
// devices/pci0000:00, bus/pci/devices/* and class/net/* as symlinks.
class FakeSysfs {
 public:
  explicit FakeSysfs(const std::string& root) : root_(root) {
    fs::create_directories(root_ / "devices/pci0000:3a");
    fs::create_directories(root_ / "bus/pci/devices");
    fs::create_directories(root_ / "class/net");
  }
  void add_device(const std::string& addr) {
    fs::create_directories(root_ / "devices/pci0000:3a" / addr);
    fs::create_symlink("../../../devices/pci0000:3a/" + addr, root_ / "bus/pci/devices" / addr);
  }
  void add_vf(const std::string& pf, const std::string& vf, int index) {
    add_device(vf);
    fs::create_symlink("../" + pf, root_ / "devices/pci0000:3a" / vf / "physfn");
    fs::create_symlink("../" + vf, root_ / "devices/pci0000:3a" / pf / ("virtfn" + std::to_string(index)));
  }
  void add_netdev(const std::string& dev, const std::string& name) {
    fs::create_directories(root_ / "devices/pci0000:3a" / dev / "net" / name);
    fs::create_symlink("../../devices/pci0000:3a/" + dev + "/net/" + name, root_ / "class/net" / name);
    fs::create_symlink("../../../" + dev, root_ / "devices/pci0000:3a" / dev / "net" / name / "device");
  }

 private:
  fs::path root_;
};

TEST(Sysfs, ResolvesVfToPfAndIndex) {
  test::TempDir dir;
  FakeSysfs sysfs(dir.path());
  sysfs.add_device("0000:3b:00.0");
  sysfs.add_vf("0000:3b:00.0", "0000:3b:02.0", 0);
  sysfs.add_vf("0000:3b:00.0", "0000:3b:02.1", 1);
  auto id = resolve_vf(dir.path(), *PciAddress::parse("0000:3b:02.1"));
  ASSERT_TRUE(id);
  EXPECT_EQ(id->pf.to_string(), "0000:3b:00.0");
  EXPECT_EQ(id->index, 1U);
}

TEST(Sysfs, PfAndMissingDevicesAreNotVfs) {
  test::TempDir dir;
  FakeSysfs sysfs(dir.path());
  sysfs.add_device("0000:3b:00.0");
  EXPECT_FALSE(resolve_vf(dir.path(), *PciAddress::parse("0000:3b:00.0")));
  EXPECT_FALSE(resolve_vf(dir.path(), *PciAddress::parse("0000:3b:02.5")));
}

TEST(Sysfs, NetdevToPciAddress) {
  test::TempDir dir;
  FakeSysfs sysfs(dir.path());
  sysfs.add_device("0000:3b:00.0");
  sysfs.add_netdev("0000:3b:00.0", "enp59s0f0");
  EXPECT_EQ(pci_address_of_netdev(dir.path(), "enp59s0f0")->to_string(), "0000:3b:00.0");
  EXPECT_FALSE(pci_address_of_netdev(dir.path(), "nosuch0"));
}

}  // namespace
}  // namespace sriovd::host
