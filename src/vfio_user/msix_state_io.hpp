#pragma once
// A function's MSI-X state in bytes - virtio-pci's saved state
// (DeviceState::transport) and the VF proxy's handover part share it:
// Message Control, whether the table is the VMM's, then per vector its
// entry, its SET_IRQS mask and its pending bit.
#include <string>

#include "sriovd/msix/msix.hpp"
#include "sriovd/virtio/device.hpp"

namespace sriovd::vfio_user {

inline void write_msix(virtio::StateWriter& w, const msix::MsixState::Snapshot& m) {
  w.u16(m.control);
  w.u8(m.table_forwarded ? 1 : 0);
  w.u32(static_cast<uint32_t>(m.entries.size()));
  for (size_t v = 0; v < m.entries.size(); ++v) {
    w.u64(m.entries[v].address);
    w.u32(m.entries[v].data);
    w.u32(m.entries[v].control);
    w.u8(m.irq_masked[v]);
    w.u8(m.pending[v] ? 1 : 0);
  }
}

// Refuses (r.fail) a state of another number of vectors than `vectors`.
inline msix::MsixState::Snapshot read_msix(virtio::StateReader& r, size_t vectors) {
  msix::MsixState::Snapshot m;
  m.control = r.u16();
  m.table_forwarded = r.u8() != 0;
  if (const uint32_t n = r.u32(); n != vectors)
    r.fail(std::to_string(n) + " MSI-X vectors, this device has " + std::to_string(vectors));
  for (size_t v = 0; v < vectors; ++v) {
    m.entries.push_back({r.u64(), r.u32(), r.u32()});
    m.irq_masked.push_back(r.u8() != 0 ? 1 : 0);
    m.pending.push_back(r.u8() != 0);
  }
  return m;
}

}  // namespace sriovd::vfio_user
