// vhost-user: the device's queues served to a VMM's front-end over a unix
// socket (vhost_user::Backend).

#include "sriovd/vhost_user/backend.hpp"
#include "virtio_transport.hpp"

namespace sriovd::daemon {

namespace {

class VhostUserTransport final : public ServedTransport {
 public:
  explicit VhostUserTransport(TransportContext& ctx)
      : device_(ctx.device),
        client_mode_(ctx.config.socket_mode == config::SocketMode::client),
        backend_(ctx.thread.io(), ctx.config.socket, ctx.device, ctx.engine,
                 client_mode_ ? vhost_user::Backend::Mode::client : vhost_user::Backend::Mode::server,
                 ctx.config.access.allowed_uids,
                 ctx.handed ? std::move(ctx.handed->backend) : vhost_user::BackendHandover()) {
    backend_.set_socket_access(access_of(ctx.config.access));
  }

  [[nodiscard]] bool connected() const override { return backend_.connected(); }
  [[nodiscard]] std::string state() const override {
    if (backend_.connected()) return device_.running() ? "running" : "connected";
    return client_mode_ ? "connecting" : "listening";
  }
  void set_access(const config::SocketAccess& access) override {
    backend_.set_allowed_uids(access.allowed_uids);
    backend_.set_socket_access(access_of(access));
  }
  void config_changed() override { backend_.config_changed(); }

  void freeze(HandedVirtio& h) override {
    h.pci = false;
    h.backend = backend_.freeze_for_handover();
  }
  void thaw() override { backend_.thaw(); }
  void handed_over() override { backend_.handed_over(); }

  void describe(control::json& j) const override {
    j["socket_mode"] = client_mode_ ? "client" : "server";
    j["vhost_user"] = counters_json(backend_.stats(), vhost_user::kBackendCounters);
    j["vhost_user"]["last_error"] = backend_.stats().last_error;
    // Live migration: the log while one runs, and what it missed (a write
    // past a log the front-end sized too small).
    j["vhost_user"]["migration"] = counters_json(backend_.stats(), vhost_user::kMigrationCounters);
    j["vhost_user"]["migration"]["logging"] = backend_.logging();
    j["vhost_user"]["migration"]["log_bytes"] = backend_.log_bytes();
    j["vhost_user"]["migration"]["log_missed"] = backend_.log_missed();
  }
  [[nodiscard]] PeerCounters peer_counters() const override { return PeerCounters::of(backend_.stats()); }
  void metrics(const Labels& labels, MetricSet& out) const override {
    out.counters("sriovd_vhost_user", vhost_user::kMigrationCounters, labels, backend_.stats());
    out.family("sriovd_vhost_user_logging", "1 while the device logs its writes for a live migration",
               prometheus::MetricType::Gauge)
        .add(labels, backend_.logging() ? 1 : 0);
  }

 private:
  virtio::Device& device_;
  bool client_mode_;
  vhost_user::Backend backend_;
};

}  // namespace

std::unique_ptr<ServedTransport> make_vhost_user_transport(TransportContext& ctx) {
  return std::make_unique<VhostUserTransport>(ctx);
}

}  // namespace sriovd::daemon
