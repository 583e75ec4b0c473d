// VDUSE: the device on the kernel's vDPA bus (vduse::Backend), driven by
// the kernel itself - virtio_vdpa makes it a host netdev, vhost_vdpa a
// /dev/vhost-vdpa-N for a VMM.

#include <spdlog/spdlog.h>

#include "sriovd/vduse/backend.hpp"
#include "virtio_transport.hpp"

namespace sriovd::daemon {

namespace {

class VduseTransport final : public ServedTransport {
 public:
  explicit VduseTransport(TransportContext& ctx)
      : device_(ctx.device),
        backend_(ctx.thread.io(), ctx.config.name, ctx.device, ctx.engine,
                 ctx.config.bind == config::VduseBind::netdev ? vduse::Bind::netdev : vduse::Bind::vhost_vdpa,
                 journal(ctx.state_dir)) {}

  static std::string journal(const std::string& state_dir) { return state_dir + "/vduse-devices"; }

  [[nodiscard]] bool connected() const override { return backend_.driver_ok(); }
  [[nodiscard]] std::string state() const override {
    if (backend_.driver_ok()) return device_.running() ? "running" : "connected";
    return "bound";  // on the bus, its driver has not started it (a vhost-vdpa device without a VMM)
  }
  void set_access(const config::SocketAccess& /*access*/) override {}  // no socket
  void config_changed() override { backend_.config_changed(); }

  void freeze(HandedVirtio& /*h*/) override {
    throw HandoverRefused("a VDUSE device is not handed over (the kernel's driver would see it reset)");
  }
  void thaw() override {}
  void handed_over() override {}

  void describe(control::json& j) const override {
    j["vduse"] = counters_json(backend_.stats(), vduse::kBackendCounters);
    j["vduse"]["last_error"] = backend_.stats().last_error;
    j["vduse"]["driver"] = vduse::driver_name(backend_.bind());
    j["vduse"]["status"] = backend_.status();
    if (backend_.bind() == vduse::Bind::netdev)
      j["vduse"]["netdev"] = backend_.kernel_device();
    else
      j["vduse"]["vhost_vdpa"] = backend_.kernel_device();
  }
  [[nodiscard]] PeerCounters peer_counters() const override {
    // A driver's start is what a connection is to the socket transports
    // (a counter: it never goes down); a failed request what a malformed
    // message is.
    return {backend_.stats().starts, backend_.stats().requests, backend_.stats().failed_requests, 0};
  }
  void metrics(const Labels& labels, MetricSet& out) const override {
    out.counters("sriovd_vduse", vduse::kBackendCounters, labels, backend_.stats());
  }

 private:
  virtio::Device& device_;
  vduse::Backend backend_;
};

}  // namespace

std::unique_ptr<ServedTransport> make_vduse_transport(TransportContext& ctx) {
  return std::make_unique<VduseTransport>(ctx);
}

// VDUSE devices a crashed run made (its journal names them): off the vDPA
// bus and destroyed; the devices configured now make theirs anew.
void remove_vduse_left_overs(const std::string& state_dir) {
  try {
    for (const auto& gone : vduse::Backend::remove_left_over(VduseTransport::journal(state_dir), {}))
      spdlog::warn("virtio: removed VDUSE device {} left by an earlier run", gone);
  } catch (const std::exception& ex) {
    spdlog::error("virtio: looking for VDUSE devices left by an earlier run: {}", ex.what());
  }
}

}  // namespace sriovd::daemon
