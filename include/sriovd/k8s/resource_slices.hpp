#pragma once
// The DRA driver's ResourceSlices (resource.k8s.io/v1): one pool per node,
// named after the node, its devices in slices of at most 128, each slice
// owned by the Node (deleted with it), `generation` raised whenever the
// pool changes and `resourceSliceCount` the number of slices of that
// generation. Published by reconciling with what the API server has: a
// slice that went (the kubelet deletes a node's slices when it starts, a
// driver's some time after it disconnects) is made again, one that is
// not ours to keep is deleted, every update and delete with the
// resourceVersion it was read at (a conflict: read again and redo).
#include <map>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "sriovd/k8s/api_client.hpp"

namespace sriovd::k8s {

// A device attribute's value: string, int, bool or version (semver).
struct Version {
  std::string value;
  bool operator==(const Version&) const = default;
};
using AttributeValue = std::variant<std::string, int64_t, bool, Version>;

struct SliceDevice {
  std::string name;  // a DNS label: "vf-0000-3b-02-0"
  // Qualified names: "sriovd.io/pciAddress", "resource.kubernetes.io/pcieRoot".
  std::map<std::string, AttributeValue> attributes;
  bool operator==(const SliceDevice&) const = default;
};

inline constexpr size_t kMaxDevicesPerSlice = 128;

class SlicePublisher {
 public:
  SlicePublisher(ApiClient& api, std::string driver, std::string node);

  // Makes the API server's slices of this driver and node say `devices`
  // (sorted by name). Returns true when it wrote anything. Throws ApiError
  // / ApiUnreachable (the caller retries with backoff).
  bool publish(std::vector<SliceDevice> devices);
  // Every slice of this driver and node, deleted (the driver is removed
  // from the config). Returns how many.
  size_t remove_all();

  // The slices as they should be now (for tests and `status`).
  [[nodiscard]] std::vector<nlohmann::json> desired(const std::vector<SliceDevice>& devices, int64_t generation,
                                                    const std::string& node_uid) const;
  [[nodiscard]] int64_t generation() const { return generation_; }
  [[nodiscard]] std::string slice_name(size_t index) const;

  static constexpr const char* kSlices = "/apis/resource.k8s.io/v1/resourceslices";

 private:
  std::vector<nlohmann::json> list();
  std::string node_uid();
  ApiClient& api_;
  std::string driver_, node_, node_uid_;
  int64_t generation_ = 0;
};

}  // namespace sriovd::k8s
