#pragma once
// A peer's message that breaks its protocol - a vhost-user or vfio-user
// message that cannot be handled as the spec says: it ends that peer's
// connection (PeerConnection, EndCause::framing), never the daemon.
#include <stdexcept>

namespace sriovd {

class ProtocolError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace sriovd
