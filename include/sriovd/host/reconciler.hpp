#pragma once
// Plans the difference between the configuration and the host, and carries
// it out as a journaled transaction: each step's before-value is written to
// state.json before the step is done; on any failure the steps done are
// undone in reverse. A journal left by a crash is rolled back on start.

#include <functional>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "sriovd/config/config.hpp"
#include "sriovd/host/host_control.hpp"
#include "sriovd/host/state.hpp"

namespace sriovd::host {

// A VF by PF address and index.
using VfRef = std::pair<PciAddress, unsigned>;

class ApplyError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Reconciler {
 public:
  Reconciler(HostControl& host, StateFile state);

  // Rolls back a transaction a crash left in the journal. Returns what it
  // undid (empty when there was nothing).
  std::vector<std::string> recover();

  // The steps that bring the host to `cfg` (with `released` VFs given back
  // to the host), without acting. Throws std::runtime_error when the config
  // cannot be met on this host (a PF missing, no SR-IOV, VFs in use by others).
  std::vector<Step> plan(const config::Config& cfg, const std::set<VfRef>& released = {});

  // Carries out `steps` as one transaction. On failure everything done is
  // undone and ApplyError says which step failed and why.
  void apply(const std::vector<Step>& steps, const std::string& kind = "apply");

  // plan + apply.
  std::vector<Step> converge(const config::Config& cfg, const std::set<VfRef>& released = {});

  // Gives everything back: every key in the ledger to its original value.
  std::vector<Step> release_all();

  [[nodiscard]] const Ledger& ledger() const { return journal_.ledger; }
  [[nodiscard]] const std::string& state_path() const { return state_.path(); }

  // Called before each step; tests use it to die at a chosen point.
  std::function<void(const Step&, size_t index)> before_step;

  // Transactions applied whole and rolled back, since this object was made;
  // and what could not be given back to the host: each step a rollback
  // could not undo, and each release (everything back, at a stop) that
  // failed.
  struct Counters {
    uint64_t committed = 0;
    uint64_t rolled_back = 0;
    uint64_t restore_failures = 0;
  };
  [[nodiscard]] const Counters& counters() const { return counters_; }

 private:
  std::vector<std::string> rollback(std::vector<Step>& steps);
  Counters counters_;
  PciAddress resolve(const config::PfRef& ref);
  // plan()'s parts (reconciler.cpp says what each does).
  bool check_pf(const config::PfConfig& pf_cfg, PciAddress pf);
  void desire_pf(const config::PfConfig& pf_cfg, PciAddress pf, const std::set<VfRef>& released, bool makes_vfs,
                 std::map<Key, json>& desired);
  std::vector<Step> restores(std::map<Key, json>& desired, const std::set<PciAddress>& numvfs_changes) const;
  void check_driver_rules(const std::vector<Step>& steps);
  std::vector<Step> needed(const std::vector<Step>& restore, const std::vector<Step>& apply,
                           const std::set<PciAddress>& numvfs_changes);

  HostControl& host_;
  StateFile state_;
  Journal journal_;
};

}  // namespace sriovd::host
