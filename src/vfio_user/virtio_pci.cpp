#include "sriovd/vfio_user/virtio_pci.hpp"

#include <linux/vfio.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include <spdlog/spdlog.h>

#include "sriovd/util/log_limit.hpp"
#include "sriovd/util/error.hpp"
#include "sriovd/util/eventfd.hpp"
#include "sriovd/util/hex.hpp"
#include "sriovd/pci/config_space.hpp"
#include "msix_state_io.hpp"

namespace sriovd::vfio_user {

namespace {

// What save_state writes into DeviceState::transport: raised when it changes.
constexpr uint32_t kTransportStateVersion = 1;

// Device status bits (§2.1).
constexpr uint8_t kDriverOk = 4;
constexpr uint8_t kFeaturesOk = 8;
constexpr uint8_t kNeedsReset = 64;

// virtio_pci_cap cfg_type (§4.1.4).
constexpr uint8_t kCommonCfg = 1;
constexpr uint8_t kNotifyCfg = 2;
constexpr uint8_t kIsrCfg = 3;
constexpr uint8_t kDeviceCfg = 4;
constexpr uint8_t kPciCfg = 5;

constexpr uint32_t kCapCommon = 0x4c;
constexpr uint32_t kCapNotify = 0x5c;
constexpr uint32_t kCapIsr = 0x70;
constexpr uint32_t kCapDevice = 0x80;

using pci::put16;
using pci::put32;
using pci::put8;

void virtio_cap(std::vector<uint8_t>& c, uint32_t at, uint8_t next, uint8_t len, uint8_t type, uint8_t bar,
                uint32_t offset, uint32_t length) {
  put8(c, at + 0, 0x09);  // vendor-specific
  put8(c, at + 1, next);
  put8(c, at + 2, len);
  put8(c, at + 3, type);
  put8(c, at + 4, bar);
  put32(c, at + 8, offset);
  put32(c, at + 12, length);
}

uint64_t merge(uint64_t whole, uint64_t offset_in, unsigned size, uint64_t value) {
  const uint64_t mask = (size == 8 ? ~0ULL : ((1ULL << (8U * size)) - 1)) << (8U * offset_in);
  return (whole & ~mask) | ((value << (8U * offset_in)) & mask);
}

}  // namespace

VirtioPci::VirtioPci(virtio::Device& device, irq::Engine& engine, std::string name)
    : device_(device),
      engine_(engine),
      name_(std::move(name)),
      num_queues_(device.num_queues()),
      routes_([&] {
        std::vector<irq::RouteId> r;
        for (unsigned v = 0; v <= num_queues_; ++v) r.push_back(engine.add({name_, v, irq::Policy::relay, nullptr}));
        return r;
      }()),
      vectors_(engine, routes_),
      sinks_(routes_.size()),
      queues_(num_queues_) {
  if (device.config_size() > kDeviceWindow)
    throw std::invalid_argument(name_ + ": the device's configuration (" + std::to_string(device.config_size()) +
                                " bytes) is larger than the transport's window (" + std::to_string(kDeviceWindow) +
                                ")");
  new_doorbells();
  // Config space (§4.1.2): a non-transitional virtio-net function.
  config_bytes_.assign(4096, 0);
  auto& c = config_bytes_;
  put16(c, 0x00, 0x1af4);
  put16(c, 0x02, static_cast<uint16_t>(0x1040 + device.device_id()));  // §4.1.2.1
  put16(c, 0x06, 0x0010);                                              // Status: capabilities list
  put8(c, 0x08, 0x01);                                                 // revision 1
  put8(c, 0x09, static_cast<uint8_t>(device.pci_class()));             // class code: the device type's
  put8(c, 0x0a, static_cast<uint8_t>(device.pci_class() >> 8U));
  put8(c, 0x0b, static_cast<uint8_t>(device.pci_class() >> 16U));
  put16(c, 0x2c, 0x1af4);
  put16(c, 0x2e, 0x0040);
  put8(c, 0x34, kCapMsix);
  // MSI-X: one vector per queue and one for configuration changes.
  put8(c, kCapMsix + 0, 0x11);
  put8(c, kCapMsix + 1, kCapCommon);
  put16(c, kCapMsix + 2, static_cast<uint16_t>(routes_.size() - 1));
  put32(c, kCapMsix + 4, 0x0 | 1U);  // table at 0 in BAR1
  put32(c, kCapMsix + 8, static_cast<uint32_t>(kPbaOffset) | 1U);
  virtio_cap(c, kCapCommon, kCapNotify, 16, kCommonCfg, 0, kCommonOffset, kCommonSize);
  virtio_cap(c, kCapNotify, kCapIsr, 20, kNotifyCfg, 0, kNotifyOffset, num_queues_ * kNotifyMultiplier);
  put32(c, kCapNotify + 16, kNotifyMultiplier);
  virtio_cap(c, kCapIsr, kCapDevice, 16, kIsrCfg, 0, kIsrOffset, 4);
  virtio_cap(c, kCapDevice, kCapPciCfg, 16, kDeviceCfg, 0, kDeviceOffset, device_config_length());
  virtio_cap(c, kCapPciCfg, 0, 20, kPciCfg, 0, 0, 0);
  msix_ = std::make_unique<msix::MsixState>(static_cast<uint16_t>(routes_.size()), vectors_);
  config_ = make_config();
  virtio_reset();
}

// One eventfd per queue doorbell, handed to a client with GET_REGION_IO_FDS.
// Each client gets its own: one that left keeps the ones it was given and
// must not ring (or drain) the next client's queues with them.
void VirtioPci::new_doorbells() {
  std::vector<UniqueFd> fresh;
  for (unsigned q = 0; q < num_queues_; ++q) {
    fresh.emplace_back(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!fresh.back()) throw_errno(name_ + ": doorbell eventfd");
  }
  kicks_ = std::move(fresh);
}

// The guest's config space: BAR0 (the virtio structures) and BAR1 (MSI-X),
// both 64-bit-less memory BARs of fixed size, nothing placed yet.
std::unique_ptr<pci::VirtualConfig> VirtioPci::make_config() {
  std::array<pci::BarInfo, 6> bars{};
  bars[0].size = kBar0Size;
  bars[1].size = kBar1Size;
  return std::make_unique<pci::VirtualConfig>(config_bytes_, bars, msix_.get(), nullptr);
}

VirtioPci::~VirtioPci() {
  device_.reset();
  for (auto r : routes_) engine_.remove(r);
}

RegionDescription VirtioPci::region(uint32_t index) {
  RegionDescription d;
  constexpr uint32_t rw = VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE;
  if (index == vfio::kConfigRegion) d = {rw, config_bytes_.size(), -1, 0, {}};
  if (index == 0) d = {rw, kBar0Size, -1, 0, {}};
  if (index == 1) d = {rw, kBar1Size, -1, 0, {}};
  return d;
}

std::vector<IoFd> VirtioPci::region_io_fds(uint32_t index) {
  std::vector<IoFd> out;
  if (index != 0) return out;
  for (unsigned q = 0; q < num_queues_; ++q) out.push_back({kNotifyOffset + q * kNotifyMultiplier, 0, kicks_[q].get()});
  return out;
}

void VirtioPci::read(uint32_t region, uint64_t offset, std::span<uint8_t> data) {
  access(region, offset, data.data(), data.size(), false);
}

void VirtioPci::write(uint32_t region, uint64_t offset, std::span<const uint8_t> data) {
  // A write only reads `data` (the same walk serves reads, hence non-const).
  access(region, offset, const_cast<uint8_t*>(data.data()), data.size(), true);
}

// Splits an access into naturally aligned pieces of up to 8 bytes (4 in
// config space), as a CPU issues them.
void VirtioPci::access(uint32_t region, uint64_t offset, uint8_t* data, size_t size, bool write) {
  if (region != vfio::kConfigRegion && region > 1)
    throw Error(EINVAL, name_ + ": region " + std::to_string(region) + " is empty");
  const unsigned widest = region == vfio::kConfigRegion ? 4 : 8;
  for (size_t done = 0; done < size;) {
    const uint64_t at = offset + done;
    unsigned piece = widest;
    while (piece > 1 && (at % piece != 0 || piece > size - done)) piece /= 2;
    uint64_t v = 0;
    if (write) std::memcpy(&v, data + done, piece);
    if (region == vfio::kConfigRegion) {
      if (write)
        config_write(static_cast<uint32_t>(at), piece, static_cast<uint32_t>(v));
      else
        v = config_read(static_cast<uint32_t>(at), piece);
    } else if (region == 1) {
      const bool table = at < kPbaOffset;
      if (write)
        table ? msix_->write_table(at, piece, v) : msix_->write_pba(at - kPbaOffset, piece, v);
      else
        v = table ? msix_->read_table(at, piece) : msix_->read_pba(at - kPbaOffset, piece);
    } else {
      if (write)
        bar0_write(at, piece, v);
      else
        v = bar0_read(at, piece);
    }
    if (!write) std::memcpy(data + done, &v, piece);
    done += piece;
  }
}

// virtio_pci_cfg_cap (§4.1.4.9): cap.bar/offset/length select a window in
// a BAR, and pci_cfg_data reads or writes it.
uint32_t VirtioPci::config_read(uint32_t offset, unsigned size) {
  const uint32_t data_at = kCapPciCfg + 16;
  if (offset >= data_at && offset < data_at + 4) {
    if (cfg_length_ == 0 || cfg_length_ > 4 || cfg_bar_ != 0) return 0;
    return static_cast<uint32_t>(bar0_read(cfg_offset_, cfg_length_));
  }
  if (offset >= kCapPciCfg + 4 && offset < kCapPciCfg + 16) {
    std::vector<uint8_t> fields(16, 0);
    std::memcpy(fields.data(), config_bytes_.data() + kCapPciCfg, 4);
    fields[4] = cfg_bar_;
    std::memcpy(fields.data() + 8, &cfg_offset_, 4);
    std::memcpy(fields.data() + 12, &cfg_length_, 4);
    uint32_t v = 0;
    std::memcpy(&v, fields.data() + (offset - kCapPciCfg), size);
    return v;
  }
  return config_->read(offset, size);
}

void VirtioPci::config_write(uint32_t offset, unsigned size, uint32_t value) {
  const uint32_t data_at = kCapPciCfg + 16;
  if (offset >= data_at && offset < data_at + 4) {
    if (cfg_length_ >= 1 && cfg_length_ <= 4 && cfg_bar_ == 0) bar0_write(cfg_offset_, cfg_length_, value);
    return;
  }
  if (offset == kCapPciCfg + 4 && size == 1) {
    cfg_bar_ = static_cast<uint8_t>(value);
    return;
  }
  if (offset == kCapPciCfg + 8 && size == 4) {
    cfg_offset_ = value;
    return;
  }
  if (offset == kCapPciCfg + 12 && size == 4) {
    cfg_length_ = value;
    return;
  }
  config_->write(offset, size, value);
}

uint64_t VirtioPci::bar0_read(uint64_t offset, unsigned size) {
  if (offset >= kCommonOffset && offset + size <= kCommonOffset + kCommonSize)
    return common_read(offset - kCommonOffset, size);
  if (offset == kIsrOffset) return 0;  // MSI-X in use: the ISR status is not used (§4.1.4.5)
  if (offset >= kDeviceOffset && offset + size <= kDeviceOffset + device_.config_size()) {
    // The device type's configuration (virtio-net: §5.1.4), as the device keeps it.
    uint8_t bytes[8] = {};
    device_.read_config(static_cast<uint32_t>(offset - kDeviceOffset), bytes, size);
    uint64_t v = 0;
    std::memcpy(&v, bytes, size);
    return v;
  }
  return 0;  // notify area and holes read as zero
}

void VirtioPci::bar0_write(uint64_t offset, unsigned size, uint64_t value) {
  if (offset >= kCommonOffset && offset + size <= kCommonOffset + kCommonSize) {
    common_write(offset - kCommonOffset, size, value);
    return;
  }
  if (offset >= kNotifyOffset && offset < kNotifyOffset + num_queues_ * kNotifyMultiplier) {
    // A doorbell through REGION_WRITE (a client without ioeventfds): the
    // queue is the address. Not a write to the queue's doorbell eventfd -
    // the client holds that one too and may have made it blocking, and
    // this is the control thread - but the worker's own wake-up.
    device_.kick(static_cast<unsigned>((offset - kNotifyOffset) / kNotifyMultiplier));
    return;
  }
  if (offset >= kDeviceOffset && offset + size <= kDeviceOffset + device_.config_size()) {
    // The device's configuration: writable where its type says so
    // (virtio-net has no writable field and ignores it).
    uint8_t bytes[8] = {};
    std::memcpy(bytes, &value, size);
    (void)device_.write_config(static_cast<uint32_t>(offset - kDeviceOffset), bytes, size);
  }
}

// The device configuration capability's length: the device type's own
// size, in whole dwords (a driver reads it 4 bytes at a time).
uint32_t VirtioPci::device_config_length() const {
  return static_cast<uint32_t>((device_.config_size() + 3U) & ~size_t{3});
}

// struct virtio_pci_common_cfg as the driver sees it now, so an access of
// any width at any offset reads what the same bytes of the structure hold.
uint64_t VirtioPci::common_read(uint64_t off, unsigned size) {
  std::array<uint8_t, kCommonSize> c{};
  auto put = [&c](unsigned at, uint64_t v, unsigned width) { std::memcpy(c.data() + at, &v, width); };
  const QueueRegs* q = queue_select_ < num_queues_ ? &queues_[queue_select_] : nullptr;
  const uint64_t offered = device_.offered_features();
  put(0x00, device_feature_select_, 4);
  put(0x04, device_feature_select_ < 2 ? offered >> (32U * device_feature_select_) : 0, 4);
  put(0x08, driver_feature_select_, 4);
  put(0x0c, driver_feature_select_ < 2 ? driver_features_ >> (32U * driver_feature_select_) : 0, 4);
  put(0x10, config_msix_vector_, 2);
  put(0x12, num_queues_, 2);
  put(0x14, static_cast<uint8_t>(status_ | (device_.broken() ? kNeedsReset : 0)), 1);
  put(0x15, config_generation_, 1);
  put(0x16, queue_select_, 2);
  put(0x18, q ? q->size : 0, 2);
  put(0x1a, q ? q->msix_vector : kNoVector, 2);
  put(0x1c, q && q->enabled ? 1 : 0, 2);
  put(0x1e, q ? queue_select_ : 0, 2);  // queue_notify_off: queue q rings at q * multiplier
  put(0x20, q ? q->desc : 0, 8);
  put(0x28, q ? q->driver : 0, 8);
  put(0x30, q ? q->device : 0, 8);
  uint64_t v = 0;
  std::memcpy(&v, c.data() + off, size);
  return v;
}

void VirtioPci::common_write(uint64_t off, unsigned size, uint64_t value) {
  QueueRegs* q = queue_select_ < num_queues_ ? &queues_[queue_select_] : nullptr;
  const bool live = status_ & kDriverOk;
  // The ring addresses, 64-bit, written whole or in 32-bit halves.
  if (off >= 0x20 && off < 0x38) {
    if (!q || live) return;
    uint64_t& field = off < 0x28 ? q->desc : off < 0x30 ? q->driver : q->device;
    field = merge(field, off & 7U, size, value);
    return;
  }
  switch (off) {
    case 0x00: device_feature_select_ = static_cast<uint32_t>(value); break;
    case 0x08: driver_feature_select_ = static_cast<uint32_t>(value); break;
    case 0x0c:
      if (driver_feature_select_ < 2 && !(status_ & kFeaturesOk))
        driver_features_ = merge(driver_features_, 4ULL * driver_feature_select_, 4, value);
      break;
    case 0x10:
      config_msix_vector_ = value < routes_.size() || value == kNoVector ? static_cast<uint16_t>(value) : kNoVector;
      break;
    case 0x14: set_status(static_cast<uint8_t>(value)); break;
    case 0x16: queue_select_ = static_cast<uint16_t>(value); break;
    case 0x18:
      if (q && !live) q->size = static_cast<uint16_t>(std::min<uint64_t>(value, device_.max_queue_size()));
      break;
    case 0x1a:
      // A vector the device does not have reads back as NO_VECTOR (§4.1.5.1.2).
      if (q) q->msix_vector = value < routes_.size() ? static_cast<uint16_t>(value) : kNoVector;
      break;
    case 0x1c:
      if (q && !live && value == 1) q->enabled = true;
      break;
    default: break;  // read-only or not offered
  }
}

void VirtioPci::set_status(uint8_t status) {
  if (status == 0) {
    virtio_reset();
    return;
  }
  const uint8_t added = status & ~status_;
  if (added & kFeaturesOk) {
    const uint64_t offered = device_.offered_features();
    if ((driver_features_ & ~offered) || !(driver_features_ & virtio::kVersion1)) {
      // Features the device did not offer: FEATURES_OK does not stick (§3.1.1).
      spdlog::warn("virtio-pci {}: driver features 0x{:x} not a subset of 0x{:x} with VERSION_1", name_,
                   driver_features_, offered);
      status &= static_cast<uint8_t>(~kFeaturesOk);
    } else {
      device_.set_features(driver_features_);
    }
  }
  status_ = status;
  if ((added & kDriverOk) && (status_ & kFeaturesOk) && quiesced_) {
    start_pending_ = true;  // a migration stopped the device: it starts at RUNNING
    return;
  }
  if ((added & kDriverOk) && (status_ & kFeaturesOk)) {
    try {
      start_device();
    } catch (const std::exception& e) {
      spdlog::error("virtio-pci {}: cannot start: {}", name_, e.what());
      device_.reset();
      status_ |= kNeedsReset;
    }
  }
}

// Where a ring part lies in a window shared without an fd, what is wrong
// (empty: nowhere of that kind).
std::string VirtioPci::in_unmapped_window(uint64_t iova) const {
  for (const auto& w : windows_)
    if (!w.host && iova >= w.iova && iova - w.iova < w.size)
      return "lies in the DMA window [" + hex(w.iova) + ", +" + hex(w.size) +
             ") that the client shared without an fd; the rings must be in memory shared with an fd";
  return {};
}

// What an enabled queue needs from the transport, whether the device
// starts it afresh or resumes it from a state: its rings in memory shared
// with an fd, its doorbell, its vector's route and its dirty log.
void VirtioPci::connect_queue(unsigned i) {
  const QueueRegs& q = queues_[i];
  for (const uint64_t at : {q.desc, q.driver, q.device})
    if (const std::string why = in_unmapped_window(at); !why.empty())
      throw Error(EFAULT, "queue " + std::to_string(i) + " at " + hex(at) + " " + why);
  UniqueFd kick(::dup(kicks_[i].get()));
  if (!kick) throw_errno(name_ + ": dup of a doorbell");
  device_.set_queue_kick(i, std::move(kick));
  device_.set_queue_interrupt(i, q.msix_vector == kNoVector ? std::nullopt : std::optional(routes_[q.msix_vector]));
  wire_queue_log(i);
}

void VirtioPci::start_device() {
  device_.stop();
  rebuild_memory();
  for (unsigned i = 0; i < num_queues_; ++i) {
    const QueueRegs& q = queues_[i];
    device_.set_queue_enabled(i, false);
    if (!q.enabled) continue;
    connect_queue(i);
    device_.set_queue_size(i, q.size);
    device_.set_queue_rings(i, {q.desc, q.driver, q.device});
    device_.set_queue_base(i, 0);
    device_.set_queue_enabled(i, true);
  }
  device_.start();
  log_limited(driver_ready_log_, spdlog::level::info, "virtio-pci {}: driver ready, features 0x{:x}", name_,
              device_.features());
}

void VirtioPci::resume_device() {
  resume_pending_ = false;
  device_.stop();
  rebuild_memory();
  for (unsigned i = 0; i < num_queues_; ++i)
    if (queues_[i].enabled) connect_queue(i);
  device_.start();
  spdlog::info("virtio-pci {}: resumed from a saved state, features 0x{:x}", name_, device_.features());
  // The guest is somewhere else now: the network is told (its driver, or a RARP).
  if (announce_on_resume_ && device_.announce_restored()) config_changed();
}

virtio::DeviceState VirtioPci::save_state() {
  virtio::DeviceState state = device_.save_state();
  virtio::StateWriter w;
  w.u32(device_feature_select_);
  w.u32(driver_feature_select_);
  w.u64(driver_features_);
  w.u16(config_msix_vector_);
  w.u8(status_);
  w.u8(config_generation_);
  w.u16(queue_select_);
  w.u32(num_queues_);
  for (const QueueRegs& q : queues_) {
    w.u16(q.size);
    w.u16(q.msix_vector);
    w.u8(q.enabled ? 1 : 0);
    w.u64(q.desc);
    w.u64(q.driver);
    w.u64(q.device);
  }
  w.u8(cfg_bar_);
  w.u32(cfg_offset_);
  w.u32(cfg_length_);
  // The first 256 bytes: the header and every capability (nothing past
  // them is writable: no extended capability).
  w.blob(std::span(config_->bytes()).first(kConfigSaved));
  write_msix(w, msix_->snapshot());
  state.transport = w.take();
  state.transport_version = kTransportStateVersion;
  return state;
}

void VirtioPci::restore_state(const virtio::DeviceState& state) {
  if (status_ != 0) throw std::logic_error(name_ + ": restoring a state under a driver (status " + hex(status_) + ")");
  if (state.transport_version != kTransportStateVersion)
    throw std::invalid_argument(name_ + ": its virtio-pci part is version " + std::to_string(state.transport_version) +
                                ", this sriovd reads version " + std::to_string(kTransportStateVersion));
  virtio::StateReader r(state.transport, name_ + ": virtio-pci state");
  const uint32_t dfs = r.u32(), drfs = r.u32();
  const uint64_t driver_features = r.u64();
  const uint16_t config_vector = r.u16();
  const uint8_t status = r.u8(), generation = r.u8();
  const uint16_t select = r.u16();
  if (const uint32_t n = r.u32(); n != num_queues_)
    r.fail(std::to_string(n) + " queues, this device has " + std::to_string(num_queues_));
  auto vector_ok = [&](uint16_t v) { return v == kNoVector || v < routes_.size(); };
  if (!vector_ok(config_vector)) r.fail("configuration vector " + std::to_string(config_vector));
  std::vector<QueueRegs> queues(num_queues_);
  for (unsigned i = 0; i < num_queues_; ++i) {
    QueueRegs& q = queues[i];
    q.size = r.u16();
    q.msix_vector = r.u16();
    q.enabled = r.u8() != 0;
    q.desc = r.u64();
    q.driver = r.u64();
    q.device = r.u64();
    if (q.size > device_.max_queue_size()) r.fail("queue " + std::to_string(i) + " size " + std::to_string(q.size));
    if (!vector_ok(q.msix_vector)) r.fail("queue " + std::to_string(i) + " vector " + std::to_string(q.msix_vector));
  }
  const uint8_t cfg_bar = r.u8();
  const uint32_t cfg_offset = r.u32(), cfg_length = r.u32();
  const std::vector<uint8_t> config = r.blob(kConfigSaved);
  if (config.size() != kConfigSaved) r.fail("a config space of " + std::to_string(config.size()) + " bytes");
  const msix::MsixState::Snapshot m = read_msix(r, routes_.size());
  r.end();
  if ((status & kFeaturesOk) && driver_features != state.features)
    r.fail("driver features " + hex(driver_features) + " but the device negotiated " + hex(state.features));
  check_queues_agree(queues, state, r);

  device_.restore_state(state);  // checks its own part before it changes anything
  device_feature_select_ = dfs;
  driver_feature_select_ = drfs;
  driver_features_ = driver_features;
  config_msix_vector_ = config_vector;
  status_ = static_cast<uint8_t>(status & ~kNeedsReset);
  config_generation_ = generation;
  queue_select_ = select;
  queues_ = std::move(queues);
  cfg_bar_ = cfg_bar;
  cfg_offset_ = cfg_offset;
  cfg_length_ = cfg_length;
  config_->load(config);
  msix_->restore(m);
  if ((status_ & kDriverOk) && (status_ & kFeaturesOk)) {
    resume_pending_ = true;
    if (!quiesced_ &&
        std::any_of(windows_.begin(), windows_.end(), [](const DmaWindow& w) { return w.host != nullptr; }))
      resume_device();
  }
}

// A queue the device part has enabled runs on the rings its transport
// registers name (start_device gave them): a state whose two parts disagree
// would have the device use rings other than those its driver sees, and is
// refused. Whatever the status says (NEEDS_RESET is not kept across a
// restore: a rule that depended on it would refuse the same state saved
// again - the device_state fuzzer found that).
void VirtioPci::check_queues_agree(const std::vector<QueueRegs>& queues, const virtio::DeviceState& state,
                                   virtio::StateReader& r) const {
  if (state.queues.size() != queues.size())
    r.fail("the device part has " + std::to_string(state.queues.size()) + " queues, the transport " +
           std::to_string(queues.size()));
  for (size_t i = 0; i < queues.size(); ++i) {
    const QueueRegs& t = queues[i];
    const virtio::QueueState& d = state.queues[i];
    const std::string which = "queue " + std::to_string(i) + ": ";
    if (!d.enabled) continue;
    if (!t.enabled) r.fail(which + "enabled in the device, not in the transport");
    if (t.size != d.size)
      r.fail(which + "size " + std::to_string(t.size) + " in the transport, " + std::to_string(d.size) +
             " in the device");
    if (!d.rings_set || d.rings != virtio::RingAddresses{t.desc, t.driver, t.device})
      r.fail(which + "rings at " + hex(t.desc) + "/" + hex(t.driver) + "/" + hex(t.device) + " in the transport, " +
             (d.rings_set ? hex(d.rings.desc) + "/" + hex(d.rings.driver) + "/" + hex(d.rings.device)
                          : std::string("none")) +
             " in the device");
  }
}

// --- live migration (vfio_user/migration.hpp) ---

// A queue's ring logs its device area at its guest address (IOVA and
// guest address are one here) while a DMA log is on.
void VirtioPci::wire_queue_log(unsigned q) {
  device_.set_queue_log(q, dma_log_ ? std::optional(queues_[q].device) : std::nullopt);
}

void VirtioPci::set_dma_log(const virtio::DirtyLog* log) {
  const bool was_running = device_.running();
  stop_device();  // the log changes only under stopped workers (Error: one did not stop)
  memory_.set_dirty_log(log);
  dma_log_ = log;
  for (unsigned q = 0; q < num_queues_; ++q) wire_queue_log(q);
  if (!was_running) return;
  try {
    device_.start();
  } catch (const std::exception& e) {
    spdlog::error("virtio-pci {}: restarting with the DMA log {}: {}", name_, log ? "on" : "off", e.what());
    device_.reset();
    status_ |= kNeedsReset;
  }
}

void VirtioPci::mig_stop() {
  ran_at_stop_ = device_.running();
  quiesced_ = true;
  device_.stop();
  // A worker that does not come out still writes guest memory: that is no
  // STOP (the arc fails, the migration is in ERROR).
  if (device_.wedged()) throw std::runtime_error(name_ + ": the device's worker did not stop");
}

void VirtioPci::mig_run() {
  quiesced_ = false;
  const bool memory = std::any_of(windows_.begin(), windows_.end(), [](const DmaWindow& w) { return w.host; });
  try {
    if (resume_pending_) {
      if (memory) resume_device();  // a loaded state, which also announces the guest
    } else if (start_pending_) {
      start_pending_ = false;
      start_device();
    } else if (ran_at_stop_ && !device_.broken()) {
      rebuild_memory();  // windows mapped or unmapped while it stood
      device_.start();   // on from where it stood
    }
  } catch (const std::exception& e) {
    spdlog::error("virtio-pci {}: cannot run after the migration stop: {}", name_, e.what());
    device_.reset();
    status_ |= kNeedsReset;
  }
  ran_at_stop_ = false;
  if (config_irq_pending_) {
    config_irq_pending_ = false;
    config_changed();
  }
}

std::vector<uint8_t> VirtioPci::mig_save() { return save_state().serialize(); }

// STOP -> RESUMING: whatever a driver did here goes (the state replaces it).
void VirtioPci::mig_prepare_resume() {
  ran_at_stop_ = false;
  start_pending_ = false;
  if (status_ != 0) virtio_reset();
}

void VirtioPci::mig_load(std::span<const uint8_t> data) {
  const virtio::DeviceState state = virtio::DeviceState::parse(data, name_ + ": migration data");
  if (status_ != 0) virtio_reset();  // a client that wrote a status while RESUMING
  start_pending_ = false;
  restore_state(state);  // checks everything first; runs at RUNNING (quiesced)
}

void VirtioPci::virtio_reset() {
  resume_pending_ = false;
  start_pending_ = false;
  ran_at_stop_ = false;  // a driver's reset while a migration has it stopped: nothing to go on with
  device_.reset();
  device_feature_select_ = driver_feature_select_ = 0;
  driver_features_ = 0;
  config_msix_vector_ = kNoVector;
  status_ = 0;
  queue_select_ = 0;
  for (auto& q : queues_) q = QueueRegs{device_.max_queue_size()};
}

void VirtioPci::rebuild_memory() {
  device_.set_memory(nullptr);
  memory_.clear();
  // Each window keeps the client's permissions: a read-only window (mapped
  // PROT_READ by the server) is never written through, a window with no
  // access flags or without an fd is not guest memory here.
  for (const auto& w : windows_) {
    if (!w.host) continue;
    const uint8_t perm = (w.readable ? virtio::kIotlbRead : 0) | (w.writable ? virtio::kIotlbWrite : 0);
    if (perm != 0) memory_.add_host_region(w.iova, w.size, w.iova, w.host, perm, w.guard);
  }
  device_.set_memory(&memory_);
}

void VirtioPci::config_changed() {
  ++config_generation_;
  if (quiesced_) {
    config_irq_pending_ = true;  // no interrupt from a stopped device: it fires at RUNNING
    return;
  }
  if (config_msix_vector_ != kNoVector && (status_ & kDriverOk)) engine_.trigger(routes_[config_msix_vector_]);
}

vfio::IrqInfo VirtioPci::irq(uint32_t index) {
  if (index == vfio::kMsixIrq)
    return {index, VFIO_IRQ_INFO_EVENTFD | VFIO_IRQ_INFO_MASKABLE, static_cast<uint32_t>(routes_.size())};
  return {index, 0, 0};
}

void VirtioPci::set_irq_eventfds(uint32_t index, uint32_t start, std::vector<UniqueFd> fds) {
  if (index != vfio::kMsixIrq) throw Error(EINVAL, "IRQ index " + std::to_string(index) + " has no vectors");
  for (uint32_t i = 0; i < fds.size(); ++i) {
    sinks_[start + i] = fds[i] ? dup_fd(fds[i].get(), name_ + ": an MSI-X eventfd") : UniqueFd();
    engine_.set_sink(routes_[start + i], std::move(fds[i]));
  }
}

void VirtioPci::disable_irqs(uint32_t index) {
  if (index != vfio::kMsixIrq) return;
  for (auto r : routes_) engine_.set_sink(r, UniqueFd());
  for (auto& fd : sinks_) fd.reset();
}

void VirtioPci::mask_irq(uint32_t index, uint32_t vector, bool masked) {
  if (index != vfio::kMsixIrq) throw Error(EINVAL, "IRQ index " + std::to_string(index) + " has no vectors");
  msix_->set_vector_mask(vector, masked);
}

void VirtioPci::trigger_irq(uint32_t index, uint32_t vector) {
  if (index != vfio::kMsixIrq) throw Error(EINVAL, "IRQ index " + std::to_string(index) + " has no vectors");
  engine_.trigger(routes_[vector]);
}

// A window without an fd (QEMU shares its BIOS and ROM windows that way)
// is kept but is not guest memory here: the rings and buffers are reached
// by mapping, so a queue that lies in one is refused when the driver
// starts the device (start_device names the window), never at DMA_MAP.
void VirtioPci::dma_mapped(const DmaWindow& w) {
  windows_.push_back(w);
  if (!w.host) return;
  if (resume_pending_ && !quiesced_) {
    try {
      resume_device();
    } catch (const std::exception& e) {
      spdlog::error("virtio-pci {}: cannot resume the restored device: {}", name_, e.what());
      device_.reset();
      status_ |= kNeedsReset;
    }
    return;
  }
  remap_running_device();
}

void VirtioPci::dma_unmapped(const DmaWindow& w) {
  std::erase_if(windows_, [&](const DmaWindow& x) { return x.iova == w.iova && x.size == w.size; });
  // The server unmaps the window once this returns: the workers must not
  // touch it after that.
  if (w.host) remap_running_device();
}

// The workers see a new memory map from a stopped state; the rings go on
// where they stood. If they cannot (a ring left with the window), the
// device needs a reset (§2.1.2 DEVICE_NEEDS_RESET) - the window still goes.
void VirtioPci::remap_running_device() {
  if (!device_.running()) return;
  stop_device();
  rebuild_memory();
  try {
    device_.start();
  } catch (const std::exception& e) {
    spdlog::error("virtio-pci {}: the memory map changed under the running device: {}", name_, e.what());
    device_.reset();
    status_ |= kNeedsReset;
  }
}

// DEVICE_RESET: a PCI function reset, so the virtio state and MSI-X (§6.8.2).
void VirtioPci::reset() {
  virtio_reset();
  msix_->reset();
  quiesced_ = config_irq_pending_ = false;  // RUNNING again
}

// Stops the workers before the memory map changes; a worker that does not
// stop (NetDevice::wedged) still reads the windows, so they must stay: the
// server keeps a window mapped when unmapping it throws.
void VirtioPci::stop_device() {
  device_.stop();
  if (device_.wedged())
    throw Error(EBUSY, name_ + ": the device's worker did not stop; its DMA windows stay mapped until it does");
}

void VirtioPci::client_gone() {
  virtio_reset();
  quiesced_ = config_irq_pending_ = false;
  windows_.clear();
  if (device_.wedged()) {
    spdlog::error("vfio-user: {}: the client left but the device's worker has not stopped: its memory stays", name_);
  } else {
    device_.set_memory(nullptr);
    memory_.clear();
  }
  disable_irqs(vfio::kMsixIrq);
  msix_->reset();
  try {
    new_doorbells();
  } catch (const std::exception& e) {
    // The old ones stay (out of fds): logged, the device still works.
    spdlog::error("virtio-pci {}: new doorbells for the next client: {}", name_, e.what());
  }
  config_ = make_config();  // BARs unplaced again, as a new client expects
  cfg_bar_ = 0;
  cfg_offset_ = cfg_length_ = 0;
}

// --- handover (daemon/handover.hpp) ---

namespace {
constexpr uint32_t kHandoverPartVersion = 1;
}  // namespace

std::vector<uint8_t> VirtioPci::freeze_for_handover(HandedFds& fds) {
  if (quiesced_ || dma_log_) throw HandoverRefused(name_ + ": a live migration has stopped the device or logs it");
  if (device_.wedged()) throw HandoverRefused(name_ + ": the device's worker has not stopped since it was asked to");
  ran_at_freeze_ = device_.running();
  frozen_ = true;
  try {
    device_.stop();
    if (device_.wedged()) throw HandoverRefused(name_ + ": the device's worker did not stop");
    virtio::StateWriter w;
    w.u32(kHandoverPartVersion);
    w.blob(save_state().serialize());
    w.u8(ran_at_freeze_ ? 1 : 0);
    w.u32(num_queues_);
    for (const UniqueFd& kick : kicks_) w.u32(fds.add_fd(dup_fd(kick.get(), name_ + ": a doorbell")));
    w.u32(static_cast<uint32_t>(sinks_.size()));
    for (const UniqueFd& sink : sinks_)
      w.u32(sink ? fds.add_fd(dup_fd(sink.get(), name_ + ": an MSI-X eventfd")) : HandedFds::kNoFd);
    return w.take();
  } catch (...) {
    thaw();
    throw;
  }
}

void VirtioPci::thaw() {
  if (!std::exchange(frozen_, false) || !ran_at_freeze_) return;
  try {
    device_.start();
    device_.kick_all();
  } catch (const std::exception& e) {
    spdlog::error("virtio-pci {}: cannot run again after a refused handover: {}", name_, e.what());
    device_.reset();
    status_ |= kNeedsReset;
  }
}

void VirtioPci::take_over(std::span<const uint8_t> part, HandedFds& fds) {
  const std::string who = name_ + ": the handover";
  virtio::StateReader r(part, who);
  if (const uint32_t version = r.u32(); version != kHandoverPartVersion)
    r.fail("a virtio-pci handover of version " + std::to_string(version));
  const std::vector<uint8_t> state_bytes = r.blob(16U << 20U);
  const bool ran = r.u8() != 0;
  if (const uint32_t n = r.u32(); n != num_queues_)
    r.fail(std::to_string(n) + " doorbells for " + std::to_string(num_queues_) + " queues");
  std::vector<uint32_t> kick_at(num_queues_), sink_at(routes_.size());
  for (uint32_t& at : kick_at)
    if ((at = read_fd_index(r, fds.fds.size(), "a doorbell")) == HandedFds::kNoFd)
      r.fail("a queue without its doorbell");
  if (const uint32_t n = r.u32(); n != routes_.size())
    r.fail(std::to_string(n) + " MSI-X vectors for " + std::to_string(routes_.size()));
  for (uint32_t& at : sink_at) at = read_fd_index(r, fds.fds.size(), "an MSI-X eventfd");
  r.end();
  const virtio::DeviceState state = virtio::DeviceState::parse(state_bytes, who + "'s device state");
  // The client shares these files and may have changed their flags since
  // the predecessor looked: checked again before anything changes.
  std::vector<UniqueFd> kicks, sinks;
  for (unsigned q = 0; q < num_queues_; ++q)
    kicks.push_back(
        checked_peer_eventfd(fds.take_fd(kick_at[q]), who + ": queue " + std::to_string(q) + "'s doorbell"));
  for (size_t v = 0; v < routes_.size(); ++v)
    sinks.push_back(
        checked_peer_eventfd(fds.take_fd(sink_at[v]), who + ": vector " + std::to_string(v) + "'s eventfd"));
  kicks_ = std::move(kicks);
  for (size_t v = 0; v < routes_.size(); ++v) {
    if (!sinks[v]) continue;
    sinks_[v] = dup_fd(sinks[v].get(), name_ + ": an MSI-X eventfd");
    engine_.set_sink(routes_[v], std::move(sinks[v]));
  }
  announce_on_resume_ = false;  // the guest has not moved
  try {
    restore_state(state);  // runs the device on the mapped windows when its driver had
  } catch (...) {
    announce_on_resume_ = true;
    throw;
  }
  announce_on_resume_ = true;
  // An interrupt the predecessor owed when it stopped is raised now (a
  // spurious one costs a driver a look at its used ring).
  if (status_ & kDriverOk)
    for (const QueueRegs& q : queues_)
      if (q.enabled && q.msix_vector != kNoVector) engine_.trigger(routes_[q.msix_vector]);
  spdlog::info("virtio-pci {}: taken over from the previous sriovd (device {})", name_,
               device_.running() ? "running" : (ran ? "stopped, it ran before" : "stopped"));
}

}  // namespace sriovd::vfio_user
