// vm_host_probe: the host layer's pieces as commands, for scenarios in the
// real-kernel VM that sriovd's config cannot express (the PF itself bound
// to vfio-pci) and for reading what libpci sees.
//   vm_host_probe bind ADDRESS DRIVER   # HostControl binding; DRIVER "" = unbind
//   vm_host_probe group ADDRESS         # viable? and the members
//   vm_host_probe scan                  # libpci's view as JSON lines
#include <cstdio>
#include <string>

#include "sriovd/host/host_control.hpp"
#include "sriovd/host/netlink_vf_link.hpp"
#include "sriovd/host/topology.hpp"

using namespace sriovd;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: vm_host_probe bind ADDRESS DRIVER | group ADDRESS | scan\n");
    return 64;
  }
  const std::string cmd = argv[1];
  try {
    host::RealSysfs sysfs("/sys");
    host::NetlinkVfLink netlink;
    host::HostControl control(sysfs, netlink);
    if (cmd == "scan") {
      for (const auto& d : host::scan_pci("/sys")) {
        nlohmann::json j = {{"address", d.address.to_string()},
                            {"driver", d.driver},
                            {"iommu_group", d.iommu_group},
                            {"sriov", d.sriov},
                            {"total_vfs", d.total_vfs},
                            {"num_vfs", d.num_vfs},
                            {"vf_index", d.vf_index}};
        if (d.msix) j["msix_vectors"] = d.msix->vectors;
        std::printf("%s\n", j.dump().c_str());
      }
      return 0;
    }
    if (argc < 3) return 64;
    auto addr = PciAddress::parse(argv[2]);
    if (!addr) {
      std::fprintf(stderr, "not a PCI address: %s\n", argv[2]);
      return 64;
    }
    if (cmd == "bind" && argc == 4) {
      const std::string driver = argv[3];
      control.set(host::Key{host::KeyKind::binding, *addr},
                  {{"driver", driver}, {"override", driver == "vfio-pci" ? driver : ""}});
      std::printf("%s\n", control.get(host::Key{host::KeyKind::binding, *addr}).dump().c_str());
      return 0;
    }
    if (cmd == "group") {
      const auto report = control.iommu_group(*addr);
      std::printf("group %d viable %d\n", report.group, report.viable() ? 1 : 0);
      for (const auto& m : report.members)
        std::printf("member %s %s\n", m.address.to_string().c_str(), m.driver.c_str());
      return report.viable() ? 0 : 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vm_host_probe: %s\n", e.what());
    return 1;
  }
  return 64;
}
