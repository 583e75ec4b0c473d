#include "sriovd/host/reconciler.hpp"

#include <algorithm>
#include <map>

#include <spdlog/spdlog.h>

#include "sriovd/host/driver_rules.hpp"

namespace sriovd::host {

namespace {

constexpr const char* kVfio = "vfio-pci";

json vfio_binding() { return {{"driver", kVfio}, {"override", kVfio}}; }

json settings_json(const config::VfConfig& vf) {
  VfSettings s;
  s.mac = vf.mac;
  s.vlan = vf.vlan;
  if (vf.vlan) s.qos = vf.qos;
  s.trust = vf.trust;
  s.spoofchk = vf.spoofchk;
  if (vf.link_state) s.link_state = config::to_string(*vf.link_state);
  s.max_tx_rate = vf.max_tx_rate;
  s.min_tx_rate = vf.min_tx_rate;
  return s.to_json();
}

// Steps on VF-level state restore before PF-level state (bindings before
// numvfs before autoprobe); applying goes the other way round.
int apply_rank(KeyKind k) {
  switch (k) {
    case KeyKind::autoprobe: return 0;
    case KeyKind::numvfs: return 1;
    case KeyKind::vf_settings: return 2;
    case KeyKind::binding: return 3;
    case KeyKind::vf_mtu: return 4;  // on the netdev the binding made
    case KeyKind::group_check: return 5;
  }
  return 6;
}

// Does the host already hold `want`? For settings, only the fields wanted.
bool satisfied(const Key& key, const json& have, const json& want) {
  if (have.is_null()) return false;
  switch (key.kind) {
    case KeyKind::numvfs: return have.at("numvfs") == want.at("numvfs");
    case KeyKind::vf_settings:
      for (auto it = want.begin(); it != want.end(); ++it)
        if (!have.contains(it.key()) || have[it.key()] != it.value()) return false;
      return true;
    case KeyKind::binding:
      if (want.at("driver") == "*") {
        const std::string d = have.at("driver").get<std::string>();
        return !d.empty() && d != kVfio && have.at("override") == "";
      }
      return have.at("driver") == want.at("driver") && have.at("override") == want.value("override", "");
    default: return have == want;
  }
}

}  // namespace

Reconciler::Reconciler(HostControl& host, StateFile state) : host_(host), state_(std::move(state)) {
  journal_ = state_.load();
}

PciAddress Reconciler::resolve(const config::PfRef& ref) {
  if (ref.address) return *ref.address;
  auto addr = host_.resolve_netdev(ref.netdev);
  if (!addr) throw std::runtime_error("PF " + ref.netdev + ": no such network interface, or it is not a PCI device");
  return *addr;
}

// A PF the config names must exist, do SR-IOV and have room for num_vfs;
// a change of num_vfs must not pull out a VF someone else bound to
// vfio-pci. True when num_vfs changes (every VF is recreated).
bool Reconciler::check_pf(const config::PfConfig& pf_cfg, PciAddress pf) {
  const std::string name = pf_cfg.ref.to_string();
  if (!host_.exists(pf)) throw std::runtime_error("PF " + name + ": no PCI device " + pf.to_string());
  const auto total = host_.total_vfs(pf);
  if (!total)
    throw std::runtime_error("PF " + name + " (" + pf.to_string() + ") does not support SR-IOV (no sriov_totalvfs)");
  if (pf_cfg.num_vfs > *total)
    throw std::runtime_error("PF " + name + ": num_vfs " + std::to_string(pf_cfg.num_vfs) + " exceeds sriov_totalvfs " +
                             std::to_string(*total));
  const unsigned current = host_.num_vfs(pf);
  if (current == pf_cfg.num_vfs) return false;
  for (unsigned i = 0; i < current; ++i) {
    auto vf = host_.vf_address(pf, i);
    if (!vf) continue;
    const bool ours = journal_.ledger.find(Key{KeyKind::binding, pf, static_cast<int>(i)}) != nullptr;
    if (host_.driver(*vf) == kVfio && !ours)
      throw std::runtime_error("PF " + name + ": VF " + vf->to_string() +
                               " is bound to vfio-pci by someone else; refusing to change sriov_numvfs from " +
                               std::to_string(current) + " to " + std::to_string(pf_cfg.num_vfs));
  }
  return true;
}

// What the config asks of one PF and its VFs, key by key.
void Reconciler::desire_pf(const config::PfConfig& pf_cfg, PciAddress pf, const std::set<VfRef>& released,
                           bool makes_vfs, std::map<Key, json>& desired) {
  bool any_assigned = false;
  for (const auto& vf : pf_cfg.vfs)
    if (vf.assign && !released.count({pf, vf.index})) any_assigned = true;
  // VFs sriovd makes (or made) on a PF that probes its VFs by itself get
  // their own driver as the kernel would have given them, whatever their
  // neighbours are for: their "original" is a VF the kernel had just made
  // and autoprobe, off for the assigned ones, had not probed yet.
  bool autoprobes = true;
  if (const json* was = journal_.ledger.find(Key{KeyKind::autoprobe, pf})) {
    autoprobes = was->get<bool>();
  } else {
    try {
      autoprobes = host_.get(Key{KeyKind::autoprobe, pf}).get<bool>();
    } catch (const std::exception&) {
    }
  }
  makes_vfs = makes_vfs || journal_.ledger.find(Key{KeyKind::numvfs, pf}) != nullptr;
  // Native VF drivers must not grab VFs that go to vfio-pci; the others
  // are probed explicitly below.
  if (any_assigned) desired[Key{KeyKind::autoprobe, pf}] = false;
  desired[Key{KeyKind::numvfs, pf}] = json{{"numvfs", pf_cfg.num_vfs}};
  for (const auto& vf : pf_cfg.vfs) {
    json s = settings_json(vf);
    if (!s.empty()) desired[Key{KeyKind::vf_settings, pf, vf.index}] = s;
    // Only a VF on its own driver has a netdev (the loader refuses mtu on
    // an assigned one); a released VF is on its own driver too.
    if (vf.mtu && (!vf.assign || released.count({pf, vf.index})))
      desired[Key{KeyKind::vf_mtu, pf, vf.index}] = json{{"mtu", *vf.mtu}};
  }
  for (unsigned i = 0; i < pf_cfg.num_vfs; ++i) {
    const config::VfConfig* vf = nullptr;
    for (const auto& c : pf_cfg.vfs)
      if (c.index == i) vf = &c;
    const int idx = static_cast<int>(i);
    if (vf && vf->assign && !released.count({pf, i})) {
      desired[Key{KeyKind::binding, pf, idx}] = vfio_binding();
      desired[Key{KeyKind::group_check, pf, idx}] = true;
    } else if (any_assigned || released.count({pf, i}) || (makes_vfs && autoprobes)) {
      // Not for a guest: the VF's own driver, as the kernel would probe it.
      desired[Key{KeyKind::binding, pf, idx}] = json{{"driver", "*"}, {"override", ""}};
    }
  }
}

// What the config no longer asks for goes back to how it was found, in
// the reverse of applying order; settings fields no longer configured go
// back too (added to `desired`).
std::vector<Step> Reconciler::restores(std::map<Key, json>& desired, const std::set<PciAddress>& numvfs_changes) const {
  std::vector<Step> out;
  for (auto it = journal_.ledger.entries().rbegin(); it != journal_.ledger.entries().rend(); ++it) {
    const auto& [key, original] = *it;
    if (desired.count(key)) {
      if (key.kind == KeyKind::vf_settings)
        for (auto f = original.begin(); f != original.end(); ++f)
          if (!desired[key].contains(f.key())) desired[key][f.key()] = f.value();
      continue;
    }
    if (key.vf >= 0 && numvfs_changes.count(key.device)) continue;  // its VF is recreated anyway
    Step s;
    s.key = key;
    s.after = original;
    out.push_back(s);
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const Step& a, const Step& b) { return apply_rank(a.key.kind) > apply_rank(b.key.kind); });
  return out;
}

// Per PF: autoprobe, numvfs, then its VFs' settings and bindings, then checks.
static std::vector<Step> applies(const std::map<Key, json>& desired) {
  std::vector<Step> out;
  for (const auto& [key, want] : desired) {
    Step s;
    s.key = key;
    s.after = want;
    out.push_back(s);
  }
  std::stable_sort(out.begin(), out.end(), [](const Step& a, const Step& b) {
    if (a.key.device != b.key.device) return a.key.device < b.key.device;
    const bool a_pf = a.key.vf < 0, b_pf = b.key.vf < 0;
    if (a_pf != b_pf) return a_pf;
    if (apply_rank(a.key.kind) != apply_rank(b.key.kind)) return apply_rank(a.key.kind) < apply_rank(b.key.kind);
    return a.key.vf < b.key.vf;
  });
  return out;
}

// The steps that change something: a step the host already satisfies goes
// (unless its VF is recreated), and a group check stays only after a binding.
std::vector<Step> Reconciler::needed(const std::vector<Step>& restore, const std::vector<Step>& apply,
                                     const std::set<PciAddress>& numvfs_changes) {
  std::vector<Step> steps;
  auto keep_if_needed = [&](Step s, bool vf_recreated) {
    if (!vf_recreated && s.key.kind != KeyKind::group_check) {
      json have;
      try {
        have = host_.get(s.key);
      } catch (const std::exception&) {
        have = nullptr;
      }
      if (satisfied(s.key, have, s.after)) return;
      s.before = have;
    }
    steps.push_back(std::move(s));
  };
  for (const auto& s : restore) keep_if_needed(s, false);
  for (const auto& s : apply) keep_if_needed(s, s.key.vf >= 0 && numvfs_changes.count(s.key.device));
  std::vector<Step> out;
  for (auto& s : steps) {
    if (s.key.kind == KeyKind::group_check && std::none_of(steps.begin(), steps.end(), [&](const Step& o) {
          return o.key.kind == KeyKind::binding && o.key.device == s.key.device && o.key.vf == s.key.vf;
        }))
      continue;
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<Step> Reconciler::plan(const config::Config& cfg, const std::set<VfRef>& released) {
  std::map<Key, json> desired;
  std::set<PciAddress> numvfs_changes;
  for (const auto& pf_cfg : cfg.physical_functions) {
    const PciAddress pf = resolve(pf_cfg.ref);
    if (check_pf(pf_cfg, pf)) numvfs_changes.insert(pf);
    desire_pf(pf_cfg, pf, released, numvfs_changes.count(pf) != 0, desired);
  }
  const std::vector<Step> restore = restores(desired, numvfs_changes);
  auto steps =
      needed(restore, applies(desired), numvfs_changes);  // `before` is what the plan saw; apply() reads it again
  check_driver_rules(steps);
  return steps;
}

// A setting the PF's driver is known to refuse fails the plan, before
// anything changes (driver_rules.hpp). Only fields the step changes count:
// a driver that refuses every link state still reports one ("auto"), and
// asking for that is no change. A VF not there yet starts as drivers make
// them: link state auto, no rates.
void Reconciler::check_driver_rules(const std::vector<Step>& steps) {
  std::string problems;
  for (const auto& s : steps) {
    if (s.key.kind != KeyKind::vf_settings) continue;
    const VfSettings want = VfSettings::from_json(s.after);
    VfSettings have;
    if (s.before.is_object()) {
      have = VfSettings::from_json(s.before);
    } else {
      have.link_state = "auto";
      have.max_tx_rate = 0;
      have.min_tx_rate = 0;
    }
    VfSettings change;
    if (want.link_state && want.link_state != have.link_state) change.link_state = want.link_state;
    if (want.min_tx_rate && *want.min_tx_rate != have.min_tx_rate.value_or(0)) change.min_tx_rate = want.min_tx_rate;
    if (want.max_tx_rate && *want.max_tx_rate != have.max_tx_rate.value_or(0)) change.max_tx_rate = want.max_tx_rate;
    if (change.empty()) continue;
    const std::string driver = host_.driver(s.key.device);
    const std::string netdev = host_.pf_netdev(s.key.device);
    for (const auto& why : refused_settings(driver, change, !netdev.empty() && host_.link_up(netdev)))
      problems += (problems.empty() ? "" : "; ") + std::string("PF ") + s.key.device.to_string() +
                  (netdev.empty() ? "" : " (" + netdev + ")") + " VF " + std::to_string(s.key.vf) + ": " + why;
  }
  if (!problems.empty()) throw std::runtime_error(problems);
}

void Reconciler::apply(const std::vector<Step>& steps, const std::string& kind) {
  if (steps.empty()) return;
  Transaction txn;
  txn.id = journal_.next_txn++;
  txn.kind = kind;
  txn.ledger_before = journal_.ledger;
  txn.steps = steps;
  journal_.txn = txn;
  state_.save(journal_);
  auto& journaled = journal_.txn->steps;
  for (size_t i = 0; i < journaled.size(); ++i) {
    Step& step = journaled[i];
    try {
      if (before_step) before_step(step, i);
      if (step.key.kind != KeyKind::group_check) {
        try {
          step.before = host_.get(step.key);
        } catch (const std::exception&) {
          step.before = nullptr;  // a VF that does not exist yet
        }
      }
      step.status = "pending";
      state_.save(journal_);
      spdlog::info("host: {}", step.describe());
      host_.set(step.key, step.after);
      step.status = "done";
      if (step.key.kind == KeyKind::numvfs) journal_.ledger.drop_vfs_of(step.key.device);
      if (kind == "release" || (journal_.ledger.find(step.key) && *journal_.ledger.find(step.key) == step.after &&
                                step.key.kind != KeyKind::vf_settings)) {
        journal_.ledger.erase(step.key);  // back where it started
      } else {
        json original = step.before;
        // For settings, only the fields changed have an original worth keeping.
        if (step.key.kind == KeyKind::vf_settings && original.is_object()) {
          json only = json::object();
          for (auto f = step.after.begin(); f != step.after.end(); ++f)
            if (original.contains(f.key())) only[f.key()] = original[f.key()];
          original = only;
        }
        // A numvfs original only needs its VF snapshot if VFs existed.
        journal_.ledger.record(step.key, original);
      }
      state_.save(journal_);
    } catch (const std::exception& e) {
      const std::string failed = step.describe();
      spdlog::error("host: step {} of {} failed: {}: {}", i + 1, journaled.size(), failed, e.what());
      auto problems = rollback(journaled);
      ++counters_.rolled_back;
      if (kind == "release") ++counters_.restore_failures;
      journal_.ledger = journal_.txn->ledger_before;
      journal_.txn.reset();
      state_.save(journal_);
      std::string msg = kind + " failed at step " + std::to_string(i + 1) + " of " + std::to_string(journaled.size()) +
                        " (" + failed + "): " + e.what() + "; rolled back";
      for (const auto& p : problems) msg += "; rollback problem: " + p;
      throw ApplyError(msg);
    }
  }
  journal_.txn.reset();
  state_.save(journal_);
  ++counters_.committed;
}

std::vector<std::string> Reconciler::rollback(std::vector<Step>& steps) {
  std::vector<std::string> problems;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    Step& s = *it;
    if (s.status == "planned" || s.before.is_null() || s.key.kind == KeyKind::group_check) continue;
    try {
      spdlog::info("host: undo {}", s.describe());
      host_.set(s.key, s.before);
      s.status = "undone";
    } catch (const std::exception& e) {
      problems.push_back(s.describe() + ": " + e.what());
      ++counters_.restore_failures;
      spdlog::error("host: cannot undo {}: {}", s.describe(), e.what());
    }
  }
  return problems;
}

std::vector<std::string> Reconciler::recover() {
  std::vector<std::string> undone;
  if (!journal_.txn) return undone;
  spdlog::warn("host: journal {} holds unfinished transaction {} ({}): rolling it back", state_.path(),
               journal_.txn->id, journal_.txn->kind);
  auto& steps = journal_.txn->steps;
  for (const auto& s : steps)
    if (s.status != "planned" && !s.before.is_null() && s.key.kind != KeyKind::group_check)
      undone.push_back(s.describe());
  std::reverse(undone.begin(), undone.end());
  auto problems = rollback(steps);
  journal_.ledger = journal_.txn->ledger_before;
  journal_.txn.reset();
  state_.save(journal_);
  for (const auto& p : problems) undone.push_back("FAILED: " + p);
  return undone;
}

std::vector<Step> Reconciler::converge(const config::Config& cfg, const std::set<VfRef>& released) {
  auto steps = plan(cfg, released);
  apply(steps, "apply");
  return steps;
}

std::vector<Step> Reconciler::release_all() {
  config::Config nothing;
  auto steps = plan(nothing);
  apply(steps, "release");
  return steps;
}

}  // namespace sriovd::host
