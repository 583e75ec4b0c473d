// kubernetes: the device-plugin directory, the CDI directory and the
// resource pools, each a resource name and its members. Read after the
// PFs and virtio devices it names.

#include <regex>

#include "loader_sections.hpp"

namespace sriovd::config {

namespace {

// "vendor.domain/name": a DNS subdomain, a slash, a name of at most 63
// characters (as an extended resource name and a CDI kind both need).
bool valid_resource_name(const std::string& s) {
  static const std::regex re(
      R"(^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$)");
  return s.size() <= 253 + 64 && std::regex_match(s, re);
}

}  // namespace

void Loader::read_kubernetes(const YAML::Node& node) {
  Mapping m(ctx_, node, "kubernetes", {"device_plugin_dir", "cdi_dir", "pools", "dra"});
  if (!m.valid()) return;
  cfg_.kubernetes.enabled = true;
  if (auto d = absolute_path(ctx_, m, "device_plugin_dir")) cfg_.kubernetes.device_plugin_dir = *d;
  if (auto d = absolute_path(ctx_, m, "cdi_dir")) cfg_.kubernetes.cdi_dir = *d;
  for_each_item(ctx_, m, "pools", [&](const YAML::Node& n, const std::string& p) { read_pool(n, p); });
  check_pool_members();
  if (m.has("dra")) read_dra(m.get("dra", false));
}

// kubernetes.dra: the driver's name (a DNS subdomain, as a ResourceSlice's
// spec.driver must be), the node, the API server's kubeconfig and the
// kubelet's directories.
void Loader::read_dra(const YAML::Node& node) {
  Mapping m(ctx_, node, "kubernetes.dra", {"driver", "node_name", "kubeconfig", "registry_dir", "plugins_dir"});
  if (!m.valid()) return;
  Dra& dra = cfg_.kubernetes.dra;
  dra.enabled = true;
  dra.where = m.where();
  static const std::regex dns_subdomain(R"(^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$)");
  if (auto d = m.string("driver")) {
    if (d->size() > 63 || !std::regex_match(*d, dns_subdomain))
      ctx_.error(m.where("driver"), m.path_of("driver"),
                 "'" + *d + "' is not a DNS subdomain of at most 63 characters (a DRA driver's name, e.g. sriovd.io)");
    else
      dra.driver = *d;
  }
  if (auto n = m.string("node_name")) {
    if (n->size() > 253 || !std::regex_match(*n, dns_subdomain))
      ctx_.error(m.where("node_name"), m.path_of("node_name"), "'" + *n + "' is not a Kubernetes node name");
    else
      dra.node_name = *n;
  }
  if (auto d = absolute_path(ctx_, m, "kubeconfig")) dra.kubeconfig = *d;
  if (auto d = absolute_path(ctx_, m, "registry_dir")) dra.registry_dir = *d;
  if (auto d = absolute_path(ctx_, m, "plugins_dir")) dra.plugins_dir = *d;
}

// One entry of a pool's vfs: a PF and the indexes of its VFs, each assigned
// with 'export: none' (a pod takes the VF whole).
void Loader::read_pool_vfs(const YAML::Node& n, const std::string& p, ResourcePool& pool) {
  Mapping v(ctx_, n, p, {"pf", "indexes"});
  if (!v.valid()) return;
  auto pf_name = v.string("pf", true);
  if (!pf_name) return;
  const PfConfig* pf = find_pf(v, *pf_name);
  if (!pf) return;
  PoolVfs vfs{pf->ref, {}};
  for_each_item(ctx_, v, "indexes", [&](const YAML::Node& i, const std::string& ip) {
    auto idx = Mapping::unsigned_value(ctx_, i, ip, 0, 255);
    if (!idx) return;
    const VfConfig* vf = nullptr;
    for (const auto& c : pf->vfs)
      if (c.index == *idx) vf = &c;
    if (!vf || !vf->assign) {
      ctx_.error(i, ip,
                 "VF " + std::to_string(*idx) + " of PF " + pf->ref.to_string() +
                     " is not assigned (a pool's VFs are bound to vfio-pci: vfs[].assign with 'export: none')");
      return;
    }
    if (vf->assign->export_kind != ExportKind::none) {
      ctx_.error(i, ip,
                 "VF " + std::to_string(*idx) + " of PF " + pf->ref.to_string() + " is exported over vfio-user to '" +
                     vf->assign->owner + "'; a pool's VFs go to pods whole ('export: none')");
      return;
    }
    vfs.indexes.push_back(static_cast<uint16_t>(*idx));
  });
  if (!v.has("indexes")) v.get("indexes", true);
  pool.vfs.push_back(std::move(vfs));
}

void Loader::read_pool(const YAML::Node& node, const std::string& path) {
  Mapping m(ctx_, node, path, {"name", "vfs", "selector", "virtio_devices"});
  if (!m.valid()) return;
  ResourcePool pool;
  pool.where = m.where();
  auto name = m.string("name", true);
  if (!name) return;
  if (!valid_resource_name(*name)) {
    ctx_.error(m.where("name"), m.path_of("name"),
               "'" + *name +
                   "' is not a resource name 'vendor.domain/name' (a DNS subdomain, '/', up to 63 letters, "
                   "digits, '-', '_', '.')");
    return;
  }
  for (const auto& other : cfg_.kubernetes.pools)
    if (other.name == *name) {
      ctx_.error(m.where("name"), m.path_of("name"),
                 "pool '" + *name + "' is already defined at " + line_ref(other.where));
      return;
    }
  pool.name = *name;
  for_each_item(ctx_, m, "vfs", [&](const YAML::Node& n, const std::string& p) { read_pool_vfs(n, p, pool); });
  if (m.has("selector")) {
    Mapping s(ctx_, m.get("selector", false), m.path_of("selector"), {"pf", "vendor_id", "device_id", "owner"});
    if (s.valid()) {
      PoolSelector sel;
      if (auto pf_name = s.string("pf")) {
        if (const PfConfig* pf = find_pf(s, *pf_name)) sel.pf = pf->ref;
      }
      if (auto v = s.unsigned_in("vendor_id", 0, 0xffff)) sel.vendor_id = static_cast<uint16_t>(*v);
      if (auto v = s.unsigned_in("device_id", 0, 0xffff)) sel.device_id = static_cast<uint16_t>(*v);
      sel.owner = s.string("owner");
      pool.selector = sel;
    }
  }
  for_each_item(ctx_, m, "virtio_devices", [&](const YAML::Node& n, const std::string& p) {
    if (!n.IsScalar()) {
      ctx_.error(n, p, "expected a virtio device name, got " + describe(n));
      return;
    }
    const bool known = std::any_of(cfg_.virtio_devices.begin(), cfg_.virtio_devices.end(),
                                   [&](const VirtioDevice& d) { return d.name == n.Scalar(); });
    if (!known) {
      ctx_.error(n, p, "no virtio device '" + n.Scalar() + "' in virtio_devices");
      return;
    }
    pool.virtio_devices.push_back(n.Scalar());
  });
  if (!m.has("vfs") && !m.has("selector") && !m.has("virtio_devices")) {
    ctx_.error(m.where(), path, "pool '" + pool.name + "' has no members (vfs, selector or virtio_devices)");
    return;
  }
  cfg_.kubernetes.pools.push_back(std::move(pool));
}

// A VF is in at most one pool: every configured VF that a pool's list or
// selector can take (vendor and device ids are the host's, so a selector
// is taken to match every VF its PF and owner allow) belongs to one pool.
void Loader::check_pool_members() {
  std::map<std::pair<std::string, uint16_t>, std::string> taken;
  std::map<std::string, std::string> taken_virtio;
  for (const auto& pool : cfg_.kubernetes.pools) {
    auto claim = [&](const PfConfig& pf, uint16_t index) {
      auto [it, inserted] = taken.emplace(std::make_pair(pf.ref.to_string(), index), pool.name);
      if (!inserted && it->second != pool.name)
        ctx_.error(pool.where, "kubernetes.pools",
                   "VF " + std::to_string(index) + " of PF " + pf.ref.to_string() + " is in pool '" + it->second +
                       "' and pool '" + pool.name + "' (a VF is in at most one pool)");
    };
    for (const auto& list : pool.vfs)
      for (const auto& pf : cfg_.physical_functions)
        if (pf.ref == list.pf)
          for (uint16_t i : list.indexes) claim(pf, i);
    if (pool.selector)
      for (const auto& pf : cfg_.physical_functions) {
        if (pool.selector->pf && !(*pool.selector->pf == pf.ref)) continue;
        for (const auto& vf : pf.vfs)
          if (vf.assign && vf.assign->export_kind == ExportKind::none &&
              (!pool.selector->owner || *pool.selector->owner == vf.assign->owner))
            claim(pf, vf.index);
      }
    for (const auto& name : pool.virtio_devices) {
      auto [it, inserted] = taken_virtio.emplace(name, pool.name);
      if (!inserted)
        ctx_.error(pool.where, "kubernetes.pools",
                   "virtio device '" + name + "' is in pool '" + it->second + "' and pool '" + pool.name + "'");
    }
  }
}

}  // namespace sriovd::config
