#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <sys/uio.h>

#include <optional>
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

// A connected Unix stream socket to `path` (close-on-exec). Throws
// SystemError naming `what` and the path: ENAMETOOLONG for a path that does
// not fit sun_path (never truncated), or connect's errno. Non-blocking:
// the socket is O_NONBLOCK and a listener that cannot take the connection
// now (a full backlog: EAGAIN) fails at once instead of blocking the caller.
UniqueFd connect_unix(const std::string& path, const std::string& what, bool nonblocking = false);

// A peer's connection, for a server that replies with blocking sends:
// blocking, but a send waits at most `limit` for a peer that does not read
// its replies (SO_SNDTIMEO) and then fails with EAGAIN - the caller ends
// that connection instead of the control thread waiting for ever.
void limit_send_wait(int fd, int limit_ms = 1000);

// The process on the other end of a connected Unix socket (SO_PEERCRED);
// nullopt when the kernel cannot say.
std::optional<ucred> peer_credentials(int fd);

// Whether that peer may use a socket whose allow-list is `allowed`. Fails
// closed: unknown credentials are never admitted. An empty list admits
// every known peer (the socket file's owner, group and mode are the gate);
// otherwise exactly the listed uids (root too only when listed).
bool peer_admitted(const std::optional<ucred>& peer, std::span<const uid_t> allowed);

// Gives the socket file at `path` its owner and group (unset: left as they
// are) and mode; throws SystemError naming `what`.
void set_socket_access(const std::string& path, std::optional<uid_t> uid, std::optional<gid_t> gid, mode_t mode,
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
