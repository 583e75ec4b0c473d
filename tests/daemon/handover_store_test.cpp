// The handover through systemd's fd store (FDSTORE=1), against a store that
// keeps what systemd 252 keeps: one entry per open file - a second fd of a
// file it already holds is dropped, with its name (service_add_fd_store).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/kcmp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "../../src/daemon/handover.hpp"
#include "support/temp_dir.hpp"

namespace sriovd::daemon {
namespace {

bool same_file(int a, int b) { return ::syscall(SYS_kcmp, ::getpid(), ::getpid(), KCMP_FILE, a, b) == 0; }

UniqueFd memfd(const char* name) {
  UniqueFd fd(::memfd_create(name, MFD_CLOEXEC));
  EXPECT_TRUE(fd) << name;
  return fd;
}

// NOTIFY_SOCKET's other end: the fds sent with FDSTORE=1 by name, deduped
// by file as systemd does.
class FdStore {
 public:
  explicit FdStore(const std::string& path) : path_(path) {
    sock_ = UniqueFd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    path.copy(a.sun_path, sizeof(a.sun_path) - 1);
    EXPECT_EQ(::bind(sock_.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    ::setenv("NOTIFY_SOCKET", path.c_str(), 1);
  }
  ~FdStore() { ::unsetenv("NOTIFY_SOCKET"); }

  void receive() {
    for (;;) {
      std::array<char, 4096> text{};
      alignas(cmsghdr) std::array<char, CMSG_SPACE(sizeof(int) * 16)> control{};
      iovec iov{text.data(), text.size() - 1};
      msghdr m{};
      m.msg_iov = &iov;
      m.msg_iovlen = 1;
      m.msg_control = control.data();
      m.msg_controllen = control.size();
      const ssize_t n = ::recvmsg(sock_.get(), &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
      if (n < 0) return;
      std::vector<int> fds;
      for (cmsghdr* c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
          for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++i)
            fds.push_back(reinterpret_cast<int*>(CMSG_DATA(c))[i]);
      const std::string msg(text.data(), static_cast<size_t>(n));
      ASSERT_NE(msg.find("FDSTORE=1\n"), std::string::npos) << msg;
      const auto at = msg.find("FDNAME=");
      ASSERT_NE(at, std::string::npos) << msg;
      const std::string name = msg.substr(at + 7, msg.find('\n', at) - at - 7);
      for (int fd : fds) {
        bool held = false;
        for (const auto& [_, f] : by_name_) held = held || same_file(f.get(), fd);
        if (held)
          ::close(fd);
        else
          by_name_[name] = UniqueFd(fd);
      }
    }
  }
  // What the successor does with LISTEN_FDNAMES: the manifest, and the
  // fd the manifest calls N under "fdN".
  Handover take() {
    const std::function<int(int)> remap = [&](int n) {
      const auto it = by_name_.find("fd" + std::to_string(n));
      return it == by_name_.end() ? -1 : it->second.get();
    };
    return Handover::read_mapped(::dup(by_name_.at("manifest").get()), &remap);
  }
  [[nodiscard]] size_t size() const { return by_name_.size(); }

 private:
  std::string path_;
  UniqueFd sock_;
  std::map<std::string, UniqueFd> by_name_;
};

// Guest memory is one file with many fds (QEMU sends one per DMA window and
// per device): each one the predecessor held comes back, of the same file.
TEST(HandoverFdStore, FdsOfOneFileComeBackUnderTheFirstsName) {
  test::TempDir dir;
  FdStore store(dir.path() + "/notify");
  UniqueFd ram = memfd("ram");
  UniqueFd other = memfd("other");
  Handover h;
  h.from_pid = ::getpid();
  for (const char* name : {"vnet0", "vnet1"}) {
    HandedVirtio v;
    v.name = name;
    v.socket = dir.path() + "/" + name + ".sock";
    v.tap = std::string("tap-") + name;
    v.tap_fds.emplace_back(::dup(ram.get()));
    v.tap_fds.emplace_back(::dup(other.get()));
    v.tap_fds.emplace_back(::dup(ram.get()));
    h.virtio.push_back(std::move(v));
  }
  h.store();
  store.receive();
  EXPECT_EQ(store.size(), 3U) << "the manifest and one entry per file";
  const Handover got = store.take();
  ASSERT_EQ(got.virtio.size(), 2U);
  for (const HandedVirtio& v : got.virtio) {
    ASSERT_EQ(v.tap_fds.size(), 3U) << v.name;
    for (const UniqueFd& fd : v.tap_fds) ASSERT_TRUE(fd) << v.name << ": an fd did not come back";
    EXPECT_TRUE(same_file(v.tap_fds[0].get(), ram.get())) << v.name;
    EXPECT_TRUE(same_file(v.tap_fds[1].get(), other.get())) << v.name;
    EXPECT_TRUE(same_file(v.tap_fds[2].get(), ram.get())) << v.name;
    // Each one its own fd: closing one closes none of the others.
    EXPECT_NE(v.tap_fds[0].get(), v.tap_fds[2].get());
  }
}

TEST(HandoverFdStore, ABadAliasIsRefusedByName) {
  test::TempDir dir;
  FdStore store(dir.path() + "/notify");
  Handover h;
  h.from_pid = ::getpid();
  UniqueFd manifest = h.write({{7, 5}});
  // A manifest naming an alias that is not a number: rewritten by hand.
  const std::string text = R"({"version":2,"from_pid":1,"virtio":[],"vf_exports":[],"fd_aliases":{"x7":5}})";
  UniqueFd bad = memfd("bad");
  ASSERT_EQ(::write(bad.get(), text.data(), text.size()), static_cast<ssize_t>(text.size()));
  const std::function<int(int)> remap = [](int) { return -1; };
  try {
    (void)Handover::read_mapped(bad.release(), &remap);
    FAIL() << "a bad alias was read";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("fd alias 'x7'"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW((void)Handover::read_mapped(manifest.release(), &remap));
}

}  // namespace
}  // namespace sriovd::daemon
