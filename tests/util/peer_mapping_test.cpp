// PeerMemory, the one way a peer's memory is mapped (issue 39): whatever
// the backing - memfd, hugetlb memfd, hugetlbfs or tmpfs file - a file
// truncated or hole-punched under the mapping faults the mapping, not the
// process; exactly the declared range is mapped and exactly that is
// unmapped; each client is held to its own share, and no table one client
// can fill stands in another's way.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "sriovd/util/peer_mapping.hpp"
#include "support/peer_backing.hpp"

namespace sriovd {
namespace {

using test::Backing;

// Whether [addr, addr + 1) is in any mapping of this process.
bool mapped(const void* addr) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const auto a = reinterpret_cast<uintptr_t>(addr);
  while (std::getline(maps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) == 2 && a >= lo && a < hi) return true;
  }
  return false;
}

class PeerBackingTest : public ::testing::TestWithParam<Backing> {
 protected:
  void SetUp() override {
    const Backing b = GetParam();
    if (b == Backing::hugetlb_memfd || b == Backing::hugetlbfs_file) {
      pages = std::make_unique<test::HugePages>(8);
      if (!pages->ok()) GTEST_SKIP() << "no huge pages for this backing: " << pages->why();
      if (b == Backing::hugetlbfs_file) {
        mount = std::make_unique<test::HugetlbfsMount>();
        if (mount->dir().empty()) GTEST_SKIP() << "cannot mount a hugetlbfs (needs root)";
      }
    }
  }
  [[nodiscard]] size_t page() const {
    const Backing b = GetParam();
    return b == Backing::hugetlb_memfd || b == Backing::hugetlbfs_file ? test::kHugePage : 4096;
  }
  UniqueFd file(size_t size) {
    UniqueFd fd = test::make_backing(GetParam(), size, mount ? mount->dir() : "");
    EXPECT_TRUE(fd.valid()) << "cannot make a " << test::backing_name(GetParam()) << " file";
    return fd;
  }
  std::unique_ptr<test::HugePages> pages;
  std::unique_ptr<test::HugetlbfsMount> mount;
};

// c2: a hugetlb file truncated under the mapping killed the daemon (the
// handler's 4 KiB patch is refused inside a hugetlb mapping). Now every
// backing's lost pages read as zeros, take writes, and the mapping says so.
TEST_P(PeerBackingTest, ATruncatedFileFaultsTheMappingNotTheProcess) {
  UniqueFd fd = file(2 * page());
  const uint8_t marker = 0x5a;
  PeerMemory m(fd.get(), page(), page(), PROT_READ | PROT_WRITE, nullptr, "test window");
  volatile uint8_t* p = m.data() + 100;
  *p = marker;  // (hugetlbfs takes no write(2): through the mapping)
  EXPECT_EQ(*p, marker);
  EXPECT_FALSE(m.faulted());
  const uint64_t before = peer_mapping_faults();
  ASSERT_EQ(::ftruncate(fd.get(), 0), 0);
  EXPECT_EQ(*p, 0) << "the page the file lost reads as zeros";
  *p = 1;
  m.data()[page() - 1] = 2;  // the whole page was replaced, to its last byte
  EXPECT_TRUE(m.faulted());
  EXPECT_EQ(peer_mapping_faults(), before + 1);
  const uint64_t failures = peer_unmap_failures();
  m.reset();
  EXPECT_EQ(peer_unmap_failures(), failures);
}

// A hole punched under the mapping: the kernel gives a fresh page where it
// can (shmem) and SIGBUS where it cannot (a hugetlb pool with none left);
// either way the process goes on.
TEST_P(PeerBackingTest, AHolePunchedUnderTheMappingIsSurvived) {
  UniqueFd fd = file(2 * page());
  PeerMemory m(fd.get(), 0, 2 * page(), PROT_READ | PROT_WRITE, nullptr, "test region");
  std::memset(m.data(), 0x11, 2 * page());
  ASSERT_EQ(::fallocate(fd.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(page())), 0);
  volatile uint8_t* p = m.data();
  EXPECT_EQ(*p, 0) << "a punched page reads as zeros";
  *p = 3;
  EXPECT_EQ(m.data()[page()], 0x11) << "the page after the hole is untouched";
}

// x1 and c5: exactly the declared range is mapped, from the backing page it
// starts in to the end of the page it ends in, and exactly that is unmapped
// (a hugetlb mapping of 3 MiB was never unmapped: munmap took only the
// rounded length, and its result was not checked).
TEST_P(PeerBackingTest, ExactlyTheDeclaredRangeIsMappedAndUnmapped) {
  UniqueFd fd = file(4 * page());
  const uint64_t offset = page() + 64;  // inside the second page
  const uint64_t size = page() + page() / 2;
  PeerMemory m(fd.get(), offset, size, PROT_READ | PROT_WRITE, nullptr, "test buffer");
  EXPECT_EQ(m.page_size(), page());
  EXPECT_EQ(m.mapped_length(), 2 * page()) << "from the page it starts in to the end of the page it ends in";
  {
    PeerMemory whole(fd.get(), 0, 4 * page(), PROT_READ | PROT_WRITE, nullptr, "the whole file");
    whole.data()[offset] = 0x42;  // (hugetlbfs takes no write(2))
  }
  EXPECT_EQ(m.data()[0], 0x42) << "data() is the declared offset";
  const uint8_t* start = m.data() - 64;
  ASSERT_TRUE(mapped(start));
  const uint64_t failures = peer_unmap_failures();
  m.reset();
  EXPECT_EQ(peer_unmap_failures(), failures);
  EXPECT_FALSE(mapped(start)) << "the mapping outlived its owner";
  EXPECT_FALSE(mapped(start + page())) << "its last page outlived its owner";
}

INSTANTIATE_TEST_SUITE_P(EveryBacking, PeerBackingTest,
                         ::testing::Values(Backing::memfd, Backing::hugetlb_memfd, Backing::hugetlbfs_file,
                                           Backing::tmpfs_file),
                         [](const auto& p) { return std::string(test::backing_name(p.param)); });

// c5: a 4 KiB log at offset 64 TiB reserved 64 TiB of address space (the
// file was mapped from 0); now one page is.
TEST(PeerMemory, AFarOffsetMapsOnlyItsOwnPages) {
  UniqueFd fd(::memfd_create("far", MFD_CLOEXEC));
  const uint64_t far = 64ULL << 40U;
  ASSERT_EQ(::ftruncate(fd.get(), static_cast<off_t>(far + 4096)), 0);  // sparse
  PeerMemory m(fd.get(), far, 4096, PROT_READ | PROT_WRITE, nullptr, "a log far out");
  EXPECT_EQ(m.mapped_length(), 4096U);
  m.data()[0] = 1;
}

std::string refusal(PeerMemoryQuota& q, int fd, uint64_t offset, uint64_t size, std::vector<PeerMemory>& keep) {
  try {
    keep.emplace_back(fd, offset, size, PROT_READ, &q, "window " + std::to_string(keep.size()));
  } catch (const PeerMemoryError& e) {
    EXPECT_EQ(e.error, EDQUOT) << e.what();
    return e.what();
  }
  return "";
}

// c3: each client is held to its own share - count, declared bytes and
// address space - with an error that names the limit; what it gives back
// it can map again.
TEST(PeerMemory, EachClientIsHeldToItsShare) {
  UniqueFd fd(::memfd_create("quota", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(fd.get(), 1 << 20), 0);
  PeerMemoryQuota q({2, 1ULL << 20U, 1ULL << 20U});
  std::vector<PeerMemory> keep;
  EXPECT_EQ(refusal(q, fd.get(), 0, 4096, keep), "");
  EXPECT_EQ(refusal(q, fd.get(), 4096, 4096, keep), "");
  const std::string why = refusal(q, fd.get(), 8192, 4096, keep);
  EXPECT_NE(why.find("window 2: over this client's share"), std::string::npos) << why;
  EXPECT_NE(why.find("peer_limits.max_mappings is 2"), std::string::npos) << why;
  EXPECT_EQ(q.mappings(), 2U);
  EXPECT_EQ(q.refused(), 1U);
  keep.pop_back();
  EXPECT_EQ(q.mappings(), 1U);
  EXPECT_EQ(refusal(q, fd.get(), 8192, 4096, keep), "") << "a mapping given back is room for another";
  keep.clear();
  EXPECT_EQ(q.mappings(), 0U);
  EXPECT_EQ(q.bytes(), 0U);
  EXPECT_EQ(q.address_space(), 0U);

  PeerMemoryQuota bytes({16, 8192, 1ULL << 20U});
  EXPECT_EQ(refusal(bytes, fd.get(), 0, 8192, keep), "");
  EXPECT_NE(refusal(bytes, fd.get(), 8192, 4096, keep).find("peer_limits.max_mib"), std::string::npos);
  keep.clear();
  // Address space: 100 bytes declared at an offset inside a page take a page.
  PeerMemoryQuota space({16, 1ULL << 20U, 4096});
  EXPECT_EQ(refusal(space, fd.get(), 4000, 50, keep), "");
  EXPECT_EQ(space.address_space(), 4096U);
  EXPECT_NE(refusal(space, fd.get(), 8192, 50, keep).find("peer_limits.max_address_space_mib"), std::string::npos);
  // A reload lowers the limits below what is held: nothing more is mapped.
  space.set_limits({16, 10, 10});
  EXPECT_NE(refusal(space, fd.get(), 8192, 50, keep).find("peer_limits.max_mib"), std::string::npos);
}

// c3: the registry had 1024 slots shared by every client; one client that
// filled it made every other tenant's SET_MEM_TABLE and DMA_MAP fail. It
// now grows, and a fault in a mapping registered after thousands of others
// is still caught.
TEST(PeerMemory, NoFixedTableOneClientCanFill) {
  std::vector<uint8_t> anon(4096);
  std::vector<PeerMapping> many;
  const size_t before = peer_mappings_registered();
  for (int i = 0; i < 3000; ++i) many.emplace_back(anon.data(), 4096, 4096);
  EXPECT_EQ(peer_mappings_registered(), before + 3000);
  UniqueFd fd(::memfd_create("late", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(fd.get(), 8192), 0);
  PeerMemory late(fd.get(), 0, 8192, PROT_READ | PROT_WRITE, nullptr, "another tenant's region");
  ASSERT_EQ(::ftruncate(fd.get(), 0), 0);
  volatile uint8_t* p = late.data() + 4096;
  *p = 9;
  EXPECT_TRUE(late.faulted());
  many.clear();
  EXPECT_EQ(peer_mappings_registered(), before + 1);
}

}  // namespace
}  // namespace sriovd
