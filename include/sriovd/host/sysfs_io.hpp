#pragma once

#include <optional>
#include <string>
#include <vector>

namespace sriovd::host {

// The host layer's only way to sysfs. Paths are relative to the sysfs root
// ("bus/pci/devices/0000:3b:00.0/sriov_numvfs"). Two implementations: the
// real /sys (RealSysfs) and the simulated kernel, which reacts to writes.
class SysfsIo {
 public:
  virtual ~SysfsIo() = default;

  // The directory that holds the tree, as libpci's sysfs.path wants it
  // (<root>/bus/pci).
  [[nodiscard]] virtual const std::string& root() const = 0;
  // An attribute's text without the trailing newline; nullopt when absent.
  virtual std::optional<std::string> read(const std::string& path) = 0;
  // Writes an attribute as the kernel takes it (one write call). Throws
  // SystemError carrying the kernel's errno and naming the path.
  virtual void write(const std::string& path, const std::string& value) = 0;
  // The last component of a symlink's target ("vfio-pci" for a driver link).
  virtual std::optional<std::string> link_name(const std::string& path) = 0;
  virtual std::vector<std::string> list(const std::string& dir) = 0;
  virtual bool exists(const std::string& path) = 0;
  // The kernel modules whose PCI ID tables match a device's modalias
  // ("pci:v00008086d000010CA..."), as modules.alias and modules.builtin.alias
  // of the running kernel name them (the lookup modprobe does for a uevent).
  virtual std::vector<std::string> modules_for(const std::string& modalias) = 0;
};

class RealSysfs : public SysfsIo {
 public:
  explicit RealSysfs(std::string root = "/sys") : root_(std::move(root)) {}
  [[nodiscard]] const std::string& root() const override { return root_; }
  std::optional<std::string> read(const std::string& path) override;
  void write(const std::string& path, const std::string& value) override;
  std::optional<std::string> link_name(const std::string& path) override;
  std::vector<std::string> list(const std::string& dir) override;
  bool exists(const std::string& path) override;
  std::vector<std::string> modules_for(const std::string& modalias) override;

 private:
  std::string root_;
  // "pci:" lines of modules(.builtin).alias: pattern, module; read once.
  std::vector<std::pair<std::string, std::string>> pci_aliases_;
  bool aliases_read_ = false;
};

}  // namespace sriovd::host
