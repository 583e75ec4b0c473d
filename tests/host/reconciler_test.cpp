// Planning, transactions, rollback and crash recovery against the simulated
// host. The central property: whatever fails, wherever, the host ends where
// it started or where the config says, never in between.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "sim_fixture.hpp"

namespace sriovd::host {
namespace {

using test::kPf;
using test::kThreeVfs;
using test::SimHost;
using ::testing::HasSubstr;

using test::kVf0;
using test::kVf1;
using test::kVf2;

json binding(HostControl& c, const PciAddress& dev) { return c.get(Key{KeyKind::binding, dev}); }

TEST(Reconciler, AppliesTheConfigAndReleaseRestoresTheHostExactly) {
  SimHost h;
  const std::string initial = h.kernel.snapshot();
  auto r = h.reconciler();
  const auto steps = r->converge(SimHost::config(kThreeVfs));
  EXPECT_FALSE(steps.empty());

  EXPECT_EQ(h.control.num_vfs(kPf), 3U);
  EXPECT_EQ(h.control.get(Key{KeyKind::autoprobe, kPf}), false);
  EXPECT_EQ(binding(h.control, kVf0), (json{{"driver", "vfio-pci"}, {"override", "vfio-pci"}}));
  EXPECT_EQ(binding(h.control, kVf1), (json{{"driver", "vfio-pci"}, {"override", "vfio-pci"}}));
  EXPECT_EQ(h.control.driver(kVf2), "iavf");  // not assigned: its own driver
  const VfSettings s0 = h.kernel.get("simpf0", 0);
  EXPECT_EQ(s0.mac->to_string(), "02:00:00:00:00:10");
  EXPECT_EQ(s0.vlan, 100);
  EXPECT_EQ(s0.qos, 2);
  EXPECT_EQ(s0.spoofchk, false);
  EXPECT_EQ(h.kernel.get("simpf0", 1).trust, true);
  EXPECT_EQ(h.kernel.get("simpf0", 2).link_state, "enable");
  EXPECT_EQ(h.kernel.get("simpf0", 2).max_tx_rate, 1000U);
  EXPECT_FALSE(r->ledger().empty());
  EXPECT_TRUE(std::filesystem::exists(r->state_path()));

  // Converging again changes nothing.
  EXPECT_TRUE(r->plan(SimHost::config(kThreeVfs)).empty());

  r->release_all();
  EXPECT_EQ(h.kernel.snapshot(), initial);
  EXPECT_TRUE(r->ledger().empty());
}

// The MTU of a VF on its own driver: set on its netdev after the binding,
// given back when the config drops it, refused by the driver as a step
// that rolls the whole apply back.
TEST(Reconciler, AVfNetdevMtuIsSetAndGivenBack) {
  SimHost h;
  const std::string initial = h.kernel.snapshot();
  auto r = h.reconciler();
  const std::string with_mtu = std::string(kThreeVfs) + "        mtu: 9000\n";
  const auto steps = r->converge(SimHost::config(with_mtu.c_str()));
  const Key mtu{KeyKind::vf_mtu, kPf, 2};
  EXPECT_EQ(h.control.get(mtu), (json{{"mtu", 9000}}));
  EXPECT_TRUE(std::any_of(steps.begin(), steps.end(), [&](const Step& s) { return s.key == mtu; }));
  EXPECT_TRUE(r->plan(SimHost::config(with_mtu.c_str())).empty());
  // The config without it: the netdev's MTU as it was.
  r->converge(SimHost::config(kThreeVfs));
  EXPECT_EQ(h.control.get(mtu), (json{{"mtu", 1500}}));
  // One the driver refuses: the apply fails naming it, and the host is as before.
  const std::string before = h.kernel.snapshot();
  const std::string too_big = std::string(kThreeVfs) + "        mtu: 12000\n";
  try {
    r->converge(SimHost::config(too_big.c_str()));
    ADD_FAILURE() << "an MTU above the driver's maximum was applied";
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), HasSubstr("netdev MTU 1500 -> 12000")) << e.what();
    EXPECT_THAT(e.what(), HasSubstr("out of range")) << e.what();
  }
  EXPECT_EQ(h.kernel.snapshot(), before);
  r->converge(SimHost::config(with_mtu.c_str()));
  r->release_all();
  EXPECT_EQ(h.kernel.snapshot(), initial);
}

TEST(Reconciler, PlanDoesNotTouchTheHost) {
  SimHost h;
  const std::string initial = h.kernel.snapshot();
  const unsigned ops = h.kernel.operations();
  auto r = h.reconciler();
  const auto steps = r->plan(SimHost::config(kThreeVfs));
  ASSERT_GE(steps.size(), 8U);
  EXPECT_EQ(steps[0].describe(), "0000:3b:00.0: sriov_drivers_autoprobe 1 -> 0");
  EXPECT_EQ(steps[1].describe(), "0000:3b:00.0: sriov_numvfs 0 -> 3");
  EXPECT_EQ(h.kernel.snapshot(), initial);
  EXPECT_EQ(h.kernel.operations(), ops);
}

// A fault injected at every mutating operation of a multi-VF apply: after
// each, the host model equals its starting state and the journal is clean.
TEST(Reconciler, AFaultAtEveryStepOfAnApplyRollsBackToTheStart) {
  unsigned total = 0;
  {
    SimHost h;
    const unsigned before = h.kernel.operations();
    h.reconciler()->converge(SimHost::config(kThreeVfs));
    total = h.kernel.operations() - before;
  }
  ASSERT_GE(total, 10U);  // autoprobe, numvfs, 6 settings writes, 2 binds and more
  for (unsigned k = 0; k < total; ++k) {
    SimHost h;
    const std::string initial = h.kernel.snapshot();
    auto r = h.reconciler();
    h.kernel.fail_nth_operation(k, k % 2 ? EBUSY : EIO);
    try {
      r->converge(SimHost::config(kThreeVfs));
      ADD_FAILURE() << "operation " << k << ": no failure";
    } catch (const ApplyError& e) {
      EXPECT_THAT(e.what(), HasSubstr("rolled back")) << k;
      EXPECT_THAT(e.what(), ::testing::Not(HasSubstr("rollback problem"))) << k << ": " << e.what();
    }
    EXPECT_EQ(h.kernel.snapshot(), initial) << "after a fault at operation " << k;
    EXPECT_EQ(r->counters().rolled_back, 1U) << k;
    EXPECT_EQ(r->counters().restore_failures, 0U) << k << ": everything was given back";
    EXPECT_TRUE(r->ledger().empty()) << k;
    // The journal on disk agrees: nothing to recover.
    EXPECT_TRUE(h.reconciler()->recover().empty()) << k;
  }
}

// The same for a release: a failed release leaves the host as configured.
TEST(Reconciler, AFaultAtEveryStepOfAReleaseKeepsTheAppliedState) {
  unsigned total = 0;
  {
    SimHost h;
    auto r = h.reconciler();
    r->converge(SimHost::config(kThreeVfs));
    const unsigned before = h.kernel.operations();
    r->release_all();
    total = h.kernel.operations() - before;
  }
  for (unsigned k = 0; k < total; ++k) {
    SimHost h;
    auto r = h.reconciler();
    r->converge(SimHost::config(kThreeVfs));
    const std::string applied = h.kernel.snapshot();
    h.kernel.fail_nth_operation(k, EIO);
    EXPECT_THROW(r->release_all(), ApplyError) << k;
    EXPECT_EQ(h.kernel.snapshot(), applied) << "after a fault at release operation " << k;
    EXPECT_EQ(r->counters().restore_failures, 1U) << k << ": a release that failed did not give the host back";
    h.kernel.clear_faults();
    r->release_all();  // and a later release still works
    EXPECT_EQ(r->counters().restore_failures, 1U) << k;
  }
}

// The daemon dies (SIGKILL) between any two steps: the journal on disk lets
// the next start put the host back, and then converge to the config.
TEST(Reconciler, ACrashAtAnyStepIsRecoveredByTheNextStart) {
  struct Crash {};
  size_t total = 0;
  {
    SimHost h;
    total = h.reconciler()->plan(SimHost::config(kThreeVfs)).size();
  }
  std::string configured;
  {
    SimHost h;
    h.reconciler()->converge(SimHost::config(kThreeVfs));
    configured = h.kernel.snapshot();
  }
  for (size_t k = 0; k <= total; ++k) {
    SimHost h;
    const std::string initial = h.kernel.snapshot();
    {
      auto r = h.reconciler();
      r->before_step = [k](const Step&, size_t i) {
        if (i == k) throw Crash{};
      };
      if (k < total) {
        EXPECT_THROW(r->converge(SimHost::config(kThreeVfs)), Crash);
      } else {
        r->converge(SimHost::config(kThreeVfs));
      }
    }
    auto next = h.reconciler();  // a new daemon reads the journal
    next->recover();
    if (k < total) {
      EXPECT_EQ(h.kernel.snapshot(), initial) << "crash before step " << k;
    }
    next->converge(SimHost::config(kThreeVfs));
    EXPECT_EQ(h.kernel.snapshot(), configured) << "crash before step " << k;
    next->release_all();
    EXPECT_EQ(h.kernel.snapshot(), initial) << "crash before step " << k;
  }
}

TEST(Reconciler, AVfBoundByHandMidApplyRollsBackCleanly) {
  SimHost h;
  const std::string initial = h.kernel.snapshot();
  auto r = h.reconciler();
  // Mid-apply, someone binds VF 1 to pci-stub by hand, and pci-stub does
  // not let go of it when sriovd asks.
  r->before_step = [&](const Step& s, size_t) {
    if (s.key.kind == KeyKind::binding && s.key.vf == 1) {
      h.kernel.bind_by_hand(kVf1, "pci-stub");
      h.kernel.inject({"drivers/pci-stub/unbind", EBUSY, 0, 1});
    }
  };
  try {
    r->converge(SimHost::config(kThreeVfs));
    FAIL();
  } catch (const ApplyError& e) {
    EXPECT_THAT(e.what(), HasSubstr("(0000:3b:00.0 VF 1: driver pci-stub -> vfio-pci)"));
    EXPECT_THAT(e.what(), HasSubstr("injected fault on bus/pci/drivers/pci-stub/unbind"));
    EXPECT_THAT(e.what(), HasSubstr("rolled back"));
    EXPECT_THAT(e.what(), ::testing::Not(HasSubstr("rollback problem")));
  }
  EXPECT_EQ(h.kernel.snapshot(), initial);
}

// A step fails and so does its undo: the host is not given back, which the
// error says and the counters count (sriovd_host_restore_failures_total).
TEST(Reconciler, AnUndoThatFailsIsARestoreFailure) {
  SimHost h;
  auto r = h.reconciler();
  // VF 1's binding fails; so does giving its settings back (the first
  // netlink write to it, the apply's, goes through).
  h.kernel.inject({"0000:3b:02.1/driver_override", EBUSY, 0, 1});
  h.kernel.inject({"/vf1", EBUSY, 1, 1});
  try {
    r->converge(SimHost::config(kThreeVfs));
    FAIL();
  } catch (const ApplyError& e) {
    EXPECT_THAT(e.what(), HasSubstr("rollback problem: 0000:3b:00.0 VF 1"));
  }
  EXPECT_EQ(r->counters().rolled_back, 1U);
  EXPECT_EQ(r->counters().restore_failures, 1U);
  EXPECT_EQ(r->counters().committed, 0U);
}

TEST(Reconciler, ANonViableIommuGroupNamesTheOffendingDevice) {
  SimHost h;
  const std::string initial = h.kernel.snapshot();
  auto r = h.reconciler();
  r->before_step = [&](const Step& s, size_t) {
    if (s.key.kind == KeyKind::binding && s.key.vf == 0 && !h.kernel.exists("bus/pci/devices/0000:5e:00.0"))
      h.kernel.add_device(*PciAddress::parse("0000:5e:00.0"), 0x1af4, 0x1041, 0x020000, "virtio-pci",
                          h.kernel.iommu_group_of(kVf0));
  };
  try {
    r->converge(SimHost::config(kThreeVfs));
    FAIL();
  } catch (const ApplyError& e) {
    EXPECT_THAT(e.what(), HasSubstr("is not viable: member 0000:5e:00.0 is bound to virtio-pci"));
  }
  // The foreign device stays; everything sriovd did is undone.
  EXPECT_EQ(h.control.num_vfs(kPf), 0U);
  EXPECT_EQ(h.control.get(Key{KeyKind::autoprobe, kPf}), true);
  EXPECT_EQ(h.control.driver(*PciAddress::parse("0000:5e:00.0")), "virtio-pci");
  EXPECT_NE(h.kernel.snapshot(), initial);
}

// The classic trap: drivers_probe "succeeds" and no driver binds, because
// vfio-pci is not loaded. It is an error, and the apply is undone.
TEST(Reconciler, ProbeThatBindsNothingIsCaught) {
  SimHost h;
  const std::string initial = h.kernel.snapshot();
  h.kernel.set_driver_loaded("vfio-pci", false);
  try {
    h.reconciler()->converge(SimHost::config(kThreeVfs));
    FAIL();
  } catch (const ApplyError& e) {
    EXPECT_THAT(e.what(), HasSubstr("binding 0000:3b:02.0 to vfio-pci: drivers_probe succeeded but the device is "
                                    "bound to no driver (is the vfio-pci module loaded?)"));
    EXPECT_THAT(e.what(), ::testing::Not(HasSubstr("rollback problem")));
  }
  EXPECT_EQ(h.kernel.snapshot(), initial);
}

TEST(Reconciler, LateVfsAreWaitedForWithADeadline) {
  {
    SimHost h;
    h.kernel.delay_vf_appearance(std::chrono::milliseconds(150));
    h.reconciler()->converge(SimHost::config(kThreeVfs));
    EXPECT_EQ(h.control.driver(kVf0), "vfio-pci");
  }
  SimHost h(std::chrono::milliseconds(50));
  const std::string initial = h.kernel.snapshot();
  h.kernel.delay_vf_appearance(std::chrono::milliseconds(2000));
  try {
    h.reconciler()->converge(SimHost::config(kThreeVfs));
    FAIL();
  } catch (const ApplyError& e) {
    EXPECT_THAT(e.what(), HasSubstr("0 of 3 VFs appeared within 50 ms"));
  }
  EXPECT_EQ(h.control.num_vfs(kPf), 0U);
  (void)initial;
}

TEST(Reconciler, RefusesToChangeNumvfsUnderSomeoneElsesVfs) {
  SimHost h;
  h.kernel.write("bus/pci/devices/0000:3b:00.0/sriov_numvfs", "2");
  h.kernel.bind_by_hand(kVf1, "vfio-pci");
  try {
    h.reconciler()->plan(SimHost::config(kThreeVfs));
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(),
                 "PF 0000:3b:00.0: VF 0000:3b:02.1 is bound to vfio-pci by someone else; refusing to change "
                 "sriov_numvfs from 2 to 3");
  }
}

TEST(Reconciler, MissingOrNonSriovPfIsAPlanError) {
  SimHost h;
  h.kernel.add_device(*PciAddress::parse("0000:5e:00.0"), 0x8086, 0x10d3, 0x020000, "e1000e");
  auto cfg = SimHost::config("");
  config::PfConfig pf;
  pf.ref.address = PciAddress::parse("0000:5e:00.0");
  pf.num_vfs = 1;
  cfg.physical_functions.push_back(pf);
  EXPECT_THROW(
      {
        try {
          h.reconciler()->plan(cfg);
        } catch (const std::runtime_error& e) {
          EXPECT_THAT(e.what(), HasSubstr("does not support SR-IOV"));
          throw;
        }
      },
      std::runtime_error);
}

TEST(Reconciler, ReloadAppliesTheDiffAndReleasingOneVfGivesItBack) {
  SimHost h;
  const std::string initial = h.kernel.snapshot();
  auto r = h.reconciler();
  r->converge(SimHost::config(kThreeVfs));
  // VF 1 released: back to its own driver; nothing else moves.
  const auto steps = r->converge(SimHost::config(kThreeVfs), {{kPf, 1}});
  ASSERT_EQ(steps.size(), 1U) << steps.front().describe();
  EXPECT_EQ(h.control.driver(kVf1), "iavf");
  EXPECT_EQ(h.control.driver(kVf0), "vfio-pci");
  EXPECT_EQ(h.kernel.read("bus/pci/devices/0000:3b:02.1/driver_override"), "(null)");

  // A new config with 2 VFs: numvfs goes through 0, VF 0 is bound again.
  std::string two = kThreeVfs;
  two.replace(two.find("num_vfs: 3"), 10, "num_vfs: 2");
  two = two.substr(0, two.find("      - index: 2"));
  r->converge(SimHost::config(two));
  EXPECT_EQ(h.control.num_vfs(kPf), 2U);
  EXPECT_EQ(h.control.driver(kVf0), "vfio-pci");
  EXPECT_EQ(h.control.driver(kVf1), "vfio-pci");

  r->release_all();
  EXPECT_EQ(h.kernel.snapshot(), initial);
}

TEST(Reconciler, PreexistingVfsAreRestoredOneByOne) {
  SimHost h;
  // An operator created the VFs and set a MAC before sriovd came.
  h.kernel.write("bus/pci/devices/0000:3b:00.0/sriov_numvfs", "3");
  VfSettings mac;
  mac.mac = MacAddress::parse("02:aa:00:00:00:01");
  h.kernel.set("simpf0", 0, mac);
  const std::string initial = h.kernel.snapshot();
  auto r = h.reconciler();
  r->converge(SimHost::config(kThreeVfs));
  EXPECT_EQ(h.control.driver(kVf0), "vfio-pci");
  EXPECT_EQ(h.kernel.get("simpf0", 0).mac->to_string(), "02:00:00:00:00:10");
  r->release_all();
  EXPECT_EQ(h.kernel.snapshot(), initial);
  EXPECT_EQ(h.control.driver(kVf0), "iavf");
  EXPECT_EQ(h.kernel.get("simpf0", 0).mac->to_string(), "02:aa:00:00:00:01");
}

TEST(StateFile, CorruptJournalIsRefusedWithAReason) {
  sriovd::test::TempDir dir;
  dir.write("state.json", "{not json");
  try {
    (void)StateFile(dir.file("state.json")).load();
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("is corrupt"));
    EXPECT_THAT(e.what(), HasSubstr("will not overwrite it"));
  }
}

TEST(StateFile, RoundTripsLedgerAndTransaction) {
  sriovd::test::TempDir dir;
  StateFile f(dir.file("sub/state.json"));
  Journal j;
  j.ledger.record(Key{KeyKind::numvfs, kPf}, json{{"numvfs", 0}});
  Transaction t;
  t.id = 4;
  t.kind = "apply";
  Step s;
  s.key = Key{KeyKind::binding, kPf, 1};
  s.after = json{{"driver", "vfio-pci"}, {"override", "vfio-pci"}};
  s.status = "pending";
  t.steps.push_back(s);
  j.txn = t;
  f.save(j);
  const Journal back = f.load();
  ASSERT_EQ(back.ledger.entries().size(), 1U);
  ASSERT_TRUE(back.txn);
  EXPECT_EQ(back.txn->steps[0].key, s.key);
  EXPECT_EQ(back.txn->steps[0].status, "pending");
  EXPECT_FALSE(std::filesystem::exists(dir.file("sub/state.json.tmp")));
}

}  // namespace
}  // namespace sriovd::host

namespace sriovd::host {
namespace {

// A VMM that still holds a VF's VFIO device (given its fd: bar_access
// mmap) would make the unbind from vfio-pci wait in the kernel until it
// lets go. The host layer asks first, waits a bounded time, and then fails
// naming the holder, with the VF left on vfio-pci; once the holder is gone
// the same release goes through.
TEST(Reconciler, AReleaseWaitsBoundedForAVfioHolderAndThenNamesIt) {
  SimHost h;
  auto r = h.reconciler();
  r->converge(SimHost::config(kThreeVfs));
  std::string holder = "pid 4242 (qemu-system-x86) fd 23";
  unsigned asked = 0;
  h.control.set_release_check(
      [&](const PciAddress& dev) {
        ++asked;
        return dev == kVf0 ? holder : std::string();
      },
      std::chrono::milliseconds(200));
  try {
    r->release_all();
    FAIL() << "a held VF was unbound";
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), HasSubstr("unbinding 0000:3b:02.0 from vfio-pci: its VFIO device is still held by "
                                    "pid 4242 (qemu-system-x86) fd 23 after 200 ms"));
  }
  EXPECT_GT(asked, 2U) << "it did not wait for the holder";
  EXPECT_EQ(h.control.driver(kVf0), "vfio-pci") << "the held VF left vfio-pci";
  holder.clear();  // the VMM exits
  r->release_all();
  EXPECT_NE(h.control.driver(kVf0), "vfio-pci");
}

}  // namespace
}  // namespace sriovd::host
