// The dirty log's arithmetic: which bits a write sets, what it cannot mark,
// and the guest addresses a host pointer stands for.
#include <gtest/gtest.h>

#include <vector>

#include "sriovd/virtio/dirty_log.hpp"
#include "sriovd/virtio/guest_memory.hpp"

namespace sriovd::virtio {
namespace {

std::vector<uint64_t> pages(const std::vector<uint8_t>& bits) {
  std::vector<uint64_t> p;
  for (uint64_t i = 0; i < bits.size() * 8; ++i)
    if ((bits[i / 8] >> (i % 8)) & 1U) p.push_back(i);
  return p;
}

TEST(DirtyLog, AWriteMarksEveryPageItTouchesAndNothingElse) {
  GuestMemory mem;
  std::vector<uint8_t> bits(4);  // 32 pages
  const DirtyLog log(bits.data(), bits.size(), mem);
  EXPECT_EQ(log.covers(), 32U * 4096U);
  log.mark_gpa(0x1000, 1);
  EXPECT_EQ(pages(bits), (std::vector<uint64_t>{1}));
  log.mark_gpa(0x2fff, 2);  // across a page boundary
  EXPECT_EQ(pages(bits), (std::vector<uint64_t>{1, 2, 3}));
  log.mark_gpa(0x9000, 0x3000);  // three whole pages, into the next byte
  EXPECT_EQ(pages(bits), (std::vector<uint64_t>{1, 2, 3, 9, 10, 11}));
  log.mark_gpa(0x5000, 0);  // nothing written, nothing marked
  EXPECT_EQ(pages(bits).size(), 6U);
  EXPECT_EQ(log.missed(), 0U);
}

TEST(DirtyLog, AWritePastTheLogOrWrappingIsCountedNotMarkedElsewhere) {
  GuestMemory mem;
  std::vector<uint8_t> bits(4, 0);
  const DirtyLog log(bits.data(), bits.size(), mem);
  log.mark_gpa(31 * 4096, 4096);  // the last page: inside
  log.mark_gpa(32 * 4096, 1);     // the first page past the end
  log.mark_gpa(31 * 4096, 8192);  // starts inside, ends outside
  log.mark_gpa(~0ULL - 10, 100);  // wraps
  EXPECT_EQ(pages(bits), (std::vector<uint64_t>{31}));
  EXPECT_EQ(log.missed(), 3U);
}

// A host pointer is logged at the guest address of its region, and of
// every region the front-end maps at the same virtual address (the same
// memory at two guest addresses); a pointer in no region is a miss.
TEST(DirtyLog, AHostPointerIsLoggedAtEveryGuestAddressOfItsMemory) {
  std::vector<uint8_t> a(0x4000), b(0x4000);
  GuestMemory mem;
  mem.add_host_region(0x10000, 0x4000, 0x7f0000000000ULL, a.data());
  mem.add_host_region(0x40000, 0x2000, 0x7f0000002000ULL, a.data() + 0x2000);  // the upper half again
  mem.add_host_region(0x80000, 0x4000, 0x7f0000100000ULL, b.data());
  std::vector<uint8_t> bits(32);  // 256 pages: below 1 MiB
  const DirtyLog log(bits.data(), bits.size(), mem);
  log.mark_host(a.data() + 0x1010, 16);
  EXPECT_EQ(pages(bits), (std::vector<uint64_t>{0x11}));
  std::fill(bits.begin(), bits.end(), 0);
  log.mark_host(a.data() + 0x3000, 8);  // also seen at 0x41000
  EXPECT_EQ(pages(bits), (std::vector<uint64_t>{0x13, 0x41}));
  std::fill(bits.begin(), bits.end(), 0);
  log.mark_host(b.data() + 0x2000, 4096);
  EXPECT_EQ(pages(bits), (std::vector<uint64_t>{0x82}));
  uint8_t elsewhere = 0;
  log.mark_host(&elsewhere, 1);
  EXPECT_EQ(log.missed(), 1U);
}

// Two regions whose mappings follow each other in the address space: a
// run of bytes across both is each region's part at its own guest address
// (the device marks contiguous segments as one run).
TEST(DirtyLog, ARunAcrossTwoMappingsIsMarkedAtEachRegionsAddress) {
  std::vector<uint8_t> ram(0x4000);
  GuestMemory mem;
  mem.add_host_region(0x10000, 0x2000, 0x7f0000000000ULL, ram.data());
  mem.add_host_region(0x80000, 0x2000, 0x7f0000100000ULL, ram.data() + 0x2000);
  std::vector<uint8_t> bits(32);
  const DirtyLog log(bits.data(), bits.size(), mem);
  log.mark_host(ram.data() + 0x1800, 0x1000);  // the last half page of one, the first of the other
  EXPECT_EQ(pages(bits), (std::vector<uint64_t>{0x11, 0x80}));
  EXPECT_EQ(log.missed(), 0U);
  std::fill(bits.begin(), bits.end(), 0);
  log.mark_gpa(0x3000, 0x10000);  // 16 pages over three bytes of the log
  EXPECT_EQ(pages(bits).size(), 16U);
  EXPECT_EQ(pages(bits).front(), 3U);
  EXPECT_EQ(pages(bits).back(), 18U);
}

}  // namespace
}  // namespace sriovd::virtio
