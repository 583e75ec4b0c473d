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

#include <sys/mman.h>

#include "sriovd/guest/virtqueue.hpp"
#include "sriovd/util/unix_socket.hpp"
#include "sriovd/vhost_user/backend.hpp"
#include "sriovd/vhost_user/protocol.hpp"
#include "sriovd/virtio/net.hpp"
#include "support/stream_port.hpp"

namespace sriovd::vhost_user::test {

using sriovd::test::EventPort;

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
  // A successor's: serves the front-end `handover` came from.
  BackendRunner(const virtio::NetConfig& nc, std::unique_ptr<virtio::PacketPort> port, const std::string& socket,
                BackendHandover handover, Backend::Mode mode = Backend::Mode::server)
      : engine(no_relay()),
        device(nc, engine, std::move(port)),
        backend(io, socket, device, engine, mode, {}, std::move(handover)),
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

// The guest's side as these tests lay it out: RAM in a memfd (what the
// front-end shares) and the driver's half of an RX ring at 0 and a TX ring
// at 0x8000, split or packed.
struct GuestRings {
  // `backing`: a file of at least `bytes` to use instead of a fresh memfd.
  GuestRings(size_t bytes, uint16_t queue_size, bool packed_rings, UniqueFd backing = {})
      : fd(std::move(backing)), size(bytes), packed(packed_rings) {
    if (!fd) {
      fd.reset(::memfd_create("ram", MFD_CLOEXEC));
      if (!fd || ::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) throw std::runtime_error("guest RAM memfd");
    }
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (p == MAP_FAILED) throw std::runtime_error("guest RAM mapping");
    ram = static_cast<uint8_t*>(p);
    if (packed) {
      rx_packed = std::make_unique<guest::PackedDriver>(ram, 0, queue_size);
      tx_packed = std::make_unique<guest::PackedDriver>(ram + 0x8000, 0x8000, queue_size);
    } else {
      rx_split = std::make_unique<guest::SplitDriver>(ram, 0, queue_size);
      tx_split = std::make_unique<guest::SplitDriver>(ram + 0x8000, 0x8000, queue_size);
    }
  }
  ~GuestRings() { ::munmap(ram, size); }
  GuestRings(const GuestRings&) = delete;
  GuestRings& operator=(const GuestRings&) = delete;
  [[nodiscard]] virtio::RingAddresses addresses(unsigned q) const {
    return packed ? (q == 0 ? rx_packed : tx_packed)->addresses() : (q == 0 ? rx_split : tx_split)->addresses();
  }
  UniqueFd fd;
  size_t size;
  bool packed;
  uint8_t* ram = nullptr;
  std::unique_ptr<guest::SplitDriver> rx_split, tx_split;
  std::unique_ptr<guest::PackedDriver> rx_packed, tx_packed;
};

// One vring as QEMU starts it: size, addresses, base, fresh kick and call
// eventfds (into `kick` and `call`), enable. `send` is the test's request
// function (request, payload, size, fds).
template <typename Send>
void start_vring(Send&& send, unsigned q, uint32_t size, const VringAddr& addr, uint32_t base, UniqueFd& kick,
                 UniqueFd& call) {
  const VringState num{q, size};
  send(kSetVringNum, &num, sizeof num, std::vector<int>{});
  send(kSetVringAddr, &addr, sizeof addr, std::vector<int>{});
  const VringState b{q, base};
  send(kSetVringBase, &b, sizeof b, std::vector<int>{});
  kick.reset(::eventfd(0, EFD_NONBLOCK));
  call.reset(::eventfd(0, EFD_NONBLOCK));
  const uint64_t idx = q;
  send(kSetVringKick, &idx, 8, std::vector<int>{kick.get()});
  send(kSetVringCall, &idx, 8, std::vector<int>{call.get()});
  const VringState on{q, 1};
  send(kSetVringEnable, &on, sizeof on, std::vector<int>{});
}

// GET_INFLIGHT_FD for `queues` queues of `size`: the buffer's fd and its
// description (`got`, the reply's header in `reply`); an invalid fd when
// the back-end answered otherwise.
inline UniqueFd get_inflight_fd(int sock, uint16_t queues, uint16_t size, InflightDesc& got, Header& reply) {
  InflightDesc want{0, 0, queues, size, 0};
  const Header h{kGetInflightFd, kVersion, sizeof want};
  const iovec iov[2] = {{const_cast<Header*>(&h), sizeof h}, {&want, sizeof want}};
  if (send_with_fds(sock, iov, {}) != static_cast<ssize_t>(sizeof h + sizeof want)) return {};
  struct {
    Header h;
    InflightDesc d;
  } __attribute__((packed)) answer{};
  std::vector<UniqueFd> fds;
  bool truncated = false;
  if (recv_with_fds(sock, &answer, sizeof answer, fds, MSG_WAITALL, truncated) != static_cast<ssize_t>(sizeof answer) ||
      fds.size() != 1)
    return {};
  reply = answer.h;
  got = answer.d;
  return std::move(fds[0]);
}

}  // namespace sriovd::vhost_user::test
