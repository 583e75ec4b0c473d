#pragma once
// sriovd as a Kubernetes DRA driver, the kubelet's side: registration with
// the kubelet's plugin watcher (pluginregistration v1: a socket in its
// registry directory answering GetInfo with type "DRAPlugin", the driver's
// name, its service socket and "v1.DRAPlugin"), the DRAPlugin service
// (NodePrepareResources / NodeUnprepareResources, each claim answered on
// its own, within the kubelet's 45 s) and the DRAResourceHealth service
// (v1alpha1, what a 1.34 kubelet opens, and v1) on that service socket.
//
// Sockets are per instance (kubelet 1.33+'s rolling-update naming):
// <registry_dir>/<driver>-<instance>-reg.sock and
// <plugins_dir>/<driver>/dra-<instance>.sock, so that a new sriovd
// registers before the old one leaves; each instance removes its own
// sockets when it stops. Both are made again when they disappear (the
// kubelet wipes its directories when it starts) and the registration
// socket when the kubelet refuses a registration (after a backoff; its
// plugin watcher then tries again).
//
// What a claim means for the host is the ClaimHandler's (the daemon's).
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace sriovd::k8s {

struct ClaimRef {
  std::string ns;
  std::string name;
  std::string uid;
};

struct PreparedDevice {
  std::vector<std::string> request_names;
  std::string pool;
  std::string device;
  std::vector<std::string> cdi_device_ids;
  bool operator==(const PreparedDevice&) const = default;
};

// Called on the gRPC threads, one claim at a time, with the time the call
// has left. Idempotent: a claim prepared again answers the same and changes
// nothing. Throws std::exception whose message is that claim's error.
class ClaimHandler {
 public:
  virtual ~ClaimHandler() = default;
  virtual std::vector<PreparedDevice> prepare(const ClaimRef& claim,
                                              std::chrono::steady_clock::time_point deadline) = 0;
  virtual void unprepare(const ClaimRef& claim, std::chrono::steady_clock::time_point deadline) = 0;
};

struct DeviceHealth {
  std::string pool;
  std::string device;
  bool healthy = false;
  std::string message;  // why it is unhealthy, for the kubelet (<= 1024 characters)
  int64_t since = 0;    // Unix seconds of the last change
  bool operator==(const DeviceHealth&) const = default;
};

class DraPlugin {
 public:
  struct Options {
    std::string driver;  // a DNS subdomain: "sriovd.io"
    std::string registry_dir = "/var/lib/kubelet/plugins_registry";
    std::string plugins_dir = "/var/lib/kubelet/plugins";
    std::string instance;  // this process's: the sockets' names
    // Of the kubelet's 45 s per call: what the claims may take in all; a
    // claim not started by then is answered with a timeout error.
    std::chrono::milliseconds call_budget{40000};
  };

  // Serves and registers at once. Throws std::runtime_error naming the
  // socket that cannot be made.
  DraPlugin(Options options, ClaimHandler& handler);
  ~DraPlugin();  // stops serving and removes this instance's sockets
  DraPlugin(const DraPlugin&) = delete;
  DraPlugin& operator=(const DraPlugin&) = delete;

  // Every device's health as it is now; streamed to the kubelet's
  // watchers when it differs from what they have.
  void set_health(std::vector<DeviceHealth> devices);

  [[nodiscard]] std::string registration_socket() const;
  [[nodiscard]] std::string service_socket() const;
  // registered, registrations, refusals, sockets made again, prepares,
  // unprepares, claim errors, health watchers.
  [[nodiscard]] nlohmann::json status() const;

  static constexpr const char* kServiceVersion = "v1.DRAPlugin";

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sriovd::k8s
