#pragma once
// What daemon.cpp and control.cpp (the control views) share, and nothing
// outside src/daemon uses.
#include <cstddef>
#include <cstdint>
#include <string>

#include "sriovd/config/config.hpp"
#include "sriovd/control/client.hpp"
#include "sriovd/util/counters.hpp"
#include "sriovd/util/unix_socket.hpp"
#include "sriovd/vfio_user/server.hpp"
#include "sriovd/vhost_user/backend.hpp"

namespace sriovd::daemon {

// The VFs the config asks for, over all PFs.
size_t count_vfs(const config::Config& cfg);
// "1 PF(s), 2 VF(s), 0 virtio device(s), host simulated"
std::string summary(const config::Config& cfg);

// Whether an assigned VF can serve its owner, from `sriovctl devices`' view
// of it and its PF: bound to vfio-pci, assigned, its IOMMU group viable, and
// its PF's link up (a PF without link - its cable, its switch port - makes
// every VF on it useless). The device plugin's and DRA's health and the
// metric sriovd_vf_healthy.
inline bool assigned_vf_healthy(const control::json& host_pf, const control::json& host_vf) {
  return host_vf.value("driver", "") == "vfio-pci" && host_vf.value("state", "") == "assigned" &&
         host_vf.value("group_viable", false) && host_pf.value("link", "up") == "up";
}

// A config's socket access as the socket code takes it.
inline SocketAccess access_of(const config::SocketAccess& a) { return {a.uid, a.gid, a.mode}; }

// A stats struct as JSON, one key per counter of its table.
template <typename T, size_t N>
control::json counters_json(const T& value, const Counter<T> (&table)[N]) {
  control::json j = control::json::object();
  for (const Counter<T>& c : table) j[c.name] = value.*c.field;
  return j;
}

// What a virtio device's VMM connection counts, whichever transport: the
// counters vhost-user's back-end and the vfio-user server have in common.
struct PeerCounters {
  uint64_t connections = 0, messages = 0, protocol_errors = 0, refused_peers = 0;
  static PeerCounters of(const vhost_user::BackendStats& s) {
    return {s.connections, s.messages, s.protocol_errors, s.refused_peers};
  }
  static PeerCounters of(const vfio_user::ServerStats& s) {
    return {s.connections, s.messages, s.protocol_errors, s.refused_peers};
  }
};
inline constexpr Counter<PeerCounters> kPeerCounters[] = {
    {"connections", "VMM connections", &PeerCounters::connections},
    {"messages", "protocol messages handled", &PeerCounters::messages},
    {"protocol_errors", "connections ended for a malformed message", &PeerCounters::protocol_errors},
    {"refused_peers", "connections refused (peer credentials, one VMM at a time)", &PeerCounters::refused_peers},
};

}  // namespace sriovd::daemon
