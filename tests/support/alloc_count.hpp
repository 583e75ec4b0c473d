#pragma once
// Counts the heap allocations (global operator new) one chosen thread makes,
// so a test can hold a per-message or per-packet path to none. Linked into
// a test binary, alloc_count.cpp replaces operator new/delete there.
#include <atomic>
#include <cstdint>
#include <thread>

namespace sriovd::test::alloc_count {
extern std::atomic<std::thread::id> thread;  // the thread counted; default id: none
extern std::atomic<uint64_t> count;
}  // namespace sriovd::test::alloc_count
