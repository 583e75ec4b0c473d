#include "sriovd/virtio/packet_socket.hpp"

#include <net/if.h>
#include <sys/ioctl.h>

#include <arpa/inet.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <sys/socket.h>

#include <unistd.h>

#include <algorithm>
#include <stdexcept>
#include <cstring>

#include "sriovd/util/error.hpp"

namespace sriovd::virtio {

namespace {
constexpr size_t kKernelHeader = 10;  // struct virtio_net_hdr
constexpr size_t kDeviceHeader = 12;  // struct virtio_net_hdr_v1
constexpr int kMaxIov = 66;
}  // namespace

PacketSocket::PacketSocket(const std::string& ifname, unsigned queues) : name_(ifname) {
  if (queues == 0) throw std::invalid_argument("AF_PACKET port for " + ifname + " with no queue");
  const unsigned index = ::if_nametoindex(ifname.c_str());
  if (index == 0) throw_errno("netdev " + ifname);
  // One fanout group per port: the id only has to be unique among groups.
  const int group = static_cast<int>((static_cast<unsigned>(::getpid()) ^ (index << 8U)) & 0xffffU);
  for (unsigned q = 0; q < queues; ++q) {
    UniqueFd fd(::socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK | SOCK_CLOEXEC, htons(ETH_P_ALL)));
    if (!fd) throw_errno("AF_PACKET socket for " + ifname);
    int one = 1;
    if (::setsockopt(fd.get(), SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) != 0) throw_errno("PACKET_VNET_HDR on " + ifname);
    (void)::setsockopt(fd.get(), SOL_PACKET, PACKET_QDISC_BYPASS, &one, sizeof one);
    // What the host itself (or another queue) transmits on the VF goes to
    // the wire, not back to the guest.
    if (::setsockopt(fd.get(), SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one) != 0)
      throw_errno("PACKET_IGNORE_OUTGOING on " + ifname);
    sockaddr_ll addr{};
    addr.sll_family = AF_PACKET;
    addr.sll_protocol = htons(ETH_P_ALL);
    addr.sll_ifindex = static_cast<int>(index);
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) throw_errno("binding AF_PACKET to " + ifname);
    if (queues > 1) {
      const int fanout = group | ((PACKET_FANOUT_HASH | PACKET_FANOUT_FLAG_DEFRAG) << 16);
      if (::setsockopt(fd.get(), SOL_PACKET, PACKET_FANOUT, &fanout, sizeof fanout) != 0)
        throw_errno("PACKET_FANOUT for queue " + std::to_string(q) + " of " + ifname);
    }
    fds_.push_back(std::move(fd));
  }
}

ssize_t PacketSocket::send(unsigned q, const iovec* iov, int count) {
  // The first 10 of the guest's 12 header bytes, then everything after 12.
  uint8_t header[kDeviceHeader];
  iovec out[kMaxIov];
  int n = 1;
  size_t skip = kDeviceHeader, copied = 0;
  for (int i = 0; i < count && n < kMaxIov; ++i) {
    const auto* base = static_cast<const uint8_t*>(iov[i].iov_base);
    size_t len = iov[i].iov_len;
    if (skip > 0) {
      const size_t take = std::min(skip, len);
      std::memcpy(header + copied, base, take);
      copied += take;
      skip -= take;
      base += take;
      len -= take;
    }
    if (len > 0) out[n++] = {const_cast<uint8_t*>(base), len};
  }
  if (copied < kDeviceHeader) return -1;
  out[0] = {header, kKernelHeader};
  return ::writev(fds_[q].get(), out, n);
}

ssize_t PacketSocket::recv(unsigned q, uint8_t* buf, size_t size) {
  if (size <= kDeviceHeader) return -1;
  iovec in[2] = {{buf, kKernelHeader}, {buf + kDeviceHeader, size - kDeviceHeader}};
  const ssize_t n = ::readv(fds_[q].get(), in, 2);
  if (n <= static_cast<ssize_t>(kKernelHeader)) return n;
  std::memset(buf + kKernelHeader, 0, kDeviceHeader - kKernelHeader);  // num_buffers: the device's
  return n + static_cast<ssize_t>(kDeviceHeader - kKernelHeader);
}

bool PacketSocket::link_up() const {
  ifreq ifr{};
  std::strncpy(ifr.ifr_name, name_.c_str(), IFNAMSIZ - 1);
  if (::ioctl(fds_[0].get(), SIOCGIFFLAGS, &ifr) != 0) return false;  // gone: no link
  return (ifr.ifr_flags & IFF_UP) && (ifr.ifr_flags & IFF_RUNNING);
}

}  // namespace sriovd::virtio
