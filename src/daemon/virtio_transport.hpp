#pragma once
// The seam between a served virtio device and the way a driver reaches it.
// Each transport - vhost-user (a VMM's front-end), virtio-pci over
// vfio-user (a VMM's PCI client), VDUSE (the kernel's vDPA bus) - is one
// class behind ServedTransport, made by the factory its config value names
// (virtio_transport.cpp: one line each). VirtioExports owns a device and
// its transport and never asks which transport it holds; a transport sees
// the device only as a virtio::Device, so a new device type passes through
// every transport unchanged.
//
// A transport is made, called and deleted on its device's session thread
// (util/session_threads.hpp).

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <prometheus/metric_family.h>

#include "sriovd/config/config.hpp"
#include "sriovd/control/protocol.hpp"
#include "sriovd/irq/engine.hpp"
#include "sriovd/util/counters.hpp"
#include "sriovd/util/session_threads.hpp"
#include "sriovd/virtio/device.hpp"
#include "daemon_internal.hpp"
#include "handover.hpp"
#include "metrics.hpp"

namespace sriovd::daemon {

using Labels = std::vector<std::pair<std::string, std::string>>;

// Families by name, made as the transports first add to them, each listed
// once in the order first added (the exposition format wants a family's
// samples together).
class MetricSet {
 public:
  Family& family(const std::string& name, const std::string& help, prometheus::MetricType type);
  template <typename T, size_t N>
  void counters(const std::string& prefix, const Counter<T> (&table)[N], const Labels& labels, const T& value) {
    for (const Counter<T>& c : table)
      family(prefix + "_" + c.name + "_total", c.help, prometheus::MetricType::Counter)
          .add(labels, static_cast<double>(value.*c.field));
  }
  void into(std::vector<prometheus::MetricFamily>& out);

 private:
  std::vector<Family> families_;  // a dozen at most: searched in order
};

// What a transport is made from.
struct TransportContext {
  SessionThread& thread;  // the device's session thread, where this runs
  const config::VirtioDevice& config;
  virtio::Device& device;  // outlives the transport
  irq::Engine& engine;
  const std::string& state_dir;
  HandedVirtio* handed = nullptr;  // the predecessor's part of this device (an upgrade), or null
};

class ServedTransport {
 public:
  virtual ~ServedTransport() = default;

  // A driver (VMM or kernel) holds the device.
  [[nodiscard]] virtual bool connected() const = 0;
  // For `devices`: "running", "connected", "listening", "connecting", ...
  [[nodiscard]] virtual std::string state() const = 0;
  // A reload's access for the device's socket (a transport without one
  // ignores it).
  virtual void set_access(const config::SocketAccess& access) = 0;
  // The device's configuration space changed (its link): the driver is told.
  virtual void config_changed() = 0;

  // An upgrade in place (handover.hpp): this transport's part into `h`, the
  // device frozen; throws HandoverRefused naming why it cannot be handed now.
  virtual void freeze(HandedVirtio& h) = 0;
  virtual void thaw() = 0;
  virtual void handed_over() = 0;

  // Its part of the device's entry in `devices`, and of the metrics.
  virtual void describe(control::json& j) const = 0;
  [[nodiscard]] virtual PeerCounters peer_counters() const = 0;
  virtual void metrics(const Labels& labels, MetricSet& out) const = 0;
};

// What a transport asks of the device it serves, before the device is made.
struct TransportTraits {
  // The device serves its control queue itself (virtio-pci: sriovd is the
  // whole device); else the driver's side handles it (a vhost-user
  // front-end) or the transport has none (VDUSE).
  bool control_queue = false;
  // Without control_queue: the driver's side has one (vhost-user) or there
  // is none (VDUSE).
  bool front_end_control = true;
  // Every address in the rings is an IOVA (VIRTIO_F_ACCESS_PLATFORM is
  // offered whatever the config says).
  bool access_platform = false;
};
TransportTraits transport_traits(config::Transport kind);

// The transport `ctx.config.transport` names, serving `ctx.device`. Throws
// std::runtime_error naming what stops it (a socket it cannot make, a
// kernel without the transport).
std::unique_ptr<ServedTransport> make_transport(TransportContext& ctx);

// What a crashed run of this instance left in the kernel (a transport's
// journal in `state_dir` names it), removed; logged, never thrown.
void remove_transport_left_overs(const std::string& state_dir);

// The transport a predecessor's handed part belongs to.
config::Transport handed_transport(const HandedVirtio& h);

}  // namespace sriovd::daemon
