#include "sriovd/guest/vfio_user_client.hpp"

#include <linux/vfio.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

#include "sriovd/util/error.hpp"
#include "sriovd/util/unix_socket.hpp"

namespace sriovd::guest {

using namespace vfio_user;  // the wire format this client speaks

namespace {

template <typename T>
std::span<const uint8_t> bytes_of(const T& v) {
  return {reinterpret_cast<const uint8_t*>(&v), sizeof v};
}

template <typename T>
T load(const std::vector<uint8_t>& p, size_t at = 0) {
  T v{};
  if (p.size() < at + sizeof v) throw Error(EPROTO, "a reply shorter than its structure");
  std::memcpy(&v, p.data() + at, sizeof v);
  return v;
}

}  // namespace

VfioUserClient::VfioUserClient(const std::string& socket_path, nlohmann::json capabilities, Dialect dialect)
    : dialect_(dialect) {
  sock_ = connect_unix(socket_path, "vfio-user socket");
  if (capabilities.is_null())
    capabilities = {{"capabilities", {{"max_msg_fds", kMaxMsgFds}, {"max_data_xfer_size", kMaxDataXfer}}}};
  std::vector<uint8_t> payload(4);
  const uint16_t minor = dialect_.version_json ? kMinor : 1;
  std::memcpy(payload.data(), &kMajor, 2);
  std::memcpy(payload.data() + 2, &minor, 2);
  if (dialect_.version_json) {
    const std::string text = capabilities.dump();
    payload.insert(payload.end(), text.begin(), text.end());
    payload.push_back(0);
  }
  Reply r = call(kVersion, payload);
  if (r.payload.size() < 4) throw Error(EPROTO, "VERSION reply of " + std::to_string(r.payload.size()) + " bytes");
  std::memcpy(&minor_, r.payload.data() + 2, 2);
  std::string caps(r.payload.begin() + 4, r.payload.end());
  while (!caps.empty() && caps.back() == '\0') caps.pop_back();
  if (!caps.empty()) {
    server_caps_ = nlohmann::json::parse(caps, nullptr, false);
    if (server_caps_.is_discarded()) throw Error(EPROTO, "VERSION reply with bad JSON");
  }
}

void VfioUserClient::send(const Header& h, std::span<const uint8_t> payload, std::span<const int> fds) {
  const iovec iov[2] = {{const_cast<Header*>(&h), sizeof h}, {const_cast<uint8_t*>(payload.data()), payload.size()}};
  const ssize_t n = send_with_fds(sock_.get(), std::span<const iovec>(iov, payload.empty() ? 1 : 2), fds);
  if (n != static_cast<ssize_t>(sizeof h + payload.size())) throw SystemError(n < 0 ? errno : EPIPE, "vfio-user send");
}

VfioUserClient::Reply VfioUserClient::receive() {
  Reply r;
  auto read_exact = [&](uint8_t* to, size_t size) {
    size_t got = 0;
    while (got < size) {
      bool truncated = false;
      const ssize_t n = recv_with_fds(sock_.get(), to + got, size - got, r.fds, 0, truncated, kMaxMsgFds);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw SystemError(n == 0 ? ECONNRESET : errno, "vfio-user server connection");
      got += static_cast<size_t>(n);
    }
  };
  read_exact(reinterpret_cast<uint8_t*>(&r.hdr), sizeof r.hdr);
  if (r.hdr.size < sizeof(Header) || r.hdr.size > kMaxMessage)
    throw Error(EPROTO, "a message of " + std::to_string(r.hdr.size) + " bytes");
  r.payload.resize(r.hdr.size - sizeof(Header));
  read_exact(r.payload.data(), r.payload.size());
  return r;
}

void VfioUserClient::serve_dma(const Reply& m) {
  Header h{m.hdr.id, m.hdr.command, sizeof(Header), kTypeReply, 0};
  const auto a = load<DmaAccess>(m.payload);
  const bool write = m.hdr.command == kDmaWrite;
  for (const Local& l : local_) {
    if (a.address < l.iova || a.count > l.size || a.address - l.iova > l.size - a.count) continue;
    if (write && (!l.writable || m.payload.size() != sizeof a + a.count)) break;
    uint8_t* at = l.host + (a.address - l.iova);
    std::vector<uint8_t> out(bytes_of(a).begin(), bytes_of(a).end());
    if (write)
      std::memcpy(at, m.payload.data() + sizeof a, a.count);
    else
      out.insert(out.end(), at, at + a.count);
    h.size = static_cast<uint32_t>(sizeof h + out.size());
    send(h, out, {});
    ++dma_served_;
    return;
  }
  h.flags |= kError;
  h.error = EFAULT;
  send(h, {}, {});
}

VfioUserClient::Reply VfioUserClient::request(uint16_t command, std::span<const uint8_t> payload,
                                              std::span<const int> fds, uint32_t flags) {
  const std::lock_guard lock(io_);
  const uint16_t id = dialect_.id_zero ? 0 : next_id_++;
  send(Header{id, command, static_cast<uint32_t>(sizeof(Header) + payload.size()), flags, 0}, payload, fds);
  if (flags & kNoReply) return {};
  for (;;) {
    Reply r = receive();
    if ((r.hdr.flags & kTypeMask) == kTypeCommand && (r.hdr.command == kDmaRead || r.hdr.command == kDmaWrite)) {
      serve_dma(r);
      continue;
    }
    if ((r.hdr.flags & kTypeMask) != kTypeReply || r.hdr.id != id || r.hdr.command != command)
      throw Error(EPROTO, "unexpected message (command " + std::to_string(r.hdr.command) + ", id " +
                              std::to_string(r.hdr.id) + ") waiting for the reply to " + command_name(command));
    return r;
  }
}

VfioUserClient::Reply VfioUserClient::call(uint16_t command, std::span<const uint8_t> payload,
                                           std::span<const int> fds) {
  Reply r = request(command, payload, fds);
  if (r.hdr.flags & kError)
    throw Error(r.hdr.error ? static_cast<int>(r.hdr.error) : EIO,
                std::string(command_name(command)) + " refused: " + std::strerror(static_cast<int>(r.hdr.error)));
  return r;
}

DeviceInfo VfioUserClient::device_info() {
  DeviceInfo q{sizeof(DeviceInfo), 0, 0, 0};
  return load<DeviceInfo>(call(kDeviceGetInfo, bytes_of(q)).payload);
}

VfioUserClient::Region VfioUserClient::region(uint32_t index) {
  // The fixed struct with room for the capabilities; a dialect may send its
  // whole reply buffer as the payload.
  const uint32_t argsz = dialect_.region_info_argsz ? dialect_.region_info_argsz : 4064;
  RegionInfo q{argsz, 0, index, 0, 0, 0};
  std::vector<uint8_t> payload(dialect_.region_info_argsz ? argsz : sizeof q);
  std::memcpy(payload.data(), &q, sizeof q);
  Reply r = call(kDeviceGetRegionInfo, payload);
  Region out;
  out.info = load<RegionInfo>(r.payload);
  if (!r.fds.empty()) out.fd = std::move(r.fds[0]);
  if ((out.info.flags & VFIO_REGION_INFO_FLAG_CAPS) && out.info.cap_offset) {
    uint32_t off = out.info.cap_offset;
    for (int hops = 0; off && hops < 16; ++hops) {
      const auto cap = load<CapHeader>(r.payload, off);
      if (cap.id == kCapSparseMmap) {
        const auto sm = load<SparseMmapCap>(r.payload, off);
        for (uint32_t i = 0; i < sm.nr_areas; ++i)
          out.sparse.push_back(load<SparseArea>(r.payload, off + sizeof sm + i * sizeof(SparseArea)));
      }
      off = cap.next;
    }
  }
  return out;
}

VfioUserClient::IoFds VfioUserClient::region_io_fds(uint32_t index) {
  RegionIoFds q{4096, 0, index, 0};
  Reply r = call(kDeviceGetRegionIoFds, bytes_of(q));
  const auto head = load<RegionIoFds>(r.payload);
  IoFds out;
  for (uint32_t i = 0; i < head.count; ++i)
    out.entries.push_back(load<IoFdEntry>(r.payload, sizeof head + i * sizeof(IoFdEntry)));
  out.fds = std::move(r.fds);
  return out;
}

IrqInfo VfioUserClient::irq_info(uint32_t index) {
  IrqInfo q{sizeof(IrqInfo), 0, index, 0};
  return load<IrqInfo>(call(kDeviceGetIrqInfo, bytes_of(q)).payload);
}

void VfioUserClient::read(uint32_t region, uint64_t offset, std::span<uint8_t> out) {
  RegionAccess a{offset, region, static_cast<uint32_t>(out.size())};
  Reply r = call(kRegionRead, bytes_of(a));
  if (r.payload.size() != sizeof a + out.size())
    throw Error(EPROTO, "REGION_READ reply of " + std::to_string(r.payload.size()) + " bytes");
  std::memcpy(out.data(), r.payload.data() + sizeof a, out.size());
}

void VfioUserClient::write(uint32_t region, uint64_t offset, std::span<const uint8_t> in) {
  RegionAccess a{offset, region, static_cast<uint32_t>(in.size())};
  std::vector<uint8_t> payload(bytes_of(a).begin(), bytes_of(a).end());
  payload.insert(payload.end(), in.begin(), in.end());
  call(kRegionWrite, payload);
}

void VfioUserClient::post_write(uint32_t region, uint64_t offset, std::span<const uint8_t> in) {
  if (in.size() > 8)
    throw std::invalid_argument("a posted write of " + std::to_string(in.size()) + " bytes (at most 8)");
  struct {
    RegionAccess a;
    uint8_t data[8];
  } m{{offset, region, static_cast<uint32_t>(in.size())}, {}};
  std::memcpy(m.data, in.data(), in.size());
  const std::lock_guard lock(io_);
  const uint16_t id = dialect_.id_zero ? 0 : next_id_++;
  send(Header{id, kRegionWrite, static_cast<uint32_t>(sizeof(Header) + sizeof m.a + in.size()), kNoReply, 0},
       {reinterpret_cast<const uint8_t*>(&m), sizeof m.a + in.size()}, {});
}

uint32_t VfioUserClient::read32(uint32_t region, uint64_t offset) {
  uint32_t v;
  read(region, offset, {reinterpret_cast<uint8_t*>(&v), sizeof v});
  return v;
}

void VfioUserClient::write32(uint32_t region, uint64_t offset, uint32_t value) {
  write(region, offset, {reinterpret_cast<const uint8_t*>(&value), sizeof value});
}

void VfioUserClient::set_irq_eventfds(uint32_t index, uint32_t start, std::span<const int> fds) {
  // A run of -1 entries is a de-assignment (no fds); a mix is sent as
  // separate runs, since a message carries either fds for all or none.
  for (size_t i = 0; i < fds.size();) {
    const bool none = fds[i] < 0;
    size_t j = i;
    while (j < fds.size() && (fds[j] < 0) == none) ++j;
    IrqSet s{sizeof(IrqSet), VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER, index,
             static_cast<uint32_t>(start + i), static_cast<uint32_t>(j - i)};
    call(kDeviceSetIrqs, bytes_of(s), none ? std::span<const int>{} : fds.subspan(i, j - i));
    i = j;
  }
}

void VfioUserClient::disable_irqs(uint32_t index) {
  IrqSet s{sizeof(IrqSet), VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER, index, 0, 0};
  call(kDeviceSetIrqs, bytes_of(s));
}

void VfioUserClient::mask(uint32_t index, uint32_t vector, bool masked) {
  IrqSet s{
      sizeof(IrqSet),
      static_cast<uint32_t>(VFIO_IRQ_SET_DATA_NONE | (masked ? VFIO_IRQ_SET_ACTION_MASK : VFIO_IRQ_SET_ACTION_UNMASK)),
      index, vector, 1};
  call(kDeviceSetIrqs, bytes_of(s));
}

void VfioUserClient::trigger(uint32_t index, uint32_t vector) {
  IrqSet s{sizeof(IrqSet), VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER, index, vector, 1};
  call(kDeviceSetIrqs, bytes_of(s));
}

void VfioUserClient::dma_map(uint64_t iova, uint64_t size, int fd, uint64_t offset, bool writable) {
  DmaMap d{sizeof(DmaMap), kDmaFlagRead | (writable ? kDmaFlagWrite : 0U), offset, iova, size};
  const int fds[1] = {fd};
  call(kDmaMap, bytes_of(d), fd >= 0 ? std::span<const int>(fds) : std::span<const int>{});
  if (fd >= 0 && dialect_.fd_with_unmap) mapped_.push_back({iova, size, UniqueFd(::dup(fd))});
}

void VfioUserClient::dma_map_local(uint64_t iova, uint64_t size, uint8_t* local, bool writable) {
  dma_map(iova, size, -1, 0, writable);
  local_.push_back({iova, size, local, writable});
}

void VfioUserClient::dma_unmap(uint64_t iova, uint64_t size) {
  DmaUnmap d{sizeof(DmaUnmap), 0, iova, size};
  int fd[1] = {-1};
  for (const Mapped& m : mapped_)
    if (m.iova == iova && m.size == size) fd[0] = m.fd.get();
  call(kDmaUnmap, bytes_of(d), fd[0] >= 0 ? std::span<const int>(fd) : std::span<const int>{});
  std::erase_if(mapped_, [&](const Mapped& m) { return m.iova == iova && m.size == size; });
  std::erase_if(local_, [&](const Local& l) { return l.iova == iova && l.size == size; });
}

void VfioUserClient::reset() { call(kDeviceReset, {}); }

std::vector<uint8_t> VfioUserClient::feature(uint32_t flags, std::span<const uint8_t> data, uint32_t reply_data) {
  const DeviceFeature f{static_cast<uint32_t>(sizeof(DeviceFeature) + std::max<size_t>(data.size(), reply_data)),
                        flags};
  std::vector<uint8_t> payload(bytes_of(f).begin(), bytes_of(f).end());
  payload.insert(payload.end(), data.begin(), data.end());
  const Reply r = call(kDeviceFeature, payload);
  if (r.payload.size() < sizeof f)
    throw std::runtime_error("DEVICE_FEATURE reply of " + std::to_string(r.payload.size()) + " bytes");
  return {r.payload.begin() + sizeof f, r.payload.end()};
}

uint64_t VfioUserClient::migration_flags() {
  const auto d = feature(kFeatureMigration | kFeatureGet, {}, 8);
  if (d.size() != 8) throw std::runtime_error("MIGRATION reply of " + std::to_string(d.size()) + " bytes");
  uint64_t flags = 0;
  std::memcpy(&flags, d.data(), 8);
  return flags;
}

uint32_t VfioUserClient::mig_state() {
  const auto d = feature(kFeatureMigDeviceState | kFeatureGet, {}, sizeof(MigDeviceState));
  if (d.size() != sizeof(MigDeviceState))
    throw std::runtime_error("MIG_DEVICE_STATE reply of " + std::to_string(d.size()) + " bytes");
  MigDeviceState s;
  std::memcpy(&s, d.data(), sizeof s);
  return s.device_state;
}

uint32_t VfioUserClient::set_mig_state(uint32_t state) {
  const MigDeviceState s{state, -1};
  const auto d = feature(kFeatureMigDeviceState | kFeatureSet, bytes_of(s));
  if (d.size() != sizeof s)
    throw std::runtime_error("MIG_DEVICE_STATE reply of " + std::to_string(d.size()) + " bytes");
  MigDeviceState got;
  std::memcpy(&got, d.data(), sizeof got);
  return got.device_state;
}

std::vector<uint8_t> VfioUserClient::mig_read_all(uint32_t chunk) {
  std::vector<uint8_t> out;
  for (;;) {
    const MigData q{static_cast<uint32_t>(sizeof(MigData) + chunk), chunk};
    const Reply r = call(kMigDataRead, bytes_of(q));
    MigData got;
    if (r.payload.size() < sizeof got)
      throw std::runtime_error("MIG_DATA_READ reply of " + std::to_string(r.payload.size()) + " bytes");
    std::memcpy(&got, r.payload.data(), sizeof got);
    if (got.size > chunk || r.payload.size() != sizeof got + got.size)
      throw std::runtime_error("MIG_DATA_READ reply of " + std::to_string(r.payload.size()) + " bytes saying " +
                               std::to_string(got.size));
    out.insert(out.end(), r.payload.begin() + sizeof got, r.payload.end());
    if (got.size < chunk) return out;
  }
}

void VfioUserClient::mig_write_all(std::span<const uint8_t> data, uint32_t chunk) {
  for (size_t done = 0; done < data.size();) {
    const size_t n = std::min<size_t>(chunk, data.size() - done);
    const MigData q{static_cast<uint32_t>(sizeof(MigData)), static_cast<uint32_t>(n)};
    std::vector<uint8_t> payload(bytes_of(q).begin(), bytes_of(q).end());
    payload.insert(payload.end(), data.begin() + static_cast<ptrdiff_t>(done),
                   data.begin() + static_cast<ptrdiff_t>(done + n));
    call(kMigDataWrite, payload);
    done += n;
  }
}

uint64_t VfioUserClient::dma_logging_start(uint64_t page_size, std::span<const DmaRange> ranges) {
  const DmaLoggingControl c{page_size, static_cast<uint32_t>(ranges.size()), 0};
  std::vector<uint8_t> data(bytes_of(c).begin(), bytes_of(c).end());
  const auto* r = reinterpret_cast<const uint8_t*>(ranges.data());
  data.insert(data.end(), r, r + ranges.size_bytes());
  const auto d = feature(kFeatureDmaLoggingStart | kFeatureSet, data);
  if (d.size() != data.size())
    throw std::runtime_error("DMA_LOGGING_START reply of " + std::to_string(d.size()) + " bytes");
  DmaLoggingControl got;
  std::memcpy(&got, d.data(), sizeof got);
  return got.page_size;
}

void VfioUserClient::dma_logging_stop() { (void)feature(kFeatureDmaLoggingStop | kFeatureSet, {}); }

std::vector<uint64_t> VfioUserClient::dma_logging_report(uint64_t iova, uint64_t length, uint64_t page_size) {
  const DmaLoggingReport q{iova, length, page_size};
  const uint64_t bits = length / page_size + (length % page_size ? 1 : 0);
  const uint64_t words = (bits + 63) / 64;
  const auto d =
      feature(kFeatureDmaLoggingReport | kFeatureGet, bytes_of(q), static_cast<uint32_t>(sizeof q + words * 8));
  if (d.size() != sizeof q + words * 8)
    throw std::runtime_error("DMA_LOGGING_REPORT reply of " + std::to_string(d.size()) + " bytes");
  std::vector<uint64_t> bitmap(words);
  std::memcpy(bitmap.data(), d.data() + sizeof q, words * 8);
  return bitmap;
}

}  // namespace sriovd::guest
