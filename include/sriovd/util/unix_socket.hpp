#pragma once

#include <sys/types.h>

#include <string>

#include "sriovd/util/asio.hpp"

namespace sriovd {

// Opens `acceptor` listening on the Unix socket `path` with file mode
// `mode` from the moment the file exists (umask around bind). Creates the
// directory; replaces a stale socket file a dead process left, but refuses
// a path where a live server answers or that is not a socket. `what` names
// the socket in errors ("control socket", "vhost-user socket").
void listen_unix(asio::local::stream_protocol::acceptor& acceptor, const std::string& path, mode_t mode,
                 const std::string& what);

}  // namespace sriovd
