#include "sriovd/util/retirer.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace sriovd {
namespace {

using namespace std::chrono_literals;

// A thing whose destructor waits until the test opens its gate, and says on
// which thread it ran (a tap whose close waits for the kernel).
struct Slow {
  Slow(std::shared_future<void> g, std::atomic<std::thread::id>* where) : gate(std::move(g)), ran_on(where) {}
  Slow(const Slow&) = delete;
  Slow& operator=(const Slow&) = delete;
  std::shared_future<void> gate;
  std::atomic<std::thread::id>* ran_on;
  ~Slow() {
    gate.wait();
    if (ran_on) ran_on->store(std::this_thread::get_id());
  }
};

TEST(Retirer, DestroysOffTheCallingThreadWhileTheCallerGoesOn) {
  Retirer r;
  std::promise<void> open;
  std::atomic<std::thread::id> ran_on{};
  r.retire("tap:t0", std::make_unique<Slow>(open.get_future().share(), &ran_on));
  // retire() came back with the destructor still waiting.
  EXPECT_FALSE(r.wait_gone("tap:t0", 0ms));
  EXPECT_FALSE(r.wait_gone("tap:t0", 20ms));
  open.set_value();
  ASSERT_TRUE(r.wait_gone("tap:t0", 10s));
  EXPECT_TRUE(r.wait_gone("tap:t0", 0ms));
  EXPECT_NE(ran_on.load(), std::this_thread::get_id());
  EXPECT_NE(ran_on.load(), std::thread::id{});
  EXPECT_EQ(r.retired(), 1U);
}

TEST(Retirer, EachKeyIsWaitedForAloneOrByItsPrefix) {
  Retirer r;
  std::promise<void> open;
  r.retire("vf:eth3", std::make_unique<Slow>(open.get_future().share(), nullptr));
  std::promise<void> open_tap;
  open_tap.set_value();
  r.retire("tap:t1", std::make_unique<Slow>(open_tap.get_future().share(), nullptr));
  // In order, one at a time: tap:t1 waits behind vf:eth3.
  EXPECT_FALSE(r.wait_gone("tap:t1", 20ms));
  EXPECT_TRUE(r.wait_gone("tap:other", 0ms));
  EXPECT_FALSE(r.wait_gone("vf:", 0ms, true));
  EXPECT_TRUE(r.wait_gone("vf:eth4", 0ms, true));  // no key starts with it
  EXPECT_FALSE(r.wait_gone("", 0ms));              // everything
  open.set_value();
  EXPECT_TRUE(r.wait_gone("vf:", 10s, true));
  EXPECT_TRUE(r.wait_gone("", 10s));
  EXPECT_EQ(r.retired(), 2U);
}

TEST(Retirer, TellsOnceWhenTheLastThingUnderAKeyIsGone) {
  Retirer r;
  std::mutex m;
  std::vector<std::string> told;
  r.set_on_gone([&](const std::string& key) {
    std::lock_guard lock(m);
    told.push_back(key);
  });
  std::promise<void> open;
  auto gate = open.get_future().share();
  r.retire("tap:a", std::make_unique<Slow>(gate, nullptr));
  r.retire("tap:a", std::make_unique<Slow>(gate, nullptr));
  r.retire("tap:b", std::make_unique<Slow>(gate, nullptr));
  open.set_value();
  ASSERT_TRUE(r.wait_gone("", 10s));
  // wait_gone can see the last one gone just before its on_gone runs.
  for (const auto deadline = std::chrono::steady_clock::now() + 10s; std::chrono::steady_clock::now() < deadline;) {
    {
      std::lock_guard lock(m);
      if (told.size() >= 2) break;
    }
    std::this_thread::sleep_for(1ms);
  }
  std::lock_guard lock(m);
  EXPECT_EQ(told, (std::vector<std::string>{"tap:a", "tap:b"}));
}

TEST(Retirer, ItsEndDestroysEverythingStillQueued) {
  std::atomic<int> destroyed{0};
  struct Counted {
    explicit Counted(std::atomic<int>* count) : n(count) {}
    Counted(const Counted&) = delete;
    Counted& operator=(const Counted&) = delete;
    std::atomic<int>* n;
    ~Counted() { n->fetch_add(1); }
  };
  std::promise<void> open;
  {
    Retirer r;
    r.retire("x", std::make_unique<Slow>(open.get_future().share(), nullptr));
    for (int i = 0; i < 3; ++i) r.retire("y", std::make_unique<Counted>(&destroyed));
    open.set_value();
  }
  EXPECT_EQ(destroyed.load(), 3);
}

TEST(Retirer, NothingToRetireIsNothingPending) {
  Retirer r;
  r.retire("tap:none", nullptr);
  EXPECT_TRUE(r.wait_gone("tap:none", 0ms));
  EXPECT_EQ(r.retired(), 0U);
}

}  // namespace
}  // namespace sriovd
