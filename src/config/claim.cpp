// A claim's VfConfig: the YAML loader's VF reader on the claim's parameters.

#include "sriovd/config/claim.hpp"

#include "reader.hpp"

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
  YAML::Node root;
  try {
    root = YAML::Load(std::string(parameters));
  } catch (const YAML::Exception& e) {
    ctx.error(SourceLocation{e.mark.line + 1, e.mark.column + 1}, "", "not JSON: " + e.msg);
    throw ConfigError(ctx.take());
  }
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

}  // namespace sriovd::config
