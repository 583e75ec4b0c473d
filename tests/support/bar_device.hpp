#pragma once
// For tests and benches of the vfio-user server: a device with one 4 KiB
// BAR (region 0, read and write, no mmap) and no interrupts, whose writes
// a subclass decides; the wire bytes of a posted doorbell write; a blocking
// send of a whole buffer; and an export of such a device on a session
// thread.
#include <linux/vfio.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "sriovd/util/session_threads.hpp"
#include "sriovd/vfio_user/device.hpp"
#include "sriovd/vfio_user/protocol.hpp"
#include "sriovd/vfio_user/server.hpp"

namespace sriovd::test {

class BarDevice : public vfio_user::ExportedDevice {
 public:
  explicit BarDevice(std::string name) : name_(std::move(name)) {}
  [[nodiscard]] const std::string& name() const override { return name_; }
  vfio_user::RegionDescription region(uint32_t index) override {
    vfio_user::RegionDescription r;
    if (index == 0) {
      r.flags = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;
      r.size = 4096;
    }
    return r;
  }
  void read(uint32_t, uint64_t, std::span<uint8_t> data) override { std::fill(data.begin(), data.end(), 0); }
  vfio::IrqInfo irq(uint32_t index) override { return {index, 0, 0}; }
  void set_irq_eventfds(uint32_t, uint32_t, std::vector<UniqueFd>) override {}
  void disable_irqs(uint32_t) override {}
  void mask_irq(uint32_t, uint32_t, bool) override {}
  void trigger_irq(uint32_t, uint32_t) override {}
  void reset() override {}
  void client_gone() override {}

 private:
  std::string name_;
};

// One posted 4-byte REGION_WRITE (No_reply) of 1 at BAR0 + offset, as the
// wire carries it: what QEMU's client sends for a queue notify.
using Doorbell = std::array<uint8_t, 36>;
inline Doorbell doorbell(uint64_t offset = 0x10) {
  Doorbell d{};
  const vfio_user::Header h{0, vfio_user::kRegionWrite, 36, vfio_user::kNoReply, 0};
  const vfio_user::RegionAccess a{offset, 0, 4};
  const uint32_t value = 1;
  std::memcpy(d.data(), &h, sizeof h);
  std::memcpy(d.data() + sizeof h, &a, sizeof a);
  std::memcpy(d.data() + sizeof h + sizeof a, &value, sizeof value);
  return d;
}

// The whole buffer into a blocking socket; false when the peer is gone.
inline bool send_all(int fd, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    const ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// A device and its server on a session thread (made and deleted there).
template <typename Device>
struct SessionExport {
  template <typename... Args>
  SessionExport(SessionThread& t, const std::string& path, Args&&... args)
      : device(std::forward<Args>(args)...),
        server(make_on_session(t, [&] { return std::make_unique<vfio_user::Server>(t.io(), path, device); })) {}
  Device device;
  OnSession<vfio_user::Server> server;
};

}  // namespace sriovd::test
