#pragma once
// What the two wire-protocol harnesses share: a socket directory of their
// own that goes with the process, and the loop that lets the server (on an
// io_context the harness runs itself) handle what was sent while the
// harness reads and drops the replies, so the server never waits on it.
#include <sys/socket.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "sriovd/util/asio.hpp"
#include "sriovd/util/fd.hpp"
#include "sriovd/util/unix_socket.hpp"

namespace sriovd::fuzz {

// /tmp/sriovd-fuzz-TAG-PID, removed at exit (the harness's world is never
// destroyed: the fuzzer may stop anywhere).
inline std::filesystem::path socket_dir(const std::string& tag) {
  static std::filesystem::path dir;
  dir = std::filesystem::temp_directory_path() / ("sriovd-fuzz-" + tag + "-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::atexit([] {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  });
  return dir;
}

// Replies (and any fds in them) read and dropped.
inline void drain(int sock) {
  uint8_t buf[16384];
  std::vector<UniqueFd> fds;
  bool truncated = false;
  while (sock >= 0 && recv_with_fds(sock, buf, sizeof buf, fds, MSG_DONTWAIT, truncated) > 0) fds.clear();
}

// Runs the server's handlers until nothing is left to do (bounded).
inline void settle(asio::io_context& io, int sock) {
  for (int i = 0; i < 8; ++i) {
    io.restart();
    if (io.poll() == 0) break;
    drain(sock);
  }
  drain(sock);
}

}  // namespace sriovd::fuzz
