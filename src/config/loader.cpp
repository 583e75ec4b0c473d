#include "sriovd/config/loader.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "loader_sections.hpp"

namespace sriovd::config {

const char* to_string(HostMode v) { return v == HostMode::system ? "system" : "simulated"; }
const char* to_string(LinkState v) {
  switch (v) {
    case LinkState::automatic: return "auto";
    case LinkState::enable: return "enable";
    case LinkState::disable: return "disable";
  }
  return "?";
}
const char* to_string(ExportKind v) { return v == ExportKind::none ? "none" : "vfio-user"; }
const char* to_string(MsixPolicy v) {
  switch (v) {
    case MsixPolicy::direct: return "direct";
    case MsixPolicy::relay: return "relay";
    case MsixPolicy::adaptive: return "adaptive";
  }
  return "?";
}

const char* to_string(BarAccess v) { return v == BarAccess::mmap ? "mmap" : "trapped"; }
const char* to_string(Transport v) {
  switch (v) {
    case Transport::vhost_user: return "vhost-user";
    case Transport::vfio_user: return "vfio-user";
    case Transport::vduse: return "vduse";
  }
  return "?";
}
const char* to_string(VduseBind v) { return v == VduseBind::netdev ? "netdev" : "vhost-vdpa"; }
const char* to_string(VirtioType v) {
  switch (v) {
    case VirtioType::net: return "net";
  }
  return "?";
}
const char* to_string(PackedRing v) {
  switch (v) {
    case PackedRing::off: return "off";
    case PackedRing::on: return "on";
    case PackedRing::automatic: return "auto";
  }
  return "?";
}
const char* to_string(BackendKind v) { return v == BackendKind::tap ? "tap" : "vf"; }
const char* to_string(PacketRingMode v) {
  switch (v) {
    case PacketRingMode::v3: return "v3";
    case PacketRingMode::v2: return "v2";
    case PacketRingMode::off: return "off";
  }
  return "?";
}
const char* to_string(VfAttach v) {
  switch (v) {
    case VfAttach::af_packet: return "af_packet";
    case VfAttach::macvtap: return "macvtap";
    case VfAttach::af_xdp: return "af_xdp";
  }
  return "?";
}
const char* to_string(SocketMode v) { return v == SocketMode::server ? "server" : "client"; }

std::string Diagnostic::to_string() const {
  if (line == 0) return file + ": " + message;
  return file + ":" + std::to_string(line) + ":" + std::to_string(column) + ": " + message;
}

namespace {

std::string join_diagnostics(const std::vector<Diagnostic>& diags) {
  std::string out;
  for (const auto& d : diags) {
    if (!out.empty()) out += '\n';
    out += d.to_string();
  }
  return out;
}

}  // namespace

ConfigError::ConfigError(std::vector<Diagnostic> diagnostics)
    : std::runtime_error(join_diagnostics(diagnostics)), diagnostics_(std::move(diagnostics)) {}

Config Loader::run(const YAML::Node& root) {
  Mapping top(ctx_, root, "",
              {"version", "host", "log_level", "state_dir", "simulated", "control", "physical_functions",
               "virtio_devices", "interrupts", "peer_limits", "metrics", "kubernetes"});
  if (!top.valid()) throw ConfigError(ctx_.take());

  if (auto v = top.unsigned_in("version", 0, UINT32_MAX, true); v && *v != 1)
    ctx_.error(top.where("version"), "version",
               "unsupported schema version " + std::to_string(*v) + " (this sriovd reads version 1)");
  if (auto h = top.choice<HostMode>("host", {{"system", HostMode::system}, {"simulated", HostMode::simulated}}, true))
    cfg_.host = *h;
  if (auto l = top.choice<std::string>("log_level", {{"trace", "trace"},
                                                     {"debug", "debug"},
                                                     {"info", "info"},
                                                     {"warn", "warn"},
                                                     {"error", "error"},
                                                     {"critical", "critical"},
                                                     {"off", "off"}}))
    cfg_.log_level = *l;
  if (auto d = top.string("state_dir")) {
    if ((*d)[0] != '/')
      ctx_.error(top.where("state_dir"), "state_dir", "expected an absolute path, got '" + *d + "'");
    else
      cfg_.state_dir = *d;
  }

  if (top.has("simulated")) {
    if (cfg_.host != HostMode::simulated && top.has("host"))
      ctx_.error(top.where("simulated"), "simulated", "only allowed with 'host: simulated' (host is system)");
    read_simulated(top.get("simulated", false));
  } else if (cfg_.host == HostMode::simulated) {
    ctx_.error(top.where(), "document", "'host: simulated' needs a 'simulated' section");
  }
  if (top.has("control")) read_control(top.get("control", false));
  if (top.has("interrupts")) read_interrupts(top.get("interrupts", false));
  if (top.has("peer_limits")) read_peer_limits(top.get("peer_limits", false));
  if (top.has("metrics")) read_metrics(top.get("metrics", false));
  for_each_item(ctx_, top, "physical_functions", [&](const YAML::Node& n, const std::string& p) { read_pf(n, p); });
  for_each_item(ctx_, top, "virtio_devices", [&](const YAML::Node& n, const std::string& p) { read_virtio(n, p); });
  if (top.has("kubernetes")) read_kubernetes(top.get("kubernetes", false));
  check_sockets();
  link_bridged_macs();
  check_macs();

  if (ctx_.failed()) throw ConfigError(ctx_.take());
  return std::move(cfg_);
}

void Loader::read_simulated(const YAML::Node& node) {
  Mapping m(ctx_, node, "simulated", {"physical_functions"});
  if (!m.valid()) return;
  if (!m.has("physical_functions")) {
    m.get("physical_functions", true);
    return;
  }
  for_each_item(ctx_, m, "physical_functions", [&](const YAML::Node& n, const std::string& p) {
    Mapping pf(ctx_, n, p,
               {"address", "vendor_id", "device_id", "total_vfs", "msix_vectors_per_vf", "set_irqs_cost_us", "netdev"});
    if (!pf.valid()) return;
    SimulatedPf sim;
    sim.where = pf.where();
    auto addr = pci_value(ctx_, pf, "address", true);
    if (auto v = pf.unsigned_in("vendor_id", 1, 0xfffe)) sim.vendor_id = static_cast<uint16_t>(*v);
    if (auto v = pf.unsigned_in("device_id", 0, 0xffff)) sim.device_id = static_cast<uint16_t>(*v);
    if (auto v = pf.unsigned_in("total_vfs", 1, 256)) sim.total_vfs = static_cast<uint16_t>(*v);
    if (auto v = pf.unsigned_in("msix_vectors_per_vf", 1, 2048)) sim.msix_vectors_per_vf = static_cast<uint16_t>(*v);
    if (auto v = pf.unsigned_in("set_irqs_cost_us", 0, 100000)) sim.set_irqs_cost_us = static_cast<uint32_t>(*v);
    auto netdev = pf.string("netdev", true);
    if (netdev && !valid_ifname(*netdev)) {
      ctx_.error(pf.where("netdev"), pf.path_of("netdev"),
                 "'" + *netdev + "' is not a valid interface name (1 to 15 characters, no '/', ':' or spaces)");
      netdev.reset();
    }
    if (!addr || !netdev) return;
    sim.address = *addr;
    sim.netdev = *netdev;
    for (const auto& other : cfg_.simulated_pfs) {
      if (other.address == sim.address)
        ctx_.error(pf.where("address"), pf.path_of("address"),
                   "PCI address " + sim.address.to_string() + " is already simulated at " + line_ref(other.where));
      if (other.netdev == sim.netdev)
        ctx_.error(pf.where("netdev"), pf.path_of("netdev"),
                   "netdev '" + sim.netdev + "' is already used at " + line_ref(other.where));
    }
    cfg_.simulated_pfs.push_back(sim);
  });
  if (cfg_.simulated_pfs.empty() && !ctx_.failed())
    ctx_.error(m.where("physical_functions"), "simulated.physical_functions", "a simulated host needs at least one PF");
}

void Loader::read_control(const YAML::Node& node) {
  Mapping m(ctx_, node, "control", {"socket", "group", "allowed_uids", "poll_us", "session_threads"});
  if (!m.valid()) return;
  if (auto s = socket_path(ctx_, m, "socket", false)) cfg_.control.socket = *s;
  control_socket_where_ = m.where("socket");
  if (auto v = m.unsigned_in("poll_us", 0, kMaxControlPollUs)) cfg_.control.poll_us = static_cast<uint32_t>(*v);
  if (auto v = m.unsigned_in("session_threads", 0, kMaxSessionThreads))
    cfg_.control.session_threads = static_cast<uint16_t>(*v);
  if (auto g = m.string("group")) {
    cfg_.control.group = *g;
    cfg_.control.gid = group_id(*g);
    if (!cfg_.control.gid) ctx_.error(m.where("group"), "control.group", "no such group '" + *g + "' on this host");
  }
  for_each_item(ctx_, m, "allowed_uids", [&](const YAML::Node& n, const std::string& p) {
    if (auto uid = Mapping::unsigned_value(ctx_, n, p, 0, UINT32_MAX - 1))
      cfg_.control.allowed_uids.push_back(static_cast<uid_t>(*uid));
  });
}

// listen: an IPv4 literal and a port ("127.0.0.1:9808"; port 0: any free
// one, which `sriovctl status` shows), loopback unless allow_remote says
// otherwise. An IPv6 one ("[::1]:9808") is recognised and refused.
void Loader::read_metrics(const YAML::Node& node) {
  Mapping m(ctx_, node, "metrics", {"listen", "allow_remote"});
  if (!m.valid()) return;
  const bool remote = m.boolean("allow_remote").value_or(false);
  auto listen = m.string("listen", true);
  if (!listen) return;
  const auto colon = listen->rfind(':');
  std::string host = colon == std::string::npos ? "" : listen->substr(0, colon);
  const std::string port = colon == std::string::npos ? "" : listen->substr(colon + 1);
  const bool bracketed = host.size() >= 2 && host.front() == '[' && host.back() == ']';
  if (bracketed) host = host.substr(1, host.size() - 2);
  in6_addr a6{};
  in_addr a4{};
  const bool v6 = bracketed && ::inet_pton(AF_INET6, host.c_str(), &a6) == 1;
  const bool v4 = !bracketed && ::inet_pton(AF_INET, host.c_str(), &a4) == 1;
  const auto port_number =
      port.find_first_not_of("0123456789") == std::string::npos ? parse_unsigned(port) : std::nullopt;
  if ((!v4 && !v6) || !port_number || *port_number > 65535) {
    ctx_.error(m.where("listen"), "metrics.listen",
               "'" + *listen + "' is not an address and port (e.g. \"127.0.0.1:9808\")");
    return;
  }
  if (v6) {
    // The endpoint (daemon/metrics.cpp) binds an IPv4 address.
    ctx_.error(m.where("listen"), "metrics.listen",
               "'" + *listen +
                   "': IPv6 is not served (the metrics endpoint listens on an IPv4 address); "
                   "use an IPv4 address such as \"127.0.0.1:9808\"");
    return;
  }
  const bool loopback = (ntohl(a4.s_addr) >> 24U) == 127;
  if (!loopback && !remote) {
    ctx_.error(m.where("listen"), "metrics.listen",
               "'" + *listen +
                   "' is not a loopback address; the metrics name every VF, owner and socket of this "
                   "host, so serving them beyond it needs 'allow_remote: true'");
    return;
  }
  cfg_.metrics.listen = *listen;
  cfg_.metrics.allow_remote = remote;
}

void Loader::read_peer_limits(const YAML::Node& node) {
  Mapping m(ctx_, node, "peer_limits", {"max_mappings", "max_mib", "max_address_space_mib"});
  if (!m.valid()) return;
  PeerLimits& l = cfg_.peer_limits;
  if (auto v = m.unsigned_in("max_mappings", 1, 65536)) l.max_mappings = static_cast<uint32_t>(*v);
  if (auto v = m.unsigned_in("max_mib", 1, 1ULL << 32U)) l.max_mib = *v;
  if (auto v = m.unsigned_in("max_address_space_mib", 1, 1ULL << 32U)) l.max_address_space_mib = *v;
  if (l.max_address_space_mib < l.max_mib)
    ctx_.error(m.where("max_address_space_mib"), "peer_limits.max_address_space_mib",
               std::to_string(l.max_address_space_mib) + " MiB is less than max_mib (" + std::to_string(l.max_mib) +
                   " MiB): what a client declares always takes at least that much address space");
}

void Loader::read_interrupts(const YAML::Node& node) {
  Mapping m(ctx_, node, "interrupts", {"relay_threads", "cpus", "busy_poll"});
  if (!m.valid()) return;
  if (auto v = m.unsigned_in("relay_threads", 1, 64)) cfg_.interrupts.relay_threads = static_cast<uint16_t>(*v);
  if (auto b = m.boolean("busy_poll")) cfg_.interrupts.busy_poll = *b;
  for_each_item(ctx_, m, "cpus", [&](const YAML::Node& n, const std::string& p) {
    auto cpu = Mapping::unsigned_value(ctx_, n, p, 0, CPU_SETSIZE - 1);
    if (!cpu) return;
    auto& cpus = cfg_.interrupts.cpus;
    if (std::find(cpus.begin(), cpus.end(), *cpu) != cpus.end())
      ctx_.error(n, p, "CPU " + std::to_string(*cpu) + " is listed twice");
    else
      cpus.push_back(static_cast<uint16_t>(*cpu));
  });
}

SocketAccess Loader::read_access(const YAML::Node& node, const std::string& path) {
  SocketAccess a;
  Mapping m(ctx_, node, path, {"user", "group", "mode", "allowed_uids"});
  if (!m.valid()) return a;
  if (auto u = m.string("user")) {
    a.user = *u;
    a.uid = user_id(*u);
    if (!a.uid) ctx_.error(m.where("user"), m.path_of("user"), "no such user '" + *u + "' on this host");
  }
  if (auto g = m.string("group")) {
    a.group = *g;
    a.gid = group_id(*g);
    if (!a.gid) a.gid = numeric_id(*g);
    if (!a.gid) ctx_.error(m.where("group"), m.path_of("group"), "no such group '" + *g + "' on this host");
  }
  if (auto mode = m.string("mode")) {
    // Octal, as chmod takes it: "0660", "660". The owner must be able to
    // use its own socket; nobody needs execute or setuid bits on one.
    const bool digits = !mode->empty() && mode->size() <= 4 && mode->find_first_not_of("01234567") == std::string::npos;
    const unsigned long v = digits ? std::stoul(*mode, nullptr, 8) : 0;
    if (!digits || v > 0777 || (v & 0600) != 0600 || (v & 0111) != 0)
      ctx_.error(m.where("mode"), m.path_of("mode"),
                 "mode '" + *mode +
                     "': octal file mode with read and write for the owner and no execute bits (e.g. \"0660\")");
    else
      a.mode = static_cast<uint32_t>(v);
  }
  for_each_item(ctx_, m, "allowed_uids", [&](const YAML::Node& n, const std::string& p) {
    if (auto uid = Mapping::unsigned_value(ctx_, n, p, 0, UINT32_MAX - 1))
      a.allowed_uids.push_back(static_cast<uid_t>(*uid));
  });
  return a;
}

void Loader::check_sockets() {
  struct Use {
    std::string what;
    SourceLocation where;
  };
  std::map<std::string, Use> used;
  used[cfg_.control.socket] = {"control.socket", control_socket_where_};
  auto claim = [&](const std::string& path, const std::string& what, SourceLocation where) {
    auto [it, inserted] = used.emplace(path, Use{what, where});
    if (!inserted)
      ctx_.error(where, what,
                 "socket '" + path + "' is already used by " + it->second.what +
                     (it->second.where.line ? " (" + line_ref(it->second.where) + ")" : ""));
  };
  for (size_t p = 0; p < cfg_.physical_functions.size(); ++p)
    for (const auto& vf : cfg_.physical_functions[p].vfs)
      if (vf.assign && !vf.assign->socket.empty())
        claim(vf.assign->socket,
              "VF " + std::to_string(vf.index) + " of PF " + cfg_.physical_functions[p].ref.to_string(),
              vf.assign->socket_where);
  for (const auto& dev : cfg_.virtio_devices)
    if (!dev.socket.empty()) claim(dev.socket, "virtio device '" + dev.name + "'", dev.socket_where);
}

// A guest bridged to a VF speaks with the VF's MAC: a NIC's VF receives
// only frames for its own MAC (and broadcast and subscribed multicast)
// unless it is trusted and promiscuous - igbvf has no unicast promiscuous
// mode at all - and with spoofchk on it drops frames sent from any other.
// So the device's MAC and the VF's are one: either given sets the other,
// and two that differ are an error. Neither given: the device takes the VF
// netdev's MAC when it starts.
void Loader::link_bridged_macs() {
  for (size_t i = 0; i < cfg_.virtio_devices.size(); ++i) {
    VirtioDevice& dev = cfg_.virtio_devices[i];
    if (dev.backend_kind != BackendKind::vf) continue;
    PfConfig* pf = nullptr;
    for (auto& candidate : cfg_.physical_functions)
      if (candidate.ref == dev.vf.pf) pf = &candidate;
    if (!pf) continue;
    VfConfig* vf = nullptr;
    for (auto& c : pf->vfs)
      if (c.index == dev.vf.vf) vf = &c;
    if (vf && vf->mac && dev.mac && *vf->mac != *dev.mac) {
      ctx_.error(dev.where, "virtio_devices[" + std::to_string(i) + "].mac",
                 "virtio device '" + dev.name + "' has MAC " + dev.mac->to_string() + " but its backing VF " +
                     std::to_string(dev.vf.vf) + " of PF " + pf->ref.to_string() + " has " + vf->mac->to_string() +
                     " (" + line_ref(vf->where) +
                     "): a bridged guest must use its VF's MAC (the VF receives only its own, and spoofchk drops "
                     "others); leave one of the two out");
      continue;
    }
    if (dev.mac && (!vf || !vf->mac)) {
      if (!vf) {
        VfConfig added;
        added.index = dev.vf.vf;
        added.where = dev.where;
        pf->vfs.push_back(added);
        vf = &pf->vfs.back();
      }
      vf->mac = dev.mac;
      vf->mac_from_device = dev.name;
    } else if (!dev.mac && vf && vf->mac) {
      dev.mac = vf->mac;
    }
  }
}

void Loader::check_macs() {
  std::map<MacAddress, std::string> used;
  auto claim = [&](const MacAddress& mac, const std::string& what, SourceLocation where) {
    auto [it, inserted] = used.emplace(mac, what);
    if (!inserted) ctx_.error(where, what, "MAC " + mac.to_string() + " is already used by " + it->second);
  };
  for (const auto& pf : cfg_.physical_functions)
    for (const auto& vf : pf.vfs)
      if (vf.mac) claim(*vf.mac, "VF " + std::to_string(vf.index) + " of PF " + pf.ref.to_string(), vf.where);
  for (const auto& dev : cfg_.virtio_devices)
    if (dev.mac && dev.backend_kind != BackendKind::vf)  // a bridged device's MAC is its VF's
      claim(*dev.mac, "virtio device '" + dev.name + "'", dev.where);
}

Config parse(std::string_view text, const std::string& file) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(text));
  } catch (const YAML::ParserException& e) {
    throw ConfigError({{file, e.mark.line + 1, e.mark.column + 1, "YAML syntax error: " + e.msg}});
  }
  if (!root.IsDefined() || root.IsNull())
    throw ConfigError({{file, 1, 1, "the file is empty; expected a mapping with 'version: 1'"}});
  return Loader(file).run(root);
}

Config load(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError({{path, 0, 0, std::string("cannot read: ") + std::strerror(errno)}});
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw ConfigError({{path, 0, 0, std::string("cannot read: ") + std::strerror(errno)}});
  return parse(text.str(), path);
}

}  // namespace sriovd::config
