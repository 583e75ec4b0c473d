#pragma once

#include <chrono>
#include <string>

#include "sriovd/control/protocol.hpp"
#include "sriovd/util/fd.hpp"

namespace sriovd::control {

// A blocking client of the control socket, for sriovctl and tests. Each call
// is bounded by the timeout given at connect time.
class Client {
 public:
  // Throws SystemError naming the socket when it cannot connect.
  Client(const std::string& socket_path, std::chrono::milliseconds timeout);

  // Sends one request line and returns the parsed reply line. Throws
  // std::runtime_error on timeout, a closed connection or a malformed reply.
  json request(const json& req);

  // Sends raw bytes and returns the next reply line unparsed (for tests of
  // malformed input). Returns "" when the daemon closed the connection.
  std::string send_raw(const std::string& bytes);

 private:
  void write_all(const std::string& bytes);
  std::string read_line();

  std::string path_;
  std::chrono::milliseconds timeout_;
  UniqueFd fd_;
  std::string buffer_;
};

}  // namespace sriovd::control
