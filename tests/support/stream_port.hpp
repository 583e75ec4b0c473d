#pragma once
// Packet ports for device tests whose fd is an eventfd the port signals
// itself: EventPort (nothing arrives, what is sent goes nowhere) and
// StreamPort, a known stream of numbered packets without end - what a
// migration test flows into the guest and checks, packet by packet, on
// the other side.
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/virtio/port.hpp"

namespace sriovd::test {

class EventPort : public virtio::PacketPort {
 public:
  explicit EventPort(std::string name, unsigned queues = 1)
      : name_(std::move(name)), queues_(queues), fd_(::eventfd(0, EFD_NONBLOCK)) {}
  [[nodiscard]] const std::string& name() const override { return name_; }
  [[nodiscard]] unsigned queues() const override { return queues_; }
  [[nodiscard]] int fd(unsigned) const override { return fd_.get(); }
  ssize_t send(unsigned, const iovec*, int) override { return 0; }
  ssize_t recv(unsigned, uint8_t*, size_t) override { return -1; }
  void set_offloads(unsigned) override {}

 protected:
  void signal() {
    const uint64_t one = 1;
    (void)::write(fd_.get(), &one, sizeof one);
  }
  void drain() {
    uint64_t v;
    (void)::read(fd_.get(), &v, sizeof v);
  }
  // The bytes of a packet the device sends.
  static std::vector<uint8_t> gather(const iovec* iov, int count) {
    std::vector<uint8_t> p;
    for (int i = 0; i < count; ++i) {
      const auto* b = static_cast<const uint8_t*>(iov[i].iov_base);
      p.insert(p.end(), b, b + iov[i].iov_len);
    }
    return p;
  }

 private:
  std::string name_;
  unsigned queues_;
  UniqueFd fd_;
};

inline uint8_t stream_byte(uint32_t seq, uint32_t i) { return static_cast<uint8_t>(seq * 7U + i); }

// Packets without end while on: a virtio-net header (no offload), then
// packet n's payload: n (4 bytes), then stream_byte(n, i). What the device
// sends is kept (a RARP).
class StreamPort : public EventPort {
 public:
  static constexpr uint32_t kPayload = 1400;
  StreamPort() : EventPort("stream0") {}
  ssize_t recv(unsigned, uint8_t* buf, size_t size) override {
    if (!on_.load() || size < 12 + kPayload) {
      drain();
      return -1;
    }
    std::memset(buf, 0, 12);
    const uint32_t seq = next_++;
    std::memcpy(buf + 12, &seq, 4);
    for (uint32_t i = 4; i < kPayload; ++i) buf[12 + i] = stream_byte(seq, i);
    return 12 + kPayload;
  }
  ssize_t send(unsigned, const iovec* iov, int count) override {
    std::lock_guard lock(mutex_);
    sent_.push_back(gather(iov, count));
    return static_cast<ssize_t>(sent_.back().size());
  }
  void flow(bool on) {
    on_.store(on);
    if (on) signal();
  }
  std::vector<std::vector<uint8_t>> sent() {
    std::lock_guard lock(mutex_);
    return sent_;
  }
  // The destination's wire goes on where the source's stopped.
  void start_at(uint32_t seq) { next_.store(seq); }
  [[nodiscard]] uint32_t generated() const { return next_.load(); }
  // Whether a packet's payload is packet `seq` of the stream, byte for byte.
  static bool is_packet(const uint8_t* payload, size_t size, uint32_t& seq) {
    if (size != kPayload) return false;
    std::memcpy(&seq, payload, 4);
    for (uint32_t i = 4; i < kPayload; ++i)
      if (payload[i] != stream_byte(seq, i)) return false;
    return true;
  }

 private:
  std::atomic<bool> on_{false};
  std::atomic<uint32_t> next_{0};
  std::mutex mutex_;
  std::vector<std::vector<uint8_t>> sent_;
};

// What a guest takes from a StreamPort's stream: each packet must be the
// stream's next - a later one is a loss (counted in gaps); an earlier one,
// a repeat or a wrong byte is corrupt.
struct StreamCheck {
  unsigned received = 0, corrupt = 0, gaps = 0;
  uint32_t last_seq = 0;
  // `n` frames from `receive` (size_t(uint8_t* out, size_t size, int
  // timeout_ms), virtio-net header first: a driver's receive); false when
  // they do not come.
  template <typename Receive>
  bool take(Receive&& receive, unsigned n) {
    std::vector<uint8_t> out(70000);
    for (unsigned i = 0; i < n; ++i) {
      const size_t got = receive(out.data(), out.size(), 3000);
      if (got == 0) return false;
      uint32_t seq = 0;
      const bool good =
          got > 12 && StreamPort::is_packet(out.data() + 12, got - 12, seq) && (received == 0 || seq > last_seq);
      if (!good) ++corrupt;
      if (good && received > 0) gaps += seq - last_seq - 1;
      last_seq = seq;
      ++received;
    }
    return true;
  }
};

}  // namespace sriovd::test
