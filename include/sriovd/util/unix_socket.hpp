#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <sys/uio.h>

#include <chrono>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"

#include "sriovd/util/asio.hpp"

namespace sriovd {

// A listening Unix socket and a handle on its file. The file is made in a
// private directory (0700, next to `path`) where its mode, owner and group
// are set before anyone can reach it, then renamed into place: no umask is
// changed (the process's umask is shared by every thread) and nothing is
// done by path that a peer could redirect. Later changes of access go to
// the file through an O_PATH handle (/proc/self/fd/N), never by path: a
// VMM that can write the socket's directory (libvirt, KubeVirt) and puts
// a symlink to /etc/shadow where its socket was has its symlink, and
// nothing else, left alone. remove() unlinks the path only while it is
// still this socket.
//
// Creates the directory; replaces a stale socket file a dead process left,
// but refuses a path where a live server answers or that is not a socket.
// `what` names the socket in errors ("control socket", "vhost-user socket").
struct SocketAccess {
  std::optional<uid_t> uid;  // unset: the daemon's
  std::optional<gid_t> gid;
  mode_t mode = 0600;
};

class SocketFile {
 public:
  SocketFile() = default;
  SocketFile(const std::string& path, const SocketAccess& access, const std::string& what);
  SocketFile(SocketFile&&) noexcept = default;
  SocketFile& operator=(SocketFile&&) noexcept = default;
  ~SocketFile() = default;  // the path stays: remove() says when it goes

  // The listening socket (ownership passes to the caller once).
  [[nodiscard]] UniqueFd take_listener() { return std::move(listener_); }
  // Owner, group and mode of this socket's file; throws SystemError.
  void set_access(const SocketAccess& access) const;
  // Unlinks the path if it is still this socket's file.
  void remove() const;
  // Handover (daemon/handover.hpp): the O_PATH handle on the socket's
  // file, duplicated for a successor, and a successor's SocketFile from
  // its predecessor's listening socket and handle. adopt() checks that the
  // listener is a listening Unix socket and that `path` still names the
  // handle's file; it throws std::runtime_error naming `what` otherwise
  // (the successor then makes a socket of its own).
  [[nodiscard]] UniqueFd dup_handle() const;
  static SocketFile adopt(const std::string& path, const std::string& what, UniqueFd listener, UniqueFd handle);
  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  std::string path_, what_, base_;
  UniqueFd listener_, handle_, dir_;  // dir_: the parent, held as it was when the socket was made
  dev_t dev_ = 0;
  ino_t ino_ = 0;
};

// Opens `acceptor` listening on a SocketFile at `path` with `access`; the
// file stays the caller's to remove.
SocketFile listen_unix(asio::local::stream_protocol::acceptor& acceptor, const std::string& path,
                       const SocketAccess& access, const std::string& what);

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

// The most fds one message may carry through these two (no allocation:
// the control buffers are on the stack).
inline constexpr size_t kMaxPassedFds = 16;

// sendmsg of `iov` with `fds` as SCM_RIGHTS (none: a plain message);
// MSG_NOSIGNAL, retried on EINTR. Returns what sendmsg returned.
ssize_t send_with_fds(int sock, std::span<const iovec> iov, std::span<const int> fds, int flags = 0);

// The whole of `iov`, `fds` with its first byte, waiting for room at most
// `limit` in all: each sendmsg is MSG_DONTWAIT and the waits between them
// share one deadline, so a peer that drains a large reply one socket buffer
// at a time, just inside a per-wait timeout, cannot hold the sender for
// longer (SO_SNDTIMEO counts each wait afresh). Returns the bytes sent (all
// of them) or -1 with errno (ETIMEDOUT, or sendmsg's). At most 4 iovecs.
ssize_t send_all_within(int sock, std::span<const iovec> iov, std::span<const int> fds,
                        std::chrono::milliseconds limit);

// One recvmsg into [data, data + size); the fds that came with it are
// appended to `fds` (close-on-exec). Sets `truncated` when the sender's
// fds did not all fit (more than max_fds). Returns what recvmsg returned.
ssize_t recv_with_fds(int sock, void* data, size_t size, std::vector<UniqueFd>& fds, int flags, bool& truncated,
                      size_t max_fds = 16);

}  // namespace sriovd
