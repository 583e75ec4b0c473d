#include "metrics.hpp"

#include <future>
#include <stdexcept>

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <spdlog/spdlog.h>

#include "host_service.hpp"
#include "control_server.hpp"
#include "sriovd/daemon/daemon.hpp"
#include "sriovd/version.hpp"

namespace sriovd::daemon {

using prometheus::MetricFamily;
using prometheus::MetricType;

Family::Family(std::string name, std::string help, MetricType type) {
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
}

Family& Family::add(std::vector<std::pair<std::string, std::string>> labels, double value) {
  prometheus::ClientMetric m;
  for (auto& [k, v] : labels) m.label.push_back({std::move(k), std::move(v)});
  if (f.type == MetricType::Counter)
    m.counter.value = value;
  else
    m.gauge.value = value;
  f.metric.push_back(std::move(m));
  return *this;
}

// Runs the snapshot on the control thread and waits for it; a control
// thread that does not answer in time gives a scrape that says so
// (sriovd_scrape_timeouts_total) instead of a hung one.
class MetricsServer::Collector : public prometheus::Collectable {
 public:
  Collector(asio::io_context& io, Snapshot snapshot) : io_(io), snapshot_(std::move(snapshot)) {}

  std::vector<MetricFamily> Collect() const override {
    auto done = std::make_shared<std::promise<std::vector<MetricFamily>>>();
    auto result = done->get_future();
    asio::post(io_, [done, fn = snapshot_] {
      try {
        done->set_value(fn());
      } catch (...) {
        done->set_exception(std::current_exception());
      }
    });
    std::vector<MetricFamily> out;
    if (result.wait_for(kScrapeDeadline) == std::future_status::ready) {
      try {
        out = result.get();
      } catch (const std::exception& e) {
        spdlog::warn("metrics: a scrape failed: {}", e.what());
      }
    } else {
      ++timeouts_;
    }
    Family t("sriovd_scrape_timeouts_total", "scrapes the control thread did not answer within 2 s", MetricType::Counter);
    t.add({}, static_cast<double>(timeouts_.load()));
    out.push_back(std::move(t.f));
    return out;
  }

 private:
  asio::io_context& io_;
  Snapshot snapshot_;
  mutable std::atomic<uint64_t> timeouts_{0};
};

MetricsServer::MetricsServer(asio::io_context& io, const std::string& listen, Snapshot snapshot)
    : listen_(listen), collector_(std::make_shared<Collector>(io, std::move(snapshot))) {
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(listen, 1);
  } catch (const std::exception& e) {
    throw std::runtime_error("metrics.listen " + listen + ": cannot listen (" + e.what() + ")");
  }
  exposer_->RegisterCollectable(collector_);
  spdlog::info("metrics: serving Prometheus on http://{}/metrics", listen);
}

MetricsServer::~MetricsServer() = default;

int MetricsServer::port() const {
  const auto ports = exposer_->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

namespace {

std::string str(const control::json& j, const char* key) {
  if (!j.contains(key) || j[key].is_null()) return "";
  return j[key].is_string() ? j[key].get<std::string>() : j[key].dump();
}

double num(const control::json& j, const char* key) {
  return j.contains(key) && j[key].is_number() ? j[key].get<double>() : 0.0;
}

// One counter family per field of `fields`, named prefix_field_total.
struct CounterSet {
  std::vector<std::pair<std::string, Family>> families;
  CounterSet(const std::string& prefix, std::initializer_list<std::pair<const char*, const char*>> fields) {
    for (const auto& [field, help] : fields)
      families.emplace_back(field, Family(prefix + "_" + field + "_total", help, MetricType::Counter));
  }
  void add(const std::vector<std::pair<std::string, std::string>>& labels, const control::json& values) {
    for (auto& [field, fam] : families) fam.add(labels, num(values, field.c_str()));
  }
  void into(std::vector<MetricFamily>& out) {
    for (auto& [field, fam] : families) out.push_back(std::move(fam.f));
  }
};

void vf_metrics(const control::json& devices, std::vector<MetricFamily>& out) {
  Family info("sriovd_vf_info", "a VF of a configured PF: its address, driver, owner, export and state (value 1)",
              MetricType::Gauge);
  Family pf_present("sriovd_pf_present", "1 while a configured PF exists on the host", MetricType::Gauge);
  for (const auto& pf : devices["physical_functions"]) {
    pf_present.add({{"pf", str(pf, "pf")}}, str(pf, "state") == "present" ? 1 : 0);
    for (const auto& vf : pf["vfs"])
      info.add({{"pf", str(pf, "pf")},
                {"vf", str(vf, "index")},
                {"address", str(vf, "address")},
                {"driver", str(vf, "driver")},
                {"owner", str(vf, "owner")},
                {"export", str(vf, "export")},
                {"state", str(vf, "state")}},
               1);
  }
  out.push_back(std::move(info.f));
  out.push_back(std::move(pf_present.f));
}

void export_metrics(const control::json& devices, std::vector<MetricFamily>& out) {
  Family connected("sriovd_export_connected", "1 while a VMM is connected to the VF's vfio-user export", MetricType::Gauge);
  CounterSet proto("sriovd_export", {{"connections", "VMM connections accepted"},
                                     {"messages", "vfio-user messages handled"},
                                     {"error_replies", "requests refused with an error reply"},
                                     {"protocol_errors", "connections ended for a malformed message"},
                                     {"refused_peers", "connections refused (peer credentials, one client at a time)"}});
  CounterSet irq("sriovd_export_interrupts",
                 {{"fired", "interrupts the VF raised"}, {"delivered", "interrupts delivered to the VMM"},
                  {"masked_pending", "interrupts held while masked"}, {"replayed", "held interrupts delivered at unmask"},
                  {"dropped", "interrupts with nowhere to go"}, {"mode_switches", "adaptive policy switches"}});
  for (const auto& e : devices["vfio_user_exports"]) {
    const std::vector<std::pair<std::string, std::string>> labels = {
        {"pf", str(e, "pf")}, {"vf", str(e, "vf_index")}, {"device", str(e, "vf")}};
    connected.add(labels, str(e, "state") == "connected" ? 1 : 0);
    if (e.contains("vfio_user")) proto.add(labels, e["vfio_user"]);
    if (e.contains("interrupts")) irq.add(labels, e["interrupts"]);
  }
  out.push_back(std::move(connected.f));
  proto.into(out);
  irq.into(out);
}

void virtio_metrics(const control::json& devices, std::vector<MetricFamily>& out) {
  Family connected("sriovd_virtio_connected", "1 while the device's VMM (front-end or vfio-user client) is connected",
                   MetricType::Gauge);
  CounterSet peer("sriovd_virtio", {{"connections", "VMM connections"},
                                    {"messages", "protocol messages handled"},
                                    {"protocol_errors", "connections ended for a malformed message"}});
  CounterSet queues("sriovd_virtio_queue",
                    {{"packets", "packets through the queue"}, {"bytes", "bytes through the queue"},
                     {"dropped", "packets dropped (no room, truncated, or a port error)"},
                     {"kicks", "driver notifications taken"}, {"notifies", "used-buffer notifications sent"},
                     {"sw_offload", "RX packets segmented or checksummed in software for the driver"},
                     {"resubmitted", "buffers a previous back-end left in flight, handed out again"}});
  for (const auto& d : devices["virtio_devices"]) {
    const std::string name = str(d, "name");
    const std::string state = str(d, "state");
    connected.add({{"device", name}}, state == "running" || state == "connected" ? 1 : 0);
    for (const char* key : {"vhost_user", "vfio_user"})
      if (d.contains(key)) peer.add({{"device", name}}, d[key]);
    if (d.contains("queues"))
      for (const auto& q : d["queues"]) queues.add({{"device", name}, {"queue", str(q, "queue")}}, q);
  }
  out.push_back(std::move(connected.f));
  peer.into(out);
  queues.into(out);
}

void route_metrics(const control::json& routes, std::vector<MetricFamily>& out) {
  CounterSet c("sriovd_route",
               {{"fired", "source signals taken"}, {"delivered", "interrupts delivered to the sink"},
                {"masked_pending", "interrupts held while masked"}, {"replayed", "held interrupts delivered at unmask"},
                {"dropped", "interrupts with no sink"}, {"mode_switches", "direct/relay switches (adaptive)"}});
  Family masked("sriovd_route_masked", "1 while the route's vector is masked", MetricType::Gauge);
  Family direct("sriovd_route_direct", "1 while the route is bound kernel-to-VMM (no relay)", MetricType::Gauge);
  for (const auto& r : routes["routes"]) {
    const std::vector<std::pair<std::string, std::string>> labels = {{"device", str(r, "device")},
                                                                      {"vector", str(r, "vector")}};
    c.add(labels, r);
    masked.add(labels, r.value("masked", false) ? 1 : 0);
    direct.add(labels, str(r, "mode") == "direct" ? 1 : 0);
  }
  c.into(out);
  out.push_back(std::move(masked.f));
  out.push_back(std::move(direct.f));
}

}  // namespace

std::vector<MetricFamily> Daemon::metrics_snapshot() const {
  std::vector<MetricFamily> out;
  Family build("sriovd_build_info", "the running sriovd (value 1)", MetricType::Gauge);
  build.add({{"version", kVersion}}, 1);
  out.push_back(std::move(build.f));
  const control::json devices = devices_json();
  vf_metrics(devices, out);
  export_metrics(devices, out);
  virtio_metrics(devices, out);
  route_metrics(routes_json(), out);
  Family reloads("sriovd_reloads_total", "configuration reloads, by result", MetricType::Counter);
  reloads.add({{"result", "ok"}}, static_cast<double>(reloads_.ok)).add({{"result", "failed"}}, static_cast<double>(reloads_.failed));
  out.push_back(std::move(reloads.f));
  const auto& c = control_->stats();
  CounterSet control("sriovd_control", {{"connections", "control API connections"},
                                        {"requests", "control API requests"},
                                        {"errors", "control API requests answered with an error"},
                                        {"rejected_peers", "control API peers refused (credentials)"}});
  control.add({}, {{"connections", c.connections}, {"requests", c.requests}, {"errors", c.errors},
                   {"rejected_peers", c.rejected_peers}});
  control.into(out);
  const control::json loop = control_loop_json();
  CounterSet polls("sriovd_control_loop", {{"polls", "times the control thread polled before sleeping (control.poll_us)"},
                                           {"hits", "polls in which work came"}});
  polls.add({}, loop);
  polls.into(out);
  Family polled("sriovd_control_loop_polled_seconds_total", "wall time the control thread spent polling (its yields included)",
                MetricType::Counter);
  polled.add({}, static_cast<double>(loop_.stats().polled_ns) / 1e9);
  out.push_back(std::move(polled.f));
  Family txn("sriovd_host_transactions_total", "host change transactions, by outcome", MetricType::Counter);
  const auto& t = host_->transactions();
  txn.add({{"outcome", "committed"}}, static_cast<double>(t.committed))
      .add({{"outcome", "rolled_back"}}, static_cast<double>(t.rolled_back));
  out.push_back(std::move(txn.f));
  Family udev("sriovd_udev_events_total", "udev events taken", MetricType::Counter);
  udev.add({}, static_cast<double>(udev_events_total_));
  out.push_back(std::move(udev.f));
  return out;
}

}  // namespace sriovd::daemon
