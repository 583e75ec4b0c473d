#pragma once

#include <memory>
#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/virtio/port.hpp"

namespace sriovd::ports {

// The TUNSETOFFLOAD flags (TUN_F_*) for what a tap may hand the device:
// checksum offload, TSO over IPv4 and IPv6, TSO with ECN, UFO.
unsigned tun_offload_flags(bool csum, bool tso4, bool tso6, bool tso_ecn, bool ufo);

// A tap device carrying virtio-net headers (IFF_VNET_HDR, 12-byte header):
// what the guest puts in front of a packet goes to the kernel as it is, and
// the kernel's checksum/GSO metadata comes back the same way.
class Tap : public virtio::PacketPort {
 public:
  // Creates (or attaches to) tap `name`, one queue fd per queue pair
  // (IFF_MULTI_QUEUE when more than one), non-blocking. With `netns`, the
  // tap is moved into that network namespace (its fds stay valid).
  Tap(const std::string& name, unsigned queues, const std::string& netns = "");
  // The queue fds of tap `name` another sriovd handed over (an upgrade in
  // place: the tap, its addresses and bridges stay). Throws
  // std::runtime_error when an fd is not a queue of that tap.
  static std::unique_ptr<Tap> adopt(const std::string& name, std::vector<UniqueFd> fds);
  ~Tap() override;
  Tap(const Tap&) = delete;
  Tap& operator=(const Tap&) = delete;

  [[nodiscard]] const std::string& name() const override { return name_; }
  [[nodiscard]] unsigned queues() const override { return static_cast<unsigned>(fds_.size()); }
  [[nodiscard]] int fd(unsigned queue) const override { return fds_.at(queue).get(); }
  ssize_t send(unsigned q, const iovec* iov, int count) override;
  ssize_t recv(unsigned q, uint8_t* buf, size_t size) override;
  // TUNSETOFFLOAD: what the kernel may hand us (csum, tso4, tso6, ecn, ufo).
  // Like TUNSETQUEUE it takes the kernel's rtnl lock, which a tap being
  // closed anywhere on the host holds through an RCU grace period (seconds
  // on a loaded machine): both are only called when something changes.
  void set_offloads(unsigned tun_flags) override;
  // TUNSETQUEUE: queues >= n detached, so the kernel steers no flow to them.
  void set_active_queues(unsigned n) override;

 protected:
  // Queue fds already attached to a tap-like device (a tap or a macvtap's
  // character device): each is given the 12-byte header and no offloads.
  Tap(std::string name, std::vector<UniqueFd> fds);
  // Closes every queue (a macvtap's link can only go once they are closed).
  void close_queues() { fds_.clear(); }

 private:
  std::string name_;
  std::vector<UniqueFd> fds_;
  unsigned offloads_ = ~0U;  // as last set (~0: not yet)
  unsigned active_queues_;   // attached: [0, active_queues_)
};

}  // namespace sriovd::ports
