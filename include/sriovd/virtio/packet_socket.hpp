#pragma once

#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/virtio/port.hpp"

namespace sriovd::virtio {

// A netdev (a VF's, for the VF-to-virtio bridge) through an AF_PACKET
// socket with PACKET_VNET_HDR. The kernel's header there is the 10-byte
// struct virtio_net_hdr; the device's is the 12-byte v1 header, so the two
// bytes of num_buffers are dropped on the way out and left for the device
// to fill on the way in.
class PacketSocket : public PacketPort {
 public:
  // `queues` sockets; with more than one they form a PACKET_FANOUT_HASH
  // group, so the kernel spreads received flows over the queue pairs.
  explicit PacketSocket(const std::string& ifname, unsigned queues = 1);

  [[nodiscard]] const std::string& name() const override { return name_; }
  [[nodiscard]] unsigned queues() const override { return static_cast<unsigned>(fds_.size()); }
  [[nodiscard]] int fd(unsigned q) const override { return fds_.at(q).get(); }
  ssize_t send(unsigned q, const iovec* iov, int count) override;
  ssize_t recv(unsigned q, uint8_t* buf, size_t size) override;
  void set_offloads(unsigned) override {}
  // The netdev's IFF_RUNNING (carrier and up): a VF whose link goes down.
  [[nodiscard]] bool link_up() const override;

 private:
  std::string name_;
  std::vector<UniqueFd> fds_;
};

}  // namespace sriovd::virtio
