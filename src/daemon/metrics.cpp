#include "metrics.hpp"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <utility>

#include <prometheus/text_serializer.h>
#include <spdlog/spdlog.h>

#include "daemon_internal.hpp"
#include "host_service.hpp"
#include "notify.hpp"
#include "vf_exports.hpp"
#include "virtio_exports.hpp"
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

Family& Family::add(const std::vector<std::pair<std::string, std::string>>& labels, double value) {
  prometheus::ClientMetric m;
  m.label.reserve(labels.size());
  for (const auto& [k, v] : labels) m.label.push_back({k, v});
  if (f.type == MetricType::Counter)
    m.counter.value = value;
  else
    m.gauge.value = value;
  f.metric.push_back(std::move(m));
  return *this;
}

// One client: its request read within the deadline and the size limit,
// answered, closed (no keep-alive: a scrape is one request).
class MetricsServer::Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(MetricsServer& server, asio::ip::tcp::socket socket)
      : server_(&server), socket_(std::move(socket)), timer_(socket_.get_executor()), buffer_(kMaxRequest) {
    boost::system::error_code ec;
    const auto peer = socket_.remote_endpoint(ec);
    address_ = ec ? std::string("?") : peer.address().to_string();
  }

  void start() {
    arm(kRequestDeadline, &Closed::request_deadline);
    asio::async_read_until(socket_, buffer_, "\r\n\r\n",
                           [self = shared_from_this()](boost::system::error_code ec, size_t) { self->on_request(ec); });
  }

  // The server is going: nothing here may touch it again.
  void abandon() {
    server_ = nullptr;
    shut();
  }
  // Pushed out by a newer connection while it had not sent its request.
  void push_out() { close(&Closed::pushed_out); }

  [[nodiscard]] bool requested() const { return requested_; }
  [[nodiscard]] const std::string& address() const { return address_; }

 private:
  void arm(std::chrono::seconds deadline, uint64_t Closed::*reason) {
    timer_.expires_after(deadline);
    timer_.async_wait([self = shared_from_this(), reason](boost::system::error_code ec) {
      if (!ec) self->close(reason);
    });
  }

  void on_request(boost::system::error_code ec) {
    if (!server_ || ec == asio::error::operation_aborted) return;
    if (ec) {
      close(ec == asio::error::not_found ? &Closed::too_large : nullptr);  // not_found: the limit came first
      return;
    }
    requested_ = true;
    std::istream in(&buffer_);
    std::string line;
    std::getline(in, line);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    answer_ = server_->answer(line);
    if (answer_.rfind("HTTP/1.1 400", 0) == 0) ++server_->closed_.bad_request;
    timer_.cancel();
    arm(kAnswerDeadline, &Closed::answer_deadline);
    asio::async_write(socket_, asio::buffer(answer_),
                      [self = shared_from_this()](boost::system::error_code wec, size_t) {
                        if (wec == asio::error::operation_aborted || !self->server_) return;
                        self->close(nullptr);
                      });
  }

  void close(uint64_t Closed::*reason) {
    if (!server_) return;
    MetricsServer* server = std::exchange(server_, nullptr);
    if (reason) ++(server->closed_.*reason);
    shut();
    server->forget(this);
  }

  void shut() {
    boost::system::error_code ignored;
    timer_.cancel();
    socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
  }

  MetricsServer* server_;
  asio::ip::tcp::socket socket_;
  asio::steady_timer timer_;
  asio::streambuf buffer_;
  std::string address_, answer_;
  bool requested_ = false;
};

MetricsServer::MetricsServer(asio::io_context& io, const std::string& listen, Snapshot snapshot)
    : listen_(listen), snapshot_(std::move(snapshot)), acceptor_(io), retry_(io) {
  try {
    const auto colon = listen.rfind(':');
    if (colon == std::string::npos) throw std::invalid_argument("not an address and a port");
    const asio::ip::tcp::endpoint at(asio::ip::make_address_v4(listen.substr(0, colon)),
                                     static_cast<uint16_t>(std::stoul(listen.substr(colon + 1))));
    acceptor_.open(at.protocol());
    acceptor_.set_option(asio::socket_base::reuse_address(true));
    acceptor_.bind(at);
    acceptor_.listen(asio::socket_base::max_listen_connections);
  } catch (const std::exception& e) {
    throw std::runtime_error("metrics.listen " + listen + ": cannot listen (" + e.what() + ")");
  }
  accept_next();
  spdlog::info("metrics: serving Prometheus on http://{}:{}/metrics", listen.substr(0, listen.rfind(':')), port());
}

// Nothing of it stays pending on the io_context (the daemon's shutdown
// lets the io_context run out of work).
MetricsServer::~MetricsServer() {
  boost::system::error_code ignored;
  retry_.cancel();
  acceptor_.close(ignored);
  for (auto& c : connections_) c->abandon();
  connections_.clear();
}

int MetricsServer::port() const {
  boost::system::error_code ec;
  const auto at = acceptor_.local_endpoint(ec);
  return ec ? 0 : at.port();
}

void MetricsServer::accept_next() {
  acceptor_.async_accept([this](boost::system::error_code ec, asio::ip::tcp::socket socket) {
    if (ec == asio::error::operation_aborted) return;
    if (ec) {
      // Out of fds and the like: this client waits in the backlog; no spin.
      retry_.expires_after(std::chrono::milliseconds(100));
      retry_.async_wait([this](boost::system::error_code tec) {
        if (!tec) accept_next();
      });
      return;
    }
    admit(std::move(socket));
    accept_next();
  });
}

void MetricsServer::admit(asio::ip::tcp::socket socket) {
  auto c = std::make_shared<Connection>(*this, std::move(socket));
  if (connections_.size() >= kMaxConnections) {
    // Full: the oldest connection that has not sent its request, from the
    // address that holds the most such connections, makes room.
    std::map<std::string, size_t> waiting;
    for (const auto& o : connections_)
      if (!o->requested()) ++waiting[o->address()];
    if (waiting.empty()) {
      c->abandon();  // all answering: the new one waits for no one
      ++closed_.pushed_out;
      return;
    }
    const auto most = std::max_element(waiting.begin(), waiting.end(),
                                       [](const auto& x, const auto& y) { return x.second < y.second; });
    for (const auto& o : connections_)
      if (!o->requested() && o->address() == most->first) {
        const auto victim = o;  // push_out() takes it off the list `o` lives in
        victim->push_out();
        break;
      }
  }
  connections_.push_back(c);
  c->start();
}

void MetricsServer::forget(Connection* c) {
  connections_.remove_if([c](const std::shared_ptr<Connection>& o) { return o.get() == c; });
}

std::string MetricsServer::answer(const std::string& request_line) {
  auto reply = [](const char* status, const std::string& type, const std::string& body) {
    return std::string("HTTP/1.1 ") + status + "\r\nContent-Type: " + type +
           "\r\nContent-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
  };
  const auto sp1 = request_line.find(' ');
  const auto sp2 = sp1 == std::string::npos ? std::string::npos : request_line.find(' ', sp1 + 1);
  if (sp2 == std::string::npos || request_line.compare(sp2 + 1, 5, "HTTP/") != 0)
    return reply("400 Bad Request", "text/plain", "not an HTTP request\n");
  const std::string method = request_line.substr(0, sp1);
  std::string target = request_line.substr(sp1 + 1, sp2 - sp1 - 1);
  target = target.substr(0, target.find('?'));
  if (method != "GET" && method != "HEAD") return reply("405 Method Not Allowed", "text/plain", "GET /metrics\n");
  if (target != "/metrics") return reply("404 Not Found", "text/plain", "sriovd serves /metrics\n");
  std::string body;
  try {
    std::ostringstream out;
    prometheus::TextSerializer().Serialize(out, snapshot_());
    body = out.str();
  } catch (const std::exception& e) {
    spdlog::warn("metrics: a scrape failed: {}", e.what());
    return reply("500 Internal Server Error", "text/plain", std::string(e.what()) + "\n");
  }
  std::string r = reply("200 OK", "text/plain; version=0.0.4; charset=utf-8", body);
  if (method == "HEAD") r.resize(r.size() - body.size());
  return r;
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
  Family pf_link("sriovd_pf_link_up", "1 while a configured PF's netdev has carrier, 0 while its link is down",
                 MetricType::Gauge);
  Family healthy("sriovd_vf_healthy",
                 "1 while an assigned VF can serve its owner (on vfio-pci, its IOMMU group viable, its PF's link up)",
                 MetricType::Gauge);
  for (const auto& pf : devices["physical_functions"]) {
    pf_present.add({{"pf", str(pf, "pf")}}, str(pf, "state") == "present" ? 1 : 0);
    if (pf.contains("link")) pf_link.add({{"pf", str(pf, "pf")}}, str(pf, "link") == "up" ? 1 : 0);
    for (const auto& vf : pf["vfs"]) {
      info.add({{"pf", str(pf, "pf")},
                {"vf", str(vf, "index")},
                {"address", str(vf, "address")},
                {"driver", str(vf, "driver")},
                {"owner", str(vf, "owner")},
                {"export", str(vf, "export")},
                {"state", str(vf, "state")}},
               1);
      if (vf.contains("owner"))
        healthy.add({{"pf", str(pf, "pf")}, {"vf", str(vf, "index")}, {"owner", str(vf, "owner")}},
                    assigned_vf_healthy(pf, vf) ? 1 : 0);
    }
  }
  out.push_back(std::move(info.f));
  out.push_back(std::move(pf_present.f));
  out.push_back(std::move(pf_link.f));
  out.push_back(std::move(healthy.f));
}

// A device a VMM cannot use: a VF export or virtio device that is not
// served (its reason in `sriovctl devices`), or a virtio device its driver
// must reset (NEEDS_RESET).
void failed_device_metrics(const control::json& devices, std::vector<MetricFamily>& out) {
  Family failed("sriovd_device_failed",
                "1 while a configured device cannot be used: not served, or needing its driver's reset "
                "(sriovctl devices says why)",
                MetricType::Gauge);
  for (const auto& e : devices.value("vfio_user_exports", control::json::array()))
    failed.add({{"kind", "vf_export"}, {"device", str(e, "vf")}}, str(e, "state") == "not served" ? 1 : 0);
  for (const auto& v : devices.value("virtio_devices", control::json::array()))
    failed.add({{"kind", "virtio"}, {"device", str(v, "name")}},
               str(v, "state") == "not served" || v.value("needs_reset", false) ? 1 : 0);
  out.push_back(std::move(failed.f));
}

}  // namespace

std::vector<MetricFamily> Daemon::metrics_snapshot() const {
  std::vector<MetricFamily> out;
  Family build("sriovd_build_info", "the running sriovd (value 1)", MetricType::Gauge);
  build.add({{"version", kVersion}}, 1);
  out.push_back(std::move(build.f));
  const control::json devices = devices_json();
  vf_metrics(devices, out);
  failed_device_metrics(devices, out);
  vf_exports_->metrics(out);
  virtio_->metrics(out);
  route_metrics(out);
  Family reloads("sriovd_reloads_total", "configuration reloads, by result", MetricType::Counter);
  reloads.add({{"result", "ok"}}, static_cast<double>(reloads_.ok))
      .add({{"result", "failed"}}, static_cast<double>(reloads_.failed));
  out.push_back(std::move(reloads.f));
  const auto& c = control_->stats();
  CounterSet control("sriovd_control", {{"connections", "control API connections"},
                                        {"requests", "control API requests"},
                                        {"errors", "control API requests answered with an error"},
                                        {"rejected_peers", "control API peers refused (credentials, or no room)"},
                                        {"evicted", "waiting control connections closed to make room for a new one"}});
  control.add({}, {{"connections", c.connections},
                   {"requests", c.requests},
                   {"errors", c.errors},
                   {"rejected_peers", c.rejected_peers},
                   {"evicted", c.evicted}});
  control.into(out);
  const control::json loop = control_loop_json();
  CounterSet polls("sriovd_control_loop",
                   {{"polls", "times the control thread polled before sleeping (control.poll_us)"},
                    {"hits", "polls in which work came"}});
  polls.add({}, loop);
  polls.into(out);
  Family polled("sriovd_control_loop_polled_seconds_total",
                "wall time the control thread spent polling (its yields included)", MetricType::Counter);
  polled.add({}, static_cast<double>(loop_.stats().polled_ns) / 1e9);
  out.push_back(std::move(polled.f));
  Family sessions("sriovd_session_thread_exports", "exports served by each session thread", MetricType::Gauge);
  Family cpu("sriovd_session_thread_cpu_seconds_total", "CPU time each session thread has used", MetricType::Counter);
  for (size_t i = 0; i < sessions_->size(); ++i) {
    const SessionThread& st = sessions_->at(i);
    sessions.add({{"thread", std::to_string(i)}}, st.sessions());
    cpu.add({{"thread", std::to_string(i)}}, static_cast<double>(st.cpu_ns()) / 1e9);
  }
  out.push_back(std::move(sessions.f));
  out.push_back(std::move(cpu.f));
  Family txn("sriovd_host_transactions_total", "host change transactions, by outcome", MetricType::Counter);
  const auto& t = host_->transactions();
  txn.add({{"outcome", "committed"}}, static_cast<double>(t.committed))
      .add({{"outcome", "rolled_back"}}, static_cast<double>(t.rolled_back));
  out.push_back(std::move(txn.f));
  // A family of one unlabelled sample.
  auto single = [&out](const char* name, const char* help, MetricType type, double value) {
    Family f(name, help, type);
    f.add({}, value);
    out.push_back(std::move(f.f));
  };
  single("sriovd_host_restore_failures_total",
         "changes sriovd could not give back to the host: steps a rollback could not undo, releases that failed",
         MetricType::Counter, static_cast<double>(t.restore_failures));
  if (const auto interval = notifier_->watchdog_interval()) {
    single("sriovd_watchdog_pings_total", "pings sent to systemd's watchdog", MetricType::Counter,
           static_cast<double>(watchdog_.pings));
    single("sriovd_watchdog_late_pings_total",
           "watchdog pings sent more than half an interval after they were due (the control thread stalled; "
           "systemd kills the daemon at two intervals)",
           MetricType::Counter, static_cast<double>(watchdog_.late));
    single("sriovd_watchdog_max_delay_seconds", "the latest a watchdog ping has been since the start",
           MetricType::Gauge, std::chrono::duration<double>(watchdog_.max_delay).count());
    single("sriovd_watchdog_interval_seconds", "how often the watchdog is pinged (half of WatchdogSec)",
           MetricType::Gauge, std::chrono::duration<double>(*interval).count());
  }
  single("sriovd_udev_events_total", "udev events taken", MetricType::Counter, static_cast<double>(udev_events_total_));
  if (metrics_) {
    const auto& shut = metrics_->closed();
    Family closed("sriovd_metrics_connections_closed_total",
                  "connections to this endpoint closed by its limits, by reason", MetricType::Counter);
    closed.add({{"reason", "request_deadline"}}, static_cast<double>(shut.request_deadline))
        .add({{"reason", "too_large"}}, static_cast<double>(shut.too_large))
        .add({{"reason", "bad_request"}}, static_cast<double>(shut.bad_request))
        .add({{"reason", "pushed_out"}}, static_cast<double>(shut.pushed_out))
        .add({{"reason", "answer_deadline"}}, static_cast<double>(shut.answer_deadline));
    out.push_back(std::move(closed.f));
  }
  return out;
}

void Daemon::route_metrics(std::vector<MetricFamily>& out) const {
  TypedCounters c("sriovd_route", irq::kRouteCounters);
  Family masked("sriovd_route_masked", "1 while the route's vector is masked", MetricType::Gauge);
  Family direct("sriovd_route_direct", "1 while the route is bound kernel-to-VMM (no relay)", MetricType::Gauge);
  for (const auto& r : irq_->list()) {
    const std::vector<std::pair<std::string, std::string>> labels = {{"device", r.device},
                                                                     {"vector", std::to_string(r.vector)}};
    c.add(labels, r.stats);
    masked.add(labels, r.masked ? 1 : 0);
    direct.add(labels, r.mode == irq::Mode::direct ? 1 : 0);
  }
  c.into(out);
  out.push_back(std::move(masked.f));
  out.push_back(std::move(direct.f));
}

}  // namespace sriovd::daemon
