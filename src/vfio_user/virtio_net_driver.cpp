#include "sriovd/vfio_user/virtio_net_driver.hpp"

#include <linux/if_tun.h>
#include <linux/vfio.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "sriovd/pci/config_space.hpp"
#include "sriovd/util/error.hpp"
#include "sriovd/util/unix_socket.hpp"
#include "sriovd/vhost_user/protocol.hpp"
#include "sriovd/virtio/net.hpp"

namespace sriovd::vfio_user {

namespace {

constexpr uint32_t kConfigRegion = VFIO_PCI_CONFIG_REGION_INDEX;
constexpr uint32_t kMsixIrq = VFIO_PCI_MSIX_IRQ_INDEX;
constexpr uint64_t kRamBase = 0x100000;  // guest physical address of the shared RAM
constexpr uint64_t kIovaBase = 0x7c0000000ULL;  // where the emulated IOMMU maps it (anything but kRamBase)
constexpr size_t kBufSize = 65536 + 4096;  // a 64 KB TSO segment, its headers and the virtio-net header
constexpr uint8_t kAcknowledge = 1, kDriver = 2, kDriverOk = 4, kFeaturesOk = 8;

uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace

// One virtqueue from the driver's side, split or packed, with the buffer
// slot each outstanding chain carries.
class VirtioNetDriver::Ring {
 public:
  Ring(uint8_t* host, uint64_t gpa, uint16_t size, bool packed) : slot_of_(size) {
    if (packed)
      packed_ = std::make_unique<virtio::PackedDriver>(host, gpa, size);
    else
      split_ = std::make_unique<virtio::SplitDriver>(host, gpa, size);
  }
  static uint64_t bytes(uint16_t size, bool packed) {
    return packed ? virtio::PackedDriver::ring_bytes(size) : virtio::SplitDriver::ring_bytes(size);
  }
  [[nodiscard]] virtio::RingAddresses addresses() const { return split_ ? split_->addresses() : packed_->addresses(); }
  bool add(const virtio::Buffer& b, uint16_t slot) { return add_chain(std::span<const virtio::Buffer>(&b, 1), slot); }
  bool add_chain(std::span<const virtio::Buffer> chain, uint16_t slot) {
    const int id = split_ ? split_->add(chain) : packed_->add(chain);
    if (id < 0) return false;
    slot_of_[static_cast<size_t>(id)] = slot;
    return true;
  }
  void publish() {
    if (split_) split_->publish();
  }
  bool take(uint16_t& slot, uint32_t& len) {
    uint32_t id = 0;
    if (!(split_ ? split_->take_used(id, len) : packed_->take_used(id, len))) return false;
    if (id >= slot_of_.size()) throw std::runtime_error("the device used an id that was never made available");
    slot = slot_of_[id];
    return true;
  }

 private:
  std::unique_ptr<virtio::SplitDriver> split_;
  std::unique_ptr<virtio::PackedDriver> packed_;
  std::vector<uint16_t> slot_of_;
};

VirtioNetDriver::VirtioNetDriver(Client& client, VirtioNetDriverOptions options) : client_(&client), options_(options) {}

VirtioNetDriver::VirtioNetDriver(std::string vhost_user_socket, VirtioNetDriverOptions options)
    : vhost_socket_(std::move(vhost_user_socket)), options_(options) {}

VirtioNetDriver::~VirtioNetDriver() {
  try {
    if (client_) set_status(0);
  } catch (...) {
  }
  if (ram_) ::munmap(ram_, ram_size_);
}

void VirtioNetDriver::bring_up() {
  if (client_)
    bring_up_pci();
  else
    bring_up_vhost_user();
}

// Guest RAM: per pair an RX and a TX ring, the control ring; per pair TX
// and RX buffers; a command page.
void VirtioNetDriver::map_ram(unsigned pairs) {
  const uint16_t n = options_.queue_size;
  ram_pairs_ = pairs;
  ring_bytes_ = align_up(Ring::bytes(n, packed_), 4096);
  ram_size_ = align_up(command_page() + 4096, 2 << 20);
  ram_fd_.reset(::memfd_create("sriovd-guest-ram", MFD_CLOEXEC));
  if (!ram_fd_ || ::ftruncate(ram_fd_.get(), static_cast<off_t>(ram_size_)) != 0) throw_errno("guest RAM memfd");
  void* m = ::mmap(nullptr, ram_size_, PROT_READ | PROT_WRITE, MAP_SHARED, ram_fd_.get(), 0);
  if (m == MAP_FAILED) throw_errno("mapping guest RAM");
  ram_ = static_cast<uint8_t*>(m);
}

uint64_t VirtioNetDriver::tx_offset(unsigned pair, uint16_t slot) const {
  return (2ULL * ram_pairs_ + 1) * ring_bytes_ + (2ULL * pair * options_.queue_size + slot) * kBufSize;
}

uint64_t VirtioNetDriver::rx_offset(unsigned pair, uint16_t slot) const {
  return (2ULL * ram_pairs_ + 1) * ring_bytes_ + ((2ULL * pair + 1) * options_.queue_size + slot) * kBufSize;
}

uint64_t VirtioNetDriver::command_page() const { return tx_offset(ram_pairs_, 0); }

// The rings of `count` pairs (and the control ring after them) in guest RAM.
void VirtioNetDriver::make_pairs(unsigned count) {
  const uint16_t n = options_.queue_size;
  pairs_.clear();
  pairs_.resize(count);
  for (unsigned p = 0; p < count; ++p) {
    const uint64_t rx = 2ULL * p * ring_bytes_, tx = rx + ring_bytes_;
    pairs_[p].rx = std::make_unique<Ring>(ram_ + rx, dma_base_ + rx, n, packed_);
    pairs_[p].tx = std::make_unique<Ring>(ram_ + tx, dma_base_ + tx, n, packed_);
    for (uint16_t slot = 0; slot < n; ++slot) pairs_[p].tx_free.push_back(slot);
  }
}

void VirtioNetDriver::find_caps() {
  std::vector<uint8_t> cfg(256);
  client_->read(kConfigRegion, 0, cfg);
  uint16_t vendor = 0;
  std::memcpy(&vendor, cfg.data(), 2);
  if (vendor != 0x1af4) throw std::runtime_error("not a virtio device (vendor " + std::to_string(vendor) + ")");
  bool have_common = false, have_notify = false, have_device = false;
  for (const auto& cap : pci::capabilities(cfg)) {
    if (cap.id != 0x09 || cap.offset + 16U > cfg.size()) continue;
    Cap c{cfg[cap.offset + 4U], 0, 0};
    std::memcpy(&c.offset, &cfg[cap.offset + 8U], 4);
    std::memcpy(&c.length, &cfg[cap.offset + 12U], 4);
    switch (cfg[cap.offset + 3U]) {
      case 1: if (!have_common) common_ = c; have_common = true; break;
      case 2:
        if (!have_notify) {
          notify_ = c;
          std::memcpy(&notify_multiplier_, &cfg[cap.offset + 16U], 4);
        }
        have_notify = true;
        break;
      case 4: if (!have_device) device_ = c; have_device = true; break;
      default: break;
    }
  }
  if (!have_common || !have_notify || !have_device)
    throw std::runtime_error("the device lacks the common, notify or device configuration capability");
}

uint32_t VirtioNetDriver::common32(uint32_t off) { return client_->read32(common_.bar, common_.offset + off); }

void VirtioNetDriver::common_write(uint32_t off, uint64_t value, unsigned size) {
  client_->write(common_.bar, common_.offset + off, {reinterpret_cast<const uint8_t*>(&value), size});
}

uint8_t VirtioNetDriver::status() {
  uint8_t s = 0;
  client_->read(common_.bar, common_.offset + 0x14, {&s, 1});
  return s;
}

void VirtioNetDriver::set_status(uint8_t s) { common_write(0x14, s, 1); }

std::string VirtioNetDriver::mac() const {
  if (!client_) return "(vhost-user: the VMM's)";
  uint8_t m[6];
  client_->read(device_.bar, device_.offset, {m, 6});
  char out[18];
  std::snprintf(out, sizeof out, "%02x:%02x:%02x:%02x:%02x:%02x", m[0], m[1], m[2], m[3], m[4], m[5]);
  return out;
}

void VirtioNetDriver::bring_up_pci() {
  find_caps();
  // §3.1.1: reset, ACKNOWLEDGE, DRIVER, features, FEATURES_OK, queues, DRIVER_OK.
  set_status(0);
  set_status(kAcknowledge | kDriver);
  common_write(0x00, 0, 4);
  uint64_t offered = common32(0x04);
  common_write(0x00, 1, 4);
  offered |= static_cast<uint64_t>(common32(0x04)) << 32U;
  uint64_t want = virtio::kVersion1 | virtio::kNetMrgRxbuf | virtio::kNetMac | virtio::kNetMtu | virtio::kNetStatus;
  if (options_.offloads)
    want |= virtio::kNetCsum | virtio::kNetGuestCsum | virtio::kNetHostTso4 | virtio::kNetHostTso6 | virtio::kNetGuestTso4 |
            virtio::kNetGuestTso6;
  if (options_.packed) want |= virtio::kRingPacked;
  if (options_.control_queue) want |= virtio::kNetCtrlVq | virtio::kNetCtrlRx | virtio::kNetCtrlMacAddr;
  if (options_.queue_pairs > 1) want |= virtio::kNetCtrlVq | virtio::kNetMq;
  features_ = offered & want;
  if (!(features_ & virtio::kVersion1)) throw std::runtime_error("the device does not offer VIRTIO_F_VERSION_1");
  if (options_.queue_pairs > 1 && !(features_ & virtio::kNetMq))
    throw std::runtime_error("the device does not offer VIRTIO_NET_F_MQ (" + std::to_string(options_.queue_pairs) +
                             " queue pairs asked for)");
  packed_ = features_ & virtio::kRingPacked;
  common_write(0x08, 0, 4);
  common_write(0x0c, features_ & 0xffffffffU, 4);
  common_write(0x08, 1, 4);
  common_write(0x0c, features_ >> 32U, 4);
  set_status(kAcknowledge | kDriver | kFeaturesOk);
  if (!(status() & kFeaturesOk)) throw std::runtime_error("the device refused the features (FEATURES_OK did not stick)");

  // Pairs: as many as asked for and the device has (max_virtqueue_pairs,
  // device config offset 8, with MQ).
  unsigned pairs = 1;
  if (features_ & virtio::kNetMq) {
    uint16_t max_pairs = 0;
    client_->read(device_.bar, device_.offset + 8, {reinterpret_cast<uint8_t*>(&max_pairs), 2});
    pairs = std::clamp<unsigned>(options_.queue_pairs, 1, std::max<uint16_t>(max_pairs, 1));
  }
  const uint16_t n = options_.queue_size;
  map_ram(pairs);
  client_->dma_map(kRamBase, ram_size_, ram_fd_.get(), 0);
  dma_base_ = kRamBase;
  make_pairs(pairs);
  const bool with_ctrl = features_ & virtio::kNetCtrlVq;
  if (with_ctrl) {
    // The control queue is the last one: after every data queue pair.
    ctrl_index_ = static_cast<unsigned>(common32(0x10) >> 16U) - 1;  // num_queues - 1
    const uint64_t at = 2ULL * pairs * ring_bytes_;
    ctrl_ = std::make_unique<Ring>(ram_ + at, kRamBase + at, n, packed_);
  }

  // MSI-X: queue q's vector is q (RX 2p, TX 2p + 1), the control queue's
  // the last; enabled and unmasked.
  std::vector<uint8_t> cfg(256);
  client_->read(kConfigRegion, 0, cfg);
  const auto msix = pci::find_msix(cfg);
  const unsigned nvec = 2 * pairs + (with_ctrl ? 1 : 0);
  if (!msix || msix->vectors < nvec) throw std::runtime_error("the device has too few MSI-X vectors");
  std::vector<int> fds(nvec);
  for (unsigned v = 0; v < nvec; ++v) {
    irq_fds_.emplace_back(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    fds[v] = irq_fds_.back().get();
    client_->write32(msix->table_bir, msix->table_offset + 16 * v, 0xfee00000);
    client_->write32(msix->table_bir, msix->table_offset + 16 * v + 8, 0x30 + v);
  }
  client_->set_irq_eventfds(kMsixIrq, 0, std::span<const int>(fds.data(), nvec));
  const uint32_t dw0 = client_->read32(kConfigRegion, msix->cap_offset);
  client_->write32(kConfigRegion, msix->cap_offset, (dw0 & 0x3fffffffU) | 0x80000000U);
  for (unsigned v = 0; v < nvec; ++v) client_->write32(msix->table_bir, msix->table_offset + 16 * v + 12, 0);

  for (unsigned i = 0; i < nvec; ++i) {
    const bool data = i < 2 * pairs;
    Ring& r = !data ? *ctrl_ : i % 2 == 0 ? *pairs_[i / 2].rx : *pairs_[i / 2].tx;
    const unsigned q = data ? i : ctrl_index_;
    common_write(0x16, q, 2);
    common_write(0x18, n, 2);
    common_write(0x1a, i, 2);
    uint16_t vector = 0;
    client_->read(common_.bar, common_.offset + 0x1a, {reinterpret_cast<uint8_t*>(&vector), 2});
    if (vector != i) throw std::runtime_error("queue " + std::to_string(q) + " refused MSI-X vector " + std::to_string(i));
    const auto a = r.addresses();
    common_write(0x20, a.desc, 8);
    common_write(0x28, a.driver, 8);
    common_write(0x30, a.device, 8);
    common_write(0x1c, 1, 2);
  }
  // Doorbells: one eventfd per queue; fall back to REGION_WRITE without them.
  try {
    auto io = client_->region_io_fds(notify_.bar);
    doorbells_.resize(2ULL * pairs);
    for (size_t i = 0; i < io.entries.size(); ++i) {
      const uint64_t q = (io.entries[i].offset - notify_.offset) / std::max<uint32_t>(notify_multiplier_, 1);
      if (io.entries[i].fd_index >= io.fds.size()) continue;
      if (q >= doorbells_.size()) doorbells_.resize(q + 1);
      doorbells_[q] = UniqueFd(::dup(io.fds[io.entries[i].fd_index].get()));
    }
  } catch (const Error&) {
    doorbells_.clear();
  }
  set_status(kAcknowledge | kDriver | kFeaturesOk | kDriverOk);
  if (!(status() & kDriverOk)) throw std::runtime_error("the device did not take DRIVER_OK");
  for (unsigned p = 0; p < pairs; ++p) post_rx(p);
  // §5.1.6.5.5: with MQ the device starts on one pair; the driver says how
  // many it uses.
  if (pairs > 1) {
    const uint8_t kCtrlMq = 4, kCtrlMqPairsSet = 0;
    const auto count = static_cast<uint16_t>(pairs);
    if (const uint8_t ack = control(kCtrlMq, kCtrlMqPairsSet, {static_cast<uint8_t>(count), static_cast<uint8_t>(count >> 8U)});
        ack != 0)
      throw std::runtime_error("the device refused VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET " + std::to_string(pairs) +
                               " (ack " + std::to_string(ack) + ")");
  }
}

// One vhost-user request (the front-end's side of the protocol); with
// `reply`, waits for the u64 reply (or the REPLY_ACK status) and returns it.
uint64_t VirtioNetDriver::vhost_request(uint32_t request, const void* payload, uint32_t size, const std::vector<int>& fds,
                                        bool reply, uint32_t flags) {
  namespace vu = vhost_user;
  vu::Header h{request, vu::kVersion | flags, size};
  std::vector<uint8_t> bytes(sizeof h + size);
  std::memcpy(bytes.data(), &h, sizeof h);
  if (size) std::memcpy(bytes.data() + sizeof h, payload, size);
  const iovec iov{bytes.data(), bytes.size()};
  if (send_with_fds(vhost_.get(), {&iov, 1}, fds) != static_cast<ssize_t>(bytes.size()))
    throw SystemError(errno, "vhost-user request " + std::to_string(request));
  if (!reply) return 0;
  vu::Header rh{};
  uint64_t v = 0;
  if (::recv(vhost_.get(), &rh, sizeof rh, MSG_WAITALL) != sizeof rh || rh.size != sizeof v ||
      ::recv(vhost_.get(), &v, sizeof v, MSG_WAITALL) != sizeof v)
    throw std::runtime_error("vhost-user: no reply to request " + std::to_string(request) + " (the back-end hung up?)");
  return v;
}

// The emulated IOMMU maps guest RAM at kIovaBase. A miss inside that
// window is answered with an UPDATE of the page around it (REPLY_ACK: in
// place when acknowledged); one outside it gets no answer, as the spec
// says of an invalid miss, and is counted.
unsigned VirtioNetDriver::serve_iotlb() {
  namespace vu = vhost_user;
  if (!backend_channel_) return 0;
  unsigned answered = 0;
  for (;;) {
    struct {
      vu::Header h;
      vu::IotlbMsg m;
    } __attribute__((packed)) in{};
    const ssize_t n = ::recv(backend_channel_.get(), &in, sizeof in.h, MSG_DONTWAIT | MSG_PEEK);
    if (n < static_cast<ssize_t>(sizeof in.h)) {
      if (n == 0) throw std::runtime_error("vhost-user: the back-end closed its channel");
      return answered;
    }
    if (in.h.size > vu::kMaxPayload) throw std::runtime_error("vhost-user: back-end message of " + std::to_string(in.h.size) + " bytes");
    std::vector<uint8_t> whole(sizeof in.h + in.h.size);
    if (::recv(backend_channel_.get(), whole.data(), whole.size(), MSG_WAITALL) != static_cast<ssize_t>(whole.size()))
      throw std::runtime_error("vhost-user: a short message on the back-end channel");
    if (in.h.request != vu::kBackendIotlbMsg || in.h.size != sizeof(vu::IotlbMsg)) continue;  // config change etc.
    std::memcpy(&in.m, whole.data() + sizeof in.h, sizeof in.m);
    if (in.m.type != vu::kIotlbMiss) continue;
    stats_.iotlb_misses.fetch_add(1, std::memory_order_relaxed);
    const uint64_t page = in.m.iova & ~(static_cast<uint64_t>(options_.iommu_page) - 1);
    if (page < dma_base_ || page + options_.iommu_page > dma_base_ + ram_size_) {
      stats_.iotlb_faults.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    const vu::IotlbMsg update{page, options_.iommu_page, reinterpret_cast<uint64_t>(ram_) + (page - dma_base_),
                              virtio::kIotlbRead | virtio::kIotlbWrite, vu::kIotlbUpdate, {}};
    if (vhost_request(vu::kIotlbMsg, &update, sizeof update, {}, true, vu::kFlagNeedReply) != 0)
      throw std::runtime_error("vhost-user: the back-end refused an IOTLB update");
    stats_.iotlb_updates.fetch_add(1, std::memory_order_relaxed);
    ++answered;
  }
}

int VirtioNetDriver::wait(pollfd* fds, nfds_t count, int timeout_ms) {
  constexpr nfds_t kMax = 8;
  if (!backend_channel_ || count >= kMax) return ::poll(fds, count, timeout_ms);
  pollfd all[kMax];
  std::copy(fds, fds + count, all);
  all[count] = {backend_channel_.get(), POLLIN, 0};
  const int n = ::poll(all, count + 1, timeout_ms);
  if (n > 0 && (all[count].revents & (POLLIN | POLLHUP))) serve_iotlb();
  for (nfds_t i = 0; i < count; ++i) fds[i].revents = all[i].revents;
  return n;
}

// The VMM's part of vhost-user (§ "Starting the device" of the spec):
// features, memory table, then per vring its size, addresses (this
// process's virtual addresses), base, kick and call eventfds, enable.
void VirtioNetDriver::bring_up_vhost_user() {
  namespace vu = vhost_user;
  vhost_ = connect_unix(vhost_socket_, "vhost-user socket");
  timeval tv{5, 0};
  ::setsockopt(vhost_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (options_.queue_pairs > 1)
    throw std::invalid_argument("vhost-user: one queue pair (a VMM's control queue is its own; use virtio-net-pci for MQ)");
  const uint64_t offered = vhost_request(vu::kGetFeatures, nullptr, 0, {}, true);
  uint64_t want = virtio::kVersion1 | virtio::kNetMrgRxbuf;
  if (options_.offloads)
    want |= virtio::kNetCsum | virtio::kNetGuestCsum | virtio::kNetHostTso4 | virtio::kNetHostTso6 | virtio::kNetGuestTso4 |
            virtio::kNetGuestTso6;
  if (options_.packed) want |= virtio::kRingPacked;
  if (options_.iommu) want |= virtio::kAccessPlatform;
  features_ = offered & want;
  if (!(features_ & virtio::kVersion1)) throw std::runtime_error("the back-end does not offer VIRTIO_F_VERSION_1");
  if (options_.iommu && !(features_ & virtio::kAccessPlatform))
    throw std::runtime_error("the back-end does not offer VIRTIO_F_ACCESS_PLATFORM (iommu_platform: true in its config)");
  if (options_.iommu_page < 4096 || (options_.iommu_page & (options_.iommu_page - 1)) != 0)
    throw std::invalid_argument("IOMMU page size " + std::to_string(options_.iommu_page) + " is not a power of two >= 4096");
  packed_ = features_ & virtio::kRingPacked;
  const bool protocol = offered & vu::kFeatureProtocolFeatures;
  vhost_request(vu::kSetOwner, nullptr, 0, {}, false);
  if (protocol) {
    const uint64_t proto_offered = vhost_request(vu::kGetProtocolFeatures, nullptr, 0, {}, true);
    // Only an IOMMU needs an extension: the back-end channel for misses,
    // and REPLY_ACK so that an update is in place before the guest goes on.
    const uint64_t need = options_.iommu ? vu::kProtoBackendReq | vu::kProtoReplyAck : 0;
    if ((proto_offered & need) != need)
      throw std::runtime_error("the back-end does not offer BACKEND_REQ and REPLY_ACK, which an IOMMU needs");
    vhost_request(vu::kSetProtocolFeatures, &need, 8, {}, false);
  } else if (options_.iommu) {
    throw std::runtime_error("the back-end has no protocol features, which an IOMMU needs");
  }
  const uint64_t set = features_ | (protocol ? vu::kFeatureProtocolFeatures : 0);
  vhost_request(vu::kSetFeatures, &set, 8, {}, false);
  if (options_.iommu) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) != 0) throw_errno("back-end channel");
    backend_channel_.reset(sv[0]);
    UniqueFd theirs(sv[1]);
    vhost_request(vu::kSetBackendReqFd, nullptr, 0, {theirs.get()}, false);
  }
  // Behind an IOMMU the device sees IOVAs; else guest-physical addresses.
  dma_base_ = options_.iommu ? kIovaBase : kRamBase;

  const uint16_t n = options_.queue_size;
  map_ram(1);
  vu::MemTable t{};
  t.nregions = 1;
  t.regions[0] = {kRamBase, ram_size_, reinterpret_cast<uint64_t>(ram_), 0};
  vhost_request(vu::kSetMemTable, &t, 8 + sizeof(vu::MemRegion), {ram_fd_.get()}, false);
  make_pairs(1);
  doorbells_.resize(2);
  for (uint32_t q = 0; q < 2; ++q) {
    const auto addr = (q == 0 ? pairs_[0].rx : pairs_[0].tx)->addresses();
    // Vring addresses: IOVAs behind an IOMMU, else this process's own.
    auto uva = [&](uint64_t dma) {
      return options_.iommu ? dma : reinterpret_cast<uint64_t>(ram_) + (dma - dma_base_);
    };
    vu::VringState num{q, n};
    vhost_request(vu::kSetVringNum, &num, sizeof num, {}, false);
    vu::VringAddr va{q, 0, uva(addr.desc), uva(addr.device), uva(addr.driver), 0};
    vhost_request(vu::kSetVringAddr, &va, sizeof va, {}, false);
    vu::VringState base{q, 0};
    vhost_request(vu::kSetVringBase, &base, sizeof base, {}, false);
    doorbells_[q].reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    irq_fds_.emplace_back(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    const uint64_t idx = q;
    vhost_request(vu::kSetVringCall, &idx, 8, {irq_fds_.back().get()}, false);
    vhost_request(vu::kSetVringKick, &idx, 8, {doorbells_[q].get()}, false);
    if (protocol) {
      vu::VringState on{q, 1};
      vhost_request(vu::kSetVringEnable, &on, sizeof on, {}, false);
    }
  }
  // A round trip: every request before it has been taken.
  (void)vhost_request(vu::kGetFeatures, nullptr, 0, {}, true);
  post_rx(0);
}

void VirtioNetDriver::kick(unsigned q) {
  stats_.kicks.fetch_add(1, std::memory_order_relaxed);
  if (q < doorbells_.size() && doorbells_[q]) {
    const uint64_t one = 1;
    (void)::write(doorbells_[q].get(), &one, sizeof one);
    return;
  }
  if (client_) client_->write(notify_.bar, notify_.offset + q * notify_multiplier_, {reinterpret_cast<const uint8_t*>(&q), 2});
}

void VirtioNetDriver::post_rx(unsigned pair) {
  Ring& rx = *pairs_[pair].rx;
  for (uint16_t slot = 0; slot < options_.queue_size; ++slot)
    if (!rx.add({dma_base_ + rx_offset(pair, slot), static_cast<uint32_t>(kBufSize), true}, slot)) break;
  rx.publish();
  kick(2 * pair);
}

void VirtioNetDriver::reclaim_tx(Pair& p) {
  uint16_t slot;
  uint32_t len;
  while (p.tx->take(slot, len)) p.tx_free.push_back(slot);
}

// Takes one used RX chain (gathering the num_buffers a merged packet
// spans), hands it to the tap or copies it out, and gives the buffers back.
size_t VirtioNetDriver::take_rx(unsigned pair, uint8_t* out, size_t size, virtio::Tap* tap, unsigned tap_queue) {
  Ring& rx = *pairs_[pair].rx;
  auto buf = [&](uint16_t slot) { return ram_ + rx_offset(pair, slot); };
  uint16_t slot;
  uint32_t len;
  if (!rx.take(slot, len)) return 0;
  uint16_t count = 1;
  if (features_ & virtio::kNetMrgRxbuf) std::memcpy(&count, buf(slot) + 10, 2);
  iovec iov[64];
  uint16_t slots[64];
  int parts = 0;
  iov[parts] = {buf(slot), std::min<size_t>(len, kBufSize)};
  slots[parts++] = slot;
  // The device publishes a merged packet's buffers together; a count it
  // never completes is a broken device, not a reason to hang.
  for (uint32_t i = 1, spins = 0; i < count && parts < 64 && spins < (1U << 24U); ++spins) {
    if (rx.take(slot, len)) {
      iov[parts] = {buf(slot), std::min<size_t>(len, kBufSize)};
      slots[parts++] = slot;
      ++i;
    }
  }
  size_t total = 0;
  for (int i = 0; i < parts; ++i) total += iov[i].iov_len;
  if (tap) {
    if (tap->send(tap_queue, iov, parts) < 0) stats_.rx_dropped.fetch_add(1, std::memory_order_relaxed);
  } else {
    size_t at = 0;
    for (int i = 0; i < parts && at < size; ++i) {
      const size_t c = std::min(size - at, iov[i].iov_len);
      std::memcpy(out + at, iov[i].iov_base, c);
      at += c;
    }
    total = std::min(total, size);
  }
  stats_.rx_packets.fetch_add(1, std::memory_order_relaxed);
  stats_.rx_bytes.fetch_add(total, std::memory_order_relaxed);
  for (int i = 0; i < parts; ++i)
    rx.add({dma_base_ + rx_offset(pair, slots[i]), static_cast<uint32_t>(kBufSize), true}, slots[i]);
  return total;
}

uint8_t VirtioNetDriver::control(uint8_t cls, uint8_t cmd, const std::vector<uint8_t>& data) {
  if (!ctrl_) throw std::runtime_error("no control queue was negotiated");
  // The command page follows the RX buffers: header, data, then the ack.
  const uint64_t page = command_page();
  if (data.size() + 3 > 4096) throw std::invalid_argument("control command too long");
  uint8_t* p = ram_ + page;
  p[0] = cls;
  p[1] = cmd;
  if (!data.empty()) std::memcpy(p + 2, data.data(), data.size());
  p[2 + data.size()] = 0xff;
  const virtio::Buffer chain[2] = {{dma_base_ + page, static_cast<uint32_t>(2 + data.size()), false},
                                   {dma_base_ + page + 2 + data.size(), 1, true}};
  uint16_t slot = 0;
  uint32_t len = 0;
  if (!ctrl_->add_chain(chain, 0)) throw std::runtime_error("the control queue is full");
  ctrl_->publish();
  kick(ctrl_index_);
  for (int i = 0; i < 2000; ++i) {
    if (ctrl_->take(slot, len)) return p[2 + data.size()];
    pollfd pf{irq_fds_.back().get(), POLLIN, 0};  // the control queue's vector is the last
    if (wait(&pf, 1, 1) > 0 && (pf.revents & POLLIN)) {
      uint64_t v;
      (void)::read(pf.fd, &v, sizeof v);
    }
  }
  throw std::runtime_error("the device did not answer the control command");
}

bool VirtioNetDriver::send(const uint8_t* frame, size_t size, unsigned pair) {
  Pair& p = pairs_.at(pair);
  reclaim_tx(p);
  if (p.tx_free.empty() || size > kBufSize) return false;
  const uint16_t slot = p.tx_free.back();
  const uint64_t off = tx_offset(pair, slot);
  std::memcpy(ram_ + off, frame, size);
  if (!p.tx->add({dma_base_ + off, static_cast<uint32_t>(size), false}, slot)) return false;
  p.tx_free.pop_back();
  p.tx->publish();
  kick(2 * pair + 1);
  stats_.tx_packets.fetch_add(1, std::memory_order_relaxed);
  stats_.tx_bytes.fetch_add(size, std::memory_order_relaxed);
  return true;
}

size_t VirtioNetDriver::receive(uint8_t* out, size_t size, int timeout_ms) {
  constexpr unsigned kMaxPairs = 8;
  const unsigned pairs = std::min<unsigned>(queue_pairs(), kMaxPairs);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  // An interrupt is counted when its eventfd was signalled, whether or not
  // the frame it announced was already there before we waited.
  auto take_interrupt = [&](int fd) {
    uint64_t v;
    if (::read(fd, &v, sizeof v) == sizeof v) stats_.interrupts.fetch_add(1, std::memory_order_relaxed);
  };
  for (;;) {
    for (unsigned p = 0; p < pairs; ++p) take_interrupt(irq_fds_[2 * p].get());
    for (unsigned p = 0; p < pairs; ++p)
      if (const size_t got = take_rx(p, out, size, nullptr, 0)) {
        pairs_[p].rx->publish();
        kick(2 * p);
        return got;
      }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return 0;
    pollfd fds[kMaxPairs];
    for (unsigned p = 0; p < pairs; ++p) fds[p] = {irq_fds_[2 * p].get(), POLLIN, 0};
    (void)wait(fds, pairs, static_cast<int>(left.count()));
  }
}

void VirtioNetDriver::bridge(virtio::Tap& tap, const std::atomic<bool>& stop) {
  // What the kernel may hand us on the tap is what the device takes on TX.
  unsigned tun = 0;
  if (features_ & virtio::kNetCsum) {
    tun |= TUN_F_CSUM;
    if (features_ & virtio::kNetHostTso4) tun |= TUN_F_TSO4;
    if (features_ & virtio::kNetHostTso6) tun |= TUN_F_TSO6;
  }
  tap.set_offloads(tun);
  // Pair i with tap queue i when there is one per pair (the tap's kernel
  // side spreads the flows it sends); else every pair with queue 0.
  constexpr unsigned kMaxPairs = 8;
  const unsigned pairs = std::min<unsigned>(queue_pairs(), kMaxPairs);
  const bool own_queues = tap.queues() == pairs;
  auto tap_queue = [&](unsigned p) { return own_queues ? p : 0U; };
  // Without a tap queue per pair, pair 0 alone takes what the tap sends.
  auto reads_tap = [&](unsigned p) { return own_queues || p == 0; };
  // Interrupt eventfds first (read to clear them), then the tap queues.
  pollfd fds[3 * kMaxPairs];
  while (!stop.load(std::memory_order_relaxed)) {
    nfds_t count = 0;
    for (unsigned q = 0; q < 2 * pairs; ++q) fds[count++] = {irq_fds_[q].get(), POLLIN, 0};
    for (unsigned p = 0; p < pairs; ++p) {
      reclaim_tx(pairs_[p]);
      if (!pairs_[p].tx_free.empty() && reads_tap(p)) fds[count++] = {tap.fd(tap_queue(p)), POLLIN, 0};
    }
    if (wait(fds, count, 100) < 0 && errno != EINTR) throw_errno("poll");
    for (unsigned q = 0; q < 2 * pairs; ++q)
      if (fds[q].revents & POLLIN) {
        uint64_t v;
        (void)::read(fds[q].fd, &v, sizeof v);
        stats_.interrupts.fetch_add(1, std::memory_order_relaxed);
      }
    for (unsigned p = 0; p < pairs; ++p) {
      Pair& pr = pairs_[p];
      // Device -> tap.
      bool reposted = false;
      while (take_rx(p, nullptr, 0, &tap, tap_queue(p)) > 0) reposted = true;
      if (reposted) {
        pr.rx->publish();
        kick(2 * p);
      }
      // Tap -> device.
      if (!reads_tap(p)) continue;
      bool added = false;
      reclaim_tx(pr);
      while (!pr.tx_free.empty()) {
        const uint16_t slot = pr.tx_free.back();
        const uint64_t off = tx_offset(p, slot);
        const ssize_t got = tap.recv(tap_queue(p), ram_ + off, kBufSize);
        if (got <= 0) break;
        if (!pr.tx->add({dma_base_ + off, static_cast<uint32_t>(got), false}, slot)) break;
        pr.tx_free.pop_back();
        added = true;
        stats_.tx_packets.fetch_add(1, std::memory_order_relaxed);
        stats_.tx_bytes.fetch_add(static_cast<uint64_t>(got), std::memory_order_relaxed);
      }
      if (added) {
        pr.tx->publish();
        kick(2 * p + 1);
      }
    }
  }
}

}  // namespace sriovd::vfio_user
