// MSI-X (PCI Local Bus 3.0 §6.8.2) as a guest drives it, checked against a
// model of the spec kept here: table, PBA and Message Control accesses of
// any offset and size (through the MSI-X state and through the virtual
// config space that owns Message Control), vfio-user SET_IRQS masks,
// function resets, and interrupts firing at any time. After every step:
//  - the engine's view of each vector's mask (what VectorControl was told)
//    is the effective mask: MSI-X disabled, function masked, SET_IRQS
//    masked, or the vector's Mask Bit once the client wrote the table;
//  - a table or PBA read returns what the model says (all ones for an
//    access the spec does not allow), the PBA bit is the latched interrupt,
//    writes to the PBA and to read-only bits change nothing;
//  - a vector unmasked with its pending bit set delivers once and clears it;
//  - the config space's identity never changes, and its Message Control is
//    the MSI-X state's.
// A difference aborts: it is a finding, as a crash is.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "fuzz/input.hpp"
#include "sriovd/msix/msix.hpp"
#include "sriovd/pci/config_space.hpp"
#include "sriovd/pci/virtual_config.hpp"

namespace {

using namespace sriovd;

void check(bool ok) {
  if (!ok) std::abort();
}

// The interrupt side, as the routing engine behaves: a fire on a masked
// vector latches its pending bit; an unmask delivers what is pending.
class Engine : public msix::VectorControl {
 public:
  explicit Engine(unsigned n) : masked(n, false), pending_(n, false), delivered(n, 0) {}
  void set_masked(unsigned v, bool m) override {
    check(v < masked.size());
    masked[v] = m;
    if (!m && pending_[v]) {
      pending_[v] = false;
      ++delivered[v];
    }
  }
  [[nodiscard]] bool pending(unsigned v) const override { return pending_.at(v); }
  void clear_pending(unsigned v) override { pending_.at(v) = false; }
  void fire(unsigned v) {
    if (masked[v])
      pending_[v] = true;
    else
      ++delivered[v];
  }
  std::vector<bool> masked;
  std::vector<bool> pending_;
  std::vector<uint64_t> delivered;
};

// The spec's table, written by the harness from the same accesses.
struct Model {
  explicit Model(unsigned n) : entries(n), irq_masked(n, false) {}
  struct Entry {
    uint64_t address = 0;
    uint32_t data = 0;
    uint32_t control = 1;  // masked after reset (§6.8.2.9)
  };
  // msix.hpp: the Mask Bit counts once the client has written the table;
  // a SET_IRQS mask is a mask of its own.
  [[nodiscard]] bool effective(unsigned v) const {
    return !enable || fmask || irq_masked[v] || (forwarded && (entries[v].control & 1U));
  }
  [[nodiscard]] uint32_t dword(unsigned v, unsigned d) const {
    const Entry& e = entries[v];
    return d == 0   ? static_cast<uint32_t>(e.address)
           : d == 1 ? static_cast<uint32_t>(e.address >> 32U)
           : d == 2 ? e.data
                    : e.control;
  }
  void write_dword(unsigned v, unsigned d, uint32_t value) {
    Entry& e = entries[v];
    if (d == 0) e.address = (e.address & 0xffffffff00000000ULL) | (value & ~3U);  // DWORD-aligned address
    if (d == 1) e.address = (e.address & 0xffffffffULL) | (static_cast<uint64_t>(value) << 32U);
    if (d == 2) e.data = value;
    if (d == 3) e.control = value & 1U;  // bits 31:1 reserved
  }
  std::vector<Entry> entries;
  std::vector<bool> irq_masked;
  bool forwarded = false;
  bool enable = false;
  bool fmask = false;
};

bool aligned(uint64_t offset, unsigned size, uint64_t limit) {
  return (size == 1 || size == 2 || size == 4 || size == 8) && offset % size == 0 && offset + size <= limit;
}

uint64_t ones(unsigned size) { return size >= 8 ? ~0ULL : (1ULL << (8U * size)) - 1U; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  // 1..2048 vectors, mostly few (the PBA's second QWORD starts at 65).
  const uint8_t pick = in.byte();
  const unsigned n = pick < 200 ? 1U + pick % 80U : 1U + (in.take<uint16_t>() % 2048U);
  Engine engine(n);
  msix::MsixState msix(static_cast<uint16_t>(n), engine);
  Model model(n);

  pci::EndpointSpec spec;
  spec.vendor = 0x8086;
  spec.device = 0x154c;
  spec.class_code = 0x020000;
  spec.msix_vectors = static_cast<uint16_t>(n);
  spec.msix_bir = 0;
  spec.msix_pba_offset = 0x8000;
  const std::vector<uint8_t> bytes = pci::make_endpoint_config(spec);
  const auto layout = pci::find_msix(bytes);
  check(layout.has_value());
  std::array<pci::BarInfo, 6> bars{};
  bars[0] = {0x10000, false, true, false};
  pci::VirtualConfig config(bytes, bars, &msix, [](uint16_t) {});
  const uint32_t control_at = layout->cap_offset + 2U;

  const auto verify = [&] {
    for (unsigned v = 0; v < n; ++v) {
      check(engine.masked[v] == model.effective(v));
      check(msix.effectively_masked(v) == model.effective(v));
    }
    check(msix.enabled() == model.enable && msix.function_masked() == model.fmask);
    check(config.read(0, 4) == 0x154c8086U);
    check(config.read(control_at, 2) == msix.read_message_control());
    check((msix.read_message_control() & msix::kTableSizeMask) == n - 1U);
  };
  verify();

  static constexpr unsigned kSizes[] = {1, 2, 4, 8, 3, 16};
  while (!in.empty()) {
    const uint8_t op = in.byte() % 9U;
    const unsigned sz = kSizes[in.byte() % 6U];
    switch (op) {
      case 0: {  // table write
        const uint64_t off = in.take<uint16_t>() % (msix.table_bytes() + 32U);
        const uint64_t value = in.take<uint64_t>();
        msix.write_table(off, sz, value);
        if ((sz == 4 || sz == 8) && aligned(off, sz, msix.table_bytes())) {
          model.forwarded = true;
          const auto v = static_cast<unsigned>(off / 16U);
          const auto d = static_cast<unsigned>((off % 16U) / 4U);
          model.write_dword(v, d, static_cast<uint32_t>(value));
          if (sz == 8) model.write_dword(v, d + 1, static_cast<uint32_t>(value >> 32U));
        }
        break;
      }
      case 1: {  // table read
        const uint64_t off = in.take<uint16_t>() % (msix.table_bytes() + 32U);
        const uint64_t got = msix.read_table(off, sz);
        if (!aligned(off, sz, msix.table_bytes())) {
          check(got == ones(sz));
        } else {
          const auto v = static_cast<unsigned>(off / 16U);
          const auto d = static_cast<unsigned>((off % 16U) / 4U);
          uint64_t want;
          if (sz == 8)
            want = model.dword(v, d) | (static_cast<uint64_t>(model.dword(v, d + 1)) << 32U);
          else
            want = (model.dword(v, d) >> (8U * (off % 4U))) & ones(sz);
          check(got == want);
        }
        break;
      }
      case 2: {  // PBA read: the latched bits, nothing else
        const uint64_t off = in.take<uint16_t>() % (msix.pba_bytes() + 16U);
        const uint64_t got = msix.read_pba(off, sz);
        if (!aligned(off, sz, msix.pba_bytes())) {
          check(got == ones(sz));
        } else {
          uint64_t want = 0;
          for (unsigned i = 0; i < sz * 8U; ++i) {
            const uint64_t v = off * 8U + i;
            if (v < n && engine.pending_[v]) want |= 1ULL << i;
          }
          check(got == want);
        }
        break;
      }
      case 3: {  // PBA write: read-only
        const std::vector<bool> before = engine.pending_;
        msix.write_pba(in.take<uint16_t>() % (msix.pba_bytes() + 16U), sz, in.take<uint64_t>());
        check(engine.pending_ == before);
        break;
      }
      case 4: {  // Message Control through config space, as the guest writes it
        const uint16_t value = in.take<uint16_t>();
        const bool was = model.enable;
        config.write(control_at, 2, value);
        model.enable = value & msix::kEnable;
        model.fmask = value & msix::kFunctionMask;
        if (!was && model.enable)  // latched while disabled: not owed (msix.cpp)
          for (unsigned v = 0; v < n; ++v) check(!engine.pending_[v]);
        break;
      }
      case 5: {  // any config space access
        const uint32_t off = in.take<uint16_t>() % 4200U;
        const uint32_t value = in.take<uint32_t>();
        if (in.byte() & 1U) {
          (void)config.read(off, sz);
        } else if (off + sz <= control_at || off >= control_at + 2U) {
          config.write(off, sz, value);  // Message Control is op 4's, so the model stays exact
        }
        break;
      }
      case 6: {  // vfio-user SET_IRQS MASK/UNMASK
        const unsigned v = in.take<uint16_t>() % n;
        const bool masked = in.byte() & 1U;
        msix.set_vector_mask(v, masked);
        model.irq_masked[v] = masked;
        break;
      }
      case 7: {  // the device fires
        const unsigned v = in.take<uint16_t>() % n;
        const bool was_pending = engine.pending_[v];
        const uint64_t was_delivered = engine.delivered[v];
        engine.fire(v);
        check(model.effective(v) ? engine.pending_[v] : engine.delivered[v] == was_delivered + 1 && !was_pending);
        break;
      }
      case 8:  // function reset (DEVICE_RESET)
        msix.reset();
        model = Model(n);
        for (unsigned v = 0; v < n; ++v) check(!engine.pending_[v]);
        break;
    }
    verify();
  }
  return 0;
}
