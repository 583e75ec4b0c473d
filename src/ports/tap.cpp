#include "sriovd/ports/tap.hpp"

#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cstring>
#include <exception>
#include <thread>

#include "sriovd/util/error.hpp"
#include "sriovd/util/netlink.hpp"

namespace sriovd::ports {

unsigned tun_offload_flags(bool csum, bool tso4, bool tso6, bool tso_ecn, bool ufo) {
  return (csum ? TUN_F_CSUM : 0U) | (tso4 ? TUN_F_TSO4 : 0U) | (tso6 ? TUN_F_TSO6 : 0U) |
         (tso_ecn ? TUN_F_TSO_ECN : 0U) | (ufo ? TUN_F_UFO : 0U);
}

namespace {

void move_to_netns(const std::string& ifname, const std::string& netns);
void set_up(const std::string& ifname);

std::vector<UniqueFd> open_tun(const std::string& name, unsigned queues) {
  if (queues == 0) queues = 1;
  std::vector<UniqueFd> fds;
  for (unsigned q = 0; q < queues; ++q) {
    UniqueFd fd(::open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC));
    if (!fd) throw_errno("opening /dev/net/tun for tap " + name);
    ifreq ifr{};
    ifr.ifr_flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR | (queues > 1 ? IFF_MULTI_QUEUE : 0);
    std::strncpy(ifr.ifr_name, name.c_str(), IFNAMSIZ - 1);
    if (::ioctl(fd.get(), TUNSETIFF, &ifr) != 0) throw_errno("TUNSETIFF " + name);
    fds.push_back(std::move(fd));
  }
  return fds;
}

}  // namespace

Tap::Tap(std::string name, std::vector<UniqueFd> fds)
    : name_(std::move(name)), fds_(std::move(fds)), active_queues_(static_cast<unsigned>(fds_.size())) {
  for (auto& fd : fds_) {
    int hdr = 12;  // struct virtio_net_hdr_v1 (virtio 1.2 §5.1.6)
    if (::ioctl(fd.get(), TUNSETVNETHDRSZ, &hdr) != 0) throw_errno("TUNSETVNETHDRSZ on " + name_);
  }
  set_offloads(0);
}

std::unique_ptr<Tap> Tap::adopt(const std::string& name, std::vector<UniqueFd> fds) {
  if (fds.empty()) throw std::runtime_error("tap " + name + ": no queue fds handed over");
  for (const UniqueFd& fd : fds) {
    ifreq ifr{};
    if (::ioctl(fd.get(), TUNGETIFF, &ifr) != 0 || name != ifr.ifr_name)
      throw std::runtime_error("tap " + name + ": a handed-over fd is not one of its queues");
  }
  return std::unique_ptr<Tap>(new Tap(name, std::move(fds)));
}

Tap::Tap(const std::string& name, unsigned queues, const std::string& netns) : Tap(name, open_tun(name, queues)) {
  if (netns.empty()) {
    set_up(name);
  } else {
    move_to_netns(name, netns);
    // Up from inside the namespace: a helper thread enters it, so this
    // process's own threads never change namespace.
    std::exception_ptr error;
    std::thread([&] {
      try {
        UniqueFd ns(::open(("/run/netns/" + netns).c_str(), O_RDONLY | O_CLOEXEC));
        if (!ns || ::setns(ns.get(), CLONE_NEWNET) != 0) throw_errno("entering network namespace " + netns);
        set_up(name);
      } catch (...) {
        error = std::current_exception();
      }
    }).join();
    if (error) std::rethrow_exception(error);
  }
}

Tap::~Tap() = default;

// With IFF_VNET_HDR the tap takes and gives the virtio-net header as it is.
ssize_t Tap::send(unsigned q, const iovec* iov, int count) { return ::writev(fds_[q].get(), iov, count); }
ssize_t Tap::recv(unsigned q, uint8_t* buf, size_t size) { return ::read(fds_[q].get(), buf, size); }

void Tap::set_offloads(unsigned tun_flags) {
  if (tun_flags == offloads_) return;
  offloads_ = ~0U;  // unknown until every queue has them
  for (auto& fd : fds_)
    if (::ioctl(fd.get(), TUNSETOFFLOAD, tun_flags) != 0) throw_errno("TUNSETOFFLOAD on tap " + name_);
  offloads_ = tun_flags;
}

namespace {

void set_up(const std::string& ifname) {
  UniqueFd sock(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  ifreq ifr{};
  std::strncpy(ifr.ifr_name, ifname.c_str(), IFNAMSIZ - 1);
  if (::ioctl(sock.get(), SIOCGIFFLAGS, &ifr) != 0) throw_errno("reading flags of " + ifname);
  ifr.ifr_flags = static_cast<short>(ifr.ifr_flags | IFF_UP);
  if (::ioctl(sock.get(), SIOCSIFFLAGS, &ifr) != 0) throw_errno("bringing " + ifname + " up");
}

// RTM_NEWLINK with IFLA_NET_NS_FD (what `ip link set netns` sends), by libnl.
void move_to_netns(const std::string& ifname, const std::string& netns) {
  UniqueFd ns(::open(("/run/netns/" + netns).c_str(), O_RDONLY | O_CLOEXEC));
  if (!ns) throw_errno("opening network namespace " + netns + " (create it with ip netns add)");
  const nl::Sock sk = nl::route_socket();
  int err = 0;
  const nl::Link orig = nl::get_link(sk.get(), ifname, &err);
  if (orig) {
    const nl::Link change(rtnl_link_alloc());
    rtnl_link_set_ns_fd(change.get(), static_cast<uint32_t>(ns.get()));
    err = rtnl_link_change(sk.get(), orig.get(), change.get(), 0);
  }
  if (err < 0)
    throw std::runtime_error("moving tap " + ifname + " into network namespace " + netns + ": " + nl_geterror(err));
}

}  // namespace

void Tap::set_active_queues(unsigned n) {
  if (fds_.size() < 2 || n == active_queues_) return;
  active_queues_ = ~0U;  // unknown until every queue is where it should be
  for (size_t q = 0; q < fds_.size(); ++q) {
    ifreq ifr{};
    ifr.ifr_flags = q < n ? IFF_ATTACH_QUEUE : IFF_DETACH_QUEUE;
    // EINVAL: already in that state.
    if (::ioctl(fds_[q].get(), TUNSETQUEUE, &ifr) != 0 && errno != EINVAL)
      throw_errno(name_ + ": TUNSETQUEUE on queue " + std::to_string(q));
  }
  active_queues_ = n;
}

}  // namespace sriovd::ports
