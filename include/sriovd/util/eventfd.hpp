#pragma once
// Eventfds that come from a peer (vhost-user kick/call/err, vfio-user
// SET_IRQS): checked where they enter, so nothing after can block on them.

#include <string>

#include "sriovd/util/fd.hpp"

namespace sriovd {

// True when `fd` is an eventfd (its /proc/self/fd link says so).
[[nodiscard]] bool is_eventfd(int fd);

// Refuses (std::invalid_argument naming `what`) an fd that is not an
// eventfd, and makes it non-blocking. The flag is on the open file the peer
// shares: an eventfd it reads blocking would see EAGAIN - QEMU, DPDK and
// cloud-hypervisor all use theirs non-blocking. A blocking fd here would let
// the peer stop a worker's read or the relay's write for as long as it liked.
UniqueFd checked_peer_eventfd(UniqueFd fd, const std::string& what);

}  // namespace sriovd
