#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sriovd/config/config.hpp"
#include "sriovd/control/protocol.hpp"
#include "sriovd/util/asio.hpp"
#include "sriovd/util/peer_session.hpp"

namespace sriovd::daemon {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

// Serves the control API on a Unix socket (mode 0660, group from config).
// Each connection is checked with SO_PEERCRED against the allow-list and then
// sends JSON request lines; the handler's replies go back in order. Runs on
// the control thread's io_context; any number of clients at once.
class ControlServer {
 public:
  using Handler = std::function<control::json(const control::json& request, const PeerCredentials&)>;

  struct Stats {
    uint64_t connections = 0;
    uint64_t active = 0;
    uint64_t requests = 0;
    uint64_t errors = 0;          // replies with ok=false
    uint64_t rejected_peers = 0;  // refused by the allow-list, or with no room
    uint64_t evicted = 0;         // waiting connections closed to make room for a new one
  };

  // Binds the socket, replacing a stale one; throws when another daemon
  // answers on it or the path cannot be used.
  ControlServer(asio::io_context& io, const config::Control& cfg, Handler handler);
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  // Applies a reloaded allow-list and group (the socket path cannot change).
  void update_access(const config::Control& cfg);
  // Closes the listener and every connection.
  void stop();

  [[nodiscard]] const Stats& stats() const { return stats_; }
  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  class Session;
  std::shared_ptr<Session> open_session(UniqueFd fd, PeerCredentials peer);
  std::string make_room(uid_t uid);

  asio::io_context& io_;
  std::string path_;
  Handler handler_;
  std::map<uint64_t, std::shared_ptr<Session>> sessions_;
  uint64_t next_session_ = 0;
  Stats stats_;
  bool stopped_ = false;
  std::unique_ptr<UnixListener> listener_;  // last: it calls into the above
};

}  // namespace sriovd::daemon
