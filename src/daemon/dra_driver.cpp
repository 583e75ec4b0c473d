#include "dra_driver.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>

#include <spdlog/spdlog.h>

#include "sriovd/config/loader.hpp"
#include "sriovd/util/fd.hpp"

namespace sriovd::daemon {

namespace fs = std::filesystem;
using control::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kRecordsFile = "dra-claims.json";
constexpr int kRecordsVersion = 1;
constexpr auto kResync = std::chrono::seconds(10);
constexpr auto kBackoffFirst = std::chrono::seconds(1);
constexpr auto kBackoffMax = std::chrono::seconds(30);

// Written whole or not at all, and durable before the host is touched: a
// temporary file synced, renamed over the old one, the directory synced.
void write_durably(const std::string& path, const std::string& text) {
  const fs::path p(path);
  fs::create_directories(p.parent_path());
  const std::string tmp = path + ".tmp";
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!fd) throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(errno));
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(errno));
      done += static_cast<size_t>(n);
    }
    if (::fsync(fd.get()) != 0) throw std::runtime_error("cannot sync " + tmp + ": " + std::strerror(errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0)
    throw std::runtime_error("cannot rename " + tmp + " to " + path + ": " + std::strerror(errno));
  UniqueFd dir(::open(p.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir) ::fsync(dir.get());
}

std::string env_name(const std::string& s) {
  std::string out;
  for (const char c : s) out += std::isalnum(static_cast<unsigned char>(c)) ? static_cast<char>(std::toupper(c)) : '_';
  return out;
}

// "pci0000:00": the PCI root a device is under, from its sysfs path
// (/sys/devices/pci0000:00/0000:00:02.0/...), as upstream's standard
// attribute resource.kubernetes.io/pcieRoot says it.
std::string pcie_root(const std::string& sysfs_root, const std::string& address) {
  std::error_code ec;
  const fs::path real = fs::canonical(fs::path(sysfs_root) / "bus/pci/devices" / address, ec);
  if (ec) return "";
  for (const auto& part : real) {
    std::string s = part.string();
    if (s.size() == 10 && s.rfind("pci", 0) == 0 && s[7] == ':') return s;
  }
  return "";
}

int64_t link_speed(const std::string& sysfs_root, const std::string& netdev) {
  std::ifstream in(fs::path(sysfs_root) / "class/net" / netdev / "speed");
  long long v = -1;
  if (!(in >> v) || v <= 0) return -1;
  return v;
}

std::string node_name(const config::Dra& dra) {
  if (!dra.node_name.empty()) return dra.node_name;
  if (const char* n = std::getenv("NODE_NAME"); n && *n) return n;
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0 || !*host)
    throw std::runtime_error("kubernetes.dra: no node_name, no $NODE_NAME and no host name");
  return host;
}

json ref_json(const k8s::ClaimRef& r) { return {{"namespace", r.ns}, {"name", r.name}, {"uid", r.uid}}; }

// Why a request name `result` (maybe "req/subreq") is what a config's
// requests list names: the list is empty (every request), or names it or
// its parent.
bool config_applies(const json& requests, const std::string& request) {
  if (!requests.is_array() || requests.empty()) return true;
  const std::string parent = request.substr(0, request.find('/'));
  for (const json& r : requests)
    if (r.is_string() && (r.get<std::string>() == request || r.get<std::string>() == parent)) return true;
  return false;
}

}  // namespace

k8s::ApiConfig dra_api_config(const config::Dra& dra) {
  if (!dra.kubeconfig.empty()) return k8s::load_kubeconfig(dra.kubeconfig);
  if (const char* k = std::getenv("KUBECONFIG"); k && *k) return k8s::load_kubeconfig(k);
  try {
    return k8s::in_cluster();
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("no kubeconfig (kubernetes.dra.kubeconfig, $KUBECONFIG) and ") + e.what());
  }
}

std::string dra_device_name(const PciAddress& vf) {
  std::string s = "vf-" + vf.to_string();
  for (char& c : s)
    if (c == ':' || c == '.') c = '-';
  return s;
}

// --- the record file ---

std::vector<ClaimRecord> read_claim_records(const std::string& path) {
  std::ifstream in(path);
  if (!in) return {};
  std::stringstream text;
  text << in.rdbuf();
  std::vector<ClaimRecord> out;
  try {
    const json j = json::parse(text.str());
    if (j.value("version", 0) != kRecordsVersion)
      throw std::runtime_error("version " + j.value("version", json()).dump() + ", this sriovd reads version " +
                               std::to_string(kRecordsVersion));
    for (const json& c : j.at("claims")) {
      ClaimRecord r;
      r.ref = {c.at("namespace").get<std::string>(), c.at("name").get<std::string>(), c.at("uid").get<std::string>()};
      const std::string who = "claim " + r.ref.ns + "/" + r.ref.name;
      for (const json& v : c.at("vfs")) {
        config::ClaimedVf vf;
        vf.claim = r.ref.ns + "/" + r.ref.name;
        vf.uid = r.ref.uid;
        const std::string pf = v.at("pf").get<std::string>();
        if (auto a = PciAddress::parse(pf))
          vf.pf.address = a;
        else
          vf.pf.netdev = pf;
        vf.index = v.at("index").get<uint16_t>();
        vf.config = config::parse_claim_vf_config(v.at("config").dump(), who);
        vf.socket = v.value("socket", "");
        r.vfs.push_back(std::move(vf));
      }
      for (const json& d : c.at("devices")) {
        k8s::PreparedDevice pd;
        pd.request_names = d.at("requests").get<std::vector<std::string>>();
        pd.pool = d.at("pool").get<std::string>();
        pd.device = d.at("device").get<std::string>();
        pd.cdi_device_ids = d.at("cdi_devices").get<std::vector<std::string>>();
        r.devices.push_back(std::move(pd));
      }
      out.push_back(std::move(r));
    }
  } catch (const std::exception& e) {
    throw std::runtime_error(path + ": the prepared claims' record cannot be read: " + e.what());
  }
  return out;
}

void write_claim_records(const std::string& path, const std::vector<ClaimRecord>& records) {
  json claims = json::array();
  for (const ClaimRecord& r : records) {
    json c = ref_json(r.ref);
    c["vfs"] = json::array();
    for (const config::ClaimedVf& v : r.vfs) {
      json e = {{"pf", v.pf.to_string()},
                {"index", v.index},
                {"config", json::parse(config::claim_vf_config_json(v.config))}};
      if (!v.socket.empty()) e["socket"] = v.socket;
      c["vfs"].push_back(e);
    }
    c["devices"] = json::array();
    for (const k8s::PreparedDevice& d : r.devices)
      c["devices"].push_back(
          {{"requests", d.request_names}, {"pool", d.pool}, {"device", d.device}, {"cdi_devices", d.cdi_device_ids}});
    claims.push_back(c);
  }
  write_durably(path, json{{"version", kRecordsVersion}, {"claims", claims}}.dump(2) + "\n");
}

// --- the driver ---

DraDriver::DraDriver(asio::io_context& control, const config::Config& yaml, std::vector<ClaimRecord> records,
                     Hooks hooks)
    : io_(control),
      hooks_(std::move(hooks)),
      driver_(yaml.kubernetes.dra.driver),
      node_(node_name(yaml.kubernetes.dra)),
      records_path_(yaml.state_dir + "/" + kRecordsFile),
      cdi_dir_(yaml.kubernetes.cdi_dir),
      socket_dir_((fs::path(yaml.control.socket).parent_path() / "dra").string()),
      records_(std::move(records)) {
  api_ = std::make_unique<k8s::ApiClient>(dra_api_config(yaml.kubernetes.dra));
  // The CDI specs are the records': written again (a runtime reads them
  // for a container started later), a spec of a claim not recorded goes.
  std::error_code ec;
  const std::string prefix = driver_ + "-claim-";
  for (const auto& e : fs::directory_iterator(cdi_dir_, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) != 0 || !e.is_regular_file(ec) || e.is_symlink(ec)) continue;
    const std::string uid = name.substr(prefix.size(), name.find(".json") - prefix.size());
    bool kept = false;
    for (const ClaimRecord& r : records_) kept = kept || r.ref.uid == uid;
    if (!kept) {
      spdlog::info("dra: removing {}, the CDI spec of a claim not prepared", e.path().string());
      fs::remove(e.path(), ec);
    }
  }
  for (const ClaimRecord& r : records_) write_cdi(r);
  k8s::DraPlugin::Options o;
  o.driver = driver_;
  o.registry_dir = yaml.kubernetes.dra.registry_dir;
  o.plugins_dir = yaml.kubernetes.dra.plugins_dir;
  o.instance = std::to_string(::getpid());
  plugin_ = std::make_unique<k8s::DraPlugin>(o, *this);
  sync_ = std::thread([this] { sync_loop(); });
  spdlog::info("dra: driver {} on node {}, {} prepared claim(s) recorded, serving {}", driver_, node_, records_.size(),
               plugin_->service_socket());
}

DraDriver::~DraDriver() {
  stop();
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (sync_.joinable()) sync_.join();
  plugin_.reset();  // its calls under way end first: they wait on nothing now
}

void DraDriver::stop() { taking_ = false; }

std::vector<config::ClaimedVf> DraDriver::claimed() const {
  std::vector<config::ClaimedVf> out;
  for (const ClaimRecord& r : records_) out.insert(out.end(), r.vfs.begin(), r.vfs.end());
  return out;
}

void DraDriver::kick() {
  {
    std::lock_guard lock(mu_);
    kicked_ = true;
  }
  cv_.notify_all();
}

void DraDriver::update(const config::Config& yaml, const json& devices, const std::string& sysfs_root) {
  std::vector<Offered> offered;
  std::vector<k8s::SliceDevice> slices;
  std::vector<k8s::DeviceHealth> health;
  const auto now = static_cast<int64_t>(::time(nullptr));
  for (const auto& [pf_ref, index] : config::dra_offered_vfs(yaml)) {
    const json* pf = nullptr;
    for (const json& p : devices["physical_functions"])
      if (p.value("pf", "") == pf_ref.to_string()) pf = &p;
    const json* vf = nullptr;
    if (pf && pf->contains("vfs"))
      for (const json& v : (*pf)["vfs"])  // not value(): a copy would die with the loop
        if (v.value("index", -1) == index) vf = &v;
    if (!vf || !vf->contains("address")) continue;  // not there: nothing to offer
    const auto address = PciAddress::parse(vf->value("address", ""));
    if (!address) continue;
    Offered o{dra_device_name(*address), pf_ref, index, *address, vf->value("iommu_group", -1)};
    k8s::SliceDevice d;
    d.name = o.name;
    const std::string dom = driver_ + "/";
    d.attributes[dom + "pciAddress"] = address->to_string();
    const auto netdevs = pf->value("netdevs", std::vector<std::string>());
    d.attributes[dom + "pfName"] = netdevs.empty() ? pf->value("address", pf_ref.to_string()) : netdevs.front();
    d.attributes[dom + "vfIndex"] = static_cast<int64_t>(index);
    d.attributes[dom + "numaNode"] = static_cast<int64_t>(vf->value("numa_node", -1));
    char id[8];
    std::snprintf(id, sizeof id, "%04x", vf->value("vendor_id", 0U) & 0xffffU);
    d.attributes[dom + "vendorID"] = std::string(id);
    std::snprintf(id, sizeof id, "%04x", vf->value("device_id", 0U) & 0xffffU);
    d.attributes[dom + "deviceID"] = std::string(id);
    if (!netdevs.empty())
      if (const int64_t speed = link_speed(sysfs_root, netdevs.front()); speed > 0)
        d.attributes[dom + "linkSpeedMbps"] = speed;
    if (const std::string root = pcie_root(sysfs_root, address->to_string()); !root.empty())
      d.attributes["resource.kubernetes.io/pcieRoot"] = root;
    slices.push_back(std::move(d));
    // A VF is of use while it is there and its PF has link.
    const bool link = pf->value("link", "up") == "up";
    health.push_back({node_, o.name, link, link ? "" : "the PF's link is down", 0});
    offered.push_back(std::move(o));
  }
  // A device offered before and gone now stays in the health list,
  // Unhealthy, so that the kubelet hears of it.
  for (const Offered& was : offered_) {
    bool still = false;
    for (const Offered& o : offered) still = still || o.name == was.name;
    if (!still) health.push_back({node_, was.name, false, "the VF is gone from the host", 0});
  }
  // Each device's time is that of its last change: the same health again
  // is no news for the kubelet (set_health streams only what differs).
  std::map<std::string, std::pair<bool, int64_t>> since;
  for (k8s::DeviceHealth& h : health) {
    const auto it = health_since_.find(h.device);
    h.since = it != health_since_.end() && it->second.first == h.healthy ? it->second.second : now;
    since[h.device] = {h.healthy, h.since};
  }
  health_since_ = std::move(since);
  std::sort(slices.begin(), slices.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  offered_ = std::move(offered);
  plugin_->set_health(std::move(health));
  bool changed = false;
  {
    std::lock_guard lock(mu_);
    changed = !devices_known_ || slices != slice_devices_;
    slice_devices_ = std::move(slices);
    devices_known_ = true;
  }
  if (changed) kick();
}

void DraDriver::remove_slices() {
  try {
    k8s::SlicePublisher pub(*api_, driver_, node_);
    const size_t n = pub.remove_all();
    spdlog::info("dra: driver removed from the config: {} ResourceSlice(s) deleted", n);
  } catch (const std::exception& e) {
    spdlog::error("dra: driver removed from the config, its ResourceSlices stay: {}", e.what());
  }
}

void DraDriver::sync_loop() {
  k8s::SlicePublisher pub(*api_, driver_, node_);
  bool stale_checked = false;
  auto backoff = kBackoffFirst;
  std::string last_error;
  std::unique_lock lock(mu_);
  for (;;) {
    if (stopping_) return;
    std::vector<k8s::SliceDevice> devices = slice_devices_;
    const bool known = devices_known_;
    kicked_ = false;
    lock.unlock();
    std::string error;
    try {
      if (!stale_checked) {
        // A claim prepared before this start whose ResourceClaim is gone
        // (deleted while sriovd was away): nobody will unprepare it.
        std::vector<k8s::ClaimRef> refs = on_control<std::vector<k8s::ClaimRef>>(
            [this] {
              std::vector<k8s::ClaimRef> r;
              for (const ClaimRecord& c : records_) r.push_back(c.ref);
              return r;
            },
            Clock::now() + std::chrono::seconds(10), "listing the prepared claims");
        for (const k8s::ClaimRef& ref : refs) {
          const auto claim =
              api_->find("/apis/resource.k8s.io/v1/namespaces/" + ref.ns + "/resourceclaims/" + ref.name);
          if (claim && (*claim)["metadata"].value("uid", "") == ref.uid) continue;
          spdlog::warn("dra: claim {}/{} ({}) was prepared and its ResourceClaim is gone: unpreparing it", ref.ns,
                       ref.name, ref.uid);
          on_control<bool>(
              [this, uid = ref.uid] {
                unprepare_on_control(uid);
                return true;
              },
              Clock::now() + std::chrono::seconds(40), "unpreparing claim " + ref.ns + "/" + ref.name);
          std::lock_guard l(mu_);
          ++stale_unprepared_;
        }
        stale_checked = true;
      }
      if (known && pub.publish(devices)) {
        std::lock_guard l(mu_);
        ++publishes_;
        spdlog::info("dra: ResourceSlices of node {} published: {} device(s), generation {}", node_, devices.size(),
                     pub.generation());
      }
      if (known) {
        std::lock_guard l(mu_);
        published_once_ = true;
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
    lock.lock();
    sync_error_ = error;
    if (!error.empty()) {
      ++sync_errors_;
      if (error != last_error)
        spdlog::warn("dra: the API server: {} (trying again in {} s)", error,
                     std::chrono::duration_cast<std::chrono::seconds>(backoff).count());
      last_error = error;
      cv_.wait_for(lock, backoff, [this] { return stopping_; });
      backoff = std::min(backoff * 2, std::chrono::duration_cast<std::chrono::seconds>(kBackoffMax));
      continue;
    }
    if (!last_error.empty()) spdlog::info("dra: the API server answers again");
    last_error.clear();
    backoff = kBackoffFirst;
    cv_.wait_for(lock, kResync, [this] { return stopping_ || kicked_; });
  }
}

template <typename R>
R DraDriver::on_control(std::function<R()> fn, Clock::time_point deadline, const std::string& what) {
  if (!taking_) throw std::runtime_error(what + ": sriovd is stopping; ask again");
  auto task = std::make_shared<std::packaged_task<R()>>(std::move(fn));
  auto started = std::make_shared<std::atomic<bool>>(false);
  std::future<R> done = task->get_future();
  asio::post(io_, [task, started] {
    if (!started->exchange(true)) (*task)();
  });
  while (done.wait_until(std::min(deadline, Clock::now() + std::chrono::milliseconds(100))) !=
         std::future_status::ready) {
    const bool late = Clock::now() >= deadline;
    if (!late && taking_) continue;
    if (!started->exchange(true))
      throw std::runtime_error(what + ": " +
                               (late ? "not started within the kubelet's deadline" : "sriovd is stopping") +
                               "; nothing was changed");
    // Under way: it finishes (and is recorded); the kubelet asks again.
    if (late) throw std::runtime_error(what + ": still under way at the kubelet's deadline; ask again");
    if (done.wait_for(std::chrono::seconds(30)) != std::future_status::ready)
      throw std::runtime_error(what + ": sriovd is stopping; ask again");
  }
  return done.get();
}

std::vector<DraDriver::Allocated> DraDriver::read_claim(const k8s::ClaimRef& ref) {
  const std::string who = "ResourceClaim " + ref.ns + "/" + ref.name;
  std::optional<json> claim;
  try {
    claim = api_->find("/apis/resource.k8s.io/v1/namespaces/" + ref.ns + "/resourceclaims/" + ref.name);
  } catch (const k8s::ApiError& e) {
    throw std::runtime_error(who + ": the API server: " + e.what());
  } catch (const k8s::ApiUnreachable& e) {
    throw std::runtime_error(who + ": the API server cannot be reached: " + e.what());
  }
  if (!claim) throw std::runtime_error(who + " does not exist");
  const std::string uid = (*claim)["metadata"].value("uid", "");
  if (uid != ref.uid) throw std::runtime_error(who + " has UID " + uid + ", the kubelet asks for " + ref.uid);
  const json* alloc = nullptr;
  if (claim->contains("status") && (*claim)["status"].contains("allocation")) alloc = &(*claim)["status"]["allocation"];
  if (!alloc || !alloc->contains("devices")) throw std::runtime_error(who + " is not allocated");
  const json& devs = (*alloc)["devices"];
  std::vector<Allocated> out;
  for (const json& r : devs.value("results", json::array())) {
    if (r.value("driver", "") != driver_) continue;
    const std::string device = r.value("device", "");
    if (r.value("pool", "") != node_)
      throw std::runtime_error(who + ": device " + device + " is allocated from pool '" + r.value("pool", "") +
                               "', not this node's (" + node_ + ")");
    Allocated a{device, r.value("request", ""), {}};
    // The class's configs first, then the claim's; within each, in order:
    // a later one's field wins.
    const json configs = devs.value("config", json::array());
    for (const char* source : {"FromClass", "FromClaim"}) {
      for (size_t i = 0; i < configs.size(); ++i) {
        const json& c = configs[i];
        if (c.value("source", "") != source || !c.contains("opaque")) continue;
        if (c["opaque"].value("driver", "") != driver_) continue;
        if (!config_applies(c.value("requests", json::array()), a.request)) continue;
        const std::string where =
            "claim " + ref.ns + "/" + ref.name + ", config " + std::to_string(i) + " (" + source + ")";
        a.config = config::merge(
            a.config, config::parse_claim_vf_config(c["opaque"].value("parameters", json::object()).dump(), where));
      }
    }
    out.push_back(std::move(a));
  }
  if (out.empty()) throw std::runtime_error(who + " has no device of driver " + driver_ + " allocated");
  return out;
}

std::vector<k8s::PreparedDevice> DraDriver::prepare(const k8s::ClaimRef& ref, Clock::time_point deadline) {
  const std::string what = "claim " + ref.ns + "/" + ref.name;
  // Prepared already: the same answer, nothing changed (the API server
  // need not be there for it).
  auto known = on_control<std::optional<std::vector<k8s::PreparedDevice>>>(
      [this, uid = ref.uid]() -> std::optional<std::vector<k8s::PreparedDevice>> {
        for (const ClaimRecord& r : records_)
          if (r.ref.uid == uid) return r.devices;
        return std::nullopt;
      },
      deadline, what);
  if (known) return *known;
  const std::vector<Allocated> alloc = read_claim(ref);
  return on_control<std::vector<k8s::PreparedDevice>>([this, ref, alloc] { return prepare_on_control(ref, alloc); },
                                                      deadline, what);
}

std::vector<k8s::PreparedDevice> DraDriver::prepare_on_control(const k8s::ClaimRef& ref,
                                                               const std::vector<Allocated>& alloc) {
  for (const ClaimRecord& r : records_)
    if (r.ref.uid == ref.uid) return r.devices;  // a call that raced this one prepared it
  const std::string who = "claim " + ref.ns + "/" + ref.name;
  ClaimRecord rec;
  rec.ref = ref;
  for (const Allocated& a : alloc) {
    const Offered* o = nullptr;
    for (const Offered& x : offered_)
      if (x.name == a.device) o = &x;
    if (!o) throw std::runtime_error(who + ": device " + a.device + " is not a VF this node offers now");
    config::ClaimedVf vf;
    vf.claim = ref.ns + "/" + ref.name;
    vf.uid = ref.uid;
    vf.pf = o->pf;
    vf.index = o->index;
    vf.config = a.config;
    const auto driver = a.config.driver.value_or(config::ClaimDriver::vfio_pci);
    if (driver == config::ClaimDriver::vfio_user || driver == config::ClaimDriver::virtio)
      vf.socket = socket_for(ref.uid, a.device);
    rec.vfs.push_back(std::move(vf));
    k8s::PreparedDevice d;
    d.request_names = {a.request};
    d.pool = node_;
    d.device = a.device;
    d.cdi_device_ids = {driver_ + "/vf=" + ref.uid + "-" + a.device};
    rec.devices.push_back(std::move(d));
  }
  std::vector<config::ClaimedVf> all = claimed();
  all.insert(all.end(), rec.vfs.begin(), rec.vfs.end());
  // Recorded before the host changes: a crash from here on restarts with
  // the claim applied, and the kubelet's next prepare or unprepare of it
  // finds it.
  records_.push_back(rec);
  try {
    save();
    hooks_.apply_claims(all);
  } catch (...) {
    records_.pop_back();
    try {
      save();
    } catch (const std::exception& e) {
      spdlog::error("dra: {}", e.what());
    }
    throw;
  }
  write_cdi(rec);
  spdlog::info("dra: {} ({}) prepared: {} device(s)", who, ref.uid, rec.devices.size());
  return rec.devices;
}

void DraDriver::unprepare(const k8s::ClaimRef& ref, Clock::time_point deadline) {
  on_control<bool>(
      [this, uid = ref.uid] {
        unprepare_on_control(uid);
        return true;
      },
      deadline, "claim " + ref.ns + "/" + ref.name);
}

void DraDriver::unprepare_on_control(const std::string& uid) {
  size_t i = 0;
  while (i < records_.size() && records_[i].ref.uid != uid) ++i;
  if (i == records_.size()) return;  // not prepared (or unprepared already): nothing to do
  std::vector<config::ClaimedVf> rest;
  for (size_t k = 0; k < records_.size(); ++k)
    if (k != i) rest.insert(rest.end(), records_[k].vfs.begin(), records_[k].vfs.end());
  // The host restored first; the record goes after (a crash in between
  // restarts with the claim, and the kubelet's unprepare comes again).
  hooks_.apply_claims(rest);
  const ClaimRecord gone = records_[i];
  records_.erase(records_.begin() + static_cast<std::ptrdiff_t>(i));
  save();
  remove_cdi(uid);
  spdlog::info("dra: claim {}/{} ({}) unprepared", gone.ref.ns, gone.ref.name, uid);
}

void DraDriver::save() const { write_claim_records(records_path_, records_); }

std::string DraDriver::cdi_path(const std::string& uid) const {
  return (fs::path(cdi_dir_) / (driver_ + "-claim-" + uid + ".json")).string();
}

std::string DraDriver::socket_for(const std::string& uid, const std::string& device) const {
  return (fs::path(socket_dir_) / (uid + "-" + device + ".sock")).string();
}

// The claim's CDI spec: kind <driver>/vf, a device per allocated VF named
// <uid>-<device>, with what a container needs of it.
void DraDriver::write_cdi(const ClaimRecord& r) const {
  json devices = json::array();
  for (size_t k = 0; k < r.devices.size() && k < r.vfs.size(); ++k) {
    const config::ClaimedVf& vf = r.vfs[k];
    const std::string request_env = env_name(r.devices[k].request_names.empty() ? "" : r.devices[k].request_names[0]);
    json edits = json::object();
    json env = json::array();
    std::string address;
    int group = -1;
    for (const Offered& o : offered_)
      if (o.name == r.devices[k].device) {
        address = o.address.to_string();
        group = o.iommu_group;
      }
    const auto driver = vf.config.driver.value_or(config::ClaimDriver::vfio_pci);
    if (!address.empty()) env.push_back("PCIDEVICE_" + env_name(driver_ + "/vf") + "_" + request_env + "=" + address);
    if (driver == config::ClaimDriver::vfio_pci) {
      json nodes = json::array({{{"path", "/dev/vfio/vfio"}}});
      if (group >= 0) nodes.push_back({{"path", "/dev/vfio/" + std::to_string(group)}});
      edits["deviceNodes"] = nodes;
    } else if (!vf.socket.empty()) {
      edits["mounts"] = json::array({{{"hostPath", vf.socket}, {"containerPath", vf.socket}, {"options", {"bind"}}}});
      env.push_back(
          std::string(driver == config::ClaimDriver::virtio ? "SRIOVD_VIRTIO_SOCKET_" : "SRIOVD_VFIO_USER_SOCKET_") +
          request_env + "=" + vf.socket);
    }
    edits["env"] = env;
    devices.push_back({{"name", r.ref.uid + "-" + r.devices[k].device}, {"containerEdits", edits}});
  }
  try {
    write_durably(cdi_path(r.ref.uid),
                  json{{"cdiVersion", "0.6.0"}, {"kind", driver_ + "/vf"}, {"devices", devices}}.dump(2) + "\n");
  } catch (const std::exception& e) {
    spdlog::error("dra: claim {}/{}: CDI spec: {}", r.ref.ns, r.ref.name, e.what());
  }
}

void DraDriver::remove_cdi(const std::string& uid) const {
  std::error_code ec;
  fs::remove(cdi_path(uid), ec);
}

json DraDriver::status() const {
  json j = plugin_->status();
  j["driver"] = driver_;
  j["node"] = node_;
  j["prepared_claims"] = records_.size();
  j["offered_devices"] = offered_.size();
  std::lock_guard lock(mu_);
  j["slices_published"] = published_once_;
  j["slice_writes"] = publishes_;
  j["api_errors"] = sync_errors_;
  j["stale_claims_unprepared"] = stale_unprepared_;
  if (!sync_error_.empty()) j["api_error"] = sync_error_;
  return j;
}

json DraDriver::claims_json() const {
  json out = json::array();
  for (const ClaimRecord& r : records_) {
    json c = ref_json(r.ref);
    c["devices"] = json::array();
    for (size_t k = 0; k < r.devices.size() && k < r.vfs.size(); ++k) {
      const config::ClaimedVf& vf = r.vfs[k];
      json d = {{"device", r.devices[k].device},
                {"requests", r.devices[k].request_names},
                {"pf", vf.pf.to_string()},
                {"vf", vf.index},
                {"driver", config::to_string(vf.config.driver.value_or(config::ClaimDriver::vfio_pci))},
                {"config", json::parse(config::claim_vf_config_json(vf.config))},
                {"cdi_devices", r.devices[k].cdi_device_ids}};
      if (!vf.socket.empty()) d["socket"] = vf.socket;
      c["devices"].push_back(d);
    }
    out.push_back(c);
  }
  return out;
}

}  // namespace sriovd::daemon
