#include <stdexcept>

#include "sriovd/vfio/device.hpp"

namespace sriovd::vfio {

MsixVectors::MsixVectors(Device& device) : device_(device), info_(device.irq(kMsixIrq)) {
  if (info_.count == 0) throw std::runtime_error(device.name() + " has no MSI-X vectors");
  if (!info_.eventfd()) throw std::runtime_error(device.name() + ": MSI-X does not signal eventfds");
}

// Enables `fds_` as the vector set: vectors from `had` on are new. With
// NORESIZE (or nothing enabled yet) that is one SET_IRQS for all of them,
// after a disable if some were enabled; otherwise only the new ones.
void MsixVectors::grow(size_t had) {
  if (had > 0 && !info_.noresize()) {
    device_.set_irq_eventfds(kMsixIrq, static_cast<uint32_t>(had), std::span<const int>(fds_).subspan(had));
    return;
  }
  if (had > 0) {
    device_.disable_irqs(kMsixIrq);
    ++reenables_;
  }
  device_.set_irq_eventfds(kMsixIrq, 0, fds_);
}

void MsixVectors::reserve(unsigned count) {
  std::lock_guard lock(mutex_);
  if (count > info_.count)
    throw std::out_of_range(device_.name() + ": " + std::to_string(count) + " MSI-X vectors asked, " +
                            std::to_string(info_.count) + " exist");
  if (count <= fds_.size()) return;
  const size_t had = fds_.size();
  fds_.resize(count, -1);
  grow(had);
}

void MsixVectors::bind(unsigned vector, int eventfd) {
  std::lock_guard lock(mutex_);
  if (vector < fds_.size()) {
    fds_[vector] = eventfd;
    const int one[1] = {eventfd};
    device_.set_irq_eventfds(kMsixIrq, vector, one);
    return;
  }
  if (eventfd < 0) return;  // not enabled: nothing to release
  if (vector >= info_.count) throw std::out_of_range(device_.name() + ": no MSI-X vector " + std::to_string(vector));
  const size_t had = fds_.size();
  fds_.resize(vector + 1, -1);
  fds_[vector] = eventfd;
  grow(had);
}

void MsixVectors::adopt_enabled(unsigned count) {
  std::lock_guard lock(mutex_);
  if (count > info_.count)
    throw std::invalid_argument(device_.name() + ": " + std::to_string(count) + " MSI-X vectors enabled, " +
                                std::to_string(info_.count) + " exist");
  fds_.assign(count, -1);
}

void MsixVectors::disable() {
  std::lock_guard lock(mutex_);
  if (fds_.empty()) return;
  device_.disable_irqs(kMsixIrq);
  fds_.clear();
}

}  // namespace sriovd::vfio
