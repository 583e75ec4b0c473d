#pragma once
// sriovd as a kubelet device plugin (the v1beta1 API over gRPC): one
// DevicePlugin server per resource pool on its own socket in the
// device-plugin directory, registered with the kubelet (Registration on
// kubelet.sock) and registered again whenever the kubelet re-creates that
// socket (it does at every start, and removes the plugins' sockets then).
// ListAndWatch streams each pool's devices with their health and NUMA node
// and a new list whenever update() changes them. Allocate hands out what a
// container needs: for a VF its VFIO device nodes, PCIDEVICE_<RESOURCE>
// (and _INFO, as sriov-network-device-plugin names them) and
// PCI_RESOURCE_<RESOURCE> (KubeVirt's host devices); for a virtio device
// its socket as a mount; CDI device names, with the CDI spec of each pool
// written (atomically) in the CDI directory.
//
// update() is the daemon's (control thread); the gRPC threads read the
// pools under a lock. Nothing here is on a data plane.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace sriovd::k8s {

struct Device {
  std::string id;  // a VF: its PCI address; a virtio device: its name
  bool healthy = false;
  int numa_node = -1;  // -1: none known
  // A VF: its PF (for packing) and IOMMU group (-1: not bound to vfio-pci).
  std::string pf;
  int iommu_group = -1;
  // A virtio device: the socket its VMM connects to.
  std::string socket;
  bool operator==(const Device&) const = default;
};

struct Pool {
  std::string resource;  // "vendor.domain/name"
  std::vector<Device> devices;
  bool operator==(const Pool&) const = default;
};

// "intel.com/sriov_vf" -> "INTEL_COM_SRIOV_VF" (sriov-network-device-plugin's
// environment naming: upper case, every other character an underscore).
std::string env_name(const std::string& resource);

class NodeAgent {
 public:
  // Serves nothing until update() gives it pools.
  NodeAgent(std::string plugin_dir, std::string cdi_dir);
  ~NodeAgent();
  NodeAgent(const NodeAgent&) = delete;
  NodeAgent& operator=(const NodeAgent&) = delete;

  // The pools as they are now: a new pool's server starts and registers, a
  // pool that went stops (its socket and CDI spec removed), a changed one
  // streams its new list to every ListAndWatch. Throws naming the socket
  // when a server cannot start.
  void update(std::vector<Pool> pools);

  // Per pool: socket, registered, registrations, allocations, refusals.
  [[nodiscard]] nlohmann::json status() const;

  static constexpr const char* kKubeletSocket = "kubelet.sock";

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sriovd::k8s
