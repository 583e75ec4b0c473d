#include "sriovd/ports/netdev.hpp"

#include <linux/if.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <cstring>

#include "sriovd/util/error.hpp"
#include "sriovd/util/fd.hpp"

namespace sriovd::ports {

bool netdev_running(int sock, const std::string& ifname) {
  ifreq ifr{};
  std::strncpy(ifr.ifr_name, ifname.c_str(), IFNAMSIZ - 1);
  if (::ioctl(sock, SIOCGIFFLAGS, &ifr) != 0) return false;  // gone: no link
  return (ifr.ifr_flags & IFF_UP) && (ifr.ifr_flags & IFF_RUNNING);
}

void netdev_set_up(const std::string& ifname) {
  UniqueFd sock(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!sock) throw_errno("socket for " + ifname);
  ifreq ifr{};
  std::strncpy(ifr.ifr_name, ifname.c_str(), IFNAMSIZ - 1);
  if (::ioctl(sock.get(), SIOCGIFFLAGS, &ifr) != 0) throw_errno("netdev " + ifname);
  if (ifr.ifr_flags & IFF_UP) return;
  ifr.ifr_flags = static_cast<short>(ifr.ifr_flags | IFF_UP);
  if (::ioctl(sock.get(), SIOCSIFFLAGS, &ifr) != 0) throw_errno("bringing " + ifname + " up");
}

bool netdev_address(const std::string& ifname, uint8_t (&mac)[6]) {
  UniqueFd sock(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!sock) return false;
  ifreq ifr{};
  std::strncpy(ifr.ifr_name, ifname.c_str(), IFNAMSIZ - 1);
  if (::ioctl(sock.get(), SIOCGIFHWADDR, &ifr) != 0) return false;
  std::memcpy(mac, ifr.ifr_hwaddr.sa_data, 6);
  return true;
}

}  // namespace sriovd::ports
