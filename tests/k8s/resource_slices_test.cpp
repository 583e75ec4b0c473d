// The DRA driver's ResourceSlices against the API-server stand-in, which
// checks every slice written against upstream's validation rules.
#include "sriovd/k8s/resource_slices.hpp"

#include <gtest/gtest.h>

#include "k8s/apiserver_fixture.hpp"

namespace sriovd::k8s {
namespace {

using namespace test_support;
using json = nlohmann::json;

const std::string kNodeUid = "3f0e2c4a-0000-4000-8000-00000000000a";

std::vector<SliceDevice> vfs(size_t n) {
  std::vector<SliceDevice> out;
  for (size_t i = 0; i < n; ++i) {
    char addr[32];
    std::snprintf(addr, sizeof addr, "0000:%02zx:%02zx.%zu", 0x3b + i / 256, (i / 8) % 32, i % 8);
    std::string name = std::string("vf-") + addr;
    for (char& c : name)
      if (c == ':' || c == '.') c = '-';
    out.push_back({name,
                   {{"sriovd.io/pciAddress", std::string(addr)},
                    {"sriovd.io/vfIndex", static_cast<int64_t>(i)},
                    {"sriovd.io/pfName", std::string("ens1f0")},
                    {"sriovd.io/trustable", true},
                    {"sriovd.io/driverVersion", Version{"1.2.3"}},
                    {"resource.kubernetes.io/pcieRoot", std::string("pci0000:00")}}});
  }
  return out;
}

class SlicesTest : public WithPki {
 protected:
  void SetUp() override {
    WithPki::SetUp();
    if (HasFatalFailure()) return;
    server =
        std::make_unique<ApiServer>(*pki, std::vector<std::string>{"--token", kToken, "--node", "node-a:" + kNodeUid});
    api = std::make_unique<ApiClient>(config_for(*pki, *server));
  }
  std::vector<json> slices() {
    const json list = api->get(SlicePublisher::kSlices);
    return list["items"].get<std::vector<json>>();
  }
  std::unique_ptr<ApiServer> server;
  std::unique_ptr<ApiClient> api;
};

TEST_F(SlicesTest, APoolOfThreeSlicesOwnedByTheNode) {
  SlicePublisher pub(*api, "sriovd.io", "node-a");
  ASSERT_TRUE(pub.publish(vfs(300)));
  const std::vector<json> got = slices();
  ASSERT_EQ(got.size(), 3U);
  size_t devices = 0;
  for (const json& s : got) {
    EXPECT_EQ(s["spec"]["driver"], "sriovd.io");
    EXPECT_EQ(s["spec"]["nodeName"], "node-a");
    EXPECT_EQ(s["spec"]["pool"]["name"], "node-a");
    EXPECT_EQ(s["spec"]["pool"]["generation"], 1);
    EXPECT_EQ(s["spec"]["pool"]["resourceSliceCount"], 3);
    EXPECT_LE(s["spec"]["devices"].size(), kMaxDevicesPerSlice);
    EXPECT_EQ(s["metadata"]["ownerReferences"][0]["kind"], "Node");
    EXPECT_EQ(s["metadata"]["ownerReferences"][0]["uid"], kNodeUid);
    devices += s["spec"]["devices"].size();
  }
  EXPECT_EQ(devices, 300U);
  const json& first = got[0]["spec"]["devices"][0];
  EXPECT_EQ(first["attributes"]["sriovd.io/vfIndex"]["int"], 0);
  EXPECT_EQ(first["attributes"]["sriovd.io/trustable"]["bool"], true);
  EXPECT_EQ(first["attributes"]["sriovd.io/driverVersion"]["version"], "1.2.3");
  EXPECT_EQ(first["attributes"]["resource.kubernetes.io/pcieRoot"]["string"], "pci0000:00");
  // The same again: nothing written.
  const std::string rv = got[0]["metadata"]["resourceVersion"];
  EXPECT_FALSE(pub.publish(vfs(300)));
  EXPECT_EQ(slices()[0]["metadata"]["resourceVersion"], rv);
}

TEST_F(SlicesTest, AChangedPoolIsANewGenerationAndSurplusSlicesGo) {
  SlicePublisher pub(*api, "sriovd.io", "node-a");
  ASSERT_TRUE(pub.publish(vfs(300)));
  ASSERT_TRUE(pub.publish(vfs(7)));
  const std::vector<json> got = slices();
  ASSERT_EQ(got.size(), 1U);
  EXPECT_EQ(got[0]["spec"]["pool"]["generation"], 2);
  EXPECT_EQ(got[0]["spec"]["pool"]["resourceSliceCount"], 1);
  EXPECT_EQ(got[0]["spec"]["devices"].size(), 7U);
  // No devices: the pool is still there, empty.
  ASSERT_TRUE(pub.publish({}));
  ASSERT_EQ(slices().size(), 1U);
  EXPECT_EQ(slices()[0]["spec"]["devices"].size(), 0U);
}

TEST_F(SlicesTest, SlicesDeletedBehindItsBackAreMadeAgain) {
  SlicePublisher pub(*api, "sriovd.io", "node-a");
  ASSERT_TRUE(pub.publish(vfs(200)));
  // The kubelet deletes the node's slices when it starts.
  for (const json& s : slices())
    api->remove(std::string(SlicePublisher::kSlices) + "/" + s["metadata"]["name"].get<std::string>());
  ASSERT_TRUE(pub.publish(vfs(200)));
  EXPECT_EQ(slices().size(), 2U);
  // One of two gone: the pool is written again as a new generation.
  api->remove(std::string(SlicePublisher::kSlices) + "/" + pub.slice_name(1));
  ASSERT_TRUE(pub.publish(vfs(200)));
  for (const json& s : slices()) EXPECT_EQ(s["spec"]["pool"]["generation"], pub.generation());
  EXPECT_EQ(slices().size(), 2U);
}

TEST_F(SlicesTest, WhatTheServerAddsIsNotAChangeButAnAttributeDroppedIs) {
  SlicePublisher pub(*api, "sriovd.io", "node-a");
  ASSERT_TRUE(pub.publish(vfs(3)));
  // A field the API server defaults (or a newer version has), written
  // behind the publisher's back: still the same pool.
  json slice = slices()[0];
  slice["spec"]["devices"][0]["allowMultipleAllocations"] = false;
  slice["spec"]["sharedCounters"] = json::array();
  (void)api->replace(std::string(SlicePublisher::kSlices) + "/" + pub.slice_name(0), slice);
  EXPECT_FALSE(pub.publish(vfs(3)));
  EXPECT_EQ(pub.generation(), 1);
  // An attribute no longer published is a change.
  std::vector<SliceDevice> fewer = vfs(3);
  fewer[1].attributes.erase("sriovd.io/pfName");
  EXPECT_TRUE(pub.publish(fewer));
  EXPECT_FALSE(slices()[0]["spec"]["devices"][1]["attributes"].contains("sriovd.io/pfName"));
}

TEST_F(SlicesTest, AConflictIsReadAgainAndRedone) {
  SlicePublisher pub(*api, "sriovd.io", "node-a");
  ASSERT_TRUE(pub.publish(vfs(3)));
  (void)api->create("/_test/conflict-next", json::object({{"metadata", {{"name", "x"}}}}));
  ASSERT_TRUE(pub.publish(vfs(4)));
  EXPECT_EQ(slices()[0]["spec"]["devices"].size(), 4U);
}

TEST_F(SlicesTest, OtherDriversAndNodesAreLeftAlone) {
  SlicePublisher other_node(*api, "sriovd.io", "node-b");
  SlicePublisher other_driver(*api, "gpu.example.com", "node-a");
  SlicePublisher pub(*api, "sriovd.io", "node-a");
  // node-b is not in the API server: its Node's uid cannot be had.
  EXPECT_THROW(other_node.publish(vfs(1)), ApiError);
  ASSERT_TRUE(other_driver.publish(vfs(2)));
  ASSERT_TRUE(pub.publish(vfs(3)));
  EXPECT_EQ(pub.remove_all(), 1U);
  const std::vector<json> left = slices();
  ASSERT_EQ(left.size(), 1U);
  EXPECT_EQ(left[0]["spec"]["driver"], "gpu.example.com");
}

TEST_F(SlicesTest, WhatUpstreamRefusesIsRefusedNamingTheField) {
  SlicePublisher pub(*api, "sriovd.io", "node-a");
  std::vector<SliceDevice> bad = vfs(1);
  bad[0].attributes["sriovd.io/pfName"] = std::string(65, 'x');
  try {
    (void)pub.publish(bad);
    FAIL() << "a 65-byte string attribute was taken";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 422);
    EXPECT_NE(std::string(e.what()).find("attributes[sriovd.io/pfName].string: Too long"), std::string::npos)
        << e.what();
  }
  bad = vfs(1);
  bad[0].name = "VF_0";
  EXPECT_THROW((void)pub.publish(bad), ApiError);
  EXPECT_TRUE(slices().empty());
}

}  // namespace
}  // namespace sriovd::k8s
