#include "sriovd/host/sysfs.hpp"

#include <filesystem>
#include <string_view>
#include <system_error>

namespace sriovd::host {

namespace fs = std::filesystem;

std::optional<VfIdentity> resolve_vf(const std::string& sysfs_root, const PciAddress& vf) {
  const fs::path devices = fs::path(sysfs_root) / "bus/pci/devices";
  std::error_code ec;
  const fs::path physfn = fs::read_symlink(devices / vf.to_string() / "physfn", ec);
  if (ec) return std::nullopt;
  auto pf = PciAddress::parse(physfn.filename().string());
  if (!pf) return std::nullopt;
  for (const auto& entry : fs::directory_iterator(devices / pf->to_string(), ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("virtfn", 0) != 0) continue;
    std::error_code link_ec;
    const fs::path target = fs::read_symlink(entry.path(), link_ec);
    if (link_ec) continue;
    if (PciAddress::parse(target.filename().string()) == vf) {
      try {
        return VfIdentity{vf, *pf, static_cast<unsigned>(std::stoul(name.substr(6)))};
      } catch (const std::exception&) {
        return std::nullopt;
      }
    }
  }
  return std::nullopt;
}

std::optional<PciAddress> pci_address_of_netdev(const std::string& sysfs_root, const std::string& netdev) {
  std::error_code ec;
  const fs::path device = fs::read_symlink(fs::path(sysfs_root) / "class/net" / netdev / "device", ec);
  if (ec) return std::nullopt;
  return PciAddress::parse(device.filename().string());
}

}  // namespace sriovd::host
