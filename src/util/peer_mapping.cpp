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
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace sriovd {

namespace {

struct Slot {
  std::atomic<uintptr_t> base{0};  // 0: free
  std::atomic<size_t> length{0};
  std::atomic<size_t> page{0};
  std::atomic<bool> faulted{false};
};

// The registry: blocks of slots chained from g_first, added when every slot
// is taken and never freed (the handler may be walking one), so it holds as
// many mappings as the clients' quotas allow at once - no fixed table one
// client can fill.
struct Block {
  static constexpr size_t kSlots = 256;
  Slot slots[kSlots];
  std::atomic<Block*> next{nullptr};
};

Block g_first;
std::vector<std::unique_ptr<Block>> g_more;  // owns the blocks after the first (registration only)
std::atomic<uint64_t> g_faults{0};
std::atomic<uint64_t> g_unmap_failures{0};
std::atomic<size_t> g_registered{0};
std::mutex g_register;  // registration only; the handler takes no lock
struct sigaction g_previous {};
std::mutex g_limits_lock;
PeerMemoryLimits g_limits;

size_t system_page() {
  static const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

// A SIGBUS on a registered mapping: a zero page of the mapping's page size
// over the faulting one (the file's page is gone; the peer broke its own
// memory), the fault noted, and the access restarts. Anything else goes to
// whoever handled SIGBUS before (by default: the process dies with a core,
// as it should).
void on_sigbus(int signo, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Block* b = &g_first; b != nullptr; b = b->next.load(std::memory_order_acquire)) {
    for (Slot& s : b->slots) {
      const uintptr_t base = s.base.load(std::memory_order_acquire);
      if (base == 0 || addr < base || addr - base >= s.length.load(std::memory_order_acquire)) continue;
      const size_t page = s.page.load(std::memory_order_acquire);
      const uintptr_t start = addr & ~(static_cast<uintptr_t>(page) - 1);
      void* p = ::mmap(reinterpret_cast<void*>(start), page, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) goto fatal;
      s.faulted.store(true, std::memory_order_release);
      g_faults.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
fatal:
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
    (void)system_page();  // sysconf is not for handlers
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (::sigaction(SIGBUS, &sa, &g_previous) != 0) throw std::runtime_error("installing the SIGBUS handler");
  });
}

Slot* free_slot() {
  Block* last = &g_first;
  for (Block* b = &g_first; b != nullptr; b = b->next.load(std::memory_order_relaxed)) {
    for (Slot& s : b->slots)
      if (s.base.load(std::memory_order_relaxed) == 0) return &s;
    last = b;
  }
  g_more.push_back(std::make_unique<Block>());
  last->next.store(g_more.back().get(), std::memory_order_release);
  return &g_more.back()->slots[0];
}

uint64_t round_up(uint64_t v, uint64_t page) { return (v + page - 1) & ~(page - 1); }

}  // namespace

PeerMapping::PeerMapping(void* base, size_t length, size_t page) {
  install_once();
  std::lock_guard lock(g_register);
  Slot* s = free_slot();
  s->faulted.store(false, std::memory_order_relaxed);
  s->page.store(page, std::memory_order_relaxed);
  s->length.store(length, std::memory_order_release);
  s->base.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
  slot_ = s;
  g_registered.fetch_add(1, std::memory_order_relaxed);
}

PeerMapping::~PeerMapping() { release(); }

PeerMapping::PeerMapping(PeerMapping&& other) noexcept : slot_(std::exchange(other.slot_, nullptr)) {}

PeerMapping& PeerMapping::operator=(PeerMapping&& other) noexcept {
  if (this != &other) {
    release();
    slot_ = std::exchange(other.slot_, nullptr);
  }
  return *this;
}

// Before the owner unmaps: the handler must not take a later fault at that
// address (someone else's mapping by then) for this one.
void PeerMapping::release() {
  if (slot_ == nullptr) return;
  std::lock_guard lock(g_register);
  auto* s = static_cast<Slot*>(slot_);
  s->base.store(0, std::memory_order_release);
  s->length.store(0, std::memory_order_release);
  slot_ = nullptr;
  g_registered.fetch_sub(1, std::memory_order_relaxed);
}

bool PeerMapping::faulted() const {
  return slot_ != nullptr && static_cast<const Slot*>(slot_)->faulted.load(std::memory_order_acquire);
}

uint64_t peer_mapping_faults() { return g_faults.load(std::memory_order_relaxed); }
size_t peer_mappings_registered() { return g_registered.load(std::memory_order_relaxed); }
uint64_t peer_unmap_failures() { return g_unmap_failures.load(std::memory_order_relaxed); }

void set_default_peer_memory_limits(const PeerMemoryLimits& limits) {
  std::lock_guard lock(g_limits_lock);
  g_limits = limits;
}

PeerMemoryLimits default_peer_memory_limits() {
  std::lock_guard lock(g_limits_lock);
  return g_limits;
}

void PeerMemoryQuota::charge(uint64_t bytes, uint64_t address_space, const std::string& what) {
  const auto refuse = [&](const std::string& limit) {
    ++refused_;
    throw PeerMemoryError(EDQUOT, what + ": over this client's share of peer memory (" + limit + ")");
  };
  // (A reload may have lowered a limit below what is held: no subtraction
  // of the held from the limit, which would wrap.)
  const auto over = [](uint64_t held, uint64_t more, uint64_t limit) { return held > limit || more > limit - held; };
  if (mappings_ >= limits_.max_mappings)
    refuse(std::to_string(mappings_) + " mappings held; peer_limits.max_mappings is " +
           std::to_string(limits_.max_mappings));
  if (over(bytes_, bytes, limits_.max_bytes))
    refuse(hex(bytes_) + " bytes mapped, " + hex(bytes) + " more asked; peer_limits.max_mib allows " +
           std::to_string(limits_.max_bytes >> 20U) + " MiB");
  if (over(address_space_, address_space, limits_.max_address_space))
    refuse(hex(address_space_) + " bytes of address space held, " + hex(address_space) +
           " more asked; peer_limits.max_address_space_mib allows " + std::to_string(limits_.max_address_space >> 20U) +
           " MiB");
  ++mappings_;
  bytes_ += bytes;
  address_space_ += address_space;
}

void PeerMemoryQuota::release(uint64_t bytes, uint64_t address_space) {
  --mappings_;
  bytes_ -= bytes;
  address_space_ -= address_space;
}

PeerMemory::PeerMemory(int fd, uint64_t offset, uint64_t size, int prot, PeerMemoryQuota* quota,
                       const std::string& what) {
  size_t page = 0;
  if (const std::string problem = peer_memory_problem(fd, offset, size, &page); !problem.empty())
    throw PeerMemoryError(EINVAL, what + ": " + problem);
  // From the page the range starts in to the end of the page it ends in:
  // exactly what is needed, in whole pages of its backing (a hugetlb
  // mapping's length is rounded up by the kernel, and munmap takes only the
  // rounded length). The file covers it: a hugetlbfs file's size is a
  // multiple of its page, and any other file's last page is whole in memory.
  const uint64_t skew = offset & (page - 1);
  const uint64_t end = round_up(skew + size, page);
  if (end < size || end > SIZE_MAX) throw PeerMemoryError(EINVAL, what + ": too large to map");
  if (quota) quota->charge(size, end, what);
  void* p = ::mmap(nullptr, end, prot, MAP_SHARED, fd, static_cast<off_t>(offset - skew));
  if (p == MAP_FAILED) {
    const int err = errno;
    if (quota) quota->release(size, end);
    throw PeerMemoryError(err, what + ": mapping its fd at offset " + hex(offset) + ": " + std::strerror(err));
  }
  try {
    guard_ = PeerMapping(p, end, page);
  } catch (...) {
    ::munmap(p, end);
    if (quota) quota->release(size, end);
    throw;
  }
  base_ = p;
  length_ = end;
  skew_ = skew;
  size_ = size;
  page_ = page;
  quota_ = quota;
}

PeerMemory& PeerMemory::operator=(PeerMemory&& other) noexcept {
  if (this != &other) {
    reset();
    base_ = std::exchange(other.base_, nullptr);
    length_ = std::exchange(other.length_, 0);
    skew_ = std::exchange(other.skew_, 0);
    size_ = std::exchange(other.size_, 0);
    page_ = std::exchange(other.page_, 0);
    guard_ = std::move(other.guard_);
    quota_ = std::exchange(other.quota_, nullptr);
  }
  return *this;
}

void PeerMemory::reset() {
  if (base_ == nullptr) return;
  guard_ = PeerMapping();  // unregistered before the address can be reused
  if (::munmap(base_, length_) != 0) g_unmap_failures.fetch_add(1, std::memory_order_relaxed);
  if (quota_) quota_->release(size_, length_);
  base_ = nullptr;
  length_ = 0;
  size_ = 0;
  quota_ = nullptr;
}

std::string peer_memory_problem(int fd, uint64_t offset, uint64_t size, size_t* page) {
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
  if (page) {
    constexpr unsigned long kHugetlbfs = 0x958458f6UL;
    *page = system_page();
    if (static_cast<unsigned long>(fs.f_type) == kHugetlbfs) {
      const auto huge = static_cast<size_t>(fs.f_bsize);
      if (huge < *page || (huge & (huge - 1)) != 0) return "its hugetlbfs reports a page size of " + hex(huge);
      *page = huge;
    }
  }
  return {};
}

}  // namespace sriovd
