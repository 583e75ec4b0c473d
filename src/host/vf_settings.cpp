#include "sriovd/host/vf_link.hpp"

namespace sriovd::host {

using json = nlohmann::json;

VfSettings VfSettings::only(const VfSettings& mask) const {
  VfSettings out;
  if (mask.mac) out.mac = mac;
  if (mask.vlan) out.vlan = vlan;
  if (mask.qos) out.qos = qos;
  if (mask.trust) out.trust = trust;
  if (mask.spoofchk) out.spoofchk = spoofchk;
  if (mask.link_state) out.link_state = link_state;
  if (mask.max_tx_rate) out.max_tx_rate = max_tx_rate;
  if (mask.min_tx_rate) out.min_tx_rate = min_tx_rate;
  return out;
}

json VfSettings::to_json() const {
  json j = json::object();
  if (mac) j["mac"] = mac->to_string();
  if (vlan) j["vlan"] = *vlan;
  if (qos) j["qos"] = *qos;
  if (trust) j["trust"] = *trust;
  if (spoofchk) j["spoofchk"] = *spoofchk;
  if (link_state) j["link_state"] = *link_state;
  if (max_tx_rate) j["max_tx_rate"] = *max_tx_rate;
  if (min_tx_rate) j["min_tx_rate"] = *min_tx_rate;
  return j;
}

VfSettings VfSettings::from_json(const json& j) {
  VfSettings s;
  if (j.contains("mac")) s.mac = MacAddress::parse(j["mac"].get<std::string>());
  if (j.contains("vlan")) s.vlan = j["vlan"].get<uint16_t>();
  if (j.contains("qos")) s.qos = j["qos"].get<uint8_t>();
  if (j.contains("trust")) s.trust = j["trust"].get<bool>();
  if (j.contains("spoofchk")) s.spoofchk = j["spoofchk"].get<bool>();
  if (j.contains("link_state")) s.link_state = j["link_state"].get<std::string>();
  if (j.contains("max_tx_rate")) s.max_tx_rate = j["max_tx_rate"].get<uint32_t>();
  if (j.contains("min_tx_rate")) s.min_tx_rate = j["min_tx_rate"].get<uint32_t>();
  return s;
}

}  // namespace sriovd::host
