#include "sriovd/guest/virtio_net_driver.hpp"

#include <linux/if_tun.h>
#include <poll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "sriovd/guest/virtqueue.hpp"
#include "sriovd/util/error.hpp"
#include "sriovd/util/eventfd.hpp"
#include "sriovd/virtio/net.hpp"
#include "transport.hpp"

namespace sriovd::guest {

namespace {

constexpr size_t kBufSize = 65536 + 4096;  // a 64 KB TSO segment, its headers and the virtio-net header

uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace

// One virtqueue from the driver's side, split or packed, with the buffer
// slot each outstanding chain carries.
class VirtioNetDriver::Ring {
 public:
  Ring(uint8_t* host, uint64_t gpa, uint16_t size, bool packed) : slot_of_(size) {
    if (packed)
      packed_ = std::make_unique<PackedDriver>(host, gpa, size);
    else
      split_ = std::make_unique<SplitDriver>(host, gpa, size);
  }
  static uint64_t bytes(uint16_t size, bool packed) {
    return packed ? PackedDriver::ring_bytes(size) : SplitDriver::ring_bytes(size);
  }
  [[nodiscard]] virtio::RingAddresses addresses() const { return split_ ? split_->addresses() : packed_->addresses(); }
  bool add(const Buffer& b, uint16_t slot) { return add_chain(std::span<const Buffer>(&b, 1), slot); }
  bool add_chain(std::span<const Buffer> chain, uint16_t slot) {
    const int id = split_ ? split_->add(chain) : packed_->add(chain);
    if (id < 0) return false;
    slot_of_[static_cast<size_t>(id)] = slot;
    return true;
  }
  void publish() {
    if (split_) split_->publish();
  }
  bool take(uint16_t& slot, uint32_t& len) {
    uint32_t id = 0;
    if (!(split_ ? split_->take_used(id, len) : packed_->take_used(id, len))) return false;
    if (id >= slot_of_.size()) throw std::runtime_error("the device used an id that was never made available");
    slot = slot_of_[id];
    return true;
  }

 private:
  std::unique_ptr<SplitDriver> split_;
  std::unique_ptr<PackedDriver> packed_;
  std::vector<uint16_t> slot_of_;
};

VirtioNetDriver::VirtioNetDriver(VfioUserClient& client, VirtioNetDriverOptions options)
    : options_(options), transport_(make_pci_transport(client, options_, stats_)) {}

VirtioNetDriver::VirtioNetDriver(std::string vhost_user_socket, VirtioNetDriverOptions options)
    : options_(options), transport_(make_vhost_user_transport(std::move(vhost_user_socket), options_, stats_)) {}

VirtioNetDriver::~VirtioNetDriver() {
  transport_.reset();  // the device stops using guest RAM first
  if (ram_) ::munmap(ram_, ram_size_);
}

// §3.1.1 with the transport's part of each step: features, then guest RAM
// laid out for the pairs agreed and shared, the rings handed over and the
// device started, then the RX buffers posted (and, with MQ, the pairs in
// use told, §5.1.6.5.5).
void VirtioNetDriver::bring_up() {
  uint64_t want = virtio::kVersion1 | virtio::kNetMrgRxbuf;
  if (options_.offloads)
    want |= virtio::kNetCsum | virtio::kNetGuestCsum | virtio::kNetHostTso4 | virtio::kNetHostTso6 |
            virtio::kNetGuestTso4 | virtio::kNetGuestTso6;
  if (options_.packed) want |= virtio::kRingPacked;
  features_ = transport_->negotiate(want);
  if (!(features_ & virtio::kVersion1)) throw std::runtime_error("the device does not offer VIRTIO_F_VERSION_1");
  packed_ = features_ & virtio::kRingPacked;
  const unsigned pairs = transport_->queue_pairs(features_, options_.queue_pairs);
  map_ram(pairs);
  dma_base_ = transport_->share({ram_fd_.get(), ram_, ram_size_});
  make_pairs(pairs);

  std::vector<QueueSetup> queues;
  for (unsigned i = 0; i < 2 * pairs; ++i)
    queues.push_back({i, i, options_.queue_size, (i % 2 == 0 ? pairs_[i / 2].rx : pairs_[i / 2].tx)->addresses()});
  if (features_ & virtio::kNetCtrlVq) {
    ctrl_index_ = transport_->control_queue(pairs);
    const uint64_t at = 2ULL * pairs * ring_bytes_;
    ctrl_ = std::make_unique<Ring>(ram_ + at, dma_base_ + at, options_.queue_size, packed_);
    queues.push_back({ctrl_index_, 2 * pairs, options_.queue_size, ctrl_->addresses()});
  }
  auto started = transport_->start(queues);
  irq_fds_ = std::move(started.interrupts);
  doorbells_ = std::move(started.doorbells);
  for (unsigned p = 0; p < pairs; ++p) post_rx(p);
  if (pairs > 1) {
    const uint8_t kCtrlMq = 4, kCtrlMqPairsSet = 0;
    const auto count = static_cast<uint16_t>(pairs);
    if (const uint8_t ack =
            control(kCtrlMq, kCtrlMqPairsSet, {static_cast<uint8_t>(count), static_cast<uint8_t>(count >> 8U)});
        ack != 0)
      throw std::runtime_error("the device refused VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET " + std::to_string(pairs) +
                               " (ack " + std::to_string(ack) + ")");
  }
}

std::string VirtioNetDriver::mac() const { return transport_->mac(); }

std::vector<VirtioNetDriver::Area> VirtioNetDriver::device_only_areas() const {
  std::vector<Area> out;
  for (unsigned p = 0; p < pairs_.size(); ++p)
    out.push_back({rx_offset(p, 0), uint64_t{options_.queue_size} * kBufSize});
  if (!packed_) {
    const uint64_t used = virtio::split_layout(options_.queue_size).device_bytes;
    for (const Pair& p : pairs_)
      for (const Ring* r : {p.rx.get(), p.tx.get()}) out.push_back({r->addresses().device - dma_base_, used});
    if (ctrl_) out.push_back({ctrl_->addresses().device - dma_base_, used});
  }
  return out;
}

void VirtioNetDriver::moved_to(VfioUserClient& to) {
  doorbells_ = transport_->moved_to(to, {ram_fd_.get(), ram_, ram_size_}, irq_fds_);
}

// Guest RAM: per pair an RX and a TX ring, the control ring; per pair TX
// and RX buffers; a command page.
void VirtioNetDriver::map_ram(unsigned pairs) {
  const uint16_t n = options_.queue_size;
  ram_pairs_ = pairs;
  ring_bytes_ = align_up(Ring::bytes(n, packed_), 4096);
  ram_size_ = align_up(command_page() + 4096, 2 << 20);
  ram_fd_.reset(::memfd_create("sriovd-guest-ram", MFD_CLOEXEC));
  if (!ram_fd_ || ::ftruncate(ram_fd_.get(), static_cast<off_t>(ram_size_)) != 0) throw_errno("guest RAM memfd");
  void* m = ::mmap(nullptr, ram_size_, PROT_READ | PROT_WRITE, MAP_SHARED, ram_fd_.get(), 0);
  if (m == MAP_FAILED) throw_errno("mapping guest RAM");
  ram_ = static_cast<uint8_t*>(m);
}

uint64_t VirtioNetDriver::tx_offset(unsigned pair, uint16_t slot) const {
  return (2ULL * ram_pairs_ + 1) * ring_bytes_ + (2ULL * pair * options_.queue_size + slot) * kBufSize;
}

uint64_t VirtioNetDriver::rx_offset(unsigned pair, uint16_t slot) const {
  return (2ULL * ram_pairs_ + 1) * ring_bytes_ + ((2ULL * pair + 1) * options_.queue_size + slot) * kBufSize;
}

uint64_t VirtioNetDriver::command_page() const { return tx_offset(ram_pairs_, 0); }

// The rings of `count` pairs (and the control ring after them) in guest RAM.
void VirtioNetDriver::make_pairs(unsigned count) {
  const uint16_t n = options_.queue_size;
  pairs_.clear();
  pairs_.resize(count);
  for (unsigned p = 0; p < count; ++p) {
    const uint64_t rx = 2ULL * p * ring_bytes_, tx = rx + ring_bytes_;
    pairs_[p].rx = std::make_unique<Ring>(ram_ + rx, dma_base_ + rx, n, packed_);
    pairs_[p].tx = std::make_unique<Ring>(ram_ + tx, dma_base_ + tx, n, packed_);
    for (uint16_t slot = 0; slot < n; ++slot) pairs_[p].tx_free.push_back(slot);
  }
}

void VirtioNetDriver::kick(unsigned q) {
  stats_.kicks.fetch_add(1, std::memory_order_relaxed);
  if (q < doorbells_.size() && doorbells_[q]) {
    own_eventfd_signal(doorbells_[q].get());
    return;
  }
  transport_->notify(q);
}

void VirtioNetDriver::post_rx(unsigned pair) {
  Ring& rx = *pairs_[pair].rx;
  for (uint16_t slot = 0; slot < options_.queue_size; ++slot)
    if (!rx.add({dma_base_ + rx_offset(pair, slot), static_cast<uint32_t>(kBufSize), true}, slot)) break;
  rx.publish();
  kick(2 * pair);
}

void VirtioNetDriver::reclaim_tx(Pair& p) {
  uint16_t slot;
  uint32_t len;
  while (p.tx->take(slot, len)) p.tx_free.push_back(slot);
}

// Takes one used RX chain (gathering the num_buffers a merged packet
// spans), hands it to the tap or copies it out, and gives the buffers back.
size_t VirtioNetDriver::take_rx(unsigned pair, uint8_t* out, size_t size, ports::Tap* tap, unsigned tap_queue) {
  Ring& rx = *pairs_[pair].rx;
  auto buf = [&](uint16_t slot) { return ram_ + rx_offset(pair, slot); };
  uint16_t slot;
  uint32_t len;
  if (!rx.take(slot, len)) return 0;
  uint16_t count = 1;
  if (features_ & virtio::kNetMrgRxbuf) std::memcpy(&count, buf(slot) + 10, 2);
  iovec iov[64];
  uint16_t slots[64];
  int parts = 0;
  iov[parts] = {buf(slot), std::min<size_t>(len, kBufSize)};
  slots[parts++] = slot;
  // The device publishes a merged packet's buffers together; a count it
  // never completes is a broken device, not a reason to hang.
  for (uint32_t i = 1, spins = 0; i < count && parts < 64 && spins < (1U << 24U); ++spins) {
    if (rx.take(slot, len)) {
      iov[parts] = {buf(slot), std::min<size_t>(len, kBufSize)};
      slots[parts++] = slot;
      ++i;
    }
  }
  size_t total = 0;
  for (int i = 0; i < parts; ++i) total += iov[i].iov_len;
  if (tap) {
    if (tap->send(tap_queue, iov, parts) < 0) stats_.rx_dropped.fetch_add(1, std::memory_order_relaxed);
  } else {
    size_t at = 0;
    for (int i = 0; i < parts && at < size; ++i) {
      const size_t c = std::min(size - at, iov[i].iov_len);
      std::memcpy(out + at, iov[i].iov_base, c);
      at += c;
    }
    total = std::min(total, size);
  }
  stats_.rx_packets.fetch_add(1, std::memory_order_relaxed);
  stats_.rx_bytes.fetch_add(total, std::memory_order_relaxed);
  for (int i = 0; i < parts; ++i)
    rx.add({dma_base_ + rx_offset(pair, slots[i]), static_cast<uint32_t>(kBufSize), true}, slots[i]);
  return total;
}

uint8_t VirtioNetDriver::control(uint8_t cls, uint8_t cmd, const std::vector<uint8_t>& data) {
  if (!ctrl_) throw std::runtime_error("no control queue was negotiated");
  // The command page follows the RX buffers: header, data, then the ack.
  const uint64_t page = command_page();
  if (data.size() + 3 > 4096) throw std::invalid_argument("control command too long");
  uint8_t* p = ram_ + page;
  p[0] = cls;
  p[1] = cmd;
  if (!data.empty()) std::memcpy(p + 2, data.data(), data.size());
  p[2 + data.size()] = 0xff;
  const Buffer chain[2] = {{dma_base_ + page, static_cast<uint32_t>(2 + data.size()), false},
                           {dma_base_ + page + 2 + data.size(), 1, true}};
  uint16_t slot = 0;
  uint32_t len = 0;
  if (!ctrl_->add_chain(chain, 0)) throw std::runtime_error("the control queue is full");
  ctrl_->publish();
  kick(ctrl_index_);
  for (int i = 0; i < 2000; ++i) {
    if (ctrl_->take(slot, len)) return p[2 + data.size()];
    pollfd pf{irq_fds_.back().get(), POLLIN, 0};  // the control queue's vector is the last
    if (transport_->poll(&pf, 1, 1) > 0 && (pf.revents & POLLIN)) {
      own_eventfd_drain(pf.fd);
    }
  }
  throw std::runtime_error("the device did not answer the control command");
}

bool VirtioNetDriver::send(const uint8_t* frame, size_t size, unsigned pair) {
  Pair& p = pairs_.at(pair);
  reclaim_tx(p);
  if (p.tx_free.empty() || size > kBufSize) return false;
  const uint16_t slot = p.tx_free.back();
  const uint64_t off = tx_offset(pair, slot);
  std::memcpy(ram_ + off, frame, size);
  if (!p.tx->add({dma_base_ + off, static_cast<uint32_t>(size), false}, slot)) return false;
  p.tx_free.pop_back();
  p.tx->publish();
  kick(2 * pair + 1);
  stats_.tx_packets.fetch_add(1, std::memory_order_relaxed);
  stats_.tx_bytes.fetch_add(size, std::memory_order_relaxed);
  return true;
}

size_t VirtioNetDriver::receive(uint8_t* out, size_t size, int timeout_ms) {
  constexpr unsigned kMaxPairs = 8;
  const unsigned pairs = std::min<unsigned>(queue_pairs(), kMaxPairs);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  // An interrupt is counted when its eventfd was signalled, whether or not
  // the frame it announced was already there before we waited.
  auto take_interrupt = [&](int fd) {
    uint64_t v;
    if (::read(fd, &v, sizeof v) == sizeof v) stats_.interrupts.fetch_add(1, std::memory_order_relaxed);
  };
  for (;;) {
    for (unsigned p = 0; p < pairs; ++p) take_interrupt(irq_fds_[2 * p].get());
    for (unsigned p = 0; p < pairs; ++p)
      if (const size_t got = take_rx(p, out, size, nullptr, 0)) {
        pairs_[p].rx->publish();
        kick(2 * p);
        return got;
      }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return 0;
    pollfd fds[kMaxPairs];
    for (unsigned p = 0; p < pairs; ++p) fds[p] = {irq_fds_[2 * p].get(), POLLIN, 0};
    (void)transport_->poll(fds, pairs, static_cast<int>(left.count()));
  }
}

// One Vector Control write, timed (its round trip is what the experiment
// is about).
void VirtioNetDriver::timed_mask(unsigned vector, bool masked) {
  const auto t0 = std::chrono::steady_clock::now();
  transport_->mask_vector(vector, masked);
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  stats_.mask_writes.fetch_add(1, std::memory_order_relaxed);
  stats_.mask_ns.fetch_add(static_cast<uint64_t>(ns), std::memory_order_relaxed);
}

void VirtioNetDriver::bridge(ports::Tap& tap, const std::atomic<bool>& stop) {
  // What the kernel may hand us on the tap is what the device takes on TX.
  unsigned tun = 0;
  if (features_ & virtio::kNetCsum) {
    tun |= TUN_F_CSUM;
    if (features_ & virtio::kNetHostTso4) tun |= TUN_F_TSO4;
    if (features_ & virtio::kNetHostTso6) tun |= TUN_F_TSO6;
  }
  tap.set_offloads(tun);
  // Pair i with tap queue i when there is one per pair (the tap's kernel
  // side spreads the flows it sends); else every pair with queue 0.
  constexpr unsigned kMaxPairs = 8;
  const unsigned pairs = std::min<unsigned>(queue_pairs(), kMaxPairs);
  const bool own_queues = tap.queues() == pairs;
  auto tap_queue = [&](unsigned p) { return own_queues ? p : 0U; };
  // Without a tap queue per pair, pair 0 alone takes what the tap sends.
  auto reads_tap = [&](unsigned p) { return own_queues || p == 0; };
  // Interrupt eventfds first (read to clear them), then the tap queues.
  pollfd fds[3 * kMaxPairs];
  while (!stop.load(std::memory_order_relaxed)) {
    nfds_t count = 0;
    for (unsigned q = 0; q < 2 * pairs; ++q) fds[count++] = {irq_fds_[q].get(), POLLIN, 0};
    for (unsigned p = 0; p < pairs; ++p) {
      reclaim_tx(pairs_[p]);
      if (!pairs_[p].tx_free.empty() && reads_tap(p)) fds[count++] = {tap.fd(tap_queue(p)), POLLIN, 0};
    }
    if (transport_->poll(fds, count, 100) < 0 && errno != EINTR) throw_errno("poll");
    // Vector q is queue q's. Masked on the way in (the 2.6.18 ack), unmasked
    // once the queues are served below.
    bool masked[2 * kMaxPairs] = {};
    for (unsigned q = 0; q < 2 * pairs; ++q)
      if (fds[q].revents & POLLIN) {
        if (options_.mask_every_interrupt) {
          timed_mask(q, true);
          masked[q] = true;
        }
        own_eventfd_drain(fds[q].fd);
        stats_.interrupts.fetch_add(1, std::memory_order_relaxed);
      }
    for (unsigned p = 0; p < pairs; ++p) {
      Pair& pr = pairs_[p];
      // Device -> tap.
      bool reposted = false;
      while (take_rx(p, nullptr, 0, &tap, tap_queue(p)) > 0) reposted = true;
      if (reposted) {
        pr.rx->publish();
        kick(2 * p);
      }
      // Tap -> device.
      if (!reads_tap(p)) continue;
      bool added = false;
      reclaim_tx(pr);
      while (!pr.tx_free.empty()) {
        const uint16_t slot = pr.tx_free.back();
        const uint64_t off = tx_offset(p, slot);
        const ssize_t got = tap.recv(tap_queue(p), ram_ + off, kBufSize);
        if (got <= 0) break;
        if (!pr.tx->add({dma_base_ + off, static_cast<uint32_t>(got), false}, slot)) break;
        pr.tx_free.pop_back();
        added = true;
        stats_.tx_packets.fetch_add(1, std::memory_order_relaxed);
        stats_.tx_bytes.fetch_add(static_cast<uint64_t>(got), std::memory_order_relaxed);
      }
      if (added) {
        pr.tx->publish();
        kick(2 * p + 1);
      }
    }
    for (unsigned q = 0; q < 2 * pairs; ++q)
      if (masked[q]) timed_mask(q, false);  // a message that came meanwhile is delivered now (pending bit)
  }
}

}  // namespace sriovd::guest
