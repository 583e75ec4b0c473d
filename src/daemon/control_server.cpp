#include "control_server.hpp"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include <spdlog/spdlog.h>

#include "sriovd/util/error.hpp"
#include "sriovd/util/peer_session.hpp"

namespace sriovd::daemon {

using control::json;
using stream = asio::local::stream_protocol;

namespace {

// A connection that sends no complete request for this long is closed: an
// idle one holds an fd of the daemon's and one of the sessions below.
constexpr std::chrono::seconds kIdleDeadline{60};
// Sessions open at once (the fd limit outside the unit is 1024, and
// everything else needs fds too), and one user's share of them. A new
// connection past either takes the place of a waiting one (idle, or
// sending its request slowly): of its own user's past the share, else of
// the user holding the most, the longest waiting first. So an operator
// always gets in, whatever any number of idle or slow connections do.
constexpr size_t kMaxSessions = 64;
constexpr size_t kMaxSessionsPerUser = 16;
// Arrays and objects nested deeper than this are refused before parsing:
// a value is copied and printed recursively (the "id" goes back in the
// reply), and 30,000 levels overflow the stack.
constexpr int kMaxNesting = 64;

bool nests_deeper_than(const std::string& line, int limit) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (in_string) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

}  // namespace

class ControlServer::Session : public std::enable_shared_from_this<Session> {
 public:
  Session(ControlServer& server, uint64_t id, stream::socket socket, PeerCredentials peer)
      : server_(server),
        id_(id),
        socket_(std::move(socket)),
        peer_(peer),
        buffer_(control::kMaxLineBytes),
        idle_(socket_.get_executor()) {}

  void start() { read_next(); }

  // Waiting for a request (not handling one or writing its reply): it may
  // give its place to a new connection.
  [[nodiscard]] bool waiting() const { return waiting_; }
  [[nodiscard]] std::chrono::steady_clock::time_point waiting_since() const { return waiting_since_; }
  [[nodiscard]] uid_t uid() const { return peer_.uid; }
  [[nodiscard]] uint64_t id() const { return id_; }
  // Gives its place: told why, then closed.
  void evict(const std::string& why) {
    waiting_ = false;
    idle_.cancel();
    socket_.cancel();
    refuse(control::make_error(control::errc::kFailed, why));
  }

  // Sends one line and then closes: for refusals.
  void refuse(const json& reply) { write_line(reply, /*close_after=*/true); }

  void close() {
    boost::system::error_code ignored;
    idle_.cancel();
    socket_.shutdown(stream::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

 private:
  void read_next() {
    waiting_ = true;
    waiting_since_ = std::chrono::steady_clock::now();
    idle_.expires_after(kIdleDeadline);
    idle_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (!ec) self->finish();  // no request within the deadline
    });
    asio::async_read_until(socket_, buffer_, '\n', [self = shared_from_this()](boost::system::error_code ec, size_t n) {
      self->on_line(ec, n);
    });
  }

  void on_line(boost::system::error_code ec, size_t n) {
    if (!waiting_) return;  // evicted: its read was cancelled
    waiting_ = false;
    idle_.cancel();
    if (ec == asio::error::not_found) {
      // streambuf full before a newline: a request longer than the limit.
      ++server_.stats_.errors;
      write_line(control::make_error(control::errc::kLineTooLong,
                                     "request line longer than " + std::to_string(control::kMaxLineBytes) + " bytes"),
                 true);
      return;
    }
    if (ec) {
      finish();
      return;
    }
    std::string line(asio::buffers_begin(buffer_.data()),
                     asio::buffers_begin(buffer_.data()) + static_cast<std::ptrdiff_t>(n - 1));
    buffer_.consume(n);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) {
      read_next();  // blank lines are keep-alives
      return;
    }
    ++server_.stats_.requests;
    json reply = dispatch(line);
    if (!reply.value("ok", false)) ++server_.stats_.errors;
    write_line(reply, false);
  }

  json dispatch(const std::string& line) {
    if (nests_deeper_than(line, kMaxNesting))
      return control::make_error(control::errc::kBadRequest, "request nests arrays or objects deeper than " +
                                                                 std::to_string(kMaxNesting) + " levels");
    json request = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (request.is_discarded()) return control::make_error(control::errc::kBadJson, "request is not valid JSON");
    json reply;
    if (!request.is_object() || !request.contains("cmd") || !request["cmd"].is_string()) {
      reply = control::make_error(control::errc::kBadRequest, "request must be a JSON object with a string \"cmd\"");
    } else {
      try {
        reply = server_.handler_(request, peer_);
      } catch (const std::exception& e) {
        reply = control::make_error(control::errc::kFailed, e.what());
      }
    }
    if (request.is_object() && request.contains("id")) reply["id"] = request["id"];
    return reply;
  }

  void write_line(const json& reply, bool close_after) {
    out_ = reply.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
    asio::async_write(socket_, asio::buffer(out_),
                      [self = shared_from_this(), close_after](boost::system::error_code ec, size_t) {
                        if (ec || close_after) {
                          self->finish();
                          return;
                        }
                        self->read_next();
                      });
  }

  void finish() {
    close();
    if (server_.sessions_.erase(id_) != 0) --server_.stats_.active;
  }

  ControlServer& server_;
  uint64_t id_;
  stream::socket socket_;
  PeerCredentials peer_;
  asio::streambuf buffer_;
  std::string out_;
  asio::steady_timer idle_;
  bool waiting_ = false;
  std::chrono::steady_clock::time_point waiting_since_{};
};

ControlServer::ControlServer(asio::io_context& io, const config::Control& cfg, Handler handler)
    : io_(io), path_(cfg.socket), handler_(std::move(handler)) {
  listener_ = std::make_unique<UnixListener>(
      io, path_,
      UnixListener::Options{"control socket", "control.allowed_uids", 0660, cfg.allowed_uids,
                            "a connection: " + std::to_string(kMaxSessions) + " control connections are open",
                            std::nullopt, cfg.gid},
      [this](UniqueFd fd, const ucred& peer) {
        const std::string full = make_room(peer.uid);
        if (!full.empty()) {
          ++stats_.rejected_peers;
          open_session(std::move(fd), {})->refuse(control::make_error(control::errc::kFailed, full));
          return;
        }
        open_session(std::move(fd), {peer.pid, peer.uid, peer.gid})->start();
      },
      // Several clients at once (one may watch while another reloads): a
      // full table makes room (make_room), it does not refuse at the door.
      [] { return false; },
      [this](UniqueFd fd, const std::string& why) {
        // Fails closed: the peer is told why, then closed.
        ++stats_.rejected_peers;
        open_session(std::move(fd), {})->refuse(control::make_error(control::errc::kPermissionDenied, why));
      });
  spdlog::info("control API listening on {}", path_);
}

ControlServer::~ControlServer() { stop(); }

void ControlServer::stop() {
  if (stopped_) return;
  stopped_ = true;
  for (auto& [id, session] : sessions_) session->close();
  sessions_.clear();
  stats_.active = 0;
  listener_.reset();  // stops accepting and removes the socket file
}

// A reload's group: given to the socket file the listener made (never by
// path), mode as at the start.
void ControlServer::update_access(const config::Control& cfg) {
  if (!listener_) return;
  if (cfg.gid) listener_->set_access({std::nullopt, cfg.gid, 0660});
  listener_->set_allowed_uids(cfg.allowed_uids);
}

// Room for one more session of `uid`; empty, or why there is none (every
// session that could give its place is handling a request).
std::string ControlServer::make_room(uid_t uid) {
  std::map<uid_t, size_t> held;
  for (const auto& [id, s] : sessions_) ++held[s->uid()];
  const auto evict_one = [&](bool own_only) {
    std::shared_ptr<Session> pick;
    for (const auto& [id, s] : sessions_) {
      if (!s->waiting() || (own_only && s->uid() != uid)) continue;
      if (!pick || held[s->uid()] > held[pick->uid()] ||
          (held[s->uid()] == held[pick->uid()] && s->waiting_since() < pick->waiting_since()))
        pick = s;
    }
    if (!pick) return false;
    ++stats_.evicted;
    --held[pick->uid()];
    sessions_.erase(pick->id());  // its place is free now; the refusal's write keeps it alive
    --stats_.active;
    pick->evict("closed: this connection waited, and another needed its place (" + std::to_string(kMaxSessions) +
                " control connections at most, " + std::to_string(kMaxSessionsPerUser) + " per user)");
    return true;
  };
  if (held[uid] >= kMaxSessionsPerUser && !evict_one(true))
    return "a connection: uid " + std::to_string(uid) + " has " + std::to_string(kMaxSessionsPerUser) +
           " control connections open, each handling a request";
  if (sessions_.size() >= kMaxSessions && !evict_one(false))
    return "a connection: " + std::to_string(kMaxSessions) + " control connections are open, each handling a request";
  return {};
}

std::shared_ptr<ControlServer::Session> ControlServer::open_session(UniqueFd fd, PeerCredentials peer) {
  const uint64_t id = next_session_++;
  auto session = std::make_shared<Session>(*this, id, stream::socket(io_, stream(), fd.release()), peer);
  sessions_.emplace(id, session);
  ++stats_.connections;
  ++stats_.active;
  return session;
}

}  // namespace sriovd::daemon
