#pragma once
// Reading a fuzzer's input as a little program: each harness takes its
// choices (an opcode, an offset, a length) from the front of the bytes, and
// what is left when the bytes run out is zero. No harness throws out of
// LLVMFuzzerTestOneInput: the code under test may refuse input by throwing
// its documented exceptions, which the harness catches where it calls.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace sriovd::fuzz {

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  [[nodiscard]] bool empty() const { return at_ >= size_; }
  [[nodiscard]] size_t left() const { return at_ < size_ ? size_ - at_ : 0; }
  template <typename T>
  T take() {
    T v{};
    const size_t n = std::min(sizeof v, left());
    std::memcpy(&v, data_ + at_, n);
    at_ += n;
    return v;
  }
  uint8_t byte() { return take<uint8_t>(); }
  // Up to `max` bytes (fewer when the input ends).
  std::span<const uint8_t> bytes(size_t max) {
    const size_t n = std::min(max, left());
    std::span<const uint8_t> out(data_ + at_, n);
    at_ += n;
    return out;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

}  // namespace sriovd::fuzz
