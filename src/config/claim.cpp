// A claim's VfConfig: the YAML loader's VF reader on the claim's parameters.

#include "sriovd/config/claim.hpp"

#include <nlohmann/json.hpp>

#include "reader.hpp"
#include "sriovd/config/loader.hpp"

namespace sriovd::config {

const char* to_string(ClaimDriver d) {
  switch (d) {
    case ClaimDriver::vfio_pci: return "vfio-pci";
    case ClaimDriver::netdev: return "netdev";
    case ClaimDriver::vfio_user: return "vfio-user";
    case ClaimDriver::virtio: return "virtio";
  }
  return "?";
}

ClaimVfConfig parse_claim_vf_config(std::string_view parameters, const std::string& source) {
  Context ctx(source);
  // The parameters are whatever a user who may create claims wrote: parsed
  // as JSON (nlohmann: no recursion on the input's depth), and a VfConfig
  // is flat - only then does the YAML reader (recursive) see it, one
  // scalar per key.
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(parameters);
  } catch (const nlohmann::json::exception& e) {
    ctx.error(SourceLocation{}, "", std::string("not JSON: ") + e.what());
    throw ConfigError(ctx.take());
  }
  if (!j.is_object()) {
    ctx.error(SourceLocation{}, "", std::string("expected a mapping, got ") + j.type_name());
    throw ConfigError(ctx.take());
  }
  YAML::Node root(YAML::NodeType::Map);
  for (const auto& [key, value] : j.items()) {
    if (value.is_object() || value.is_array() || value.is_null()) {
      ctx.error(SourceLocation{}, key, std::string("expected a single value, got ") + value.type_name());
      continue;
    }
    // A JSON string stays a string (the "!" tag the YAML reader checks);
    // numbers and booleans are plain scalars.
    YAML::Node v(value.is_string() ? value.get<std::string>() : value.dump());
    if (value.is_string()) v.SetTag("!");
    root[key] = v;
  }
  if (ctx.failed()) throw ConfigError(ctx.take());
  Mapping m(ctx, root, "",
            {"apiVersion", "kind", "mac", "vlan", "qos", "trust", "spoofchk", "link_state", "max_tx_rate",
             "min_tx_rate", "mtu", "driver"});
  if (!m.valid()) throw ConfigError(ctx.take());
  ClaimVfConfig c;
  if (auto v = m.string("apiVersion", true); v && *v != kVfConfigApiVersion)
    ctx.error(m.where("apiVersion"), "apiVersion",
              "'" + *v + "' is not an API version of sriovd (expected " + kVfConfigApiVersion + ")");
  if (auto k = m.string("kind", true); k && *k != kVfConfigKind)
    ctx.error(m.where("kind"), "kind", "'" + *k + "' is not a kind of sriovd (expected " + kVfConfigKind + ")");
  read_vf_settings(ctx, m, c.settings);
  if (auto mtu = m.unsigned_in("mtu", 68, 65535)) c.mtu = static_cast<uint16_t>(*mtu);
  c.driver = m.choice<ClaimDriver>("driver", {{"vfio-pci", ClaimDriver::vfio_pci},
                                              {"netdev", ClaimDriver::netdev},
                                              {"vfio-user", ClaimDriver::vfio_user},
                                              {"virtio", ClaimDriver::virtio}});
  if (ctx.failed()) throw ConfigError(ctx.take());
  return c;
}

std::string claim_vf_config_json(const ClaimVfConfig& c) {
  const VfConfig& s = c.settings;
  nlohmann::json j = {{"apiVersion", kVfConfigApiVersion}, {"kind", kVfConfigKind}};
  if (s.mac) j["mac"] = s.mac->to_string();
  if (s.vlan) {
    j["vlan"] = *s.vlan;
    if (s.qos) j["qos"] = s.qos;
  }
  if (s.trust) j["trust"] = *s.trust;
  if (s.spoofchk) j["spoofchk"] = *s.spoofchk;
  if (s.link_state) j["link_state"] = to_string(*s.link_state);
  if (s.max_tx_rate) j["max_tx_rate"] = *s.max_tx_rate;
  if (s.min_tx_rate) j["min_tx_rate"] = *s.min_tx_rate;
  if (c.mtu) j["mtu"] = *c.mtu;
  if (c.driver) j["driver"] = to_string(*c.driver);
  return j.dump();
}

ClaimVfConfig merge(const ClaimVfConfig& base, const ClaimVfConfig& over) {
  ClaimVfConfig out = base;
  const VfConfig& o = over.settings;
  VfConfig& s = out.settings;
  if (o.mac) s.mac = o.mac;
  if (o.vlan) {
    s.vlan = o.vlan;
    s.qos = o.qos;
  }
  if (o.trust) s.trust = o.trust;
  if (o.spoofchk) s.spoofchk = o.spoofchk;
  if (o.link_state) s.link_state = o.link_state;
  if (o.max_tx_rate) s.max_tx_rate = o.max_tx_rate;
  if (o.min_tx_rate) s.min_tx_rate = o.min_tx_rate;
  if (over.mtu) out.mtu = over.mtu;
  if (over.driver) out.driver = over.driver;
  return out;
}

namespace {

// One PF, however each names it (the loader gives a simulated PF both its
// address and its netdev; a claim's device knows its address).
bool same_pf(const PfRef& a, const PfRef& b) {
  if (a.address && b.address) return *a.address == *b.address;
  return !a.netdev.empty() && a.netdev == b.netdev;
}

bool bridged(const Config& c, const PfRef& pf, uint16_t index) {
  for (const VirtioDevice& d : c.virtio_devices)
    if (d.backend_kind == BackendKind::vf && same_pf(d.vf.pf, pf) && d.vf.vf == index) return true;
  return false;
}

}  // namespace

std::vector<std::pair<PfRef, uint16_t>> dra_offered_vfs(const Config& yaml) {
  std::vector<std::pair<PfRef, uint16_t>> out;
  for (const PfConfig& pf : yaml.physical_functions)
    for (uint16_t i = 0; i < pf.num_vfs; ++i) {
      bool listed = false;
      for (const VfConfig& vf : pf.vfs) listed = listed || vf.index == i;
      if (!listed && !bridged(yaml, pf.ref, i)) out.emplace_back(pf.ref, i);
    }
  return out;
}

std::string claim_device_name(const std::string& uid) { return "claim-" + uid.substr(0, 8); }

Config with_claims(const Config& yaml, const std::vector<ClaimedVf>& claims) {
  if (claims.empty()) return yaml;
  YAML::Node root = YAML::Load(to_yaml(yaml));
  std::vector<std::pair<const ClaimedVf*, std::pair<std::string, uint16_t>>> held;
  for (const ClaimedVf& c : claims) {
    const std::string who = "claim " + c.claim + " (" + c.uid + ")";
    const std::string vf_name = "VF " + std::to_string(c.index) + " of PF " + c.pf.to_string();
    size_t p = 0;
    while (p < yaml.physical_functions.size() && !same_pf(yaml.physical_functions[p].ref, c.pf)) ++p;
    if (p == yaml.physical_functions.size())
      throw std::runtime_error(who + ": PF " + c.pf.to_string() + " is not in the config");
    const PfConfig& pf = yaml.physical_functions[p];
    if (c.index >= pf.num_vfs)
      throw std::runtime_error(who + ": " + vf_name + " is not below its num_vfs " + std::to_string(pf.num_vfs));
    if (bridged(yaml, c.pf, c.index))
      throw std::runtime_error(who + ": " + vf_name +
                               " is prepared for it, and the config bridges it to a virtio device: a prepared VF stays "
                               "the claim's until it is unprepared");
    for (const VfConfig& vf : pf.vfs)
      if (vf.index == c.index)
        throw std::runtime_error(who + ": " + vf_name + " is prepared for it, and the config lists it (line " +
                                 std::to_string(vf.where.line) +
                                 "): a prepared VF stays the claim's until it is unprepared");
    for (const auto& [other, key] : held)
      if (key == std::make_pair(pf.ref.to_string(), c.index))
        throw std::runtime_error(who + ": " + vf_name + " is already held by claim " + other->claim);
    held.push_back({&c, {pf.ref.to_string(), c.index}});
    const ClaimDriver driver = c.config.driver.value_or(ClaimDriver::vfio_pci);
    if (c.config.mtu && (driver == ClaimDriver::vfio_pci || driver == ClaimDriver::vfio_user))
      throw std::runtime_error(who +
                               ": mtu is for a VF with a netdev (driver: netdev) or a virtio device (driver: "
                               "virtio); a VF given to a guest (" +
                               to_string(driver) + ") has its MTU set by the guest");
    if ((driver == ClaimDriver::vfio_user || driver == ClaimDriver::virtio) && c.socket.empty())
      throw std::runtime_error(who + ": no socket for its " + to_string(driver) + " device");

    const VfConfig& s = c.config.settings;
    YAML::Node vf;
    vf["index"] = c.index;
    if (s.mac && driver != ClaimDriver::virtio) vf["mac"] = s.mac->to_string();
    if (s.vlan) vf["vlan"] = *s.vlan;
    if (s.qos) vf["qos"] = static_cast<unsigned>(s.qos);
    if (s.trust) vf["trust"] = *s.trust;
    if (s.spoofchk) vf["spoofchk"] = *s.spoofchk;
    if (s.link_state) vf["link_state"] = to_string(*s.link_state);
    if (s.max_tx_rate) vf["max_tx_rate"] = *s.max_tx_rate;
    if (s.min_tx_rate) vf["min_tx_rate"] = *s.min_tx_rate;
    if (c.config.mtu && driver == ClaimDriver::netdev) vf["mtu"] = *c.config.mtu;
    if (driver == ClaimDriver::vfio_pci) {
      vf["assign"]["owner"] = "claim-" + c.uid;
      vf["assign"]["export"] = "none";
    } else if (driver == ClaimDriver::vfio_user) {
      vf["assign"]["owner"] = "claim-" + c.uid;
      vf["assign"]["export"] = "vfio-user";
      vf["assign"]["socket"] = c.socket;
    }
    root["physical_functions"][p]["vfs"].push_back(vf);
    if (driver == ClaimDriver::virtio) {
      YAML::Node d;
      d["name"] = claim_device_name(c.uid);
      d["type"] = "net";
      d["transport"] = "vhost-user";
      d["socket"] = c.socket;
      if (s.mac) d["mac"] = s.mac->to_string();
      if (c.config.mtu) d["mtu"] = *c.config.mtu;
      d["backend"]["type"] = "vf";
      d["backend"]["pf"] = pf.ref.to_string();
      d["backend"]["vf"] = c.index;
      root["virtio_devices"].push_back(d);
    }
  }
  YAML::Emitter out;
  out << root;
  try {
    Config merged = parse(out.c_str(), yaml.path + " with the prepared claims");
    merged.path = yaml.path;
    return merged;
  } catch (const ConfigError& e) {
    throw std::runtime_error(std::string("the prepared claims do not fit the config: ") + e.what());
  }
}

}  // namespace sriovd::config
