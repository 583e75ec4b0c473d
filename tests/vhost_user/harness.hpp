#pragma once
// What the vhost-user tests share: a back-end and its device served on an
// io thread of their own, packet ports built on an eventfd, and a
// front-end's request that waits for the REPLY_ACK.
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "sriovd/util/unix_socket.hpp"
#include "sriovd/vhost_user/backend.hpp"
#include "sriovd/vhost_user/protocol.hpp"
#include "sriovd/virtio/net.hpp"

namespace sriovd::vhost_user::test {

// A port whose fd is an eventfd the port itself signals; by default
// nothing arrives and what is sent goes nowhere.
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

// A device with `port` served by a back-end on `socket`, the protocol on
// an io thread of its own (relay threads off: the tests read the routes).
class BackendRunner {
 public:
  BackendRunner(const virtio::NetConfig& nc, std::unique_ptr<virtio::PacketPort> port, const std::string& socket,
                Backend::Mode mode = Backend::Mode::server, std::vector<uid_t> allowed_uids = {})
      : engine(no_relay()),
        device(nc, engine, std::move(port)),
        backend(io, socket, device, engine, mode, std::move(allowed_uids)),
        runner([this] { io.run(); }) {}
  ~BackendRunner() {
    io.stop();
    runner.join();
  }
  BackendRunner(const BackendRunner&) = delete;
  BackendRunner& operator=(const BackendRunner&) = delete;

  // Runs fn on the io thread and waits for its result.
  template <typename F>
  auto on_io(F fn) {
    std::promise<decltype(fn())> p;
    asio::post(io, [&] { p.set_value(fn()); });
    return p.get_future().get();
  }

  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  irq::Engine engine;
  virtio::NetDevice device;
  Backend backend;
  std::thread runner;

 private:
  static irq::EngineOptions no_relay() {
    irq::EngineOptions o;
    o.relay_threads = 0;
    return o;
  }
};

// A front-end's connection to `path`: replies are waited for at most
// `reply_wait` (SO_RCVTIMEO), so a back-end that does not answer fails the
// test instead of hanging it.
inline UniqueFd connect_frontend(const std::string& path, int reply_wait_s = 2) {
  UniqueFd fd = connect_unix(path, "vhost-user socket");
  timeval tv{reply_wait_s, 0};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

// One front-end request with NEED_REPLY (except SET_PROTOCOL_FEATURES,
// which negotiates REPLY_ACK and is not acknowledged); the ack's status,
// or -1 when the back-end hung up instead of answering.
inline int64_t acked_request(int sock, uint32_t request, const void* payload, uint32_t size,
                             std::span<const int> fds = {}) {
  const bool ack = request != kSetProtocolFeatures;
  Header h{request, ack ? kVersion | kFlagNeedReply : kVersion, size};
  const iovec iov[2] = {{&h, sizeof h}, {const_cast<void*>(payload), size}};
  if (send_with_fds(sock, std::span<const iovec>(iov, size ? 2 : 1), fds) != static_cast<ssize_t>(sizeof h + size))
    return -1;
  if (!ack) return 0;
  Header rh{};
  uint64_t status = 0;
  if (::recv(sock, &rh, sizeof rh, MSG_WAITALL) != static_cast<ssize_t>(sizeof rh) ||
      ::recv(sock, &status, sizeof status, MSG_WAITALL) != static_cast<ssize_t>(sizeof status))
    return -1;
  return static_cast<int64_t>(status);
}

}  // namespace sriovd::vhost_user::test
