#include "support/alloc_count.hpp"

#include <cstdlib>
#include <new>

namespace sriovd::test::alloc_count {
std::atomic<std::thread::id> thread;
std::atomic<uint64_t> count{0};
}  // namespace sriovd::test::alloc_count

namespace ac = sriovd::test::alloc_count;

void* operator new(std::size_t n) {
  if (std::this_thread::get_id() == ac::thread.load(std::memory_order_relaxed))
    ac::count.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return ::operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
