#include "handover.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <charconv>
#include <cstdio>
#include <stdexcept>

#include <linux/kcmp.h>
#include <sys/syscall.h>
#include <systemd/sd-daemon.h>

#include <map>
#include <sstream>

#include <spdlog/spdlog.h>

#include "sriovd/util/error.hpp"

namespace sriovd::daemon {

using control::json;

namespace {

std::string to_hex(const std::vector<uint8_t>& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  s.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    s.push_back(kDigits[b >> 4U]);
    s.push_back(kDigits[b & 15U]);
  }
  return s;
}

std::vector<uint8_t> from_hex(const std::string& s, const std::string& what) {
  if (s.size() % 2 != 0) throw std::runtime_error(what + ": an odd number of hex digits");
  const auto digit = [&](char c) -> unsigned {
    if (c >= '0' && c <= '9') return static_cast<unsigned>(c - '0');
    if (c >= 'a' && c <= 'f') return static_cast<unsigned>(c - 'a' + 10);
    throw std::runtime_error(what + ": not hex");
  };
  std::vector<uint8_t> out(s.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>(digit(s[2 * i]) << 4U | digit(s[2 * i + 1]));
  return out;
}

void set_cloexec(int fd, bool on) {
  const int flags = ::fcntl(fd, F_GETFD);
  if (flags < 0) throw_errno("the handover's fd " + std::to_string(fd));
  if (::fcntl(fd, F_SETFD, on ? (flags | FD_CLOEXEC) : (flags & ~FD_CLOEXEC)) != 0)
    throw_errno("the handover's fd " + std::to_string(fd));
}

json numbers(const std::vector<UniqueFd>& fds) {
  json a = json::array();
  for (const UniqueFd& f : fds) a.push_back(f.get());
  return a;
}

// Takes the inherited fds a manifest names (`remap`: where the fd the
// manifest calls N is in this process).
// With `remap`, the fds are systemd's store's: duplicated (one stored fd
// may stand for several), the store's own closed by the caller.
std::vector<UniqueFd> take(const json& list, const std::string& what, const std::function<int(int)>* remap) {
  std::vector<UniqueFd> out;
  for (const json& n : list) {
    const int fd = remap ? (*remap)(n.get<int>()) : n.get<int>();
    if (remap && fd < 0) {
      // Not in systemd's store (an O_PATH handle it cannot poll): the
      // part that needs it does without it, or is not taken over.
      out.emplace_back();
      continue;
    }
    if (fd < 3) throw std::runtime_error(what + ": fd " + std::to_string(n.get<int>()) + " was not handed over");
    set_cloexec(fd, true);  // throws when it was not inherited
    if (!remap) {
      out.emplace_back(fd);
      continue;
    }
    out.push_back(dup_fd(fd, what + ": a stored fd"));
  }
  return out;
}

template <typename F>
void each_fd(const Handover& h, F f) {
  for (const HandedVirtio& v : h.virtio) {
    for (const UniqueFd& fd : v.backend.fds) f(fd.get());
    for (const UniqueFd& fd : v.server.fds) f(fd.get());
    for (const UniqueFd& fd : v.tap_fds) f(fd.get());
  }
  for (const HandedVf& v : h.vf_exports)
    for (const UniqueFd& fd : v.server.fds) f(fd.get());
}

}  // namespace

std::string handover_versions_read() {
  std::string out;
  for (uint32_t v = kOldestHandoverRead; v <= kHandoverVersion; ++v)
    out += (out.empty() ? "" : " ") + std::to_string(v);
  return out;
}

bool reads_handover_version(const std::string& reads, uint32_t version) {
  std::istringstream words(reads);
  std::string word;
  while (words >> word)
    if (word == std::to_string(version)) return true;
  return false;
}

UniqueFd Handover::write(const std::map<int, int>& aliases) const {
  json j = {{"version", kHandoverVersion}, {"from_pid", from_pid}, {"virtio", json::array()}};
  if (!aliases.empty()) {
    json a = json::object();
    for (const auto& [fd, first] : aliases) a[std::to_string(fd)] = first;
    j["fd_aliases"] = std::move(a);
  }
  for (const HandedVirtio& v : virtio) {
    json d = {{"name", v.name},
              {"socket", v.socket},
              {"tap", v.tap},
              {"tap_fds", numbers(v.tap_fds)},
              {"macvtap_lower", v.macvtap_lower}};
    if (v.pci) {
      d["transport"] = "vfio-user";
      d["server"] = to_hex(v.server.serialize());
      d["server_fds"] = numbers(v.server.fds);
    } else {
      d["backend"] = to_hex(v.backend.serialize());
      d["backend_fds"] = numbers(v.backend.fds);
    }
    j["virtio"].push_back(std::move(d));
  }
  j["simulated_host"] = simulated_host;
  j["vf_exports"] = json::array();
  for (const HandedVf& v : vf_exports)
    j["vf_exports"].push_back({{"vf", v.vf},
                               {"socket", v.socket},
                               {"server", to_hex(v.server.serialize())},
                               {"server_fds", numbers(v.server.fds)}});
  const std::string text = j.dump();
  UniqueFd fd(::memfd_create("sriovd-handover", MFD_ALLOW_SEALING));  // inherited by the exec
  if (!fd) throw_errno("the handover's manifest");
  if (::write(fd.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size()))
    throw_errno("writing the handover's manifest");
  (void)::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL);
  each_fd(*this, [](int f) { set_cloexec(f, false); });
  return fd;
}

std::vector<int> Handover::fd_numbers() const {
  std::vector<int> out;
  each_fd(*this, [&](int f) { out.push_back(f); });
  return out;
}

void Handover::keep_from_exec() const {
  each_fd(*this, [](int f) { set_cloexec(f, true); });
}

Handover Handover::read(int fd) { return read_mapped(fd, nullptr); }

Handover Handover::read_mapped(int fd, const std::function<int(int)>* remap) {
  UniqueFd manifest(fd);
  set_cloexec(fd, true);
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_errno("the handover's manifest (fd " + std::to_string(fd) + ")");
  if (st.st_size > (64 << 20))
    throw std::runtime_error("the handover's manifest is " + std::to_string(st.st_size) + " bytes");
  std::string text(static_cast<size_t>(st.st_size), '\0');
  if (::pread(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size()))
    throw_errno("reading the handover's manifest");
  Handover h;
  try {
    const json j = json::parse(text);
    const uint32_t version = j.at("version").get<uint32_t>();
    if (version < kOldestHandoverRead || version > kHandoverVersion)
      throw std::runtime_error("a handover of version " + std::to_string(version) + " (this sriovd reads " +
                               handover_versions_read() + ")");
    h.from_pid = j.at("from_pid").get<int>();
    h.simulated_host = j.value("simulated_host", std::string());
    // The fd store's: an fd of a file already stored under another fd's
    // name is found by that name.
    std::map<int, int> aliases;
    if (j.contains("fd_aliases"))
      for (const auto& [key, first] : j.at("fd_aliases").items()) {
        int alias = -1;
        const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), alias);
        if (ec != std::errc() || end != key.data() + key.size() || alias < 0)
          throw std::runtime_error("the handover's manifest: fd alias '" + key + "'");
        aliases[alias] = first.get<int>();
      }
    std::function<int(int)> aliased;
    if (remap && !aliases.empty()) {
      aliased = [&aliases, stored = remap](int n) {
        const auto it = aliases.find(n);
        return (*stored)(it == aliases.end() ? n : it->second);
      };
      remap = &aliased;
    }
    // Device by device: one that cannot be taken (its fds closed) is
    // served afresh; the others are still taken over.
    for (const json& v : j.at("virtio")) {
      HandedVirtio hv;
      hv.name = v.at("name").get<std::string>();
      try {
        hv.socket = v.at("socket").get<std::string>();
        // Version 1 knew vhost-user only.
        const std::string transport = v.value("transport", std::string("vhost-user"));
        if (transport != "vhost-user" && transport != "vfio-user")
          throw std::runtime_error("transport '" + transport + "'");
        hv.pci = transport == "vfio-user";
        const char* part = hv.pci ? "server" : "backend";
        std::vector<UniqueFd> fds = take(v.at(std::string(part) + "_fds"), hv.name, remap);
        hv.tap = v.at("tap").get<std::string>();
        hv.tap_fds = take(v.at("tap_fds"), hv.name, remap);
        hv.macvtap_lower = v.value("macvtap_lower", std::string());
        const std::vector<uint8_t> bytes = from_hex(v.at(part).get<std::string>(), hv.name);
        const std::string what = "the handover of virtio device " + hv.name;
        if (hv.pci) {
          hv.server = vfio_user::ServerHandover::parse(bytes, fds.size(), what);
          hv.server.fds = std::move(fds);
        } else {
          hv.backend = vhost_user::BackendHandover::parse(bytes, fds.size(), what);
          hv.backend.fds = std::move(fds);
        }
        h.virtio.push_back(std::move(hv));
      } catch (const std::exception& e) {
        spdlog::error("upgrade: virtio device {} cannot be taken over ({}): it starts afresh", hv.name, e.what());
      }
    }
    // Version 1 had none.
    for (const json& v : j.value("vf_exports", json::array())) {
      HandedVf hv;
      hv.vf = v.at("vf").get<std::string>();
      try {
        hv.socket = v.at("socket").get<std::string>();
        std::vector<UniqueFd> fds = take(v.at("server_fds"), hv.vf, remap);
        hv.server = vfio_user::ServerHandover::parse(from_hex(v.at("server").get<std::string>(), hv.vf), fds.size(),
                                                     "the handover of VF export " + hv.vf);
        hv.server.fds = std::move(fds);
        h.vf_exports.push_back(std::move(hv));
      } catch (const std::exception& e) {
        spdlog::error("upgrade: VF export {} cannot be taken over ({}): it starts afresh", hv.vf, e.what());
      }
    }
  } catch (const json::exception& e) {
    throw std::runtime_error(std::string("the handover's manifest: ") + e.what());
  }
  return h;
}

void Handover::store() const {
  // systemd keeps one entry per open file (a second fd of a file it holds
  // is dropped, name and all): a later fd of a file already stored goes in
  // the manifest as an alias of the first, and the successor finds it by
  // the first's name. Guest memory is such a file: QEMU sends one fd of
  // its RAM per DMA window and per device.
  std::vector<int> stored;
  std::map<int, int> aliases;
  each_fd(*this, [&](int fd) {
    const int fl = ::fcntl(fd, F_GETFL);
    if (fl >= 0 && (fl & O_PATH)) return;  // systemd refuses what it cannot poll: the successor opens the path
    for (int s : stored)
      if (::syscall(SYS_kcmp, ::getpid(), ::getpid(), KCMP_FILE, s, fd) == 0) {
        aliases[fd] = s;
        return;
      }
    stored.push_back(fd);
  });
  UniqueFd manifest = write(aliases);
  keep_from_exec();  // nothing is exec'ed on this path
  const auto put = [](int fd, const std::string& name) {
    const std::string state = "FDSTORE=1\nFDNAME=" + name;
    const int rc = sd_pid_notify_with_fds(0, 0, state.c_str(), &fd, 1);
    if (rc <= 0)
      throw std::runtime_error("storing " + name + " with the service manager: " +
                               (rc == 0 ? std::string("not run by systemd") : std::strerror(-rc)));
  };
  for (int fd : stored) put(fd, "fd" + std::to_string(fd));
  put(manifest.get(), "manifest");
}

std::optional<Handover> Handover::from_fd_store() {
  char** names = nullptr;
  const int n = sd_listen_fds_with_names(1, &names);
  if (n <= 0) return std::nullopt;
  std::map<std::string, int> by_name;
  for (int i = 0; i < n; ++i) {
    by_name[names[i]] = SD_LISTEN_FDS_START + i;
    std::free(names[i]);
  }
  std::free(names);
  // Out of the store: this process holds them now.
  for (const auto& [name, fd] : by_name) (void)sd_notifyf(0, "FDSTOREREMOVE=1\nFDNAME=%s", name.c_str());
  const auto manifest = by_name.find("manifest");
  if (manifest == by_name.end()) {
    for (const auto& [name, fd] : by_name) ::close(fd);
    return std::nullopt;
  }
  std::optional<Handover> h;
  std::string error;
  try {
    const std::function<int(int)> remap = [&](int old) {
      const auto it = by_name.find("fd" + std::to_string(old));
      return it == by_name.end() ? -1 : it->second;
    };
    h = read_mapped(manifest->second, &remap);
  } catch (const std::exception& e) {
    error = e.what();
  }
  // Each stored fd was taken by a duplicate (or not at all): the store's
  // own copies are closed.
  for (const auto& [name, fd] : by_name)
    if (name != "manifest") ::close(fd);
  if (!error.empty()) throw std::runtime_error(error);
  return h;
}

json Handover::summary() const {
  json names = json::array();
  for (const HandedVirtio& v : virtio) names.push_back(v.name);
  json vfs = json::array();
  for (const HandedVf& v : vf_exports) vfs.push_back(v.vf);
  return {{"from_pid", from_pid}, {"virtio_devices", names}, {"vf_exports", vfs}};
}

}  // namespace sriovd::daemon
