#pragma once
// A gRPC server on a Unix socket that only root and the daemon's own uid
// may use - as the kubelet runs. The socket is ours (a SocketFile, 0600):
// connections are accepted here, their peer checked (SO_PEERCRED), and
// handed to the gRPC server, which has no listening port of its own; its
// threads are capped. Used by the device plugin's pools and the DRA
// driver's registration and service sockets.
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "sriovd/util/fd.hpp"
#include "sriovd/util/unix_socket.hpp"

namespace sriovd::k8s {

class LocalGrpcServer {
 public:
  // Starts serving `services` on `socket_path` (a stale file there is
  // replaced); `what` names it in messages; each peer refused is counted
  // in `refused_peers` (the caller's: it outlives this server). Throws
  // std::runtime_error.
  LocalGrpcServer(const std::string& socket_path, const std::vector<grpc::Service*>& services, std::string what,
                  int max_threads, std::atomic<uint64_t>& refused_peers);
  ~LocalGrpcServer();
  LocalGrpcServer(const LocalGrpcServer&) = delete;
  LocalGrpcServer& operator=(const LocalGrpcServer&) = delete;

  // Stops accepting and removes the socket file if it is still ours.
  void close_socket();
  // Then ends the calls under way by `deadline` (close_socket() first if
  // it was not).
  void shutdown(std::chrono::steady_clock::time_point deadline);
  [[nodiscard]] const std::string& path() const { return socket_.path(); }

 private:
  void accept_loop();
  std::string what_;
  std::unique_ptr<grpc::Server> server_;
  SocketFile socket_;
  UniqueFd listener_, wake_;
  std::thread acceptor_;
  std::atomic<uint64_t>& refused_peers_;
};

}  // namespace sriovd::k8s
