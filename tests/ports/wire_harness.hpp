#pragma once
// A network namespace of the test process's own with a veth pair standing
// for a VF's netdev ("vf0") and the wire behind it ("wire0"), and the
// test's frames: broadcast, a local experimental ethertype, a sequence
// number in the first payload bytes.
#include <arpa/inet.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "support/process.hpp"

namespace sriovd::ports::wire {

constexpr uint16_t kEthertype = 0x88b5;  // local experimental

// Enters a new network namespace (and, with `own_sysfs`, a mount namespace
// with /sys mounted for it: sysfs shows the namespace that mounted it) and
// makes wire0 <-> vf0 there at `mtu`, up, without IPv6 (its router and
// multicast chatter would arrive between the test's frames). Returns why
// the test must skip, or "" when all is in place.
// `queues`: RX and TX queues of each end (a multi-queue VF's netdev).
inline std::string enter_private_netns(bool own_sysfs, unsigned mtu = 9000, unsigned queues = 1) {
  if (::unshare(CLONE_NEWNET | (own_sysfs ? CLONE_NEWNS : 0)) != 0)
    return std::string("needs root (CAP_SYS_ADMIN) for a private network namespace: ") + std::strerror(errno);
  if (own_sysfs) {
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("sysfs", "/sys", "sysfs", 0, nullptr) != 0)
      return std::string("mounting a sysfs for the test's network namespace: ") + std::strerror(errno);
  }
  for (const char* path : {"/proc/sys/net/ipv6/conf/all/disable_ipv6", "/proc/sys/net/ipv6/conf/default/disable_ipv6"})
    if (FILE* f = std::fopen(path, "w")) {
      std::fputs("1", f);
      std::fclose(f);
    }
  // veth, not dummy: the kernels here may lack the dummy module.
  const std::string m = std::to_string(mtu);
  for (const auto& cmd : std::vector<std::vector<std::string>>{
           {"/sbin/ip", "link", "add", "wire0", "numtxqueues", std::to_string(queues), "numrxqueues",
            std::to_string(queues), "type", "veth", "peer", "name", "vf0", "numtxqueues", std::to_string(queues),
            "numrxqueues", std::to_string(queues)},
           {"/sbin/ip", "link", "set", "wire0", "mtu", m},
           {"/sbin/ip", "link", "set", "vf0", "mtu", m},
           {"/sbin/ip", "link", "set", "wire0", "up"},
           {"/sbin/ip", "link", "set", "vf0", "up"}}) {
    auto r = test::run(cmd);
    if (r.exit_code != 0) return "'" + cmd[2] + " " + cmd[3] + " " + cmd[4] + "' failed: " + r.output;
  }
  return "";
}

// A packet socket on `ifname` for the test's ethertype (or `ethertype`:
// ETH_P_ALL for every frame).
inline UniqueFd open_wire(const char* ifname = "wire0", uint16_t ethertype = kEthertype) {
  UniqueFd fd(::socket(AF_PACKET, SOCK_RAW | SOCK_CLOEXEC, htons(ethertype)));
  if (!fd) return fd;
  sockaddr_ll a{};
  a.sll_family = AF_PACKET;
  a.sll_protocol = htons(ethertype);
  a.sll_ifindex = static_cast<int>(::if_nametoindex(ifname));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) fd.reset();
  return fd;
}

// `len` bytes in all; `flow` varies the source MAC (what a hash sees).
inline std::vector<uint8_t> frame(uint32_t seq, size_t len, uint8_t flow = 1) {
  std::vector<uint8_t> f(len, static_cast<uint8_t>(seq));
  std::memset(f.data(), 0xff, 6);
  const uint8_t src[6] = {0x02, 0, 0, 0, 0, flow};
  std::memcpy(f.data() + 6, src, 6);
  f[12] = kEthertype >> 8U;
  f[13] = kEthertype & 0xffU;
  std::memcpy(f.data() + 14, &seq, 4);
  return f;
}

inline uint32_t seq_of(const uint8_t* f) {
  uint32_t s = 0;
  std::memcpy(&s, f + 14, 4);
  return s;
}

inline bool is_test_frame(const uint8_t* f, size_t len) {
  return len >= 18 && f[12] == (kEthertype >> 8U) && f[13] == (kEthertype & 0xffU);
}

}  // namespace sriovd::ports::wire
