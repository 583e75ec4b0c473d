// A vhost-user back-end's or a vfio-user server's handover
// (daemon/handover.hpp) as a successor reads it (the first byte: the fd
// count, and with its top bit the vfio-user server's): the bytes come from
// the predecessor, but a successor must not trust a manifest it cannot
// check - any input is refused with std::invalid_argument, or parses into
// a handover whose every fd index is inside the fd list and which
// serializes to bytes that parse to the same handover.
#include <cstdlib>
#include <span>
#include <stdexcept>
#include <vector>

#include "sriovd/vfio_user/server.hpp"
#include "sriovd/vhost_user/backend.hpp"

namespace {

using sriovd::HandedFds;
using sriovd::vfio_user::ServerHandover;
using sriovd::vhost_user::BackendHandover;

void check(bool ok) {
  if (!ok) std::abort();
}

void check_index(uint32_t i, size_t nfds) { check(i == HandedFds::kNoFd || i < nfds); }

void server(std::span<const uint8_t> bytes, size_t nfds) {
  ServerHandover h;
  try {
    h = ServerHandover::parse(bytes, nfds, "fuzz");
  } catch (const std::invalid_argument&) {
    return;
  }
  check_index(h.listener, nfds);
  check_index(h.listener_handle, nfds);
  check_index(h.connection, nfds);
  for (size_t i = 0; i < h.windows.size(); ++i) {
    const auto& w = h.windows[i];
    check_index(w.fd, nfds);
    check(w.size > 0 && w.iova + w.size > w.iova);
    for (size_t j = 0; j < i; ++j)
      check(w.iova >= h.windows[j].iova + h.windows[j].size || h.windows[j].iova >= w.iova + w.size);
  }
  const std::vector<uint8_t> once = h.serialize();
  const ServerHandover again = ServerHandover::parse(once, nfds, "fuzz (again)");
  check(again.serialize() == once);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t nfds = data[0] % 32;
  const std::span<const uint8_t> bytes(data + 1, size - 1);
  if (data[0] & 0x80) {
    server(bytes, nfds);
    return 0;
  }
  BackendHandover h;
  try {
    h = BackendHandover::parse(bytes, nfds, "fuzz");
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
