#pragma once
// The VF-to-virtio bridge through AF_XDP (`backend.via: af_xdp`): one XDP
// socket per queue of the VF's netdev, each bound to that queue, with its
// own UMEM; sriovd's XDP program (ports/bpf/xsk_redirect.bpf.c) sends each
// queue's frames to its socket. Frames move through rings shared with the
// kernel in batches: no system call per received frame, one per transmitted
// batch (copy mode) or none while the driver runs (zero-copy, need_wakeup).
//
// The kernel picks zero-copy where the driver offers it and copy mode
// otherwise; mode() says which. AF_XDP carries no checksum or GSO metadata:
// a device over this port offers no checksum or TSO offload, and a frame
// the driver still asks a checksum for is completed here.
//
// MQ steering: the netdev's RX queue of a frame is the NIC's choice (RSS),
// not the driver's MQ setting, and a socket only receives its own queue's
// frames. So there is a socket on every RX queue of the netdev, and with n
// pairs active, pair q's reader takes the frames of queues q, q+n, q+2n, ...: fd(q) is an epoll set of those
// sockets, and each socket's receive side has one reader at a time (a
// claim taken on the first recv() of a pass and given back in rx_done()).
//
// The program is host state that outlives the process: its owner map says
// "sriovd:<instance> <device>", so a program left by a daemon that crashed
// is found by it and detached - when the device is served again, or by
// remove_left_over() at start. Another program on the netdev (another
// instance's, or not sriovd's) is an error naming it, never replaced.
// Nothing is pinned: no bpffs is needed.

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/virtio/port.hpp"

namespace sriovd::ports {

enum class XdpMode : uint8_t { zero_copy, copy };
const char* to_string(XdpMode);

class XdpSocket : public virtio::PacketPort {
 public:
  static constexpr unsigned kMaxQueues = 64;  // the program's socket map
  // Attaches the program (native XDP) to `ifname` and binds a socket to
  // each of its RX queues (at least `queues`, the device's pairs; socket k
  // feeds pair k % active). `ring_size` entries in each of the
  // four rings of a socket; its UMEM holds 2 x ring_size frames (receive:
  // one per fill-ring entry; transmit: one per TX entry, and as many again
  // waiting for completion). Throws with the reason when XDP cannot attach
  // (no native XDP in the driver, an MTU too large for one frame, the
  // kernel's refusal, a program already there) or a socket cannot bind;
  // nothing is left behind then.
  XdpSocket(const std::string& ifname, unsigned queues, unsigned mtu, const std::string& instance,
            const std::string& device, uint32_t ring_size = 2048);
  ~XdpSocket() override;
  XdpSocket(const XdpSocket&) = delete;
  XdpSocket& operator=(const XdpSocket&) = delete;

  [[nodiscard]] const std::string& name() const override { return name_; }
  // The device's queue pairs; the sockets are one per RX queue of the
  // netdev, which may be more.
  [[nodiscard]] unsigned queues() const override { return pairs_; }
  [[nodiscard]] unsigned sockets() const { return static_cast<unsigned>(queues_.size()); }
  [[nodiscard]] int fd(unsigned q) const override;
  ssize_t send(unsigned q, const iovec* iov, int count) override;
  void flush(unsigned q) override;
  ssize_t recv(unsigned q, uint8_t* buf, size_t size) override;
  void rx_done(unsigned q) override;
  void set_offloads(unsigned) override {}
  void set_active_queues(unsigned n) override;
  [[nodiscard]] int room_fd(unsigned q) const override;
  [[nodiscard]] bool link_up() const override;

  [[nodiscard]] XdpMode mode() const { return mode_; }
  // The program runs as generic XDP (the driver has no native XDP).
  [[nodiscard]] bool generic() const { return generic_; }
  [[nodiscard]] unsigned frame_size() const { return frame_; }
  // Copy mode: frames one sendto() makes the kernel transmit (32 unless the
  // kernel takes XDP_MAX_TX_SKB_BUDGET, then the TX ring's size); 0 with
  // zero-copy, where the driver transmits by itself.
  [[nodiscard]] unsigned tx_budget() const { return tx_budget_; }
  // Frames each socket's receive side took (where MQ steering sent them).
  [[nodiscard]] uint64_t received_on(unsigned port_queue) const;
  // xdp_mode, xdp_attach (native or generic), xdp_tx_budget, xdp_received per socket.
  [[nodiscard]] std::vector<virtio::PortFact> describe() const override;

  // Detaches every program of ours whose owner is `instance` (any
  // device) from every netdev, except on netdevs in `keep`; returns
  // "netdev (owner)" of each one removed.
  static std::vector<std::string> remove_left_over(const std::string& instance,
                                                   const std::vector<std::string>& keep = {});
  static std::string owner_of(const std::string& instance, const std::string& device);

 private:
  void remove_stale_program(const std::string& instance, const std::string& device);
  void load_program(const std::string& instance, const std::string& device);
  void attach_program(const std::string& device);
  struct Queue;
  struct Program;
  void bind_queue(unsigned q, uint32_t ring_size);
  void refill(Queue& x);
  void reclaim(Queue& x);
  void kick(Queue& x);
  void resteer();

  std::string name_;
  // SIOCGIFFLAGS: an AF_XDP socket takes no interface ioctls (found by a
  // real driver's carrier: VDUSE's virtio_net saw the link down for good).
  UniqueFd control_;
  unsigned ifindex_ = 0;
  unsigned frame_ = 0;
  unsigned pairs_ = 0;
  XdpMode mode_ = XdpMode::copy;
  bool generic_ = false;
  unsigned tx_budget_ = 0;
  std::unique_ptr<Program> prog_;
  std::vector<std::unique_ptr<Queue>> queues_;
  std::atomic<unsigned> active_{1};
  // Per reader (a worker, the port queue it serves): the sockets whose
  // receive side it holds this pass, one bit each.
  std::vector<uint64_t> held_;
  std::mutex steer_mutex_;  // set_active_queues: the epoll sets
};

}  // namespace sriovd::ports
