// The DRA driver's kubelet side: this test plays the kubelet (its plugin
// watcher, DRA manager and health client) over the real gRPC APIs.
#include "sriovd/k8s/dra.hpp"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <mutex>
#include <stdexcept>

#include <grpcpp/grpcpp.h>

#include "dra_health_v1.grpc.pb.h"
#include "dra_health_v1alpha1.grpc.pb.h"
#include "dra_v1.grpc.pb.h"
#include "pluginregistration_v1.grpc.pb.h"
#include "sriovd/util/fd.hpp"
#include "support/process.hpp"
#include "support/temp_dir.hpp"

namespace sriovd::k8s {
namespace {

namespace drapb = ::k8s::io::kubelet::pkg::apis::dra::v1;
using namespace std::chrono_literals;

// Claims "ok-*" prepare to one device each; "bad-*" fail, naming why.
class FakeHandler : public ClaimHandler {
 public:
  std::vector<PreparedDevice> prepare(const ClaimRef& c, std::chrono::steady_clock::time_point) override {
    std::lock_guard lock(mu);
    calls.push_back("prepare " + c.ns + "/" + c.name + " " + c.uid);
    if (c.name.rfind("bad-", 0) == 0) throw std::runtime_error("VfConfig: vlan: 4096 is above 4095");
    return {{{"vf"}, "node-a", "vf-" + c.name, {"sriovd.io/vf=" + c.uid}}};
  }
  void unprepare(const ClaimRef& c, std::chrono::steady_clock::time_point) override {
    std::lock_guard lock(mu);
    calls.push_back("unprepare " + c.ns + "/" + c.name + " " + c.uid);
    if (c.name.rfind("bad-", 0) == 0) throw std::runtime_error("the VF is gone");
  }
  std::mutex mu;
  std::vector<std::string> calls;
};

std::shared_ptr<grpc::Channel> channel(const std::string& socket) {
  return grpc::CreateChannel("unix://" + socket, grpc::InsecureChannelCredentials());
}

ino_t inode(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

class DraPluginTest : public ::testing::Test {
 protected:
  DraPlugin::Options options(const std::string& instance = "u1") {
    DraPlugin::Options o;
    o.driver = "sriovd.io";
    o.registry_dir = dir.file("plugins_registry");
    o.plugins_dir = dir.file("plugins");
    o.instance = instance;
    return o;
  }
  test::TempDir dir;
  FakeHandler handler;
};

drapb::Claim claim(const std::string& name, const std::string& uid) {
  drapb::Claim c;
  c.set_namespace_("default");
  c.set_name(name);
  c.set_uid(uid);
  return c;
}

TEST_F(DraPluginTest, RegistersAsTheKubeletsPluginWatcherExpects) {
  DraPlugin plugin(options(), handler);
  EXPECT_EQ(plugin.registration_socket(), dir.file("plugins_registry") + "/sriovd.io-u1-reg.sock");
  EXPECT_EQ(plugin.service_socket(), dir.file("plugins") + "/sriovd.io/dra-u1.sock");
  auto reg = pluginregistration::Registration::NewStub(channel(plugin.registration_socket()));
  grpc::ClientContext ctx;
  pluginregistration::PluginInfo info;
  ASSERT_TRUE(reg->GetInfo(&ctx, {}, &info).ok());
  EXPECT_EQ(info.type(), "DRAPlugin");
  EXPECT_EQ(info.name(), "sriovd.io");
  EXPECT_EQ(info.endpoint(), plugin.service_socket());
  ASSERT_EQ(info.supported_versions_size(), 1);
  EXPECT_EQ(info.supported_versions(0), "v1.DRAPlugin");
  grpc::ClientContext ctx2;
  pluginregistration::RegistrationStatus ok;
  ok.set_plugin_registered(true);
  pluginregistration::RegistrationStatusResponse r;
  ASSERT_TRUE(reg->NotifyRegistrationStatus(&ctx2, ok, &r).ok());
  EXPECT_EQ(plugin.status()["registered"], true);
}

TEST_F(DraPluginTest, EachClaimIsAnsweredOnItsOwn) {
  DraPlugin plugin(options(), handler);
  auto dra = drapb::DRAPlugin::NewStub(channel(plugin.service_socket()));
  drapb::NodePrepareResourcesRequest req;
  *req.add_claims() = claim("ok-a", "uid-a");
  *req.add_claims() = claim("bad-b", "uid-b");
  *req.add_claims() = claim("ok-a", "uid-a");  // twice in one call: answered once
  *req.add_claims() = claim("", "uid-c");
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 45s);
  drapb::NodePrepareResourcesResponse resp;
  ASSERT_TRUE(dra->NodePrepareResources(&ctx, req, &resp).ok());
  ASSERT_EQ(resp.claims_size(), 3);
  const auto& a = resp.claims().at("uid-a");
  EXPECT_EQ(a.error(), "");
  ASSERT_EQ(a.devices_size(), 1);
  EXPECT_EQ(a.devices(0).pool_name(), "node-a");
  EXPECT_EQ(a.devices(0).device_name(), "vf-ok-a");
  EXPECT_EQ(a.devices(0).cdi_device_ids(0), "sriovd.io/vf=uid-a");
  EXPECT_EQ(a.devices(0).request_names(0), "vf");
  EXPECT_EQ(resp.claims().at("uid-b").error(),
            "prepare claim default/bad-b (uid-b): VfConfig: vlan: 4096 is above 4095");
  EXPECT_EQ(resp.claims().at("uid-b").devices_size(), 0);
  EXPECT_NE(resp.claims().at("uid-c").error().find("lacks its namespace, name or uid"), std::string::npos);

  drapb::NodeUnprepareResourcesRequest un;
  *un.add_claims() = claim("ok-a", "uid-a");
  *un.add_claims() = claim("bad-b", "uid-b");
  grpc::ClientContext ctx2;
  drapb::NodeUnprepareResourcesResponse unresp;
  ASSERT_TRUE(dra->NodeUnprepareResources(&ctx2, un, &unresp).ok());
  EXPECT_EQ(unresp.claims().at("uid-a").error(), "");
  EXPECT_EQ(unresp.claims().at("uid-b").error(), "unprepare claim default/bad-b (uid-b): the VF is gone");
  std::lock_guard lock(handler.mu);
  EXPECT_EQ(handler.calls, (std::vector<std::string>{"prepare default/ok-a uid-a", "prepare default/bad-b uid-b",
                                                     "unprepare default/ok-a uid-a", "unprepare default/bad-b uid-b"}));
}

TEST_F(DraPluginTest, AKubeletThatWipesItsDirectoriesFindsTheDriverAgain) {
  DraPlugin plugin(options(), handler);
  std::filesystem::remove_all(dir.file("plugins_registry"));
  std::filesystem::remove_all(dir.file("plugins"));
  ASSERT_TRUE(test::wait_until(
      [&] { return inode(plugin.registration_socket()) != 0 && inode(plugin.service_socket()) != 0; }, 10s));
  auto reg = pluginregistration::Registration::NewStub(channel(plugin.registration_socket()));
  grpc::ClientContext ctx;
  pluginregistration::PluginInfo info;
  EXPECT_TRUE(reg->GetInfo(&ctx, {}, &info).ok());
  auto dra = drapb::DRAPlugin::NewStub(channel(plugin.service_socket()));
  drapb::NodePrepareResourcesRequest req;
  *req.add_claims() = claim("ok-a", "uid-a");
  grpc::ClientContext ctx2;
  drapb::NodePrepareResourcesResponse resp;
  EXPECT_TRUE(dra->NodePrepareResources(&ctx2, req, &resp).ok());
  EXPECT_TRUE(test::wait_until([&] { return plugin.status()["sockets_made_again"].get<int>() >= 1; }, 10s));
}

// IN_CREATE or IN_MOVED_TO of `name` in the directory `watch` watches, within `timeout`:
// what the kubelet's plugin watcher (fsnotify) acts on.
bool created(int watch, const std::string& name, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  alignas(inotify_event) char buf[4096];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{watch, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::read(watch, buf, sizeof buf);
    for (ssize_t at = 0; at < n;) {
      const auto* e = reinterpret_cast<const inotify_event*>(buf + at);
      if ((e->mask & (IN_CREATE | IN_MOVED_TO)) && e->len > 0 && name == e->name) return true;
      at += static_cast<ssize_t>(sizeof(inotify_event) + e->len);
    }
  }
  return false;
}

TEST_F(DraPluginTest, ARefusedRegistrationIsTriedAgain) {
  DraPlugin plugin(options(), handler);
  UniqueFd watch(::inotify_init1(IN_CLOEXEC | IN_NONBLOCK));
  ASSERT_GE(::inotify_add_watch(watch.get(), dir.file("plugins_registry").c_str(), IN_CREATE | IN_MOVED_TO), 0);
  auto reg = pluginregistration::Registration::NewStub(channel(plugin.registration_socket()));
  grpc::ClientContext ctx;
  pluginregistration::RegistrationStatus no;
  no.set_plugin_registered(false);
  no.set_error("plugin sriovd.io: version not supported");
  pluginregistration::RegistrationStatusResponse r;
  ASSERT_TRUE(reg->NotifyRegistrationStatus(&ctx, no, &r).ok());
  EXPECT_EQ(plugin.status()["refusals"], 1);
  EXPECT_EQ(plugin.status()["last_refusal"], "plugin sriovd.io: version not supported");
  // A new socket (what the kubelet's watcher notices) after the backoff.
  EXPECT_TRUE(created(watch.get(), "sriovd.io-u1-reg.sock", 10s));
  EXPECT_TRUE(test::wait_until([&] { return plugin.status()["sockets_made_again"] == 1; }, 10s));
}

TEST_F(DraPluginTest, TwoInstancesDuringAnUpgradeEachRemoveTheirOwnSockets) {
  auto old_one = std::make_unique<DraPlugin>(options("old"), handler);
  {
    DraPlugin new_one(options("new"), handler);
    EXPECT_NE(inode(old_one->registration_socket()), 0U);
    EXPECT_NE(inode(new_one.registration_socket()), 0U);
    const std::string old_reg = old_one->registration_socket();
    const std::string old_svc = old_one->service_socket();
    old_one.reset();
    EXPECT_EQ(inode(old_reg), 0U);
    EXPECT_EQ(inode(old_svc), 0U);
    EXPECT_NE(inode(new_one.registration_socket()), 0U);
    EXPECT_NE(inode(new_one.service_socket()), 0U);
    auto reg = pluginregistration::Registration::NewStub(channel(new_one.registration_socket()));
    grpc::ClientContext ctx;
    pluginregistration::PluginInfo info;
    EXPECT_TRUE(reg->GetInfo(&ctx, {}, &info).ok());
    EXPECT_EQ(info.endpoint(), new_one.service_socket());
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.file("plugins_registry")));
}

// A socket file whose server is gone (its process was killed): bound, then closed.
void dead_socket(const std::string& path) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr), 0) << path;
  ::close(fd);
}

TEST_F(DraPluginTest, AKilledInstancesSocketsGoAndALiveOnesStay) {
  const auto o = options("live");
  DraPlugin live(o, handler);
  const std::string dead_reg = o.registry_dir + "/" + o.driver + "-dead-reg.sock";
  const std::string dead_svc = o.plugins_dir + "/" + o.driver + "/dra-dead.sock";
  const std::string other_driver = o.registry_dir + "/other.example.com-dead-reg.sock";
  dead_socket(dead_reg);
  dead_socket(dead_svc);
  dead_socket(other_driver);
  DraPlugin next(options("next"), handler);
  EXPECT_EQ(inode(dead_reg), 0U);
  EXPECT_EQ(inode(dead_svc), 0U);
  EXPECT_NE(inode(other_driver), 0U);                // not this driver's to remove
  EXPECT_NE(inode(live.registration_socket()), 0U);  // it answers: an upgrade's other half
  EXPECT_NE(inode(live.service_socket()), 0U);
}

template <typename Stub, typename Request, typename Response>
void expect_health_stream(Stub& stub, DraPlugin& plugin) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 20s);
  auto reader = stub->NodeWatchResources(&ctx, Request{});
  Response resp;
  ASSERT_TRUE(reader->Read(&resp));
  ASSERT_EQ(resp.devices_size(), 2);
  EXPECT_EQ(resp.devices(0).device().pool_name(), "node-a");
  EXPECT_EQ(resp.devices(0).device().device_name(), "vf-0");
  EXPECT_EQ(static_cast<int>(resp.devices(0).health()), 1);  // HEALTHY
  EXPECT_EQ(resp.devices(0).last_updated_time(), 100);
  plugin.set_health({{"node-a", "vf-0", false, "PF ens1f0's link is down", 200}, {"node-a", "vf-1", true, "", 100}});
  ASSERT_TRUE(reader->Read(&resp));
  EXPECT_EQ(static_cast<int>(resp.devices(0).health()), 2);  // UNHEALTHY
  EXPECT_EQ(resp.devices(0).message(), "PF ens1f0's link is down");
  ctx.TryCancel();
}

TEST_F(DraPluginTest, HealthStreamsToBothApiVersions) {
  DraPlugin plugin(options(), handler);
  plugin.set_health({{"node-a", "vf-0", true, "", 100}, {"node-a", "vf-1", true, "", 100}});
  auto v1alpha1 = ::v1alpha1::DRAResourceHealth::NewStub(channel(plugin.service_socket()));
  expect_health_stream<decltype(v1alpha1), ::v1alpha1::NodeWatchResourcesRequest,
                       ::v1alpha1::NodeWatchResourcesResponse>(v1alpha1, plugin);
  plugin.set_health({{"node-a", "vf-0", true, "", 100}, {"node-a", "vf-1", true, "", 100}});
  auto v1 = ::v1::DRAResourceHealth::NewStub(channel(plugin.service_socket()));
  expect_health_stream<decltype(v1), ::v1::NodeWatchResourcesRequest, ::v1::NodeWatchResourcesResponse>(v1, plugin);
}

}  // namespace
}  // namespace sriovd::k8s
