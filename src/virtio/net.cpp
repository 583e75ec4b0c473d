#include "sriovd/virtio/net.hpp"

#include <linux/if_tun.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <stdexcept>

#include "sriovd/util/error.hpp"

namespace sriovd::virtio {

namespace {

constexpr size_t kHeader = sizeof(NetHeader);
constexpr size_t kMaxPacket = 65536 + kHeader;  // a GSO packet and its header
constexpr unsigned kMaxChains = 64;             // buffers one received packet may take
constexpr unsigned kSegsPerChain = 8;
constexpr unsigned kTxSegs = 64;

enum : uint64_t { kEvTxKick = 1, kEvRxKick = 2, kEvTap = 3, kEvStop = 4 };

}  // namespace

struct NetDevice::Worker {
  unsigned pair = 0;
  UniqueFd epoll;
  UniqueFd stop;
  int tap_fd = -1;
  bool tap_armed = true;
  std::thread thread;
  // Preallocated: nothing on the data path allocates.
  std::vector<uint8_t> bounce = std::vector<uint8_t>(kMaxPacket);
  size_t pending = 0;  // bytes of a received packet still waiting for buffers
  std::array<Chain, kMaxChains> chains{};
  std::array<Segment, kMaxChains * kSegsPerChain> segs{};
  std::array<Segment, kTxSegs> tx_segs{};
  std::array<iovec, kTxSegs> tx_iov{};
};

NetDevice::NetDevice(NetConfig config, irq::Engine& engine, std::unique_ptr<PacketPort> port)
    : config_(std::move(config)), engine_(engine), tap_(std::move(port)), queues_(2U * config_.queue_pairs) {
  if (tap_->queues() < config_.queue_pairs)
    throw std::invalid_argument(config_.name + ": " + tap_->name() + " has " + std::to_string(tap_->queues()) +
                                " queue(s) for " + std::to_string(config_.queue_pairs) + " queue pairs");
  for (unsigned q = 0; q < queues_.size(); ++q) {
    queues_[q].route = engine_.add({config_.name, q, irq::Policy::relay, nullptr});
    queues_[q].interrupt = queues_[q].route;
  }
}

NetDevice::~NetDevice() {
  stop();
  for (auto& q : queues_) engine_.remove(q.route);
}

uint64_t NetDevice::offered_features() const {
  uint64_t f = kVersion1 | kNetMrgRxbuf | kNetStatus | kNetMtu | kRingEventIdx | kRingIndirectDesc;
  if (config_.mac) f |= kNetMac;
  if (config_.packed) f |= kRingPacked;
  if (config_.queue_pairs > 1) f |= kNetMq;
  if (config_.offloads) f |= kNetCsum | kNetGuestCsum | kNetHostTso4 | kNetHostTso6 | kNetGuestTso4 | kNetGuestTso6;
  return f;
}

void NetDevice::set_features(uint64_t features) {
  features_ = features & offered_features();
  // What the tap may hand us is what the guest said it can take.
  unsigned tun = 0;
  if (features_ & kNetGuestCsum) tun |= TUN_F_CSUM;
  if ((features_ & kNetGuestTso4) && (tun & TUN_F_CSUM)) tun |= TUN_F_TSO4;
  if ((features_ & kNetGuestTso6) && (tun & TUN_F_CSUM)) tun |= TUN_F_TSO6;
  tap_->set_offloads(tun & config_.tap_offloads);
}

void NetDevice::set_queue_size(unsigned q, uint16_t size) {
  if (size == 0 || size > config_.max_queue_size)
    throw std::invalid_argument(config_.name + ": queue " + std::to_string(q) + " size " + std::to_string(size) +
                                " outside 1.." + std::to_string(config_.max_queue_size));
  queues_.at(q).size = size;
}
void NetDevice::set_queue_rings(unsigned q, const RingAddresses& rings) {
  queues_.at(q).rings = rings;
  queues_.at(q).rings_set = true;
}
void NetDevice::set_queue_base(unsigned q, uint32_t base) { queues_.at(q).base = base; }
void NetDevice::set_queue_kick(unsigned q, UniqueFd kick) { queues_.at(q).kick = std::move(kick); }
void NetDevice::set_queue_call(unsigned q, UniqueFd call) {
  Queue& queue = queues_.at(q);
  const bool valid = call.valid();
  engine_.set_sink(queue.route, std::move(call));
  // vhost-user has no vector masking: a call fd means "signal me".
  if (valid)
    engine_.unmask(queue.route);
  else
    engine_.mask(queue.route);
}
void NetDevice::set_queue_enabled(unsigned q, bool enabled) { queues_.at(q).enabled = enabled; }
void NetDevice::set_queue_interrupt(unsigned q, std::optional<irq::RouteId> route) {
  if (running()) throw std::logic_error(config_.name + ": queue interrupt changed while running");
  queues_.at(q).interrupt = route;
}

bool NetDevice::queue_ready(const Queue& q) const {
  return memory_ && q.size > 0 && q.rings_set && q.enabled && q.kick.valid();
}

uint32_t NetDevice::stop_queue(unsigned q) {
  stop();
  Queue& queue = queues_.at(q);
  queue.enabled = false;
  return queue.base;
}

void NetDevice::start() {
  if (running() || broken_) return;
  const bool packed = features_ & kRingPacked;
  const bool event_idx = features_ & kRingEventIdx;
  for (unsigned p = 0; p < config_.queue_pairs; ++p) {
    Queue& rx = queues_[2 * p];
    Queue& tx = queues_[2 * p + 1];
    if (!queue_ready(rx) || !queue_ready(tx)) continue;
    for (Queue* q : {&rx, &tx})
      q->ring = packed ? make_packed_queue(*memory_, q->size, q->rings, event_idx, Barriers::one_way, q->base)
                       : make_split_queue(*memory_, q->size, q->rings, event_idx, Barriers::one_way, q->base);
    auto w = std::make_unique<Worker>();
    w->pair = p;
    w->tap_fd = tap_->fd(p);
    w->epoll.reset(::epoll_create1(EPOLL_CLOEXEC));
    w->stop.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!w->epoll || !w->stop) throw_errno(config_.name + ": worker setup");
    auto watch = [&](int fd, uint64_t tag) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = tag;
      if (::epoll_ctl(w->epoll.get(), EPOLL_CTL_ADD, fd, &ev) != 0) throw_errno(config_.name + ": epoll_ctl");
    };
    watch(tx.kick.get(), kEvTxKick);
    watch(rx.kick.get(), kEvRxKick);
    watch(w->tap_fd, kEvTap);
    watch(w->stop.get(), kEvStop);
    Worker* raw = w.get();
    w->thread = std::thread([this, raw] { run_pair(*raw); });
    workers_.push_back(std::move(w));
  }
}

void NetDevice::stop() {
  for (auto& w : workers_) {
    const uint64_t one = 1;
    (void)::write(w->stop.get(), &one, sizeof one);
  }
  for (auto& w : workers_) w->thread.join();
  for (auto& w : workers_)
    for (unsigned q : {2 * w->pair, 2 * w->pair + 1}) {
      Queue& queue = queues_[q];
      if (queue.ring) queue.base = queue.ring->base();
      queue.ring.reset();
    }
  workers_.clear();
}

void NetDevice::reset() {
  stop();
  for (unsigned q = 0; q < queues_.size(); ++q) {
    Queue& queue = queues_[q];
    queue.size = 0;
    queue.rings_set = false;
    queue.base = 0;
    queue.kick.reset();
    queue.enabled = false;
    queue.interrupt = queue.route;
    engine_.set_sink(queue.route, UniqueFd());
    engine_.mask(queue.route);
  }
  features_ = 0;
  memory_ = nullptr;
  broken_ = false;
}

void NetDevice::notify(Queue& q) {
  if (q.ring->should_notify() && q.interrupt) {
    engine_.trigger(*q.interrupt);
    q.stats->notifies.fetch_add(1, std::memory_order_relaxed);
  }
}

void NetDevice::run_pair(Worker& w) {
  // Buffers may have been posted before the kick fds were watched.
  do_tx(w);
  do_rx(w);
  epoll_event events[8];
  for (;;) {
    const int n = ::epoll_wait(w.epoll.get(), events, 8, -1);
    for (int i = 0; i < n; ++i) {
      uint64_t count;
      switch (events[i].data.u64) {
        case kEvStop:
          return;
        case kEvTxKick:
          (void)::read(queues_[2 * w.pair + 1].kick.get(), &count, sizeof count);
          queues_[2 * w.pair + 1].stats->kicks.fetch_add(1, std::memory_order_relaxed);
          do_tx(w);
          break;
        case kEvRxKick:
          (void)::read(queues_[2 * w.pair].kick.get(), &count, sizeof count);
          queues_[2 * w.pair].stats->kicks.fetch_add(1, std::memory_order_relaxed);
          do_rx(w);
          break;
        case kEvTap:
          do_rx(w);
          break;
      }
    }
    if (broken_.load(std::memory_order_relaxed)) return;
  }
}

bool NetDevice::do_tx(Worker& w) {
  const unsigned pair = w.pair;
  Queue& q = queues_[2 * pair + 1];
  auto& segs = w.tx_segs;
  auto& iov = w.tx_iov;
  Chain c;
  bool any = false;
  for (;;) {
    if (!q.ring->pop(c, segs)) {
      // Ask for a kick before sleeping; buffers that slipped in meanwhile
      // are taken now.
      if (q.ring->broken() || !q.ring->enable_kicks()) break;
      continue;
    }
    any = true;
    if (c.readable == 0 || c.readable_bytes < kHeader) {
      q.stats->dropped.fetch_add(1, std::memory_order_relaxed);
    } else {
      for (unsigned i = 0; i < c.readable; ++i) iov[i] = {segs[i].data, segs[i].len};
      // The virtio-net header goes to the tap as it is (IFF_VNET_HDR, 12 bytes).
      if (tap_->send(pair, iov.data(), c.readable) < 0) {
        q.stats->dropped.fetch_add(1, std::memory_order_relaxed);
      } else {
        q.stats->packets.fetch_add(1, std::memory_order_relaxed);
        q.stats->bytes.fetch_add(c.readable_bytes - kHeader, std::memory_order_relaxed);
      }
    }
    q.ring->push(c, 0);
  }
  if (q.ring->broken()) broken_ = true;
  if (any) notify(q);
  return any;
}

bool NetDevice::do_rx(Worker& w) {
  Queue& q = queues_[2 * w.pair];
  const bool mergeable = features_ & kNetMrgRxbuf;
  bool delivered = false;
  for (;;) {
    if (w.pending == 0) {
      const ssize_t n = tap_->recv(w.pair, w.bounce.data(), w.bounce.size());
      if (n <= static_cast<ssize_t>(kHeader)) break;  // EAGAIN, or nothing usable
      w.pending = static_cast<size_t>(n);
    }
    // Take as many buffers as the packet needs before publishing any, so
    // num_buffers is right when the driver looks.
    unsigned used = 0;
    size_t room = 0;
    while (room < w.pending && used < kMaxChains) {
      std::span<Segment> segs(&w.segs[used * kSegsPerChain], kSegsPerChain);
      if (!q.ring->pop(w.chains[used], segs)) break;
      room += w.chains[used].writable_bytes;
      ++used;
      if (!mergeable) break;
    }
    if (q.ring->broken()) {
      broken_ = true;
      return delivered;
    }
    if (room < w.pending) {
      if (!mergeable && used == 1) {
        // The guest's buffer cannot hold this packet: it is dropped.
        q.ring->push(w.chains[0], 0);
        q.stats->dropped.fetch_add(1, std::memory_order_relaxed);
        w.pending = 0;
        delivered = true;
        continue;
      }
      while (used > 0) q.ring->rewind(w.chains[--used]);
      // Buffers that arrived meanwhile: try again before giving up.
      if (q.ring->enable_kicks()) continue;
      // Out of buffers: stop watching the tap until the guest kicks.
      if (w.tap_armed) {
        epoll_event ev{};
        ev.data.u64 = kEvTap;
        ::epoll_ctl(w.epoll.get(), EPOLL_CTL_MOD, w.tap_fd, &ev);
        w.tap_armed = false;
      }
      break;
    }
    const uint16_t num_buffers = static_cast<uint16_t>(used);
    std::memcpy(w.bounce.data() + offsetof(NetHeader, num_buffers), &num_buffers, sizeof num_buffers);
    size_t off = 0;
    for (unsigned c = 0; c < used; ++c) {
      Chain& chain = w.chains[c];
      uint32_t written = 0;
      for (unsigned s = chain.readable; s < chain.count && off < w.pending; ++s) {
        Segment& seg = w.segs[c * kSegsPerChain + s];
        const size_t n = std::min<size_t>(seg.len, w.pending - off);
        std::memcpy(seg.data, w.bounce.data() + off, n);
        off += n;
        written += static_cast<uint32_t>(n);
      }
      q.ring->push(chain, written);
    }
    q.stats->packets.fetch_add(1, std::memory_order_relaxed);
    q.stats->bytes.fetch_add(w.pending - kHeader, std::memory_order_relaxed);
    w.pending = 0;
    delivered = true;
  }
  if (delivered) notify(q);
  if (!w.tap_armed && w.pending == 0) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kEvTap;
    ::epoll_ctl(w.epoll.get(), EPOLL_CTL_MOD, w.tap_fd, &ev);
    w.tap_armed = true;
  }
  return delivered;
}

}  // namespace sriovd::virtio
