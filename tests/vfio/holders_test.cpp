// Who holds a VF's VFIO device (vfio/holders): read from a /proc tree the
// test builds, as the kernel shows it - fd links to the vfio-device anon
// inode, fdinfo with or without vfio-device-syspath, BAR mappings in maps.
#include "sriovd/vfio/holders.hpp"

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <future>

#include <gtest/gtest.h>

#include "support/process.hpp"
#include "support/temp_dir.hpp"

namespace sriovd::vfio {
namespace {

namespace fs = std::filesystem;

class FakeProc {
 public:
  explicit FakeProc(const std::string& root) : root_(root) {}
  void process(pid_t pid, const std::string& comm) {
    fs::create_directories(dir(pid) + "/fd");
    fs::create_directories(dir(pid) + "/fdinfo");
    std::ofstream(dir(pid) + "/comm") << comm << "\n";
    std::ofstream(dir(pid) + "/maps") << "55d0c0000000-55d0c0001000 r-xp 00000000 08:01 123 /usr/bin/" << comm << "\n";
  }
  void fd(pid_t pid, int fd, const std::string& link, const std::string& syspath = "") {
    fs::create_symlink(link, dir(pid) + "/fd/" + std::to_string(fd));
    std::ofstream info(dir(pid) + "/fdinfo/" + std::to_string(fd));
    info << "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t1057\n";
    if (!syspath.empty()) info << "vfio-device-syspath: " << syspath << "\n";
  }
  void bar_mapping(pid_t pid) {
    std::ofstream(dir(pid) + "/maps", std::ios::app)
        << "7f0000000000-7f0000004000 rw-s 00000000 00:0e 1057 anon_inode:[vfio-device]\n";
  }

 private:
  std::string dir(pid_t pid) const { return root_ + "/" + std::to_string(pid); }
  std::string root_;
};

const std::string kVf = "0000:3b:02.0";
const std::string kSys = "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:02.0";

TEST(DeviceHolders, AnFdNamedByItsSyspathIsAHolderWhoeverHasIt) {
  test::TempDir dir;
  FakeProc proc(dir.path());
  proc.process(4242, "qemu-system-x86");
  proc.fd(4242, 3, "/dev/null");
  proc.fd(4242, 23, "anon_inode:[vfio-device]", kSys);
  proc.process(4343, "other-vmm");
  proc.fd(4343, 9, "anon_inode:[vfio-device]", "/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:02.1");
  const auto h = device_holders(kVf, {}, dir.path());
  ASSERT_EQ(h.size(), 1U);
  EXPECT_EQ(h[0].pid, 4242);
  EXPECT_EQ(h[0].comm, "qemu-system-x86");
  EXPECT_EQ(h[0].what, "fd 23");
  EXPECT_EQ(describe(h), "pid 4242 (qemu-system-x86) fd 23");
}

// Kernels before 6.18 do not say which device an fd is: it counts only for
// a process the daemon gave this device's fd to; so does a BAR mapping.
TEST(DeviceHolders, WithoutASyspathOnlyTheProcessesGivenTheFdCount) {
  test::TempDir dir;
  FakeProc proc(dir.path());
  proc.process(4242, "qemu-system-x86");
  proc.fd(4242, 23, "anon_inode:[vfio-device]");
  proc.process(4343, "other-vmm");
  proc.fd(4343, 9, "anon_inode:[vfio-device]");
  proc.process(4444, "closed-fd-kept-bar");
  proc.bar_mapping(4444);
  const pid_t given[] = {4242, 4444};
  const auto h = device_holders(kVf, given, dir.path());
  ASSERT_EQ(h.size(), 2U) << describe(h);
  EXPECT_EQ(h[0].pid, 4242);
  EXPECT_NE(h[0].what.find("the kernel does not say which"), std::string::npos);
  EXPECT_EQ(h[1].pid, 4444);
  EXPECT_EQ(h[1].what, "a BAR mapping");
}

TEST(DeviceHolders, NobodyAndThisProcessAreNoHolders) {
  test::TempDir dir;
  FakeProc proc(dir.path());
  proc.process(::getpid(), "sriovd");
  proc.fd(::getpid(), 5, "anon_inode:[vfio-device]", kSys);
  proc.process(4242, "idle");
  const pid_t given[] = {4242, ::getpid()};
  EXPECT_TRUE(device_holders(kVf, given, dir.path()).empty());
  EXPECT_TRUE(device_holders(kVf, {}, dir.path() + "/missing").empty());
}

// Issue 24 item 4: a status (built for every Prometheus scrape) walked
// every process's fds on the control thread. A survey is its own thread's
// work: looking never waits for a walk, and however often a status looks,
// walks come at most once per interval.
TEST(HolderSurvey, LookingNeverWaitsForAWalkAndWalksAreRateLimited) {
  using namespace std::chrono_literals;
  std::promise<void> go;
  std::shared_future<void> released = go.get_future().share();
  std::atomic<int> walks{0};
  HolderSurvey survey(200ms, [&](const std::string& device, std::span<const pid_t> given) {
    ++walks;
    released.wait();  // a walk of a host with a great many fds
    return std::vector<Holder>{{given.empty() ? 0 : given[0], "qemu\n<0>forged", "fd 7 of " + device}};
  });
  survey.watch({{"0000:3b:02.0", {4242}}});
  // While the first walk is stuck, looking answers at once: nothing yet.
  auto looks = std::async(std::launch::async, [&] {
    for (int i = 0; i < 1000; ++i)
      if (!survey.seen("0000:3b:02.0").holders.empty()) return false;
    return true;
  });
  ASSERT_EQ(looks.wait_for(5s), std::future_status::ready) << "a look waited for the walk";
  EXPECT_TRUE(looks.get());
  ASSERT_TRUE(test::wait_until([&] { return walks.load() == 1; }, 2s));
  go.set_value();
  ASSERT_TRUE(test::wait_until([&] { return !survey.seen("0000:3b:02.0").holders.empty(); }, 5s));
  const auto seen = survey.seen("0000:3b:02.0");
  EXPECT_EQ(seen.holders[0].pid, 4242);
  EXPECT_EQ(describe(seen.holders).find('\n'), std::string::npos) << "a process's name forged a log line";
  // A thousand looks in a burst: at most a couple of walks more.
  const int before = walks.load();
  for (int i = 0; i < 1000; ++i) (void)survey.seen("0000:3b:02.0");
  EXPECT_LE(walks.load() - before, 2);
  // Nothing watched: no walk at all.
  survey.watch({});
  EXPECT_TRUE(survey.seen("0000:3b:02.0").holders.empty());
}

}  // namespace
}  // namespace sriovd::vfio
