#pragma once
// The owner of the VF exports (assign.export: vfio-user): for each VF the
// config exports, its VFIO device behind a vfio-user proxy (MSI-X emulated,
// on the shared interrupt engine) and the proxy's server; made, kept or
// closed as the config and the host change, shown in `devices` and in
// Prometheus. It remembers which processes were given a VF's device fd
// (bar_access: mmap), past the export, for the host layer's question before
// it unbinds a VF. On the control thread, as the daemon that owns it; each
// export's proxy and server live on the session thread it is given.

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <prometheus/metric_family.h>

#include "sriovd/config/config.hpp"
#include "sriovd/control/protocol.hpp"
#include "sriovd/irq/engine.hpp"
#include "sriovd/util/asio.hpp"
#include "sriovd/util/pci_address.hpp"
#include "sriovd/util/session_threads.hpp"
#include "sriovd/vfio/holders.hpp"
#include "sriovd/vfio_user/server.hpp"
#include "sriovd/vfio_user/vf_proxy.hpp"

#include "handover.hpp"

namespace sriovd::daemon {

class HostService;

class VfExports {
 public:
  // `sysfs_root` resolves a PF the config names by netdev (system mode).
  // Each export is served on a thread of `sessions` (util/session_threads.hpp).
  VfExports(SessionPool& sessions, irq::Engine& engine, HostService& host, std::string sysfs_root);
  ~VfExports();
  VfExports(const VfExports&) = delete;
  VfExports& operator=(const VfExports&) = delete;

  // Exports what `cfg` asks for and is not exported yet (a VF that was
  // released, or that the host does not have, is skipped); running ones
  // get the config's socket access.
  void sync(const config::Config& cfg);
  // Closes the exports `next` does not keep as they are (all of them when
  // next is null): a VF must be out of sriovd's hands before the host
  // layer may unbind or destroy it. `current` is the running config.
  void drop(const config::Config* next, const config::Config& current);
  // Closes the exports of these VFs of `pf` (sriovctl release).
  void release(const PciAddress& pf, const std::vector<unsigned>& indices);
  // The host layer's question before it unbinds a VF from vfio-pci: who
  // still holds its VFIO device ("" when nobody).
  std::string release_holders(const PciAddress& vf);
  // Runs `fn` with the proxy of VF `device` (its address) on the export's
  // session thread; false with why when it is not served or not exported.
  bool with_proxy(const std::string& device, std::string& why, const std::function<void(vfio_user::VfProxy&)>& fn);

  [[nodiscard]] control::json exports_json() const;
  // An upgrade in place (handover.hpp): every served export is frozen and
  // its part returned; one that cannot be handed over now throws
  // HandoverRefused naming it, with every export serving again (with
  // `force`: it is left out, named in `cut`). thaw():
  // the handover did not happen. handed_over(): it did. take_handover():
  // the successor's, before sync(), which takes over what fits the config
  // (the same VF on the same socket) instead of opening the VF.
  std::vector<HandedVf> freeze_for_handover(bool force, std::vector<std::string>& cut);
  void thaw();
  void handed_over();
  void take_handover(std::vector<HandedVf> handed) { handed_ = std::move(handed); }
  // VFs no export serves any more whose device fd a VMM still holds.
  [[nodiscard]] control::json held_json() const;
  void metrics(std::vector<prometheus::MetricFamily>& out) const;

 private:
  struct Export {
    PciAddress pf;
    unsigned index = 0;
    std::string vf;  // its PCI address
    std::string socket;
    irq::Policy policy = irq::Policy::adaptive;
    config::BarAccess bar_access = config::BarAccess::trapped;
    // The session thread that serves it; the proxy and server are made,
    // used and deleted there (declared after it: deleted before it goes).
    SessionPool::Lease thread;
    OnSession<vfio_user::VfProxy> proxy;
    OnSession<vfio_user::Server> server;
    std::string not_served;  // why, when it is not served
  };
  struct WantedExport {
    PciAddress pf;
    unsigned index;
    const config::PfConfig* pf_cfg;
    const config::VfAssign* assign;
  };
  std::vector<WantedExport> wanted(const config::Config& cfg);
  void forget(const Export& e);
  void end(Export& e);
  // The clients given the VF's device fd (on the export's thread).
  static std::vector<pid_t> fd_recipients(const Export& e);
  // Who holds the fds given for `vf`, as the last survey saw it (never a
  // /proc walk here: a status is built for every scrape).
  [[nodiscard]] std::string surveyed_holders(const std::string& vf) const;

  SessionPool& sessions_;
  irq::Engine& engine_;
  HostService& host_;
  std::string sysfs_root_;
  std::vector<Export> exports_;
  // Handed over by the predecessor, until sync() takes them.
  std::vector<HandedVf> handed_;
  // Pids given a VF's device fd (bar_access: mmap), by VF address, kept
  // past the export: such a VMM may hold the VF after it disconnects.
  std::map<std::string, std::vector<pid_t>> fd_given_;
  // Who holds those fds, surveyed on a thread of its own (a /proc walk of
  // every process costs seconds on a busy host).
  std::unique_ptr<vfio::HolderSurvey> holder_survey_ = std::make_unique<vfio::HolderSurvey>();
};

}  // namespace sriovd::daemon
