#pragma once
// What sriovd changes on a host, and the journal that makes the changes
// crash-safe. Every change is a Step on a Key (one piece of host state); a
// step's `before` is read from the host and journaled before the change is
// made, so an interrupted transaction can always be undone.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include "sriovd/util/pci_address.hpp"

namespace sriovd::host {

using json = nlohmann::json;

enum class KeyKind {
  autoprobe,    // PF sriov_drivers_autoprobe: bool
  numvfs,       // PF sriov_numvfs: {"numvfs": n[, "vfs": [snapshot...]]}
  vf_settings,  // VF network settings through the PF: VfSettings as JSON
  binding,      // a device's driver: {"driver": name|""|"*", "override": name|""}
  group_check,  // not state: the VF's IOMMU group must be viable
  vf_mtu,       // the MTU of the VF's own netdev (its kernel driver bound): {"mtu": n}
};

// device is the PF; vf is the VF index, or -1 for the PF itself.
struct Key {
  KeyKind kind = KeyKind::autoprobe;
  PciAddress device;
  int vf = -1;

  [[nodiscard]] std::string to_string() const;
  [[nodiscard]] json to_json() const;
  static Key from_json(const json& j);
  auto operator<=>(const Key&) const = default;
};

struct Step {
  Key key;
  json after;
  json before;                     // null until read from the host
  std::string status = "planned";  // planned, pending (journaled, maybe done), done

  [[nodiscard]] std::string describe() const;
  [[nodiscard]] json to_json() const;
  static Step from_json(const json& j);
};

// The value each key had before sriovd first changed it: what release
// restores. Ordered by first change.
class Ledger {
 public:
  [[nodiscard]] const json* find(const Key& key) const;
  // Records `before` as the original of `key` unless one is recorded; for
  // VF settings, adds the fields not recorded yet.
  void record(const Key& key, const json& before);
  void erase(const Key& key);
  // Drops every VF-level key of `pf` (its VFs were destroyed).
  void drop_vfs_of(const PciAddress& pf);
  [[nodiscard]] const std::vector<std::pair<Key, json>>& entries() const { return entries_; }
  [[nodiscard]] bool empty() const { return entries_.empty(); }

  [[nodiscard]] json to_json() const;
  static Ledger from_json(const json& j);

 private:
  std::vector<std::pair<Key, json>> entries_;
};

struct Transaction {
  uint64_t id = 0;
  std::string kind;  // apply, release
  Ledger ledger_before;
  std::vector<Step> steps;
};

struct Journal {
  Ledger ledger;
  std::optional<Transaction> txn;
  uint64_t next_txn = 1;
};

// state.json: written atomically (temporary file, fsync, rename, fsync of
// the directory), so a crash leaves either the old or the new journal.
class StateFile {
 public:
  explicit StateFile(std::string path) : path_(std::move(path)) {}
  [[nodiscard]] const std::string& path() const { return path_; }
  // An empty journal when the file does not exist; throws when it is corrupt.
  [[nodiscard]] Journal load() const;
  void save(const Journal& journal) const;

 private:
  std::string path_;
};

}  // namespace sriovd::host
