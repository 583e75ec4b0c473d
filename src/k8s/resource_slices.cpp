#include "sriovd/k8s/resource_slices.hpp"

#include <algorithm>
#include <set>

#include <spdlog/spdlog.h>

namespace sriovd::k8s {

using json = nlohmann::json;

namespace {

json attribute_json(const AttributeValue& v) {
  return std::visit(
      [](const auto& x) -> json {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::string>) return {{"string", x}};
        if constexpr (std::is_same_v<T, int64_t>) return {{"int", x}};
        if constexpr (std::is_same_v<T, bool>) return {{"bool", x}};
        if constexpr (std::is_same_v<T, Version>) return {{"version", x.value}};
      },
      v);
}

std::string query_escape(const std::string& s) {
  static const char* hex = "0123456789ABCDEF";
  std::string out;
  for (const unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

constexpr int kAttempts = 5;

// `have` says at least what `want` says: every member of `want` is in
// `have` with the same value (objects compared so, recursively; arrays
// element by element, of the same length). What the API server adds (a
// default, a field of a newer version) does not make a slice differ -
// else every sync would write a new generation.
bool covers(const json& have, const json& want) {
  if (want.is_object()) {
    if (!have.is_object()) return false;
    for (const auto& [k, v] : want.items())
      if (!have.contains(k) || !covers(have[k], v)) return false;
    return true;
  }
  if (want.is_array()) {
    if (!have.is_array() || have.size() != want.size()) return false;
    for (size_t i = 0; i < want.size(); ++i)
      if (!covers(have[i], want[i])) return false;
    return true;
  }
  return have == want;
}

// The devices' attributes are ours whole: one we no longer publish must go.
bool same_attributes(const json& have, const json& want) {
  const json& h = have["devices"];
  const json& w = want["devices"];
  if (!h.is_array() || h.size() != w.size()) return false;
  for (size_t i = 0; i < w.size(); ++i)
    if (h[i].value("attributes", json::object()) != w[i]["attributes"]) return false;
  return true;
}

}  // namespace

SlicePublisher::SlicePublisher(ApiClient& api, std::string driver, std::string node)
    : api_(api), driver_(std::move(driver)), node_(std::move(node)) {}

std::string SlicePublisher::slice_name(size_t index) const {
  std::string d = driver_;
  std::replace(d.begin(), d.end(), '.', '-');
  return node_ + "-" + d + "-" + std::to_string(index);
}

std::vector<json> SlicePublisher::desired(const std::vector<SliceDevice>& devices, int64_t generation,
                                          const std::string& node_uid) const {
  const size_t count = std::max<size_t>(1, (devices.size() + kMaxDevicesPerSlice - 1) / kMaxDevicesPerSlice);
  std::vector<json> out;
  for (size_t i = 0; i < count; ++i) {
    json devs = json::array();
    for (size_t k = i * kMaxDevicesPerSlice; k < std::min(devices.size(), (i + 1) * kMaxDevicesPerSlice); ++k) {
      json attrs = json::object();
      for (const auto& [name, value] : devices[k].attributes) attrs[name] = attribute_json(value);
      devs.push_back({{"name", devices[k].name}, {"attributes", attrs}});
    }
    out.push_back({{"apiVersion", "resource.k8s.io/v1"},
                   {"kind", "ResourceSlice"},
                   {"metadata",
                    {{"name", slice_name(i)},
                     {"ownerReferences", json::array({{{"apiVersion", "v1"},
                                                       {"kind", "Node"},
                                                       {"name", node_},
                                                       {"uid", node_uid},
                                                       {"controller", true}}})}}},
                   {"spec",
                    {{"driver", driver_},
                     {"nodeName", node_},
                     {"pool", {{"name", node_}, {"generation", generation}, {"resourceSliceCount", count}}},
                     {"devices", devs}}}});
  }
  return out;
}

std::vector<json> SlicePublisher::list() {
  const json reply = api_.get(std::string(kSlices) +
                              "?fieldSelector=" + query_escape("spec.driver=" + driver_ + ",spec.nodeName=" + node_));
  std::vector<json> out;
  for (const json& item : reply.value("items", json::array()))
    // The API server filtered; a stand-in or an old server might not have.
    if (item.contains("spec") && item["spec"].value("driver", "") == driver_ &&
        item["spec"].value("nodeName", "") == node_)
      out.push_back(item);
  return out;
}

std::string SlicePublisher::node_uid() {
  if (node_uid_.empty()) {
    const json node = api_.get("/api/v1/nodes/" + node_);
    node_uid_ = node.at("metadata").at("uid").get<std::string>();
  }
  return node_uid_;
}

bool SlicePublisher::publish(std::vector<SliceDevice> devices) {
  std::sort(devices.begin(), devices.end(), [](const SliceDevice& a, const SliceDevice& b) { return a.name < b.name; });
  for (int attempt = 1;; ++attempt) {
    const std::vector<json> existing = list();
    std::map<std::string, json> by_name;
    int64_t generation = 0;
    for (const json& s : existing) {
      by_name[s["metadata"]["name"].get<std::string>()] = s;
      generation = std::max(generation, s["spec"]["pool"].value("generation", int64_t{0}));
    }
    const std::string uid = node_uid();
    // As it is: nothing to write.
    std::vector<json> want = desired(devices, generation, uid);
    bool same = want.size() == existing.size();
    for (const json& w : want) {
      const auto it = by_name.find(w["metadata"]["name"].get<std::string>());
      same = same && it != by_name.end() && covers(it->second["spec"], w["spec"]) &&
             same_attributes(it->second["spec"], w["spec"]) &&
             covers(it->second["metadata"].value("ownerReferences", json::array()), w["metadata"]["ownerReferences"]) &&
             !it->second["metadata"].contains("deletionTimestamp");
    }
    if (same) {
      generation_ = generation;
      return false;
    }
    want = desired(devices, generation + 1, uid);
    try {
      std::set<std::string> wanted;
      for (json& w : want) {
        const std::string name = w["metadata"]["name"];
        wanted.insert(name);
        const auto it = by_name.find(name);
        if (it == by_name.end()) {
          (void)api_.create(kSlices, w);
        } else {
          w["metadata"]["resourceVersion"] = it->second["metadata"]["resourceVersion"];
          (void)api_.replace(std::string(kSlices) + "/" + name, w);
        }
      }
      for (const auto& [name, s] : by_name)
        if (!wanted.count(name))
          api_.remove(std::string(kSlices) + "/" + name, s["metadata"]["resourceVersion"].get<std::string>());
      generation_ = generation + 1;
      spdlog::info("kubernetes DRA: pool {} of {}: {} device(s) in {} slice(s), generation {}", node_, driver_,
                   devices.size(), want.size(), generation_);
      return true;
    } catch (const ApiError& e) {
      // Someone else wrote (or deleted) one meanwhile: read again and redo.
      if ((e.status() != 409 && e.status() != 404) || attempt >= kAttempts) throw;
      spdlog::info("kubernetes DRA: pool {}: {} - reading the slices again", node_, e.what());
    }
  }
}

size_t SlicePublisher::remove_all() {
  size_t n = 0;
  for (const json& s : list()) {
    try {
      api_.remove(std::string(kSlices) + "/" + s["metadata"]["name"].get<std::string>(),
                  s["metadata"]["resourceVersion"].get<std::string>());
      ++n;
    } catch (const ApiError& e) {
      if (e.status() != 404) throw;
    }
  }
  return n;
}

}  // namespace sriovd::k8s
