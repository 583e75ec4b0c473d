#include "vf_exports.hpp"

#include <algorithm>
#include <optional>
#include <stdexcept>

#include <spdlog/spdlog.h>

#include "daemon_internal.hpp"
#include "host_service.hpp"
#include "metrics.hpp"
#include "sriovd/host/sysfs.hpp"

namespace sriovd::daemon {

using control::json;
using prometheus::MetricFamily;
using prometheus::MetricType;

VfExports::VfExports(SessionPool& sessions, irq::Engine& engine, HostService& host, std::string sysfs_root)
    : sessions_(sessions), engine_(engine), host_(host), sysfs_root_(std::move(sysfs_root)) {}

VfExports::~VfExports() = default;

std::vector<VfExports::WantedExport> VfExports::wanted(const config::Config& cfg) {
  std::vector<WantedExport> out;
  for (const auto& pf : cfg.physical_functions) {
    std::optional<PciAddress> addr = pf.ref.address;
    if (!addr) {
      const std::string root = host_.simulated() ? host_.simulated()->root() : sysfs_root_;
      addr = host::pci_address_of_netdev(root, pf.ref.netdev);
    }
    if (!addr) continue;
    for (const auto& vf : pf.vfs)
      if (vf.assign && vf.assign->export_kind == config::ExportKind::vfio_user)
        out.push_back({*addr, vf.index, &pf, &*vf.assign});
  }
  return out;
}

namespace {
irq::Policy policy_of(config::MsixPolicy p) {
  switch (p) {
    case config::MsixPolicy::direct: return irq::Policy::direct;
    case config::MsixPolicy::relay: return irq::Policy::relay;
    case config::MsixPolicy::adaptive: break;
  }
  return irq::Policy::adaptive;
}
}  // namespace

void VfExports::drop(const config::Config* next, const config::Config& current) {
  if (!next) {
    for (auto& e : exports_) end(e);
    exports_.clear();
    return;
  }
  const auto keep = wanted(*next);
  std::erase_if(exports_, [&](Export& e) {
    const bool drop = [&] {
      for (const auto& w : keep) {
        if (w.pf != e.pf || w.index != e.index || w.assign->socket != e.socket ||
            policy_of(w.assign->msix_policy) != e.policy || w.assign->bar_access != e.bar_access)
          continue;
        // Same VF, same export; its PF keeps its VFs only if num_vfs stays.
        for (const auto& pf : current.physical_functions)
          if (pf.num_vfs != w.pf_cfg->num_vfs && (pf.ref == w.pf_cfg->ref)) return true;
        return !e.server;  // one that could not be served is tried again
      }
      return true;
    }();
    if (drop) end(e);
    return drop;
  });
}

// An export's end: what it gave away remembered, then its server and
// proxy deleted on their thread, users first (never by a vector's element
// assignment, which would delete them in declaration order).
void VfExports::end(Export& e) {
  forget(e);
  e.server.reset();
  e.proxy.reset();
  e.thread.reset();
}

std::vector<pid_t> VfExports::fd_recipients(const Export& e) {
  if (!e.server) return {};
  return e.thread->call([&] { return e.server->fd_recipients(); });
}

void VfExports::forget(const Export& e) {
  const std::vector<pid_t> given = fd_recipients(e);
  if (given.empty()) return;
  auto& pids = fd_given_[e.vf];
  for (pid_t p : given)
    if (std::find(pids.begin(), pids.end(), p) == pids.end()) pids.push_back(p);
}

// The host layer's question before it unbinds a VF from vfio-pci: does a
// process still hold its VFIO device? Only VFs whose device fd went to a
// client are looked for (a /proc walk), and a VF nobody holds any more is
// forgotten.
std::string VfExports::release_holders(const PciAddress& vf) {
  for (const auto& e : exports_) forget(e);  // an export still up (released under it)
  const auto given = fd_given_.find(vf.to_string());
  if (given == fd_given_.end()) return {};
  const auto holders = vfio::device_holders(vf.to_string(), given->second);
  if (holders.empty()) {
    fd_given_.erase(given);
    return {};
  }
  return vfio::describe(holders);
}

void VfExports::sync(const config::Config& cfg) {
  for (const auto& w : wanted(cfg)) {
    if (host_.released(w.pf, w.index)) continue;
    auto have = std::find_if(exports_.begin(), exports_.end(),
                             [&](const Export& e) { return e.pf == w.pf && e.index == w.index; });
    if (have != exports_.end()) {
      // Running: a reload's access applies to it (the next client).
      if (have->server) {
        Export& x = *have;
        try {
          x.thread->call([&] {
            x.server->set_allowed_uids(w.assign->access.allowed_uids);
            x.server->set_socket_access(access_of(w.assign->access));
          });
        } catch (const std::exception& ex) {
          spdlog::error("vfio-user: {}", ex.what());
        }
      }
      continue;
    }
    Export e;
    e.pf = w.pf;
    e.index = w.index;
    e.socket = w.assign->socket;
    e.policy = policy_of(w.assign->msix_policy);
    try {
      auto vf = host_.vf_address(w.pf_cfg->ref, w.index);
      if (!vf) throw std::runtime_error("PF " + w.pf.to_string() + " has no VF " + std::to_string(w.index));
      e.vf = vf->to_string();
      e.bar_access = w.assign->bar_access;
      // Handed over by the predecessor: its VFIO device as it stands.
      std::optional<HandedVf> handed;
      if (const auto it = std::find_if(handed_.begin(), handed_.end(),
                                       [&](const HandedVf& h) { return h.vf == e.vf && h.socket == e.socket; });
          it != handed_.end()) {
        handed = std::move(*it);
        handed_.erase(it);
      }
      std::unique_ptr<vfio::Device> device;
      // (an export nobody was connected to hands over its socket only: its
      // VF is opened afresh)
      if (handed && !handed->server.device.empty()) {
        try {
          device = host_.adopt_vf(cfg, w.pf_cfg->ref, w.index,
                                  vfio_user::VfProxy::adopt_device(handed->server.device, handed->server,
                                                                   "the handover of VF export " + e.vf));
        } catch (const std::exception& ex) {
          spdlog::error("vfio-user: VF {}: the handover did not fit ({}); served afresh", e.vf, ex.what());
          handed.reset();
        }
      }
      if (!device) device = host_.open_vf(cfg, w.pf_cfg->ref, w.index);
      e.thread = sessions_.lease();
      SessionThread& t = *e.thread;
      e.proxy = make_on_session(t, [&] {
        auto proxy = std::make_unique<vfio_user::VfProxy>(std::move(device), engine_, e.policy, e.vf,
                                                          e.bar_access == config::BarAccess::mmap
                                                              ? vfio_user::BarMapping::device_fd
                                                              : vfio_user::BarMapping::trapped);
        proxy->set_dma_limit(w.assign->max_dma_mib << 20U);
        return proxy;
      });
      // The export's own allow-list: a VMM allowed here may not use the
      // control API, nor an operator's uid this VMM's socket.
      e.server = make_on_session(t, [&] {
        std::unique_ptr<vfio_user::Server> server;
        if (handed) {
          try {
            server = std::make_unique<vfio_user::Server>(t.io(), e.socket, *e.proxy, w.assign->access.allowed_uids,
                                                         std::move(handed->server));
            spdlog::info("vfio-user: VF {} taken over from the previous sriovd", e.vf);
          } catch (const std::exception& ex) {
            // The client's connection ends; the VF starts afresh for the next.
            spdlog::error("vfio-user: VF {}: the handover did not fit ({}); served afresh", e.vf, ex.what());
          }
        }
        if (!server)
          server = std::make_unique<vfio_user::Server>(t.io(), e.socket, *e.proxy, w.assign->access.allowed_uids);
        server->set_socket_access(access_of(w.assign->access));
        return server;
      });
      spdlog::info("vfio-user: VF {} ({} VF {}) exported for {} on {}, MSI-X policy {}", e.vf, w.pf.to_string(),
                   w.index, w.assign->owner.empty() ? "anyone" : w.assign->owner, e.socket, irq::to_string(e.policy));
    } catch (const std::exception& ex) {
      e.server.reset();
      e.proxy.reset();
      e.thread.reset();
      e.not_served = ex.what();
      spdlog::error("vfio-user: {} VF {}: not exported: {}", w.pf.to_string(), w.index, ex.what());
    }
    exports_.push_back(std::move(e));
  }
  for (const HandedVf& h : handed_)
    spdlog::warn("vfio-user: VF {} handed over but not exported by this config: its client is let go", h.vf);
  handed_.clear();
}

void VfExports::release(const PciAddress& pf, const std::vector<unsigned>& indices) {
  std::erase_if(exports_, [&](Export& e) {
    if (e.pf != pf || std::find(indices.begin(), indices.end(), e.index) == indices.end()) return false;
    end(e);
    return true;
  });
}

bool VfExports::with_proxy(const std::string& device, std::string& why,
                           const std::function<void(vfio_user::VfProxy&)>& fn) {
  for (const Export& e : exports_) {
    if (e.vf != device) continue;
    if (!e.proxy) {
      why = device + " is not served: " + e.not_served;
      return false;
    }
    e.thread->call([&] { fn(*e.proxy); });
    return true;
  }
  why = device + " is not exported";
  return false;
}

// Never a /proc walk here (a status is built for every scrape): the last
// survey, which this asks to be renewed.
std::string VfExports::surveyed_holders(const std::string& vf) const {
  std::map<std::string, std::vector<pid_t>> devices = fd_given_;
  for (const auto& e : exports_) {
    if (!e.server) continue;
    auto& pids = devices[e.vf];
    for (pid_t p : fd_recipients(e))
      if (std::find(pids.begin(), pids.end(), p) == pids.end()) pids.push_back(p);
  }
  std::erase_if(devices, [](const auto& d) { return d.second.empty(); });
  holder_survey_->watch(std::move(devices));
  return vfio::describe(holder_survey_->seen(vf).holders);
}

json VfExports::held_json() const {
  json out = json::array();
  for (const auto& given : fd_given_) {
    const std::string& vf = given.first;
    if (std::any_of(exports_.begin(), exports_.end(), [&](const Export& e) { return e.vf == vf; })) continue;
    if (const std::string held = surveyed_holders(vf); !held.empty()) out.push_back({{"vf", vf}, {"held_by", held}});
  }
  return out;
}

std::vector<HandedVf> VfExports::freeze_for_handover(bool force, std::vector<std::string>& cut) {
  std::vector<HandedVf> out;
  try {
    for (auto& e : exports_) {
      if (!e.server) continue;
      HandedVf h;
      h.vf = e.vf;
      h.socket = e.socket;
      const bool frozen = e.thread->call([&] {
        try {
          h.server = e.server->freeze_for_handover();
          return true;
        } catch (const HandoverRefused& ex) {
          const std::string why = "VF export " + e.vf + ": " + ex.what();
          if (!force) throw HandoverRefused(why);
          cut.push_back(why);  // served afresh by the successor
          return false;
        }
      });
      if (frozen) out.push_back(std::move(h));
    }
  } catch (...) {
    thaw();
    throw;
  }
  return out;
}

void VfExports::thaw() {
  for (auto& e : exports_)
    if (e.server) e.thread->call([&] { e.server->thaw(); });
}

void VfExports::handed_over() {
  for (auto& e : exports_)
    if (e.server) e.thread->call([&] { e.server->handed_over(); });
}

json VfExports::exports_json() const {
  json out = json::array();
  for (const auto& e : exports_) {
    json j = {{"pf", e.pf.to_string()},
              {"vf_index", e.index},
              {"vf", e.vf},
              {"socket", e.socket},
              {"msix_policy", irq::to_string(e.policy)},
              {"bar_access", config::to_string(e.bar_access)}};
    if (!e.server) {
      j["state"] = "not served";
      j["reason"] = e.not_served;
    } else {
      bool holders = false;
      e.thread->call([&] {
        const auto& st = e.server->stats();
        j["state"] = e.server->connected() ? "connected" : "listening";
        j["session_thread"] = e.thread->index();
        j["vfio_user"] = counters_json(st, vfio_user::kServerCounters);
        j["vfio_user"]["last_error"] = st.last_error;
        j["dma_windows"] = e.proxy->dma_windows();
        holders = !e.server->fd_recipients().empty();
        j["interrupts"] = counters_json(e.proxy->interrupt_totals(), irq::kRouteCounters);
        j["msix"] = {{"vectors", e.proxy->msix().vectors()},
                     {"enabled", e.proxy->msix().enabled()},
                     {"function_masked", e.proxy->msix().function_masked()},
                     {"vfio_enabled_vectors", e.proxy->vfio_enabled_vectors()},
                     {"vfio_reenables", e.proxy->vfio_reenables()}};
      });
      if (holders) j["device_fd_holders"] = surveyed_holders(e.vf);
    }
    out.push_back(std::move(j));
  }
  return out;
}

// The counters come from the stats structs themselves, by their tables
// (util/counters.hpp), not from the control views' JSON.
void VfExports::metrics(std::vector<MetricFamily>& out) const {
  Family connected("sriovd_export_connected", "1 while a VMM is connected to the VF's vfio-user export",
                   MetricType::Gauge);
  TypedCounters proto("sriovd_export", vfio_user::kServerCounters);
  TypedCounters irq("sriovd_export_interrupts", irq::kRouteCounters);
  for (const auto& e : exports_) {
    const std::vector<std::pair<std::string, std::string>> labels = {
        {"pf", e.pf.to_string()}, {"vf", std::to_string(e.index)}, {"device", e.vf}};
    if (!e.server) {
      connected.add(labels, 0);
      continue;
    }
    e.thread->call([&] {
      connected.add(labels, e.server->connected() ? 1 : 0);
      proto.add(labels, e.server->stats());
      irq.add(labels, e.proxy->interrupt_totals());
    });
  }
  out.push_back(std::move(connected.f));
  proto.into(out);
  irq.into(out);
}

}  // namespace sriovd::daemon
