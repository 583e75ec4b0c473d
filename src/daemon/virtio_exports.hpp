#pragma once
// The owner of the virtio exports (config virtio_devices): for each, the
// device, its transport (virtio_transport.hpp) and its port (a tap, or a VF's netdev through AF_PACKET,
// a macvtap or AF_XDP), made by the factories below; started, stopped and
// restarted as the config and the host change, shown in `devices` and in
// Prometheus. On the control thread, as the daemon that owns it; each
// device and its transport live on the session thread it is given (made,
// served and deleted there: util/session_threads.hpp).

#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include <prometheus/metric_family.h>

#include "sriovd/config/config.hpp"
#include "sriovd/control/protocol.hpp"
#include "sriovd/irq/engine.hpp"
#include "sriovd/util/asio.hpp"
#include "sriovd/util/retirer.hpp"
#include "sriovd/util/session_threads.hpp"
#include "sriovd/virtio/net.hpp"
#include "handover.hpp"
#include "virtio_transport.hpp"

namespace sriovd::daemon {

class HostService;

class VirtioExports {
 public:
  // `retirer` closes the ports of stopped devices off the control thread;
  // `host` names a VF's netdev. All of them outlive this.
  VirtioExports(SessionPool& sessions, irq::Engine& engine, Retirer& retirer, HostService& host);
  ~VirtioExports();
  VirtioExports(const VirtioExports&) = delete;
  VirtioExports& operator=(const VirtioExports&) = delete;

  // Macvtap links and XDP programs a crashed run of this instance left.
  static void remove_left_over(const std::string& state_dir, const std::vector<std::string>& keep = {});
  // Serves every device `cfg` asks for that is not running, over vhost-user
  // or as virtio-net-pci over vfio-user; gives the running ones the
  // config's socket access. A device that cannot be served says why in
  // `devices`; it does not stop the others.
  void start(const config::Config& cfg);
  // Stops the devices `next` no longer has or has with other settings (all
  // of them when next is null) and forgets those not served (the next
  // start() tries them again). Their ports are closed by the retirer, or
  // kept for the device that replaces them (the same tap).
  void drop(const config::Config* next);
  // The devices waiting for the port `key` to be closed, started (posted
  // by the retirer).
  void start_waiting_for(const std::string& key, const config::Config& cfg);
  // Before the host changes a VF: the sockets and macvtaps on VF netdevs
  // that the retirer still closes are closed.
  void wait_for_vf_ports();
  // A device bridged to a VF whose netdev was re-created (its driver
  // rebound: a new ifindex), went or came is restarted on the netdev as it
  // is now.
  void follow_vf_netdevs(const config::Config& cfg);
  // Each device's link follows its port's carrier (a configuration change
  // for the driver when it changes).
  void poll_links();

  // An upgrade in place (handover.hpp). freeze_for_handover(): every
  // served device (vhost-user or virtio-pci over vfio-user) is frozen and
  // its part returned; a device that cannot be handed over now throws
  // HandoverRefused naming it, with every device serving again - or with
  // `force`, is left out, named in `cut` (its client's connection ends with
  // this sriovd; the successor serves it afresh).
  // thaw(): the handover did not happen. handed_over(): it did.
  std::vector<HandedVirtio> freeze_for_handover(bool force, std::vector<std::string>& cut);
  void thaw();
  void handed_over();
  // The successor's: what start() takes over instead of making anew (a
  // device the config no longer has, or has otherwise, is not taken: its
  // fds are closed and its front-end sees the connection end).
  void take_handover(std::vector<HandedVirtio> handed) { handed_ = std::move(handed); }

  // The `virtio_devices` of `devices`, in config order.
  [[nodiscard]] control::json devices_json(const config::Config& cfg) const;
  void metrics(std::vector<prometheus::MetricFamily>& out) const;

 private:
  // One per configured virtio device, in config order.
  struct Export {
    std::string name;
    config::VirtioDevice config;  // what it was started from
    // The session thread that serves it (declared first: it outlives the
    // objects below, which it makes, serves and deletes).
    SessionPool::Lease thread;
    // The device its config's type made (the device factory, below), and
    // the same device as a network device when it is one - what its port
    // is reached through (null for another type).
    OnSession<virtio::Device> device;
    virtio::NetDevice* net = nullptr;
    // How its driver reaches it (virtio_transport.hpp); null: not served.
    OnSession<ServedTransport> transport;
    std::string not_served;  // why it is not served, when it is not
    // The netdev its port holds ("tap:NAME", "vf:NETDEV"): the Retirer's key.
    std::string port_key;
    // Not served while the port of the device it replaces is being closed
    // (port_key): started when that is done.
    bool waiting = false;
    // backend: vf - the VF's netdev the port was opened on (name, ifindex;
    // 0: none), to see it re-created under the port (follow_vf_netdevs).
    std::string vf_netdev;
    unsigned vf_ifindex = 0;
    bool handed = false;  // frozen for a handover
  };
  // The device factory: one entry per config::VirtioType (virtio_exports.cpp's
  // kDevices), each making its device on e.thread (leased by then) from the
  // config, what the transport asks of it, and the predecessor's part.
  using DeviceMaker = void (VirtioExports::*)(const config::VirtioDevice& dev, const TransportTraits& traits, Export& e,
                                              const std::string& state_dir, HandedVirtio* handed);
  void make_device(const config::VirtioDevice& dev, Export& e, const std::string& state_dir, HandedVirtio* handed);
  // type: net - a virtio::NetDevice on the port open_port gives it.
  void make_net_device(const config::VirtioDevice& dev, const TransportTraits& traits, Export& e,
                       const std::string& state_dir, HandedVirtio* handed);
  // The port factory: the device's spare tap, or a new port once the
  // previous holder of its netdev is closed; sets what the port decides of
  // the device (offloads, the VF's MAC).
  std::unique_ptr<virtio::PacketPort> open_port(const config::VirtioDevice& dev, Export& e, virtio::NetConfig& nc,
                                                const std::string& state_dir, HandedVirtio* handed = nullptr);
  // Its transport, made by the factory its config names.
  void serve(const config::VirtioDevice& dev, Export& e, const std::string& state_dir, HandedVirtio* handed = nullptr);
  void update_access(Export& e, const config::SocketAccess& access);
  // A served device's part of `devices` (on its session thread).
  static void served_json(const Export& e, control::json& j);

  SessionPool& sessions_;
  irq::Engine& engine_;
  Retirer& retirer_;
  HostService& host_;
  std::vector<Export> exports_;
  // A changed device's tap, kept for the device that replaces it when the
  // tap's settings are the same (name, namespace, queues): the tap, its
  // addresses and its bridge stay; by device name, until start().
  std::map<std::string, std::unique_ptr<virtio::PacketPort>> spare_taps_;
  // Handed over by the predecessor, until start() takes them.
  std::vector<HandedVirtio> handed_;
  // The handed part of `dev`, if there is one that fits it.
  std::optional<HandedVirtio> take_handed(const config::VirtioDevice& dev);
};

}  // namespace sriovd::daemon
