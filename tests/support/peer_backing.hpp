#pragma once
// The files a peer may back shared memory with (SECURITY.md: "whatever its
// backing"): a memfd, a hugetlb memfd, a file on hugetlbfs and a file on
// tmpfs. Huge pages are reserved for the test's lifetime (root only: a
// test that gets none says so and skips) and given back after; a hugetlbfs
// is mounted in a temporary directory for the file case.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>

#include "sriovd/util/fd.hpp"

namespace sriovd::test {

enum class Backing { memfd, hugetlb_memfd, hugetlbfs_file, tmpfs_file };

inline const char* backing_name(Backing b) {
  switch (b) {
    case Backing::memfd: return "memfd";
    case Backing::hugetlb_memfd: return "hugetlb_memfd";
    case Backing::hugetlbfs_file: return "hugetlbfs_file";
    case Backing::tmpfs_file: return "tmpfs_file";
  }
  return "?";
}

inline constexpr size_t kHugePage = 2U << 20U;

// N more 2 MiB huge pages in the host's pool while it lives (the change
// serialised with other test processes by a lock file; added and taken
// back, never set, so that two tests at once keep each other's pages).
class HugePages {
 public:
  explicit HugePages(unsigned n) : n_(n) {
    if (::geteuid() != 0) {
      why_ = "reserving huge pages needs root";
      return;
    }
    if (!adjust(static_cast<long>(n))) return;
    held_ = true;
  }
  ~HugePages() {
    if (held_) adjust(-static_cast<long>(n_));
  }
  HugePages(const HugePages&) = delete;
  HugePages& operator=(const HugePages&) = delete;
  [[nodiscard]] bool ok() const { return held_; }
  [[nodiscard]] const std::string& why() const { return why_; }

 private:
  static constexpr const char* kPool = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages";
  bool adjust(long delta) {
    UniqueFd lock(::open("/run/sriovd-test-hugepages.lock", O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    if (!lock.valid() || ::flock(lock.get(), LOCK_EX) != 0) {
      why_ = "cannot lock the huge page pool";
      return false;
    }
    long now = 0;
    {
      std::ifstream in(kPool);
      if (!(in >> now)) {
        why_ = std::string("cannot read ") + kPool;
        return false;
      }
    }
    std::ofstream out(kPool);
    out << (now + delta < 0 ? 0 : now + delta);
    out.close();
    long after = 0;
    std::ifstream check(kPool);
    check >> after;
    if (delta > 0 && after < now + delta) {
      why_ = "the kernel gave " + std::to_string(after - now) + " of " + std::to_string(delta) + " huge pages";
      std::ofstream undo(kPool);
      undo << now;
      return false;
    }
    return true;
  }
  unsigned n_;
  bool held_ = false;
  std::string why_;
};

// A hugetlbfs mounted in a fresh directory while it lives (root).
class HugetlbfsMount {
 public:
  HugetlbfsMount() {
    char tmpl[] = "/tmp/sriovd-hugetlbfs.XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return;
    dir_ = tmpl;
    if (::mount("none", dir_.c_str(), "hugetlbfs", 0, "pagesize=2M") != 0) {
      ::rmdir(dir_.c_str());
      dir_.clear();
    }
  }
  ~HugetlbfsMount() {
    if (dir_.empty()) return;
    ::umount2(dir_.c_str(), MNT_DETACH);
    ::rmdir(dir_.c_str());
  }
  HugetlbfsMount(const HugetlbfsMount&) = delete;
  HugetlbfsMount& operator=(const HugetlbfsMount&) = delete;
  [[nodiscard]] const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
};

// A file of `size` bytes (rounded up to the backing's page) on `b`; invalid
// when the backing cannot be had here (why() of the pool or the mount).
inline UniqueFd make_backing(Backing b, size_t size, const std::string& hugetlbfs_dir = "") {
  const bool huge = b == Backing::hugetlb_memfd || b == Backing::hugetlbfs_file;
  if (huge) size = (size + kHugePage - 1) & ~(kHugePage - 1);
  UniqueFd fd;
  switch (b) {
    case Backing::memfd: fd.reset(::memfd_create("peer-backing", MFD_CLOEXEC)); break;
    case Backing::hugetlb_memfd: fd.reset(::memfd_create("peer-backing", MFD_CLOEXEC | MFD_HUGETLB)); break;
    case Backing::hugetlbfs_file:
    case Backing::tmpfs_file: {
      std::string path = (b == Backing::tmpfs_file ? std::string("/dev/shm") : hugetlbfs_dir) + "/peer-backing.XXXXXX";
      if (b == Backing::hugetlbfs_file && hugetlbfs_dir.empty()) return {};
      fd.reset(::mkstemp(path.data()));
      if (fd.valid()) ::unlink(path.c_str());
      break;
    }
  }
  if (fd.valid() && ::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) fd.reset();
  return fd;
}

}  // namespace sriovd::test
