#pragma once
// The virtio-net device model (virtio 1.2 §5.1), transport-agnostic: a
// transport (the vhost-user back-end, or virtio-pci over vfio-user) hands
// it guest memory, rings, kick fds and, per queue, the route of the shared
// routing engine that its used-buffer notifications trigger; the transport
// made that route (vhost-user: one per queue whose sink is the call
// eventfd; virtio-pci: the MSI-X vector the driver chose) and the device
// knows nothing of either. It moves packets between the rings and a packet
// port (a tap, a VF's netdev through a packet socket, or a macvtap).
//
// Data plane: one worker thread per queue pair, epoll on the pair's kick
// fds and tap fd. TX hands the guest's chain (virtio-net header first) to
// the tap with one writev; RX reads a packet and copies it into as many
// buffers as it needs (mergeable rx buffers), setting num_buffers before the
// buffers are published. No allocation, lock or log per packet: counters.

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "sriovd/irq/engine.hpp"
#include "sriovd/util/pci_address.hpp"
#include "sriovd/virtio/guest_memory.hpp"
#include "sriovd/virtio/ring.hpp"
#include "sriovd/virtio/port.hpp"

namespace sriovd::virtio {

// Feature bits (virtio 1.2 §5.1.3, §6).
inline constexpr uint64_t kNetCsum = 1ULL << 0U;
inline constexpr uint64_t kNetGuestCsum = 1ULL << 1U;
inline constexpr uint64_t kNetMtu = 1ULL << 3U;
inline constexpr uint64_t kNetMac = 1ULL << 5U;
inline constexpr uint64_t kNetGuestTso4 = 1ULL << 7U;
inline constexpr uint64_t kNetGuestTso6 = 1ULL << 8U;
inline constexpr uint64_t kNetGuestEcn = 1ULL << 9U;
inline constexpr uint64_t kNetGuestUfo = 1ULL << 10U;
inline constexpr uint64_t kNetHostTso4 = 1ULL << 11U;
inline constexpr uint64_t kNetHostTso6 = 1ULL << 12U;
inline constexpr uint64_t kNetHostEcn = 1ULL << 13U;
inline constexpr uint64_t kNetHostUfo = 1ULL << 14U;
inline constexpr uint64_t kNetMrgRxbuf = 1ULL << 15U;
inline constexpr uint64_t kNetStatus = 1ULL << 16U;
inline constexpr uint64_t kNetCtrlVq = 1ULL << 17U;
inline constexpr uint64_t kNetCtrlRx = 1ULL << 18U;
inline constexpr uint64_t kNetMq = 1ULL << 22U;
inline constexpr uint64_t kNetCtrlMacAddr = 1ULL << 23U;
inline constexpr uint64_t kRingIndirectDesc = 1ULL << 28U;
inline constexpr uint64_t kRingEventIdx = 1ULL << 29U;
inline constexpr uint64_t kVersion1 = 1ULL << 32U;
inline constexpr uint64_t kAccessPlatform = 1ULL << 33U;  // VIRTIO_F_ACCESS_PLATFORM (IOMMU_PLATFORM)
inline constexpr uint64_t kRingPacked = 1ULL << 34U;
inline constexpr uint64_t kInOrder = 1ULL << 35U;  // VIRTIO_F_IN_ORDER

// struct virtio_net_hdr_v1 (§5.1.6).
struct NetHeader {
  uint8_t flags;
  uint8_t gso_type;
  uint16_t hdr_len;
  uint16_t gso_size;
  uint16_t csum_start;
  uint16_t csum_offset;
  uint16_t num_buffers;
};
static_assert(sizeof(NetHeader) == 12);

struct NetConfig {
  std::string name;
  std::optional<MacAddress> mac;
  uint16_t mtu = 1500;
  uint16_t queue_pairs = 1;
  uint16_t max_queue_size = 1024;
  bool packed = true;         // offer VIRTIO_F_RING_PACKED
  bool offloads = true;       // offer checksum and TSO both ways
  unsigned tap_offloads = 0;  // TUN_F_* the tap may use (config backend.offloads)
  // Serve the control virtqueue (§5.1.6.5: RX mode, MAC address and
  // filter, MQ pairs). A transport that is the whole device (virtio-pci)
  // does; over vhost-user the VMM keeps the control queue itself.
  bool control_queue = false;
  // Offer VIRTIO_F_ACCESS_PLATFORM: the transport brings an IOTLB.
  bool access_platform = false;
  // Queue pair i's worker runs on cpus[i % n]; empty: wherever the kernel puts it.
  std::vector<int> cpus;
};

// What the control queue set (§5.1.6.5); read by every RX worker.
struct RxFilter {
  static constexpr unsigned kMaxMacs = 32;
  std::atomic<bool> promisc{true};
  std::atomic<bool> allmulti{true};
  std::atomic<uint64_t> mac{0};  // the device's address, 6 bytes
  std::atomic<uint32_t> unicast_count{0}, multicast_count{0};
  std::array<std::atomic<uint64_t>, kMaxMacs> unicast{}, multicast{};
  std::atomic<bool> unicast_overflow{false}, multicast_overflow{false};
  void reset(uint64_t device_mac);
  // Does a frame with this destination reach the driver?
  [[nodiscard]] bool accepts(const uint8_t* dest) const;
};

struct QueueStats {
  std::atomic<uint64_t> packets{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> dropped{0};  // no room, truncated, or a tap error
  std::atomic<uint64_t> kicks{0};
  std::atomic<uint64_t> notifies{0};
  std::atomic<uint64_t> resubmitted{0};  // buffers a previous back-end left in flight, handed out again
  std::atomic<uint64_t> sw_offload{0};   // RX packets segmented or checksummed in software for the driver
};

class NetDevice {
 public:
  NetDevice(NetConfig config, irq::Engine& engine, std::unique_ptr<PacketPort> port);
  ~NetDevice();
  NetDevice(const NetDevice&) = delete;
  NetDevice& operator=(const NetDevice&) = delete;

  [[nodiscard]] uint64_t offered_features() const;
  // Negotiated features; turns on the tap offloads the guest can take.
  void set_features(uint64_t features);
  [[nodiscard]] uint64_t features() const { return features_; }
  [[nodiscard]] unsigned num_queues() const { return 2U * config_.queue_pairs + (config_.control_queue ? 1U : 0U); }
  // The control queue's index (the last one), when there is one.
  [[nodiscard]] unsigned control_queue_index() const { return 2U * config_.queue_pairs; }
  // The device's current MAC (the config's, or what MAC_ADDR_SET gave).
  [[nodiscard]] MacAddress mac() const;
  [[nodiscard]] unsigned active_pairs() const { return active_pairs_.load(); }
  [[nodiscard]] const RxFilter& rx_filter() const { return filter_; }
  // The link as the driver sees it (VIRTIO_NET_S_LINK_UP in the config).
  [[nodiscard]] bool link_up() const { return link_up_; }
  // Control plane, from a timer: reads the port's carrier; true when the
  // link changed, and the transport then signals a configuration change.
  bool poll_link();
  // struct virtio_net_config (§5.1.4) as this device fills it.
  static constexpr size_t kConfigBytes = 12;  // mac, status, max_virtqueue_pairs, mtu
  void read_config(uint32_t offset, uint8_t* out, size_t size) const;
  [[nodiscard]] const NetConfig& config() const { return config_; }

  // --- queue setup by the transport (device stopped) ---
  void set_memory(GuestMemory* memory) { memory_ = memory; }
  void set_queue_size(unsigned q, uint16_t size);
  void set_queue_rings(unsigned q, const RingAddresses& rings);
  void set_queue_base(unsigned q, uint32_t base);
  void set_queue_kick(unsigned q, UniqueFd kick);
  void set_queue_enabled(unsigned q, bool enabled);
  // The route queue q's used-buffer notifications trigger, the transport's
  // (nullopt, the default: none, as VIRTIO_MSI_NO_VECTOR). Kept across
  // reset(): it is the transport's wiring, not negotiated state.
  void set_queue_interrupt(unsigned q, std::optional<irq::RouteId> route);
  // vhost-user INFLIGHT_SHMFD: the shared buffer holding one region per
  // queue (inflight_queue_bytes(queue_size) each) for queues [0, queues);
  // null: no tracking. Rings larger than queue_size cannot start.
  void set_inflight(uint8_t* base, uint16_t queues, uint16_t queue_size);
  // Stops the queue and returns where it stood (GET_VRING_BASE).
  uint32_t stop_queue(unsigned q);

  // Starts workers for every pair whose two queues are ready; stops them,
  // waiting at most kStopDeadline for each: a worker that does not come
  // out leaves the device broken and wedged (below), and stop() returns.
  void start();
  void stop();
  static constexpr std::chrono::milliseconds kStopDeadline{2000};
  // A worker did not stop in time: the device keeps everything it may
  // still touch (rings, memory, the inflight buffer - its owner must keep
  // what it lent, too), starts nothing and resets nothing. reap() joins
  // what has come out since, without waiting; true when none is left.
  [[nodiscard]] bool wedged() const { return wedged_; }
  bool reap();
  // For an owner about to free what it lent the device: waits, without a
  // deadline, for a wedged device's workers (logged as critical).
  void wait_for_workers();
  // The last thing before the device is destroyed: stops it and gives up
  // its port (for the device that replaces it, or to be closed off the
  // control thread: util/retirer.hpp). Null when a worker is stuck and may
  // still use the port, which then goes with the device.
  std::unique_ptr<PacketPort> release_port();
  // Everything back to the state before negotiation.
  void reset();
  // Wakes every queue as its kick would (after an IOTLB update, so that
  // stalled rings retry).
  void kick_all();
  // A doorbell that came as a message (vfio-user REGION_WRITE): the worker
  // of queue q's pair looks at its rings.
  void kick(unsigned q);
  // Pairs that could not start because their rings are not translated
  // yet (IOTLB misses reported).
  [[nodiscard]] bool waiting_for_translations() const { return waiting_rings_; }
  [[nodiscard]] bool running() const { return !workers_.empty(); }
  [[nodiscard]] bool broken() const { return broken_.load(); }

  [[nodiscard]] const QueueStats& stats(unsigned q) const { return *queues_.at(q).stats; }
  [[nodiscard]] const PacketPort& port() const { return *tap_; }

 private:
  struct Queue {
    uint16_t size = 0;
    RingAddresses rings{};
    bool rings_set = false;
    uint32_t base = 0;
    UniqueFd kick;
    bool enabled = false;
    std::unique_ptr<Virtqueue> ring;
    std::optional<irq::RouteId> interrupt;  // what notify() triggers
    std::unique_ptr<QueueStats> stats = std::make_unique<QueueStats>();
  };
  struct Worker;
  struct RxHold;

  [[nodiscard]] bool queue_ready(const Queue& q) const;
  std::unique_ptr<Virtqueue> make_ring(unsigned index);
  void run_pair(Worker& w);
  bool do_tx(Worker& w);
  void watch_port(Worker& w);
  bool do_rx(Worker& w);
  enum class RxTake { packet, skipped, none };  // a packet in hand; one dropped or filtered; the port has none
  // do_rx's per-packet parts, inlined into it as they were written there.
  [[gnu::always_inline]] inline RxTake take_rx_packet(Worker& w, Queue& q);
  [[gnu::always_inline]] inline void deliver_rx(Worker& w, Queue& q, unsigned used);
  void do_ctrl(Worker& w);
  uint8_t control_command(uint8_t cls, uint8_t cmd, const uint8_t* data, size_t len);
  void notify(Queue& q);
  void fail_device(const std::string& why);
  bool take_kick(unsigned q);
  void fail_queue(unsigned index, const Queue& q);

  NetConfig config_;
  irq::Engine& engine_;
  std::unique_ptr<PacketPort> tap_;
  GuestMemory* memory_ = nullptr;
  uint64_t features_ = 0;
  std::vector<Queue> queues_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<std::unique_ptr<RxHold>> rx_hold_;
  std::atomic<bool> broken_{false};
  bool wedged_ = false;
  bool stop_within(std::chrono::milliseconds limit);
  bool waiting_rings_ = false;
  RxFilter filter_;
  std::atomic<unsigned> active_pairs_{1};
  // The port queues that get received traffic: the pairs the driver uses.
  // With the device's own control queue that is its MQ setting (one pair
  // until VQ_PAIRS_SET, §5.1.6.5.5); over vhost-user the VMM's control queue
  // is its own, and the pairs in use are those whose RX vring it enabled.
  // False when the port refused.
  bool steer_port();
  std::mutex steer_mutex_;
  unsigned steered_pairs_ = 0;  // what the port was last told (0: nothing yet)
  bool link_up_ = true;
  std::atomic<uint64_t> filtered_{0};
  uint8_t* inflight_ = nullptr;
  uint16_t inflight_queues_ = 0;
  uint16_t inflight_queue_size_ = 0;
};

}  // namespace sriovd::virtio
