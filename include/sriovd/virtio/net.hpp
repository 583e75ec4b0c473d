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
#include "sriovd/virtio/device.hpp"
#include "sriovd/virtio/guest_memory.hpp"
#include "sriovd/virtio/port.hpp"
#include "sriovd/virtio/ring.hpp"

namespace sriovd::virtio {

// virtio-net feature bits (virtio 1.2 §5.1.3; the reserved ones, §6, in device.hpp).
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
inline constexpr uint64_t kNetGuestAnnounce = 1ULL << 21U;
inline constexpr uint64_t kNetMq = 1ULL << 22U;
inline constexpr uint64_t kNetCtrlMacAddr = 1ULL << 23U;

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
  // Without control_queue: the driver's side has one (a vhost-user
  // front-end: MQ and GUEST_ANNOUNCE are offered) or there is none at all
  // (VDUSE: neither is).
  bool front_end_control = true;
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

class NetDevice : public QueueDevice {
 public:
  NetDevice(NetConfig config, irq::Engine& engine, std::unique_ptr<PacketPort> port);
  ~NetDevice() override;

  [[nodiscard]] uint16_t device_id() const override { return kDeviceIdNet; }
  [[nodiscard]] uint32_t pci_class() const override { return kPciClassEthernet; }
  [[nodiscard]] unsigned queue_groups() const override { return config_.queue_pairs; }
  [[nodiscard]] uint64_t offered_features() const override;
  // Negotiated features; turns on the tap offloads the guest can take.
  void set_features(uint64_t features) override;
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
  [[nodiscard]] size_t config_size() const override { return kConfigBytes; }
  void read_config(uint32_t offset, uint8_t* out, size_t size) const override;
  [[nodiscard]] const NetConfig& config() const { return config_; }

  // Starts workers for every pair whose two queues are ready (each pair's
  // worker also serves the control queue when it is pair 0).
  void start() override;
  // A doorbell that came as a message (vfio-user REGION_WRITE): the worker
  // of queue q's pair looks at its rings.
  void kick(unsigned q) override;
  // The last thing before the device is destroyed: stops it and gives up
  // its port (for the device that replaces it, or to be closed off the
  // control thread: util/retirer.hpp). Null when a worker is stuck and may
  // still use the port, which then goes with the device.
  std::unique_ptr<PacketPort> release_port();
  [[nodiscard]] const PacketPort& port() const { return *port_; }
  [[nodiscard]] PacketPort& port() { return *port_; }
  // A RARP for `mac` on the wire (RFC 903: the guest is here now), sent by
  // the first pair's worker - the port's queue is its - when it next runs.
  // Only for the device's MAC: the configured one or the one its driver
  // set; a device given none takes the first unicast MAC announced since
  // its reset as its own (a VMM's NIC property), and refuses any other.
  Announcement announce(const std::array<uint8_t, 6>& mac) override;
  bool announce_restored() override;

 protected:
  void queue_enabled_changed(unsigned q) override;
  void reset_device() override;
  // MAC, RX mode and filter tables, MQ pairs, and each pair's received
  // packet that was waiting for buffers.
  [[nodiscard]] std::vector<uint8_t> save_device() const override;
  void restore_device(std::span<const uint8_t> bytes) override;
  void add_device_stats(DeviceStats& s) const override { s.filtered = filtered_.load(std::memory_order_relaxed); }

 private:
  struct Worker;
  struct RxHold;

  void run_pair(Worker& w);
  bool do_tx(Worker& w);
  void watch_port(Worker& w);
  bool do_rx(Worker& w);
  enum class RxTake { packet, skipped, none };  // a packet in hand; one dropped or filtered; the port has none
  // do_rx's per-packet parts, inlined into it as they were written there.
  [[gnu::always_inline]] inline RxTake take_rx_packet(Worker& w, Queue& q);
  [[gnu::always_inline]] inline void deliver_rx(Worker& w, Queue& q, unsigned used);
  void do_ctrl(Worker& w);
  void send_announcement(Worker& w);
  uint8_t control_command(uint8_t cls, uint8_t cmd, const uint8_t* data, size_t len);

  NetConfig config_;
  std::unique_ptr<PacketPort> port_;
  std::vector<std::unique_ptr<RxHold>> rx_hold_;
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
  // announce(): the frame (virtio-net header first) the first pair's
  // worker sends when it sees announce_pending_.
  std::mutex announce_mutex_;
  uint64_t announced_mac_ = 0;  // the MAC first announced since the reset (a device given none)
  std::array<uint8_t, 12 + 60> announcement_{};
  std::atomic<bool> announce_pending_{false};
  // VIRTIO_NET_S_ANNOUNCE: set by announce_restored(), cleared by the
  // driver's VIRTIO_NET_CTRL_ANNOUNCE_ACK (§5.1.6.5.4).
  std::atomic<bool> announce_status_{false};
};

}  // namespace sriovd::virtio
