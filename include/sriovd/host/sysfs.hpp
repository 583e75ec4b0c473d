#pragma once

#include <optional>
#include <string>

#include "sriovd/util/pci_address.hpp"

namespace sriovd::host {

// Where a VF sits: its PF and its index among the PF's virtfn links.
struct VfIdentity {
  PciAddress vf;
  PciAddress pf;
  unsigned index = 0;
};

// Reads <sysfs_root>/bus/pci/devices/<vf>/physfn and the PF's virtfn<N>
// links. nullopt when the device is not a VF (or is gone).
std::optional<VfIdentity> resolve_vf(const std::string& sysfs_root, const PciAddress& vf);

// The PCI function behind a netdev (<sysfs_root>/class/net/<netdev>/device).
std::optional<PciAddress> pci_address_of_netdev(const std::string& sysfs_root, const std::string& netdev);

}  // namespace sriovd::host
