#include "sriovd/virtio/net.hpp"

#include <linux/if_tun.h>
#include <sys/epoll.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <utility>
#include <stdexcept>

#include "sriovd/util/error.hpp"
#include "sriovd/util/eventfd.hpp"
#include "sriovd/virtio/offload.hpp"

namespace sriovd::virtio {

namespace {

constexpr size_t kHeader = sizeof(NetHeader);
constexpr size_t kMaxPacket =
    65536 + 64 + kHeader;            // a GSO packet (64 KB of IP, Ethernet and VLAN headers) and its header
constexpr unsigned kMaxChains = 64;  // buffers one received packet may take
constexpr unsigned kSegsPerChain = 8;
constexpr unsigned kTxSegs = 64;

enum : uint64_t { kEvTxKick = 1, kEvRxKick = 2, kEvPort = 3, kEvStop = 4, kEvCtrlKick = 5, kEvRoom = 6, kEvPoke = 7 };

// Control queue classes and commands (§5.1.6.5).
constexpr uint8_t kCtrlRx = 0, kCtrlRxPromisc = 0, kCtrlRxAllmulti = 1;
constexpr uint8_t kCtrlMac = 1, kCtrlMacTableSet = 0, kCtrlMacAddrSet = 1;
constexpr uint8_t kCtrlMq = 4, kCtrlMqPairsSet = 0;
constexpr uint8_t kCtrlAnnounce = 3, kCtrlAnnounceAck = 0;
constexpr uint16_t kStatusLinkUp = 1, kStatusAnnounce = 2;
constexpr uint8_t kCtrlOk = 0, kCtrlErr = 1;
constexpr size_t kCtrlMaxCommand = 4096;

uint64_t mac_bits(const uint8_t* m) {
  uint64_t v = 0;
  std::memcpy(&v, m, 6);
  return v;
}

}  // namespace

void RxFilter::reset(uint64_t device_mac) {
  promisc = true;
  allmulti = true;
  mac = device_mac;
  unicast_count = 0;
  multicast_count = 0;
  unicast_overflow = false;
  multicast_overflow = false;
}

bool RxFilter::accepts(const uint8_t* dest) const {
  if (promisc.load(std::memory_order_relaxed)) return true;
  const uint64_t d = mac_bits(dest);
  if (dest[0] & 1U) {  // multicast or broadcast
    if (d == 0xffffffffffffULL || allmulti.load(std::memory_order_relaxed) ||
        multicast_overflow.load(std::memory_order_relaxed))
      return true;
    const uint32_t n = multicast_count.load(std::memory_order_acquire);
    for (uint32_t i = 0; i < n; ++i)
      if (multicast[i].load(std::memory_order_relaxed) == d) return true;
    return false;
  }
  if (d == mac.load(std::memory_order_relaxed) || unicast_overflow.load(std::memory_order_relaxed)) return true;
  const uint32_t n = unicast_count.load(std::memory_order_acquire);
  for (uint32_t i = 0; i < n; ++i)
    if (unicast[i].load(std::memory_order_relaxed) == d) return true;
  return false;
}

// A packet taken from the port that found no guest buffers yet. It
// belongs to the pair, not to a worker: a restart of the workers (memory
// or IOTLB changes) must not drop it.
struct NetDevice::RxHold {
  std::vector<uint8_t> bounce = std::vector<uint8_t>(kMaxPacket);
  uint8_t* data = nullptr;  // the packet being delivered: in bounce, or a segment in piece
  size_t pending = 0;       // its bytes; 0: none
  // A GSO packet the driver cannot take, cut into segments one at a time.
  TcpSegmenter cutter;
  std::vector<uint8_t> piece = std::vector<uint8_t>(kMaxPacket);
};

// Chains (packets, commands) one pass over a queue takes before the worker
// looks at its events again.
constexpr unsigned kPassBudget = 256;

struct NetDevice::Worker : QueueDevice::Worker {
  UniqueFd epoll;
  int port_fd = -1;
  int room_fd = -1;           // the port's fd for room after a full transmit: port_fd, or its own
  bool room_watched = false;  // room_fd (its own) in the epoll set
  bool port_armed = true;     // watching the port for received packets
  bool tx_blocked = false;    // the port had no room: watching it for room
  // Queues whose last pass ran out of budget: served again after the next
  // look at the stop event, without waiting for a kick.
  bool tx_more = false, rx_more = false, ctrl_more = false;
  uint64_t faults_seen = 0;       // peer_mapping_faults() when last looked at
  RxHold* rx = nullptr;           // the pair's received packet waiting for buffers (outlives the worker)
  const DirtyLog* log = nullptr;  // guest memory's dirty log when the worker started (migration), or none
  // Preallocated: nothing on the data path allocates.
  std::array<Chain, kMaxChains> chains{};
  std::array<uint32_t, kMaxChains> written{};  // deliver_rx: bytes into each chain
  std::array<Segment, kMaxChains * kSegsPerChain> segs{};
  std::array<Segment, kTxSegs> tx_segs{};
  std::array<Segment, 16> ctrl_segs{};
  std::array<uint8_t, kCtrlMaxCommand> ctrl_buf{};
  std::array<iovec, kTxSegs> tx_iov{};
};

NetDevice::NetDevice(NetConfig config, irq::Engine& engine, std::unique_ptr<PacketPort> port)
    : QueueDevice(config.name, 2U * config.queue_pairs + (config.control_queue ? 1U : 0U), config.max_queue_size,
                  engine),
      config_(std::move(config)),
      port_(std::move(port)) {
  if (config_.mac) filter_.mac.store(mac_bits(config_.mac->octets));
  if (port_->queues() < config_.queue_pairs)
    throw std::invalid_argument(config_.name + ": " + port_->name() + " has " + std::to_string(port_->queues()) +
                                " queue(s) for " + std::to_string(config_.queue_pairs) + " queue pairs");
  for (unsigned p = 0; p < config_.queue_pairs; ++p) rx_hold_.push_back(std::make_unique<RxHold>());
  // A multi-queue port starts with every queue attached; the driver has
  // none yet but the first pair.
  if (!steer_port()) throw std::runtime_error(config_.name + ": " + port_->name() + " cannot steer to one queue");
}

bool NetDevice::steer_port() {
  std::lock_guard lock(steer_mutex_);
  unsigned n = 1;
  if (config_.control_queue) {
    n = active_pairs_.load();
  } else {
    n = 0;
    while (n < config_.queue_pairs && queues_[2 * n].enabled) ++n;
    n = std::max(n, 1U);
  }
  if (n == steered_pairs_) return true;
  try {
    port_->set_active_queues(n);
  } catch (const std::exception&) {
    return false;
  }
  steered_pairs_ = n;
  return true;
}

NetDevice::~NetDevice() {
  stop();
  wait_for_workers();  // everything a stuck worker uses is this object's
}

void NetDevice::queue_enabled_changed(unsigned q) {
  if (q % 2 == 0 && q < 2U * config_.queue_pairs) (void)steer_port();  // an RX vring: the pairs in use change
}

std::unique_ptr<PacketPort> NetDevice::release_port() {
  stop();
  if (wedged_) return nullptr;
  return std::move(port_);
}

uint64_t NetDevice::offered_features() const {
  // IN_ORDER: every queue hands buffers back in the order it took them
  // (TX and the control queue push as they pop; RX pushes a packet's
  // buffers in order and only ever undoes its latest pops).
  uint64_t f = kVersion1 | kNetMrgRxbuf | kNetStatus | kNetMtu | kRingEventIdx | kRingIndirectDesc | kInOrder;
  if (config_.mac) f |= kNetMac;
  if (config_.access_platform) f |= kAccessPlatform;
  if (config_.packed) f |= kRingPacked;
  if (config_.control_queue) {
    // GUEST_ANNOUNCE: the device's own control queue takes the driver's ack.
    f |= kNetCtrlVq | kNetCtrlRx | kNetCtrlMacAddr | kNetGuestAnnounce;
    if (config_.queue_pairs > 1) f |= kNetMq;  // MQ needs the control queue (§5.1.3.1)
  } else if (config_.front_end_control) {
    // vhost-user: the VMM's control queue, SET_VRING_ENABLE per pair, and
    // the VMM's guest announcement after a migration (offered, QEMU lets
    // the guest announce itself instead of asking for SEND_RARP).
    f |= kNetGuestAnnounce;
    if (config_.queue_pairs > 1) f |= kNetMq;
  }
  if (config_.offloads) f |= kNetCsum | kNetGuestCsum | kNetHostTso4 | kNetHostTso6 | kNetGuestTso4 | kNetGuestTso6;
  return f;
}

bool NetDevice::poll_link() {
  const bool up = port_->link_up();
  if (up == link_up_) return false;
  link_up_ = up;
  return true;
}

void NetDevice::read_config(uint32_t offset, uint8_t* out, size_t size) const {
  std::array<uint8_t, kConfigBytes> c{};
  const MacAddress m = mac();
  std::memcpy(c.data(), m.octets, 6);
  const uint16_t status = static_cast<uint16_t>(
      (link_up_ ? kStatusLinkUp : 0) | (announce_status_.load(std::memory_order_relaxed) ? kStatusAnnounce : 0));
  std::memcpy(c.data() + 6, &status, 2);
  std::memcpy(c.data() + 8, &config_.queue_pairs, 2);
  std::memcpy(c.data() + 10, &config_.mtu, 2);
  for (size_t i = 0; i < size; ++i) out[i] = offset + i < c.size() ? c[offset + i] : 0;
}

MacAddress NetDevice::mac() const {
  MacAddress m;
  const uint64_t v = filter_.mac.load();
  std::memcpy(m.octets, &v, 6);
  return m;
}

void NetDevice::set_features(uint64_t features) {
  features_ = features & offered_features();
  // What the port may hand us is what the guest said it can take.
  unsigned tun = 0;
  if (features_ & kNetGuestCsum) tun |= TUN_F_CSUM;
  if ((features_ & kNetGuestTso4) && (tun & TUN_F_CSUM)) tun |= TUN_F_TSO4;
  if ((features_ & kNetGuestTso6) && (tun & TUN_F_CSUM)) tun |= TUN_F_TSO6;
  port_->set_offloads(tun & config_.tap_offloads);
}

void NetDevice::start() {
  if (running() || broken_ || wedged_) return;
  waiting_rings_ = false;
  for (unsigned p = 0; p < config_.queue_pairs; ++p) {
    Queue& rx = queues_[2 * p];
    Queue& tx = queues_[2 * p + 1];
    if (!queue_ready(rx) || !queue_ready(tx)) continue;
    // With an IOTLB the pair starts when both rings are translated.
    if (memory_->has_iotlb() && (!rings_translated(rx) || !rings_translated(tx))) {
      waiting_rings_ = true;
      continue;
    }
    rx.ring = make_ring(2 * p);
    tx.ring = make_ring(2 * p + 1);
    auto w = std::make_unique<Worker>();
    w->group = p;
    w->rx = rx_hold_[p].get();
    w->log = memory_->dirty_log();
    w->port_fd = port_->fd(p);
    w->room_fd = port_->room_fd(p);
    prepare_worker(*w);
    w->epoll.reset(::epoll_create1(EPOLL_CLOEXEC));
    if (!w->epoll) throw_errno(config_.name + ": worker setup");
    auto watch = [&](int fd, uint64_t tag) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = tag;
      if (::epoll_ctl(w->epoll.get(), EPOLL_CTL_ADD, fd, &ev) != 0) throw_errno(config_.name + ": epoll_ctl");
    };
    watch(tx.kick.get(), kEvTxKick);
    watch(rx.kick.get(), kEvRxKick);
    watch(w->port_fd, kEvPort);
    watch(w->stop.get(), kEvStop);
    watch(w->poke.get(), kEvPoke);
    if (p == 0 && (features_ & kNetCtrlVq)) {
      Queue& ctrl = queues_[control_queue_index()];
      if (queue_ready(ctrl)) {
        ctrl.ring = make_ring(control_queue_index());
        watch(ctrl.kick.get(), kEvCtrlKick);
      }
    }
    Worker* raw = w.get();
    const int cpu = config_.cpus.empty() ? -1 : config_.cpus[p % config_.cpus.size()];
    launch(
        std::move(w), [this, raw] { run_pair(*raw); }, "sriovd-q" + std::to_string(p), cpu);
  }
}

void NetDevice::reset_device() {
  for (auto& hold : rx_hold_) {  // a reset device has no packet in hand
    hold->pending = 0;
    hold->cutter.stop();
  }
  filter_.reset(config_.mac ? mac_bits(config_.mac->octets) : 0);
  {
    std::lock_guard lock(announce_mutex_);
    announced_mac_ = 0;
  }
  active_pairs_.store(1);
  announce_status_.store(false);
  (void)steer_port();  // a reset device uses its first pair (vhost-user: none enabled yet)
}

std::vector<uint8_t> NetDevice::save_device() const {
  StateWriter w;
  w.u64(filter_.mac.load());
  w.u8(filter_.promisc.load() ? 1 : 0);
  w.u8(filter_.allmulti.load() ? 1 : 0);
  w.u16(static_cast<uint16_t>(active_pairs_.load()));
  for (const auto* table : {&filter_.unicast, &filter_.multicast}) {
    const bool uni = table == &filter_.unicast;
    const uint32_t n = (uni ? filter_.unicast_count : filter_.multicast_count).load();
    w.u8((uni ? filter_.unicast_overflow : filter_.multicast_overflow).load() ? 1 : 0);
    w.u32(n);
    for (uint32_t i = 0; i < n; ++i) w.u64((*table)[i].load());
  }
  // A packet taken from the port that found no buffers yet goes with the
  // device (a GSO packet being cut in software: the segment in hand; the
  // rest was counted as dropped).
  w.u16(static_cast<uint16_t>(rx_hold_.size()));
  for (const auto& hold : rx_hold_) w.blob({hold->data, hold->pending});
  return w.take();
}

void NetDevice::restore_device(std::span<const uint8_t> bytes) {
  StateReader r(bytes, config_.name + ": virtio-net state");
  const uint64_t mac = r.u64();
  const bool promisc = r.u8() != 0, allmulti = r.u8() != 0;
  const uint16_t pairs = r.u16();
  if (pairs == 0 || pairs > config_.queue_pairs)
    r.fail(std::to_string(pairs) + " queue pairs in use, the device has " + std::to_string(config_.queue_pairs));
  struct Table {
    bool overflow = false;
    std::vector<uint64_t> macs;
  } tables[2];
  for (Table& t : tables) {
    t.overflow = r.u8() != 0;
    const uint32_t n = r.u32();
    if (n > RxFilter::kMaxMacs) r.fail(std::to_string(n) + " filter addresses (at most 32)");
    for (uint32_t i = 0; i < n; ++i) t.macs.push_back(r.u64());
  }
  if (const uint16_t holds = r.u16(); holds != rx_hold_.size())
    r.fail(std::to_string(holds) + " queue pairs' received packets, the device has " + std::to_string(rx_hold_.size()));
  std::vector<std::vector<uint8_t>> held;
  for (size_t p = 0; p < rx_hold_.size(); ++p) {
    held.push_back(r.blob(kMaxPacket));
    if (!held.back().empty() && held.back().size() < kHeader) r.fail("a held packet shorter than its header");
  }
  r.end();
  // All read and checked: now the device changes.
  filter_.mac.store(mac);
  filter_.promisc.store(promisc);
  filter_.allmulti.store(allmulti);
  for (int t = 0; t < 2; ++t) {
    auto& count = t == 0 ? filter_.unicast_count : filter_.multicast_count;
    auto& slots = t == 0 ? filter_.unicast : filter_.multicast;
    (t == 0 ? filter_.unicast_overflow : filter_.multicast_overflow).store(tables[t].overflow);
    for (size_t i = 0; i < tables[t].macs.size(); ++i) slots[i].store(tables[t].macs[i]);
    count.store(static_cast<uint32_t>(tables[t].macs.size()));
  }
  active_pairs_.store(pairs);
  for (size_t p = 0; p < rx_hold_.size(); ++p) {
    RxHold& hold = *rx_hold_[p];
    hold.cutter.stop();
    if (!held[p].empty()) std::memcpy(hold.bounce.data(), held[p].data(), held[p].size());
    hold.data = hold.bounce.data();
    hold.pending = held[p].size();
  }
  (void)steer_port();
}

void NetDevice::kick(unsigned q) { poke(q == control_queue_index() ? 0 : q / 2); }

void NetDevice::run_pair(Worker& w) {
  enroll_peer_io_thread();
  // Buffers may have been posted before the kick fds were watched.
  do_tx(w);
  do_rx(w);
  if (w.group == 0) do_ctrl(w);
  if (w.group == 0) send_announcement(w);
  epoll_event events[8];
  for (;;) {
    // Work left over from a pass that hit its budget: look for events (the
    // stop event among them) without sleeping, then go on with it.
    const bool more = w.tx_more || w.rx_more || w.ctrl_more;
    const int n = ::epoll_wait(w.epoll.get(), events, 8, more ? 0 : -1);
    for (int i = 0; i < n; ++i) {
      switch (events[i].data.u64) {
        case kEvStop: return;
        case kEvPoke:
          own_eventfd_drain(w.poke.get());
          do_tx(w);
          do_rx(w);
          if (w.group == 0) do_ctrl(w);
          if (w.group == 0) send_announcement(w);
          break;
        case kEvTxKick:
          if (!take_kick(2 * w.group + 1)) return;
          do_tx(w);
          break;
        case kEvRxKick:
          if (!take_kick(2 * w.group)) return;
          do_rx(w);
          break;
        case kEvRoom:
        case kEvPort:
          // A socket's pending error (AF_PACKET: ENETDOWN when its netdev
          // goes down) is reported level-triggered until it is taken: left
          // there, it would wake this worker without end.
          if (events[i].events & EPOLLERR) (void)port_->take_error(w.group);
          if ((events[i].events & EPOLLOUT) && w.tx_blocked) {
            w.tx_blocked = false;
            watch_port(w);
            do_tx(w);
          }
          if (events[i].events & EPOLLIN) do_rx(w);
          break;
        case kEvCtrlKick:
          if (!take_kick(control_queue_index())) return;
          do_ctrl(w);
          break;
      }
    }
    // A peer that shrank its memory under a mapping: the pages read as
    // zeros now (util/peer_mapping.hpp), and this device stops for good
    // (NEEDS_RESET). One load per wakeup finds out whether any fault
    // happened at all.
    if (const uint64_t faults = peer_mapping_faults(); faults != w.faults_seen) {
      w.faults_seen = faults;
      if (memory_->faulted()) fail_device("guest memory shrank under its mapping (a fault)");
    }
    if (broken_.load(std::memory_order_relaxed)) return;
    if (std::exchange(w.tx_more, false)) do_tx(w);
    if (std::exchange(w.rx_more, false)) do_rx(w);
    if (std::exchange(w.ctrl_more, false)) do_ctrl(w);
  }
}

bool NetDevice::do_tx(Worker& w) {
  const unsigned pair = w.group;
  Queue& q = queues_[2 * pair + 1];
  auto& segs = w.tx_segs;
  auto& iov = w.tx_iov;
  Chain c;
  bool any = false;
  for (unsigned budget = kPassBudget;; --budget) {
    // A guest that keeps its ring full must not keep the worker from its
    // stop event: the rest is served on the next pass.
    if (budget == 0) {
      w.tx_more = true;
      break;
    }
    if (!q.ring->pop(c, segs)) {
      // Ask for a kick before sleeping; buffers that slipped in meanwhile
      // are taken now. A stalled ring waits for its IOTLB answer instead.
      if (q.ring->broken() || q.ring->stalled() || !q.ring->enable_kicks()) break;
      continue;
    }
    any = true;
    if (c.readable == 0 || c.readable_bytes < kHeader) {
      q.stats->dropped.fetch_add(1, std::memory_order_relaxed);
    } else {
      for (unsigned i = 0; i < c.readable; ++i) iov[i] = {segs[i].data, segs[i].len};
      // The virtio-net header goes to the port as it is (a tap: IFF_VNET_HDR, 12 bytes).
      if (port_->send(pair, iov.data(), c.readable) < 0) {
        if (errno == EAGAIN) {
          // The port is full: the buffer stays with us until it has room.
          q.ring->rewind(c);
          w.tx_blocked = true;
          watch_port(w);
          break;
        }
        q.stats->dropped.fetch_add(1, std::memory_order_relaxed);
      } else {
        q.stats->packets.fetch_add(1, std::memory_order_relaxed);
        q.stats->bytes.fetch_add(c.readable_bytes - kHeader, std::memory_order_relaxed);
      }
    }
    q.ring->add_used(c, 0);
  }
  port_->flush(pair);
  if (q.ring->broken()) fail_queue(2 * pair + 1, q);
  if (any) notify(q);
  return any;
}

// What the worker waits for on the port: received packets unless the
// guest has no buffers for them, room when a transmit found none.
void NetDevice::watch_port(Worker& w) {
  epoll_event ev{};
  const bool own_room = w.room_fd != w.port_fd;
  ev.events = (w.port_armed ? EPOLLIN : 0U) | (w.tx_blocked && !own_room ? EPOLLOUT : 0U);
  ev.data.u64 = kEvPort;
  ::epoll_ctl(w.epoll.get(), EPOLL_CTL_MOD, w.port_fd, &ev);
  if (own_room && w.tx_blocked != w.room_watched) {
    // Watched only while a transmit waits: a socket waited on is woken
    // for every frame it sends.
    ev.events = EPOLLOUT;
    ev.data.u64 = kEvRoom;
    ::epoll_ctl(w.epoll.get(), w.tx_blocked ? EPOLL_CTL_ADD : EPOLL_CTL_DEL, w.room_fd, &ev);
    w.room_watched = w.tx_blocked;
  }
}

// The next packet for the driver into w.rx: the next segment of a GSO
// packet being cut, or one from the port, filtered by the driver's
// addresses (§5.1.6.5.1) and with the offloads it did not negotiate done
// here (a tap never needs it: TUNSETOFFLOAD follows the features).
NetDevice::RxTake NetDevice::take_rx_packet(Worker& w, Queue& q) {
  RxHold& rx = *w.rx;
  const bool guest_csum = features_ & kNetGuestCsum;
  if (rx.cutter.active()) {
    rx.pending = rx.cutter.next(rx.piece.data(), rx.piece.size(), guest_csum ? kHdrDataValid : 0);
    rx.data = rx.piece.data();
    if (rx.pending) return RxTake::packet;
  }
  const ssize_t n = port_->recv(w.group, rx.bounce.data(), rx.bounce.size());
  if (n <= static_cast<ssize_t>(kHeader)) return RxTake::none;  // EAGAIN, or nothing usable
  if ((features_ & kNetCtrlRx) && static_cast<size_t>(n) >= kHeader + 6 &&
      !filter_.accepts(rx.bounce.data() + kHeader)) {
    filtered_.fetch_add(1, std::memory_order_relaxed);
    return RxTake::skipped;
  }
  rx.data = rx.bounce.data();
  rx.pending = static_cast<size_t>(n);
  const uint8_t gso = rx.data[1] & static_cast<uint8_t>(~kGsoEcn);
  const bool ecn_ok = !(rx.data[1] & kGsoEcn) || (features_ & kNetGuestEcn);
  if (gso != kGsoNone && !(ecn_ok && ((gso == kGsoTcpV4 && (features_ & kNetGuestTso4)) ||
                                      (gso == kGsoTcpV6 && (features_ & kNetGuestTso6))))) {
    rx.pending = 0;
    q.stats->sw_offload.fetch_add(1, std::memory_order_relaxed);
    if ((gso != kGsoTcpV4 && gso != kGsoTcpV6) || !rx.cutter.start(rx.data, static_cast<size_t>(n)))
      q.stats->dropped.fetch_add(1, std::memory_order_relaxed);  // UDP GSO, or not a TCP packet after all
    return RxTake::skipped;
  }
  if ((rx.data[0] & kHdrNeedsCsum) && !guest_csum) {
    q.stats->sw_offload.fetch_add(1, std::memory_order_relaxed);
    if (!complete_checksum(rx.data, rx.pending)) {
      q.stats->dropped.fetch_add(1, std::memory_order_relaxed);
      rx.pending = 0;
      return RxTake::skipped;
    }
  }
  return RxTake::packet;
}

// Copies the packet in hand into the `used` chains taken for it, with
// num_buffers set before any is published, and hands them back.
void NetDevice::deliver_rx(Worker& w, Queue& q, unsigned used) {
  const uint16_t num_buffers = static_cast<uint16_t>(used);
  std::memcpy(w.rx->data + offsetof(NetHeader, num_buffers), &num_buffers, sizeof num_buffers);
  size_t off = 0;
  // Logging (a migration): segments that follow each other in memory are
  // marked as one run, all before the first add_used hands a buffer over.
  const uint8_t* run = nullptr;
  size_t run_len = 0;
  auto& written = w.written;
  for (unsigned c = 0; c < used; ++c) {
    const Chain& chain = w.chains[c];
    written[c] = 0;
    for (unsigned s = chain.readable; s < chain.count && off < w.rx->pending; ++s) {
      Segment& seg = w.segs[c * kSegsPerChain + s];
      const size_t n = std::min<size_t>(seg.len, w.rx->pending - off);
      std::memcpy(seg.data, w.rx->data + off, n);
      if (w.log) {
        if (run && seg.data == run + run_len) {
          run_len += n;
        } else {
          if (run) w.log->mark_host(run, run_len);
          run = seg.data;
          run_len = n;
        }
      }
      off += n;
      written[c] += static_cast<uint32_t>(n);
    }
  }
  if (run) w.log->mark_host(run, run_len);
  for (unsigned c = 0; c < used; ++c) q.ring->add_used(w.chains[c], written[c]);
  q.stats->packets.fetch_add(1, std::memory_order_relaxed);
  q.stats->bytes.fetch_add(w.rx->pending - kHeader, std::memory_order_relaxed);
  w.rx->pending = 0;
}

bool NetDevice::do_rx(Worker& w) {
  Queue& q = queues_[2 * w.group];
  const bool mergeable = features_ & kNetMrgRxbuf;
  // A pair the driver did not activate (MQ) takes nothing.
  if ((features_ & kNetCtrlVq) && w.group >= active_pairs_.load(std::memory_order_relaxed)) return false;
  bool delivered = false;
  for (unsigned budget = kPassBudget;; --budget) {
    if (budget == 0) {
      w.rx_more = true;
      break;
    }
    if (w.rx->pending == 0) {
      const RxTake t = take_rx_packet(w, q);
      if (t == RxTake::none) break;
      if (t == RxTake::skipped) continue;
    }
    // Take as many buffers as the packet needs before publishing any, so
    // num_buffers is right when the driver looks.
    unsigned used = 0;
    size_t room = 0;
    while (room < w.rx->pending && used < kMaxChains) {
      std::span<Segment> segs(&w.segs[used * kSegsPerChain], kSegsPerChain);
      if (!q.ring->pop(w.chains[used], segs)) break;
      room += w.chains[used].writable_bytes;
      ++used;
      if (!mergeable) break;
    }
    if (q.ring->broken()) {
      port_->rx_done(w.group);
      q.ring->publish_used();  // what was delivered before
      fail_queue(2 * w.group, q);
      return delivered;
    }
    if (room < w.rx->pending) {
      if (!mergeable && used == 1) {
        // The guest's buffer cannot hold this packet: it is dropped.
        q.ring->add_used(w.chains[0], 0);
        q.stats->dropped.fetch_add(1, std::memory_order_relaxed);
        w.rx->pending = 0;
        delivered = true;
        continue;
      }
      const bool stalled = q.ring->stalled();
      while (used > 0) q.ring->rewind(w.chains[--used]);
      // Buffers that arrived meanwhile: try again before giving up (not
      // when waiting for an IOTLB answer: kick_all() brings us back).
      if (!stalled && q.ring->enable_kicks()) continue;
      // Out of buffers: stop watching the port until the guest kicks.
      if (w.port_armed) {
        w.port_armed = false;
        watch_port(w);
      }
      break;
    }
    deliver_rx(w, q, used);
    delivered = true;
  }
  port_->rx_done(w.group);
  if (delivered) notify(q);
  if (!w.port_armed && w.rx->pending == 0) {
    w.port_armed = true;
    watch_port(w);
  }
  return delivered;
}

Announcement NetDevice::announce(const std::array<uint8_t, 6>& mac) {
  const uint64_t bits = mac_bits(mac.data());
  if (bits == 0 || (mac[0] & 1U)) return Announcement::not_its_mac;  // none, or a group address
  {
    std::lock_guard lock(announce_mutex_);
    const uint64_t own = filter_.mac.load();
    if (own != 0 ? bits != own : (announced_mac_ != 0 && bits != announced_mac_)) return Announcement::not_its_mac;
    if (own == 0) announced_mac_ = bits;
    uint8_t* f = announcement_.data() + kHeader;  // the virtio-net header: zeros, no offload
    std::memset(f, 0xff, 6);                      // broadcast
    std::memcpy(f + 6, mac.data(), 6);
    const uint8_t rarp[] = {0x80, 0x35,   // ethertype RARP
                            0x00, 0x01,   // hardware: Ethernet
                            0x08, 0x00,   // protocol: IPv4
                            6,    4,      // address lengths
                            0x00, 0x03};  // request reverse
    std::memcpy(f + 12, rarp, sizeof rarp);
    std::memcpy(f + 22, mac.data(), 6);  // sender: the guest, no IP
    std::memset(f + 28, 0, 4);
    std::memcpy(f + 32, mac.data(), 6);  // target: the guest, no IP
    std::memset(f + 38, 0, 22);          // to the 60-byte minimum
  }
  announce_pending_.store(true, std::memory_order_release);
  poke(0);  // no worker yet: the first pair's sends it when it starts
  return Announcement::sent;
}

bool NetDevice::announce_restored() {
  if ((features_ & kNetGuestAnnounce) && config_.control_queue) {
    announce_status_.store(true, std::memory_order_relaxed);
    return true;
  }
  const MacAddress m = mac();
  std::array<uint8_t, 6> octets{};
  std::memcpy(octets.data(), m.octets, 6);
  (void)announce(octets);
  return false;
}

void NetDevice::send_announcement(Worker& w) {
  if (!announce_pending_.exchange(false, std::memory_order_acquire)) return;
  std::array<uint8_t, 12 + 60> frame;
  {
    std::lock_guard lock(announce_mutex_);
    frame = announcement_;
  }
  const iovec iov{frame.data(), frame.size()};
  Queue& tx = queues_[2 * w.group + 1];
  if (port_->send(w.group, &iov, 1) < 0) {
    tx.stats->dropped.fetch_add(1, std::memory_order_relaxed);
  } else {
    tx.stats->packets.fetch_add(1, std::memory_order_relaxed);
    tx.stats->bytes.fetch_add(frame.size() - kHeader, std::memory_order_relaxed);
  }
  port_->flush(w.group);
}

// The control queue (§5.1.6.5): class, command, data in device-readable
// buffers; one ack byte in the first device-writable one.
void NetDevice::do_ctrl(Worker& w) {
  if (!(features_ & kNetCtrlVq)) return;
  Queue& q = queues_[control_queue_index()];
  if (!q.ring) return;
  Chain c;
  bool any = false;
  for (unsigned budget = kPassBudget;; --budget) {
    if (budget == 0) {
      w.ctrl_more = true;
      break;
    }
    if (!q.ring->pop(c, w.ctrl_segs)) {
      if (q.ring->broken() || q.ring->stalled() || !q.ring->enable_kicks()) break;
      continue;
    }
    any = true;
    size_t len = 0;
    for (unsigned i = 0; i < c.readable && len < w.ctrl_buf.size(); ++i) {
      const size_t n = std::min<size_t>(w.ctrl_segs[i].len, w.ctrl_buf.size() - len);
      std::memcpy(w.ctrl_buf.data() + len, w.ctrl_segs[i].data, n);
      len += n;
    }
    uint32_t written = 0;
    if (c.count > c.readable && w.ctrl_segs[c.readable].len >= 1) {
      const uint8_t ack = len >= 2 && c.readable_bytes <= w.ctrl_buf.size()
                              ? control_command(w.ctrl_buf[0], w.ctrl_buf[1], w.ctrl_buf.data() + 2, len - 2)
                              : kCtrlErr;
      *w.ctrl_segs[c.readable].data = ack;
      if (w.log) w.log->mark_host(w.ctrl_segs[c.readable].data, 1);
      written = 1;
    }
    q.stats->packets.fetch_add(1, std::memory_order_relaxed);
    q.ring->add_used(c, written);
  }
  if (q.ring->broken()) fail_queue(control_queue_index(), q);
  if (any) notify(q);
}

uint8_t NetDevice::control_command(uint8_t cls, uint8_t cmd, const uint8_t* data, size_t len) {
  if (cls == kCtrlRx && (features_ & kNetCtrlRx) && len == 1 && (cmd == kCtrlRxPromisc || cmd == kCtrlRxAllmulti)) {
    (cmd == kCtrlRxPromisc ? filter_.promisc : filter_.allmulti).store(data[0] != 0);
    return kCtrlOk;
  }
  if (cls == kCtrlMac && cmd == kCtrlMacAddrSet && (features_ & kNetCtrlMacAddr) && len == 6) {
    filter_.mac.store(mac_bits(data));
    return kCtrlOk;
  }
  if (cls == kCtrlMac && cmd == kCtrlMacTableSet && (features_ & kNetCtrlRx)) {
    // Two tables: u32 entries then 6-byte addresses, unicast then multicast.
    size_t at = 0;
    for (int table = 0; table < 2; ++table) {
      uint32_t entries = 0;
      if (len - at < 4) return kCtrlErr;
      std::memcpy(&entries, data + at, 4);
      at += 4;
      if (entries > (len - at) / 6) return kCtrlErr;
      auto& slots = table == 0 ? filter_.unicast : filter_.multicast;
      auto& count = table == 0 ? filter_.unicast_count : filter_.multicast_count;
      auto& overflow = table == 0 ? filter_.unicast_overflow : filter_.multicast_overflow;
      const uint32_t kept = std::min<uint32_t>(entries, RxFilter::kMaxMacs);
      count.store(0, std::memory_order_release);
      for (uint32_t i = 0; i < kept; ++i) slots[i].store(mac_bits(data + at + 6ULL * i), std::memory_order_relaxed);
      count.store(kept, std::memory_order_release);
      overflow.store(entries > RxFilter::kMaxMacs);  // more than we hold: let that kind through
      at += 6ULL * entries;
    }
    return at == len ? kCtrlOk : kCtrlErr;
  }
  if (cls == kCtrlAnnounce && cmd == kCtrlAnnounceAck && (features_ & kNetGuestAnnounce) && len == 0) {
    announce_status_.store(false, std::memory_order_relaxed);
    return kCtrlOk;
  }
  if (cls == kCtrlMq && cmd == kCtrlMqPairsSet && (features_ & kNetMq) && len == 2) {
    uint16_t pairs = 0;
    std::memcpy(&pairs, data, 2);
    if (pairs < 1 || pairs > config_.queue_pairs) return kCtrlErr;
    const unsigned before = active_pairs_.exchange(pairs);
    if (!steer_port()) {
      active_pairs_.store(before);
      return kCtrlErr;
    }
    return kCtrlOk;
  }
  return kCtrlErr;  // a class or command not negotiated (VLAN, ANNOUNCE, ...)
}

}  // namespace sriovd::virtio
