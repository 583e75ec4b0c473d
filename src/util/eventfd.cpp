#include "sriovd/util/eventfd.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

#include "sriovd/util/error.hpp"

namespace sriovd {

bool is_eventfd(int fd) {
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  char target[64];
  const ssize_t n = ::readlink(link.c_str(), target, sizeof target);
  static constexpr char kEventfd[] = "anon_inode:[eventfd]";
  return n == static_cast<ssize_t>(sizeof kEventfd - 1) && std::memcmp(target, kEventfd, sizeof kEventfd - 1) == 0;
}

UniqueFd checked_peer_eventfd(UniqueFd fd, const std::string& what) {
  if (!fd.valid()) return fd;
  if (!is_eventfd(fd.get())) throw std::invalid_argument(what + ": the fd is not an eventfd");
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || (!(flags & O_NONBLOCK) && ::fcntl(fd.get(), F_SETFL, flags | O_NONBLOCK) != 0))
    throw_errno(what + ": making the eventfd non-blocking");
  return fd;
}

}  // namespace sriovd
