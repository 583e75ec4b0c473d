#pragma once
// What the routing engine asks of an interrupt source, on its own so that
// a device (vfio/device.hpp) can offer it without the whole engine.

namespace sriovd::irq {

// Points a device's vector at an eventfd: VFIO_DEVICE_SET_IRQS with one
// eventfd, or the simulated VF's equivalent. Called on the control plane
// and on mode switches, never per interrupt.
class SourceBinder {
 public:
  virtual ~SourceBinder() = default;
  virtual void bind(unsigned vector, int eventfd) = 0;
};

}  // namespace sriovd::irq
