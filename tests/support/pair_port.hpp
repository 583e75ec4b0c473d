#pragma once
// A packet port for device tests: each queue one end of a SOCK_SEQPACKET
// pair whose other end (peer(q)) stands for the wire behind that queue, so
// every frame is checked byte for byte at both ends.
#include <sys/socket.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/virtio/port.hpp"

namespace sriovd::test {

// A port of `queues` queues, each one end of a socketpair whose other end
// (peer(q)) stands for the wire behind that queue.
class PairPort : public virtio::PacketPort {
 public:
  explicit PairPort(unsigned queues = 1) : ours_(queues), peers_(queues) {
    for (unsigned q = 0; q < queues; ++q) {
      int sv[2];
      if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0)
        throw std::runtime_error("socketpair");
      ours_[q].reset(sv[0]);
      peers_[q].reset(sv[1]);
    }
  }
  const std::string& name() const override { return name_; }
  unsigned queues() const override { return static_cast<unsigned>(ours_.size()); }
  int fd(unsigned q) const override { return ours_.at(q).get(); }
  ssize_t send(unsigned q, const iovec* iov, int count) override {
    msghdr m{};
    m.msg_iov = const_cast<iovec*>(iov);
    m.msg_iovlen = static_cast<size_t>(count);
    return ::sendmsg(ours_[q].get(), &m, MSG_DONTWAIT);
  }
  ssize_t recv(unsigned q, uint8_t* buf, size_t size) override {
    return ::recv(ours_[q].get(), buf, size, MSG_DONTWAIT);
  }
  void set_offloads(unsigned) override {}
  void set_active_queues(unsigned n) override { active.store(n); }
  bool link_up() const override { return link.load(); }
  int peer(unsigned q = 0) const { return peers_.at(q).get(); }
  std::atomic<bool> link{true};
  std::atomic<unsigned> active{0};  // the last set_active_queues

 private:
  std::string name_ = "pair0";
  std::vector<UniqueFd> ours_, peers_;
};

}  // namespace sriovd::test
