#pragma once
// Where a virtio-net device's packets go, as the device sees it: the
// ports module (src/ports) has a tap device, a (VF's) netdev through an
// AF_PACKET socket, a macvtap and AF_XDP sockets. All speak the 12-byte virtio_net_hdr_v1 in front of each packet to
// the device.

#include <sys/types.h>
#include <sys/uio.h>

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace sriovd::virtio {

// One fact a port tells about itself for status (the devices list shows
// them under the device's backend): a name and a text, a number or a list.
using PortFact = std::pair<std::string, std::variant<std::string, uint64_t, std::vector<uint64_t>>>;

class PacketPort {
 public:
  virtual ~PacketPort() = default;
  [[nodiscard]] virtual const std::string& name() const = 0;
  [[nodiscard]] virtual unsigned queues() const = 0;
  // The fd to wait on for queue q (non-blocking).
  [[nodiscard]] virtual int fd(unsigned q) const = 0;
  // One packet, virtio-net header first, from the guest's segments. -1
  // with errno EAGAIN: no room now; the fd turns writable when there is.
  virtual ssize_t send(unsigned q, const iovec* iov, int count) = 0;
  // Hands over what send() queued (a port that batches: one system call
  // per batch). The device calls it after each round of transmits.
  virtual void flush(unsigned /*q*/) {}
  // One packet into buf, virtio-net header first; <= 0 when none.
  virtual ssize_t recv(unsigned q, uint8_t* buf, size_t size) = 0;
  // The end of a pass of recv() calls on queue q (a port that batches
  // hands the pass's buffers back to the kernel here).
  virtual void rx_done(unsigned /*q*/) {}
  // TUN_F_* offloads the guest can take from us.
  virtual void set_offloads(unsigned tun_flags) = 0;
  // Only queues [0, n) carry traffic (the driver's MQ setting); a port
  // that can steer (a multi-queue tap) stops giving packets to the rest.
  virtual void set_active_queues(unsigned /*n*/) {}
  // The fd that turns writable (EPOLLOUT) when queue q has room again
  // after a send() found none: fd(q) itself, unless fd(q) is a set of
  // sockets (an epoll fd, which never reports EPOLLOUT).
  [[nodiscard]] virtual int room_fd(unsigned q) const { return fd(q); }
  // Carrier of what the port is attached to (control plane; an ioctl).
  [[nodiscard]] virtual bool link_up() const { return true; }
  // Queue q's fd reported EPOLLERR (a socket's pending error: AF_PACKET
  // sets ENETDOWN when its netdev goes down): takes the error, which
  // epoll reports level-triggered until it is taken - a worker that left
  // it would wake without end. Returns the error (0: none, or not a socket).
  virtual int take_error(unsigned /*q*/) { return 0; }
  // The netdev the traffic goes through (a macvtap's is its lower device).
  [[nodiscard]] virtual const std::string& netdev() const { return name(); }
  // What else the port is, for status (a macvtap's own name, AF_XDP's mode).
  [[nodiscard]] virtual std::vector<PortFact> describe() const { return {}; }
  // An upgrade in place handed the port's fds to the successor: what the
  // port made on the host (a macvtap link) stays when it goes.
  virtual void keep_for_successor() {}
};

}  // namespace sriovd::virtio
