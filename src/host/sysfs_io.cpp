#include "sriovd/host/sysfs_io.hpp"

#include <fcntl.h>
#include <fnmatch.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "sriovd/util/error.hpp"
#include "sriovd/util/fd.hpp"

namespace sriovd::host {

namespace fs = std::filesystem;

std::optional<std::string> RealSysfs::read(const std::string& path) {
  std::ifstream in(root_ + "/" + path);
  if (!in) return std::nullopt;
  std::ostringstream s;
  s << in.rdbuf();
  std::string text = s.str();
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text;
}

void RealSysfs::write(const std::string& path, const std::string& value) {
  const std::string full = root_ + "/" + path;
  UniqueFd fd(::open(full.c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd) throw_errno("open " + full);
  // sysfs takes an attribute in one write; a short write is an error.
  const ssize_t n = ::write(fd.get(), value.data(), value.size());
  if (n < 0) throw_errno("write '" + value + "' to " + full);
  if (static_cast<size_t>(n) != value.size()) throw SystemError(EIO, "short write to " + full);
}

std::optional<std::string> RealSysfs::link_name(const std::string& path) {
  std::error_code ec;
  const fs::path target = fs::read_symlink(root_ + "/" + path, ec);
  if (ec) return std::nullopt;
  return target.filename().string();
}

std::vector<std::string> RealSysfs::list(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root_ + "/" + dir, ec)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

bool RealSysfs::exists(const std::string& path) {
  std::error_code ec;
  return fs::exists(fs::symlink_status(root_ + "/" + path, ec));
}

std::vector<std::string> RealSysfs::modules_for(const std::string& modalias) {
  if (!aliases_read_) {
    aliases_read_ = true;
    utsname u{};
    if (::uname(&u) == 0) {
      for (const char* file : {"modules.alias", "modules.builtin.alias"}) {
        std::ifstream in(std::string("/lib/modules/") + u.release + "/" + file);
        std::string word, pattern, module;
        // "alias PATTERN MODULE", one per line; only PCI ones matter here.
        while (in >> word >> pattern >> module)
          if (word == "alias" && pattern.rfind("pci:", 0) == 0) pci_aliases_.emplace_back(pattern, module);
      }
    }
  }
  std::vector<std::string> out;
  for (const auto& [pattern, module] : pci_aliases_)
    if (::fnmatch(pattern.c_str(), modalias.c_str(), 0) == 0 && std::find(out.begin(), out.end(), module) == out.end())
      out.push_back(module);
  return out;
}

}  // namespace sriovd::host
