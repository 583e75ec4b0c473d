#include "sriovd/util/unix_socket.hpp"

#include <algorithm>

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "sriovd/util/error.hpp"
#include "sriovd/util/fd.hpp"

namespace sriovd {

namespace {

void remove_stale(const std::string& path, const std::string& what) {
  struct stat st{};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    throw_errno(what + " " + path);
  }
  if (!S_ISSOCK(st.st_mode)) throw std::runtime_error(what + " path " + path + " exists and is not a socket");
  UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), std::min(path.size() + 1, sizeof addr.sun_path));
  if (::connect(probe.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0)
    throw std::runtime_error("another server is already answering on " + what + " " + path);
  if (::unlink(path.c_str()) != 0) throw_errno("removing stale " + what + " " + path);
}

}  // namespace

void listen_unix(asio::local::stream_protocol::acceptor& acceptor, const std::string& path, mode_t mode,
                 const std::string& what) {
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  std::error_code fs_ec;
  std::filesystem::create_directories(dir, fs_ec);
  if (fs_ec) throw std::runtime_error("cannot create " + dir.string() + " for " + what + ": " + fs_ec.message());
  remove_stale(path, what);
  acceptor.open(asio::local::stream_protocol());
  // The mode must hold from the moment the file exists, so the umask is set
  // around bind() rather than fixed with chmod() afterwards.
  const mode_t old_mask = ::umask(static_cast<mode_t>(~mode & 0777));
  boost::system::error_code ec;
  acceptor.bind(asio::local::stream_protocol::endpoint(path), ec);
  ::umask(old_mask);
  if (ec) throw std::runtime_error("cannot bind " + what + " " + path + ": " + ec.message());
  acceptor.listen(asio::socket_base::max_listen_connections);
}

ssize_t send_with_fds(int sock, std::span<const iovec> iov, std::span<const int> fds, int flags) {
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov.data());
  msg.msg_iovlen = iov.size();
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPassedFds)];
  if (fds.size() > kMaxPassedFds) {
    errno = E2BIG;
    return -1;
  }
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t n;
  do n = ::sendmsg(sock, &msg, flags | MSG_NOSIGNAL);
  while (n < 0 && errno == EINTR);
  return n;
}

std::optional<ucred> peer_credentials(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof cred) return std::nullopt;
  return cred;
}

bool peer_admitted(const std::optional<ucred>& peer, std::span<const uid_t> allowed) {
  if (!peer) return false;
  if (allowed.empty()) return true;
  return std::find(allowed.begin(), allowed.end(), peer->uid) != allowed.end();
}

void set_socket_access(const std::string& path, std::optional<uid_t> uid, std::optional<gid_t> gid, mode_t mode,
                       const std::string& what) {
  if ((uid || gid) && ::chown(path.c_str(), uid ? *uid : static_cast<uid_t>(-1), gid ? *gid : static_cast<gid_t>(-1)) != 0)
    throw_errno("giving " + what + " " + path + " its owner and group");
  if (::chmod(path.c_str(), mode) != 0) throw_errno("setting the mode of " + what + " " + path);
}

UniqueFd connect_unix(const std::string& path, const std::string& what, bool nonblocking) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path)
    throw SystemError(ENAMETOOLONG, what + " path " + path + " is longer than " +
                                        std::to_string(sizeof addr.sun_path - 1) + " bytes");
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0), 0));
  if (!fd) throw_errno("socket for " + what);
  int rc;
  do {
    rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) throw_errno("connecting to " + what + " " + path);
  return fd;
}

void limit_send_wait(int fd, int limit_ms) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0 && (flags & O_NONBLOCK)) (void)::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  const timeval tv{limit_ms / 1000, (limit_ms % 1000) * 1000};
  if (::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0) throw_errno("SO_SNDTIMEO on a peer's socket");
}

ssize_t recv_with_fds(int sock, void* data, size_t size, std::vector<UniqueFd>& fds, int flags, bool& truncated,
                      size_t max_fds) {
  iovec iov{data, size};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPassedFds)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * std::min(max_fds, kMaxPassedFds));
  const ssize_t n = ::recvmsg(sock, &msg, flags | MSG_CMSG_CLOEXEC);
  if (n < 0) return n;
  const size_t before = fds.size();
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
      for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        fds.emplace_back(fd);
      }
  // CMSG_SPACE rounds up: a buffer for an odd count holds one more fd.
  truncated = (msg.msg_flags & MSG_CTRUNC) || fds.size() - before > max_fds;
  return n;
}

}  // namespace sriovd
