// The simulated kernel behaves as the kernel's sysfs does where sriovd
// depends on it, and libpci reads its tree.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "sim_fixture.hpp"
#include "sriovd/host/topology.hpp"
#include "sriovd/util/error.hpp"
#include "support/process.hpp"

namespace sriovd::host {
namespace {

using test::kPf;
using ::testing::HasSubstr;

const std::string kPfDir = "bus/pci/devices/0000:3b:00.0/";

TEST(SimulatedKernel, NumvfsCreatesVfsWithTheirOwnGroupsAndDrivers) {
  test::SimHost h;
  h.kernel.write(kPfDir + "sriov_numvfs", "2\n");
  EXPECT_EQ(h.kernel.read(kPfDir + "sriov_numvfs"), "2");
  EXPECT_EQ(h.kernel.link_name(kPfDir + "virtfn0"), "0000:3b:02.0");
  EXPECT_EQ(h.kernel.link_name(kPfDir + "virtfn1"), "0000:3b:02.1");
  EXPECT_EQ(h.kernel.link_name("bus/pci/devices/0000:3b:02.1/physfn"), "0000:3b:00.0");
  // autoprobe is on by default: the native VF driver took them, with netdevs.
  EXPECT_EQ(h.kernel.link_name("bus/pci/devices/0000:3b:02.0/driver"), "iavf");
  EXPECT_EQ(h.kernel.list("bus/pci/devices/0000:3b:02.0/net"), std::vector<std::string>{"simpf0v0"});
  EXPECT_NE(h.kernel.iommu_group_of(*PciAddress::parse("0000:3b:02.0")),
            h.kernel.iommu_group_of(*PciAddress::parse("0000:3b:02.1")));
}

TEST(SimulatedKernel, NumvfsChangesOnlyThroughZeroAndNotAboveTotal) {
  test::SimHost h;
  h.kernel.write(kPfDir + "sriov_numvfs", "2");
  try {
    h.kernel.write(kPfDir + "sriov_numvfs", "3");
    FAIL();
  } catch (const SystemError& e) {
    EXPECT_EQ(e.code().value(), EBUSY);
  }
  try {
    h.kernel.write(kPfDir + "sriov_numvfs", "0");
    h.kernel.write(kPfDir + "sriov_numvfs", "9");
    FAIL();
  } catch (const SystemError& e) {
    EXPECT_EQ(e.code().value(), ERANGE);
  }
  EXPECT_FALSE(h.kernel.exists("bus/pci/devices/0000:3b:02.0"));
}

TEST(SimulatedKernel, OverrideAndProbeBindAndProbeOfAMissingDriverLeavesItUnbound) {
  test::SimHost h;
  h.kernel.write(kPfDir + "sriov_drivers_autoprobe", "0");
  h.kernel.write(kPfDir + "sriov_numvfs", "2");
  EXPECT_FALSE(h.kernel.link_name("bus/pci/devices/0000:3b:02.0/driver"));
  h.kernel.write("bus/pci/devices/0000:3b:02.0/driver_override", "vfio-pci\n");
  h.kernel.write("bus/pci/drivers_probe", "0000:3b:02.0");
  EXPECT_EQ(h.kernel.link_name("bus/pci/devices/0000:3b:02.0/driver"), "vfio-pci");
  EXPECT_TRUE(h.kernel.exists("bus/pci/drivers/vfio-pci/0000:3b:02.0"));
  // An override naming no loaded driver: probe "succeeds", nothing binds.
  h.kernel.write("bus/pci/devices/0000:3b:02.1/driver_override", "vfio-pcie");
  h.kernel.write("bus/pci/drivers_probe", "0000:3b:02.1");
  EXPECT_FALSE(h.kernel.link_name("bus/pci/devices/0000:3b:02.1/driver"));
}

TEST(SimulatedKernel, BusyDevicesRefuseAndFaultsAreInjected) {
  test::SimHost h;
  h.kernel.write(kPfDir + "sriov_numvfs", "1");
  const auto vf = *PciAddress::parse("0000:3b:02.0");
  h.kernel.set_busy(vf, true);
  EXPECT_THROW(h.kernel.write("bus/pci/drivers/iavf/unbind", "0000:3b:02.0"), SystemError);
  EXPECT_THROW(h.kernel.write(kPfDir + "sriov_numvfs", "0"), SystemError);
  h.kernel.set_busy(vf, false);
  h.kernel.inject({"sriov_numvfs", ENODEV, 0, 1});
  try {
    h.kernel.write(kPfDir + "sriov_numvfs", "0");
    FAIL();
  } catch (const SystemError& e) {
    EXPECT_EQ(e.code().value(), ENODEV);
  }
  h.kernel.write(kPfDir + "sriov_numvfs", "0");  // the fault fired once
}

TEST(SimulatedKernel, LateVfsAppearAfterTheDelay) {
  test::SimHost h;
  h.kernel.delay_vf_appearance(std::chrono::milliseconds(100));
  h.kernel.write(kPfDir + "sriov_numvfs", "2");
  EXPECT_FALSE(h.kernel.exists("bus/pci/devices/0000:3b:02.0"));
  EXPECT_TRUE(sriovd::test::wait_until([&] { return h.kernel.exists("bus/pci/devices/0000:3b:02.1"); },
                                       std::chrono::seconds(2)));
}

TEST(Topology, LibpciReadsTheSimulatedTree) {
  test::SimHost h;
  h.kernel.write(kPfDir + "sriov_numvfs", "2");
  h.kernel.write("bus/pci/devices/0000:3b:02.1/driver_override", "vfio-pci");
  h.kernel.write("bus/pci/drivers/iavf/unbind", "0000:3b:02.1");
  h.kernel.write("bus/pci/drivers_probe", "0000:3b:02.1");
  const auto devices = scan_pci(h.kernel.root());
  ASSERT_EQ(devices.size(), 3U);
  const PciDeviceInfo& pf = devices[0];
  EXPECT_EQ(pf.address, kPf);
  EXPECT_EQ(pf.vendor, 0x8086);
  EXPECT_EQ(pf.device, 0x1572);
  EXPECT_EQ(pf.class_code, 0x020000U);
  EXPECT_TRUE(pf.sriov);
  EXPECT_EQ(pf.total_vfs, 8);
  EXPECT_EQ(pf.num_vfs, 2);
  EXPECT_EQ(pf.driver, "i40e");
  EXPECT_EQ(pf.netdevs, std::vector<std::string>{"simpf0"});
  const PciDeviceInfo& vf1 = devices[2];
  EXPECT_EQ(vf1.address.to_string(), "0000:3b:02.1");
  EXPECT_EQ(vf1.device, 0x154c);
  EXPECT_EQ(vf1.driver, "vfio-pci");
  EXPECT_EQ(vf1.physfn, kPf);
  EXPECT_EQ(vf1.vf_index, 1);
  EXPECT_GE(vf1.iommu_group, 0);
  ASSERT_TRUE(vf1.msix);
  EXPECT_EQ(vf1.msix->vectors, 4);
  EXPECT_EQ(vf1.msix->table_bir, 3);
  EXPECT_EQ(vf1.msix->pba_offset, 0x2000U);
}

TEST(Topology, AMissingTreeIsAnErrorNotAnExit) { EXPECT_THROW(scan_pci("/nonexistent-sysfs"), std::runtime_error); }

}  // namespace
}  // namespace sriovd::host
