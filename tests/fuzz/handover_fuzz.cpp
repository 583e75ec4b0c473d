// A vhost-user back-end's handover (daemon/handover.hpp) as a successor
// reads it: the bytes come from the predecessor, but a successor must not
// trust a manifest it cannot check - any input is refused with
// std::invalid_argument, or parses into a handover whose every fd index
// is inside the fd list and which serializes to bytes that parse to the
// same handover.
#include <cstdlib>
#include <span>
#include <stdexcept>
#include <vector>

#include "sriovd/vhost_user/backend.hpp"

namespace {

using sriovd::vhost_user::BackendHandover;

void check(bool ok) {
  if (!ok) std::abort();
}

void check_index(uint32_t i, size_t nfds) { check(i == BackendHandover::kNoFd || i < nfds); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t nfds = data[0] % 32;
  BackendHandover h;
  try {
    h = BackendHandover::parse(std::span<const uint8_t>(data + 1, size - 1), nfds, "fuzz");
  } catch (const std::invalid_argument&) {
    return 0;
  }
  check_index(h.listener, nfds);
  check_index(h.listener_handle, nfds);
  check_index(h.connection, nfds);
  check_index(h.backend_req, nfds);
  check_index(h.inflight, nfds);
  for (const auto& r : h.regions) check(r.fd < nfds);
  for (const auto& q : h.queues) {
    check_index(q.kick, nfds);
    check_index(q.call, nfds);
    check_index(q.err, nfds);
  }
  const std::vector<uint8_t> once = h.serialize();
  const BackendHandover again = BackendHandover::parse(once, nfds, "fuzz (again)");
  check(again.serialize() == once);
  return 0;
}
