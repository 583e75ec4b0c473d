// LogLimit (issue 39, c4): what a peer can make the daemon log at will goes
// out at most kBurst times a second, and the next line that goes out says
// how many were held back.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <thread>

#include "sriovd/util/log_limit.hpp"

namespace sriovd {
namespace {

TEST(LogLimit, AFloodGivesABurstAndACountNotALineEach) {
  LogLimit limit;
  uint64_t held = 99;
  unsigned allowed = 0;
  for (int i = 0; i < 1000; ++i)
    if (limit.allow(held)) ++allowed;
  // Within one second, or across a second boundary at most twice the burst.
  EXPECT_GE(allowed, LogLimit::kBurst);
  EXPECT_LE(allowed, 2 * LogLimit::kBurst);
  EXPECT_EQ(limit.held_total(), 1000U - allowed);
}

TEST(LogLimit, TheFirstLineAfterAPauseSaysHowManyWereHeld) {
  LogLimit limit;
  uint64_t held = 0;
  for (unsigned i = 0; i < LogLimit::kBurst; ++i) ASSERT_TRUE(limit.allow(held));
  EXPECT_EQ(held, 0U);
  ASSERT_FALSE(limit.allow(held));
  ASSERT_FALSE(limit.allow(held));
  // The window is a second: the next allowed line carries the count.
  bool allowed = false;
  for (int i = 0; i < 2000 && !allowed; ++i) {
    if (limit.allow(held))
      allowed = true;
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(allowed);
  EXPECT_GE(held, 2U);
  EXPECT_EQ(held, limit.held_total());
}

}  // namespace
}  // namespace sriovd
