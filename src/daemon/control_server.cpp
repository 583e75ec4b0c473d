#include "sriovd/daemon/control_server.hpp"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include <spdlog/spdlog.h>

#include "sriovd/util/error.hpp"
#include "sriovd/util/unix_socket.hpp"

namespace sriovd::daemon {

using control::json;
using stream = asio::local::stream_protocol;

class ControlServer::Session : public std::enable_shared_from_this<Session> {
 public:
  Session(ControlServer& server, uint64_t id, stream::socket socket, PeerCredentials peer)
      : server_(server), id_(id), socket_(std::move(socket)), peer_(peer),
        buffer_(control::kMaxLineBytes) {}

  void start() { read_next(); }

  // Sends one line and then closes: for refusals.
  void refuse(const json& reply) {
    write_line(reply, /*close_after=*/true);
  }

  void close() {
    boost::system::error_code ignored;
    socket_.shutdown(stream::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

 private:
  void read_next() {
    asio::async_read_until(socket_, buffer_, '\n',
                           [self = shared_from_this()](boost::system::error_code ec, size_t n) {
                             self->on_line(ec, n);
                           });
  }

  void on_line(boost::system::error_code ec, size_t n) {
    if (ec == asio::error::not_found) {
      // streambuf full before a newline: a request longer than the limit.
      ++server_.stats_.errors;
      write_line(control::make_error(control::errc::kLineTooLong,
                                     "request line longer than " +
                                         std::to_string(control::kMaxLineBytes) + " bytes"),
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
    json request = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (request.is_discarded())
      return control::make_error(control::errc::kBadJson, "request is not valid JSON");
    json reply;
    if (!request.is_object() || !request.contains("cmd") || !request["cmd"].is_string()) {
      reply = control::make_error(control::errc::kBadRequest,
                                  "request must be a JSON object with a string \"cmd\"");
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
};

ControlServer::ControlServer(asio::io_context& io, const config::Control& cfg, Handler handler)
    : io_(io), path_(cfg.socket), allowed_uids_(cfg.allowed_uids), handler_(std::move(handler)),
      acceptor_(io) {
  listen_unix(acceptor_, path_, 0660, "control socket");
  apply_group(cfg);
  accept_next();
  spdlog::info("control API listening on {}", path_);
}

ControlServer::~ControlServer() { stop(); }

void ControlServer::stop() {
  if (stopped_) return;
  stopped_ = true;
  boost::system::error_code ignored;
  acceptor_.close(ignored);
  for (auto& [id, session] : sessions_) session->close();
  sessions_.clear();
  stats_.active = 0;
  ::unlink(path_.c_str());
}

void ControlServer::apply_group(const config::Control& cfg) {
  if (!cfg.gid) return;
  if (::chown(path_.c_str(), static_cast<uid_t>(-1), *cfg.gid) != 0)
    throw_errno("setting group " + cfg.group + " on " + path_);
}

void ControlServer::update_access(const config::Control& cfg) {
  apply_group(cfg);
  allowed_uids_ = cfg.allowed_uids;
}

bool ControlServer::allowed(uid_t uid) const {
  return allowed_uids_.empty() ||
         std::find(allowed_uids_.begin(), allowed_uids_.end(), uid) != allowed_uids_.end();
}

void ControlServer::accept_next() {
  acceptor_.async_accept([this](boost::system::error_code ec, stream::socket socket) {
    if (ec == asio::error::operation_aborted || stopped_) return;
    if (ec) {
      spdlog::warn("control accept failed: {}", ec.message());
      accept_next();
      return;
    }
    const std::optional<ucred> cred = peer_credentials(socket.native_handle());
    PeerCredentials peer;
    if (cred) peer = {cred->pid, cred->uid, cred->gid};
    const uint64_t id = next_session_++;
    auto session = std::make_shared<Session>(*this, id, std::move(socket), peer);
    sessions_.emplace(id, session);
    ++stats_.connections;
    ++stats_.active;
    if (!cred || !allowed(peer.uid)) {
      // Fails closed: a peer the kernel cannot name is not uid 0.
      ++stats_.rejected_peers;
      const std::string why = cred ? "peer uid " + std::to_string(peer.uid) + " is not in control.allowed_uids"
                                   : std::string("the peer's credentials cannot be read (SO_PEERCRED)");
      spdlog::warn("control: refused peer pid {}: {}", peer.pid, why);
      session->refuse(control::make_error(control::errc::kPermissionDenied, why));
    } else {
      session->start();
    }
    accept_next();
  });
}

}  // namespace sriovd::daemon
