// The DRA driver's record of prepared claims (state_dir/dra-claims.json)
// and what a stop leaves the host at.
#include <gtest/gtest.h>

#include <fstream>

#include "../../src/daemon/dra_driver.hpp"
#include "sriovd/config/loader.hpp"
#include "sriovd/daemon/daemon.hpp"
#include "support/temp_dir.hpp"

namespace sriovd::daemon {
namespace {

config::Config yaml() {
  return config::parse(R"(version: 1
host: simulated
simulated:
  physical_functions:
    - {address: "0000:3b:00.0", netdev: pf0}
physical_functions:
  - address: "0000:3b:00.0"
    num_vfs: 4
    vfs:
      - {index: 0, mac: "02:00:00:00:00:10", assign: {owner: vm, export: none}}
virtio_devices:
  - {name: vnet0, type: net, transport: vhost-user, socket: /run/sriovd/vnet0.sock, backend: {type: vf, pf: "0000:3b:00.0", vf: 3}}
)",
                       "test.yaml");
}

ClaimRecord record(const std::string& uid, uint16_t index, const std::string& params) {
  ClaimRecord r;
  r.ref = {"default", "vm-" + uid, uid};
  config::ClaimedVf vf;
  vf.claim = "default/vm-" + uid;
  vf.uid = uid;
  vf.pf.address = PciAddress::parse("0000:3b:00.0");
  vf.index = index;
  vf.config = config::parse_claim_vf_config(
      R"({"apiVersion": "sriovd.io/v1alpha1", "kind": "VfConfig", )" + params.substr(1), "test");
  if (vf.config.driver == config::ClaimDriver::vfio_user) vf.socket = "/run/sriovd/dra/" + uid + ".sock";
  r.vfs.push_back(vf);
  r.devices.push_back({{"vf"}, "node-a", "vf-0000-3b-02-" + std::to_string(index), {"sriovd.io/vf=" + uid}});
  return r;
}

TEST(DraRecords, WrittenAndReadBackTheSame) {
  test::TempDir dir;
  const std::vector<ClaimRecord> recs = {
      record("u1", 1, R"({"mac": "02:00:00:00:0a:01", "vlan": 200, "qos": 3, "trust": true, "max_tx_rate": 500})"),
      record("u2", 2, R"({"driver": "vfio-user", "spoofchk": false, "link_state": "disable"})")};
  write_claim_records(dir.file("dra-claims.json"), recs);
  const auto back = read_claim_records(dir.file("dra-claims.json"));
  ASSERT_EQ(back.size(), 2U);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(back[i].ref.uid, recs[i].ref.uid);
    EXPECT_EQ(back[i].ref.name, recs[i].ref.name);
    ASSERT_EQ(back[i].vfs.size(), 1U);
    EXPECT_EQ(back[i].vfs[0].config, recs[i].vfs[0].config);
    EXPECT_EQ(back[i].vfs[0].index, recs[i].vfs[0].index);
    EXPECT_EQ(back[i].vfs[0].pf, recs[i].vfs[0].pf);
    EXPECT_EQ(back[i].vfs[0].socket, recs[i].vfs[0].socket);
    EXPECT_EQ(back[i].devices, recs[i].devices);
  }
  EXPECT_TRUE(read_claim_records(dir.file("none.json")).empty());  // no file: nothing prepared
}

TEST(DraRecords, ABadRecordIsRefusedNamingTheFile) {
  test::TempDir dir;
  const std::string path = dir.write("dra-claims.json", R"({"version": 1, "claims": [{"namespace": "default"}]})");
  try {
    read_claim_records(path);
    FAIL() << "a record without its claim's name was read";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  // A setting a claim could not have had (edited by hand, a newer sriovd)
  // is refused as the claim's parameters are.
  dir.write("bad.json", R"({"version": 1, "claims": [{"namespace": "d", "name": "n", "uid": "u", "devices": [],
    "vfs": [{"pf": "0000:3b:00.0", "index": 1, "config": {"apiVersion": "sriovd.io/v1alpha1", "kind": "VfConfig", "vlan": 9999}}]}]})");
  EXPECT_THROW(read_claim_records(dir.file("bad.json")), std::runtime_error);
  dir.write("v2.json", R"({"version": 2, "claims": []})");
  EXPECT_THROW(read_claim_records(dir.file("v2.json")), std::runtime_error);
}

TEST(DraRecords, AStopKeepsOnlyTheClaimsVfs) {
  const config::Config y = yaml();
  EXPECT_FALSE(Daemon::kept_at_stop(y, {}).has_value());  // nothing prepared: all is released
  const auto claims = record("u1", 1, R"({"mac": "02:00:00:00:0a:01", "vlan": 7})").vfs;
  const auto kept = Daemon::kept_at_stop(y, claims);
  ASSERT_TRUE(kept.has_value());
  ASSERT_EQ(kept->physical_functions.size(), 1U);
  const auto& pf = kept->physical_functions[0];
  EXPECT_EQ(pf.num_vfs, 4);      // the PF keeps its VFs: the claim's pod holds one
  ASSERT_EQ(pf.vfs.size(), 1U);  // the file's VF 0 is released, the claim's VF 1 kept
  EXPECT_EQ(pf.vfs[0].index, 1);
  EXPECT_EQ(pf.vfs[0].vlan, 7);
  ASSERT_TRUE(pf.vfs[0].assign.has_value());
  EXPECT_EQ(pf.vfs[0].assign->owner, "claim-u1");
  EXPECT_TRUE(kept->virtio_devices.empty());  // the file's devices stop with sriovd
}

TEST(DraRecords, DeviceNamesAreDnsLabels) {
  EXPECT_EQ(dra_device_name(*PciAddress::parse("0000:3b:02.1")), "vf-0000-3b-02-1");
}

}  // namespace
}  // namespace sriovd::daemon
