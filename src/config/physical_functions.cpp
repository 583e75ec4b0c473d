// physical_functions: the PFs, their VFs and what each VF is assigned to.

#include "loader_sections.hpp"

namespace sriovd::config {

const SimulatedPf* Loader::find_simulated(const PfRef& ref) const {
  for (const auto& sim : cfg_.simulated_pfs)
    if ((ref.address && *ref.address == sim.address) || (!ref.address && ref.netdev == sim.netdev)) return &sim;
  return nullptr;
}

void Loader::read_pf(const YAML::Node& node, const std::string& path) {
  Mapping m(ctx_, node, path, {"address", "netdev", "num_vfs", "vfs"});
  if (!m.valid()) return;
  PfConfig pf;
  pf.where = m.where();
  if (m.has("address") == m.has("netdev")) {
    ctx_.error(m.where(), path, "expected exactly one of 'address' or 'netdev' to name the PF");
    return;
  }
  if (m.has("address")) {
    pf.ref.address = pci_value(ctx_, m, "address", true);
    if (!pf.ref.address) return;
  } else {
    auto netdev = m.string("netdev", true);
    if (!netdev) return;
    if (!valid_ifname(*netdev)) {
      ctx_.error(m.where("netdev"), m.path_of("netdev"),
                 "'" + *netdev + "' is not a valid interface name (1 to 15 characters, no '/', ':' or spaces)");
      return;
    }
    pf.ref.netdev = *netdev;
  }
  const std::string ref_key = m.has("address") ? "address" : "netdev";
  uint64_t max_vfs = 256;
  if (cfg_.host == HostMode::simulated) {
    const SimulatedPf* sim = find_simulated(pf.ref);
    if (!sim) {
      ctx_.error(m.where(ref_key), m.path_of(ref_key),
                 "PF '" + pf.ref.to_string() + "' is not one of the simulated PFs");
      return;
    }
    pf.ref = PfRef{sim->address, sim->netdev};
    max_vfs = sim->total_vfs;
  }
  for (const auto& other : cfg_.physical_functions)
    if ((pf.ref.address && other.ref.address == pf.ref.address) ||
        (!pf.ref.netdev.empty() && other.ref.netdev == pf.ref.netdev)) {
      ctx_.error(m.where(ref_key), m.path_of(ref_key),
                 "PF '" + pf.ref.to_string() + "' is already configured at " + line_ref(other.where));
      return;
    }
  auto num_vfs = m.unsigned_in("num_vfs", 0, 256, true);
  if (!num_vfs) return;
  if (*num_vfs > max_vfs) {
    ctx_.error(m.where("num_vfs"), m.path_of("num_vfs"),
               "num_vfs " + std::to_string(*num_vfs) + " exceeds total_vfs " + std::to_string(max_vfs) +
                   " of simulated PF " + pf.ref.to_string());
    return;
  }
  pf.num_vfs = static_cast<uint16_t>(*num_vfs);
  const SimulatedPf* sim = cfg_.host == HostMode::simulated ? find_simulated(pf.ref) : nullptr;
  for_each_item(ctx_, m, "vfs", [&](const YAML::Node& n, const std::string& p) { read_vf(n, p, pf, sim); });
  cfg_.physical_functions.push_back(std::move(pf));
}

void Loader::read_vf(const YAML::Node& node, const std::string& path, PfConfig& pf, const SimulatedPf* sim) {
  Mapping m(ctx_, node, path,
            {"index", "mac", "vlan", "qos", "trust", "spoofchk", "link_state", "max_tx_rate", "min_tx_rate", "mtu",
             "assign"});
  if (!m.valid()) return;
  VfConfig vf;
  vf.where = m.where();
  // A plain sentinel rather than std::optional: g++ 12 reports a false
  // maybe-uninitialized on the optional's payload here.
  int index = static_cast<int>(m.unsigned_in("index", 0, 255, true).value_or(-1));
  if (index >= pf.num_vfs) {
    ctx_.error(m.where("index"), m.path_of("index"),
               "VF index " + std::to_string(index) + " is not below num_vfs " + std::to_string(pf.num_vfs) + " of PF " +
                   pf.ref.to_string());
    index = -1;
  }
  for (const auto& other : pf.vfs)
    if (index >= 0 && other.index == index) {
      ctx_.error(m.where("index"), m.path_of("index"),
                 "VF " + std::to_string(index) + " of PF " + pf.ref.to_string() + " is already configured at " +
                     line_ref(other.where));
      index = -1;
    }
  read_vf_settings(ctx_, m, vf);
  if (auto mtu = m.unsigned_in("mtu", 68, 65535)) vf.mtu = static_cast<uint16_t>(*mtu);
  if (m.has("assign")) vf.assign = read_assign(m.get("assign", false), m.path_of("assign"), sim);
  if (vf.mtu && vf.assign)
    ctx_.error(m.where("mtu"), m.path_of("mtu"),
               "mtu is the MTU of the VF's own netdev; an assigned VF has none on the host (its guest sets its MTU)");
  if (index < 0) return;
  vf.index = static_cast<uint16_t>(index);
  pf.vfs.push_back(std::move(vf));
}

std::optional<VfAssign> Loader::read_assign(const YAML::Node& node, const std::string& path, const SimulatedPf* sim) {
  Mapping m(ctx_, node, path,
            {"owner", "export", "socket", "msix_policy", "bar_access", "max_vectors", "max_dma_mib", "access"});
  if (!m.valid()) return std::nullopt;
  VfAssign a;
  auto owner = m.string("owner", true);
  if (owner && !valid_identifier(*owner)) {
    ctx_.error(m.where("owner"), m.path_of("owner"),
               "owner '" + *owner + "' may use only letters, digits, '-', '_' and '.' (at most 64)");
    owner.reset();
  }
  if (auto e = m.choice<ExportKind>("export", {{"vfio-user", ExportKind::vfio_user}, {"none", ExportKind::none}}))
    a.export_kind = *e;
  auto socket = socket_path(ctx_, m, "socket", a.export_kind == ExportKind::vfio_user);
  if (socket && a.export_kind == ExportKind::none)
    ctx_.error(m.where("socket"), m.path_of("socket"), "a socket is only used with 'export: vfio-user'");
  if (auto p = m.choice<MsixPolicy>(
          "msix_policy",
          {{"direct", MsixPolicy::direct}, {"relay", MsixPolicy::relay}, {"adaptive", MsixPolicy::adaptive}}))
    a.msix_policy = *p;
  if (auto b = m.choice<BarAccess>("bar_access", {{"trapped", BarAccess::trapped}, {"mmap", BarAccess::mmap}})) {
    a.bar_access = *b;
    if (a.export_kind == ExportKind::none)
      ctx_.error(m.where("bar_access"), m.path_of("bar_access"), "bar_access is only used with 'export: vfio-user'");
  }
  const uint64_t max_vectors = sim ? sim->msix_vectors_per_vf : 2048;
  if (auto v = m.unsigned_in("max_vectors", 0, max_vectors)) a.max_vectors = static_cast<uint16_t>(*v);
  if (auto v = m.unsigned_in("max_dma_mib", 1, 1ULL << 32U)) a.max_dma_mib = *v;
  if (m.has("access")) {
    if (a.export_kind == ExportKind::none)
      ctx_.error(m.where("access"), m.path_of("access"), "access is only used with 'export: vfio-user'");
    a.access = read_access(m.get("access", false), m.path_of("access"));
  }
  if (!owner) return std::nullopt;
  a.owner = *owner;
  if (socket) {
    a.socket = *socket;
    a.socket_where = m.where("socket");
  }
  return a;
}

}  // namespace sriovd::config
