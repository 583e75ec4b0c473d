#include "local_grpc_server.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

#include <grpcpp/server_posix.h>
#include <spdlog/spdlog.h>

#include "sriovd/util/eventfd.hpp"

namespace sriovd::k8s {

LocalGrpcServer::LocalGrpcServer(const std::string& socket_path, const std::vector<grpc::Service*>& services,
                                 std::string what, int max_threads, std::atomic<uint64_t>& refused_peers)
    : what_(std::move(what)), refused_peers_(refused_peers) {
  grpc::ServerBuilder b;
  grpc::ResourceQuota quota("sriovd " + what_);
  quota.SetMaxThreads(max_threads);
  b.SetResourceQuota(quota);
  for (grpc::Service* s : services) b.RegisterService(s);
  server_ = b.BuildAndStart();
  if (!server_) throw std::runtime_error(what_ + ": cannot start its gRPC server");
  socket_ = SocketFile(socket_path, {std::nullopt, std::nullopt, 0600}, what_ + " socket");
  listener_ = socket_.take_listener();
  wake_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_) throw std::runtime_error(what_ + ": eventfd: " + std::strerror(errno));
  acceptor_ = std::thread([this] { accept_loop(); });
}

LocalGrpcServer::~LocalGrpcServer() { shutdown(std::chrono::steady_clock::now() + std::chrono::milliseconds(200)); }

void LocalGrpcServer::close_socket() {
  if (acceptor_.joinable()) {
    own_eventfd_signal(wake_.get());
    acceptor_.join();
  }
  listener_.reset();
  socket_.remove();
}

void LocalGrpcServer::shutdown(std::chrono::steady_clock::time_point deadline) {
  close_socket();
  if (!server_) return;
  server_->Shutdown(std::chrono::system_clock::now() +
                    std::chrono::duration_cast<std::chrono::system_clock::duration>(std::max(
                        deadline - std::chrono::steady_clock::now(), std::chrono::steady_clock::duration::zero())));
  server_->Wait();
  server_.reset();
}

// A peer that is neither root nor the daemon's uid is closed at once
// (counted, the first of a run logged).
void LocalGrpcServer::accept_loop() {
  const uid_t self = ::geteuid();
  for (;;) {
    pollfd fds[2] = {{listener_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents) return;
    UniqueFd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd) {
      // EMFILE and the like: the peer waits in the backlog; no spinning.
      pollfd w{wake_.get(), POLLIN, 0};
      if (::poll(&w, 1, 100) > 0) return;
      continue;
    }
    const auto peer = peer_credentials(fd.get());
    if (!peer || (peer->uid != 0 && peer->uid != self)) {
      if (refused_peers_++ == 0 || refused_peers_ % 1000 == 0)
        spdlog::warn("kubernetes: {}: refused a peer ({}; {} refused so far)", what_,
                     peer ? "uid " + std::to_string(peer->uid) : std::string("no credentials"), refused_peers_.load());
      continue;
    }
    grpc::AddInsecureChannelFromFd(server_.get(), fd.release());
  }
}

}  // namespace sriovd::k8s
