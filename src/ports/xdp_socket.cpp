#include "sriovd/ports/xdp_socket.hpp"

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <linux/ethtool.h>
#include <linux/if_link.h>
#include <linux/sockios.h>
#include <linux/if_xdp.h>
#include <net/if.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>
#include <xdp/xsk.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <cerrno>
#include <cstdarg>
#include <cstring>
#include <stdexcept>

#include <spdlog/spdlog.h>

#include "sriovd/ports/netdev.hpp"
#include "sriovd/util/error.hpp"
#include "sriovd/virtio/offload.hpp"

// The compiled program (ports/bpf/xsk_redirect.bpf.c), linked in by
// ports/bpf/xsk_redirect_obj.S.
extern "C" const unsigned char sriovd_xsk_redirect_obj[];
extern "C" const unsigned char sriovd_xsk_redirect_obj_end[];

namespace sriovd::ports {

namespace {

constexpr size_t kDeviceHeader = 12;  // struct virtio_net_hdr_v1
constexpr const char* kProgName = "sriovd_xsk";
constexpr const char* kOwnerPrefix = "sriovd:";
constexpr size_t kOwnerBytes = 128;     // struct owner in the program
constexpr uint32_t kFillBatch = 64;     // received frames handed back to the kernel at once
constexpr uint32_t kXdpHeadroom = 256;  // XDP_PACKET_HEADROOM: where received frames start in their chunk
// Frames a copy-mode sendto() transmits (the kernel's TX_BATCH_SIZE), and
// the socket option that raises it (linux/if_xdp.h from 6.17; Debian 12's
// headers predate it).
constexpr unsigned kCopyTxBatch = 32;
constexpr int kXdpMaxTxSkbBudget = 9;

// What libbpf says while sriovd loads or attaches a program (the kernel's
// verifier log or extack message among it), for the error that follows.
thread_local std::string* libbpf_capture = nullptr;
int libbpf_print(enum libbpf_print_level level, const char* fmt, va_list args) {
  char line[1024];
  const int n = std::vsnprintf(line, sizeof line, fmt, args);
  if (n <= 0) return 0;
  std::string text(line, std::min<size_t>(static_cast<size_t>(n), sizeof line - 1));
  while (!text.empty() && text.back() == '\n') text.pop_back();
  if (libbpf_capture && level != LIBBPF_DEBUG) {
    if (!libbpf_capture->empty()) *libbpf_capture += "; ";
    *libbpf_capture += text;
  }
  spdlog::debug("libbpf: {}", text);
  return 0;
}
struct Capture {
  std::string text;
  Capture() {
    static const bool installed = (libbpf_set_print(libbpf_print), true);
    (void)installed;
    libbpf_capture = &text;
  }
  ~Capture() { libbpf_capture = nullptr; }
  Capture(const Capture&) = delete;
  Capture& operator=(const Capture&) = delete;
  [[nodiscard]] std::string said() const { return text.empty() ? "" : " (" + text + ")"; }
};

std::string errno_text(int err) { return std::strerror(err < 0 ? -err : err); }

// The program attached to ifindex (native or generic mode), if any: its
// id, name and, when it is ours, its owner.
struct Attached {
  uint32_t id = 0;
  std::string name;
  bool ours = false;
  std::string owner;
  UniqueFd fd;
};

Attached attached_to(unsigned ifindex) {
  Attached a;
  bpf_xdp_query_opts q{};
  q.sz = sizeof q;
  if (bpf_xdp_query(static_cast<int>(ifindex), 0, &q) != 0) return a;
  a.id = q.prog_id;
  if (a.id == 0) return a;
  a.fd.reset(bpf_prog_get_fd_by_id(a.id));
  if (!a.fd) return a;
  uint32_t map_ids[8] = {};
  bpf_prog_info info{};
  info.nr_map_ids = 8;
  info.map_ids = reinterpret_cast<uint64_t>(map_ids);
  uint32_t len = sizeof info;
  if (bpf_obj_get_info_by_fd(a.fd.get(), &info, &len) != 0) return a;
  a.name = info.name;
  if (a.name != kProgName) return a;
  for (uint32_t i = 0; i < std::min<uint32_t>(info.nr_map_ids, 8); ++i) {
    const UniqueFd map(bpf_map_get_fd_by_id(map_ids[i]));
    if (!map) continue;
    bpf_map_info mi{};
    uint32_t mlen = sizeof mi;
    if (bpf_obj_get_info_by_fd(map.get(), &mi, &mlen) != 0 || std::string(mi.name) != "sriovd_owner" ||
        mi.value_size != kOwnerBytes)
      continue;
    char text[kOwnerBytes] = {};
    const uint32_t key = 0;
    if (bpf_map_lookup_elem(map.get(), &key, text) != 0) continue;
    a.owner.assign(text, strnlen(text, sizeof text));
    a.ours = a.owner.rfind(kOwnerPrefix, 0) == 0;
  }
  return a;
}

// "sriovd:<instance> <device>" -> instance.
std::string instance_of(const std::string& owner) {
  const size_t space = owner.rfind(' ');
  const size_t start = std::string(kOwnerPrefix).size();
  return space == std::string::npos || space < start ? owner.substr(start) : owner.substr(start, space - start);
}

// Detaches the program `prog_fd` from ifindex, and only that one: not one
// attached there since.
bool detach(unsigned ifindex, int prog_fd) {
  bpf_xdp_attach_opts o{};
  o.sz = sizeof o;
  o.old_prog_fd = prog_fd;
  return bpf_xdp_detach(static_cast<int>(ifindex), XDP_FLAGS_REPLACE, &o) == 0;
}

// The netdev's RX queues (ETHTOOL_GCHANNELS: rx or combined channels,
// in this process's network namespace); 0 when the driver does not say.
unsigned rx_queues_of(const std::string& ifname) {
  const UniqueFd sock(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!sock) return 0;
  ethtool_channels ch{};
  ch.cmd = ETHTOOL_GCHANNELS;
  ifreq ifr{};
  std::strncpy(ifr.ifr_name, ifname.c_str(), IFNAMSIZ - 1);
  ifr.ifr_data = reinterpret_cast<char*>(&ch);
  if (::ioctl(sock.get(), SIOCETHTOOL, &ifr) != 0) return 0;
  return ch.rx_count + ch.combined_count;
}

}  // namespace

const char* to_string(XdpMode m) { return m == XdpMode::zero_copy ? "zero-copy" : "copy"; }

std::vector<virtio::PortFact> XdpSocket::describe() const {
  std::vector<uint64_t> received;
  for (unsigned q = 0; q < sockets(); ++q) received.push_back(received_on(q));
  return {{"xdp_mode", to_string(mode_)},
          {"xdp_attach", generic_ ? "generic" : "native"},
          {"xdp_tx_budget", uint64_t{tx_budget_}},
          {"xdp_received", std::move(received)}};
}

std::string XdpSocket::owner_of(const std::string& instance, const std::string& device) {
  return kOwnerPrefix + instance + " " + device;
}

struct XdpSocket::Program {
  bpf_object* obj = nullptr;
  int prog_fd = -1;
  int xsks_fd = -1;
  unsigned ifindex = 0;
  bool attached = false;
  ~Program() {
    if (attached && !detach(ifindex, prog_fd))
      spdlog::warn("af_xdp: detaching the XDP program from ifindex {}: {}", ifindex, std::strerror(errno));
    if (obj) bpf_object__close(obj);
  }
};

// One socket, its UMEM and its four rings. Receive side (rx, fill): its
// reader of the moment, under `claimed`; transmit side (tx, comp): the
// worker of this queue.
struct XdpSocket::Queue {
  unsigned index = 0;
  uint8_t* area = nullptr;
  size_t area_len = 0;
  xsk_umem* umem = nullptr;
  xsk_socket* xsk = nullptr;     // receives
  xsk_socket* xsk_tx = nullptr;  // transmits
  int fd = -1;
  int tx_fd = -1;
  xsk_ring_prod fill{};
  xsk_ring_cons comp{};
  xsk_ring_cons rx{};
  xsk_ring_prod tx{};
  UniqueFd set;     // epoll: the sockets whose received frames this queue's reader takes
  int in_set = -1;  // which queue's set this socket's receive side is in
  // Receive side.
  std::atomic<bool> claimed{false};
  uint32_t unreleased = 0;  // rx entries peeked and copied, not yet released
  std::vector<uint64_t> to_fill;
  uint32_t n_fill = 0;
  std::atomic<uint64_t> received{0};
  // Transmit side: frames free for send(), a stack.
  std::vector<uint64_t> tx_free;
  uint32_t n_free = 0;
  uint32_t tx_pending = 0;  // reserved and written, not yet submitted
  ~Queue() {
    if (xsk_tx) xsk_socket__delete(xsk_tx);
    if (xsk) xsk_socket__delete(xsk);
    if (umem) xsk_umem__delete(umem);
    if (area) ::munmap(area, area_len);
  }
};

XdpSocket::XdpSocket(const std::string& ifname, unsigned queues, unsigned mtu, const std::string& instance,
                     const std::string& device, uint32_t ring_size)
    : name_(ifname), control_(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0)) {
  if (!control_) throw_errno("AF_XDP port for " + ifname + ": a socket for its interface flags");
  if (queues == 0 || queues > kMaxQueues)
    throw std::invalid_argument("AF_XDP port for " + ifname + ": " + std::to_string(queues) + " queues (1.." +
                                std::to_string(kMaxQueues) + ")");
  if (ring_size < 64 || (ring_size & (ring_size - 1)) != 0)
    throw std::invalid_argument("AF_XDP port for " + ifname + ": ring size " + std::to_string(ring_size) +
                                " is not a power of two of at least 64");
  ifindex_ = ::if_nametoindex(ifname.c_str());
  if (ifindex_ == 0) throw_errno("netdev " + ifname);
  // A chunk holds the headroom, a VLAN-tagged frame of the MTU (receive),
  // or the device's header and the frame (transmit).
  const unsigned need = kXdpHeadroom + 18 + mtu;
  frame_ = need <= 2048 ? 2048 : need <= 4096 ? 4096 : 0;
  if (frame_ == 0)
    throw std::invalid_argument("AF_XDP port for " + ifname + ": MTU " + std::to_string(mtu) +
                                " does not fit one 4096-byte UMEM frame (AF_XDP without multi-buffer: MTU at most " +
                                std::to_string(4096 - kXdpHeadroom - 18) + ")");
  const unsigned have = rx_queues_of(ifname);
  if (have != 0 && have < queues)
    throw std::invalid_argument("AF_XDP port for " + ifname + ": " + std::to_string(queues) +
                                " queue pairs need as many RX queues; the netdev has " + std::to_string(have));
  // A socket on every RX queue: the NIC spreads flows over all of them,
  // whatever number of pairs the device has.
  pairs_ = queues;
  unsigned sockets = std::max(queues, have);
  if (sockets > kMaxQueues) {
    spdlog::warn("af_xdp {}: {} RX queues, sockets on the first {}: frames on the others reach the host's stack",
                 ifname, sockets, kMaxQueues);
    sockets = kMaxQueues;
  }

  remove_stale_program(instance, device);
  load_program(instance, device);
  attach_program(device);
  for (unsigned q = 0; q < sockets; ++q) bind_queue(q, ring_size);
  held_.assign(queues, 0);
  active_.store(queues);
  resteer();
}

// A program of ours already on the netdev: a crashed run's of this
// instance goes; anything else stays and is named.
void XdpSocket::remove_stale_program(const std::string& instance, const std::string& device) {
  const std::string& ifname = name_;
  if (Attached a = attached_to(ifindex_); a.id != 0) {
    if (!a.ours)
      throw std::runtime_error("netdev " + ifname + " already has an XDP program ('" + a.name + "', id " +
                               std::to_string(a.id) + "), not sriovd's: sriovd does not replace it");
    if (instance_of(a.owner) != instance)
      throw std::runtime_error("netdev " + ifname + " has the XDP program of another sriovd instance (" + a.owner +
                               ", id " + std::to_string(a.id) + ")");
    if (!detach(ifindex_, a.fd.get()))
      throw_errno("netdev " + ifname + ": removing the XDP program a crashed run left (" + a.owner + ")");
    spdlog::warn("virtio {}: removed the XDP program an earlier run left on {} ({})", device, ifname, a.owner);
  }
}

// sriovd's program, loaded, with this device as its owner.
void XdpSocket::load_program(const std::string& instance, const std::string& device) {
  const std::string& ifname = name_;
  prog_ = std::make_unique<Program>();
  prog_->ifindex = ifindex_;
  {
    Capture said;
    bpf_object_open_opts opts{};
    opts.sz = sizeof opts;
    opts.object_name = kProgName;
    prog_->obj = bpf_object__open_mem(
        sriovd_xsk_redirect_obj, static_cast<size_t>(sriovd_xsk_redirect_obj_end - sriovd_xsk_redirect_obj), &opts);
    if (!prog_->obj) {
      const int err = errno;
      throw std::runtime_error("AF_XDP on " + ifname + ": opening sriovd's XDP program: " + errno_text(err) +
                               said.said());
    }
    if (int err = bpf_object__load(prog_->obj); err != 0)
      throw std::runtime_error("AF_XDP on " + ifname + ": loading sriovd's XDP program: " + errno_text(err) +
                               (err == -EPERM ? " (needs CAP_BPF and CAP_NET_ADMIN)" : "") + said.said());
  }
  bpf_program* prog = bpf_object__find_program_by_name(prog_->obj, kProgName);
  prog_->prog_fd = prog ? bpf_program__fd(prog) : -1;
  prog_->xsks_fd = bpf_object__find_map_fd_by_name(prog_->obj, "sriovd_xsks");
  const int owner_fd = bpf_object__find_map_fd_by_name(prog_->obj, "sriovd_owner");
  if (prog_->prog_fd < 0 || prog_->xsks_fd < 0 || owner_fd < 0)
    throw std::logic_error("sriovd's XDP program lacks its program or maps");
  char owner[kOwnerBytes] = {};
  std::strncpy(owner, owner_of(instance, device).c_str(), sizeof owner - 1);
  const uint32_t zero = 0;
  if (bpf_map_update_elem(owner_fd, &zero, owner, BPF_ANY) != 0)
    throw_errno("AF_XDP on " + ifname + ": writing the owner map");
}

void XdpSocket::attach_program(const std::string& device) {
  const std::string& ifname = name_;
  {
    Capture said;
    // Native mode where the driver has it; generic XDP (the kernel runs
    // the program on the skb, after the driver) where it has none - igbvf,
    // most VF drivers of older NICs: slower, but the device is served, and
    // `sriovctl devices` says which (xdp_attach).
    int err = bpf_xdp_attach(static_cast<int>(ifindex_), prog_->prog_fd,
                             XDP_FLAGS_DRV_MODE | XDP_FLAGS_UPDATE_IF_NOEXIST, nullptr);
    if (err == -EOPNOTSUPP) {
      err = bpf_xdp_attach(static_cast<int>(ifindex_), prog_->prog_fd, XDP_FLAGS_SKB_MODE | XDP_FLAGS_UPDATE_IF_NOEXIST,
                           nullptr);
      if (err == 0) {
        generic_ = true;
        spdlog::warn("virtio {}: {}'s driver has no native XDP: AF_XDP runs on generic XDP (slower)", device, ifname);
      }
    }
    if (err != 0) {
      std::string why = errno_text(err);
      if (err == -EOPNOTSUPP) why = "neither native nor generic XDP is possible on it";
      if (err == -EBUSY || err == -EEXIST) why = "another XDP program was attached meanwhile";
      throw std::runtime_error("AF_XDP: attaching the XDP program to " + ifname + " failed: " + why + said.said());
    }
  }
  prog_->attached = true;
}

XdpSocket::~XdpSocket() {
  prog_.reset();  // detached first: nothing is redirected to a closing socket
  queues_.clear();
}

void XdpSocket::bind_queue(unsigned qi, uint32_t ring_size) {
  auto owned = std::make_unique<Queue>();
  Queue& x = *owned;
  x.index = qi;
  const uint32_t rx_frames = ring_size;
  const uint32_t tx_frames = 2 * ring_size;
  x.area_len = static_cast<size_t>(rx_frames + tx_frames) * frame_;
  void* p = ::mmap(nullptr, x.area_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) throw_errno("AF_XDP on " + name_ + ": the UMEM of queue " + std::to_string(qi));
  x.area = static_cast<uint8_t*>(p);
  xsk_umem_config uc{};
  uc.fill_size = ring_size;
  uc.comp_size = ring_size;
  uc.frame_size = frame_;
  uc.frame_headroom = 0;
  xsk_socket_config sc{};
  sc.rx_size = ring_size;
  sc.tx_size = ring_size;
  sc.libxdp_flags = XSK_LIBXDP_FLAGS__INHIBIT_PROG_LOAD;  // the program is sriovd's own
  sc.xdp_flags = XDP_FLAGS_DRV_MODE;
  sc.bind_flags = XDP_USE_NEED_WAKEUP;  // neither COPY nor ZEROCOPY: the kernel takes zero-copy where it can
  // A socket of a process that just died (a crashed run) is released by
  // the kernel after its exit: its queue is busy for a moment.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (;;) {
    if (int err = xsk_umem__create(&x.umem, x.area, x.area_len, &x.fill, &x.comp, &uc); err != 0) {
      x.umem = nullptr;
      throw std::runtime_error("AF_XDP on " + name_ + ": registering the UMEM of queue " + std::to_string(qi) + ": " +
                               errno_text(err));
    }
    // Two sockets on the queue, sharing its UMEM, fill and completion
    // rings: one receives (and is waited on), one transmits (and is not).
    // Every transmitted frame's skb, freed, wakes the waiters of the socket
    // that sent it (sock_wfree): with nobody waiting on the sender, that is
    // nothing per frame.
    int err = xsk_socket__create(&x.xsk, name_.c_str(), qi, x.umem, &x.rx, nullptr, &sc);
    if (err == 0) {
      err = xsk_socket__create_shared(&x.xsk_tx, name_.c_str(), qi, x.umem, nullptr, &x.tx, &x.fill, &x.comp, &sc);
      if (err == 0) break;
      x.xsk_tx = nullptr;
      xsk_socket__delete(x.xsk);
    }
    x.xsk = nullptr;
    xsk_umem__delete(x.umem);
    x.umem = nullptr;
    if (err == -EBUSY && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    throw std::runtime_error("AF_XDP on " + name_ + ": binding a socket to queue " + std::to_string(qi) + ": " +
                             errno_text(err) + (err == -EBUSY ? " (another AF_XDP socket holds the queue)" : ""));
  }
  x.fd = xsk_socket__fd(x.xsk);
  x.tx_fd = xsk_socket__fd(x.xsk_tx);
  xdp_options opts{};
  socklen_t len = sizeof opts;
  if (::getsockopt(x.fd, SOL_XDP, XDP_OPTIONS, &opts, &len) == 0 && qi == 0)
    mode_ = (opts.flags & XDP_OPTIONS_ZEROCOPY) ? XdpMode::zero_copy : XdpMode::copy;
  // Copy mode transmits in sendto() itself, 32 frames a call by default;
  // kernels from 6.17 take a larger budget (up to the TX ring's size), so
  // one call sends a whole burst.
  if (mode_ == XdpMode::copy) {
    unsigned budget = ring_size;
    tx_budget_ =
        ::setsockopt(x.tx_fd, SOL_XDP, kXdpMaxTxSkbBudget, &budget, sizeof budget) == 0 ? budget : kCopyTxBatch;
  }
  // Every receive frame into the fill ring; the transmit frames free.
  x.to_fill.resize(rx_frames);
  for (uint32_t i = 0; i < rx_frames; ++i) x.to_fill[i] = static_cast<uint64_t>(i) * frame_;
  x.n_fill = rx_frames;
  x.tx_free.resize(tx_frames);
  for (uint32_t i = 0; i < tx_frames; ++i) x.tx_free[i] = static_cast<uint64_t>(rx_frames + i) * frame_;
  x.n_free = tx_frames;
  refill(x);
  x.set.reset(::epoll_create1(EPOLL_CLOEXEC));
  if (!x.set) throw_errno("AF_XDP on " + name_ + ": epoll set of queue " + std::to_string(qi));
  const uint32_t key = qi;
  if (bpf_map_update_elem(prog_->xsks_fd, &key, &x.fd, BPF_ANY) != 0)
    throw_errno("AF_XDP on " + name_ + ": entering the socket of queue " + std::to_string(qi) +
                " in the program's map");
  queues_.push_back(std::move(owned));
}

int XdpSocket::fd(unsigned q) const { return queues_.at(q)->set.get(); }
int XdpSocket::room_fd(unsigned q) const { return queues_.at(q)->tx_fd; }

uint64_t XdpSocket::received_on(unsigned q) const { return queues_.at(q)->received.load(std::memory_order_relaxed); }

// Hands the frames copied out back to the kernel: the rx entries released,
// their chunks into the fill ring (which has room for every receive frame).
void XdpSocket::refill(Queue& x) {
  if (x.unreleased) {
    xsk_ring_cons__release(&x.rx, x.unreleased);
    x.unreleased = 0;
  }
  if (x.n_fill == 0) return;
  uint32_t at = 0;
  const uint32_t got = xsk_ring_prod__reserve(&x.fill, x.n_fill, &at);
  for (uint32_t i = 0; i < got; ++i) *xsk_ring_prod__fill_addr(&x.fill, at + i) = x.to_fill[x.n_fill - got + i];
  xsk_ring_prod__submit(&x.fill, got);
  x.n_fill -= got;
  // Zero-copy drivers that sleep want to be told of new fill entries.
  if (got && xsk_ring_prod__needs_wakeup(&x.fill)) (void)::recvfrom(x.fd, nullptr, 0, MSG_DONTWAIT, nullptr, nullptr);
}

ssize_t XdpSocket::recv(unsigned q, uint8_t* buf, size_t size) {
  const unsigned n = active_.load(std::memory_order_relaxed);
  uint64_t& held = held_[q];
  for (unsigned k = q; k < queues_.size() && q < n; k += n) {
    Queue& x = *queues_[k];
    const uint64_t bit = 1ULL << k;
    if (!(held & bit)) {
      if (x.claimed.exchange(true, std::memory_order_acquire)) continue;  // its previous reader's pass is not over
      held |= bit;
    }
    uint32_t idx = 0;
    while (xsk_ring_cons__peek(&x.rx, 1, &idx) == 1) {
      const xdp_desc* d = xsk_ring_cons__rx_desc(&x.rx, idx);
      const uint64_t addr = d->addr;
      const uint32_t len = d->len;
      ++x.unreleased;
      x.to_fill[x.n_fill++] = addr & ~static_cast<uint64_t>(frame_ - 1);
      const bool fits = kDeviceHeader + len <= size && addr + len <= x.area_len;
      if (fits) {
        std::memset(buf, 0, kDeviceHeader);  // no checksum or GSO metadata through AF_XDP
        std::memcpy(buf + kDeviceHeader, x.area + addr, len);
      }
      if (x.n_fill >= kFillBatch) refill(x);
      if (!fits) continue;
      x.received.store(x.received.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      return static_cast<ssize_t>(kDeviceHeader + len);
    }
  }
  errno = EAGAIN;
  return -1;
}

void XdpSocket::rx_done(unsigned q) {
  uint64_t& held = held_[q];
  while (held) {
    const unsigned k = static_cast<unsigned>(__builtin_ctzll(held));
    held &= held - 1;
    Queue& x = *queues_[k];
    refill(x);
    x.claimed.store(false, std::memory_order_release);
  }
}

// Transmit frames the kernel is done with, back on the free stack.
void XdpSocket::reclaim(Queue& x) {
  uint32_t idx = 0;
  const uint32_t done = xsk_ring_cons__peek(&x.comp, static_cast<uint32_t>(x.tx_free.size()), &idx);
  for (uint32_t i = 0; i < done; ++i)
    x.tx_free[x.n_free++] = *xsk_ring_cons__comp_addr(&x.comp, idx + i) & ~static_cast<uint64_t>(frame_ - 1);
  if (done) xsk_ring_cons__release(&x.comp, done);
}

void XdpSocket::kick(Queue& x) {
  // A zero-copy driver sends by itself and only needs a wakeup when it
  // sleeps (need_wakeup).
  if (mode_ == XdpMode::zero_copy) {
    if (xsk_ring_prod__needs_wakeup(&x.tx)) (void)::sendto(x.tx_fd, nullptr, 0, MSG_DONTWAIT, nullptr, 0);
    return;
  }
  // Copy mode sends in this call, at most tx_budget_ frames each time
  // (EAGAIN: more left, or the completion ring full): again until the ring
  // is empty or the kernel takes no more.
  for (int round = 0; round < 64; ++round) {
    const uint32_t before = std::atomic_ref<uint32_t>(*x.tx.consumer).load(std::memory_order_acquire);
    if (before == x.tx.cached_prod) return;  // all taken
    if (::sendto(x.tx_fd, nullptr, 0, MSG_DONTWAIT, nullptr, 0) >= 0) continue;
    if (errno != EAGAIN && errno != EBUSY) {
      if (errno != ENOBUFS && errno != ENETDOWN)
        spdlog::debug("af_xdp {} queue {}: sendto: {}", name_, x.index, std::strerror(errno));
      return;
    }
    reclaim(x);
    if (std::atomic_ref<uint32_t>(*x.tx.consumer).load(std::memory_order_acquire) == before) return;  // no progress
  }
}

void XdpSocket::flush(unsigned q) {
  Queue& x = *queues_[q];
  if (x.tx_pending) {
    xsk_ring_prod__submit(&x.tx, x.tx_pending);
    x.tx_pending = 0;
    kick(x);
  }
  reclaim(x);
}

// One frame: the guest's chain (device header first) gathered into a free
// chunk, header and frame together, a checksum the driver left to the
// device completed there; then a TX entry for the frame after the header.
ssize_t XdpSocket::send(unsigned q, const iovec* iov, int count) {
  Queue& x = *queues_[q];
  if (x.n_free == 0) {
    reclaim(x);
    if (x.n_free == 0) {
      flush(q);
      if (x.n_free == 0) {
        errno = EAGAIN;
        return -1;
      }
    }
  }
  // Off the stack now: a flush below pushes completed chunks onto it.
  const uint64_t chunk = x.tx_free[--x.n_free];
  auto refuse = [&](int err) {
    x.tx_free[x.n_free++] = chunk;
    errno = err;
    return -1;
  };
  uint8_t* out = x.area + chunk;
  size_t at = 0;
  for (int i = 0; i < count; ++i) {
    // Larger than a frame: GSO, which this port does not offer.
    if (iov[i].iov_len > frame_ - at) return refuse(EMSGSIZE);
    std::memcpy(out + at, iov[i].iov_base, iov[i].iov_len);
    at += iov[i].iov_len;
  }
  if (at < kDeviceHeader + 14) return refuse(EINVAL);
  if (out[1] != virtio::kGsoNone) return refuse(EMSGSIZE);
  if ((out[0] & virtio::kHdrNeedsCsum) && !virtio::complete_checksum(out, at)) return refuse(EINVAL);
  uint32_t idx = 0;
  if (xsk_ring_prod__reserve(&x.tx, 1, &idx) != 1) {
    flush(q);
    if (xsk_ring_prod__reserve(&x.tx, 1, &idx) != 1) return refuse(EAGAIN);
  }
  xdp_desc* d = xsk_ring_prod__tx_desc(&x.tx, idx);
  d->addr = chunk + kDeviceHeader;
  d->len = static_cast<uint32_t>(at - kDeviceHeader);
  d->options = 0;
  ++x.tx_pending;
  return static_cast<ssize_t>(at - kDeviceHeader);
}

void XdpSocket::set_active_queues(unsigned n) {
  if (n == 0 || n > pairs_)
    throw std::invalid_argument("AF_XDP port " + name_ + ": " + std::to_string(n) + " active queues of " +
                                std::to_string(pairs_));
  active_.store(n, std::memory_order_relaxed);
  resteer();
}

// Socket k's receive side into the set of queue k % n (control plane; an
// epoll_ctl per socket that moves).
void XdpSocket::resteer() {
  std::lock_guard lock(steer_mutex_);
  const unsigned n = active_.load();
  for (auto& owned : queues_) {
    Queue& x = *owned;
    const int want = static_cast<int>(x.index % n);
    if (x.in_set == want) continue;
    if (x.in_set >= 0)
      (void)::epoll_ctl(queues_[static_cast<size_t>(x.in_set)]->set.get(), EPOLL_CTL_DEL, x.fd, nullptr);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u32 = x.index;
    if (::epoll_ctl(queues_[static_cast<size_t>(want)]->set.get(), EPOLL_CTL_ADD, x.fd, &ev) != 0) {
      x.in_set = -1;
      throw_errno("AF_XDP port " + name_ + ": steering queue " + std::to_string(x.index));
    }
    x.in_set = want;
  }
}

bool XdpSocket::link_up() const { return netdev_running(control_.get(), name_); }

std::vector<std::string> XdpSocket::remove_left_over(const std::string& instance,
                                                     const std::vector<std::string>& keep) {
  std::vector<std::string> removed;
  struct if_nameindex* all = ::if_nameindex();
  if (!all) throw_errno("listing netdevs");
  for (struct if_nameindex* i = all; i->if_index != 0; ++i) {
    const std::string name = i->if_name;
    if (std::find(keep.begin(), keep.end(), name) != keep.end()) continue;
    const Attached a = attached_to(i->if_index);
    if (a.id == 0 || !a.ours || instance_of(a.owner) != instance) continue;
    if (detach(i->if_index, a.fd.get())) removed.push_back(name + " (" + a.owner + ")");
  }
  ::if_freenameindex(all);
  return removed;
}

}  // namespace sriovd::ports
