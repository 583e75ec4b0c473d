#pragma once

#include <sys/types.h>

#include <sys/uio.h>

#include <span>
#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"

#include "sriovd/util/asio.hpp"

namespace sriovd {

// Opens `acceptor` listening on the Unix socket `path` with file mode
// `mode` from the moment the file exists (umask around bind). Creates the
// directory; replaces a stale socket file a dead process left, but refuses
// a path where a live server answers or that is not a socket. `what` names
// the socket in errors ("control socket", "vhost-user socket").
void listen_unix(asio::local::stream_protocol::acceptor& acceptor, const std::string& path, mode_t mode,
                 const std::string& what);

// The most fds one message may carry through these two (no allocation:
// the control buffers are on the stack).
inline constexpr size_t kMaxPassedFds = 16;

// sendmsg of `iov` with `fds` as SCM_RIGHTS (none: a plain message);
// MSG_NOSIGNAL, retried on EINTR. Returns what sendmsg returned.
ssize_t send_with_fds(int sock, std::span<const iovec> iov, std::span<const int> fds, int flags = 0);

// One recvmsg into [data, data + size); the fds that came with it are
// appended to `fds` (close-on-exec). Sets `truncated` when the sender's
// fds did not all fit (more than max_fds). Returns what recvmsg returned.
ssize_t recv_with_fds(int sock, void* data, size_t size, std::vector<UniqueFd>& fds, int flags, bool& truncated,
                      size_t max_fds = 16);

}  // namespace sriovd
