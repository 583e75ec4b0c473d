#include "sriovd/util/unix_socket.hpp"

#include <algorithm>
#include <array>

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

#include "sriovd/util/error.hpp"
#include "sriovd/util/fd.hpp"

namespace sriovd {

namespace {

void remove_stale(const std::string& path, const std::string& what) {
  struct stat st {};
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

UniqueFd dup_fd(int fd, const std::string& what) {
  if (fd < 0) return {};
  UniqueFd d(::fcntl(fd, F_DUPFD_CLOEXEC, 3));
  if (!d) throw_errno("duplicating " + what);
  return d;
}

// ---- SocketFile ------------------------------------------------------------

namespace {

std::string proc_fd(int fd) { return "/proc/self/fd/" + std::to_string(fd); }

// A fresh directory only this process can use, made in `parent`; its name.
std::string private_directory(int parent, const std::string& what) {
  std::random_device random;
  for (int attempt = 0; attempt < 16; ++attempt) {
    char name[32];
    std::snprintf(name, sizeof name, ".sriovd-%08x%08x", random(), random());
    if (::mkdirat(parent, name, 0700) == 0) return name;
    if (errno != EEXIST) throw_errno("making a private directory for " + what);
  }
  throw std::runtime_error("making a private directory for " + what + ": every name taken");
}

bool same_file(int dir, const char* name, dev_t dev, ino_t ino) {
  struct stat st {};
  return ::fstatat(dir, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_dev == dev && st.st_ino == ino;
}

}  // namespace

SocketFile::SocketFile(const std::string& path, const SocketAccess& access, const std::string& what)
    : path_(path), what_(what) {
  const std::filesystem::path p(path);
  base_ = p.filename().string();
  const std::filesystem::path dir = p.parent_path();
  if (base_.empty() || dir.empty())
    throw std::invalid_argument(what + " path '" + path + "' is not a file in a directory");
  std::error_code fs_ec;
  std::filesystem::create_directories(dir, fs_ec);
  if (fs_ec) throw std::runtime_error("cannot create " + dir.string() + " for " + what + ": " + fs_ec.message());
  remove_stale(path, what);
  dir_.reset(::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!dir_) throw_errno("opening the directory of " + what + " " + path);

  // The socket is bound and given its access where nobody else can reach
  // it: a directory of ours, held by fd (a peer that renames it away and
  // puts a symlink in its place changes nothing we do).
  const std::string hidden = private_directory(dir_.get(), what);
  UniqueFd priv(::openat(dir_.get(), hidden.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  struct stat pst {};
  auto clean_up = [&] {
    if (priv) ::unlinkat(priv.get(), "s", 0);
    if (priv && ::fstat(priv.get(), &pst) == 0 && same_file(dir_.get(), hidden.c_str(), pst.st_dev, pst.st_ino))
      ::unlinkat(dir_.get(), hidden.c_str(), AT_REMOVEDIR);
  };
  try {
    if (!priv || ::fstat(priv.get(), &pst) != 0) throw_errno("opening the private directory of " + what);
    if (pst.st_uid != ::geteuid() || ::chmod(proc_fd(priv.get()).c_str(), 0700) != 0)
      throw std::runtime_error("the private directory of " + what + " " + path + " was replaced");
    listener_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!listener_) throw_errno("socket for " + what);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string inside = proc_fd(priv.get()) + "/s";
    std::memcpy(addr.sun_path, inside.c_str(), inside.size() + 1);
    if (::bind(listener_.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0)
      throw_errno("cannot bind " + what + " " + path);
    handle_.reset(::openat(priv.get(), "s", O_PATH | O_NOFOLLOW | O_CLOEXEC));
    struct stat st {};
    if (!handle_ || ::fstat(handle_.get(), &st) != 0 || !S_ISSOCK(st.st_mode))
      throw_errno("opening " + what + " " + path);
    dev_ = st.st_dev;
    ino_ = st.st_ino;
    set_access(access);
    if (::listen(listener_.get(), SOMAXCONN) != 0) throw_errno("listen on " + what + " " + path);
    // Into place at once, with its access: replaces what is at the path
    // (a stale socket, or whatever was put there since it was looked at).
    if (::renameat(priv.get(), "s", dir_.get(), base_.c_str()) != 0) throw_errno("putting " + what + " at " + path);
  } catch (...) {
    clean_up();
    throw;
  }
  clean_up();
}

void SocketFile::set_access(const SocketAccess& access) const {
  if (!handle_) return;
  const std::string file = proc_fd(handle_.get());  // this socket's inode, whatever its path holds now
  if ((access.uid || access.gid) && ::chown(file.c_str(), access.uid ? *access.uid : static_cast<uid_t>(-1),
                                            access.gid ? *access.gid : static_cast<gid_t>(-1)) != 0)
    throw_errno("giving " + what_ + " " + path_ + " its owner and group");
  if (::chmod(file.c_str(), access.mode) != 0) throw_errno("setting the mode of " + what_ + " " + path_);
}

void SocketFile::remove() const {
  if (dir_ && same_file(dir_.get(), base_.c_str(), dev_, ino_)) ::unlinkat(dir_.get(), base_.c_str(), 0);
}

UniqueFd SocketFile::dup_handle() const { return dup_fd(handle_.get(), "the handle of " + what_ + " " + path_); }

SocketFile SocketFile::adopt(const std::string& path, const std::string& what, UniqueFd listener, UniqueFd handle) {
  SocketFile f;
  f.path_ = path;
  f.what_ = what;
  const std::filesystem::path p(path);
  f.base_ = p.filename().string();
  int accepting = 0;
  socklen_t len = sizeof accepting;
  sockaddr_un addr{};
  socklen_t alen = sizeof addr;
  if (!listener || ::getsockopt(listener.get(), SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len) != 0 || !accepting ||
      ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &alen) != 0 || addr.sun_family != AF_UNIX)
    throw std::runtime_error(what + " " + path + ": the handed-over fd is not a listening Unix socket");
  f.dir_.reset(::open(p.parent_path().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  // Without the predecessor's handle (systemd's store cannot keep O_PATH
  // fds), the socket file the path names now, never through a symlink.
  if (!handle && f.dir_) handle.reset(::openat(f.dir_.get(), f.base_.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC));
  struct stat st {};
  if (!handle || ::fstat(handle.get(), &st) != 0 || !S_ISSOCK(st.st_mode))
    throw std::runtime_error(what + " " + path + ": the handed-over handle is not a socket file");
  if (!f.dir_ || !same_file(f.dir_.get(), f.base_.c_str(), st.st_dev, st.st_ino))
    throw std::runtime_error(what + " " + path + ": the path no longer names the handed-over socket");
  f.dev_ = st.st_dev;
  f.ino_ = st.st_ino;
  f.listener_ = std::move(listener);
  f.handle_ = std::move(handle);
  return f;
}

SocketFile listen_unix(asio::local::stream_protocol::acceptor& acceptor, const std::string& path,
                       const SocketAccess& access, const std::string& what) {
  SocketFile file(path, access, what);
  UniqueFd fd = file.take_listener();
  acceptor.assign(asio::local::stream_protocol(), fd.get());
  (void)fd.release();
  return file;
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

ssize_t send_all_within(int sock, std::span<const iovec> iov, std::span<const int> fds,
                        std::chrono::milliseconds limit) {
  std::array<iovec, 4> rest{};
  if (iov.size() > rest.size()) {
    errno = E2BIG;
    return -1;
  }
  std::copy(iov.begin(), iov.end(), rest.begin());
  size_t first = 0, count = iov.size(), total = 0;
  bool fds_sent = fds.empty();
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (first < count) {
    const ssize_t n = send_with_fds(sock, std::span<const iovec>(rest.data() + first, count - first),
                                    fds_sent ? std::span<const int>() : fds, MSG_DONTWAIT);
    if (n < 0 && errno != EAGAIN) return -1;
    if (n > 0) {
      fds_sent = true;  // they went with the first byte
      total += static_cast<size_t>(n);
      for (size_t left = static_cast<size_t>(n); left > 0 && first < count;) {
        const size_t take = std::min(left, rest[first].iov_len);
        rest[first].iov_base = static_cast<uint8_t*>(rest[first].iov_base) + take;
        rest[first].iov_len -= take;
        left -= take;
        if (rest[first].iov_len == 0) ++first;
      }
      while (first < count && rest[first].iov_len == 0) ++first;
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      errno = ETIMEDOUT;
      return -1;
    }
    pollfd p{sock, POLLOUT, 0};
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1;
    if (::poll(&p, 1, static_cast<int>(wait)) < 0 && errno != EINTR) return -1;
  }
  return static_cast<ssize_t>(total);
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
