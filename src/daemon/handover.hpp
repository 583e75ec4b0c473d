#pragma once
// An upgrade in place (`sriovctl upgrade`): the running sriovd hands what
// the VMs depend on to its successor, which it becomes by exec'ing the
// (new) binary with the same PID - systemd's unit sees a reload, not a
// restart. What is handed over travels as inherited fds and a manifest in
// a memfd whose fd the successor is given (--handover-fd). The manifest is
// versioned: a successor that cannot read it is found out before the exec
// (--handover-version), and the upgrade is refused while the running one
// goes on.
//
// Handed over today: each virtio device's transport - a vhost-user
// back-end (its socket, connection, memory, rings, eventfds and device
// state: vhost_user::BackendHandover) or a virtio-pci device's vfio-user
// server (socket, connection, DMA windows, doorbells, MSI-X eventfds and
// the device's state: vfio_user::ServerHandover) - and a tap port's queue
// fds, and each VF export (its server's part and the VFIO device as the
// kernel holds it: container, group and device fds, MSI-X left on, the
// IOMMU's mappings kept). The rest is made anew by the successor as at any
// start (the host is already as the config says: the journal's converge
// finds nothing to do); other ports are opened again.
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sriovd/control/protocol.hpp"
#include "sriovd/util/fd.hpp"
#include "sriovd/vfio_user/server.hpp"
#include "sriovd/vhost_user/backend.hpp"

namespace sriovd::daemon {

// What this sriovd writes; it reads this and every older one (1: vhost-user
// devices only; 2: virtio-pci over vfio-user too; 3: device states of
// frame version 2 - part versions and a checksum - which an sriovd that
// reads at most 2 cannot parse).
inline constexpr uint32_t kHandoverVersion = 3;
inline constexpr uint32_t kOldestHandoverRead = 1;
// `--handover-version`'s answer: the versions read, space-separated ("1 2").
std::string handover_versions_read();
// Whether a successor's answer `reads` names `version`.
bool reads_handover_version(const std::string& reads, uint32_t version);

// One virtio device's part.
struct HandedVirtio {
  std::string name;
  std::string socket;
  // Its transport's part: a vhost-user back-end's, or (pci) the vfio-user
  // server's of a virtio-pci device.
  bool pci = false;
  vhost_user::BackendHandover backend;
  vfio_user::ServerHandover server;
  std::string tap;  // the tap's name when its queue fds are handed over
  std::vector<UniqueFd> tap_fds;
  std::string macvtap_lower;  // set: the tap is a macvtap (its link stays) on this netdev
};

// One VF export's part: its server's, whose device part carries the VFIO
// device (vfio_user::VfProxy::freeze_for_handover).
struct HandedVf {
  std::string vf;  // the VF's PCI address
  std::string socket;
  vfio_user::ServerHandover server;
};

struct Handover {
  int from_pid = 0;
  std::vector<HandedVirtio> virtio;
  std::vector<HandedVf> vf_exports;
  // host: simulated - the simulated kernel (SimulatedKernel::save), which
  // a real host's kernel keeps by itself.
  std::string simulated_host;

  // Into a sealed memfd; every fd it names is made inheritable (the
  // caller exec's next, or calls keep_from_exec() if it does not).
  // `aliases` (fd -> an fd of the same file) is for the fd store.
  [[nodiscard]] UniqueFd write(const std::map<int, int>& aliases = {}) const;
  void keep_from_exec() const;
  // Every fd it holds.
  [[nodiscard]] std::vector<int> fd_numbers() const;
  // The successor's: the manifest at `fd` and the fds it names, taken
  // (close-on-exec again). Throws std::runtime_error naming what is wrong;
  // the fds it took by then are closed.
  static Handover read(int fd);

  // systemd's fd store (FDSTORE=1; a unit with FileDescriptorStoreMax):
  // the manifest and every fd it names are stored under names of their
  // own ("manifest", "fd<N>" for the fd the manifest calls N), so the
  // successor systemd starts gets them back whatever their order and
  // numbers. Throws std::runtime_error when the manager refuses.
  void store() const;
  static Handover read_mapped(int fd, const std::function<int(int)>* remap);
  // The successor's: the fds systemd passed (sd_listen_fds_with_names);
  // nullopt when there is no manifest among them. Takes them out of the
  // store again (FDSTOREREMOVE): a handover is taken once.
  static std::optional<Handover> from_fd_store();
  // What it holds, for the log and `status`.
  [[nodiscard]] control::json summary() const;
};

}  // namespace sriovd::daemon
