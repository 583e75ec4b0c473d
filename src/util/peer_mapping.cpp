#include "sriovd/util/peer_mapping.hpp"
#include "sriovd/util/hex.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

namespace sriovd {

namespace {

struct Slot {
  std::atomic<uintptr_t> base{0};  // 0: free
  std::atomic<size_t> length{0};
  std::atomic<bool> faulted{false};
};

Slot g_slots[PeerMapping::kMaxPeerMappings];
std::atomic<uint64_t> g_faults{0};
std::mutex g_register;    // registration only; the handler takes no lock
uintptr_t g_page = 4096;  // set before the handler is installed (sysconf is not for handlers)
struct sigaction g_previous {};

// A SIGBUS on a registered mapping: a zero page over the faulting one (the
// file's page is gone; the peer broke its own memory), the fault noted, and
// the access restarts. Anything else goes to whoever handled SIGBUS before
// (by default: the process dies with a core, as it should).
void on_sigbus(int signo, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Slot& s : g_slots) {
    const uintptr_t base = s.base.load(std::memory_order_acquire);
    if (base == 0 || addr < base || addr - base >= s.length.load(std::memory_order_acquire)) continue;
    const uintptr_t page = addr & ~(g_page - 1);
    void* p = ::mmap(reinterpret_cast<void*>(page), g_page, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) break;
    s.faulted.store(true, std::memory_order_release);
    g_faults.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (g_previous.sa_flags & SA_SIGINFO) {
    g_previous.sa_sigaction(signo, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(signo);
    return;
  }
  ::signal(SIGBUS, SIG_DFL);
  ::raise(SIGBUS);
}

void install_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (::sigaction(SIGBUS, &sa, &g_previous) != 0) throw std::runtime_error("installing the SIGBUS handler");
  });
}

}  // namespace

PeerMapping::PeerMapping(void* base, size_t length) {
  install_once();
  std::lock_guard lock(g_register);
  for (size_t i = 0; i < kMaxPeerMappings; ++i) {
    if (g_slots[i].base.load(std::memory_order_relaxed) != 0) continue;
    g_slots[i].faulted.store(false, std::memory_order_relaxed);
    g_slots[i].length.store(length, std::memory_order_release);
    g_slots[i].base.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
    slot_ = static_cast<int>(i);
    return;
  }
  throw std::runtime_error("more than " + std::to_string(kMaxPeerMappings) + " peer memory mappings");
}

PeerMapping::~PeerMapping() { release(); }

PeerMapping::PeerMapping(PeerMapping&& other) noexcept : slot_(std::exchange(other.slot_, -1)) {}

PeerMapping& PeerMapping::operator=(PeerMapping&& other) noexcept {
  if (this != &other) {
    release();
    slot_ = std::exchange(other.slot_, -1);
  }
  return *this;
}

// Before the owner unmaps: the handler must not take a later fault at that
// address (someone else's mapping by then) for this one.
void PeerMapping::release() {
  if (slot_ < 0) return;
  std::lock_guard lock(g_register);
  g_slots[slot_].base.store(0, std::memory_order_release);
  g_slots[slot_].length.store(0, std::memory_order_release);
  slot_ = -1;
}

bool PeerMapping::faulted() const { return slot_ >= 0 && g_slots[slot_].faulted.load(std::memory_order_acquire); }

uint64_t peer_mapping_faults() { return g_faults.load(std::memory_order_relaxed); }

std::string peer_memory_problem(int fd, uint64_t offset, uint64_t size) {
  if (size == 0) return "an empty range";
  if (offset > UINT64_MAX - size) return "offset " + hex(offset) + " + size " + hex(size) + " wraps";
  struct stat st {};
  if (::fstat(fd, &st) != 0) return std::string("fstat of its fd: ") + std::strerror(errno);
  // A device node or socket has no size to check a mapping against.
  if (!S_ISREG(st.st_mode)) return "its fd is not a file that can back memory (memfd, tmpfs, hugetlbfs)";
  if (static_cast<uint64_t>(st.st_size) < offset + size)
    return "its file has only " + hex(static_cast<uint64_t>(st.st_size)) + " bytes, " + hex(offset + size) + " needed";
  struct statfs fs {};
  if (::fstatfs(fd, &fs) != 0) return std::string("fstatfs of its fd: ") + std::strerror(errno);
  struct Remote {
    unsigned long magic;
    const char* name;
  };
  static constexpr Remote kRemote[] = {{0x65735546UL, "FUSE"}, {0x6969UL, "NFS"},    {0xfe534d42UL, "SMB2"},
                                       {0xff534d42UL, "CIFS"}, {0x01021997UL, "9p"}, {0x00c36400UL, "Ceph"}};
  for (const Remote& r : kRemote)
    if (static_cast<unsigned long>(fs.f_type) == r.magic)
      return std::string("its file is on ") + r.name +
             ", whose page faults another process or the network serves (use a memfd, tmpfs or hugetlbfs)";
  return {};
}

}  // namespace sriovd
