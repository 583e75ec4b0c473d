#include "sriovd/control/client.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cstring>
#include <stdexcept>

#include "sriovd/util/error.hpp"
#include "sriovd/util/unix_socket.hpp"

namespace sriovd::control {

Client::Client(const std::string& socket_path, std::chrono::milliseconds timeout)
    : path_(socket_path), timeout_(timeout) {
  try {
    fd_ = connect_unix(socket_path, "control socket");
  } catch (const SystemError& e) {
    throw SystemError(e.code().value(), "cannot connect to " + socket_path + " (is sriovd running?)");
  }
}

void Client::write_all(const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::send(fd_.get(), bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("writing to " + path_);
    }
    done += static_cast<size_t>(n);
  }
}

std::string Client::read_line() {
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (;;) {
    if (auto nl = buffer_.find('\n'); nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0)
      throw std::runtime_error("no reply from " + path_ + " within " + std::to_string(timeout_.count()) + " ms");
    pollfd pfd{fd_.get(), POLLIN, 0};
    const int rc = ::poll(&pfd, 1, static_cast<int>(left.count()));
    if (rc < 0 && errno != EINTR) throw_errno("poll on " + path_);
    if (rc <= 0) continue;
    char chunk[4096];
    const ssize_t n = ::recv(fd_.get(), chunk, sizeof chunk, 0);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      if (errno == ECONNRESET) return {};
      throw_errno("reading from " + path_);
    }
    if (n == 0) return {};
    buffer_.append(chunk, static_cast<size_t>(n));
  }
}

std::string Client::send_raw(const std::string& bytes) {
  write_all(bytes);
  return read_line();
}

json Client::request(const json& req) {
  const std::string line = send_raw(req.dump() + "\n");
  if (line.empty()) throw std::runtime_error("sriovd closed the connection on " + path_);
  json reply = json::parse(line, nullptr, false);
  if (reply.is_discarded() || !reply.is_object() || !reply.contains("ok"))
    throw std::runtime_error("malformed reply from sriovd: " + line);
  return reply;
}

}  // namespace sriovd::control
