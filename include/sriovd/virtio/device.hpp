#pragma once
// The virtio device interface (virtio 1.2 §2 and §5): what a transport - the
// vhost-user back-end, virtio-pci over vfio-user - needs of a device,
// whatever its type. The transport owns the wiring (guest memory, kick fds,
// the interrupt route of each queue, an inflight buffer) and hands it in;
// the device owns features, its configuration space, its queues' state and
// the workers that serve them.
//
// QueueDevice is the part every device type shares: the per-queue registers
// a transport sets, rings made from them, workers started, stopped with a
// deadline (wedged when one does not come out), reset, and the device's
// state saved and restored. A device type (virtio::NetDevice) adds its
// features, its configuration, what a queue's buffers mean and which queues
// one worker serves.

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "sriovd/irq/engine.hpp"
#include "sriovd/util/counters.hpp"
#include "sriovd/util/fd.hpp"
#include "sriovd/virtio/guest_memory.hpp"
#include "sriovd/virtio/ring.hpp"

namespace sriovd::virtio {

// Device ids (§5) and the PCI class code a virtio-pci function of that type
// carries (class, subclass, programming interface).
inline constexpr uint16_t kDeviceIdNet = 1;
inline constexpr uint32_t kPciClassEthernet = 0x020000;

// Reserved feature bits, every device type's (§6).
inline constexpr uint64_t kRingIndirectDesc = 1ULL << 28U;
inline constexpr uint64_t kRingEventIdx = 1ULL << 29U;
inline constexpr uint64_t kVersion1 = 1ULL << 32U;
inline constexpr uint64_t kAccessPlatform = 1ULL << 33U;  // VIRTIO_F_ACCESS_PLATFORM (IOMMU_PLATFORM)
inline constexpr uint64_t kRingPacked = 1ULL << 34U;
inline constexpr uint64_t kInOrder = 1ULL << 35U;  // VIRTIO_F_IN_ORDER

// One queue as the transport set it up, and where the device stands in it.
struct QueueState {
  uint16_t size = 0;
  bool enabled = false;
  bool rings_set = false;
  RingAddresses rings{};
  // The next available index the device will read: split, the avail
  // index; packed, the index with the wrap counter in bit 15 (as
  // GET_VRING_BASE and SET_VRING_BASE carry it).
  uint32_t base = 0;
  friend bool operator==(const QueueState&, const QueueState&) = default;
};

// A device's whole state in one versioned, serialisable form: what a
// device saved while stopped and a fresh one restores, for live migration
// and upgrades. What is not state is wiring the transport gives again:
// guest memory, kick fds, interrupt routes, the port.
//
// Each part has its version: the device type's and the transport's own
// bytes change with their code, not with this frame's, and each refuses a
// version it does not read. Version 2 of the frame ends with a CRC-32 of
// everything before it (a state crosses hosts and processes: a flipped bit
// is refused, not restored); version 1 (no part versions, no checksum:
// what sriovd wrote before) is still read, its parts as their version 1.
struct DeviceState {
  static constexpr uint32_t kVersion = 2;
  static constexpr uint32_t kOldestRead = 1;
  uint16_t device_id = 0;
  uint64_t features = 0;
  std::vector<QueueState> queues;
  std::vector<uint8_t> device;  // the device type's own (virtio-net: MAC, RX filter, pairs, held packets)
  uint32_t device_version = 1;
  std::vector<uint8_t> transport;  // the transport's (virtio-pci: common configuration, MSI-X table and PBA)
  uint32_t transport_version = 1;

  [[nodiscard]] std::vector<uint8_t> serialize() const;
  // Throws std::invalid_argument naming what is wrong (`what` first): the
  // bytes may come from another host.
  static DeviceState parse(std::span<const uint8_t> bytes, const std::string& what);
  // The CRC-32 (IEEE) a version-2 state ends with, of `bytes`.
  static uint32_t checksum(std::span<const uint8_t> bytes);
  friend bool operator==(const DeviceState&, const DeviceState&) = default;
};

// A little-endian byte writer and a bounds-checked reader for the parts of
// DeviceState (device and transport blobs use them too).
class StateWriter {
 public:
  void u8(uint8_t v) { bytes_.push_back(v); }
  void u16(uint16_t v) { put(v, 2); }
  void u32(uint32_t v) { put(v, 4); }
  void u64(uint64_t v) { put(v, 8); }
  void blob(std::span<const uint8_t> b);  // u32 length, then the bytes
  std::vector<uint8_t> take() { return std::move(bytes_); }

 private:
  void put(uint64_t v, unsigned n) {
    for (unsigned i = 0; i < n; ++i) bytes_.push_back(static_cast<uint8_t>(v >> (8U * i)));
  }
  std::vector<uint8_t> bytes_;
};
class StateReader {
 public:
  StateReader(std::span<const uint8_t> b, std::string what) : b_(b), what_(std::move(what)) {}
  uint8_t u8() { return static_cast<uint8_t>(get(1)); }
  uint16_t u16() { return static_cast<uint16_t>(get(2)); }
  uint32_t u32() { return static_cast<uint32_t>(get(4)); }
  uint64_t u64() { return get(8); }
  std::vector<uint8_t> blob(size_t max);
  // Throws unless every byte was read.
  void end() const;
  [[noreturn]] void fail(const std::string& why) const;

 private:
  uint64_t get(unsigned n);
  std::span<const uint8_t> b_;
  size_t at_ = 0;
  std::string what_;
};

// A queue's counters (atomics the workers add to, relaxed).
struct QueueStats {
  std::atomic<uint64_t> packets{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> dropped{0};  // no room, truncated, or a port error
  std::atomic<uint64_t> kicks{0};
  std::atomic<uint64_t> notifies{0};
  std::atomic<uint64_t> resubmitted{0};  // buffers a previous back-end left in flight, handed out again
  std::atomic<uint64_t> sw_offload{0};   // RX packets segmented or checksummed in software for the driver
};

// The same, read once: what sriovctl and Prometheus show, by field.
struct QueueCounters {
  uint64_t packets = 0, bytes = 0, dropped = 0, kicks = 0, notifies = 0, resubmitted = 0, sw_offload = 0;
};
inline constexpr Counter<QueueCounters> kQueueCounters[] = {
    {"packets", "packets through the queue", &QueueCounters::packets},
    {"bytes", "bytes through the queue", &QueueCounters::bytes},
    {"dropped", "packets dropped (no room, truncated, or a port error)", &QueueCounters::dropped},
    {"kicks", "driver notifications taken", &QueueCounters::kicks},
    {"notifies", "used-buffer notifications sent", &QueueCounters::notifies},
    {"sw_offload", "RX packets segmented or checksummed in software for the driver", &QueueCounters::sw_offload},
    {"resubmitted", "buffers a previous back-end left in flight, handed out again", &QueueCounters::resubmitted},
};
struct DeviceStats {
  std::vector<QueueCounters> queues;
  uint64_t filtered = 0;  // frames the driver's RX filter kept out (virtio-net)
};

// What announce() did.
enum class Announcement {
  sent,
  no_wire,      // the device type has no wire
  not_its_mac,  // not the device's MAC: nothing sent
};

class Device {
 public:
  virtual ~Device() = default;

  // --- identity ---
  [[nodiscard]] virtual uint16_t device_id() const = 0;
  [[nodiscard]] virtual uint32_t pci_class() const = 0;
  [[nodiscard]] virtual const std::string& name() const = 0;
  [[nodiscard]] virtual unsigned num_queues() const = 0;
  [[nodiscard]] virtual uint16_t max_queue_size() const = 0;
  // The queues a front-end counts as one (vhost-user GET_QUEUE_NUM;
  // virtio-net: a queue pair).
  [[nodiscard]] virtual unsigned queue_groups() const { return num_queues(); }

  // --- features (§2.2) and the configuration space (§2.5) ---
  [[nodiscard]] virtual uint64_t offered_features() const = 0;
  virtual void set_features(uint64_t features) = 0;
  [[nodiscard]] virtual uint64_t features() const = 0;
  [[nodiscard]] virtual size_t config_size() const = 0;
  virtual void read_config(uint32_t offset, uint8_t* out, size_t size) const = 0;
  // A driver's write into the configuration space: whether the type took
  // it (false where it has no writable field there - a transport that can
  // say so, vhost-user's SET_CONFIG, answers it as refused).
  virtual bool write_config(uint32_t offset, const uint8_t* data, size_t size) = 0;

  // --- queue set-up by the transport (device stopped) ---
  virtual void set_memory(GuestMemory* memory) = 0;
  virtual void set_queue_size(unsigned q, uint16_t size) = 0;
  virtual void set_queue_rings(unsigned q, const RingAddresses& rings) = 0;
  virtual void set_queue_base(unsigned q, uint32_t base) = 0;
  virtual void set_queue_kick(unsigned q, UniqueFd kick) = 0;
  virtual void set_queue_enabled(unsigned q, bool enabled) = 0;
  // The route queue q's used-buffer notifications trigger (nullopt: none).
  virtual void set_queue_interrupt(unsigned q, std::optional<irq::RouteId> route) = 0;
  // vhost-user INFLIGHT_SHMFD: one region per queue for [0, queues); null: none.
  virtual void set_inflight(uint8_t* base, uint16_t queues, uint16_t queue_size) = 0;
  // Whether queue q's ring marks its own writes in the memory's dirty log
  // (vhost-user VHOST_VRING_F_LOG), and at which guest address of its
  // device area (log_guest_addr; RingLog::kByHost: by host pointer).
  // nullopt: the ring logs nothing. Buffers are logged whenever the
  // memory has a log (GuestMemory::set_dirty_log).
  virtual void set_queue_log(unsigned q, std::optional<uint64_t> device_area) = 0;
  // Stops the queue and returns where it stood (GET_VRING_BASE).
  virtual uint32_t stop_queue(unsigned q) = 0;

  // --- activation ---
  virtual void start() = 0;
  virtual void stop() = 0;
  virtual bool reap() = 0;
  virtual void wait_for_workers() = 0;
  virtual void reset() = 0;
  virtual void kick(unsigned q) = 0;
  virtual void kick_all() = 0;
  [[nodiscard]] virtual bool running() const = 0;
  [[nodiscard]] virtual bool broken() const = 0;
  [[nodiscard]] virtual bool wedged() const = 0;
  [[nodiscard]] virtual bool waiting_for_translations() const = 0;

  // Live migration's last step on the destination: tells the network
  // where the guest with this MAC is now (virtio-net: a RARP on the wire,
  // vhost-user SEND_RARP). Only for the device's own MAC: a front-end must
  // not move another guest's traffic here.
  virtual Announcement announce(const std::array<uint8_t, 6>& /*mac*/) { return Announcement::no_wire; }
  // The same for a device restored on the destination whose transport is
  // the whole device (virtio-pci): virtio-net asks its driver to announce
  // itself when it negotiated VIRTIO_NET_F_GUEST_ANNOUNCE - true: the
  // transport signals a configuration change - and else sends a RARP for
  // its MAC itself.
  virtual bool announce_restored() { return false; }

  // --- state and counters ---
  // The device's state (it stops first); `restore_state` into a device of
  // the same type and shape, reset and stopped, before the transport wires
  // it and starts it. Throws std::invalid_argument on a state that does not
  // fit (another type, another number of queues, a queue too large).
  [[nodiscard]] virtual DeviceState save_state() = 0;
  virtual void restore_state(const DeviceState& state) = 0;
  [[nodiscard]] virtual DeviceStats stats() const = 0;
};

// The queue registers and worker lifecycle every device type shares.
class QueueDevice : public Device {
 public:
  static constexpr std::chrono::milliseconds kStopDeadline{2000};

  QueueDevice(std::string name, unsigned num_queues, uint16_t max_queue_size, irq::Engine& engine);
  ~QueueDevice() override;
  QueueDevice(const QueueDevice&) = delete;
  QueueDevice& operator=(const QueueDevice&) = delete;

  [[nodiscard]] const std::string& name() const override { return name_; }
  [[nodiscard]] unsigned num_queues() const override { return static_cast<unsigned>(queues_.size()); }
  [[nodiscard]] uint16_t max_queue_size() const override { return max_queue_size_; }
  [[nodiscard]] uint64_t features() const override { return features_; }
  bool write_config(uint32_t, const uint8_t*, size_t) override { return false; }

  void set_memory(GuestMemory* memory) override { memory_ = memory; }
  void set_queue_size(unsigned q, uint16_t size) override;
  void set_queue_rings(unsigned q, const RingAddresses& rings) override;
  void set_queue_base(unsigned q, uint32_t base) override { queues_.at(q).base = base; }
  void set_queue_kick(unsigned q, UniqueFd kick) override { queues_.at(q).kick = std::move(kick); }
  void set_queue_enabled(unsigned q, bool enabled) override;
  void set_queue_interrupt(unsigned q, std::optional<irq::RouteId> route) override;
  void set_inflight(uint8_t* base, uint16_t queues, uint16_t queue_size) override;
  void set_queue_log(unsigned q, std::optional<uint64_t> device_area) override { queues_.at(q).log = device_area; }
  uint32_t stop_queue(unsigned q) override;

  // Stops every worker, waiting at most kStopDeadline for each: a worker
  // that does not come out leaves the device broken and wedged - it keeps
  // everything the worker may still touch (rings, memory, the inflight
  // buffer: its owner must keep what it lent, too), starts nothing and
  // resets nothing. reap() joins what has come out since, without waiting;
  // true when none is left. wait_for_workers(): for an owner about to free
  // what it lent, waits for a wedged device's workers without a deadline.
  void stop() override { (void)stop_within(kStopDeadline); }
  bool reap() override { return stop_within(std::chrono::milliseconds(0)); }
  void wait_for_workers() override;
  // Everything back to the state before negotiation.
  void reset() override;
  void kick_all() override;
  [[nodiscard]] bool running() const override { return !workers_.empty(); }
  [[nodiscard]] bool broken() const override { return broken_.load(); }
  [[nodiscard]] bool wedged() const override { return wedged_; }
  [[nodiscard]] bool waiting_for_translations() const override { return waiting_rings_; }

  DeviceState save_state() override;
  void restore_state(const DeviceState& state) override;
  DeviceStats stats() const override;
  [[nodiscard]] const QueueStats& stats(unsigned q) const { return *queues_.at(q).stats; }

 protected:
  struct Queue {
    uint16_t size = 0;
    RingAddresses rings{};
    bool rings_set = false;
    uint32_t base = 0;
    UniqueFd kick;
    bool enabled = false;
    std::unique_ptr<Virtqueue> ring;
    std::optional<irq::RouteId> interrupt;  // what notify() triggers
    std::optional<uint64_t> log;            // set_queue_log
    std::unique_ptr<QueueStats> stats = std::make_unique<QueueStats>();
  };
  // One thread serving a group of queues; a device type derives its own.
  struct Worker {
    virtual ~Worker() = default;
    unsigned group = 0;  // virtio-net: the queue pair
    UniqueFd stop;       // written by stop(): the worker returns
    // The daemon's own wake-up ("look at the rings"): the control thread
    // never writes a kick eventfd, which the driver shares and can make
    // blocking.
    UniqueFd poke;
    std::thread thread;
    // Set by the thread as its last act, so stop() can wait with a deadline.
    std::mutex exit_mutex;
    std::condition_variable exit_cv;
    bool exited = false;
  };

  [[nodiscard]] bool queue_ready(const Queue& q) const;
  // Queue q's ring from its registers, the negotiated features and the
  // inflight region (throws when the ring is larger than that region).
  std::unique_ptr<Virtqueue> make_ring(unsigned index);
  // Ring parts an IOTLB has not translated yet are reported as misses; false then.
  [[nodiscard]] bool rings_translated(const Queue& q) const;
  // Makes w's stop and poke eventfds (before the worker's epoll set is built).
  void prepare_worker(Worker& w);
  // Runs body on a thread named `thread_name`, pinned to `cpu` (>= 0), and keeps w.
  void launch(std::unique_ptr<Worker> w, std::function<void()> body, const std::string& thread_name, int cpu);
  // The worker of group g looks at its rings.
  void poke(unsigned group);
  // The end of a burst: its used buffers published at once, then the
  // driver interrupted if it asked to be.
  void notify(Queue& q) {
    q.ring->publish_used();
    if (const DirtyLog* log = memory_->dirty_log()) log->published();
    if (q.ring->should_notify() && q.interrupt) {
      engine_.trigger(*q.interrupt);
      q.stats->notifies.fetch_add(1, std::memory_order_relaxed);
    }
  }
  // A kick's count read back; false: the driver made the eventfd blocking
  // and the device stops (NEEDS_RESET).
  bool take_kick(unsigned q);
  // A worker found the device unusable (NEEDS_RESET): said once, with why.
  void fail_device(const std::string& why);
  void fail_queue(unsigned index, const Queue& q);

  // What a device type adds: a queue enabled or stopped (the pairs a
  // virtio-net port steers to), the type's own state reset, saved, restored.
  virtual void queue_enabled_changed(unsigned /*q*/) {}
  virtual void reset_device() {}
  [[nodiscard]] virtual std::vector<uint8_t> save_device() const { return {}; }
  // The version of what save_device writes (and restore_device reads):
  // raised when its bytes change.
  [[nodiscard]] virtual uint32_t device_state_version() const { return 1; }
  virtual void restore_device(std::span<const uint8_t> /*bytes*/) {}
  virtual void add_device_stats(DeviceStats& /*s*/) const {}

  irq::Engine& engine_;
  GuestMemory* memory_ = nullptr;
  uint64_t features_ = 0;
  std::vector<Queue> queues_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::atomic<bool> broken_{false};
  bool wedged_ = false;
  bool waiting_rings_ = false;

 private:
  bool stop_within(std::chrono::milliseconds limit);

  std::string name_;
  uint16_t max_queue_size_;
  uint8_t* inflight_ = nullptr;
  uint16_t inflight_queues_ = 0;
  uint16_t inflight_queue_size_ = 0;
};

}  // namespace sriovd::virtio
