#pragma once

#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"

namespace sriovd::virtio {

// A tap device carrying virtio-net headers (IFF_VNET_HDR, 12-byte header):
// what the guest puts in front of a packet goes to the kernel as it is, and
// the kernel's checksum/GSO metadata comes back the same way.
class Tap {
 public:
  // Creates (or attaches to) tap `name`, one queue fd per queue pair
  // (IFF_MULTI_QUEUE when more than one), non-blocking. With `netns`, the
  // tap is moved into that network namespace (its fds stay valid).
  Tap(const std::string& name, unsigned queues, const std::string& netns = "");
  ~Tap();

  [[nodiscard]] const std::string& name() const { return name_; }
  [[nodiscard]] int fd(unsigned queue) const { return fds_.at(queue).get(); }
  // TUNSETOFFLOAD: what the kernel may hand us (csum, tso4, tso6, ecn, ufo).
  void set_offloads(unsigned tun_flags);

 private:
  std::string name_;
  std::vector<UniqueFd> fds_;
};

}  // namespace sriovd::virtio
