// A claim's VfConfig (DRA opaque parameters): read as the YAML's VF entries
// are, every error naming where it came from and the field.
#include "sriovd/config/claim.hpp"

#include <gtest/gtest.h>

#include "sriovd/config/loader.hpp"

namespace sriovd::config {
namespace {

const std::string kHead = R"("apiVersion": "sriovd.io/v1alpha1", "kind": "VfConfig")";

std::string error_of(const std::string& json) {
  try {
    (void)parse_claim_vf_config(json, "claim default/vm-a, config 2 (FromClaim)");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

TEST(ClaimVfConfig, EverySettingAsTheApiServerStoresIt) {
  const ClaimVfConfig c = parse_claim_vf_config(
      "{" + kHead +
          R"(, "mac": "02:00:00:00:aa:01", "vlan": 100, "qos": 3, "trust": true, "spoofchk": false,
             "link_state": "enable", "max_tx_rate": 1000, "min_tx_rate": 100, "mtu": 9000, "driver": "vfio-user"})",
      "claim default/vm-a, config 1 (FromClass)");
  EXPECT_EQ(c.settings.mac->to_string(), "02:00:00:00:aa:01");
  EXPECT_EQ(c.settings.vlan, 100);
  EXPECT_EQ(c.settings.qos, 3);
  EXPECT_EQ(c.settings.trust, true);
  EXPECT_EQ(c.settings.spoofchk, false);
  EXPECT_EQ(c.settings.link_state, LinkState::enable);
  EXPECT_EQ(c.settings.max_tx_rate, 1000U);
  EXPECT_EQ(c.settings.min_tx_rate, 100U);
  EXPECT_EQ(c.mtu, 9000);
  EXPECT_EQ(c.driver, ClaimDriver::vfio_user);
  // Nothing set: nothing touched.
  const ClaimVfConfig none = parse_claim_vf_config("{" + kHead + "}", "x");
  EXPECT_FALSE(none.settings.mac || none.settings.vlan || none.settings.trust || none.mtu || none.driver);
}

TEST(ClaimVfConfig, WhatIsWrongIsNamedWithItsSource) {
  const std::string where = "claim default/vm-a, config 2 (FromClaim)";
  EXPECT_NE(error_of(R"({"kind": "VfConfig"})").find("missing required key 'apiVersion'"), std::string::npos);
  EXPECT_NE(error_of(R"({"apiVersion": "sriovd.io/v2", "kind": "VfConfig"})").find("'sriovd.io/v2' is not an API"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"apiVersion": "sriovd.io/v1alpha1", "kind": "NetConfig"})").find("'NetConfig' is not a kind"),
            std::string::npos);
  const std::string unknown = error_of("{" + kHead + R"(, "vlanid": 5})");
  EXPECT_NE(unknown.find(where), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("unknown key 'vlanid'"), std::string::npos) << unknown;
  EXPECT_NE(error_of("{" + kHead + R"(, "vlan": 4096})").find("vlan"), std::string::npos);
  EXPECT_NE(error_of("{" + kHead + R"(, "qos": 2})").find("qos needs a vlan"), std::string::npos);
  EXPECT_NE(error_of("{" + kHead + R"(, "mac": "01:00:5e:00:00:01"})").find("multicast"), std::string::npos);
  EXPECT_NE(error_of("{" + kHead + R"(, "mac": 12})").find("MAC address"), std::string::npos);
  EXPECT_NE(error_of("{" + kHead + R"(, "min_tx_rate": 500, "max_tx_rate": 100})").find("exceeds max_tx_rate"),
            std::string::npos);
  EXPECT_NE(error_of("{" + kHead + R"(, "mtu": 20})").find("mtu"), std::string::npos);
  EXPECT_NE(error_of("{" + kHead + R"(, "driver": "igb"})").find("expected one of vfio-pci, netdev, vfio-user, virtio"),
            std::string::npos);
  EXPECT_NE(error_of("{" + kHead + R"(, "trust": "yes please"})").find("trust"), std::string::npos);
  EXPECT_NE(error_of(R"({"apiVersion": )").find("not JSON"), std::string::npos);
  EXPECT_NE(error_of("[1, 2]").find("expected a mapping"), std::string::npos);
  // Every problem at once, not the first only.
  const std::string two = error_of("{" + kHead + R"(, "vlan": 9999, "driver": "x"})");
  EXPECT_NE(two.find("vlan"), std::string::npos) << two;
  EXPECT_NE(two.find("driver"), std::string::npos) << two;
}

TEST(ClaimVfConfig, TheClaimsConfigOverridesTheClasss) {
  const ClaimVfConfig from_class = parse_claim_vf_config(
      "{" + kHead + R"(, "vlan": 10, "qos": 1, "trust": false, "driver": "vfio-pci", "mtu": 1500})", "class");
  const ClaimVfConfig from_claim =
      parse_claim_vf_config("{" + kHead + R"(, "vlan": 20, "mac": "02:00:00:00:00:09", "driver": "netdev"})", "claim");
  const ClaimVfConfig c = merge(from_class, from_claim);
  EXPECT_EQ(c.settings.vlan, 20);
  EXPECT_EQ(c.settings.qos, 0) << "the qos of vlan 10 does not go with vlan 20";
  EXPECT_EQ(c.settings.trust, false);
  EXPECT_EQ(c.settings.mac->to_string(), "02:00:00:00:00:09");
  EXPECT_EQ(c.driver, ClaimDriver::netdev);
  EXPECT_EQ(c.mtu, 1500);
  EXPECT_EQ(merge(from_class, ClaimVfConfig{}), from_class);
}

}  // namespace
}  // namespace sriovd::config
