#include "sriovd/config/loader.hpp"

#include <grp.h>
#include <pwd.h>
#include <net/if.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include <yaml-cpp/yaml.h>

namespace sriovd::config {

const char* to_string(HostMode v) { return v == HostMode::system ? "system" : "simulated"; }
const char* to_string(LinkState v) {
  switch (v) {
    case LinkState::automatic: return "auto";
    case LinkState::enable: return "enable";
    case LinkState::disable: return "disable";
  }
  return "?";
}
const char* to_string(ExportKind v) { return v == ExportKind::none ? "none" : "vfio-user"; }
const char* to_string(MsixPolicy v) {
  switch (v) {
    case MsixPolicy::direct: return "direct";
    case MsixPolicy::relay: return "relay";
    case MsixPolicy::adaptive: return "adaptive";
  }
  return "?";
}
namespace {
// A user or group of this host by name (the config's only side effect
// besides reading the file is looking these up), or as a plain number.
std::optional<uint32_t> numeric_id(const std::string& s) {
  if (s.empty() || s.size() >= 10 || s.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return static_cast<uint32_t>(std::stoul(s));
}
std::optional<uid_t> user_id(const std::string& name) {
  std::vector<char> buf(16384);
  passwd pw{};
  passwd* found = nullptr;
  if (getpwnam_r(name.c_str(), &pw, buf.data(), buf.size(), &found) == 0 && found) return found->pw_uid;
  return numeric_id(name);
}
std::optional<gid_t> group_id(const std::string& name) {
  std::vector<char> buf(16384);
  group grp{};
  group* found = nullptr;
  if (getgrnam_r(name.c_str(), &grp, buf.data(), buf.size(), &found) == 0 && found) return found->gr_gid;
  return std::nullopt;
}
}  // namespace

const char* to_string(BarAccess v) { return v == BarAccess::mmap ? "mmap" : "trapped"; }
const char* to_string(Transport v) { return v == Transport::vhost_user ? "vhost-user" : "vfio-user"; }
const char* to_string(PackedRing v) {
  switch (v) {
    case PackedRing::off: return "off";
    case PackedRing::on: return "on";
    case PackedRing::automatic: return "auto";
  }
  return "?";
}
const char* to_string(BackendKind v) { return v == BackendKind::tap ? "tap" : "vf"; }
const char* to_string(PacketRingMode v) {
  switch (v) {
    case PacketRingMode::v3: return "v3";
    case PacketRingMode::v2: return "v2";
    case PacketRingMode::off: return "off";
  }
  return "?";
}
const char* to_string(VfAttach v) { return v == VfAttach::af_packet ? "af_packet" : "macvtap"; }
const char* to_string(SocketMode v) { return v == SocketMode::server ? "server" : "client"; }

std::string Diagnostic::to_string() const {
  if (line == 0) return file + ": " + message;
  return file + ":" + std::to_string(line) + ":" + std::to_string(column) + ": " + message;
}

namespace {

std::string join_diagnostics(const std::vector<Diagnostic>& diags) {
  std::string out;
  for (const auto& d : diags) {
    if (!out.empty()) out += '\n';
    out += d.to_string();
  }
  return out;
}

}  // namespace

ConfigError::ConfigError(std::vector<Diagnostic> diagnostics)
    : std::runtime_error(join_diagnostics(diagnostics)), diagnostics_(std::move(diagnostics)) {}

namespace {

SourceLocation location_of(const YAML::Node& node) {
  const YAML::Mark m = node.Mark();
  return {m.line + 1, m.column + 1};
}

std::string line_ref(SourceLocation where) { return "line " + std::to_string(where.line); }

// Collects diagnostics for one file.
class Context {
 public:
  explicit Context(std::string file) : file_(std::move(file)) {}

  void error(SourceLocation where, const std::string& path, const std::string& message) {
    diags_.push_back({file_, where.line, where.column, path.empty() ? message : path + ": " + message});
  }
  void error(const YAML::Node& node, const std::string& path, const std::string& message) {
    error(location_of(node), path, message);
  }
  [[nodiscard]] bool failed() const { return !diags_.empty(); }
  std::vector<Diagnostic> take() {
    std::stable_sort(diags_.begin(), diags_.end(), [](const Diagnostic& a, const Diagnostic& b) {
      return std::tie(a.line, a.column) < std::tie(b.line, b.column);
    });
    return std::move(diags_);
  }

 private:
  std::string file_;
  std::vector<Diagnostic> diags_;
};

const char* kind_name(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Null: return "an empty value";
    case YAML::NodeType::Scalar: return node.Tag() == "!" ? "a string" : "a scalar";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Map: return "a mapping";
    default: return "nothing";
  }
}

std::string describe(const YAML::Node& node) {
  if (node.IsScalar()) return "'" + node.Scalar() + "'";
  return kind_name(node);
}

std::optional<uint64_t> parse_unsigned(const std::string& text) {
  int base = 10;
  std::string_view digits = text;
  if (digits.size() > 2 && digits[0] == '0' && (digits[1] == 'x' || digits[1] == 'X')) {
    base = 16;
    digits.remove_prefix(2);
  }
  if (digits.empty()) return std::nullopt;
  uint64_t value = 0;
  auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value, base);
  if (ec != std::errc{} || ptr != digits.data() + digits.size()) return std::nullopt;
  return value;
}

// A YAML mapping with a fixed set of allowed keys. Unknown and duplicate keys
// are reported when it is built; the typed getters report wrong types and
// ranges, and return nullopt for a missing or bad value.
class Mapping {
 public:
  Mapping(Context& ctx, YAML::Node node, std::string path, std::vector<std::string> allowed)
      : ctx_(ctx), node_(std::move(node)), path_(std::move(path)) {
    if (!node_.IsMap()) {
      ctx_.error(node_, path_.empty() ? "document" : path_,
                 std::string("expected a mapping, got ") + describe(node_));
      return;
    }
    valid_ = true;
    for (auto it = node_.begin(); it != node_.end(); ++it) {
      const YAML::Node key = it->first;
      const std::string name = key.IsScalar() ? key.Scalar() : std::string();
      if (std::find(allowed.begin(), allowed.end(), name) == allowed.end()) {
        std::string expected;
        for (const auto& a : allowed) expected += (expected.empty() ? "" : ", ") + a;
        ctx_.error(key, path_, "unknown key '" + name + "' (expected one of: " + expected + ")");
        continue;
      }
      auto [pos, inserted] = values_.emplace(name, it->second);
      if (!inserted) {
        ctx_.error(key, path_, "duplicate key '" + name + "' (first at " +
                                    line_ref(location_of(key_marks_.at(name))) + ")");
        continue;
      }
      key_marks_.emplace(name, key);
    }
  }

  [[nodiscard]] bool valid() const { return valid_; }
  [[nodiscard]] bool has(const std::string& key) const { return values_.count(key) != 0; }
  [[nodiscard]] SourceLocation where() const { return location_of(node_); }
  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] std::string path_of(const std::string& key) const {
    return path_.empty() ? key : path_ + "." + key;
  }

  // The value node of `key`, or an undefined node (reported when required).
  YAML::Node get(const std::string& key, bool required) {
    auto it = values_.find(key);
    if (it == values_.end()) {
      if (required && valid_) ctx_.error(node_, path_.empty() ? "document" : path_,
                                         "missing required key '" + key + "'");
      return YAML::Node(YAML::NodeType::Undefined);
    }
    return it->second;
  }
  SourceLocation where(const std::string& key) {
    auto it = values_.find(key);
    return it == values_.end() ? where() : location_of(it->second);
  }

  std::optional<std::string> string(const std::string& key, bool required = false) {
    YAML::Node n = get(key, required);
    if (!n.IsDefined()) return std::nullopt;
    if (!n.IsScalar()) {
      ctx_.error(n, path_of(key), std::string("expected a string, got ") + kind_name(n));
      return std::nullopt;
    }
    if (n.Scalar().empty()) {
      ctx_.error(n, path_of(key), "expected a non-empty string");
      return std::nullopt;
    }
    return n.Scalar();
  }

  std::optional<uint64_t> unsigned_in(const std::string& key, uint64_t min, uint64_t max,
                                      bool required = false) {
    YAML::Node n = get(key, required);
    if (!n.IsDefined()) return std::nullopt;
    return unsigned_value(ctx_, n, path_of(key), min, max);
  }

  std::optional<bool> boolean(const std::string& key, bool required = false) {
    YAML::Node n = get(key, required);
    if (!n.IsDefined()) return std::nullopt;
    return boolean_value(ctx_, n, path_of(key));
  }

  template <typename Enum>
  std::optional<Enum> choice(const std::string& key,
                             const std::vector<std::pair<const char*, Enum>>& table,
                             bool required = false) {
    YAML::Node n = get(key, required);
    if (!n.IsDefined()) return std::nullopt;
    std::string names;
    for (const auto& [name, value] : table) {
      if (n.IsScalar() && n.Scalar() == name) return value;
      names += (names.empty() ? "" : ", ") + std::string(name);
    }
    ctx_.error(n, path_of(key), "expected one of " + names + ", got " + describe(n));
    return std::nullopt;
  }

  static std::optional<uint64_t> unsigned_value(Context& ctx, const YAML::Node& n,
                                                const std::string& path, uint64_t min,
                                                uint64_t max) {
    const std::string expected =
        "expected an integer from " + std::to_string(min) + " to " + std::to_string(max);
    if (!n.IsScalar() || n.Tag() == "!") {
      ctx.error(n, path, expected + ", got " + (n.IsScalar() ? "a string" : kind_name(n)));
      return std::nullopt;
    }
    auto v = parse_unsigned(n.Scalar());
    if (!v || *v < min || *v > max) {
      ctx.error(n, path, expected + ", got " + describe(n));
      return std::nullopt;
    }
    return v;
  }

  static std::optional<bool> boolean_value(Context& ctx, const YAML::Node& n,
                                           const std::string& path) {
    if (n.IsScalar() && n.Tag() != "!") {
      if (n.Scalar() == "true") return true;
      if (n.Scalar() == "false") return false;
    }
    ctx.error(n, path, "expected true or false, got " + describe(n));
    return std::nullopt;
  }

 private:
  Context& ctx_;
  YAML::Node node_;
  std::string path_;
  bool valid_ = false;
  std::map<std::string, YAML::Node> values_;
  std::map<std::string, YAML::Node> key_marks_;
};

// Calls fn(item, "path[i]") for every element of a list-valued key.
void for_each_item(Context& ctx, Mapping& map, const std::string& key,
                   const std::function<void(const YAML::Node&, const std::string&)>& fn) {
  YAML::Node list = map.get(key, false);
  if (!list.IsDefined()) return;
  const std::string path = map.path_of(key);
  if (!list.IsSequence()) {
    ctx.error(list, path, std::string("expected a list, got ") + kind_name(list));
    return;
  }
  for (size_t i = 0; i < list.size(); ++i) fn(list[i], path + "[" + std::to_string(i) + "]");
}

bool valid_ifname(const std::string& name) {
  if (name.empty() || name.size() >= IFNAMSIZ || name == "." || name == "..") return false;
  return std::none_of(name.begin(), name.end(),
                      [](char c) { return c == '/' || c == ':' || c <= ' ' || c == 127; });
}

bool valid_identifier(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '-' || c == '_' || c == '.';
  });
}

// A Unix socket path the daemon can bind: absolute and short enough for sun_path.
std::optional<std::string> socket_path(Context& ctx, Mapping& map, const std::string& key,
                                       bool required) {
  auto path = map.string(key, required);
  if (!path) return std::nullopt;
  if ((*path)[0] != '/') {
    ctx.error(map.where(key), map.path_of(key), "expected an absolute path, got '" + *path + "'");
    return std::nullopt;
  }
  if (path->size() >= sizeof(sockaddr_un{}.sun_path)) {
    ctx.error(map.where(key), map.path_of(key),
              "socket path is " + std::to_string(path->size()) + " bytes; the limit is " +
                  std::to_string(sizeof(sockaddr_un{}.sun_path) - 1));
    return std::nullopt;
  }
  return path;
}

std::optional<MacAddress> mac_value(Context& ctx, Mapping& map, const std::string& key) {
  auto text = map.string(key);
  if (!text) return std::nullopt;
  auto mac = MacAddress::parse(*text);
  if (!mac) {
    ctx.error(map.where(key), map.path_of(key),
              "expected a MAC address like 02:00:00:00:00:01, got '" + *text + "'");
    return std::nullopt;
  }
  if (mac->is_multicast()) {
    ctx.error(map.where(key), map.path_of(key),
              "'" + *text + "' is a multicast address; a device MAC must be unicast");
    return std::nullopt;
  }
  if (mac->is_zero()) {
    ctx.error(map.where(key), map.path_of(key),
              "00:00:00:00:00:00 is not a usable MAC; omit the key to leave the MAC unchanged");
    return std::nullopt;
  }
  return mac;
}

std::optional<PciAddress> pci_value(Context& ctx, Mapping& map, const std::string& key,
                                    bool required) {
  auto text = map.string(key, required);
  if (!text) return std::nullopt;
  auto addr = PciAddress::parse(*text);
  if (!addr)
    ctx.error(map.where(key), map.path_of(key),
              "expected a PCI address like 0000:03:00.0, got '" + *text + "'");
  return addr;
}

class Loader {
 public:
  explicit Loader(std::string file) : ctx_(file) { cfg_.path = std::move(file); }

  Config run(const YAML::Node& root) {
    Mapping top(ctx_, root, "",
                {"version", "host", "log_level", "state_dir", "simulated", "control",
                 "physical_functions", "virtio_devices", "interrupts"});
    if (!top.valid()) throw ConfigError(ctx_.take());

    if (auto v = top.unsigned_in("version", 0, UINT32_MAX, true); v && *v != 1)
      ctx_.error(top.where("version"), "version",
                 "unsupported schema version " + std::to_string(*v) +
                     " (this sriovd reads version 1)");
    if (auto h = top.choice<HostMode>(
            "host", {{"system", HostMode::system}, {"simulated", HostMode::simulated}}, true))
      cfg_.host = *h;
    if (auto l = top.choice<std::string>("log_level", {{"trace", "trace"},
                                                       {"debug", "debug"},
                                                       {"info", "info"},
                                                       {"warn", "warn"},
                                                       {"error", "error"},
                                                       {"critical", "critical"},
                                                       {"off", "off"}}))
      cfg_.log_level = *l;
    if (auto d = top.string("state_dir")) {
      if ((*d)[0] != '/')
        ctx_.error(top.where("state_dir"), "state_dir", "expected an absolute path, got '" + *d + "'");
      else
        cfg_.state_dir = *d;
    }

    if (top.has("simulated")) {
      if (cfg_.host != HostMode::simulated && top.has("host"))
        ctx_.error(top.where("simulated"), "simulated",
                   "only allowed with 'host: simulated' (host is system)");
      read_simulated(top.get("simulated", false));
    } else if (cfg_.host == HostMode::simulated) {
      ctx_.error(top.where(), "document", "'host: simulated' needs a 'simulated' section");
    }
    if (top.has("control")) read_control(top.get("control", false));
    if (top.has("interrupts")) read_interrupts(top.get("interrupts", false));
    for_each_item(ctx_, top, "physical_functions",
                  [&](const YAML::Node& n, const std::string& p) { read_pf(n, p); });
    for_each_item(ctx_, top, "virtio_devices",
                  [&](const YAML::Node& n, const std::string& p) { read_virtio(n, p); });
    check_sockets();
    check_macs();

    if (ctx_.failed()) throw ConfigError(ctx_.take());
    return std::move(cfg_);
  }

 private:
  void read_simulated(const YAML::Node& node) {
    Mapping m(ctx_, node, "simulated", {"physical_functions"});
    if (!m.valid()) return;
    if (!m.has("physical_functions")) {
      m.get("physical_functions", true);
      return;
    }
    for_each_item(ctx_, m, "physical_functions", [&](const YAML::Node& n, const std::string& p) {
      Mapping pf(ctx_, n, p,
                 {"address", "vendor_id", "device_id", "total_vfs", "msix_vectors_per_vf", "netdev"});
      if (!pf.valid()) return;
      SimulatedPf sim;
      sim.where = pf.where();
      auto addr = pci_value(ctx_, pf, "address", true);
      if (auto v = pf.unsigned_in("vendor_id", 1, 0xfffe)) sim.vendor_id = static_cast<uint16_t>(*v);
      if (auto v = pf.unsigned_in("device_id", 0, 0xffff)) sim.device_id = static_cast<uint16_t>(*v);
      if (auto v = pf.unsigned_in("total_vfs", 1, 256)) sim.total_vfs = static_cast<uint16_t>(*v);
      if (auto v = pf.unsigned_in("msix_vectors_per_vf", 1, 2048))
        sim.msix_vectors_per_vf = static_cast<uint16_t>(*v);
      auto netdev = pf.string("netdev", true);
      if (netdev && !valid_ifname(*netdev)) {
        ctx_.error(pf.where("netdev"), pf.path_of("netdev"),
                   "'" + *netdev + "' is not a valid interface name (1 to 15 characters, no '/', ':' or spaces)");
        netdev.reset();
      }
      if (!addr || !netdev) return;
      sim.address = *addr;
      sim.netdev = *netdev;
      for (const auto& other : cfg_.simulated_pfs) {
        if (other.address == sim.address)
          ctx_.error(pf.where("address"), pf.path_of("address"),
                     "PCI address " + sim.address.to_string() + " is already simulated at " +
                         line_ref(other.where));
        if (other.netdev == sim.netdev)
          ctx_.error(pf.where("netdev"), pf.path_of("netdev"),
                     "netdev '" + sim.netdev + "' is already used at " + line_ref(other.where));
      }
      cfg_.simulated_pfs.push_back(sim);
    });
    if (cfg_.simulated_pfs.empty() && !ctx_.failed())
      ctx_.error(m.where("physical_functions"), "simulated.physical_functions",
                 "a simulated host needs at least one PF");
  }

  void read_control(const YAML::Node& node) {
    Mapping m(ctx_, node, "control", {"socket", "group", "allowed_uids"});
    if (!m.valid()) return;
    if (auto s = socket_path(ctx_, m, "socket", false)) cfg_.control.socket = *s;
    control_socket_where_ = m.where("socket");
    if (auto g = m.string("group")) {
      cfg_.control.group = *g;
      cfg_.control.gid = group_id(*g);
      if (!cfg_.control.gid) ctx_.error(m.where("group"), "control.group", "no such group '" + *g + "' on this host");
    }
    for_each_item(ctx_, m, "allowed_uids", [&](const YAML::Node& n, const std::string& p) {
      if (auto uid = Mapping::unsigned_value(ctx_, n, p, 0, UINT32_MAX - 1))
        cfg_.control.allowed_uids.push_back(static_cast<uid_t>(*uid));
    });
  }

  void read_interrupts(const YAML::Node& node) {
    Mapping m(ctx_, node, "interrupts", {"relay_threads", "cpus", "busy_poll"});
    if (!m.valid()) return;
    if (auto v = m.unsigned_in("relay_threads", 1, 64))
      cfg_.interrupts.relay_threads = static_cast<uint16_t>(*v);
    if (auto b = m.boolean("busy_poll")) cfg_.interrupts.busy_poll = *b;
    for_each_item(ctx_, m, "cpus", [&](const YAML::Node& n, const std::string& p) {
      auto cpu = Mapping::unsigned_value(ctx_, n, p, 0, CPU_SETSIZE - 1);
      if (!cpu) return;
      auto& cpus = cfg_.interrupts.cpus;
      if (std::find(cpus.begin(), cpus.end(), *cpu) != cpus.end())
        ctx_.error(n, p, "CPU " + std::to_string(*cpu) + " is listed twice");
      else
        cpus.push_back(static_cast<uint16_t>(*cpu));
    });
  }

  // Resolves a PF named by address or netdev; in simulated mode it must be
  // one of the simulated PFs and comes back by address.
  const SimulatedPf* find_simulated(const PfRef& ref) const {
    for (const auto& sim : cfg_.simulated_pfs)
      if ((ref.address && *ref.address == sim.address) || (!ref.address && ref.netdev == sim.netdev))
        return &sim;
    return nullptr;
  }

  void read_pf(const YAML::Node& node, const std::string& path) {
    Mapping m(ctx_, node, path, {"address", "netdev", "num_vfs", "vfs"});
    if (!m.valid()) return;
    PfConfig pf;
    pf.where = m.where();
    if (m.has("address") == m.has("netdev")) {
      ctx_.error(m.where(), path, "expected exactly one of 'address' or 'netdev' to name the PF");
      return;
    }
    if (m.has("address")) {
      pf.ref.address = pci_value(ctx_, m, "address", true);
      if (!pf.ref.address) return;
    } else {
      auto netdev = m.string("netdev", true);
      if (!netdev) return;
      if (!valid_ifname(*netdev)) {
        ctx_.error(m.where("netdev"), m.path_of("netdev"),
                   "'" + *netdev + "' is not a valid interface name (1 to 15 characters, no '/', ':' or spaces)");
        return;
      }
      pf.ref.netdev = *netdev;
    }
    const std::string ref_key = m.has("address") ? "address" : "netdev";
    uint64_t max_vfs = 256;
    if (cfg_.host == HostMode::simulated) {
      const SimulatedPf* sim = find_simulated(pf.ref);
      if (!sim) {
        ctx_.error(m.where(ref_key), m.path_of(ref_key),
                   "PF '" + pf.ref.to_string() + "' is not one of the simulated PFs");
        return;
      }
      pf.ref = PfRef{sim->address, sim->netdev};
      max_vfs = sim->total_vfs;
    }
    for (const auto& other : cfg_.physical_functions)
      if ((pf.ref.address && other.ref.address == pf.ref.address) ||
          (!pf.ref.netdev.empty() && other.ref.netdev == pf.ref.netdev)) {
        ctx_.error(m.where(ref_key), m.path_of(ref_key),
                   "PF '" + pf.ref.to_string() + "' is already configured at " + line_ref(other.where));
        return;
      }
    auto num_vfs = m.unsigned_in("num_vfs", 0, 256, true);
    if (!num_vfs) return;
    if (*num_vfs > max_vfs) {
      ctx_.error(m.where("num_vfs"), m.path_of("num_vfs"),
                 "num_vfs " + std::to_string(*num_vfs) + " exceeds total_vfs " +
                     std::to_string(max_vfs) + " of simulated PF " + pf.ref.to_string());
      return;
    }
    pf.num_vfs = static_cast<uint16_t>(*num_vfs);
    const SimulatedPf* sim = cfg_.host == HostMode::simulated ? find_simulated(pf.ref) : nullptr;
    for_each_item(ctx_, m, "vfs", [&](const YAML::Node& n, const std::string& p) {
      read_vf(n, p, pf, sim);
    });
    cfg_.physical_functions.push_back(std::move(pf));
  }

  void read_vf(const YAML::Node& node, const std::string& path, PfConfig& pf, const SimulatedPf* sim) {
    Mapping m(ctx_, node, path,
              {"index", "mac", "vlan", "qos", "trust", "spoofchk", "link_state", "max_tx_rate",
               "min_tx_rate", "assign"});
    if (!m.valid()) return;
    VfConfig vf;
    vf.where = m.where();
    // A plain sentinel rather than std::optional: g++ 12 reports a false
    // maybe-uninitialized on the optional's payload here.
    int index = static_cast<int>(m.unsigned_in("index", 0, 255, true).value_or(-1));
    if (index >= pf.num_vfs) {
      ctx_.error(m.where("index"), m.path_of("index"),
                 "VF index " + std::to_string(index) + " is not below num_vfs " +
                     std::to_string(pf.num_vfs) + " of PF " + pf.ref.to_string());
      index = -1;
    }
    for (const auto& other : pf.vfs)
      if (index >= 0 && other.index == index) {
        ctx_.error(m.where("index"), m.path_of("index"),
                   "VF " + std::to_string(index) + " of PF " + pf.ref.to_string() +
                       " is already configured at " + line_ref(other.where));
        index = -1;
      }
    vf.mac = mac_value(ctx_, m, "mac");
    if (auto v = m.unsigned_in("vlan", 0, 4095)) vf.vlan = static_cast<uint16_t>(*v);
    if (auto q = m.unsigned_in("qos", 0, 7)) {
      vf.qos = static_cast<uint8_t>(*q);
      if (*q != 0 && !m.has("vlan"))
        ctx_.error(m.where("qos"), m.path_of("qos"), "qos needs a vlan to tag with");
    }
    vf.trust = m.boolean("trust");
    vf.spoofchk = m.boolean("spoofchk");
    vf.link_state = m.choice<LinkState>("link_state", {{"auto", LinkState::automatic},
                                                        {"enable", LinkState::enable},
                                                        {"disable", LinkState::disable}});
    if (auto v = m.unsigned_in("max_tx_rate", 0, UINT32_MAX)) vf.max_tx_rate = static_cast<uint32_t>(*v);
    if (auto v = m.unsigned_in("min_tx_rate", 0, UINT32_MAX)) vf.min_tx_rate = static_cast<uint32_t>(*v);
    if (vf.min_tx_rate && vf.max_tx_rate && *vf.max_tx_rate != 0 && *vf.min_tx_rate > *vf.max_tx_rate)
      ctx_.error(m.where("min_tx_rate"), m.path_of("min_tx_rate"),
                 "min_tx_rate " + std::to_string(*vf.min_tx_rate) + " exceeds max_tx_rate " +
                     std::to_string(*vf.max_tx_rate));
    if (m.has("assign")) vf.assign = read_assign(m.get("assign", false), m.path_of("assign"), sim);
    if (index < 0) return;
    vf.index = static_cast<uint16_t>(index);
    pf.vfs.push_back(std::move(vf));
  }

  std::optional<VfAssign> read_assign(const YAML::Node& node, const std::string& path,
                                      const SimulatedPf* sim) {
    Mapping m(ctx_, node, path, {"owner", "export", "socket", "msix_policy", "bar_access", "max_vectors", "max_dma_mib", "access"});
    if (!m.valid()) return std::nullopt;
    VfAssign a;
    auto owner = m.string("owner", true);
    if (owner && !valid_identifier(*owner)) {
      ctx_.error(m.where("owner"), m.path_of("owner"),
                 "owner '" + *owner + "' may use only letters, digits, '-', '_' and '.' (at most 64)");
      owner.reset();
    }
    if (auto e = m.choice<ExportKind>("export", {{"vfio-user", ExportKind::vfio_user},
                                                 {"none", ExportKind::none}}))
      a.export_kind = *e;
    auto socket = socket_path(ctx_, m, "socket", a.export_kind == ExportKind::vfio_user);
    if (socket && a.export_kind == ExportKind::none)
      ctx_.error(m.where("socket"), m.path_of("socket"),
                 "a socket is only used with 'export: vfio-user'");
    if (auto p = m.choice<MsixPolicy>("msix_policy", {{"direct", MsixPolicy::direct},
                                                       {"relay", MsixPolicy::relay},
                                                       {"adaptive", MsixPolicy::adaptive}}))
      a.msix_policy = *p;
    if (auto b = m.choice<BarAccess>("bar_access", {{"trapped", BarAccess::trapped}, {"mmap", BarAccess::mmap}})) {
      a.bar_access = *b;
      if (a.export_kind == ExportKind::none)
        ctx_.error(m.where("bar_access"), m.path_of("bar_access"), "bar_access is only used with 'export: vfio-user'");
    }
    const uint64_t max_vectors = sim ? sim->msix_vectors_per_vf : 2048;
    if (auto v = m.unsigned_in("max_vectors", 0, max_vectors)) a.max_vectors = static_cast<uint16_t>(*v);
    if (auto v = m.unsigned_in("max_dma_mib", 1, 1ULL << 32U)) a.max_dma_mib = *v;
    if (m.has("access")) {
      if (a.export_kind == ExportKind::none)
        ctx_.error(m.where("access"), m.path_of("access"), "access is only used with 'export: vfio-user'");
      a.access = read_access(m.get("access", false), m.path_of("access"));
    }
    if (!owner) return std::nullopt;
    a.owner = *owner;
    if (socket) {
      a.socket = *socket;
      a.socket_where = m.where("socket");
    }
    return a;
  }

  // access: {user, group, mode, allowed_uids} of a socket a VMM connects to.
  SocketAccess read_access(const YAML::Node& node, const std::string& path) {
    SocketAccess a;
    Mapping m(ctx_, node, path, {"user", "group", "mode", "allowed_uids"});
    if (!m.valid()) return a;
    if (auto u = m.string("user")) {
      a.user = *u;
      a.uid = user_id(*u);
      if (!a.uid) ctx_.error(m.where("user"), m.path_of("user"), "no such user '" + *u + "' on this host");
    }
    if (auto g = m.string("group")) {
      a.group = *g;
      a.gid = group_id(*g);
      if (!a.gid) a.gid = numeric_id(*g);
      if (!a.gid) ctx_.error(m.where("group"), m.path_of("group"), "no such group '" + *g + "' on this host");
    }
    if (auto mode = m.string("mode")) {
      // Octal, as chmod takes it: "0660", "660". The owner must be able to
      // use its own socket; nobody needs execute or setuid bits on one.
      const bool digits = !mode->empty() && mode->size() <= 4 && mode->find_first_not_of("01234567") == std::string::npos;
      const unsigned long v = digits ? std::stoul(*mode, nullptr, 8) : 0;
      if (!digits || v > 0777 || (v & 0600) != 0600 || (v & 0111) != 0)
        ctx_.error(m.where("mode"), m.path_of("mode"),
                   "mode '" + *mode + "': octal file mode with read and write for the owner and no execute bits (e.g. \"0660\")");
      else
        a.mode = static_cast<uint32_t>(v);
    }
    for_each_item(ctx_, m, "allowed_uids", [&](const YAML::Node& n, const std::string& p) {
      if (auto uid = Mapping::unsigned_value(ctx_, n, p, 0, UINT32_MAX - 1)) a.allowed_uids.push_back(static_cast<uid_t>(*uid));
    });
    return a;
  }

  void read_virtio(const YAML::Node& node, const std::string& path) {
    Mapping m(ctx_, node, path,
              {"name", "type", "transport", "socket", "socket_mode", "queues", "queue_size", "packed", "mac",
               "mtu", "iommu_platform", "cpus", "access", "backend"});
    if (!m.valid()) return;
    VirtioDevice dev;
    dev.where = m.where();
    bool ok = true;
    auto name = m.string("name", true);
    if (name && !valid_identifier(*name)) {
      ctx_.error(m.where("name"), m.path_of("name"),
                 "name '" + *name + "' may use only letters, digits, '-', '_' and '.' (at most 64)");
      name.reset();
    }
    if (name) {
      for (const auto& other : cfg_.virtio_devices)
        if (other.name == *name) {
          ctx_.error(m.where("name"), m.path_of("name"),
                     "virtio device '" + *name + "' is already defined at " + line_ref(other.where));
          name.reset();
          break;
        }
    }
    ok &= name.has_value();
    ok &= m.choice<std::string>("type", {{"net", "net"}}, true).has_value();
    if (auto t = m.choice<Transport>("transport", {{"vhost-user", Transport::vhost_user},
                                                   {"vfio-user", Transport::vfio_user}}, true))
      dev.transport = *t;
    else
      ok = false;
    auto socket = socket_path(ctx_, m, "socket", true);
    ok &= socket.has_value();
    if (auto mode = m.choice<SocketMode>("socket_mode", {{"server", SocketMode::server}, {"client", SocketMode::client}})) {
      dev.socket_mode = *mode;
      if (*mode == SocketMode::client && dev.transport != Transport::vhost_user)
        ctx_.error(m.where("socket_mode"), m.path_of("socket_mode"),
                   "client mode is only for vhost-user (a vfio-user server always listens)");
    }
    if (auto q = m.unsigned_in("queues", 1, 16)) dev.queue_pairs = static_cast<uint16_t>(*q);
    if (auto p = m.choice<PackedRing>("packed", {{"off", PackedRing::off},
                                                 {"on", PackedRing::on},
                                                 {"auto", PackedRing::automatic}}))
      dev.packed = *p;
    if (auto qs = m.unsigned_in("queue_size", 2, 32768)) {
      // Split rings need a power of two (virtio 1.2 §2.7); packed rings do not.
      const bool power_of_two = (*qs & (*qs - 1)) == 0;
      if (!power_of_two && dev.packed != PackedRing::on)
        ctx_.error(m.where("queue_size"), m.path_of("queue_size"),
                   "queue_size " + std::to_string(*qs) +
                       " is not a power of two, which split rings require (only 'packed: on' allows it)");
      else
        dev.queue_size = static_cast<uint16_t>(*qs);
    }
    dev.mac = mac_value(ctx_, m, "mac");
    if (auto mtu = m.unsigned_in("mtu", 68, 65535)) dev.mtu = static_cast<uint16_t>(*mtu);
    for_each_item(ctx_, m, "cpus", [&](const YAML::Node& n, const std::string& p) {
      auto cpu = Mapping::unsigned_value(ctx_, n, p, 0, CPU_SETSIZE - 1);
      if (!cpu) return;
      if (std::find(dev.cpus.begin(), dev.cpus.end(), *cpu) != dev.cpus.end())
        ctx_.error(n, p, "CPU " + std::to_string(*cpu) + " is listed twice");
      else
        dev.cpus.push_back(static_cast<uint16_t>(*cpu));
    });
    if (auto iommu = m.boolean("iommu_platform")) {
      if (*iommu && dev.transport != Transport::vhost_user) {
        ctx_.error(m.where("iommu_platform"), m.path_of("iommu_platform"),
                   "iommu_platform is for vhost-user devices (over vfio-user the VMM maps DMA itself)");
        ok = false;
      }
      dev.iommu_platform = *iommu;
    }
    if (m.has("access")) dev.access = read_access(m.get("access", false), m.path_of("access"));
    ok &= read_backend(m.get("backend", true), m.path_of("backend"), dev);
    if (ok && dev.backend_kind == BackendKind::vf && dev.vf.via == VfAttach::af_packet && dev.queue_pairs > 1 &&
        dev.transport != Transport::vhost_user) {
      // The driver's MQ setting (control queue) would have to move flows
      // between AF_PACKET fanout members, which cannot leave their group;
      // a macvtap's queues detach (TUNSETQUEUE) as a tap's do.
      ctx_.error(m.where("queues"), m.path_of("queues"),
                 "a VF backend with more than one queue pair over vfio-user needs 'via: macvtap' "
                 "(through AF_PACKET it serves one; over vhost-user either works)");
      ok = false;
    }
    if (!ok) return;
    dev.name = *name;
    dev.socket = *socket;
    dev.socket_where = m.where("socket");
    cfg_.virtio_devices.push_back(std::move(dev));
  }

  bool read_backend(const YAML::Node& node, const std::string& path, VirtioDevice& dev) {
    if (!node.IsDefined()) return false;
    dev.backend_where = location_of(node);
    Mapping m(ctx_, node, path, {"type", "name", "netns", "offloads", "pf", "vf", "via", "ring"});
    if (!m.valid()) return false;
    auto kind = m.choice<BackendKind>("type", {{"tap", BackendKind::tap}, {"vf", BackendKind::vf}}, true);
    if (!kind) return false;
    dev.backend_kind = *kind;
    auto only_for = [&](const char* key, const char* kind_name) {
      if (m.has(key))
        ctx_.error(m.where(key), m.path_of(key),
                   std::string("'") + key + "' is only used with 'type: " + kind_name + "'");
    };
    if (*kind == BackendKind::tap) {
      only_for("pf", "vf");
      only_for("vf", "vf");
      only_for("via", "vf");
      only_for("ring", "vf");
      auto name = m.string("name", true);
      if (!name) return false;
      if (!valid_ifname(*name)) {
        ctx_.error(m.where("name"), m.path_of("name"),
                   "'" + *name + "' is not a valid interface name (1 to 15 characters, no '/', ':' or spaces)");
        return false;
      }
      for (const auto& other : cfg_.virtio_devices)
        if (other.backend_kind == BackendKind::tap && other.tap.name == *name &&
            other.tap.netns == m.string("netns").value_or("")) {
          ctx_.error(m.where("name"), m.path_of("name"),
                     "tap '" + *name + "' is already the backend of '" + other.name + "'");
          return false;
        }
      dev.tap.name = *name;
      if (auto ns = m.string("netns")) {
        if (ns->find('/') != std::string::npos || *ns == "." || *ns == "..") {
          ctx_.error(m.where("netns"), m.path_of("netns"),
                     "'" + *ns + "' is not a network namespace name (as in 'ip netns')");
          return false;
        }
        dev.tap.netns = *ns;
      }
      if (m.has("offloads")) {
        dev.tap.offloads = TapOffloads{false, false, false, false, false};
        for_each_item(ctx_, m, "offloads", [&](const YAML::Node& n, const std::string& p) {
          static const std::vector<std::pair<const char*, bool TapOffloads::*>> names = {
              {"csum", &TapOffloads::csum}, {"tso4", &TapOffloads::tso4},
              {"tso6", &TapOffloads::tso6}, {"tso_ecn", &TapOffloads::tso_ecn},
              {"ufo", &TapOffloads::ufo}};
          for (const auto& [nm, member] : names)
            if (n.IsScalar() && n.Scalar() == nm) {
              dev.tap.offloads.*member = true;
              return;
            }
          ctx_.error(n, p, "expected one of csum, tso4, tso6, tso_ecn, ufo, got " + describe(n));
        });
        const auto& o = dev.tap.offloads;
        if ((o.tso4 || o.tso6 || o.ufo) && !o.csum)
          ctx_.error(m.where("offloads"), m.path_of("offloads"),
                     "tso4, tso6 and ufo need csum (segmentation offloads imply checksum offload)");
      }
      return true;
    }
    only_for("name", "tap");
    only_for("netns", "tap");
    only_for("offloads", "tap");
    auto pf_name = m.string("pf", true);
    auto vf_index = m.unsigned_in("vf", 0, 255, true);
    if (!pf_name || !vf_index) return false;
    if (m.has("via")) {
      auto via = m.choice<VfAttach>("via", {{"af_packet", VfAttach::af_packet}, {"macvtap", VfAttach::macvtap}}, true);
      if (!via) return false;
      dev.vf.via = *via;
    }
    if (m.has("ring") && dev.vf.via != VfAttach::af_packet) {
      ctx_.error(m.where("ring"), m.path_of("ring"), "'ring' is only used with 'via: af_packet'");
      return false;
    }
    if (m.has("ring")) {
      auto ring = m.choice<PacketRingMode>(
          "ring", {{"v3", PacketRingMode::v3}, {"v2", PacketRingMode::v2}, {"off", PacketRingMode::off}}, true);
      if (!ring) return false;
      dev.vf.ring = *ring;
    }
    PfRef ref;
    if (auto addr = PciAddress::parse(*pf_name))
      ref.address = addr;
    else
      ref.netdev = *pf_name;
    const PfConfig* pf = nullptr;
    for (const auto& candidate : cfg_.physical_functions)
      if ((ref.address && candidate.ref.address == ref.address) ||
          (!ref.address && candidate.ref.netdev == ref.netdev))
        pf = &candidate;
    if (!pf) {
      ctx_.error(m.where("pf"), m.path_of("pf"),
                 "PF '" + *pf_name + "' is not in physical_functions");
      return false;
    }
    if (*vf_index >= pf->num_vfs) {
      ctx_.error(m.where("vf"), m.path_of("vf"),
                 "VF index " + std::to_string(*vf_index) + " is not below num_vfs " +
                     std::to_string(pf->num_vfs) + " of PF " + pf->ref.to_string());
      return false;
    }
    for (const auto& vf : pf->vfs)
      if (vf.index == *vf_index && vf.assign && vf.assign->export_kind == ExportKind::vfio_user) {
        ctx_.error(m.where("vf"), m.path_of("vf"),
                   "VF " + std::to_string(*vf_index) + " of PF " + pf->ref.to_string() +
                       " is exported over vfio-user to '" + vf.assign->owner + "' (" +
                       line_ref(vf.where) + "); its netdev cannot also back a virtio device");
        return false;
      }
    dev.vf.pf = pf->ref;
    dev.vf.vf = static_cast<uint16_t>(*vf_index);
    for (const auto& other : cfg_.virtio_devices)
      if (other.backend_kind == BackendKind::vf && other.vf == dev.vf) {
        ctx_.error(m.where("vf"), m.path_of("vf"),
                   "VF " + std::to_string(dev.vf.vf) + " of PF " + dev.vf.pf.to_string() +
                       " is already the backend of '" + other.name + "'");
        return false;
      }
    return true;
  }

  // Every socket the daemon binds must be distinct.
  void check_sockets() {
    struct Use {
      std::string what;
      SourceLocation where;
    };
    std::map<std::string, Use> used;
    used[cfg_.control.socket] = {"control.socket", control_socket_where_};
    auto claim = [&](const std::string& path, const std::string& what, SourceLocation where) {
      auto [it, inserted] = used.emplace(path, Use{what, where});
      if (!inserted)
        ctx_.error(where, what,
                   "socket '" + path + "' is already used by " + it->second.what +
                       (it->second.where.line ? " (" + line_ref(it->second.where) + ")" : ""));
    };
    for (size_t p = 0; p < cfg_.physical_functions.size(); ++p)
      for (const auto& vf : cfg_.physical_functions[p].vfs)
        if (vf.assign && !vf.assign->socket.empty())
          claim(vf.assign->socket,
                "VF " + std::to_string(vf.index) + " of PF " + cfg_.physical_functions[p].ref.to_string(),
                vf.assign->socket_where);
    for (const auto& dev : cfg_.virtio_devices)
      claim(dev.socket, "virtio device '" + dev.name + "'", dev.socket_where);
  }

  // Two devices with one MAC on a host is a misconfiguration nobody wants.
  void check_macs() {
    std::map<MacAddress, std::string> used;
    auto claim = [&](const MacAddress& mac, const std::string& what, SourceLocation where) {
      auto [it, inserted] = used.emplace(mac, what);
      if (!inserted)
        ctx_.error(where, what, "MAC " + mac.to_string() + " is already used by " + it->second);
    };
    for (const auto& pf : cfg_.physical_functions)
      for (const auto& vf : pf.vfs)
        if (vf.mac) claim(*vf.mac, "VF " + std::to_string(vf.index) + " of PF " + pf.ref.to_string(), vf.where);
    for (const auto& dev : cfg_.virtio_devices)
      if (dev.mac) claim(*dev.mac, "virtio device '" + dev.name + "'", dev.where);
  }

  Context ctx_;
  Config cfg_;
  SourceLocation control_socket_where_;
};

}  // namespace

Config parse(std::string_view text, const std::string& file) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(text));
  } catch (const YAML::ParserException& e) {
    throw ConfigError({{file, e.mark.line + 1, e.mark.column + 1, "YAML syntax error: " + e.msg}});
  }
  if (!root.IsDefined() || root.IsNull())
    throw ConfigError({{file, 1, 1, "the file is empty; expected a mapping with 'version: 1'"}});
  return Loader(file).run(root);
}

Config load(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError({{path, 0, 0, std::string("cannot read: ") + std::strerror(errno)}});
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw ConfigError({{path, 0, 0, std::string("cannot read: ") + std::strerror(errno)}});
  return parse(text.str(), path);
}

}  // namespace sriovd::config
