#include "sriovd/k8s/device_plugin.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "deviceplugin_v1beta1.grpc.pb.h"
#include "local_grpc_server.hpp"
#include "sriovd/util/eventfd.hpp"
#include "sriovd/util/fd.hpp"
#include "sriovd/util/unix_socket.hpp"

namespace sriovd::k8s {

namespace fs = std::filesystem;
using nlohmann::json;

std::string env_name(const std::string& resource) {
  std::string out;
  for (const char c : resource)
    out += std::isalnum(static_cast<unsigned char>(c)) ? static_cast<char>(std::toupper(static_cast<unsigned char>(c)))
                                                       : '_';
  return out;
}

namespace {

constexpr const char* kApiVersion = "v1beta1";

// "intel.com/sriov_vf" -> "sriovd-intel.com_sriov_vf": the pool's socket
// and CDI spec file names.
std::string file_stem(const std::string& resource) {
  std::string out = "sriovd-";
  for (const char c : resource) out += (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-') ? c : '_';
  return out;
}

// Written whole or not at all: a temporary file renamed over the old one.
void write_atomically(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw std::runtime_error("cannot write " + tmp.string());
  }
  fs::rename(tmp, path);
}

json cdi_spec(const Pool& pool) {
  json devices = json::array();
  for (const Device& d : pool.devices) {
    json edits = json::object();
    if (!d.socket.empty()) {
      edits["mounts"] = json::array({{{"hostPath", d.socket}, {"containerPath", d.socket}, {"options", {"bind"}}}});
      edits["env"] = json::array({"SRIOVD_VIRTIO_SOCKET_" + env_name(pool.resource) + "=" + d.socket});
    } else {
      json nodes = json::array({{{"path", "/dev/vfio/vfio"}}});
      if (d.iommu_group >= 0) nodes.push_back({{"path", "/dev/vfio/" + std::to_string(d.iommu_group)}});
      edits["deviceNodes"] = nodes;
      edits["env"] = json::array({"PCIDEVICE_" + env_name(pool.resource) + "=" + d.id});
    }
    devices.push_back({{"name", d.id}, {"containerEdits", edits}});
  }
  return {{"cdiVersion", "0.6.0"}, {"kind", pool.resource}, {"devices", devices}};
}

// Registration calls under way, so that a stop (a reload that drops the
// pool, the daemon's exit) cancels them instead of waiting out a kubelet
// that listens and never answers.
class RegistrationCalls {
 public:
  // false: stopped (no call may start).
  bool begin(grpc::ClientContext* ctx, const void* owner) {
    std::lock_guard lock(mu_);
    if (stopped_) return false;
    calls_.emplace_back(ctx, owner);
    return true;
  }
  void end(grpc::ClientContext* ctx) {
    std::lock_guard lock(mu_);
    std::erase_if(calls_, [&](const auto& c) { return c.first == ctx; });
  }
  void cancel(const void* owner) {
    std::lock_guard lock(mu_);
    for (auto& [ctx, o] : calls_)
      if (o == owner) ctx->TryCancel();
  }
  void stop() {
    std::lock_guard lock(mu_);
    stopped_ = true;
    for (auto& [ctx, o] : calls_) ctx->TryCancel();
  }

 private:
  std::mutex mu_;
  bool stopped_ = false;
  std::vector<std::pair<grpc::ClientContext*, const void*>> calls_;
};

// One pool's DevicePlugin service and its gRPC server. The socket is ours
// (a SocketFile, 0600): connections are accepted here, their peer checked
// (root or the daemon's own uid, as the kubelet runs), and handed to the
// gRPC server, which has no listening port of its own. The server's
// threads are capped, and so are ListAndWatch streams: a peer that opens
// many gets RESOURCE_EXHAUSTED, not a thread each.
class PoolServer final : public v1beta1::DevicePlugin::Service {
 public:
  static constexpr int kMaxThreads = 16;
  static constexpr int kMaxWatchers = 4;  // the kubelet keeps one
  static constexpr auto kShutdownGrace = std::chrono::milliseconds(200);

  PoolServer(std::string dir, std::string cdi_dir, Pool pool)
      : dir_(std::move(dir)),
        cdi_dir_(std::move(cdi_dir)),
        socket_name_(file_stem(pool.resource) + ".sock"),
        pool_(std::move(pool)) {
    write_cdi();
  }
  ~PoolServer() override { retire(); }

  [[nodiscard]] std::string socket_path() const { return dir_ + "/" + socket_name_; }
  [[nodiscard]] const std::string& socket_name() const { return socket_name_; }
  [[nodiscard]] bool registered() const { return registered_.load(); }
  [[nodiscard]] bool retired() const { return retired_.load(); }

  // (Re)starts the server on a fresh socket (not once retired).
  void start() {
    std::lock_guard life(lifecycle_);
    if (retired_) return;
    stop_locked(std::chrono::steady_clock::now() + kShutdownGrace);
    {
      std::lock_guard lock(mu_);
      stopping_ = false;
    }
    server_ = std::make_unique<LocalGrpcServer>(socket_path(), std::vector<grpc::Service*>{this},
                                                "device plugin " + pool_.resource, kMaxThreads, refused_peers_);
  }

  // Stops serving; `deadline` bounds how long in-flight calls may take.
  void stop(std::chrono::steady_clock::time_point deadline) {
    std::lock_guard life(lifecycle_);
    stop_locked(deadline);
  }

  // For good: stops, removes the socket (if its path is still ours) and the
  // CDI spec; later start() and registration do nothing. A late destructor
  // (the watcher held the last reference) then touches nothing a newer
  // server of the same pool made.
  void retire(std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::now() + kShutdownGrace) {
    std::lock_guard life(lifecycle_);
    if (retired_.exchange(true)) return;
    stop_locked(deadline);
    std::error_code ec;
    fs::remove(cdi_path(), ec);
  }

  // Registration.Register on the kubelet's socket; false (logged) when
  // there is no kubelet, it refuses, or the call was cancelled.
  bool register_with_kubelet(RegistrationCalls& calls) {
    if (retired_) return false;
    auto channel =
        grpc::CreateChannel("unix://" + dir_ + "/" + NodeAgent::kKubeletSocket, grpc::InsecureChannelCredentials());
    auto stub = v1beta1::Registration::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
    v1beta1::RegisterRequest req;
    req.set_version(kApiVersion);
    req.set_endpoint(socket_name_);
    req.set_resource_name(pool_.resource);
    req.mutable_options()->set_get_preferred_allocation_available(true);
    v1beta1::Empty reply;
    if (!calls.begin(&ctx, this)) return false;
    const grpc::Status st = stub->Register(&ctx, req, &reply);
    calls.end(&ctx);
    registered_ = st.ok();
    if (st.ok()) {
      ++registrations_;
      spdlog::info("kubernetes: {} registered with the kubelet ({})", pool_.resource, socket_path());
    } else if (!retired_) {
      spdlog::warn("kubernetes: {}: registration with the kubelet failed: {}", pool_.resource, st.error_message());
    }
    return st.ok();
  }

  void set(Pool pool) {
    {
      std::lock_guard lock(mu_);
      if (pool == pool_) return;
      pool_ = std::move(pool);
      ++version_;
    }
    cv_.notify_all();
    write_cdi();
  }

  [[nodiscard]] json status() const {
    std::lock_guard lock(mu_);
    size_t healthy = 0;
    for (const auto& d : pool_.devices) healthy += d.healthy ? 1 : 0;
    return {{"resource", pool_.resource},         {"socket", socket_path()},
            {"registered", registered_.load()},   {"registrations", registrations_.load()},
            {"devices", pool_.devices.size()},    {"healthy", healthy},
            {"allocations", allocations_.load()}, {"refused", refused_.load()},
            {"watchers", watchers_.load()},       {"refused_peers", refused_peers_.load()}};
  }

  grpc::Status GetDevicePluginOptions(grpc::ServerContext*, const v1beta1::Empty*,
                                      v1beta1::DevicePluginOptions* out) override {
    out->set_get_preferred_allocation_available(true);
    return grpc::Status::OK;
  }

  // The whole list at once, then again whenever it changes, until the
  // kubelet goes or the pool does.
  grpc::Status ListAndWatch(grpc::ServerContext* ctx, const v1beta1::Empty*,
                            grpc::ServerWriter<v1beta1::ListAndWatchResponse>* writer) override {
    if (++watchers_ > kMaxWatchers) {
      --watchers_;
      return refuse(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          "ListAndWatch: pool " + pool_.resource + " already streams to " + std::to_string(kMaxWatchers) + " watchers");
    }
    uint64_t sent = 0;
    bool first = true;
    std::unique_lock lock(mu_);
    while (!stopping_ && !ctx->IsCancelled()) {
      if (first || sent != version_) {
        v1beta1::ListAndWatchResponse resp;
        for (const Device& d : pool_.devices) {
          auto* dev = resp.add_devices();
          dev->set_id(d.id);
          dev->set_health(d.healthy ? "Healthy" : "Unhealthy");
          if (d.numa_node >= 0) dev->mutable_topology()->add_nodes()->set_id(d.numa_node);
        }
        sent = version_;
        first = false;
        lock.unlock();
        const bool ok = writer->Write(resp);
        lock.lock();
        if (!ok) break;
        continue;
      }
      cv_.wait_for(lock, std::chrono::milliseconds(200));
    }
    --watchers_;
    return grpc::Status::OK;
  }

  // Packs by NUMA node, then by PF: the devices that must be in come first,
  // then those on their node and PF (or, without any, on the node and PF
  // with the most available), then the rest.
  grpc::Status GetPreferredAllocation(grpc::ServerContext*, const v1beta1::PreferredAllocationRequest* req,
                                      v1beta1::PreferredAllocationResponse* out) override {
    std::lock_guard lock(mu_);
    for (const auto& creq : req->container_requests()) {
      std::vector<const Device*> must, avail;
      for (const auto& id : creq.must_include_deviceids()) {
        const Device* d = find(id);
        if (!d)
          return refuse(grpc::StatusCode::INVALID_ARGUMENT,
                        "GetPreferredAllocation: pool " + pool_.resource + " has no device '" + id + "'");
        must.push_back(d);
      }
      for (const auto& id : creq.available_deviceids()) {
        const Device* d = find(id);
        if (!d)
          return refuse(grpc::StatusCode::INVALID_ARGUMENT,
                        "GetPreferredAllocation: pool " + pool_.resource + " has no device '" + id + "'");
        if (d->healthy && std::find(must.begin(), must.end(), d) == must.end()) avail.push_back(d);
      }
      int node = -2;
      std::string pf;
      if (!must.empty()) {
        node = must.front()->numa_node;
        pf = must.front()->pf;
      } else if (!avail.empty()) {
        std::map<int, int> per_node;
        for (const Device* d : avail) ++per_node[d->numa_node];
        node = std::max_element(per_node.begin(), per_node.end(), [](auto& a, auto& b) {
                 return a.second < b.second;
               })->first;
        std::map<std::string, int> per_pf;
        for (const Device* d : avail)
          if (d->numa_node == node) ++per_pf[d->pf];
        pf =
            std::max_element(per_pf.begin(), per_pf.end(), [](auto& a, auto& b) { return a.second < b.second; })->first;
      }
      std::stable_sort(avail.begin(), avail.end(), [&](const Device* a, const Device* b) {
        return std::make_tuple(a->numa_node != node, a->pf != pf, a->id) <
               std::make_tuple(b->numa_node != node, b->pf != pf, b->id);
      });
      auto* resp = out->add_container_responses();
      for (const Device* d : must) resp->add_deviceids(d->id);
      for (const Device* d : avail) {
        if (resp->deviceids_size() >= creq.allocation_size()) break;
        resp->add_deviceids(d->id);
      }
    }
    return grpc::Status::OK;
  }

  grpc::Status Allocate(grpc::ServerContext*, const v1beta1::AllocateRequest* req,
                        v1beta1::AllocateResponse* out) override {
    std::lock_guard lock(mu_);
    const std::string env = env_name(pool_.resource);
    for (const auto& creq : req->container_requests()) {
      auto* resp = out->add_container_responses();
      std::vector<std::string> addresses, sockets;
      json info = json::object();
      bool vfio = false;
      for (const auto& id : creq.devices_ids()) {
        const Device* d = find(id);
        if (!d)
          return refuse(grpc::StatusCode::INVALID_ARGUMENT,
                        "Allocate: pool " + pool_.resource + " has no device '" + id + "'");
        if (!d->healthy)
          return refuse(grpc::StatusCode::FAILED_PRECONDITION,
                        "Allocate: device " + id + " of pool " + pool_.resource + " is unhealthy");
        resp->add_cdi_devices()->set_name(pool_.resource + "=" + id);
        if (!d->socket.empty()) {
          auto* m = resp->add_mounts();
          m->set_host_path(d->socket);
          m->set_container_path(d->socket);
          sockets.push_back(d->socket);
          continue;
        }
        if (d->iommu_group < 0)
          return refuse(grpc::StatusCode::FAILED_PRECONDITION,
                        "Allocate: device " + id + " of pool " + pool_.resource + " is not bound to vfio-pci");
        if (!vfio) {
          auto* spec = resp->add_devices();
          spec->set_host_path("/dev/vfio/vfio");
          spec->set_container_path("/dev/vfio/vfio");
          spec->set_permissions("rw");
          vfio = true;
        }
        const std::string group = "/dev/vfio/" + std::to_string(d->iommu_group);
        auto* spec = resp->add_devices();
        spec->set_host_path(group);
        spec->set_container_path(group);
        spec->set_permissions("rw");
        addresses.push_back(d->id);
        info[d->id] = {{"generic", {{"deviceID", d->id}}},
                       {"vfio", {{"mount", "/dev/vfio/vfio"}, {"dev-mount", group}}}};
      }
      auto join = [](const std::vector<std::string>& v) {
        std::string s;
        for (const auto& x : v) s += (s.empty() ? "" : ",") + x;
        return s;
      };
      if (!addresses.empty()) {
        (*resp->mutable_envs())["PCIDEVICE_" + env] = join(addresses);
        (*resp->mutable_envs())["PCIDEVICE_" + env + "_INFO"] = info.dump();
        (*resp->mutable_envs())["PCI_RESOURCE_" + env] = join(addresses);
      }
      if (!sockets.empty()) (*resp->mutable_envs())["SRIOVD_VIRTIO_SOCKET_" + env] = join(sockets);
    }
    ++allocations_;
    return grpc::Status::OK;
  }

  grpc::Status PreStartContainer(grpc::ServerContext*, const v1beta1::PreStartContainerRequest*,
                                 v1beta1::PreStartContainerResponse*) override {
    return grpc::Status::OK;
  }

 private:
  void stop_locked(std::chrono::steady_clock::time_point deadline) {
    if (!server_) return;
    server_->close_socket();
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    server_->shutdown(deadline);
    server_.reset();
  }

  [[nodiscard]] const Device* find(const std::string& id) const {
    for (const Device& d : pool_.devices)
      if (d.id == id) return &d;
    return nullptr;
  }
  grpc::Status refuse(grpc::StatusCode code, const std::string& why) {
    ++refused_;
    spdlog::warn("kubernetes: {}", why);
    return {code, why};
  }
  [[nodiscard]] fs::path cdi_path() const { return fs::path(cdi_dir_) / (file_stem(pool_.resource) + ".json"); }
  void write_cdi() {
    json spec;
    {
      std::lock_guard lock(mu_);
      spec = cdi_spec(pool_);
    }
    try {
      write_atomically(cdi_path(), spec.dump(2) + "\n");
    } catch (const std::exception& e) {
      spdlog::error("kubernetes: {}: CDI spec: {}", pool_.resource, e.what());
    }
  }

  std::string dir_, cdi_dir_, socket_name_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  Pool pool_;
  uint64_t version_ = 0;
  bool stopping_ = false;
  std::mutex lifecycle_;  // start, stop, retire (the control and watcher threads)
  std::atomic<bool> retired_{false};
  std::unique_ptr<LocalGrpcServer> server_;
  std::atomic<bool> registered_{false};
  std::atomic<uint64_t> registrations_{0}, allocations_{0}, refused_{0}, refused_peers_{0};
  std::atomic<int> watchers_{0};
};

}  // namespace

// The pools' servers, and a thread that watches the directory: when the
// kubelet's socket appears (a kubelet (re)start), or one of the pools'
// sockets goes (the kubelet cleans the directory when it starts), those
// servers start again and register.
struct NodeAgent::Impl {
  std::string dir, cdi_dir;
  std::mutex mu;  // servers (the map; each server locks its own state)
  std::map<std::string, std::shared_ptr<PoolServer>> servers;
  UniqueFd inotify, stop_fd, kick_fd;  // kick: a new pool wants registering
  RegistrationCalls calls;
  std::thread watcher;

  bool stopping() const {
    pollfd p{stop_fd.get(), POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }
  // Waits `t` unless a stop comes first (true: it came).
  bool stop_within(std::chrono::milliseconds t) const {
    pollfd p{stop_fd.get(), POLLIN, 0};
    return ::poll(&p, 1, static_cast<int>(t.count())) > 0;
  }

  // Registration and restarts happen here, never on the caller of update()
  // (the daemon's control thread): a kubelet that is slow to answer holds
  // up this thread alone, and without the map's lock.
  void watch() {
    alignas(inotify_event) char buf[4096];
    for (;;) {
      pollfd fds[3] = {{inotify.get(), POLLIN, 0}, {stop_fd.get(), POLLIN, 0}, {kick_fd.get(), POLLIN, 0}};
      if (::poll(fds, 3, -1) < 0 && errno != EINTR) return;
      if (fds[1].revents) return;
      bool kubelet = false, kicked = false;
      std::vector<std::string> gone;
      if (fds[2].revents & POLLIN) {
        uint64_t v;
        kicked = ::read(kick_fd.get(), &v, sizeof v) == sizeof v;
      }
      if (fds[0].revents & POLLIN) {
        const ssize_t n = ::read(inotify.get(), buf, sizeof buf);
        for (ssize_t at = 0; n > 0 && at < n;) {
          const auto* e = reinterpret_cast<const inotify_event*>(buf + at);
          const std::string name = e->len ? e->name : "";
          if ((e->mask & (IN_CREATE | IN_MOVED_TO)) && name == kKubeletSocket) kubelet = true;
          if (e->mask & (IN_DELETE | IN_MOVED_FROM)) gone.push_back(name);
          at += static_cast<ssize_t>(sizeof(inotify_event) + e->len);
        }
      }
      std::vector<std::shared_ptr<PoolServer>> all;
      {
        std::lock_guard lock(mu);
        for (auto& [resource, server] : servers) all.push_back(server);
      }
      const bool have_kubelet = fs::exists(dir + "/" + kKubeletSocket);
      for (auto& server : all) {
        if (stopping()) return;
        // Gone and not there again: a socket this process re-made is there.
        const bool lost = std::find(gone.begin(), gone.end(), server->socket_name()) != gone.end() &&
                          !fs::exists(server->socket_path());
        const bool unregistered = kicked && !server->registered();
        if (!kubelet && !lost && !unregistered) continue;
        try {
          if (lost) server->start();
          if (!have_kubelet) continue;
          // A kubelet that has just made its socket may not listen yet.
          // A stop cancels the call under way and ends the retries.
          for (int i = 0; i < 30 && !server->register_with_kubelet(calls) && kubelet && !server->retired(); ++i)
            if (stop_within(std::chrono::milliseconds(100))) return;
        } catch (const std::exception& ex) {
          spdlog::error("kubernetes: {}", ex.what());
        }
      }
    }
  }
};

NodeAgent::NodeAgent(std::string plugin_dir, std::string cdi_dir) : impl_(std::make_unique<Impl>()) {
  impl_->dir = std::move(plugin_dir);
  impl_->cdi_dir = std::move(cdi_dir);
  std::error_code ec;
  fs::create_directories(impl_->dir, ec);
  impl_->inotify.reset(::inotify_init1(IN_CLOEXEC | IN_NONBLOCK));
  impl_->stop_fd.reset(::eventfd(0, EFD_CLOEXEC));
  impl_->kick_fd.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!impl_->inotify || !impl_->stop_fd || !impl_->kick_fd ||
      ::inotify_add_watch(impl_->inotify.get(), impl_->dir.c_str(),
                          IN_CREATE | IN_MOVED_TO | IN_DELETE | IN_MOVED_FROM) < 0)
    throw std::runtime_error("kubernetes: cannot watch " + impl_->dir + ": " + std::strerror(errno));
  // CDI specs a previous run left (it crashed, or was killed): a runtime
  // that honours CDI annotations could otherwise inject a device nobody
  // allocated. Only sriovd's own files (its stem); update() writes the
  // pools' specs again.
  for (const auto& e : fs::directory_iterator(impl_->cdi_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("sriovd-", 0) == 0 && (name.ends_with(".json") || name.ends_with(".json.tmp")) &&
        e.is_regular_file(ec) && !e.is_symlink(ec)) {
      spdlog::info("kubernetes: removing {}, a CDI spec a previous run left", e.path().string());
      fs::remove(e.path(), ec);
    }
  }
  impl_->watcher = std::thread([this] { impl_->watch(); });
}

// On the control thread: bounded. The watcher's registration is cancelled
// (a kubelet that never answers holds nothing), and the servers get one
// grace period between them for their calls under way.
NodeAgent::~NodeAgent() {
  own_eventfd_signal(impl_->stop_fd.get());
  impl_->calls.stop();
  impl_->watcher.join();
  std::lock_guard lock(impl_->mu);
  const auto deadline = std::chrono::steady_clock::now() + PoolServer::kShutdownGrace;
  for (auto& [resource, server] : impl_->servers) server->retire(deadline);
  impl_->servers.clear();
}

void NodeAgent::update(std::vector<Pool> pools) {
  bool added = false;
  {
    std::lock_guard lock(impl_->mu);
    for (auto it = impl_->servers.begin(); it != impl_->servers.end();) {
      const bool kept = std::any_of(pools.begin(), pools.end(), [&](const Pool& p) { return p.resource == it->first; });
      if (!kept) {
        spdlog::info("kubernetes: {} is no longer a pool; its device plugin stops", it->first);
        // Now, not when the watcher lets go of it: a pool added again
        // next gets a server whose files the old one never touches.
        impl_->calls.cancel(it->second.get());
        it->second->retire();
      }
      it = kept ? std::next(it) : impl_->servers.erase(it);
    }
    for (Pool& pool : pools) {
      auto it = impl_->servers.find(pool.resource);
      if (it != impl_->servers.end()) {
        it->second->set(std::move(pool));
        continue;
      }
      const std::string resource = pool.resource;
      auto server = std::make_shared<PoolServer>(impl_->dir, impl_->cdi_dir, std::move(pool));
      server->start();
      impl_->servers.emplace(resource, std::move(server));
      added = true;
    }
  }
  if (added) {
    own_eventfd_signal(impl_->kick_fd.get());
  }
}

json NodeAgent::status() const {
  std::lock_guard lock(impl_->mu);
  json out = json::array();
  for (const auto& [resource, server] : impl_->servers) out.push_back(server->status());
  return out;
}

}  // namespace sriovd::k8s
