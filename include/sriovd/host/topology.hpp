#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sriovd/pci/config_space.hpp"
#include "sriovd/util/pci_address.hpp"

namespace sriovd::host {

struct PciDeviceInfo {
  PciAddress address;
  uint16_t vendor = 0;
  uint16_t device = 0;
  uint32_t class_code = 0;  // base class, subclass, prog-if
  std::string driver;       // "" when unbound
  int iommu_group = -1;
  int numa_node = -1;
  std::vector<std::string> netdevs;
  std::optional<pci::MsixLayout> msix;  // the MSI-X capability as the device reports it
  bool sriov = false;                   // has the SR-IOV extended capability
  uint16_t total_vfs = 0;
  uint16_t num_vfs = 0;
  std::optional<PciAddress> physfn;
  int vf_index = -1;
};

// Every PCI function under <sysfs_root>/bus/pci, read with libpci (ids,
// class, capabilities, driver, IOMMU group, NUMA node) plus the SR-IOV
// links libpci does not expose. Throws with libpci's message on failure.
std::vector<PciDeviceInfo> scan_pci(const std::string& sysfs_root);

}  // namespace sriovd::host
