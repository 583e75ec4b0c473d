#include "sriovd/host/topology.hpp"

#include <algorithm>
#include <csetjmp>
#include <cstdarg>
#include <cstdio>
#include <filesystem>
#include <stdexcept>

extern "C" {
#include <pci/pci.h>
}

#include "sriovd/host/sysfs_io.hpp"

namespace sriovd::host {

namespace {

// libpci's error callback must not return. It jumps back into scan_raw();
// only plain C data lives between the setjmp and the longjmp.
thread_local std::jmp_buf* g_jump = nullptr;
thread_local char g_error[512];

__attribute__((noreturn)) void on_error(char* msg, ...) {
  va_list args;
  va_start(args, msg);
  std::vsnprintf(g_error, sizeof g_error, msg, args);
  va_end(args);
  if (g_jump) std::longjmp(*g_jump, 1);
  std::abort();
}
void on_quiet(char*, ...) {}

struct RawDevice {
  unsigned domain, bus, dev, func;
  unsigned vendor, device, class_code;
  int numa_node;
  int has_msix;
  unsigned msix_cap, msix_control, msix_table, msix_pba;
  int has_sriov;
  unsigned total_vfs, num_vfs;
  char driver[64];
  int iommu_group;
};

// Fills `out` (capacity `max`); returns the count, or -1 with g_error set.
int scan_raw(const char* bus_path, RawDevice* out, int max) {
  pci_access* pacc = pci_alloc();
  pacc->error = on_error;
  pacc->warning = on_quiet;
  pacc->debug = on_quiet;
  std::jmp_buf jump;
  g_jump = &jump;
  if (setjmp(jump) != 0) {
    // pacc was set before setjmp and not changed since, so it is valid here.
    g_jump = nullptr;
    pci_cleanup(pacc);
    return -1;
  }
  pacc->method = PCI_ACCESS_SYS_BUS_PCI;
  pci_set_param(pacc, const_cast<char*>("sysfs.path"), const_cast<char*>(bus_path));
  pci_init(pacc);
  pci_scan_bus(pacc);
  int n = 0;
  for (pci_dev* d = pacc->devices; d && n < max; d = d->next) {
    pci_fill_info(d, PCI_FILL_IDENT | PCI_FILL_CLASS | PCI_FILL_CAPS | PCI_FILL_EXT_CAPS | PCI_FILL_NUMA_NODE |
                         PCI_FILL_IOMMU_GROUP | PCI_FILL_DRIVER | PCI_FILL_CLASS_EXT);
    RawDevice& r = out[n++];
    r = RawDevice{};
    r.domain = static_cast<unsigned>(d->domain);
    r.bus = d->bus;
    r.dev = d->dev;
    r.func = d->func;
    r.vendor = d->vendor_id;
    r.device = d->device_id;
    r.class_code = (static_cast<unsigned>(d->device_class) << 8U) | d->prog_if;
    r.numa_node = d->numa_node;
    if (pci_cap* cap = pci_find_cap(d, PCI_CAP_ID_MSIX, PCI_CAP_NORMAL)) {
      r.has_msix = 1;
      r.msix_cap = cap->addr;
      r.msix_control = pci_read_word(d, cap->addr + 2);  // Message Control
      r.msix_table = pci_read_long(d, cap->addr + PCI_MSIX_TABLE);
      r.msix_pba = pci_read_long(d, cap->addr + PCI_MSIX_PBA);
    }
    if (pci_cap* cap = pci_find_cap(d, PCI_EXT_CAP_ID_SRIOV, PCI_CAP_EXTENDED)) {
      r.has_sriov = 1;
      r.total_vfs = pci_read_word(d, cap->addr + 0x0e);  // TotalVFs
      r.num_vfs = pci_read_word(d, cap->addr + 0x10);    // NumVFs
    }
    if (const char* drv = pci_get_string_property(d, PCI_FILL_DRIVER))
      std::snprintf(r.driver, sizeof r.driver, "%s", drv);
    const char* group = pci_get_string_property(d, PCI_FILL_IOMMU_GROUP);
    r.iommu_group = group ? std::atoi(group) : -1;
  }
  g_jump = nullptr;
  pci_cleanup(pacc);
  return n;
}

}  // namespace

std::vector<PciDeviceInfo> scan_pci(const std::string& sysfs_root) {
  const std::string bus = sysfs_root + "/bus/pci";
  std::vector<RawDevice> raw(4096);
  const int n = scan_raw(bus.c_str(), raw.data(), static_cast<int>(raw.size()));
  if (n < 0) throw std::runtime_error("libpci scan of " + bus + ": " + g_error);
  RealSysfs sysfs(sysfs_root);
  std::vector<PciDeviceInfo> out;
  out.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const RawDevice& r = raw[static_cast<size_t>(i)];
    PciDeviceInfo info;
    info.address = {r.domain, static_cast<uint8_t>(r.bus), static_cast<uint8_t>(r.dev), static_cast<uint8_t>(r.func)};
    info.vendor = static_cast<uint16_t>(r.vendor);
    info.device = static_cast<uint16_t>(r.device);
    info.class_code = r.class_code;
    info.driver = r.driver;
    info.iommu_group = r.iommu_group;
    info.numa_node = r.numa_node;
    if (r.has_msix) {
      info.msix = pci::MsixLayout{static_cast<uint16_t>(r.msix_cap),
                                  static_cast<uint16_t>((r.msix_control & PCI_MSIX_TABSIZE) + 1),
                                  static_cast<uint8_t>(r.msix_table & PCI_MSIX_BIR),
                                  r.msix_table & ~PCI_MSIX_BIR,
                                  static_cast<uint8_t>(r.msix_pba & PCI_MSIX_BIR),
                                  r.msix_pba & ~PCI_MSIX_BIR};
    }
    info.sriov = r.has_sriov != 0;
    info.total_vfs = static_cast<uint16_t>(r.total_vfs);
    info.num_vfs = static_cast<uint16_t>(r.num_vfs);
    const std::string dir = "bus/pci/devices/" + info.address.to_string();
    info.netdevs = sysfs.list(dir + "/net");
    if (auto pf = sysfs.link_name(dir + "/physfn")) {
      info.physfn = PciAddress::parse(*pf);
      if (info.physfn)
        for (const auto& name : sysfs.list("bus/pci/devices/" + *pf))
          if (name.rfind("virtfn", 0) == 0 &&
              sysfs.link_name("bus/pci/devices/" + *pf + "/" + name) == info.address.to_string())
            info.vf_index = std::stoi(name.substr(6));
    }
    out.push_back(std::move(info));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.address < b.address; });
  return out;
}

}  // namespace sriovd::host
