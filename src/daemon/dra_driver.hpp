#pragma once
// The daemon's side of the Kubernetes DRA driver (kubernetes.dra): what a
// claim means for the host. The kubelet's gRPC threads ask to prepare and
// unprepare claims; the claim is read from the API server there, and what
// it does to the host runs on the control thread (the one that owns the
// host and the exports), waited for within the kubelet's deadline.
//
// A prepared claim is recorded in <state_dir>/dra-claims.json before the
// host is changed for it, and dropped only after the host is restored:
// the daemon's config is the file's with the recorded claims' VFs in it
// (config::with_claims), so a restart, an upgrade or a crash at any point
// converges the host to the claims recorded, and the kubelet's repeated
// prepare (or its unprepare) finishes what was under way.
//
// A sync thread keeps the node's ResourceSlices and the devices' health
// as the host is (published again when they change or disappear, with
// backoff while the API server is away) and, at the start, unprepares a
// recorded claim whose ResourceClaim is gone.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "sriovd/config/claim.hpp"
#include "sriovd/control/protocol.hpp"
#include "sriovd/k8s/api_client.hpp"
#include "sriovd/k8s/dra.hpp"
#include "sriovd/k8s/resource_slices.hpp"
#include "sriovd/util/asio.hpp"

namespace sriovd::daemon {

// One prepared claim as recorded.
struct ClaimRecord {
  k8s::ClaimRef ref;
  std::vector<config::ClaimedVf> vfs;
  std::vector<k8s::PreparedDevice> devices;
};

// The record file: read (throws std::runtime_error naming the file and the
// entry) and written atomically.
std::vector<ClaimRecord> read_claim_records(const std::string& path);
void write_claim_records(const std::string& path, const std::vector<ClaimRecord>& records);

// Where the API server is: kubernetes.dra.kubeconfig, else $KUBECONFIG,
// else the pod's service account. Throws naming what is missing.
k8s::ApiConfig dra_api_config(const config::Dra& dra);

// "vf-0000-3b-02-0": a VF's device name in the slices (a DNS label).
std::string dra_device_name(const PciAddress& vf);

class DraDriver final : public k8s::ClaimHandler {
 public:
  struct Hooks {
    // On the control thread: the host converged to the file's config with
    // these claims' VFs in it; throws (the host as it was) when it cannot.
    std::function<void(const std::vector<config::ClaimedVf>&)> apply_claims;
  };

  // The records are the daemon's (read at its start). Serves the kubelet's
  // APIs and starts the sync thread. Throws naming what cannot be set up
  // (the kubeconfig, a socket).
  DraDriver(asio::io_context& control, const config::Config& yaml, std::vector<ClaimRecord> records, Hooks hooks);
  ~DraDriver() override;
  DraDriver(const DraDriver&) = delete;
  DraDriver& operator=(const DraDriver&) = delete;

  // The claims recorded now (the control thread's).
  [[nodiscard]] std::vector<config::ClaimedVf> claimed() const;
  // On the control thread, after a reload or as the host changes: the
  // devices offered (the file's config and the host's `devices` view), their
  // health; published by the sync thread when they differ.
  void update(const config::Config& yaml, const control::json& devices, const std::string& sysfs_root);
  // The driver is removed from the config: its slices go (bounded by the
  // API client's timeout).
  void remove_slices();
  // Stops taking claims (the daemon stops): calls under way answer an error.
  void stop();

  [[nodiscard]] control::json status() const;
  [[nodiscard]] control::json claims_json() const;

  std::vector<k8s::PreparedDevice> prepare(const k8s::ClaimRef& claim,
                                           std::chrono::steady_clock::time_point deadline) override;
  void unprepare(const k8s::ClaimRef& claim, std::chrono::steady_clock::time_point deadline) override;

 private:
  struct Offered {
    std::string name;  // dra_device_name
    config::PfRef pf;
    uint16_t index = 0;
    PciAddress address;
    int iommu_group = -1;
  };
  // What a claim's allocation asks of this driver, read from the API server.
  struct Allocated {
    std::string device;
    std::string request;
    config::ClaimVfConfig config;
  };
  std::vector<Allocated> read_claim(const k8s::ClaimRef& ref);
  // Runs `fn` on the control thread and waits for it until `deadline`; a
  // task not started by then never runs. Throws what `fn` threw.
  template <typename R>
  R on_control(std::function<R()> fn, std::chrono::steady_clock::time_point deadline, const std::string& what);
  std::vector<k8s::PreparedDevice> prepare_on_control(const k8s::ClaimRef& ref, const std::vector<Allocated>& alloc);
  void unprepare_on_control(const std::string& uid);
  void save() const;
  void write_cdi(const ClaimRecord& r) const;
  void remove_cdi(const std::string& uid) const;
  [[nodiscard]] std::string cdi_path(const std::string& uid) const;
  [[nodiscard]] std::string socket_for(const std::string& uid, const std::string& device) const;
  void sync_loop();
  void kick();

  asio::io_context& io_;
  Hooks hooks_;
  std::string driver_, node_, records_path_, cdi_dir_, socket_dir_;
  // The control thread's.
  std::vector<ClaimRecord> records_;
  std::vector<Offered> offered_;
  // Each device's health and the Unix time it last changed.
  std::map<std::string, std::pair<bool, int64_t>> health_since_;
  std::unique_ptr<k8s::ApiClient> api_;
  std::unique_ptr<k8s::DraPlugin> plugin_;

  // Between the control thread and the sync thread.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<k8s::SliceDevice> slice_devices_;
  bool devices_known_ = false;
  bool kicked_ = false;
  bool stopping_ = false;
  bool published_once_ = false;
  std::string sync_error_;
  uint64_t publishes_ = 0, sync_errors_ = 0, stale_unprepared_ = 0;
  std::atomic<bool> taking_{true};
  std::thread sync_;
};

}  // namespace sriovd::daemon
