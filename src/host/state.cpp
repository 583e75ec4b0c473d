#include "sriovd/host/state.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "sriovd/util/error.hpp"
#include "sriovd/util/fd.hpp"

namespace sriovd::host {

namespace {

const char* kind_name(KeyKind k) {
  switch (k) {
    case KeyKind::autoprobe: return "autoprobe";
    case KeyKind::numvfs: return "numvfs";
    case KeyKind::vf_settings: return "vf_settings";
    case KeyKind::binding: return "binding";
    case KeyKind::group_check: return "group_check";
    case KeyKind::vf_mtu: return "vf_mtu";
  }
  return "?";
}

KeyKind kind_from(const std::string& s) {
  for (KeyKind k : {KeyKind::autoprobe, KeyKind::numvfs, KeyKind::vf_settings, KeyKind::binding, KeyKind::group_check,
                    KeyKind::vf_mtu})
    if (s == kind_name(k)) return k;
  throw std::runtime_error("journal: unknown key kind '" + s + "'");
}

std::string value_text(const json& v) {
  if (v.is_null()) return "?";
  if (v.is_boolean()) return v.get<bool>() ? "1" : "0";
  if (v.is_object() && v.contains("numvfs")) return std::to_string(v["numvfs"].get<unsigned>());
  if (v.is_object() && v.contains("driver")) {
    const std::string d = v["driver"].get<std::string>();
    if (d == "*") return "(its own driver)";
    return d.empty() ? "(none)" : d;
  }
  return v.dump();
}

void write_all(int fd, const std::string& data, const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("writing " + path);
    }
    done += static_cast<size_t>(n);
  }
}

}  // namespace

std::string Key::to_string() const {
  std::string s = device.to_string();
  if (vf >= 0) s += " VF " + std::to_string(vf);
  return s + " " + kind_name(kind);
}

json Key::to_json() const { return {{"kind", kind_name(kind)}, {"device", device.to_string()}, {"vf", vf}}; }

Key Key::from_json(const json& j) {
  auto addr = PciAddress::parse(j.at("device").get<std::string>());
  if (!addr) throw std::runtime_error("journal: bad device " + j.at("device").dump());
  return {kind_from(j.at("kind").get<std::string>()), *addr, j.at("vf").get<int>()};
}

std::string Step::describe() const {
  std::string where = key.device.to_string() + (key.vf >= 0 ? " VF " + std::to_string(key.vf) : "");
  switch (key.kind) {
    case KeyKind::autoprobe:
      return where + ": sriov_drivers_autoprobe " + value_text(before) + " -> " + value_text(after);
    case KeyKind::numvfs: return where + ": sriov_numvfs " + value_text(before) + " -> " + value_text(after);
    case KeyKind::vf_settings: {
      // Only the fields that change, before and after.
      json was = json::object();
      if (before.is_object())
        for (auto f = after.begin(); f != after.end(); ++f)
          if (before.contains(f.key())) was[f.key()] = before[f.key()];
      return where + ": settings " + (before.is_null() ? std::string("?") : was.dump()) + " -> " + after.dump();
    }
    case KeyKind::binding: return where + ": driver " + value_text(before) + " -> " + value_text(after);
    case KeyKind::group_check: return where + ": check that its IOMMU group is viable";
    case KeyKind::vf_mtu:
      return where + ": netdev MTU " + (before.is_object() ? std::to_string(before.value("mtu", 0)) : "?") + " -> " +
             std::to_string(after.value("mtu", 0));
  }
  return where;
}

json Step::to_json() const {
  return {{"key", key.to_json()}, {"after", after}, {"before", before}, {"status", status}};
}

Step Step::from_json(const json& j) {
  Step s;
  s.key = Key::from_json(j.at("key"));
  s.after = j.at("after");
  s.before = j.at("before");
  s.status = j.at("status").get<std::string>();
  return s;
}

const json* Ledger::find(const Key& key) const {
  for (const auto& [k, v] : entries_)
    if (k == key) return &v;
  return nullptr;
}

void Ledger::record(const Key& key, const json& before) {
  if (before.is_null() || key.kind == KeyKind::group_check) return;
  for (auto& [k, v] : entries_)
    if (k == key) {
      if (key.kind == KeyKind::vf_settings)
        for (auto it = before.begin(); it != before.end(); ++it)
          if (!v.contains(it.key())) v[it.key()] = it.value();
      return;
    }
  entries_.emplace_back(key, before);
}

void Ledger::erase(const Key& key) {
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(), [&](const auto& e) { return e.first == key; }),
                 entries_.end());
}

void Ledger::drop_vfs_of(const PciAddress& pf) {
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [&](const auto& e) { return e.first.device == pf && e.first.vf >= 0; }),
                 entries_.end());
}

json Ledger::to_json() const {
  json a = json::array();
  for (const auto& [k, v] : entries_) a.push_back({{"key", k.to_json()}, {"original", v}});
  return a;
}

Ledger Ledger::from_json(const json& j) {
  Ledger l;
  for (const auto& e : j) l.entries_.emplace_back(Key::from_json(e.at("key")), e.at("original"));
  return l;
}

Journal StateFile::load() const {
  std::ifstream in(path_);
  Journal journal;
  if (!in) {
    if (errno == ENOENT) return journal;
    throw SystemError(errno, "reading journal " + path_);
  }
  std::ostringstream text;
  text << in.rdbuf();
  try {
    const json j = json::parse(text.str());
    if (j.at("version").get<int>() != 1) throw std::runtime_error("unsupported version");
    journal.ledger = Ledger::from_json(j.at("ledger"));
    journal.next_txn = j.value("next_txn", uint64_t{1});
    if (!j.at("txn").is_null()) {
      const json& t = j["txn"];
      Transaction txn;
      txn.id = t.at("id").get<uint64_t>();
      txn.kind = t.at("kind").get<std::string>();
      txn.ledger_before = Ledger::from_json(t.at("ledger_before"));
      for (const auto& s : t.at("steps")) txn.steps.push_back(Step::from_json(s));
      journal.txn = std::move(txn);
    }
  } catch (const std::exception& e) {
    throw std::runtime_error("journal " + path_ + " is corrupt (" + e.what() +
                             "); it records host changes to undo, so sriovd will not overwrite it: "
                             "inspect it, restore the host by hand, then remove it");
  }
  return journal;
}

void StateFile::save(const Journal& journal) const {
  json j = {{"version", 1}, {"ledger", journal.ledger.to_json()}, {"next_txn", journal.next_txn}, {"txn", nullptr}};
  if (journal.txn) {
    json steps = json::array();
    for (const auto& s : journal.txn->steps) steps.push_back(s.to_json());
    j["txn"] = {{"id", journal.txn->id},
                {"kind", journal.txn->kind},
                {"ledger_before", journal.txn->ledger_before.to_json()},
                {"steps", steps}};
  }
  const std::filesystem::path target(path_);
  std::filesystem::create_directories(target.parent_path());
  const std::string tmp = path_ + ".tmp";
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!fd) throw_errno("creating " + tmp);
    write_all(fd.get(), j.dump(2) + "\n", tmp);
    if (::fsync(fd.get()) != 0) throw_errno("fsync " + tmp);
  }
  if (::rename(tmp.c_str(), path_.c_str()) != 0) throw_errno("renaming " + tmp + " to " + path_);
  UniqueFd dir(::open(target.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir && ::fsync(dir.get()) != 0) throw_errno("fsync " + target.parent_path().string());
}

}  // namespace sriovd::host
