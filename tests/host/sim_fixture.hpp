#pragma once
// A simulated host with one PF (0000:3b:00.0, netdev simpf0, 8 VFs of 4
// MSI-X vectors) and the host layer over it.

#include <memory>

#include "sriovd/config/loader.hpp"
#include "sriovd/host/host_control.hpp"
#include "sriovd/host/reconciler.hpp"
#include "sriovd/host/simulated_kernel.hpp"
#include "support/temp_dir.hpp"

namespace sriovd::host::test {

inline const PciAddress kPf = *PciAddress::parse("0000:3b:00.0");
// Its first VFs.
inline const PciAddress kVf0 = *PciAddress::parse("0000:3b:02.0");
inline const PciAddress kVf1 = *PciAddress::parse("0000:3b:02.1");
inline const PciAddress kVf2 = *PciAddress::parse("0000:3b:02.2");

inline config::SimulatedPf sim_pf() {
  config::SimulatedPf pf;
  pf.address = kPf;
  pf.netdev = "simpf0";
  pf.total_vfs = 8;
  pf.msix_vectors_per_vf = 4;
  return pf;
}

// The YAML header every test config starts with.
inline std::string sim_header() {
  return "version: 1\nhost: simulated\nsimulated:\n  physical_functions:\n"
         "    - {address: \"0000:3b:00.0\", netdev: simpf0, total_vfs: 8, msix_vectors_per_vf: 4}\n";
}

struct SimHost {
  explicit SimHost(std::chrono::milliseconds vf_timeout = std::chrono::seconds(2))
      : kernel(dir.file("sys"), {sim_pf()}), control(kernel, kernel, vf_timeout) {}

  std::unique_ptr<Reconciler> reconciler() {
    return std::make_unique<Reconciler>(control, StateFile(dir.file("state/state.json")));
  }
  static config::Config config(const std::string& body) { return config::parse(sim_header() + body, "test.yaml"); }

  sriovd::test::TempDir dir;
  SimulatedKernel kernel;
  HostControl control;
};

// Three VFs: 0 and 1 for guests (vfio-pci), 2 for the host, with settings.
inline const char* kThreeVfs = R"(physical_functions:
  - address: "0000:3b:00.0"
    num_vfs: 3
    vfs:
      - index: 0
        mac: "02:00:00:00:00:10"
        vlan: 100
        qos: 2
        spoofchk: false
        assign: {owner: vm1, socket: /run/sriovd/vm1.sock}
      - index: 1
        mac: "02:00:00:00:00:11"
        trust: true
        assign: {owner: vm2, socket: /run/sriovd/vm2.sock}
      - index: 2
        link_state: enable
        max_tx_rate: 1000
)";

}  // namespace sriovd::host::test
