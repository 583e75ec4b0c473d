// Session threads (util/session_threads): an export's objects are made,
// used and deleted on its thread; the control thread waits for each call.
#include "sriovd/util/session_threads.hpp"

#include <atomic>
#include <stdexcept>
#include <thread>

#include <gtest/gtest.h>

namespace sriovd {
namespace {

using namespace std::chrono_literals;

TEST(SessionThread, CallRunsThereInOrderAndReturnsOrThrows) {
  SessionThread t(0, 0us);
  const auto here = std::this_thread::get_id();
  const auto there = t.call([] { return std::this_thread::get_id(); });
  EXPECT_NE(there, here);
  EXPECT_TRUE(t.call([&] { return t.on_this_thread(); }));
  EXPECT_FALSE(t.on_this_thread());
  // Posted work goes first: a call sees what was posted before it.
  int seen = 0;
  for (int i = 1; i <= 100; ++i) asio::post(t.io(), [&seen, i] { seen = i; });
  EXPECT_EQ(t.call([&] { return seen; }), 100);
  EXPECT_THROW(t.call([]() -> int { throw std::runtime_error("refused"); }), std::runtime_error);
  // A call from the thread itself runs inline (no deadlock).
  EXPECT_EQ(t.call([&] { return t.call([] { return 7; }); }), 7);
}

struct Owned {
  explicit Owned(std::atomic<std::thread::id>& deleted_on) : deleted_on_(deleted_on) {}
  ~Owned() { deleted_on_ = std::this_thread::get_id(); }
  std::atomic<std::thread::id>& deleted_on_;
};

TEST(SessionThread, WhatItMakesIsDeletedThere) {
  SessionThread t(0, 0us);
  std::atomic<std::thread::id> made_on{}, deleted_on{};
  auto o = make_on_session(t, [&] {
    made_on = std::this_thread::get_id();
    return std::make_unique<Owned>(deleted_on);
  });
  const auto there = t.call([] { return std::this_thread::get_id(); });
  EXPECT_EQ(made_on.load(), there);
  o.reset();  // from this thread
  EXPECT_EQ(deleted_on.load(), there);
}

TEST(SessionPool, LeasesGoToTheLeastLoadedThread) {
  SessionPool pool(3, 0us);
  ASSERT_EQ(pool.size(), 3U);
  std::vector<SessionPool::Lease> leases;
  for (int i = 0; i < 7; ++i) leases.push_back(pool.lease());
  EXPECT_EQ(pool.at(0).sessions(), 3U);
  EXPECT_EQ(pool.at(1).sessions(), 2U);
  EXPECT_EQ(pool.at(2).sessions(), 2U);
  leases.erase(leases.begin() + 1);  // one of thread 1's
  EXPECT_EQ(pool.at(1).sessions(), 1U);
  EXPECT_EQ(pool.lease()->index(), 1U);
  EXPECT_GE(SessionPool(0, 0us).size(), 1U) << "0: one per usable CPU";
}

}  // namespace
}  // namespace sriovd
