#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
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

// A PF driver's refusal of one VF setting: which setting ("mac", "vlan",
// "trust", "spoofchk", "link_state", "rate") and the kernel's errno.
class VfSettingRefused : public std::runtime_error {
 public:
  VfSettingRefused(std::string setting, int error, const std::string& what)
      : std::runtime_error(what), setting_(std::move(setting)), error_(error) {}
  [[nodiscard]] const std::string& setting() const { return setting_; }
  [[nodiscard]] int error() const { return error_; }

 private:
  std::string setting_;
  int error_;
};

// Reads and changes VF settings through a PF's netdev.
class VfLinkControl {
 public:
  virtual ~VfLinkControl() = default;
  virtual VfSettings get(const std::string& pf_netdev, unsigned vf) = 0;
  // Applies the fields that are set, one request per setting (VLAN with QoS,
  // the two rates together). Throws VfSettingRefused with the PF, the VF,
  // the setting and the kernel's reason when the driver refuses one.
  virtual void set(const std::string& pf_netdev, unsigned vf, const VfSettings& settings) = 0;
};

}  // namespace sriovd::host
