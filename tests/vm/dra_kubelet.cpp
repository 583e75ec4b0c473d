// The kubelet's and the scheduler's part of a DRA claim, for a guest with
// no Python: allocates a ResourceClaim on the API server (as the scheduler
// would: the claim, then its status through /status), and drives the
// registered DRA driver as the kubelet does (GetInfo and
// NotifyRegistrationStatus on its registration socket, then
// NodePrepareResources / NodeUnprepareResources on its service socket).
//
//   dra_kubelet KUBECONFIG claim NS NAME DRIVER POOL DEVICE PARAMS_JSON   -> prints the claim's UID
//   dra_kubelet REGISTRY_DIR prepare|unprepare NS NAME UID              -> prints the answer
//
// Exit 0 when the call succeeded (the claim's error empty), 1 otherwise.
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "dra_v1.grpc.pb.h"
#include "pluginregistration_v1.grpc.pb.h"
#include "sriovd/k8s/api_client.hpp"

namespace drapb = ::k8s::io::kubelet::pkg::apis::dra::v1;
using nlohmann::json;

namespace {

int allocate(int argc, char** argv) {
  if (argc != 9) return 2;
  sriovd::k8s::ApiClient api(sriovd::k8s::load_kubeconfig(argv[1]));
  const std::string ns = argv[3], name = argv[4];
  const std::string path = "/apis/resource.k8s.io/v1/namespaces/" + ns + "/resourceclaims";
  json claim = api.create(path, {{"apiVersion", "resource.k8s.io/v1"},
                                 {"kind", "ResourceClaim"},
                                 {"metadata", {{"name", name}, {"namespace", ns}}},
                                 {"spec", {{"devices", {{"requests", json::array({{{"name", "vf"}}})}}}}}});
  claim["status"] = {
      {"allocation",
       {{"devices",
         {{"results", json::array({{{"request", "vf"}, {"driver", argv[5]}, {"pool", argv[6]}, {"device", argv[7]}}})},
          {"config", json::array({{{"source", "FromClaim"},
                                   {"requests", json::array({"vf"})},
                                   {"opaque", {{"driver", argv[5]}, {"parameters", json::parse(argv[8])}}}}})}}}}}};
  api.replace(path + "/" + name + "/status", claim);
  std::printf("%s\n", claim["metadata"]["uid"].get<std::string>().c_str());
  return 0;
}

// The registered plugin's service socket, checked as the kubelet checks it.
std::string endpoint(const std::string& registry) {
  for (const auto& e : std::filesystem::directory_iterator(registry)) {
    const std::string p = e.path().string();
    if (!p.ends_with("-reg.sock")) continue;
    auto ch = grpc::CreateChannel("unix://" + p, grpc::InsecureChannelCredentials());
    auto reg = pluginregistration::Registration::NewStub(ch);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    pluginregistration::PluginInfo info;
    if (!reg->GetInfo(&ctx, pluginregistration::InfoRequest(), &info).ok()) continue;
    const bool ok = info.type() == "DRAPlugin" &&
                    std::find(info.supported_versions().begin(), info.supported_versions().end(), "v1.DRAPlugin") !=
                        info.supported_versions().end();
    grpc::ClientContext ctx2;
    pluginregistration::RegistrationStatus st;
    st.set_plugin_registered(ok);
    if (!ok) st.set_error("not a v1.DRAPlugin");
    pluginregistration::RegistrationStatusResponse r;
    (void)reg->NotifyRegistrationStatus(&ctx2, st, &r);
    if (ok) return info.endpoint();
  }
  return "";
}

int drive(int argc, char** argv) {
  if (argc != 6) return 2;
  const std::string ep = endpoint(argv[1]);
  if (ep.empty()) {
    std::fprintf(stderr, "no DRA plugin registered in %s\n", argv[1]);
    return 1;
  }
  auto stub = drapb::DRAPlugin::NewStub(grpc::CreateChannel("unix://" + ep, grpc::InsecureChannelCredentials()));
  drapb::Claim c;
  c.set_namespace_(argv[3]);
  c.set_name(argv[4]);
  c.set_uid(argv[5]);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(45));
  std::string error;
  grpc::Status s;
  if (std::string(argv[2]) == "prepare") {
    drapb::NodePrepareResourcesRequest req;
    *req.add_claims() = c;
    drapb::NodePrepareResourcesResponse resp;
    s = stub->NodePrepareResources(&ctx, req, &resp);
    if (s.ok()) {
      const auto& r = resp.claims().at(argv[5]);
      error = r.error();
      for (const auto& d : r.devices())
        std::printf("device %s cdi %s\n", d.device_name().c_str(), d.cdi_device_ids(0).c_str());
    }
  } else {
    drapb::NodeUnprepareResourcesRequest req;
    *req.add_claims() = c;
    drapb::NodeUnprepareResourcesResponse resp;
    s = stub->NodeUnprepareResources(&ctx, req, &resp);
    if (s.ok()) error = resp.claims().at(argv[5]).error();
  }
  if (!s.ok()) error = "gRPC: " + s.error_message();
  std::printf("%s\n", error.empty() ? "ok" : ("error: " + error).c_str());
  return error.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int rc = 2;
    if (argc >= 3 && std::string(argv[2]) == "claim") rc = allocate(argc, argv);
    if (argc >= 3 && (std::string(argv[2]) == "prepare" || std::string(argv[2]) == "unprepare")) rc = drive(argc, argv);
    if (rc != 2) return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dra_kubelet: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr,
               "usage: dra_kubelet KUBECONFIG claim NS NAME DRIVER POOL DEVICE PARAMS_JSON\n"
               "       dra_kubelet REGISTRY_DIR prepare|unprepare NS NAME UID\n");
  return 2;
}
