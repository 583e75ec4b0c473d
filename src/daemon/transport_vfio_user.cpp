// virtio-pci over vfio-user: the device as a PCI function (vfio_user::
// VirtioPci, the whole device, control queue included) served to a VMM's
// vfio-user client (vfio_user::Server).

#include "sriovd/vfio_user/server.hpp"
#include "sriovd/vfio_user/virtio_pci.hpp"
#include "virtio_transport.hpp"

namespace sriovd::daemon {

namespace {

class VfioUserTransport final : public ServedTransport {
 public:
  explicit VfioUserTransport(TransportContext& ctx)
      : device_(ctx.device),
        pci_(ctx.device, ctx.engine, ctx.config.name),
        server_(ctx.handed
                    ? std::make_unique<vfio_user::Server>(ctx.thread.io(), ctx.config.socket, pci_,
                                                          ctx.config.access.allowed_uids, std::move(ctx.handed->server))
                    : std::make_unique<vfio_user::Server>(ctx.thread.io(), ctx.config.socket, pci_,
                                                          ctx.config.access.allowed_uids)) {
    server_->set_socket_access(access_of(ctx.config.access));
  }
  ~VfioUserTransport() override { server_.reset(); }  // the server uses the PCI function: it goes first

  [[nodiscard]] bool connected() const override { return server_->connected(); }
  [[nodiscard]] std::string state() const override {
    if (server_->connected()) return device_.running() ? "running" : "connected";
    return "listening";
  }
  void set_access(const config::SocketAccess& access) override {
    server_->set_allowed_uids(access.allowed_uids);
    server_->set_socket_access(access_of(access));
  }
  void config_changed() override { pci_.config_changed(); }

  void freeze(HandedVirtio& h) override {
    h.pci = true;
    h.server = server_->freeze_for_handover();
  }
  void thaw() override { server_->thaw(); }
  void handed_over() override { server_->handed_over(); }

  void describe(control::json& j) const override {
    const auto& st = server_->stats();
    j["vfio_user"] = counters_json(st, vfio_user::kServerCounters);
    j["vfio_user"]["last_error"] = st.last_error;
    // Live migration: the state the client set, the DMA log while one
    // runs, and what it missed (a write outside the ranges logged).
    if (const vfio_user::Migration* mig = server_->migration()) {
      control::json& m = j["vfio_user"]["migration"];
      m = counters_json(mig->stats(), vfio_user::kMigrationCounters);
      m["state"] = vfio_user::mig_state_name(static_cast<uint32_t>(mig->state()));
      m["dma_logging"] = mig->dma_log() != nullptr;
      m["dma_log_missed"] = mig->dma_log() ? mig->dma_log()->log().missed() : 0;
    }
  }
  [[nodiscard]] PeerCounters peer_counters() const override { return PeerCounters::of(server_->stats()); }
  void metrics(const Labels& labels, MetricSet& out) const override {
    const vfio_user::Migration* mig = server_->migration();
    if (!mig) return;
    out.counters("sriovd_vfio_user_migration", vfio_user::kMigrationCounters, labels, mig->stats());
    out.family("sriovd_vfio_user_dma_logging", "1 while the virtio-pci device logs its DMA writes for a live migration",
               prometheus::MetricType::Gauge)
        .add(labels, mig->dma_log() ? 1 : 0);
    out.family("sriovd_vfio_user_migration_state",
               "the device's live migration state (linux/vfio.h: 1 STOP, 2 RUNNING, 3 STOP_COPY, 4 RESUMING, 0 ERROR)",
               prometheus::MetricType::Gauge)
        .add(labels, static_cast<double>(mig->state()));
  }

 private:
  virtio::Device& device_;
  vfio_user::VirtioPci pci_;
  std::unique_ptr<vfio_user::Server> server_;
};

}  // namespace

std::unique_ptr<ServedTransport> make_vfio_user_transport(TransportContext& ctx) {
  return std::make_unique<VfioUserTransport>(ctx);
}

}  // namespace sriovd::daemon
