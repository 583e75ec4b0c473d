// The host layer against a PF driver that refuses what real ones refuse
// (issue 25): the simulated PF behaves as igb does (seen on QEMU 10's
// 82576), VFs of a PF with autoprobe off get no driver unless one is named
// in driver_override, and hand-made VFs come back as they were.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "sim_fixture.hpp"

namespace sriovd::host {
namespace {

using test::kPf;
using test::SimHost;
using ::testing::HasSubstr;

using test::kVf0;
using test::kVf1;
using test::kVf2;

// VF 0 for a guest, VF 1 and 2 for the host (their own driver).
const char* kIgb = R"(physical_functions:
  - address: "0000:3b:00.0"
    num_vfs: 3
    vfs:
      - index: 0
        mac: "02:00:00:00:10:00"
        vlan: 100
        qos: 3
        spoofchk: true
        max_tx_rate: 200
        assign: {owner: vm1, export: none}
      - index: 1
        mac: "02:00:00:00:10:01"
        trust: true
)";

TEST(SimulatedKernelStrict, AVfOfAPfWithAutoprobeOffIsProbedOnlyForItsOverride) {
  SimHost h;
  h.kernel.write("bus/pci/devices/0000:3b:00.0/sriov_drivers_autoprobe", "0");
  h.kernel.write("bus/pci/devices/0000:3b:00.0/sriov_numvfs", "1");
  h.kernel.write("bus/pci/drivers_probe", "0000:3b:02.0");
  EXPECT_EQ(h.control.driver(kVf0), "");  // pci_device_can_probe() says no
  h.kernel.write("bus/pci/devices/0000:3b:02.0/driver_override", "iavf");
  h.kernel.write("bus/pci/drivers_probe", "0000:3b:02.0");
  EXPECT_EQ(h.control.driver(kVf0), "iavf");
}

TEST(DriverBinding, VfsNotForAGuestGetTheirOwnDriverFoundByModalias) {
  SimHost h;
  h.kernel.behave_like_igb(kPf);
  EXPECT_EQ(h.control.own_driver(kPf), "igb");
  auto r = h.reconciler();
  r->converge(SimHost::config(kIgb));
  EXPECT_EQ(h.control.driver(kVf0), "vfio-pci");
  EXPECT_EQ(h.control.driver(kVf1), "igbvf");
  EXPECT_EQ(h.control.driver(kVf2), "igbvf");
  EXPECT_EQ(h.kernel.read("bus/pci/devices/0000:3b:02.1/driver_override"), "(null)");
  // Released: the VF goes back to igbvf, not to no driver, and the VFs
  // sriovd made for the host keep theirs.
  r->converge(SimHost::config(kIgb), {{kPf, 0U}});
  EXPECT_EQ(h.control.driver(kVf0), "igbvf");
  EXPECT_EQ(h.control.driver(kVf1), "igbvf");
  EXPECT_EQ(h.control.driver(kVf2), "igbvf");
  EXPECT_EQ(h.kernel.read("bus/pci/devices/0000:3b:02.0/driver_override"), "(null)");
}

// The shipped unit hides /lib/modules (ProtectKernelModules): the kernel
// picks the VF's driver as for a new VF, autoprobe on for that one probe.
TEST(DriverBinding, WithoutModulesAliasTheKernelPicksAsForANewVf) {
  SimHost h;
  h.kernel.behave_like_igb(kPf);
  h.kernel.hide_module_aliases(true);
  auto r = h.reconciler();
  r->converge(SimHost::config(kIgb));
  EXPECT_EQ(h.control.driver(kVf0), "vfio-pci");
  EXPECT_EQ(h.control.driver(kVf1), "igbvf");
  EXPECT_EQ(h.control.driver(kVf2), "igbvf");
  EXPECT_EQ(h.kernel.read("bus/pci/devices/0000:3b:00.0/sriov_drivers_autoprobe"), "0");
  // VF 0 released: nothing is assigned, autoprobe is back on, and every VF
  // has its own driver - the two that had it keep it.
  r->converge(SimHost::config(kIgb), {{kPf, 0U}});
  EXPECT_EQ(h.control.driver(kVf0), "igbvf");
  EXPECT_EQ(h.control.driver(kVf1), "igbvf");
  EXPECT_EQ(h.control.driver(kVf2), "igbvf");
  EXPECT_EQ(h.kernel.read("bus/pci/devices/0000:3b:00.0/sriov_drivers_autoprobe"), "1");
}

TEST(DriverBinding, NoLoadedDriverForTheVfIsNamedInTheError) {
  SimHost h;
  h.kernel.set_driver_loaded("iavf", false);
  auto r = h.reconciler();
  const std::string before = h.kernel.snapshot();
  try {
    r->converge(SimHost::config(R"(physical_functions:
  - address: "0000:3b:00.0"
    num_vfs: 2
    vfs:
      - {index: 0, assign: {owner: vm1, export: none}}
)"));
    FAIL() << "applied with no VF driver loaded";
  } catch (const ApplyError& e) {
    EXPECT_THAT(e.what(), HasSubstr("no loaded driver claims it"));
    EXPECT_THAT(e.what(), HasSubstr("iavf"));
  }
  EXPECT_EQ(h.kernel.snapshot(), before);
}

TEST(DriverRulesIgb, ARefusedSettingFailsThePlanNamingItAndChangesNothing) {
  SimHost h;
  h.kernel.behave_like_igb(kPf);
  auto r = h.reconciler();
  const std::string before = h.kernel.snapshot();
  for (const char* setting : {"link_state: enable", "link_state: disable", "min_tx_rate: 10"}) {
    const std::string body = std::string(R"(physical_functions:
  - address: "0000:3b:00.0"
    num_vfs: 2
    vfs:
      - index: 1
        )") + setting + "\n";
    try {
      (void)r->plan(SimHost::config(body));
      FAIL() << setting << " planned on igb";
    } catch (const std::runtime_error& e) {
      EXPECT_THAT(e.what(), HasSubstr("VF 1"));
      EXPECT_THAT(e.what(), HasSubstr(std::string(setting).substr(0, std::string(setting).find(':'))));
      EXPECT_THAT(e.what(), HasSubstr("igb"));
    }
  }
  EXPECT_EQ(h.kernel.snapshot(), before);
  // "auto" is what igb reports for every VF: asking for it is no change.
  r->converge(SimHost::config(R"(physical_functions:
  - address: "0000:3b:00.0"
    num_vfs: 2
    vfs:
      - {index: 1, link_state: auto, min_tx_rate: 0, max_tx_rate: 0}
)"));
  EXPECT_EQ(h.control.num_vfs(kPf), 2U);
}

TEST(DriverRulesIgb, ARateWhileThePfHasNoLinkFailsThePlan) {
  SimHost h;
  h.kernel.behave_like_igb(kPf);
  h.kernel.set_pf_link(kPf, false);
  auto r = h.reconciler();
  try {
    (void)r->plan(SimHost::config(kIgb));
    FAIL() << "a rate planned with the PF's link down";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("max_tx_rate 200"));
    EXPECT_THAT(e.what(), HasSubstr("has a link"));
  }
}

TEST(DriverRulesIgb, RatesRefusedRightAfterTheVfsAreCreatedAreAskedAgain) {
  SimHost h;
  h.kernel.behave_like_igb(kPf, std::chrono::milliseconds(300));
  auto r = h.reconciler();
  r->converge(SimHost::config(kIgb));
  EXPECT_EQ(h.kernel.get("simpf0", 0).max_tx_rate, 200U);
  // Not for ever: a refusal that lasts fails after the bound, named.
  SimHost h2;
  h2.kernel.behave_like_igb(kPf, std::chrono::hours(1));
  h2.control.set_rate_retry(std::chrono::milliseconds(200));
  const std::string before = h2.kernel.snapshot();
  try {
    h2.reconciler()->converge(SimHost::config(kIgb));
    FAIL() << "applied a rate the driver refuses";
  } catch (const ApplyError& e) {
    EXPECT_THAT(e.what(), HasSubstr("tx rate"));
    EXPECT_THAT(e.what(), ::testing::Not(HasSubstr("rollback problem")));
  }
  EXPECT_EQ(h2.kernel.snapshot(), before);
}

TEST(DriverRulesIgb, RollbackRestoresOnlyWhatItChanged) {
  // A later step fails; undoing VF 0's settings must not ask igb for a
  // link state (which it refuses even as "auto").
  SimHost h;
  h.kernel.behave_like_igb(kPf);
  auto r = h.reconciler();
  const std::string before = h.kernel.snapshot();
  h.kernel.inject({"bus/pci/drivers_probe", EIO, 0, 1});
  try {
    r->converge(SimHost::config(kIgb));
    FAIL();
  } catch (const ApplyError& e) {
    EXPECT_THAT(e.what(), ::testing::Not(HasSubstr("rollback problem")));
  }
  EXPECT_EQ(h.kernel.snapshot(), before);
}

TEST(Restore, ASettingDroppedFromTheConfigGoesBack) {
  SimHost h;
  h.kernel.behave_like_igb(kPf);
  auto r = h.reconciler();
  r->converge(SimHost::config(kIgb));
  EXPECT_TRUE(r->plan(SimHost::config(kIgb)).empty()) << "a converged host has nothing to plan";
  std::string changed = kIgb;
  changed.replace(changed.find("        max_tx_rate: 200\n"), 25, "");
  r->converge(SimHost::config(changed));
  EXPECT_EQ(h.kernel.get("simpf0", 0).max_tx_rate, 0U);
  EXPECT_EQ(h.kernel.get("simpf0", 0).vlan, 100);
  EXPECT_TRUE(r->plan(SimHost::config(changed)).empty());
}

TEST(Restore, HandMadeVfsComeBackAsTheyWereAfterANumVfsChange) {
  SimHost h;
  h.kernel.behave_like_igb(kPf, std::chrono::milliseconds(0));
  // An operator's VFs: 2, bound to igbvf (autoprobe on), with settings.
  h.kernel.write("bus/pci/devices/0000:3b:00.0/sriov_numvfs", "2");
  VfSettings mine;
  mine.mac = MacAddress::parse("02:00:00:00:aa:00");
  mine.vlan = 7;
  mine.trust = true;
  h.kernel.set("simpf0", 0, mine);
  VfSettings rate;
  rate.max_tx_rate = 50;
  h.kernel.set("simpf0", 1, rate);
  const std::string hand = h.kernel.snapshot();
  ASSERT_EQ(h.control.driver(kVf1), "igbvf");
  auto r = h.reconciler();
  r->converge(SimHost::config(kIgb));  // 2 -> 3 VFs
  EXPECT_EQ(h.control.num_vfs(kPf), 3U);
  EXPECT_TRUE(r->plan(SimHost::config(kIgb)).empty());
  r->release_all();
  EXPECT_EQ(h.kernel.snapshot(), hand);
}

}  // namespace
}  // namespace sriovd::host
