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
  EXPECT_NE(error_of("[1, 2]").find("expected a mapping, got array"), std::string::npos);
  EXPECT_NE(error_of("vlan: 5").find("not JSON"), std::string::npos);
  EXPECT_NE(error_of("{" + kHead + R"(, "vlan": {"id": 5}})").find("vlan: expected a single value, got object"),
            std::string::npos);
  EXPECT_NE(error_of("{" + kHead + R"(, "mac": null})").find("mac: expected a single value, got null"),
            std::string::npos);
  // As deep as a user can nest it: refused, never recursed into.
  EXPECT_NE(error_of("{" + kHead + R"(, "vlan": )" + std::string(100000, '[') + std::string(100000, ']') + "}")
                .find("vlan: expected a single value, got array"),
            std::string::npos);
  EXPECT_NE(error_of("{" + kHead + R"(, "vlan": "5"})").find("vlan"), std::string::npos) << "a string is not a number";
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

const char* kBase = R"(version: 1
host: simulated
state_dir: /tmp/sriovd-claim-test
simulated:
  physical_functions:
    - {address: "0000:3b:00.0", netdev: ens1f0, total_vfs: 8}
physical_functions:
  - address: "0000:3b:00.0"
    num_vfs: 6
    vfs:
      - {index: 0, mac: "02:00:00:00:00:10", assign: {owner: vm-x, export: none}}
virtio_devices:
  - name: bridge1
    type: net
    transport: vhost-user
    socket: /tmp/sriovd-claim-test/b1.sock
    mac: "02:00:00:00:00:11"
    backend: {type: vf, pf: "0000:3b:00.0", vf: 1}
)";

ClaimedVf claimed(const std::string& name, uint16_t index, const std::string& params, const std::string& socket = "") {
  ClaimedVf c;
  c.claim = "default/" + name;
  c.uid = name + "-0123456789";
  c.pf.address = PciAddress::parse("0000:3b:00.0");
  c.index = index;
  c.config = parse_claim_vf_config("{" + kHead + params + "}", "claim " + c.claim);
  c.socket = socket;
  return c;
}

TEST(ClaimedVfs, TheDriverOffersWhatTheYamlLeaves) {
  const Config base = parse(kBase, "base.yaml");
  std::vector<uint16_t> offered;
  for (const auto& [pf, index] : dra_offered_vfs(base)) offered.push_back(index);
  EXPECT_EQ(offered, (std::vector<uint16_t>{2, 3, 4, 5}));
}

TEST(ClaimedVfs, EachDriverAsTheYamlWouldSayIt) {
  const Config base = parse(kBase, "base.yaml");
  const Config c = with_claims(
      base, {claimed("vm-a", 2, R"(, "vlan": 100, "qos": 2, "trust": true, "mac": "02:00:00:00:00:a2")"),
             claimed("pod-b", 3, R"(, "driver": "netdev", "spoofchk": false, "link_state": "disable")"),
             claimed("vm-c", 4, R"(, "driver": "vfio-user", "max_tx_rate": 500)", "/run/sriovd/claims/vm-c.sock"),
             claimed("vm-d", 5, R"(, "driver": "virtio", "mac": "02:00:00:00:00:d5", "mtu": 9000)",
                     "/run/sriovd/claims/vm-d.sock")});
  EXPECT_EQ(c.path, base.path);
  const auto& vfs = c.physical_functions[0].vfs;
  const auto vf = [&](uint16_t i) -> const VfConfig& {
    for (const auto& v : vfs)
      if (v.index == i) return v;
    throw std::runtime_error("no VF " + std::to_string(i));
  };
  EXPECT_EQ(vf(2).vlan, 100);
  EXPECT_EQ(vf(2).qos, 2);
  EXPECT_EQ(vf(2).trust, true);
  EXPECT_EQ(vf(2).mac->to_string(), "02:00:00:00:00:a2");
  ASSERT_TRUE(vf(2).assign);
  EXPECT_EQ(vf(2).assign->owner, "claim-vm-a-0123456789");
  EXPECT_EQ(vf(2).assign->export_kind, ExportKind::none);
  EXPECT_FALSE(vf(3).assign) << "netdev: the VF keeps its own driver";
  EXPECT_EQ(vf(3).spoofchk, false);
  EXPECT_EQ(vf(3).link_state, LinkState::disable);
  ASSERT_TRUE(vf(4).assign);
  EXPECT_EQ(vf(4).assign->export_kind, ExportKind::vfio_user);
  EXPECT_EQ(vf(4).assign->socket, "/run/sriovd/claims/vm-c.sock");
  EXPECT_EQ(vf(4).max_tx_rate, 500U);
  ASSERT_EQ(c.virtio_devices.size(), 2U);
  const VirtioDevice& d = c.virtio_devices[1];
  EXPECT_EQ(d.name, "claim-vm-d-012");
  EXPECT_EQ(d.socket, "/run/sriovd/claims/vm-d.sock");
  EXPECT_EQ(d.mac->to_string(), "02:00:00:00:00:d5");
  EXPECT_EQ(d.mtu, 9000);
  EXPECT_EQ(d.vf.vf, 5);
  // The YAML's own entries are as they were.
  EXPECT_EQ(vf(0).assign->owner, "vm-x");
  EXPECT_EQ(to_yaml(with_claims(base, {})), to_yaml(base));
}

TEST(ClaimedVfs, AVfTheDriverDoesNotOfferIsRefusedNamingTheClaim) {
  const Config base = parse(kBase, "base.yaml");
  const auto error_of = [&](std::vector<ClaimedVf> claims) {
    try {
      (void)with_claims(base, claims);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of({claimed("vm-a", 0, "")})
                .find("claim default/vm-a (vm-a-0123456789): VF 0 of PF 0000:3b:00.0 is "
                      "prepared for it, and the config lists it (line 11)"),
            std::string::npos)
      << error_of({claimed("vm-a", 0, "")});
  EXPECT_NE(error_of({claimed("vm-a", 1, "")}).find("bridges it to a virtio device"), std::string::npos);
  EXPECT_NE(error_of({claimed("vm-a", 6, "")}).find("is not below its num_vfs 6"), std::string::npos);
  EXPECT_NE(error_of({claimed("vm-a", 2, ""), claimed("vm-b", 2, "")}).find("already held by claim default/vm-a"),
            std::string::npos);
  EXPECT_NE(error_of({claimed("vm-a", 2, R"(, "mtu": 9000)")}).find("has its MTU set by the guest"), std::string::npos);
  {
    // A VF on its own driver takes the claim's MTU on its netdev.
    const Config c =
        with_claims(parse(kBase, "base.yaml"), {claimed("vm-a", 2, R"(, "driver": "netdev", "mtu": 9000)")});
    const VfConfig* vf = nullptr;
    for (const auto& v : c.physical_functions[0].vfs)
      if (v.index == 2) vf = &v;
    ASSERT_NE(vf, nullptr);
    EXPECT_EQ(vf->mtu, 9000);
    EXPECT_FALSE(vf->assign.has_value());
  }
  EXPECT_NE(error_of({claimed("vm-a", 2, R"(, "driver": "vfio-user")")}).find("no socket"), std::string::npos);
  // What only the loader knows: a MAC the YAML already gives a device.
  EXPECT_NE(error_of({claimed("vm-a", 2, R"(, "mac": "02:00:00:00:00:10")")}).find("do not fit the config"),
            std::string::npos);
  ClaimedVf elsewhere = claimed("vm-a", 2, "");
  elsewhere.pf.address = PciAddress::parse("0000:5e:00.0");
  EXPECT_NE(error_of({elsewhere}).find("PF 0000:5e:00.0 is not in the config"), std::string::npos);
}

TEST(DraConfig, TheSectionAndItsDefaults) {
  const std::string head = std::string(kBase) + "kubernetes:\n";
  const Config d = parse(head + "  dra: {}\n", "dra.yaml");
  EXPECT_TRUE(d.kubernetes.dra.enabled);
  EXPECT_EQ(d.kubernetes.dra.driver, "sriovd.io");
  EXPECT_EQ(d.kubernetes.dra.registry_dir, "/var/lib/kubelet/plugins_registry");
  EXPECT_EQ(d.kubernetes.dra.plugins_dir, "/var/lib/kubelet/plugins");
  EXPECT_FALSE(parse(kBase, "no.yaml").kubernetes.dra.enabled);
  const Config c = parse(head +
                             "  dra: {driver: vf.example.com, node_name: node-a, kubeconfig: /etc/sriovd/kubeconfig,\n"
                             "        registry_dir: /k/reg/, plugins_dir: /k/plugins}\n",
                         "dra.yaml");
  EXPECT_EQ(c.kubernetes.dra.driver, "vf.example.com");
  EXPECT_EQ(c.kubernetes.dra.node_name, "node-a");
  EXPECT_EQ(c.kubernetes.dra.kubeconfig, "/etc/sriovd/kubeconfig");
  EXPECT_EQ(c.kubernetes.dra.registry_dir, "/k/reg");
  EXPECT_EQ(parse(to_yaml(c), "again.yaml").kubernetes.dra, c.kubernetes.dra);
  const auto error_of = [&](const std::string& dra) {
    try {
      (void)parse(head + "  dra: " + dra + "\n", "bad.yaml");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of("{driver: Sriovd_IO}").find("kubernetes.dra.driver: 'Sriovd_IO' is not a DNS subdomain"),
            std::string::npos);
  EXPECT_NE(error_of("{node_name: 'node a'}").find("not a Kubernetes node name"), std::string::npos);
  EXPECT_NE(error_of("{kubeconfig: kube.conf}").find("expected an absolute path"), std::string::npos);
  EXPECT_NE(error_of("{plugin_dir: /x}").find("unknown key 'plugin_dir'"), std::string::npos);
}

}  // namespace
}  // namespace sriovd::config
