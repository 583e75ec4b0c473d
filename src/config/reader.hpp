#pragma once
// The reading of one YAML config file: diagnostics collected with
// file:line:col (Context), mappings with a fixed set of keys and typed
// getters (Mapping), and the value checks the sections share. Internal
// to the config module.

#include <grp.h>
#include <net/if.h>
#include <pwd.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "sriovd/config/loader.hpp"

namespace sriovd::config {

// A user or group of this host by name (the config's only side effect
// besides reading the file is looking these up), or as a plain number.
inline std::optional<uint32_t> numeric_id(const std::string& s) {
  if (s.empty() || s.size() >= 10 || s.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return static_cast<uint32_t>(std::stoul(s));
}
inline std::optional<uid_t> user_id(const std::string& name) {
  std::vector<char> buf(16384);
  passwd pw{};
  passwd* found = nullptr;
  if (getpwnam_r(name.c_str(), &pw, buf.data(), buf.size(), &found) == 0 && found) return found->pw_uid;
  return numeric_id(name);
}
inline std::optional<gid_t> group_id(const std::string& name) {
  std::vector<char> buf(16384);
  group grp{};
  group* found = nullptr;
  if (getgrnam_r(name.c_str(), &grp, buf.data(), buf.size(), &found) == 0 && found) return found->gr_gid;
  return std::nullopt;
}

inline SourceLocation location_of(const YAML::Node& node) {
  const YAML::Mark m = node.Mark();
  return {m.line + 1, m.column + 1};
}

inline std::string line_ref(SourceLocation where) { return "line " + std::to_string(where.line); }

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

inline const char* kind_name(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Null: return "an empty value";
    case YAML::NodeType::Scalar: return node.Tag() == "!" ? "a string" : "a scalar";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Map: return "a mapping";
    default: return "nothing";
  }
}

inline std::string describe(const YAML::Node& node) {
  if (node.IsScalar()) return "'" + node.Scalar() + "'";
  return kind_name(node);
}

inline std::optional<uint64_t> parse_unsigned(const std::string& text) {
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
  Mapping(Context& ctx, const YAML::Node& node, std::string path, const std::vector<std::string>& allowed)
      : ctx_(ctx), node_(node), path_(std::move(path)) {
    if (!node_.IsMap()) {
      ctx_.error(node_, path_.empty() ? "document" : path_, std::string("expected a mapping, got ") + describe(node_));
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
        ctx_.error(key, path_,
                   "duplicate key '" + name + "' (first at " + line_ref(location_of(key_marks_.at(name))) + ")");
        continue;
      }
      key_marks_.emplace(name, key);
    }
  }

  [[nodiscard]] bool valid() const { return valid_; }
  [[nodiscard]] bool has(const std::string& key) const { return values_.count(key) != 0; }
  [[nodiscard]] SourceLocation where() const { return location_of(node_); }
  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] std::string path_of(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

  // The value node of `key`, or an undefined node (reported when required).
  YAML::Node get(const std::string& key, bool required) {
    auto it = values_.find(key);
    if (it == values_.end()) {
      if (required && valid_)
        ctx_.error(node_, path_.empty() ? "document" : path_, "missing required key '" + key + "'");
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

  std::optional<uint64_t> unsigned_in(const std::string& key, uint64_t min, uint64_t max, bool required = false) {
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
  std::optional<Enum> choice(const std::string& key, const std::vector<std::pair<const char*, Enum>>& table,
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

  static std::optional<uint64_t> unsigned_value(Context& ctx, const YAML::Node& n, const std::string& path,
                                                uint64_t min, uint64_t max) {
    const std::string expected = "expected an integer from " + std::to_string(min) + " to " + std::to_string(max);
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

  static std::optional<bool> boolean_value(Context& ctx, const YAML::Node& n, const std::string& path) {
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
inline void for_each_item(Context& ctx, Mapping& map, const std::string& key,
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

inline bool valid_ifname(const std::string& name) {
  if (name.empty() || name.size() >= IFNAMSIZ || name == "." || name == "..") return false;
  return std::none_of(name.begin(), name.end(), [](char c) { return c == '/' || c == ':' || c <= ' ' || c == 127; });
}

inline bool valid_identifier(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
           c == '.';
  });
}

// An absolute path (a directory's: trailing slashes dropped).
inline std::optional<std::string> absolute_path(Context& ctx, Mapping& map, const std::string& key) {
  auto path = map.string(key);
  if (!path) return std::nullopt;
  if ((*path)[0] != '/') {
    ctx.error(map.where(key), map.path_of(key), "expected an absolute path, got '" + *path + "'");
    return std::nullopt;
  }
  while (path->size() > 1 && path->back() == '/') path->pop_back();
  return path;
}

// A Unix socket path the daemon can bind: absolute and short enough for sun_path.
inline std::optional<std::string> socket_path(Context& ctx, Mapping& map, const std::string& key, bool required) {
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

inline std::optional<MacAddress> mac_value(Context& ctx, Mapping& map, const std::string& key) {
  auto text = map.string(key);
  if (!text) return std::nullopt;
  auto mac = MacAddress::parse(*text);
  if (!mac) {
    ctx.error(map.where(key), map.path_of(key), "expected a MAC address like 02:00:00:00:00:01, got '" + *text + "'");
    return std::nullopt;
  }
  if (mac->is_multicast()) {
    ctx.error(map.where(key), map.path_of(key), "'" + *text + "' is a multicast address; a device MAC must be unicast");
    return std::nullopt;
  }
  if (mac->is_zero()) {
    ctx.error(map.where(key), map.path_of(key),
              "00:00:00:00:00:00 is not a usable MAC; omit the key to leave the MAC unchanged");
    return std::nullopt;
  }
  return mac;
}

// A VF's network settings (mac, vlan, qos, trust, spoofchk, link_state,
// max_tx_rate, min_tx_rate), as the YAML's VF entries and a claim's
// VfConfig give them: the same checks, the same messages.
inline void read_vf_settings(Context& ctx, Mapping& m, VfConfig& vf) {
  vf.mac = mac_value(ctx, m, "mac");
  if (auto v = m.unsigned_in("vlan", 0, 4095)) vf.vlan = static_cast<uint16_t>(*v);
  if (auto q = m.unsigned_in("qos", 0, 7)) {
    vf.qos = static_cast<uint8_t>(*q);
    if (*q != 0 && !m.has("vlan")) ctx.error(m.where("qos"), m.path_of("qos"), "qos needs a vlan to tag with");
  }
  vf.trust = m.boolean("trust");
  vf.spoofchk = m.boolean("spoofchk");
  vf.link_state = m.choice<LinkState>(
      "link_state", {{"auto", LinkState::automatic}, {"enable", LinkState::enable}, {"disable", LinkState::disable}});
  if (auto v = m.unsigned_in("max_tx_rate", 0, UINT32_MAX)) vf.max_tx_rate = static_cast<uint32_t>(*v);
  if (auto v = m.unsigned_in("min_tx_rate", 0, UINT32_MAX)) vf.min_tx_rate = static_cast<uint32_t>(*v);
  if (vf.min_tx_rate && vf.max_tx_rate && *vf.max_tx_rate != 0 && *vf.min_tx_rate > *vf.max_tx_rate)
    ctx.error(
        m.where("min_tx_rate"), m.path_of("min_tx_rate"),
        "min_tx_rate " + std::to_string(*vf.min_tx_rate) + " exceeds max_tx_rate " + std::to_string(*vf.max_tx_rate));
}

inline std::optional<PciAddress> pci_value(Context& ctx, Mapping& map, const std::string& key, bool required) {
  auto text = map.string(key, required);
  if (!text) return std::nullopt;
  auto addr = PciAddress::parse(*text);
  if (!addr)
    ctx.error(map.where(key), map.path_of(key), "expected a PCI address like 0000:03:00.0, got '" + *text + "'");
  return addr;
}

}  // namespace sriovd::config
