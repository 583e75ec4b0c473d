#pragma once
// What the virtio-net driver needs of the transport that carries its device
// (virtio 1.2 §4): virtio-pci over vfio-user (pci_transport.cpp) or
// vhost-user, as the VMM's front-end (vhost_user_transport.cpp). The driver
// owns guest RAM, the rings and the buffers and calls these in this order:
// negotiate, queue_pairs, share, start; then notify and poll while it runs.

#include <poll.h>

#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "sriovd/guest/virtio_net_driver.hpp"
#include "sriovd/util/fd.hpp"
#include "sriovd/virtio/ring.hpp"

namespace sriovd::guest {

struct GuestRam {
  int fd = -1;
  uint8_t* host = nullptr;
  uint64_t size = 0;
};

struct QueueSetup {
  unsigned index = 0;   // the device's queue index
  unsigned vector = 0;  // its interrupt: an index into Started::interrupts
  uint16_t size = 0;
  virtio::RingAddresses rings;  // in the addresses the device is given
};

class Transport {
 public:
  virtual ~Transport() = default;

  // Offers `want` and what this transport adds of its own (virtio-pci: MAC,
  // MTU, status, the control queue and MQ as asked; vhost-user:
  // ACCESS_PLATFORM behind an IOMMU); returns what was agreed. Throws naming
  // the step or the feature that is missing.
  virtual uint64_t negotiate(uint64_t want) = 0;
  // The queue pairs the device gives of `asked`, with `features` agreed.
  virtual unsigned queue_pairs(uint64_t features, unsigned asked) = 0;
  // The control queue's index with `pairs` pairs.
  virtual unsigned control_queue(unsigned pairs) = 0;
  // Shares guest RAM with the device; returns where it starts in the
  // addresses the device is given.
  virtual uint64_t share(const GuestRam& ram) = 0;
  struct Started {
    std::vector<UniqueFd> interrupts;  // per vector
    std::vector<UniqueFd> doorbells;   // per queue index, where the transport has them
  };
  // Hands the device its queues and starts it.
  virtual Started start(std::span<const QueueSetup> queues) = 0;
  // Notifies queue q when it has no doorbell eventfd.
  virtual void notify(unsigned q) = 0;
  // Masks or unmasks interrupt vector v (virtio-pci: its MSI-X Vector
  // Control); a transport without per-vector masks throws.
  virtual void mask_vector(unsigned /*v*/, bool /*masked*/) {
    throw std::runtime_error("this transport has no interrupt vectors to mask");
  }
  // poll() on `fds`, serving meanwhile what the transport must serve (the
  // vhost-user IOTLB misses).
  virtual int poll(pollfd* fds, nfds_t count, int timeout_ms) { return ::poll(fds, count, timeout_ms); }
  virtual std::string mac() = 0;
  // Live migration, the VMM's part on the destination (virtio-pci over
  // vfio-user): the device is now the one `to` reaches, its state the
  // source's. Guest RAM shared with it at the same address, its MSI-X
  // vectors wired to the same `interrupts`; returns its doorbells.
  virtual std::vector<UniqueFd> moved_to(VfioUserClient& /*to*/, const GuestRam& /*ram*/,
                                         std::span<const UniqueFd> /*interrupts*/) {
    throw std::runtime_error("this transport does not migrate");
  }
};

class VfioUserClient;
std::unique_ptr<Transport> make_pci_transport(VfioUserClient& client, const VirtioNetDriverOptions& options,
                                              VirtioNetDriverStats& stats);
std::unique_ptr<Transport> make_vhost_user_transport(std::string socket, const VirtioNetDriverOptions& options,
                                                     VirtioNetDriverStats& stats);

}  // namespace sriovd::guest
