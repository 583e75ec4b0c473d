#include "sriovd/virtio/device.hpp"

#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <stdexcept>
#include <tuple>
#include <utility>

#include <boost/crc.hpp>
#include <spdlog/spdlog.h>

#include "sriovd/util/error.hpp"
#include "sriovd/util/eventfd.hpp"
#include "sriovd/util/hex.hpp"

namespace sriovd::virtio {

namespace {

constexpr uint32_t kStateMagic = 0x53564453;  // "SDVS": sriovd device state
constexpr size_t kMaxQueues = 1024;           // more than any transport offers
constexpr size_t kMaxBlob = 16U << 20U;       // a device's or transport's own part

}  // namespace

// --- DeviceState ---

void StateWriter::blob(std::span<const uint8_t> b) {
  u32(static_cast<uint32_t>(b.size()));
  bytes_.insert(bytes_.end(), b.begin(), b.end());
}

uint64_t StateReader::get(unsigned n) {
  if (b_.size() - at_ < n) fail("ends at byte " + std::to_string(b_.size()) + " inside a field");
  uint64_t v = 0;
  for (unsigned i = 0; i < n; ++i) v |= uint64_t{b_[at_ + i]} << (8U * i);
  at_ += n;
  return v;
}

std::vector<uint8_t> StateReader::blob(size_t max) {
  const uint32_t n = u32();
  if (n > max) fail("a part of " + std::to_string(n) + " bytes (at most " + std::to_string(max) + ")");
  if (b_.size() - at_ < n) fail("a part of " + std::to_string(n) + " bytes runs past the end");
  std::vector<uint8_t> out(b_.begin() + static_cast<std::ptrdiff_t>(at_),
                           b_.begin() + static_cast<std::ptrdiff_t>(at_ + n));
  at_ += n;
  return out;
}

void StateReader::end() const {
  if (at_ != b_.size()) fail(std::to_string(b_.size() - at_) + " bytes left over");
}

void StateReader::fail(const std::string& why) const { throw std::invalid_argument(what_ + ": " + why); }

uint32_t DeviceState::checksum(std::span<const uint8_t> bytes) {
  boost::crc_32_type crc;
  crc.process_bytes(bytes.data(), bytes.size());
  return crc.checksum();
}

std::vector<uint8_t> DeviceState::serialize() const {
  StateWriter w;
  w.u32(kStateMagic);
  w.u32(kVersion);
  w.u16(device_id);
  w.u64(features);
  w.u32(static_cast<uint32_t>(queues.size()));
  for (const QueueState& q : queues) {
    w.u16(q.size);
    w.u8(static_cast<uint8_t>((q.enabled ? 1U : 0U) | (q.rings_set ? 2U : 0U)));
    w.u64(q.rings.desc);
    w.u64(q.rings.driver);
    w.u64(q.rings.device);
    w.u32(q.base);
  }
  w.u32(device_version);
  w.blob(device);
  w.u32(transport_version);
  w.blob(transport);
  std::vector<uint8_t> out = w.take();
  const uint32_t crc = checksum(out);
  for (unsigned i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(crc >> (8U * i)));
  return out;
}

DeviceState DeviceState::parse(std::span<const uint8_t> bytes, const std::string& what) {
  StateReader head(bytes, what);
  if (head.u32() != kStateMagic) head.fail("not a device state");
  const uint32_t version = head.u32();
  if (version < kOldestRead || version > kVersion)
    head.fail("state version " + std::to_string(version) + " (this sriovd reads " + std::to_string(kOldestRead) +
              " to " + std::to_string(kVersion) + ")");
  if (version >= 2) {
    // Checked before anything else is read: a damaged state is named as
    // such, not by the first field that happens to look wrong.
    if (bytes.size() < 12) head.fail("ends at byte " + std::to_string(bytes.size()) + " before its checksum");
    const auto body = bytes.first(bytes.size() - 4);
    uint32_t have = 0;
    for (unsigned i = 0; i < 4; ++i) have |= uint32_t{bytes[body.size() + i]} << (8U * i);
    if (const uint32_t want = checksum(body); have != want)
      head.fail("checksum " + hex(have) + " does not match its bytes (" + hex(want) + "): damaged");
    bytes = body;
  }
  StateReader r(bytes, what);
  (void)r.u32();
  (void)r.u32();
  DeviceState s;
  s.device_id = r.u16();
  s.features = r.u64();
  const uint32_t n = r.u32();
  if (n > kMaxQueues) r.fail(std::to_string(n) + " queues");
  for (uint32_t i = 0; i < n; ++i) {
    QueueState q;
    q.size = r.u16();
    const uint8_t flags = r.u8();
    if (flags & ~3U) r.fail("queue " + std::to_string(i) + ": unknown flags " + std::to_string(flags));
    q.enabled = flags & 1U;
    q.rings_set = flags & 2U;
    q.rings.desc = r.u64();
    q.rings.driver = r.u64();
    q.rings.device = r.u64();
    q.base = r.u32();
    s.queues.push_back(q);
  }
  if (version >= 2) s.device_version = r.u32();
  s.device = r.blob(kMaxBlob);
  if (version >= 2) s.transport_version = r.u32();
  s.transport = r.blob(kMaxBlob);
  r.end();
  return s;
}

// --- QueueDevice ---

QueueDevice::QueueDevice(std::string name, unsigned num_queues, uint16_t max_queue_size, irq::Engine& engine)
    : engine_(engine), queues_(num_queues), name_(std::move(name)), max_queue_size_(max_queue_size) {}

QueueDevice::~QueueDevice() {
  // A device type stops its workers in its own destructor (they use its
  // members); this only makes sure.
  stop();
  wait_for_workers();
}

void QueueDevice::set_queue_size(unsigned q, uint16_t size) {
  if (size == 0 || size > max_queue_size_)
    throw std::invalid_argument(name_ + ": queue " + std::to_string(q) + " size " + std::to_string(size) +
                                " outside 1.." + std::to_string(max_queue_size_));
  queues_.at(q).size = size;
}

void QueueDevice::set_queue_rings(unsigned q, const RingAddresses& rings) {
  queues_.at(q).rings = rings;
  queues_.at(q).rings_set = true;
}

void QueueDevice::set_queue_enabled(unsigned q, bool enabled) {
  queues_.at(q).enabled = enabled;
  queue_enabled_changed(q);
}

void QueueDevice::set_queue_interrupt(unsigned q, std::optional<irq::RouteId> route) {
  if (running()) throw std::logic_error(name_ + ": queue interrupt changed while running");
  queues_.at(q).interrupt = route;
}

uint32_t QueueDevice::stop_queue(unsigned q) {
  stop();
  Queue& queue = queues_.at(q);
  queue.enabled = false;
  queue_enabled_changed(q);
  return queue.base;
}

void QueueDevice::set_inflight(uint8_t* base, uint16_t queues, uint16_t queue_size) {
  if (running()) throw std::logic_error(name_ + ": inflight buffer changed while running");
  inflight_ = base;
  inflight_queues_ = base ? queues : 0;
  inflight_queue_size_ = base ? queue_size : 0;
}

bool QueueDevice::queue_ready(const Queue& q) const {
  return memory_ && q.size > 0 && q.rings_set && q.enabled && q.kick.valid();
}

std::unique_ptr<Virtqueue> QueueDevice::make_ring(unsigned index) {
  Queue& q = queues_[index];
  uint8_t* region = nullptr;
  if (index < inflight_queues_) {
    if (q.size > inflight_queue_size_)
      throw std::invalid_argument(name_ + ": queue " + std::to_string(index) + " has " + std::to_string(q.size) +
                                  " entries, the inflight buffer room for " + std::to_string(inflight_queue_size_));
    region = inflight_ + index * inflight_queue_bytes(inflight_queue_size_);
  }
  const bool event_idx = features_ & kRingEventIdx;
  const RingLog log{q.log ? memory_->dirty_log() : nullptr, q.log.value_or(RingLog::kByHost)};
  auto ring = (features_ & kRingPacked)
                  ? make_packed_queue(*memory_, q.size, q.rings, event_idx, Barriers::one_way, q.base, region, log)
                  : make_split_queue(*memory_, q.size, q.rings, event_idx, Barriers::one_way, q.base, region, log);
  q.stats->resubmitted.fetch_add(ring->recovered(), std::memory_order_relaxed);
  return ring;
}

// With an IOTLB the ring parts may not be translated yet: the misses are
// reported and the queue starts when they are answered.
bool QueueDevice::rings_translated(const Queue& q) const {
  const RingLayout l = (features_ & kRingPacked) ? packed_layout(q.size) : split_layout(q.size);
  bool ok = true;
  for (auto [addr, len, write] :
       {std::tuple{q.rings.desc, l.desc_bytes, false}, std::tuple{q.rings.driver, l.driver_bytes, false},
        std::tuple{q.rings.device, l.device_bytes, true}})
    if (!memory_->translate(addr, len, write) && memory_->iotlb_miss(addr, len, write)) ok = false;
  return ok;
}

void QueueDevice::prepare_worker(Worker& w) {
  w.stop.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  w.poke.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!w.stop || !w.poke) throw_errno(name_ + ": worker setup");
}

void QueueDevice::launch(std::unique_ptr<Worker> w, std::function<void()> body, const std::string& thread_name,
                         int cpu) {
  Worker* raw = w.get();
  w->thread = std::thread([raw, body = std::move(body)] {
    body();
    {
      std::lock_guard lock(raw->exit_mutex);
      raw->exited = true;
    }
    raw->exit_cv.notify_all();
  });
  pthread_setname_np(w->thread.native_handle(), thread_name.c_str());
  const unsigned group = w->group;
  workers_.push_back(std::move(w));
  if (cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (int rc = pthread_setaffinity_np(workers_.back()->thread.native_handle(), sizeof set, &set); rc != 0) {
      stop();
      throw SystemError(
          rc, name_ + ": pinning the worker of queue pair " + std::to_string(group) + " to CPU " + std::to_string(cpu));
    }
  }
}

void QueueDevice::wait_for_workers() {
  if (!wedged_) return;
  spdlog::critical("{}: waiting for its stuck worker before what it uses is freed", name_);
  for (auto& w : workers_) w->thread.join();
  workers_.clear();
  wedged_ = false;
  for (Queue& queue : queues_) queue.ring.reset();
}

// Tells every worker to stop and waits for each until `limit` has passed.
// A worker is never stuck on a peer (its fds are non-blocking, its passes
// have a budget, peer memory is refused on filesystems that page in from a
// process or the network), so one that does not come out is a fault of
// the daemon: the device is broken and wedged - it keeps the rings and
// everything else the worker may still touch, serves nothing, and the
// caller goes on; reap() finishes the stop once the worker is out.
bool QueueDevice::stop_within(std::chrono::milliseconds limit) {
  if (wedged_) limit = std::chrono::milliseconds(0);  // waited once already: only look
  for (auto& w : workers_) {
    own_eventfd_signal(w->stop.get());
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::vector<std::unique_ptr<Worker>> stuck;
  for (auto& w : workers_) {
    {
      std::unique_lock lock(w->exit_mutex);
      if (!w->exit_cv.wait_until(lock, deadline, [&] { return w->exited; })) {
        stuck.push_back(std::move(w));
        continue;
      }
    }
    w->thread.join();
  }
  workers_ = std::move(stuck);
  if (!workers_.empty()) {
    if (!wedged_)
      spdlog::error(
          "{}: the worker of queue pair {} did not stop within {} ms: the device is out of service until it does",
          name_, workers_.front()->group, kStopDeadline.count());
    wedged_ = true;
    broken_ = true;
    return false;
  }
  if (wedged_) spdlog::warn("{}: its worker stopped at last", name_);
  wedged_ = false;
  // Only queues a worker served have a ring: each keeps where it stood.
  for (Queue& queue : queues_) {
    if (queue.ring) {
      queue.ring->publish_used();  // every pass publishes its burst; this only makes sure
      queue.base = queue.ring->base();
    }
    queue.ring.reset();
  }
  return true;
}

void QueueDevice::reset() {
  stop();
  if (wedged_) return;  // its worker may still use all of it
  for (Queue& queue : queues_) {
    queue.size = 0;
    queue.rings_set = false;
    queue.base = 0;
    queue.kick.reset();
    queue.enabled = false;
    queue.log.reset();
  }
  features_ = 0;
  memory_ = nullptr;
  inflight_ = nullptr;
  inflight_queues_ = inflight_queue_size_ = 0;
  broken_ = false;
  reset_device();
}

void QueueDevice::kick_all() {
  for (auto& w : workers_) own_eventfd_signal(w->poke.get());
}

void QueueDevice::poke(unsigned group) {
  for (auto& w : workers_)
    if (w->group == group) own_eventfd_signal(w->poke.get());
}

void QueueDevice::fail_device(const std::string& why) {
  if (!broken_.exchange(true)) spdlog::error("{}: {}; the device needs a reset", name_, why);
}

void QueueDevice::fail_queue(unsigned index, const Queue& q) {
  fail_device("queue " + std::to_string(index) + ": " + to_string(q.ring->error()));
}

// A kick's count read back (the driver shares the eventfd: a read it made
// blocking is cut short by the peer I/O watchdog).
bool QueueDevice::take_kick(unsigned q) {
  uint64_t count = 0;
  if (!peer_eventfd_read(queues_[q].kick.get(), count) && errno == EINTR) {
    fail_device("queue " + std::to_string(q) + ": the driver made its kick eventfd blocking");
    return false;
  }
  queues_[q].stats->kicks.fetch_add(1, std::memory_order_relaxed);
  return true;
}

DeviceState QueueDevice::save_state() {
  stop();
  if (wedged_) throw std::logic_error(name_ + ": a worker did not stop; its state cannot be saved");
  DeviceState s;
  s.device_id = device_id();
  s.features = features_;
  for (const Queue& q : queues_) s.queues.push_back({q.size, q.enabled, q.rings_set, q.rings, q.base});
  s.device = save_device();
  s.device_version = device_state_version();
  return s;
}

void QueueDevice::restore_state(const DeviceState& s) {
  const std::string what = name_ + ": restoring a device state";
  if (running()) throw std::logic_error(what + " into a running device");
  if (s.device_id != device_id())
    throw std::invalid_argument(what + ": device id " + std::to_string(s.device_id) + ", this device is " +
                                std::to_string(device_id()));
  if (s.queues.size() != queues_.size())
    throw std::invalid_argument(what + ": " + std::to_string(s.queues.size()) + " queues, this device has " +
                                std::to_string(queues_.size()));
  if (s.features & ~offered_features())
    throw std::invalid_argument(what + ": features " + hex(s.features & ~offered_features()) +
                                " this device does not offer");
  for (size_t i = 0; i < s.queues.size(); ++i)
    if (s.queues[i].size > max_queue_size_)
      throw std::invalid_argument(what + ": queue " + std::to_string(i) + " size " + std::to_string(s.queues[i].size) +
                                  " (at most " + std::to_string(max_queue_size_) + ")");
  if (s.device_version != device_state_version())
    throw std::invalid_argument(what + ": its device part is version " + std::to_string(s.device_version) +
                                ", this sriovd's device reads version " + std::to_string(device_state_version()));
  restore_device(s.device);  // first: it throws before anything changed
  set_features(s.features);
  for (size_t i = 0; i < s.queues.size(); ++i) {
    Queue& q = queues_[i];
    const QueueState& qs = s.queues[i];
    q.size = qs.size;
    q.rings = qs.rings;
    q.rings_set = qs.rings_set;
    q.base = qs.base;
    q.enabled = qs.enabled;
    queue_enabled_changed(static_cast<unsigned>(i));
  }
}

DeviceStats QueueDevice::stats() const {
  DeviceStats s;
  for (const Queue& q : queues_) {
    const QueueStats& a = *q.stats;
    constexpr auto r = std::memory_order_relaxed;
    s.queues.push_back({a.packets.load(r), a.bytes.load(r), a.dropped.load(r), a.kicks.load(r), a.notifies.load(r),
                        a.resubmitted.load(r), a.sw_offload.load(r)});
  }
  add_device_stats(s);
  return s;
}

}  // namespace sriovd::virtio
