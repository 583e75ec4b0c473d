#include "sriovd/vfio_user/vf_proxy.hpp"

#include <linux/vfio.h>

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include <spdlog/spdlog.h>

#include "sriovd/util/eventfd.hpp"
#include "msix_state_io.hpp"

namespace sriovd::vfio_user {

namespace {

std::vector<uint8_t> read_config(vfio::Device& device) {
  const vfio::RegionInfo info = device.region(vfio::kConfigRegion);
  if (info.size < 256)
    throw std::runtime_error(device.name() + ": config region of " + std::to_string(info.size) + " bytes");
  std::vector<uint8_t> bytes(std::min<uint64_t>(info.size, 4096));
  device.read(vfio::kConfigRegion, 0, bytes.data(), bytes.size());
  return bytes;
}

pci::MsixLayout layout_of(const std::vector<uint8_t>& config, const std::string& name) {
  auto layout = pci::find_msix(config);
  if (!layout || layout->vectors == 0) throw std::runtime_error(name + " has no MSI-X capability to export");
  return *layout;
}

}  // namespace

void VfProxy::Vectors::set_masked(unsigned v, bool masked) {
  masked_.at(v) = masked;
  if (!routes_[v]) return;
  if (masked)
    engine_.mask(*routes_[v]);
  else
    engine_.unmask(*routes_[v]);
}

void VfProxy::Vectors::set_pending(unsigned v) {
  if (routes_.at(v)) engine_.set_pending(*routes_[v]);
}

bool VfProxy::Vectors::pending(unsigned v) const { return routes_.at(v) && engine_.pending(*routes_[v]); }

void VfProxy::Vectors::clear_pending(unsigned v) {
  if (routes_.at(v)) engine_.clear_pending(*routes_[v]);
}

// A new route starts masked; it takes the vector's current mask.
void VfProxy::Vectors::attach(unsigned v, irq::RouteId id) {
  routes_.at(v) = id;
  if (!masked_[v]) engine_.unmask(id);
}

namespace {
void add(irq::RouteStats& to, const irq::RouteStats& s) {
  to.fired += s.fired;
  to.delivered += s.delivered;
  to.masked_pending += s.masked_pending;
  to.replayed += s.replayed;
  to.dropped += s.dropped;
  to.masks += s.masks;
  to.unmasks += s.unmasks;
  to.mode_switches += s.mode_switches;
}
}  // namespace

irq::RouteStats VfProxy::Vectors::totals() const {
  irq::RouteStats t = retired_;
  for (const auto& r : routes_)
    if (r) add(t, engine_.stats(*r));
  return t;
}

void VfProxy::Vectors::detach(unsigned v) {
  if (!routes_.at(v)) return;
  add(retired_, engine_.stats(*routes_[v]));
  engine_.remove(*routes_[v]);
  routes_[v].reset();
}

VfProxy::VfProxy(std::unique_ptr<vfio::Device> device, irq::Engine& engine, irq::Policy policy, std::string label,
                 BarMapping bars)
    : device_(std::move(device)),
      engine_(engine),
      policy_(policy),
      bar_mapping_(bars),
      label_(std::move(label)),
      device_config_(read_config(*device_)),
      layout_(layout_of(device_config_, label_)),
      vectors_(engine, layout_.vectors),
      binder_(*device_),
      gate_(binder_, layout_.vectors),
      sinks_(layout_.vectors) {
  for (unsigned i = 0; i < 6; ++i) {
    const vfio::RegionInfo r = device_->region(i);
    if (r.size == 0) continue;
    bars_[i] = pci::decode_bar(device_config_, i, r.size);
    if (bars_[i].is64) ++i;
  }
  if (bars_[layout_.table_bir].size < layout_.table_offset + layout_.table_bytes() ||
      bars_[layout_.pba_bir].size < layout_.pba_offset + layout_.pba_bytes())
    throw std::runtime_error(label_ + ": the MSI-X table or PBA lies outside its BAR");
  build_config();
}

VfProxy::~VfProxy() {
  if (handed_) {
    // The successor has the vectors: the routes go, MSI-X stays on.
    for (unsigned v = 0; v < layout_.vectors; ++v) vectors_.detach(v);
    return;
  }
  drop_routes();
}

void VfProxy::build_config() {
  msix_ = std::make_unique<msix::MsixState>(layout_.vectors, vectors_);
  config_ = std::make_unique<pci::VirtualConfig>(device_config_, bars_, msix_.get(), [this](uint16_t command) {
    device_->write(vfio::kConfigRegion, 0x04, &command, sizeof command);
  });
}

RegionDescription VfProxy::region(uint32_t index) {
  RegionDescription d;
  if (index == vfio::kConfigRegion) {
    d.flags = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;
    d.size = config_->size();
    return d;
  }
  if (index >= 6 || bars_[index].size == 0) return d;  // ROM, VGA, absent BARs: size 0
  const vfio::RegionInfo r = device_->region(index);
  d.flags = r.flags & (VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE);
  d.size = r.size;
  uint64_t offset = 0;
  const int fd = r.mappable() && bar_mapping_ == BarMapping::device_fd ? device_->mmap_fd(index, offset) : -1;
  if (fd < 0) return d;
  // What may be mapped: the device's own mappable areas (all of it, if it
  // gives none), minus the pages of the MSI-X table and PBA in this BAR.
  std::vector<vfio::SparseArea> areas = r.sparse;
  if (areas.empty()) areas.push_back({0, r.size});
  for (const auto& [begin, end] : layout_.trapped_pages(static_cast<uint8_t>(index))) {
    std::vector<vfio::SparseArea> cut;
    for (const auto& a : areas) {
      const uint64_t a_end = a.offset + a.size;
      if (a_end <= begin || a.offset >= end) {
        cut.push_back(a);
        continue;
      }
      if (a.offset < begin) cut.push_back({a.offset, begin - a.offset});
      if (a_end > end) cut.push_back({end, a_end - end});
    }
    areas = std::move(cut);
  }
  if (areas.empty()) return d;
  d.flags |= VFIO_REGION_INFO_FLAG_MMAP;
  d.fd = fd;
  d.fd_offset = offset;
  if (areas.size() != 1 || areas[0].offset != 0 || areas[0].size != r.size) d.sparse = std::move(areas);
  return d;
}

VfProxy::Area VfProxy::classify(uint32_t region, uint64_t offset, size_t size) const {
  const auto inside = [&](uint8_t bir, uint64_t begin, uint64_t bytes) {
    return region == bir && offset < begin + bytes && begin < offset + size;
  };
  if (inside(layout_.table_bir, layout_.table_offset, layout_.table_bytes())) return Area::table;
  if (inside(layout_.pba_bir, layout_.pba_offset, layout_.pba_bytes())) return Area::pba;
  return Area::device;
}

// An access that touches the table or the PBA is served by the emulation
// (in naturally aligned pieces of up to 8 bytes, as a CPU would issue
// them); everything else in the BAR goes to the device.
void VfProxy::bar_access(uint32_t region, uint64_t offset, uint8_t* data, size_t size, bool write) {
  if (classify(region, offset, size) == Area::device) {
    if (write)
      device_->write(region, offset, data, size);
    else
      device_->read(region, offset, data, size);
    return;
  }
  for (size_t done = 0; done < size;) {
    const uint64_t at = offset + done;
    unsigned piece = 8;
    while (piece > 1 && (at % piece != 0 || piece > size - done)) piece /= 2;
    const Area area = classify(region, at, piece);
    uint64_t value = 0;
    if (area == Area::device) {
      if (write)
        device_->write(region, at, data + done, piece);
      else
        device_->read(region, at, data + done, piece);
    } else if (write) {
      std::memcpy(&value, data + done, piece);
      if (area == Area::table)
        msix_->write_table(at - layout_.table_offset, piece, value);
      else
        msix_->write_pba(at - layout_.pba_offset, piece, value);
    } else {
      value = area == Area::table ? msix_->read_table(at - layout_.table_offset, piece)
                                  : msix_->read_pba(at - layout_.pba_offset, piece);
      std::memcpy(data + done, &value, piece);
    }
    done += piece;
  }
}

void VfProxy::read(uint32_t region, uint64_t offset, std::span<uint8_t> data) {
  if (region == vfio::kConfigRegion) {
    for (size_t done = 0; done < data.size();) {
      const uint64_t at = offset + done;
      unsigned piece = 4;
      while (piece > 1 && (at % piece != 0 || piece > data.size() - done)) piece /= 2;
      const uint32_t v = config_->read(static_cast<uint32_t>(at), piece);
      std::memcpy(data.data() + done, &v, piece);
      done += piece;
    }
    return;
  }
  if (region >= 6 || bars_[region].size == 0)
    throw Error(EINVAL, "read of region " + std::to_string(region) + ", which is empty");
  bar_access(region, offset, data.data(), data.size(), false);
}

void VfProxy::write(uint32_t region, uint64_t offset, std::span<const uint8_t> data) {
  if (region == vfio::kConfigRegion) {
    for (size_t done = 0; done < data.size();) {
      const uint64_t at = offset + done;
      unsigned piece = 4;
      while (piece > 1 && (at % piece != 0 || piece > data.size() - done)) piece /= 2;
      uint32_t v = 0;
      std::memcpy(&v, data.data() + done, piece);
      config_->write(static_cast<uint32_t>(at), piece, v);
      done += piece;
    }
    return;
  }
  if (region >= 6 || bars_[region].size == 0)
    throw Error(EINVAL, "write of region " + std::to_string(region) + ", which is empty");
  // A write only reads `data` (the same walk serves reads, hence non-const).
  bar_access(region, offset, const_cast<uint8_t*>(data.data()), data.size(), true);
}

vfio::IrqInfo VfProxy::irq(uint32_t index) {
  if (index == vfio::kMsixIrq)
    // Vectors are enabled one by one as the client gives eventfds: no NORESIZE.
    return {index, VFIO_IRQ_INFO_EVENTFD | VFIO_IRQ_INFO_MASKABLE, layout_.vectors};
  return {index, 0, 0};  // INTx, MSI, ERR, REQ are not exported
}

void VfProxy::set_irq_eventfds(uint32_t index, uint32_t start, std::vector<UniqueFd> fds) {
  if (index != vfio::kMsixIrq) throw Error(EINVAL, "IRQ index " + std::to_string(index) + " has no vectors");
  for (uint32_t i = 0; i < fds.size(); ++i) {
    const unsigned v = start + i;
    if (!fds[i].valid()) {
      sinks_[v].reset();
      if (vectors_.route(v)) {
        vectors_.detach(v);
        gate_.bind(v, -1);
      }
      continue;
    }
    if (!vectors_.route(v)) {
      irq::RouteSpec spec{label_, v, policy_, &gate_};
      vectors_.attach(v, engine_.add(spec));
    }
    sinks_[v] = dup_fd(fds[i].get(), label_ + ": an MSI-X eventfd");
    engine_.set_sink(*vectors_.route(v), std::move(fds[i]));
  }
}

void VfProxy::drop_routes() {
  for (unsigned v = 0; v < layout_.vectors; ++v) {
    vectors_.detach(v);
    sinks_[v].reset();
  }
  try {
    gate_.disable();
  } catch (const std::exception& e) {
    spdlog::warn("{}: disabling MSI-X: {}", label_, e.what());
  }
}

void VfProxy::disable_irqs(uint32_t index) {
  if (index == vfio::kMsixIrq) drop_routes();
}

void VfProxy::mask_irq(uint32_t index, uint32_t vector, bool masked) {
  if (index != vfio::kMsixIrq) throw Error(EINVAL, "IRQ index " + std::to_string(index) + " has no vectors");
  msix_->set_vector_mask(vector, masked);
}

// As VFIO does for a loopback trigger: the device's vector fires, and takes
// the path it would take for a real interrupt (relay or direct).
void VfProxy::trigger_irq(uint32_t index, uint32_t vector) {
  if (index != vfio::kMsixIrq) throw Error(EINVAL, "IRQ index " + std::to_string(index) + " has no vectors");
  if (vectors_.route(vector)) device_->trigger(vfio::kMsixIrq, vector);
}

// A window without an fd (QEMU's BIOS and ROM windows) cannot be put in
// the VF's IOMMU: it is accepted and left out, so the VF cannot reach it (a
// DMA there faults in the IOMMU, as to any address not mapped). Guest RAM
// comes with its fd.
void VfProxy::dma_mapped(const DmaWindow& w) {
  if (!w.host) {
    spdlog::info("{}: DMA window [{:#x}, +{:#x}) shared without an fd: not mapped for the VF", label_, w.iova, w.size);
    return;
  }
  if (w.size > dma_limit_ - dma_bytes_)
    throw Error(ENOSPC, label_ + ": a DMA window of " + std::to_string(w.size >> 20U) + " MiB would pin " +
                            std::to_string((dma_bytes_ + w.size) >> 20U) + " MiB; assign.max_dma_mib allows " +
                            std::to_string(dma_limit_ >> 20U));
  device_->map_dma(w.iova, w.host, w.size, w.writable);
  ++dma_windows_;
  dma_bytes_ += w.size;
}

void VfProxy::dma_unmapped(const DmaWindow& w) {
  if (!w.host) return;
  device_->unmap_dma(w.iova, w.size);
  --dma_windows_;
  dma_bytes_ -= w.size;
}

// Function reset: every vector masked, MSI-X disabled, no pending bits
// (§6.8.2); the client's eventfds stay, as VFIO keeps them.
void VfProxy::reset() {
  msix_->reset();
  device_->reset();
}

void VfProxy::client_gone() {
  drop_routes();
  vectors_.reset_masks();
  build_config();  // a fresh config space and MSI-X state for the next client
  try {
    device_->reset();
  } catch (const std::exception& e) {
    spdlog::warn("{}: reset after the client left: {}", label_, e.what());
  }
}

// --- handover (daemon/handover.hpp) ---

void VfProxy::Gate::bind(unsigned vector, int eventfd) {
  std::lock_guard lock(mutex_);
  wanted_.at(vector) = eventfd;
  if (!frozen_) to_.bind(vector, eventfd);
}

void VfProxy::Gate::disable() {
  std::lock_guard lock(mutex_);
  wanted_.assign(wanted_.size(), -1);
  if (!frozen_) to_.disable();
}

void VfProxy::Gate::freeze() {
  std::lock_guard lock(mutex_);
  frozen_ = true;
}

void VfProxy::Gate::thaw() {
  std::lock_guard lock(mutex_);
  if (!std::exchange(frozen_, false)) return;
  for (unsigned v = 0; v < wanted_.size(); ++v)
    if (wanted_[v] >= 0 || v < to_.enabled()) to_.bind(v, wanted_[v]);
}

bool VfProxy::Gate::frozen() const {
  std::lock_guard lock(mutex_);
  return frozen_;
}

namespace {
constexpr uint32_t kHandoverPartVersion = 1;
}  // namespace

std::vector<uint8_t> VfProxy::freeze_for_handover(HandedFds& fds) {
  if (gate_.frozen()) throw HandoverRefused(label_ + ": it is being handed over already");
  // From here to the successor's rebinding, each vector in use signals an
  // eventfd nobody reads: what it counts is delivered after.
  std::vector<UniqueFd> captured(layout_.vectors);
  for (unsigned v = 0; v < layout_.vectors; ++v) {
    if (!vectors_.route(v)) continue;
    captured[v].reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!captured[v]) throw HandoverRefused(label_ + ": an eventfd for the handover: " + std::strerror(errno));
  }
  gate_.freeze();
  captured_ = std::move(captured);
  try {
    for (unsigned v = 0; v < layout_.vectors; ++v)
      if (captured_[v]) binder_.bind(v, captured_[v].get());
    const std::vector<uint8_t> device_part = device_->freeze_for_handover(fds);
    virtio::StateWriter w;
    w.u32(kHandoverPartVersion);
    w.blob(device_part);
    w.u32(binder_.enabled());
    w.blob(config_->bytes());
    write_msix(w, msix_->snapshot());
    w.u32(layout_.vectors);
    for (unsigned v = 0; v < layout_.vectors; ++v) {
      w.u32(sinks_[v] ? fds.add_fd(dup_fd(sinks_[v].get(), label_ + ": an MSI-X eventfd")) : HandedFds::kNoFd);
      w.u32(captured_[v] ? fds.add_fd(dup_fd(captured_[v].get(), label_ + ": a handover eventfd")) : HandedFds::kNoFd);
    }
    return w.take();
  } catch (const std::exception& e) {
    thaw();
    if (dynamic_cast<const HandoverRefused*>(&e)) throw;
    throw HandoverRefused(label_ + ": " + e.what());
  }
}

// Each vector back on what the engine asked for last, and what the device
// signalled meanwhile delivered (once: MSI-X keeps one pending bit).
void VfProxy::thaw() {
  device_->thaw();
  gate_.thaw();
  deliver_captured(captured_);
}

void VfProxy::deliver_captured(std::vector<UniqueFd>& captured) {
  for (unsigned v = 0; v < captured.size(); ++v) {
    if (!captured[v]) continue;
    uint64_t n = 0;
    if (::read(captured[v].get(), &n, sizeof n) == sizeof n && n > 0 && vectors_.route(v))
      engine_.trigger(*vectors_.route(v));
  }
  captured.clear();
}

void VfProxy::handed_over() {
  device_->handed_over();
  handed_ = true;
}

std::unique_ptr<vfio::Device> VfProxy::adopt_device(std::span<const uint8_t> part, HandedFds& fds,
                                                    const std::string& what) {
  virtio::StateReader r(part, what);
  if (const uint32_t version = r.u32(); version != kHandoverPartVersion)
    r.fail("a VF proxy handover of version " + std::to_string(version));
  const std::vector<uint8_t> device_part = r.blob(1U << 20U);
  return vfio::adopt_device(device_part, fds, what);
}

void VfProxy::take_over(std::span<const uint8_t> part, HandedFds& fds) {
  const std::string who = label_ + ": the handover";
  virtio::StateReader r(part, who);
  (void)r.u32();            // checked by adopt_device
  (void)r.blob(1U << 20U);  // the VFIO device: adopted before this proxy was made
  const uint32_t enabled = r.u32();
  if (enabled > layout_.vectors) r.fail(std::to_string(enabled) + " MSI-X vectors enabled");
  const std::vector<uint8_t> config = r.blob(4096);
  if (config.size() != config_->bytes().size()) r.fail("a config space of " + std::to_string(config.size()) + " bytes");
  const msix::MsixState::Snapshot m = read_msix(r, layout_.vectors);
  if (const uint32_t n = r.u32(); n != layout_.vectors) r.fail(std::to_string(n) + " vectors");
  std::vector<uint32_t> sink_at(layout_.vectors), captured_at(layout_.vectors);
  for (unsigned v = 0; v < layout_.vectors; ++v) {
    sink_at[v] = read_fd_index(r, fds.fds.size(), "an MSI-X eventfd");
    captured_at[v] = read_fd_index(r, fds.fds.size(), "a handover eventfd");
  }
  r.end();
  // The client shares its eventfds and may have changed their flags since
  // the predecessor looked: checked again before anything changes.
  std::vector<UniqueFd> sinks, captured;
  for (unsigned v = 0; v < layout_.vectors; ++v) {
    sinks.push_back(checked_peer_eventfd(fds.take_fd(sink_at[v]), who + ": vector " + std::to_string(v)));
    captured.push_back(checked_peer_eventfd(fds.take_fd(captured_at[v]), who + ": vector " + std::to_string(v)));
  }
  binder_.adopt_enabled(enabled);
  config_->load(config);
  // Each vector in use gets its route (the device rebound to it on its
  // own), then the table, masks and pending bits, then what the device
  // signalled while no one listened.
  for (unsigned v = 0; v < layout_.vectors; ++v) {
    if (!sinks[v]) continue;
    irq::RouteSpec spec{label_, v, policy_, &gate_};
    vectors_.attach(v, engine_.add(spec));
    sinks_[v] = dup_fd(sinks[v].get(), label_ + ": an MSI-X eventfd");
    engine_.set_sink(*vectors_.route(v), std::move(sinks[v]));
  }
  msix_->restore(m);
  deliver_captured(captured);
  spdlog::info("{}: taken over from the previous sriovd ({} MSI-X vectors enabled, {} in use)", label_, enabled,
               std::count_if(sinks_.begin(), sinks_.end(), [](const UniqueFd& f) { return f.valid(); }));
}

}  // namespace sriovd::vfio_user
