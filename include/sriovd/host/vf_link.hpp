#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>
#include "sriovd/util/pci_address.hpp"

namespace sriovd::host {

// A VF's network settings as the PF's driver holds them (IFLA_VF_*). A field
// left empty is "not set / not known".
struct VfSettings {
  std::optional<MacAddress> mac;
  std::optional<uint16_t> vlan;
  std::optional<uint8_t> qos;
  std::optional<bool> trust;
  std::optional<bool> spoofchk;
  std::optional<std::string> link_state;  // auto | enable | disable
  std::optional<uint32_t> max_tx_rate;    // Mbit/s
  std::optional<uint32_t> min_tx_rate;

  bool operator==(const VfSettings&) const = default;
  [[nodiscard]] bool empty() const { return *this == VfSettings{}; }
  // The fields set in `mask`, taken from this.
  [[nodiscard]] VfSettings only(const VfSettings& mask) const;

  [[nodiscard]] nlohmann::json to_json() const;
  static VfSettings from_json(const nlohmann::json& j);
};

// Reads and changes VF settings through a PF's netdev.
class VfLinkControl {
 public:
  virtual ~VfLinkControl() = default;
  virtual VfSettings get(const std::string& pf_netdev, unsigned vf) = 0;
  // Applies the fields that are set. Throws with the PF, the VF, the
  // setting and the kernel's reason.
  virtual void set(const std::string& pf_netdev, unsigned vf, const VfSettings& settings) = 0;
};

}  // namespace sriovd::host
