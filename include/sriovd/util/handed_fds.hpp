#pragma once
// What an upgrade in place passes from one sriovd to its successor
// (daemon/handover.hpp) is bytes and fds that travel apart: inherited
// across exec, or through systemd's fd store. A part's bytes name its fds
// by index into the part's own list (kNoFd: none); the successor checks
// every index it reads against the number of fds it got.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"

namespace sriovd {

struct HandedFds {
  static constexpr uint32_t kNoFd = 0xffffffff;
  std::vector<UniqueFd> fds;

  // An invalid fd is kNoFd.
  uint32_t add_fd(UniqueFd fd) {
    if (!fd) return kNoFd;
    fds.push_back(std::move(fd));
    return static_cast<uint32_t>(fds.size() - 1);
  }
  // Each index is taken once; kNoFd or one taken already: none.
  UniqueFd take_fd(uint32_t index) {
    if (index == kNoFd || index >= fds.size()) return {};
    return std::move(fds[index]);
  }
};

// An index read from a part's bytes (`r`: a virtio::StateReader, whose
// fail() throws naming the part), checked against the `nfds` it came with.
template <typename Reader>
uint32_t read_fd_index(Reader& r, size_t nfds, const char* field) {
  const uint32_t i = r.u32();
  if (i != HandedFds::kNoFd && i >= nfds)
    r.fail(std::string(field) + " names fd " + std::to_string(i) + " of " + std::to_string(nfds));
  return i;
}

// Why something cannot be handed over now; it goes on as it was.
class HandoverRefused : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace sriovd
