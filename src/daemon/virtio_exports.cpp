#include "virtio_exports.hpp"

#include <net/if.h>

#include <algorithm>
#include <chrono>
#include <typeinfo>
#include <variant>

#include <spdlog/spdlog.h>

#include "daemon_internal.hpp"
#include "host_service.hpp"
#include "metrics.hpp"
#include "sriovd/ports/macvtap.hpp"
#include "sriovd/ports/netdev.hpp"
#include "sriovd/ports/packet_socket.hpp"
#include "sriovd/ports/tap.hpp"
#include "sriovd/ports/xdp_socket.hpp"

namespace sriovd::daemon {

using control::json;
using prometheus::MetricFamily;
using prometheus::MetricType;

namespace {

// Per-queue counters of a virtio device, as sriovctl shows them.
json queue_stats(const virtio::Device& device) {
  const virtio::DeviceStats stats = device.stats();
  json queues = json::array();
  for (unsigned q = 0; q < stats.queues.size(); ++q) {
    json j = counters_json(stats.queues[q], virtio::kQueueCounters);
    j["queue"] = q;
    queues.push_back(std::move(j));
  }
  return queues;
}

}  // namespace

VirtioExports::VirtioExports(SessionPool& sessions, irq::Engine& engine, Retirer& retirer, HostService& host)
    : sessions_(sessions), engine_(engine), retirer_(retirer), host_(host) {}

VirtioExports::~VirtioExports() { drop(nullptr); }

void VirtioExports::remove_left_over(const std::string& state_dir, const std::vector<std::string>& keep) {
  // Macvtap links a crashed run of this instance left behind (each carries
  // its owner in its alias); the devices configured now make theirs anew,
  // those handed over by an upgrade keep theirs.
  try {
    for (const auto& gone : ports::Macvtap::remove_left_over(state_dir, keep))
      spdlog::warn("virtio: deleted macvtap {} left by an earlier run", gone);
  } catch (const std::exception& ex) {
    spdlog::error("virtio: looking for macvtap links left by an earlier run: {}", ex.what());
  }
  // What the transports made in the kernel (VDUSE devices), by their own
  // journals.
  remove_transport_left_overs(state_dir);
  // XDP programs it left on VF netdevs (each names its owner in a map).
  try {
    for (const auto& gone : ports::XdpSocket::remove_left_over(state_dir))
      spdlog::warn("virtio: removed the XDP program an earlier run left on {}", gone);
  } catch (const std::exception& ex) {
    spdlog::error("virtio: looking for XDP programs left by an earlier run: {}", ex.what());
  }
}

void VirtioExports::drop(const config::Config* next) {
  std::vector<Export> kept;
  for (auto& e : exports_) {
    const bool served = e.transport != nullptr;
    const bool keep = next && served &&
                      std::any_of(next->virtio_devices.begin(), next->virtio_devices.end(),
                                  [&](const config::VirtioDevice& d) { return d.same_settings(e.config); });
    if (keep) {
      kept.push_back(std::move(e));
      continue;
    }
    // A device that could not be served is tried again by start_virtio.
    if (served)
      spdlog::info("virtio {}: stopped ({})", e.name, next ? "changed or removed by the reload" : "shutting down");
    // Users before what they use: the transport holds the device (a
    // moved-over element would drop the device first).
    e.transport.reset();
    std::unique_ptr<virtio::PacketPort> port = e.net ? e.thread->call([&] { return e.net->release_port(); }) : nullptr;
    e.net = nullptr;
    e.device.reset();
    e.thread.reset();
    if (!port) continue;
    // The same tap for the device that replaces this one: nothing to close.
    const auto& c = e.config;
    const auto takes_this_tap = [&](const config::VirtioDevice& d) {
      return d.name == c.name && d.backend_kind == config::BackendKind::tap &&
             c.backend_kind == config::BackendKind::tap && d.tap.name == c.tap.name && d.tap.netns == c.tap.netns &&
             d.queue_pairs == c.queue_pairs;
    };
    const bool same_tap = next && std::any_of(next->virtio_devices.begin(), next->virtio_devices.end(), takes_this_tap);
    if (same_tap)
      spare_taps_[e.name] = std::move(port);
    else
      retirer_.retire(e.port_key, std::move(port));
  }
  exports_ = std::move(kept);
}

void VirtioExports::start_waiting_for(const std::string& key, const config::Config& cfg) {
  const auto waited = std::erase_if(exports_, [&](const Export& e) { return e.waiting && e.port_key == key; });
  if (waited != 0) start(cfg);
}

void VirtioExports::wait_for_vf_ports() {
  if (!retirer_.wait_gone("vf:", std::chrono::seconds(10), true))
    spdlog::error("virtio: a VF netdev's socket or macvtap is still being closed after 10 s; going on");
}

void VirtioExports::start(const config::Config& cfg) {
  for (const auto& dev : cfg.virtio_devices) {
    if (auto running =
            std::find_if(exports_.begin(), exports_.end(), [&](const Export& e) { return e.name == dev.name; });
        running != exports_.end()) {
      update_access(*running, dev.access);
      continue;
    }
    Export e;
    e.name = dev.name;
    e.config = dev;
    {
      try {
        std::optional<HandedVirtio> handed = take_handed(dev);
        make_device(dev, e, cfg.state_dir, handed ? &*handed : nullptr);
        if (handed) {
          try {
            serve(dev, e, cfg.state_dir, &*handed);
            spdlog::info("virtio {}: taken over from the previous sriovd", dev.name);
          } catch (const std::exception& ex) {
            spdlog::error("virtio {}: the handover did not fit ({}); served afresh", dev.name, ex.what());
            e.transport.reset();
            e.thread->call([&] { e.device->reset(); });  // whatever of the state was restored
            serve(dev, e, cfg.state_dir);
          }
        } else {
          serve(dev, e, cfg.state_dir);
        }
      } catch (const std::exception& ex) {
        e.transport.reset();
        e.net = nullptr;
        e.device.reset();
        e.thread.reset();
        e.not_served = ex.what();
        spdlog::error("virtio {}: not served: {}", dev.name, ex.what());
      }
    }
    exports_.push_back(std::move(e));
  }
  for (auto& [name, tap] : spare_taps_) {
    // The name first: an argument's initialisation order is unspecified,
    // and a by-value parameter made from std::move(tap) would empty it.
    const std::string what = "tap:" + tap->name();
    retirer_.retire(what, std::move(tap));
  }
  spare_taps_.clear();
  for (const HandedVirtio& h : handed_)
    spdlog::warn("virtio {}: handed over but not in the config (or not served here): its front-end is let go", h.name);
  handed_.clear();
}

void VirtioExports::make_device(const config::VirtioDevice& dev, Export& e, const std::string& state_dir,
                                HandedVirtio* handed) {
  // The device factory's table: one line per device type.
  static constexpr struct {
    config::VirtioType type;
    DeviceMaker make;
  } kDevices[] = {
      {config::VirtioType::net, &VirtioExports::make_net_device},
  };
  for (const auto& t : kDevices)
    if (t.type == dev.type) return (this->*t.make)(dev, transport_traits(dev.transport), e, state_dir, handed);
  throw std::runtime_error(std::string("device type ") + config::to_string(dev.type) + " is not made by this build");
}

void VirtioExports::make_net_device(const config::VirtioDevice& dev, const TransportTraits& traits, Export& e,
                                    const std::string& state_dir, HandedVirtio* handed) {
  virtio::NetConfig nc;
  nc.name = dev.name;
  nc.mac = dev.mac;
  nc.mtu = dev.mtu;
  nc.queue_pairs = dev.queue_pairs;
  nc.max_queue_size = std::max<uint16_t>(dev.queue_size, 1024);
  nc.packed = dev.packed != config::PackedRing::off;
  nc.control_queue = traits.control_queue;
  nc.front_end_control = traits.front_end_control;
  nc.access_platform = dev.iommu_platform || traits.access_platform;
  nc.cpus.assign(dev.cpus.begin(), dev.cpus.end());
  const auto& o = dev.tap.offloads;
  nc.offloads = o.csum;
  nc.tap_offloads = ports::tun_offload_flags(o.csum, o.tso4, o.tso6, o.tso_ecn, o.ufo);
  std::unique_ptr<virtio::PacketPort> port = open_port(dev, e, nc, state_dir, handed);
  e.thread = sessions_.lease();
  OnSession<virtio::NetDevice> net =
      make_on_session(*e.thread, [&] { return std::make_unique<virtio::NetDevice>(nc, engine_, std::move(port)); });
  e.net = net.get();
  e.device = OnSession<virtio::Device>(net.release(), SessionDeleter{&*e.thread});
}

std::optional<HandedVirtio> VirtioExports::take_handed(const config::VirtioDevice& dev) {
  const auto it =
      std::find_if(handed_.begin(), handed_.end(), [&](const HandedVirtio& h) { return h.name == dev.name; });
  if (it == handed_.end()) return std::nullopt;
  HandedVirtio h = std::move(*it);
  handed_.erase(it);
  const bool port_fits = h.tap_fds.empty() ||
                         (h.macvtap_lower.empty()
                              ? dev.backend_kind == config::BackendKind::tap && h.tap == dev.tap.name
                              : dev.backend_kind == config::BackendKind::vf && dev.vf.via == config::VfAttach::macvtap);
  const bool fits = handed_transport(h) == dev.transport && h.socket == dev.socket && port_fits;
  if (!fits) {
    spdlog::warn("virtio {}: the config changed how it is served since the handover: served afresh", dev.name);
    return std::nullopt;
  }
  return h;
}

std::vector<HandedVirtio> VirtioExports::freeze_for_handover(bool force, std::vector<std::string>& cut) {
  std::vector<HandedVirtio> out;
  try {
    for (auto& e : exports_) {
      if (!e.transport) continue;
      HandedVirtio h;
      h.name = e.name;
      h.socket = e.config.socket;
      const bool frozen = e.thread->call([&] {
        try {
          e.transport->freeze(h);
        } catch (const HandoverRefused& ex) {
          const std::string why = "virtio device " + e.name + ": " + ex.what();
          if (!force) throw HandoverRefused(why);
          cut.push_back(why);  // served afresh by the successor
          return false;
        }
        // A tap goes with its device (its addresses and bridges stay), a
        // macvtap too (its link stays); other ports are opened anew.
        if (!e.net) return true;
        const virtio::PacketPort& port = e.net->port();
        if (const auto* tap = dynamic_cast<const ports::Tap*>(&port)) {
          const auto* macvtap = dynamic_cast<const ports::Macvtap*>(&port);
          if (macvtap || typeid(port) == typeid(ports::Tap)) {
            h.tap = tap->name();
            if (macvtap) h.macvtap_lower = macvtap->lower();
            for (unsigned q = 0; q < tap->queues(); ++q) h.tap_fds.push_back(dup_fd(tap->fd(q), "a tap queue"));
          }
        }
        return true;
      });
      if (!frozen) continue;
      e.handed = true;
      out.push_back(std::move(h));
    }
  } catch (...) {
    thaw();
    throw;
  }
  return out;
}

void VirtioExports::thaw() {
  for (auto& e : exports_) {
    e.handed = false;
    if (e.transport) e.thread->call([&] { e.transport->thaw(); });
  }
}

void VirtioExports::handed_over() {
  for (auto& e : exports_) {
    if (!e.handed) continue;
    e.thread->call([&] {
      e.transport->handed_over();
      if (e.net) e.net->port().keep_for_successor();
    });
  }
}

namespace {
// How long a device's start waits for the previous holder of its netdev to
// be closed; past it, the device says so and starts when that is done.
constexpr std::chrono::milliseconds kPortCloseWait{200};
}  // namespace

std::unique_ptr<virtio::PacketPort> VirtioExports::open_port(const config::VirtioDevice& dev, Export& e,
                                                             virtio::NetConfig& nc, const std::string& state_dir,
                                                             HandedVirtio* handed) {
  // The predecessor's tap or macvtap, handed over with the device.
  const bool adopt = handed && !handed->tap_fds.empty();
  const auto wait_for_previous = [&] {
    if (retirer_.wait_gone(e.port_key, kPortCloseWait)) return;
    e.waiting = true;
    throw std::runtime_error("the device that held " + e.port_key +
                             " before is still being closed; it starts when that is done");
  };
  if (dev.backend_kind == config::BackendKind::tap) {
    e.port_key = "tap:" + dev.tap.name;
    // Its offloads stay as they were until the new driver's features set
    // them, before any packet moves.
    if (adopt) return ports::Tap::adopt(dev.tap.name, std::move(handed->tap_fds));
    if (auto spare = spare_taps_.extract(dev.name)) return std::move(spare.mapped());
    wait_for_previous();
    return std::make_unique<ports::Tap>(dev.tap.name, dev.queue_pairs, dev.tap.netns);
  }
  // The VF-to-virtio bridge: the VF's own netdev through AF_PACKET.
  // AF_PACKET with virtio-net headers carries checksum and GSO metadata
  // both ways: TSO segments go out whole, and what the driver cannot take
  // is cut in software (virtio/offload.hpp).
  nc.offloads = true;
  const std::string netdev = host_.vf_netdev(dev.vf.pf, dev.vf.vf);
  e.port_key = "vf:" + netdev;
  wait_for_previous();
  // The VF's netdev carries the guest's frames: it must be up (sriovd's
  // udev rule keeps network managers off it), and the guest speaks with its
  // MAC unless the config gave one (which the host layer set on the VF).
  e.vf_netdev = netdev;
  e.vf_ifindex = ::if_nametoindex(netdev.c_str());
  ports::netdev_set_up(netdev);
  if (!nc.mac) {
    MacAddress mac;
    if (ports::netdev_address(netdev, mac.octets) && !mac.is_zero() && !mac.is_multicast()) nc.mac = mac;
  }
  if (dev.vf.via == config::VfAttach::macvtap) {
    // A macvtap is a tap: the kernel segments and checksums what the
    // driver cannot take (TUNSETOFFLOAD follows its features).
    nc.tap_offloads = ports::tun_offload_flags(true, true, true, false, false);
    if (adopt && handed->macvtap_lower == netdev)
      return ports::Macvtap::adopt(netdev, handed->tap, std::move(handed->tap_fds));
    return std::make_unique<ports::Macvtap>(netdev, state_dir, dev.name, dev.queue_pairs);
  }
  if (dev.vf.via == config::VfAttach::af_xdp) {
    // AF_XDP carries no checksum or GSO metadata: the driver checksums and
    // segments itself.
    nc.offloads = false;
    nc.tap_offloads = 0;
    return std::make_unique<ports::XdpSocket>(netdev, dev.queue_pairs, dev.mtu, state_dir, dev.name);
  }
  const auto ring = dev.vf.ring == config::PacketRingMode::v3   ? ports::PacketRing::v3
                    : dev.vf.ring == config::PacketRingMode::v2 ? ports::PacketRing::v2
                                                                : ports::PacketRing::off;
  return std::make_unique<ports::PacketSocket>(netdev, dev.queue_pairs, ring, dev.mtu);
}

void VirtioExports::serve(const config::VirtioDevice& dev, Export& e, const std::string& state_dir,
                          HandedVirtio* handed) {
  SessionThread& t = *e.thread;
  TransportContext ctx{t, dev, *e.device, engine_, state_dir, handed};
  e.transport = make_on_session(t, [&] { return make_transport(ctx); });
}

// A reload's socket access for a device that keeps running.
void VirtioExports::update_access(Export& e, const config::SocketAccess& access) {
  e.config.access = access;
  try {
    if (e.transport) e.thread->call([&] { e.transport->set_access(access); });
  } catch (const std::exception& ex) {
    spdlog::error("virtio {}: {}", e.name, ex.what());
  }
}

void VirtioExports::follow_vf_netdevs(const config::Config& cfg) {
  std::vector<std::string> restart;
  for (const auto& e : exports_) {
    if (e.config.backend_kind != config::BackendKind::vf || e.waiting) continue;
    std::string name;
    unsigned ifindex = 0;
    try {
      name = host_.vf_netdev(e.config.vf.pf, e.config.vf.vf);
      ifindex = ::if_nametoindex(name.c_str());
    } catch (const std::exception&) {
      // No netdev now (its driver unbound): the device stops, saying why.
    }
    // The same netdev as when the device (or its last try) opened it.
    if (name == e.vf_netdev && ifindex == e.vf_ifindex) continue;
    if (!e.device && ifindex == 0) continue;  // not served, and still nothing to serve on
    spdlog::warn("virtio {}: its VF's netdev {} ({} {}): restarting the device on it", e.name,
                 ifindex == 0 ? "is gone" : "was re-created",
                 e.vf_netdev.empty() ? std::string("none") : e.vf_netdev + " #" + std::to_string(e.vf_ifindex),
                 ifindex == 0 ? std::string("-> none") : "-> " + name + " #" + std::to_string(ifindex));
    restart.push_back(e.name);
  }
  if (restart.empty()) return;
  config::Config next = cfg;
  std::erase_if(next.virtio_devices, [&](const config::VirtioDevice& d) {
    return std::find(restart.begin(), restart.end(), d.name) != restart.end();
  });
  drop(&next);
  start(cfg);
}

// Posted, not waited for: the housekeeping tick never waits on a session
// thread. The objects outlive the handler: their deletion is posted to the
// same thread after it.
void VirtioExports::poll_links() {
  for (auto& e : exports_) {
    if (!e.net) continue;  // a network device's link: its port's carrier
    asio::post(e.thread->io(), [name = e.name, device = e.net, transport = e.transport.get()] {
      if (!device->poll_link()) return;
      spdlog::info("virtio {}: link {}", name, device->link_up() ? "up" : "down");
      if (transport) transport->config_changed();
    });
  }
}

json VirtioExports::devices_json(const config::Config& cfg) const {
  json virtio = json::array();
  for (const auto& dev : cfg.virtio_devices) {
    json backend = {{"type", config::to_string(dev.backend_kind)}};
    if (dev.backend_kind == config::BackendKind::tap) {
      backend["name"] = dev.tap.name;
      if (!dev.tap.netns.empty()) backend["netns"] = dev.tap.netns;
    } else {
      backend["pf"] = dev.vf.pf.to_string();
      backend["vf"] = dev.vf.vf;
      backend["via"] = config::to_string(dev.vf.via);
    }
    for (const auto& e : exports_)
      if (e.name == dev.name && e.net) {
        if (e.vf_ifindex != 0) backend["ifindex"] = e.vf_ifindex;
        e.thread->call([&] {
          const virtio::PacketPort& port = e.net->port();
          backend["netdev"] = port.netdev();
          for (const auto& fact : port.describe())
            std::visit([&backend, &fact](const auto& v) { backend[fact.first] = v; }, fact.second);
        });
      }
    json j = {{"name", dev.name},
              {"type", config::to_string(dev.type)},
              {"transport", config::to_string(dev.transport)},
              {"socket", dev.socket},
              {"queue_pairs", dev.queue_pairs},
              {"queue_size", dev.queue_size},
              {"packed", config::to_string(dev.packed)},
              {"backend", backend}};
    for (const auto& e : exports_) {
      if (e.name != dev.name) continue;
      if (!e.transport) {
        j["state"] = "not served";
        j["reason"] = e.not_served;
        continue;
      }
      j["session_thread"] = e.thread->index();
      e.thread->call([&] { served_json(e, j); });
    }
    virtio.push_back(std::move(j));
  }
  return virtio;
}

// On the export's session thread.
void VirtioExports::served_json(const Export& e, json& j) {
  j["state"] = e.transport->state();
  j["features"] = e.device->features();
  j["needs_reset"] = e.device->broken();
  j["queues"] = queue_stats(*e.device);
  e.transport->describe(j);
}

void VirtioExports::metrics(std::vector<MetricFamily>& out) const {
  Family connected("sriovd_virtio_connected", "1 while the device's VMM (front-end or vfio-user client) is connected",
                   MetricType::Gauge);
  TypedCounters peer("sriovd_virtio", kPeerCounters);
  TypedCounters queues("sriovd_virtio_queue", virtio::kQueueCounters);
  MetricSet transports;  // each transport's own
  for (const auto& e : exports_) {
    if (!e.device || !e.transport) {
      connected.add({{"device", e.name}}, 0);
      continue;
    }
    e.thread->call([&] {
      const Labels labels{{"device", e.name}};
      connected.add(labels, e.transport->connected() ? 1 : 0);
      peer.add(labels, e.transport->peer_counters());
      e.transport->metrics(labels, transports);
      const virtio::DeviceStats stats = e.device->stats();
      for (unsigned q = 0; q < stats.queues.size(); ++q)
        queues.add({{"device", e.name}, {"queue", std::to_string(q)}}, stats.queues[q]);
    });
  }
  out.push_back(std::move(connected.f));
  peer.into(out);
  queues.into(out);
  transports.into(out);
}

}  // namespace sriovd::daemon
