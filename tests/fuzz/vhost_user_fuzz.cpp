// The vhost-user back-end as a hostile VMM meets it: a real Backend and
// NetDevice (workers, routing engine, a port that sends and receives),
// driven over a real socket with messages the input writes - any request,
// size, flags and payload, with the fds each request carries (a memfd of
// guest RAM the harness also writes into, eventfds, an inflight memfd, a
// socketpair for the back-end channel). Between messages the input may
// rewrite guest RAM and kick queues. Every input is one connection; its
// end resets the device, and the next input starts clean.
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "fuzz/input.hpp"
#include "fuzz/socket_peer.hpp"
#include "sriovd/irq/engine.hpp"
#include "sriovd/util/unix_socket.hpp"
#include "sriovd/vhost_user/backend.hpp"
#include "sriovd/vhost_user/protocol.hpp"
#include "sriovd/virtio/net.hpp"

namespace {

using namespace sriovd;
using namespace sriovd::vhost_user;

constexpr size_t kRam = 1 << 20;

// Sends what the device transmits nowhere; hands it a small frame on every
// receive, a few per connection (the RX path writes guest buffers).
class FuzzPort : public virtio::PacketPort {
 public:
  FuzzPort() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
  [[nodiscard]] const std::string& name() const override { return name_; }
  [[nodiscard]] unsigned queues() const override { return 2; }
  [[nodiscard]] int fd(unsigned) const override { return fd_.get(); }
  ssize_t send(unsigned, const iovec* iov, int count) override {
    ssize_t n = 0;
    for (int i = 0; i < count; ++i) n += static_cast<ssize_t>(iov[i].iov_len);
    return n;
  }
  ssize_t recv(unsigned, uint8_t* buf, size_t size) override {
    if (frames_.load() == 0 || size < 74) return -1;
    frames_.fetch_sub(1);
    std::memset(buf, 0, 74);
    std::memset(buf + 12, 0xff, 6);  // broadcast: every filter takes it
    buf[24] = 0x08;
    return 74;
  }
  void set_offloads(unsigned) override {}
  void give_frames(unsigned n) {
    frames_.store(n);
    const uint64_t one = 1;
    (void)::write(fd_.get(), &one, sizeof one);
  }

 private:
  std::string name_ = "fuzz0";
  UniqueFd fd_;
  std::atomic<unsigned> frames_{0};
};

struct World {
  World() {
    spdlog::set_level(spdlog::level::off);  // a log line per refused message would be most of the time
    dir = fuzz::socket_dir("vu");
    irq::EngineOptions o;
    o.relay_threads = 0;
    engine = std::make_unique<irq::Engine>(o);
    virtio::NetConfig nc;
    nc.name = "fuzz";
    nc.queue_pairs = 2;
    nc.access_platform = true;
    auto p = std::make_unique<FuzzPort>();
    port = p.get();
    device = std::make_unique<virtio::NetDevice>(nc, *engine, std::move(p));
    socket = (dir / "vu.sock").string();
    backend = std::make_unique<Backend>(io, socket, *device, *engine);
    ram.reset(::memfd_create("fuzz-ram", MFD_CLOEXEC));
    (void)::ftruncate(ram.get(), kRam);
    host = static_cast<uint8_t*>(::mmap(nullptr, kRam, PROT_READ | PROT_WRITE, MAP_SHARED, ram.get(), 0));
  }
  std::filesystem::path dir;
  asio::io_context io;
  std::unique_ptr<irq::Engine> engine;
  FuzzPort* port = nullptr;
  std::unique_ptr<virtio::NetDevice> device;
  std::string socket;
  std::unique_ptr<Backend> backend;
  UniqueFd ram;
  uint8_t* host = nullptr;
};

World& world() {
  static World* w = new World();  // lives for the process: the fuzzer may stop anywhere
  return *w;
}

// The requests the back-end serves, and a few it does not.
constexpr uint32_t kRequests[] = {kGetFeatures,
                                  kSetFeatures,
                                  kSetOwner,
                                  kResetOwner,
                                  kSetMemTable,
                                  kSetVringNum,
                                  kSetVringAddr,
                                  kSetVringBase,
                                  kGetVringBase,
                                  kSetVringKick,
                                  kSetVringCall,
                                  kSetVringErr,
                                  kGetProtocolFeatures,
                                  kSetProtocolFeatures,
                                  kGetQueueNum,
                                  kSetVringEnable,
                                  kSendRarp,
                                  kNetSetMtu,
                                  kSetBackendReqFd,
                                  kIotlbMsg,
                                  kGetConfig,
                                  kSetConfig,
                                  kGetInflightFd,
                                  kSetInflightFd,
                                  kResetDevice,
                                  kGetMaxMemSlots,
                                  kAddMemReg,
                                  kRemMemReg,
                                  kSetStatus,
                                  kGetStatus,
                                  kSetLogBase,
                                  kSetLogFd,
                                  99};

size_t usual_size(uint32_t request, uint16_t pick) {
  switch (request) {
    case kSetFeatures:
    case kSetProtocolFeatures:
    case kNetSetMtu:
    case kSetStatus:
    case kSendRarp:
    case kSetVringKick:
    case kSetVringCall:
    case kSetVringErr: return 8;
    case kSetVringNum:
    case kSetVringBase:
    case kGetVringBase:
    case kSetVringEnable: return sizeof(VringState);
    case kSetVringAddr: return sizeof(VringAddr);
    case kSetMemTable: return 8 + sizeof(MemRegion) * (1 + pick % kMaxRegions);
    case kIotlbMsg: return sizeof(IotlbMsg);
    case kAddMemReg:
    case kRemMemReg: return sizeof(SingleMemRegion);
    case kGetInflightFd:
    case kSetInflightFd: return sizeof(InflightDesc);
    case kSetLogBase: return sizeof(LogDesc);
    case kGetConfig:
    case kSetConfig: return 12 + pick % 32;
    default: return 0;
  }
}

// The fds a request of this kind carries (the fuzzer still picks how many).
std::vector<UniqueFd> fds_for(World& w, uint32_t request, fuzz::Input& in) {
  std::vector<UniqueFd> fds;
  const unsigned n = in.byte() % 4;
  for (unsigned i = 0; i < n; ++i) {
    switch (request) {
      case kSetMemTable:
      case kAddMemReg:
      case kRemMemReg: fds.emplace_back(::dup(w.ram.get())); break;
      case kSetLogBase:  // a dirty log of the fuzzer's size (the payload says another)
      case kSetInflightFd: {
        UniqueFd m(::memfd_create("fuzz-inflight", MFD_CLOEXEC));
        (void)::ftruncate(m.get(), static_cast<off_t>(in.take<uint16_t>()) * 16);
        fds.push_back(std::move(m));
        break;
      }
      case kSetBackendReqFd: {
        int sv[2];
        if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) == 0) {
          fds.emplace_back(sv[0]);
          ::close(sv[1]);
        }
        break;
      }
      default: {
        int p[2];
        if ((in.byte() & 7U) == 0 && ::pipe2(p, O_CLOEXEC) == 0) {  // not an eventfd
          fds.emplace_back(p[0]);
          ::close(p[1]);
        } else {
          fds.emplace_back(::eventfd(0, EFD_CLOEXEC));
        }
      }
    }
  }
  return fds;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  World& w = world();
  fuzz::Input in(data, size);
  UniqueFd sock;
  try {
    sock = connect_unix(w.socket, "fuzz", true);
  } catch (const std::exception&) {
    return 0;
  }
  fuzz::settle(w.io, sock.get());
  w.port->give_frames(in.byte() % 8);
  for (unsigned step = 0; step < 64 && !in.empty(); ++step) {
    const uint8_t op = in.byte();
    if (op % 8 == 7) {  // the guest writes its RAM (rings, descriptors, buffers)
      const uint32_t off = in.take<uint32_t>() % kRam;
      const auto bytes = in.bytes(in.byte() % 64);
      std::memcpy(w.host + off, bytes.data(), std::min<size_t>(bytes.size(), kRam - off));
      continue;
    }
    const uint32_t request = kRequests[in.byte() % std::size(kRequests)];
    const uint32_t flags = (in.byte() & 1U) ? kVersion | kFlagNeedReply : kVersion;
    // Mostly the size the request takes (so the fuzzer gets past the shape
    // check), sometimes any size.
    const uint16_t pick = in.take<uint16_t>();
    const auto payload = in.bytes((pick & 0x8000U) ? pick % 512 : usual_size(request, pick));
    std::vector<UniqueFd> fds = fds_for(w, request, in);
    std::vector<int> raw;
    for (const auto& f : fds) raw.push_back(f.get());
    Header h{request, flags, static_cast<uint32_t>(payload.size())};
    const iovec iov[2] = {{&h, sizeof h}, {const_cast<uint8_t*>(payload.data()), payload.size()}};
    if (send_with_fds(sock.get(), std::span<const iovec>(iov, payload.empty() ? 1 : 2), raw) < 0) break;
    fuzz::settle(w.io, sock.get());
  }
  sock.reset();
  fuzz::settle(w.io, -1);
  return 0;
}
