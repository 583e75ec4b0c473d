#include "virtio_transport.hpp"

#include <stdexcept>

namespace sriovd::daemon {

Family& MetricSet::family(const std::string& name, const std::string& help, prometheus::MetricType type) {
  for (Family& f : families_)
    if (f.f.name == name) return f;
  return families_.emplace_back(name, help, type);
}

void MetricSet::into(std::vector<prometheus::MetricFamily>& out) {
  for (Family& f : families_) out.push_back(std::move(f.f));
  families_.clear();
}

// Each transport's factory (and what cleans up after a crashed run of it),
// in its own file.
std::unique_ptr<ServedTransport> make_vhost_user_transport(TransportContext& ctx);
std::unique_ptr<ServedTransport> make_vfio_user_transport(TransportContext& ctx);
std::unique_ptr<ServedTransport> make_vduse_transport(TransportContext& ctx);
void remove_vduse_left_overs(const std::string& state_dir);

namespace {

// The registry: one line per transport.
constexpr struct {
  config::Transport kind;
  std::unique_ptr<ServedTransport> (*make)(TransportContext&);
  TransportTraits traits;
  void (*remove_left_overs)(const std::string& state_dir) = nullptr;
} kTransports[] = {
    {config::Transport::vhost_user,
     make_vhost_user_transport,
     {.control_queue = false, .front_end_control = true, .access_platform = false}},
    {config::Transport::vfio_user,
     make_vfio_user_transport,
     {.control_queue = true, .front_end_control = false, .access_platform = false}},
    {config::Transport::vduse,
     make_vduse_transport,
     {.control_queue = false, .front_end_control = false, .access_platform = true},
     remove_vduse_left_overs},
};

}  // namespace

std::unique_ptr<ServedTransport> make_transport(TransportContext& ctx) {
  for (const auto& t : kTransports)
    if (t.kind == ctx.config.transport) return t.make(ctx);
  throw std::runtime_error(std::string("transport ") + config::to_string(ctx.config.transport) +
                           " is not served by this build");
}

TransportTraits transport_traits(config::Transport kind) {
  for (const auto& t : kTransports)
    if (t.kind == kind) return t.traits;
  return {};
}

void remove_transport_left_overs(const std::string& state_dir) {
  for (const auto& t : kTransports)
    if (t.remove_left_overs) t.remove_left_overs(state_dir);
}

config::Transport handed_transport(const HandedVirtio& h) {
  return h.pci ? config::Transport::vfio_user : config::Transport::vhost_user;
}

}  // namespace sriovd::daemon
