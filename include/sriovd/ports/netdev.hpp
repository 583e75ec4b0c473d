#pragma once
// A netdev's state through SIOCGIFFLAGS/SIOCGIFHWADDR: what the ports and
// the daemon ask of the netdev a port is attached to.

#include <cstdint>
#include <string>

namespace sriovd::ports {

// IFF_UP and IFF_RUNNING of netdev `ifname` (its carrier), asked through
// any socket `sock`; false when it is gone.
bool netdev_running(int sock, const std::string& ifname);
// Sets IFF_UP on netdev `ifname` (a VF's netdev that sriovd bridges: its
// udev rule keeps other managers off it, so nobody else will). Throws.
void netdev_set_up(const std::string& ifname);
// The netdev's hardware address (6 bytes into `mac`); false when it has none.
bool netdev_address(const std::string& ifname, uint8_t (&mac)[6]);

}  // namespace sriovd::ports
