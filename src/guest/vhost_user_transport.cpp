// vhost-user, as the VMM's front-end drives it (the spec's "Starting the
// device"): features and protocol features, the memory table, per vring
// its size, addresses, base, kick and call eventfds, enable. Behind an
// IOMMU (ACCESS_PLATFORM) the rings and buffers are IOVAs and this side
// plays the vIOMMU: it answers the back-end's IOTLB misses on the
// back-end channel with updates.

#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "sriovd/util/error.hpp"
#include "sriovd/util/unix_socket.hpp"
#include "sriovd/vhost_user/protocol.hpp"
#include "sriovd/virtio/net.hpp"
#include "transport.hpp"

namespace sriovd::guest {

namespace {

namespace vu = vhost_user;

constexpr uint64_t kRamBase = 0x100000;         // guest physical address of the shared RAM
constexpr uint64_t kIovaBase = 0x7c0000000ULL;  // where the emulated IOMMU maps it (anything but kRamBase)

class VhostUserTransport final : public Transport {
 public:
  VhostUserTransport(std::string socket, const VirtioNetDriverOptions& options, VirtioNetDriverStats& stats)
      : socket_(std::move(socket)), options_(options), stats_(stats) {}
  ~VhostUserTransport() override {
    log_stop_.store(true);
    if (log_reader_.joinable()) log_reader_.join();
    if (log_) ::munmap(log_, log_bytes_);
  }

  uint64_t negotiate(uint64_t want) override {
    if (options_.queue_pairs > 1)
      throw std::invalid_argument(
          "vhost-user: one queue pair (a VMM's control queue is its own; use virtio-net-pci for MQ)");
    if (options_.iommu && (options_.iommu_page < 4096 || (options_.iommu_page & (options_.iommu_page - 1)) != 0))
      throw std::invalid_argument("IOMMU page size " + std::to_string(options_.iommu_page) +
                                  " is not a power of two >= 4096");
    sock_ = connect_unix(socket_, "vhost-user socket");
    timeval tv{5, 0};
    ::setsockopt(sock_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    const uint64_t offered = request(vu::kGetFeatures, nullptr, 0, {}, true);
    if (options_.iommu) want |= virtio::kAccessPlatform;
    const uint64_t features = offered & want;
    if (options_.iommu && !(features & virtio::kAccessPlatform))
      throw std::runtime_error(
          "the back-end does not offer VIRTIO_F_ACCESS_PLATFORM (iommu_platform: true in its config)");
    protocol_ = offered & vu::kFeatureProtocolFeatures;
    request(vu::kSetOwner, nullptr, 0, {}, false);
    if (protocol_) {
      const uint64_t proto_offered = request(vu::kGetProtocolFeatures, nullptr, 0, {}, true);
      // Only an IOMMU needs an extension: the back-end channel for misses,
      // and REPLY_ACK so that an update is in place before the guest goes on.
      uint64_t need = options_.iommu ? vu::kProtoBackendReq | vu::kProtoReplyAck : 0;
      if ((proto_offered & need) != need)
        throw std::runtime_error("the back-end does not offer BACKEND_REQ and REPLY_ACK, which an IOMMU needs");
      if (options_.dirty_log) {
        if (!(proto_offered & vu::kProtoLogShmfd) || !(offered & vu::kFeatureLogAll))
          throw std::runtime_error("the back-end offers no dirty logging (LOG_SHMFD, VHOST_F_LOG_ALL)");
        need |= vu::kProtoLogShmfd;
      }
      request(vu::kSetProtocolFeatures, &need, 8, {}, false);
    } else if (options_.iommu || options_.dirty_log) {
      throw std::runtime_error("the back-end has no protocol features, which an IOMMU or a dirty log needs");
    }
    // A VMM that starts a device in the middle of a migration sends
    // LOG_ALL before the log (QEMU's order): the back-end waits for it.
    const uint64_t set =
        features | (protocol_ ? vu::kFeatureProtocolFeatures : 0) | (options_.dirty_log ? vu::kFeatureLogAll : 0);
    request(vu::kSetFeatures, &set, 8, {}, false);
    if (options_.iommu) {
      int sv[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) != 0)
        throw_errno("back-end channel");
      channel_.reset(sv[0]);
      UniqueFd theirs(sv[1]);
      request(vu::kSetBackendReqFd, nullptr, 0, {theirs.get()}, false);
    }
    return features;
  }

  unsigned queue_pairs(uint64_t /*features*/, unsigned /*asked*/) override { return 1; }
  unsigned control_queue(unsigned /*pairs*/) override {
    throw std::logic_error("vhost-user: the control queue is the VMM's own");
  }

  uint64_t share(const GuestRam& ram) override {
    ram_ = ram;
    vu::MemTable t{};
    t.nregions = 1;
    t.regions[0] = {kRamBase, ram.size, reinterpret_cast<uint64_t>(ram.host), 0};
    request(vu::kSetMemTable, &t, 8 + sizeof(vu::MemRegion), {ram.fd}, false);
    if (options_.dirty_log) give_log(kRamBase + ram.size);
    // Behind an IOMMU the device sees IOVAs; else guest-physical addresses.
    dma_base_ = options_.iommu ? kIovaBase : kRamBase;
    return dma_base_;
  }

  Started start(std::span<const QueueSetup> queues) override {
    Started s;
    for (const QueueSetup& q : queues) {
      vu::VringState num{q.index, q.size};
      request(vu::kSetVringNum, &num, sizeof num, {}, false);
      // The used ring's guest address for its log (the device area).
      vu::VringAddr va{q.index,
                       options_.dirty_log ? vu::kVringFlagLog : 0U,
                       uva(q.rings.desc),
                       uva(q.rings.device),
                       uva(q.rings.driver),
                       q.rings.device};
      request(vu::kSetVringAddr, &va, sizeof va, {}, false);
      vu::VringState base{q.index, 0};
      request(vu::kSetVringBase, &base, sizeof base, {}, false);
      if (s.doorbells.size() <= q.index) s.doorbells.resize(q.index + 1);
      if (s.interrupts.size() <= q.vector) s.interrupts.resize(q.vector + 1);
      s.doorbells[q.index].reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
      s.interrupts[q.vector].reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
      if (!s.doorbells[q.index] || !s.interrupts[q.vector]) throw_errno("vring eventfd");
      const uint64_t idx = q.index;
      request(vu::kSetVringCall, &idx, 8, {s.interrupts[q.vector].get()}, false);
      request(vu::kSetVringKick, &idx, 8, {s.doorbells[q.index].get()}, false);
      if (protocol_) {
        vu::VringState on{q.index, 1};
        request(vu::kSetVringEnable, &on, sizeof on, {}, false);
      }
    }
    // A round trip: every request before it has been taken.
    (void)request(vu::kGetFeatures, nullptr, 0, {}, true);
    return s;
  }

  // Every vring has its kick eventfd.
  void notify(unsigned /*q*/) override {}

  int poll(pollfd* fds, nfds_t count, int timeout_ms) override {
    constexpr nfds_t kMax = 8;
    if (!channel_ || count >= kMax) return ::poll(fds, count, timeout_ms);
    pollfd all[kMax];
    std::copy(fds, fds + count, all);
    all[count] = {channel_.get(), POLLIN, 0};
    const int n = ::poll(all, count + 1, timeout_ms);
    if (n > 0 && (all[count].revents & (POLLIN | POLLHUP))) serve_iotlb();
    for (nfds_t i = 0; i < count; ++i) fds[i].revents = all[i].revents;
    return n;
  }

  std::string mac() override { return "(vhost-user: the VMM's)"; }

 private:
  // Vring addresses: IOVAs behind an IOMMU, else this process's own.
  [[nodiscard]] uint64_t uva(uint64_t dma) const {
    return options_.iommu ? dma : reinterpret_cast<uint64_t>(ram_.host) + (dma - dma_base_);
  }

  // The dirty log for guest addresses below `top`: a memfd, one bit per
  // page, given with SET_LOG_BASE (whose empty reply comes first), and a
  // thread that takes what is marked every 10 ms.
  void give_log(uint64_t top) {
    log_bytes_ = ((top / 4096 + 7) / 8 + 4095) & ~uint64_t{4095};
    UniqueFd fd(::memfd_create("sriovd-guest-log", MFD_CLOEXEC));
    if (!fd || ::ftruncate(fd.get(), static_cast<off_t>(log_bytes_)) != 0) throw_errno("dirty log");
    void* p = ::mmap(nullptr, log_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (p == MAP_FAILED) throw_errno("dirty log mapping");
    log_ = static_cast<uint8_t*>(p);
    const vu::LogDesc d{log_bytes_, 0};
    vu::Header h{vu::kSetLogBase, vu::kVersion, sizeof d};
    std::vector<uint8_t> bytes(sizeof h + sizeof d);
    std::memcpy(bytes.data(), &h, sizeof h);
    std::memcpy(bytes.data() + sizeof h, &d, sizeof d);
    const iovec iov{bytes.data(), bytes.size()};
    const int fds[] = {fd.get()};
    if (send_with_fds(sock_.get(), {&iov, 1}, fds) != static_cast<ssize_t>(bytes.size()))
      throw SystemError(errno, "vhost-user SET_LOG_BASE");
    vu::Header rh{};
    if (::recv(sock_.get(), &rh, sizeof rh, MSG_WAITALL) != sizeof rh || rh.request != vu::kSetLogBase || rh.size != 0)
      throw std::runtime_error("vhost-user: no reply to SET_LOG_BASE");
    log_reader_ = std::thread([this] {
      auto* words = reinterpret_cast<uint64_t*>(log_);
      while (!log_stop_.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        uint64_t pages = 0;
        for (uint64_t i = 0; i < log_bytes_ / 8; ++i)
          if (std::atomic_ref<uint64_t>(words[i]).load(std::memory_order_relaxed) != 0)
            pages += static_cast<uint64_t>(__builtin_popcountll(std::atomic_ref<uint64_t>(words[i]).exchange(0)));
        stats_.dirty_pages.fetch_add(pages, std::memory_order_relaxed);
      }
    });
  }

  // One request; with `reply`, waits for the u64 reply (or the REPLY_ACK
  // status) and returns it.
  uint64_t request(uint32_t req, const void* payload, uint32_t size, const std::vector<int>& fds, bool reply,
                   uint32_t flags = 0) {
    vu::Header h{req, vu::kVersion | flags, size};
    std::vector<uint8_t> bytes(sizeof h + size);
    std::memcpy(bytes.data(), &h, sizeof h);
    if (size) std::memcpy(bytes.data() + sizeof h, payload, size);
    const iovec iov{bytes.data(), bytes.size()};
    if (send_with_fds(sock_.get(), {&iov, 1}, fds) != static_cast<ssize_t>(bytes.size()))
      throw SystemError(errno, "vhost-user request " + std::to_string(req));
    if (!reply) return 0;
    vu::Header rh{};
    uint64_t v = 0;
    if (::recv(sock_.get(), &rh, sizeof rh, MSG_WAITALL) != sizeof rh || rh.size != sizeof v ||
        ::recv(sock_.get(), &v, sizeof v, MSG_WAITALL) != sizeof v)
      throw std::runtime_error("vhost-user: no reply to request " + std::to_string(req) + " (the back-end hung up?)");
    return v;
  }

  // The emulated IOMMU maps guest RAM at kIovaBase. A miss inside that
  // window is answered with an UPDATE of the page around it (REPLY_ACK: in
  // place when acknowledged); one outside it gets no answer, as the spec
  // says of an invalid miss, and is counted.
  void serve_iotlb() {
    for (;;) {
      struct {
        vu::Header h;
        vu::IotlbMsg m;
      } __attribute__((packed)) in{};
      const ssize_t n = ::recv(channel_.get(), &in, sizeof in.h, MSG_DONTWAIT | MSG_PEEK);
      if (n < static_cast<ssize_t>(sizeof in.h)) {
        if (n == 0) throw std::runtime_error("vhost-user: the back-end closed its channel");
        return;
      }
      if (in.h.size > vu::kMaxPayload)
        throw std::runtime_error("vhost-user: back-end message of " + std::to_string(in.h.size) + " bytes");
      std::vector<uint8_t> whole(sizeof in.h + in.h.size);
      if (::recv(channel_.get(), whole.data(), whole.size(), MSG_WAITALL) != static_cast<ssize_t>(whole.size()))
        throw std::runtime_error("vhost-user: a short message on the back-end channel");
      if (in.h.request != vu::kBackendIotlbMsg || in.h.size != sizeof(vu::IotlbMsg)) continue;  // config change etc.
      std::memcpy(&in.m, whole.data() + sizeof in.h, sizeof in.m);
      if (in.m.type != vu::kIotlbMiss) continue;
      stats_.iotlb_misses.fetch_add(1, std::memory_order_relaxed);
      const uint64_t page = in.m.iova & ~(static_cast<uint64_t>(options_.iommu_page) - 1);
      if (page < dma_base_ || page + options_.iommu_page > dma_base_ + ram_.size) {
        stats_.iotlb_faults.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      const vu::IotlbMsg update{page,
                                options_.iommu_page,
                                reinterpret_cast<uint64_t>(ram_.host) + (page - dma_base_),
                                virtio::kIotlbRead | virtio::kIotlbWrite,
                                vu::kIotlbUpdate,
                                {}};
      if (request(vu::kIotlbMsg, &update, sizeof update, {}, true, vu::kFlagNeedReply) != 0)
        throw std::runtime_error("vhost-user: the back-end refused an IOTLB update");
      stats_.iotlb_updates.fetch_add(1, std::memory_order_relaxed);
    }
  }

  std::string socket_;
  VirtioNetDriverOptions options_;
  VirtioNetDriverStats& stats_;
  UniqueFd sock_;
  UniqueFd channel_;  // our end of SET_BACKEND_REQ_FD (IOTLB misses)
  bool protocol_ = false;
  GuestRam ram_;
  uint64_t dma_base_ = 0;
  uint8_t* log_ = nullptr;  // --dirty-log
  uint64_t log_bytes_ = 0;
  std::atomic<bool> log_stop_{false};
  std::thread log_reader_;
};

}  // namespace

std::unique_ptr<Transport> make_vhost_user_transport(std::string socket, const VirtioNetDriverOptions& options,
                                                     VirtioNetDriverStats& stats) {
  return std::make_unique<VhostUserTransport>(std::move(socket), options, stats);
}

}  // namespace sriovd::guest
