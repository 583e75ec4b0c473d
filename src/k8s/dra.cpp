#include "sriovd/k8s/dra.hpp"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "dra_health_v1.grpc.pb.h"
#include "dra_health_v1alpha1.grpc.pb.h"
#include "dra_v1.grpc.pb.h"
#include "local_grpc_server.hpp"
#include "pluginregistration_v1.grpc.pb.h"

namespace sriovd::k8s {

namespace fs = std::filesystem;
namespace drapb = ::k8s::io::kubelet::pkg::apis::dra::v1;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kMaxThreads = 16;
constexpr int kMaxWatchers = 4;  // the kubelet keeps one per version
constexpr auto kCheckEvery = std::chrono::milliseconds(250);
constexpr auto kShutdownGrace = std::chrono::milliseconds(200);

bool is_socket(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

// The kubelet's deadline for the call (none: far away), as steady time.
Clock::time_point call_deadline(const grpc::ServerContext* ctx, std::chrono::milliseconds budget) {
  const auto mine = Clock::now() + budget;
  const auto theirs = ctx->deadline();
  if (theirs == std::chrono::system_clock::time_point::max()) return mine;
  return std::min(
      mine, Clock::now() + std::chrono::duration_cast<Clock::duration>(theirs - std::chrono::system_clock::now()));
}

// A socket nobody serves any more: a connect is refused (its instance was
// killed and could not remove it). One that answers, or that cannot be
// told, is left alone: it may be a live instance's (an upgrade's other
// half).
bool is_dead_socket(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) return false;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  const bool refused =
      ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 && errno == ECONNREFUSED;
  ::close(fd);
  return refused;
}

// The sockets of this driver's instances that died without removing them:
// the kubelet's plugin watcher would try each forever.
void remove_dead_instances(const std::string& dir, const std::string& prefix, const std::string& suffix) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0 || !name.ends_with(suffix)) continue;
    if (!is_socket(e.path().string()) || !is_dead_socket(e.path().string())) continue;
    spdlog::info("kubernetes DRA: removing {}, the socket of an instance that is gone", e.path().string());
    fs::remove(e.path(), ec);
  }
}

}  // namespace

struct DraPlugin::Impl : public pluginregistration::Registration::Service, public drapb::DRAPlugin::Service {
  Options options;
  ClaimHandler& handler;

  // The health of every device, and its watchers (both API versions).
  mutable std::mutex health_mu;
  std::condition_variable health_cv;
  std::vector<DeviceHealth> health;
  uint64_t health_version = 0;
  bool stopping = false;

  template <typename Pb, typename Base>
  struct Health final : public Base {
    Impl& impl;
    explicit Health(Impl& i) : impl(i) {}
    grpc::Status NodeWatchResources(grpc::ServerContext* ctx, const typename Pb::NodeWatchResourcesRequest*,
                                    grpc::ServerWriter<typename Pb::NodeWatchResourcesResponse>* writer) override {
      if (++impl.watchers > kMaxWatchers) {
        --impl.watchers;
        return {grpc::StatusCode::RESOURCE_EXHAUSTED,
                "NodeWatchResources: already streaming to " + std::to_string(kMaxWatchers) + " watchers"};
      }
      uint64_t sent = 0;
      bool first = true;
      std::unique_lock lock(impl.health_mu);
      while (!impl.stopping && !ctx->IsCancelled()) {
        if (first || sent != impl.health_version) {
          typename Pb::NodeWatchResourcesResponse resp;
          for (const DeviceHealth& d : impl.health) {
            auto* h = resp.add_devices();
            h->mutable_device()->set_pool_name(d.pool);
            h->mutable_device()->set_device_name(d.device);
            h->set_health(d.healthy ? Pb::HEALTHY : Pb::UNHEALTHY);
            h->set_last_updated_time(d.since);
            h->set_message(d.message.substr(0, 1024));
          }
          sent = impl.health_version;
          first = false;
          lock.unlock();
          const bool ok = writer->Write(resp);
          lock.lock();
          if (!ok) break;
        }
        impl.health_cv.wait_for(lock, std::chrono::milliseconds(200));
      }
      --impl.watchers;
      return grpc::Status::OK;
    }
  };
  struct V1alpha1 {
    using NodeWatchResourcesRequest = ::v1alpha1::NodeWatchResourcesRequest;
    using NodeWatchResourcesResponse = ::v1alpha1::NodeWatchResourcesResponse;
    static constexpr auto HEALTHY = ::v1alpha1::HEALTHY;
    static constexpr auto UNHEALTHY = ::v1alpha1::UNHEALTHY;
  };
  struct V1 {
    using NodeWatchResourcesRequest = ::v1::NodeWatchResourcesRequest;
    using NodeWatchResourcesResponse = ::v1::NodeWatchResourcesResponse;
    static constexpr auto HEALTHY = ::v1::HEALTHY;
    static constexpr auto UNHEALTHY = ::v1::UNHEALTHY;
  };
  Health<V1alpha1, ::v1alpha1::DRAResourceHealth::Service> health_v1alpha1{*this};
  Health<V1, ::v1::DRAResourceHealth::Service> health_v1{*this};

  // The two servers; made again by the checker when their sockets go.
  std::atomic<uint64_t> refused_peers{0};  // before the servers that count into it
  std::mutex servers_mu;
  std::unique_ptr<LocalGrpcServer> registration_server, service_server;

  std::atomic<bool> registered{false};
  std::atomic<uint64_t> registrations{0}, refusals{0}, remade{0}, prepares{0}, unprepares{0}, claim_errors{0};
  std::atomic<int> watchers{0};
  std::mutex retry_mu;
  std::optional<Clock::time_point> retry_at;  // a refused registration: its socket made again then
  std::chrono::milliseconds backoff{1000};
  std::string last_refusal;

  std::mutex check_mu;
  std::condition_variable check_cv;
  bool check_stop = false;
  std::thread checker;

  Impl(Options o, ClaimHandler& h) : options(std::move(o)), handler(h) {}

  [[nodiscard]] std::string registration_path() const {
    return options.registry_dir + "/" + options.driver + "-" + options.instance + "-reg.sock";
  }
  [[nodiscard]] std::string service_path() const {
    return options.plugins_dir + "/" + options.driver + "/dra-" + options.instance + ".sock";
  }

  void make_service_server() {
    fs::create_directories(fs::path(service_path()).parent_path());
    service_server.reset();
    service_server = std::make_unique<LocalGrpcServer>(
        service_path(),
        std::vector<grpc::Service*>{static_cast<drapb::DRAPlugin::Service*>(this), &health_v1alpha1, &health_v1},
        "DRA driver " + options.driver, kMaxThreads, refused_peers);
  }
  void make_registration_server() {
    fs::create_directories(options.registry_dir);
    registration_server.reset();
    registered = false;
    registration_server = std::make_unique<LocalGrpcServer>(
        registration_path(), std::vector<grpc::Service*>{static_cast<pluginregistration::Registration::Service*>(this)},
        "DRA driver " + options.driver + " registration", 4, refused_peers);
  }

  // Every kCheckEvery: a socket that went (the kubelet wiped its
  // directories) is made again - the service's first, so that the kubelet
  // finds it when the registration socket appears - and so is the
  // registration socket once a refusal's backoff ran out.
  void check_loop() {
    std::unique_lock lock(check_mu);
    while (!check_stop) {
      check_cv.wait_for(lock, kCheckEvery);
      if (check_stop) break;
      bool retry = false;
      {
        std::lock_guard r(retry_mu);
        if (retry_at && Clock::now() >= *retry_at) {
          retry = true;
          retry_at.reset();
        }
      }
      std::lock_guard s(servers_mu);
      try {
        const bool service_gone = !is_socket(service_path());
        if (service_gone) {
          spdlog::info("kubernetes DRA: {} is gone: serving on it again", service_path());
          make_service_server();
        }
        if (service_gone || retry || !is_socket(registration_path())) {
          if (!retry) spdlog::info("kubernetes DRA: registering again ({} was gone)", registration_path());
          make_registration_server();
          ++remade;
        }
      } catch (const std::exception& e) {
        spdlog::warn("kubernetes DRA: cannot serve again: {}", e.what());
      }
    }
  }

  // pluginregistration.Registration
  grpc::Status GetInfo(grpc::ServerContext*, const pluginregistration::InfoRequest*,
                       pluginregistration::PluginInfo* out) override {
    out->set_type("DRAPlugin");
    out->set_name(options.driver);
    out->set_endpoint(service_path());
    out->add_supported_versions(kServiceVersion);
    return grpc::Status::OK;
  }
  grpc::Status NotifyRegistrationStatus(grpc::ServerContext*, const pluginregistration::RegistrationStatus* st,
                                        pluginregistration::RegistrationStatusResponse*) override {
    if (st->plugin_registered()) {
      registered = true;
      ++registrations;
      std::lock_guard r(retry_mu);
      backoff = std::chrono::milliseconds(1000);
      spdlog::info("kubernetes DRA: {} registered with the kubelet ({})", options.driver, service_path());
      return grpc::Status::OK;
    }
    registered = false;
    ++refusals;
    std::lock_guard r(retry_mu);
    last_refusal = st->error();
    spdlog::warn("kubernetes DRA: the kubelet refused {}'s registration: {} (again in {} ms)", options.driver,
                 st->error(), backoff.count());
    retry_at = Clock::now() + backoff;
    backoff = std::min(backoff * 2, std::chrono::milliseconds(30000));
    return grpc::Status::OK;
  }

  // DRAPlugin: each claim on its own; a claim the budget leaves no time
  // for is answered with that as its error (the kubelet calls again).
  template <typename Reply, typename Fn>
  void each_claim(const grpc::ServerContext* ctx, const google::protobuf::RepeatedPtrField<drapb::Claim>& claims,
                  const char* what, Fn fn, google::protobuf::Map<std::string, Reply>* out) {
    const auto deadline = call_deadline(ctx, options.call_budget);
    std::set<std::string> seen;
    for (const drapb::Claim& c : claims) {
      if (!seen.insert(c.uid()).second) continue;
      Reply& reply = (*out)[c.uid()];
      const ClaimRef ref{c.namespace_(), c.name(), c.uid()};
      const std::string name = ref.ns + "/" + ref.name + " (" + ref.uid + ")";
      try {
        if (ref.uid.empty() || ref.name.empty() || ref.ns.empty())
          throw std::invalid_argument("the claim lacks its namespace, name or uid");
        if (Clock::now() >= deadline) throw std::runtime_error("no time left in the kubelet's call; it calls again");
        fn(ref, deadline, reply);
      } catch (const std::exception& e) {
        ++claim_errors;
        reply.Clear();
        reply.set_error(std::string(what) + " " + name + ": " + e.what());
        spdlog::warn("kubernetes DRA: {}", reply.error());
      }
    }
  }
  grpc::Status NodePrepareResources(grpc::ServerContext* ctx, const drapb::NodePrepareResourcesRequest* req,
                                    drapb::NodePrepareResourcesResponse* out) override {
    ++prepares;
    each_claim(
        ctx, req->claims(), "prepare claim",
        [&](const ClaimRef& ref, Clock::time_point deadline, drapb::NodePrepareResourceResponse& reply) {
          for (const PreparedDevice& d : handler.prepare(ref, deadline)) {
            auto* dev = reply.add_devices();
            for (const auto& r : d.request_names) dev->add_request_names(r);
            dev->set_pool_name(d.pool);
            dev->set_device_name(d.device);
            for (const auto& id : d.cdi_device_ids) dev->add_cdi_device_ids(id);
          }
        },
        out->mutable_claims());
    return grpc::Status::OK;
  }
  grpc::Status NodeUnprepareResources(grpc::ServerContext* ctx, const drapb::NodeUnprepareResourcesRequest* req,
                                      drapb::NodeUnprepareResourcesResponse* out) override {
    ++unprepares;
    each_claim(
        ctx, req->claims(), "unprepare claim",
        [&](const ClaimRef& ref, Clock::time_point deadline, drapb::NodeUnprepareResourceResponse&) {
          handler.unprepare(ref, deadline);
        },
        out->mutable_claims());
    return grpc::Status::OK;
  }
};

DraPlugin::DraPlugin(Options options, ClaimHandler& handler)
    : impl_(std::make_unique<Impl>(std::move(options), handler)) {
  const Options& o = impl_->options;
  if (o.driver.empty() || o.instance.empty() || o.driver.find('/') != std::string::npos ||
      o.instance.find('/') != std::string::npos)
    throw std::runtime_error("DRA driver: driver name '" + o.driver + "' or instance '" + o.instance + "' unusable");
  remove_dead_instances(o.registry_dir, o.driver + "-", "-reg.sock");
  remove_dead_instances(o.plugins_dir + "/" + o.driver, "dra-", ".sock");
  {
    std::lock_guard s(impl_->servers_mu);
    impl_->make_service_server();
    impl_->make_registration_server();
  }
  impl_->checker = std::thread([this] { impl_->check_loop(); });
}

DraPlugin::~DraPlugin() {
  {
    std::lock_guard lock(impl_->check_mu);
    impl_->check_stop = true;
  }
  impl_->check_cv.notify_all();
  impl_->checker.join();
  {
    std::lock_guard lock(impl_->health_mu);
    impl_->stopping = true;
  }
  impl_->health_cv.notify_all();
  std::lock_guard s(impl_->servers_mu);
  // The registration first: the kubelet sees the driver go before its
  // service does.
  const auto deadline = Clock::now() + kShutdownGrace;
  if (impl_->registration_server) impl_->registration_server->shutdown(deadline);
  if (impl_->service_server) impl_->service_server->shutdown(deadline);
}

void DraPlugin::set_health(std::vector<DeviceHealth> devices) {
  {
    std::lock_guard lock(impl_->health_mu);
    if (devices == impl_->health) return;
    impl_->health = std::move(devices);
    ++impl_->health_version;
  }
  impl_->health_cv.notify_all();
}

std::string DraPlugin::registration_socket() const { return impl_->registration_path(); }
std::string DraPlugin::service_socket() const { return impl_->service_path(); }

json DraPlugin::status() const {
  std::string refusal;
  {
    std::lock_guard r(impl_->retry_mu);
    refusal = impl_->last_refusal;
  }
  return {{"driver", impl_->options.driver},
          {"registration_socket", registration_socket()},
          {"service_socket", service_socket()},
          {"registered", impl_->registered.load()},
          {"registrations", impl_->registrations.load()},
          {"refusals", impl_->refusals.load()},
          {"last_refusal", refusal},
          {"sockets_made_again", impl_->remade.load()},
          {"prepare_calls", impl_->prepares.load()},
          {"unprepare_calls", impl_->unprepares.load()},
          {"claim_errors", impl_->claim_errors.load()},
          {"health_watchers", impl_->watchers.load()},
          {"refused_peers", impl_->refused_peers.load()}};
}

}  // namespace sriovd::k8s
