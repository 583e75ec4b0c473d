#include "sriovd/vfio_user/server.hpp"

#include <linux/vfio.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <utility>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "sriovd/util/log_limit.hpp"
#include "sriovd/util/eventfd.hpp"
#include "sriovd/util/peer_session.hpp"
#include "sriovd/util/protocol_error.hpp"
#include "sriovd/util/unix_socket.hpp"
#include "sriovd/util/hex.hpp"
#include "sriovd/util/printable.hpp"
#include "sriovd/virtio/device.hpp"

namespace sriovd::vfio_user {

namespace {

// How long a whole message may take once its first byte came: a client
// that stalls or trickles is cut off rather than blocking the control thread.
constexpr int kMessageTimeoutMs = 1000;

template <typename T>
T load(const std::vector<uint8_t>& p, size_t at = 0) {
  T v{};
  std::memcpy(&v, p.data() + at, sizeof v);
  return v;
}

template <typename T>
void append(std::vector<uint8_t>& out, const T& v) {
  const auto* b = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), b, b + sizeof v);
}

}  // namespace

Server::Server(asio::io_context& io, std::string socket_path, ExportedDevice& device, std::vector<uid_t> allowed_uids)
    : Server(io, std::move(socket_path), device, std::move(allowed_uids), std::optional<SocketFile>()) {}

namespace {

// The predecessor's socket, when it is still the file at `path`; else the
// successor listens on a new one (its client's connection is not lost:
// only a client that connects later sees the new socket).
std::optional<SocketFile> adopt_socket(const std::string& path, const std::string& name, ServerHandover& h) {
  if (h.listener == ServerHandover::kNoFd) return std::nullopt;
  try {
    return SocketFile::adopt(path, "vfio-user socket of " + name, h.take_fd(h.listener), h.take_fd(h.listener_handle));
  } catch (const std::exception& e) {
    spdlog::warn("vfio-user: {}: {}; listening on a new socket", name, e.what());
    return std::nullopt;
  }
}

}  // namespace

Server::Server(asio::io_context& io, const std::string& socket_path, ExportedDevice& device,
               std::vector<uid_t> allowed_uids, ServerHandover handover)
    : Server(io, socket_path, device, std::move(allowed_uids), adopt_socket(socket_path, device.name(), handover)) {
  take_over(handover);
}

Server::Server(asio::io_context& io, std::string socket_path, ExportedDevice& device, std::vector<uid_t> allowed_uids,
               std::optional<SocketFile> adopted)
    : path_(std::move(socket_path)),
      device_(device),
      conn_(
          io,
          FramedReader(sizeof(Header), kMaxMsgFds,
                       [](std::span<const uint8_t> h) {
                         Header hdr;
                         std::memcpy(&hdr, h.data(), sizeof hdr);
                         if (hdr.size < sizeof(Header) || hdr.size > kMaxMessage)
                           throw FramingError(std::string(command_name(hdr.command)) + " message of " +
                                              std::to_string(hdr.size) + " bytes (16.." + std::to_string(kMaxMessage) +
                                              " allowed)");
                         return size_t{hdr.size - sizeof(Header)};
                       }),
          std::chrono::milliseconds(kMessageTimeoutMs), [this](FramedReader& r) { on_message(r); },
          [this](const std::string& why, EndCause cause) { on_end(why, cause); }),
      listener_(make_listener(io, std::move(adopted), std::move(allowed_uids))) {
  if (Migratable* m = device_.migratable()) migration_ = std::make_unique<Migration>(*m, device_.name());
  spdlog::info("vfio-user: {} listening on {}", device_.name(), path_);
}

UnixListener Server::make_listener(asio::io_context& io, std::optional<SocketFile> adopted,
                                   std::vector<uid_t> allowed_uids) {
  UnixListener::Options options{"vfio-user: " + device_.name(), "the export's allowed_uids", 0660,
                                std::move(allowed_uids)};
  auto admit = [this](UniqueFd fd, const ucred& peer) {
    spdlog::info("vfio-user: {}: client connected (pid {}, uid {})", device_.name(), peer.pid, peer.uid);
    client_pid_ = peer.pid;
    adopt(std::move(fd));
  };
  auto busy = [this] { return conn_.connected() && !conn_.settle_if_closed(); };
  auto refuse = [this](UniqueFd, const std::string& why) {
    ++stats_.refused_peers;
    stats_.last_error = why;
  };
  if (adopted) return UnixListener(io, std::move(*adopted), std::move(options), admit, busy, refuse);
  return UnixListener(io, path_, std::move(options), admit, busy, refuse);
}

Server::~Server() {
  // The successor serves the client and the device's port: nothing of
  // theirs is reset or removed here (the stopped device's windows unmap,
  // the fds close).
  if (handed_over_) return;
  if (conn_.connected()) disconnect("the export is being removed");
  if (!held_.empty()) {
    spdlog::critical("vfio-user: {}: {} DMA window(s) a stuck device worker used are left mapped", device_.name(),
                     held_.size());
    // Left mapped (and registered) for good: the worker may still touch them.
    for (auto& map : held_) (void)map.release();
  }
}

void Server::adopt(UniqueFd fd) {
  negotiated_ = false;
  peer_max_fds_ = 1;
  peer_max_xfer_ = kMaxDataXfer;
  begin_session();
  conn_.adopt(std::move(fd));
}

void Server::begin_session() {
  ++stats_.connections;
  quota_.set_limits(default_peer_memory_limits());
  // Each access is checked against its region's flags and size: taken
  // once per connection, so a REGION_READ/WRITE copies no description.
  bounds_.clear();
  for (uint32_t i = 0; i < device_.num_regions(); ++i) {
    try {
      const RegionDescription d = device_.region(i);
      bounds_.push_back({d.flags, d.size});
    } catch (const std::exception& e) {
      // A region the device cannot describe takes no access.
      spdlog::warn("vfio-user: {}: region {}: {}", device_.name(), i, e.what());
      bounds_.push_back({0, 0});
    }
  }
}

// A whole message (the connection reads without blocking and gives each
// message kMessageTimeoutMs from its first byte to be whole). The
// connection's message buffer is reused: no allocation per message.
void Server::on_message(FramedReader& reader) {
  take(reader, in_);
  try {
    dispatch(in_);
    in_.fds.clear();  // what the handler did not take is closed now, not at the next message
    while (conn_.connected() && !deferred_.empty()) {
      Message d = std::move(deferred_.front());
      deferred_.pop_front();
      dispatch(d);
    }
  } catch (const ProtocolError& e) {
    throw FramingError(e.what());  // the client's bytes broke the session: counted as such
  }
}

void Server::take(FramedReader& reader, Message& m) {
  reader.take({reinterpret_cast<uint8_t*>(&m.hdr), sizeof m.hdr}, m.payload, m.fds);
  ++stats_.messages;
}

void Server::send(const Header& h, std::span<const uint8_t> payload, std::span<const int> fds) {
  if (!conn_.connected()) throw std::runtime_error("the connection ended");
  const iovec iov[2] = {{const_cast<Header*>(&h), sizeof h}, {const_cast<uint8_t*>(payload.data()), payload.size()}};
  // Never waits for the client: what its socket does not take is queued
  // (bounded) and its next requests wait until it reads (PeerConnection).
  try {
    conn_.send(std::span<const iovec>(iov, payload.empty() ? 1 : 2), fds);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("cannot send ") + command_name(h.command) + ": " + e.what());
  }
}

bool Server::memory_faulted() const {
  for (const auto& map : mappings_)
    if (map.memory && map.memory->faulted()) return true;
  return false;
}

void Server::dispatch(Message& m) {
  // The client shrank the file under one of its windows: those pages read
  // as zeros now, and the session ends (its device is reset with it).
  if (peer_mapping_faults() != faults_seen_) {
    faults_seen_ = peer_mapping_faults();
    if (memory_faulted()) throw ProtocolError("the client truncated memory it had shared for DMA under its mapping");
  }
  // Built only when something is refused: a MSI-X mask write is a message,
  // and a guest may send one per interrupt.
  const auto what = [&] {
    return std::string(command_name(m.hdr.command)) + " (" + std::to_string(m.hdr.command) + ")";
  };
  if ((m.hdr.flags & kTypeMask) != kTypeCommand)
    throw ProtocolError("a " +
                        std::string((m.hdr.flags & kTypeMask) == kTypeReply ? "reply" : "message of unknown type") +
                        " to nothing, command " + what());
  if (!negotiated_ && m.hdr.command != kVersion) throw ProtocolError(what() + " before VERSION");
  if (negotiated_ && m.hdr.command == kVersion) throw ProtocolError("a second VERSION");
  Header reply{m.hdr.id, m.hdr.command, sizeof(Header), kTypeReply, 0};
  // One reply buffer for the connection: a reply allocates nothing once
  // it has grown to the largest one sent.
  Reply& r = reply_;
  r.payload.clear();
  r.fds.clear();
  try {
    const Command* c = command_of(m.hdr.command);
    if (!c) throw Error(ENOSYS, what() + " is not served");
    if (c->exact ? m.payload.size() != c->payload : m.payload.size() < c->payload)
      throw Error(EINVAL, what() + " with a payload of " + std::to_string(m.payload.size()) + " bytes, " +
                              (c->exact ? "" : "at least ") + std::to_string(c->payload) + " expected");
    if (m.fds.size() > c->max_fds)
      throw Error(EINVAL, what() + " with " + std::to_string(m.fds.size()) + " fds, at most " +
                              std::to_string(c->max_fds) + " expected");
    (this->*(c->handler))(m, r);
  } catch (const Error& e) {
    ++stats_.error_replies;
    stats_.last_error = e.what();
    log_refusal(m.hdr.command, e.what());
    reply.flags |= kError;
    reply.error = static_cast<uint32_t>(e.code());
    if (m.hdr.command == kVersion) {  // no version, no session
      send(reply, {}, {});
      throw ProtocolError(e.what());
    }
    if (!(m.hdr.flags & kNoReply)) send(reply, {}, {});
    return;
  } catch (const ProtocolError&) {
    throw;
  } catch (const std::exception& e) {
    // The device failed on a request that was valid: the client hears EIO,
    // the daemon goes on.
    ++stats_.error_replies;
    stats_.last_error = e.what();
    spdlog::warn("vfio-user: {}: {} failed: {}", device_.name(), what(), e.what());
    reply.flags |= kError;
    reply.error = EIO;
    if (!(m.hdr.flags & kNoReply)) send(reply, {}, {});
    return;
  }
  if (m.hdr.flags & kNoReply) return;
  reply.size = static_cast<uint32_t>(sizeof(Header) + r.payload.size());
  send(reply, r.payload, r.fds);
}

// A client may send refused requests without pause (posted writes take no
// reply): at most LogLimit::kBurst a second are logged, and the next logged
// one says how many were not. Every one is counted (stats().error_replies);
// one that is not logged builds no text.
void Server::log_refusal(uint16_t command, const char* why) {
  log_limited(log_limits_.refusal, spdlog::level::warn, "vfio-user: {}: {} ({}) refused: {}", device_.name(),
              command_name(command), command, why);
}

// The one table of commands: the payload each must carry (its exact size,
// or the fixed part of a variable one), how many fds it may, and the method
// that serves it. Shapes are checked here, once, before any handler runs.
// The queries with an argsz (DEVICE_GET_INFO, GET_REGION_INFO, GET_IRQ_INFO,
// GET_REGION_IO_FDS) are the fixed struct plus whatever the client's buffer
// holds: a client may send its whole reply buffer (one sends 4064 bytes of
// GET_REGION_INFO), so any payload of at least the fixed size is taken, and
// the reply fits the argsz asked for. DMA_UNMAP may carry the window's fd
// (a client that sends it back): accepted and closed.
const Server::Command* Server::command_of(uint16_t command) {
  static const Command table[] = {
      {kVersion, 4, false, 0, &Server::version},
      {kDmaMap, sizeof(DmaMap), true, 1, &Server::dma_map},
      {kDmaUnmap, sizeof(DmaUnmap), false, 1, &Server::dma_unmap},
      {kDeviceGetInfo, sizeof(DeviceInfo), false, 0, &Server::device_info},
      {kDeviceGetRegionInfo, sizeof(RegionInfo), false, 0, &Server::region_info},
      {kDeviceGetRegionIoFds, sizeof(RegionIoFds), false, 0, &Server::region_io_fds},
      {kDeviceGetIrqInfo, sizeof(IrqInfo), false, 0, &Server::irq_info},
      {kDeviceSetIrqs, sizeof(IrqSet), false, kMaxMsgFds, &Server::set_irqs},
      {kRegionRead, sizeof(RegionAccess), true, 0, &Server::region_access},
      {kRegionWrite, sizeof(RegionAccess), false, 0, &Server::region_access},
      {kDeviceReset, 0, true, 0, &Server::device_reset},
      {kRegionWriteMulti, sizeof(uint64_t), false, 0, &Server::region_write_multi},
      {kDeviceFeature, sizeof(DeviceFeature), false, 0, &Server::device_feature},
      {kMigDataRead, sizeof(MigData), true, 0, &Server::mig_data_read},
      {kMigDataWrite, sizeof(MigData), false, 0, &Server::mig_data_write},
  };
  for (const Command& c : table)
    if (c.command == command) return &c;
  return nullptr;
}

void Server::device_info(Message& /*m*/, Reply& r) {
  DeviceInfo info{sizeof(DeviceInfo),
                  static_cast<uint32_t>(VFIO_DEVICE_FLAGS_PCI | (device_.can_reset() ? VFIO_DEVICE_FLAGS_RESET : 0)),
                  device_.num_regions(), device_.num_irqs()};
  append(r.payload, info);
}

void Server::irq_info(Message& m, Reply& r) {
  auto q = load<IrqInfo>(m.payload);
  if (q.index >= device_.num_irqs()) throw Error(EINVAL, "no IRQ index " + std::to_string(q.index));
  const vfio::IrqInfo info = device_.irq(q.index);
  IrqInfo out{sizeof(IrqInfo), info.flags, q.index, info.count};
  append(r.payload, out);
}

void Server::region_access(Message& m, Reply& r) {
  const auto a = load<RegionAccess>(m.payload);
  const bool write = m.hdr.command == kRegionWrite;
  check_access(a.region, a.offset, a.count, write);
  if (write && m.payload.size() != sizeof a + a.count)
    throw Error(EINVAL, "write of " + std::to_string(a.count) + " bytes carrying " +
                            std::to_string(m.payload.size() - sizeof a));
  append(r.payload, a);
  if (write) {
    device_.write(a.region, a.offset, std::span<const uint8_t>(m.payload).subspan(sizeof a));
  } else {
    r.payload.resize(sizeof a + a.count);
    device_.read(a.region, a.offset, std::span<uint8_t>(r.payload).subspan(sizeof a));
  }
}

void Server::device_reset(Message& /*m*/, Reply& /*r*/) {
  if (!device_.can_reset()) throw Error(ENOTSUP, device_.name() + " cannot be reset");
  device_.reset();
  if (migration_) migration_->device_reset();  // RUNNING again (ERROR ends here)
}

namespace {

const char* feature_name(uint32_t feature) {
  switch (feature) {
    case kFeatureMigration: return "MIGRATION";
    case kFeatureMigDeviceState: return "MIG_DEVICE_STATE";
    case kFeatureDmaLoggingStart: return "DMA_LOGGING_START";
    case kFeatureDmaLoggingStop: return "DMA_LOGGING_STOP";
    case kFeatureDmaLoggingReport: return "DMA_LOGGING_REPORT";
    default: return "unknown";
  }
}

}  // namespace

// VFIO_USER_DEVICE_FEATURE: the migration features (the only ones the
// protocol carries). GET or SET, or PROBE with either or neither; each
// feature takes the operations linux/vfio.h gives it. A device that cannot
// be migrated refuses them all with ENOTTY, as VFIO does (a client then
// blocks migration instead of trying it).
void Server::device_feature(Message& m, Reply& r) {
  const auto f = load<DeviceFeature>(m.payload);
  const uint32_t feature = f.flags & kFeatureMask;
  const uint32_t ops = f.flags & ~kFeatureMask;
  const std::span<const uint8_t> data = std::span<const uint8_t>(m.payload).subspan(sizeof f);
  const std::string what =
      std::string("DEVICE_FEATURE ") + feature_name(feature) + " (" + std::to_string(feature) + ")";
  if (ops & ~(kFeatureGet | kFeatureSet | kFeatureProbe)) throw Error(EINVAL, what + " with unknown flags " + hex(ops));
  const bool get = ops & kFeatureGet, set = ops & kFeatureSet, probe = ops & kFeatureProbe;
  if (!probe && get == set) throw Error(EINVAL, what + ": GET or SET, one of them");
  if (!migration_) throw Error(ENOTTY, what + ": " + device_.name() + " cannot be migrated");
  uint32_t allowed = 0;
  switch (feature) {
    case kFeatureMigration:
    case kFeatureDmaLoggingReport: allowed = kFeatureGet; break;
    case kFeatureMigDeviceState: allowed = kFeatureGet | kFeatureSet; break;
    case kFeatureDmaLoggingStart:
    case kFeatureDmaLoggingStop: allowed = kFeatureSet; break;
    default: throw Error(ENOTTY, what + " is not served");
  }
  if (ops & (kFeatureGet | kFeatureSet) & ~allowed)
    throw Error(EINVAL, what + " does not take " + (get ? "GET" : "SET"));
  // The reply: the request's header and data (SET, PROBE), or the header
  // and the feature's data (GET), with argsz what the whole needs - no
  // more than the client's buffer (the request's argsz).
  const auto answer = [&](std::span<const uint8_t> out, std::span<const uint8_t> tail = {}) {
    const uint64_t need = sizeof f + out.size() + tail.size();
    if (f.argsz < need)
      throw Error(EINVAL, what + " with argsz " + std::to_string(f.argsz) + ": the reply is " + std::to_string(need) +
                              " bytes");
    append(r.payload, DeviceFeature{static_cast<uint32_t>(need), f.flags});
    r.payload.insert(r.payload.end(), out.begin(), out.end());
    r.payload.insert(r.payload.end(), tail.begin(), tail.end());
  };
  if (probe) {
    answer(data);
    return;
  }
  Migration& mig = *migration_;
  const auto as_bytes = [](const auto& v) { return std::span(reinterpret_cast<const uint8_t*>(&v), sizeof v); };
  const auto want_data = [&](size_t size) {
    if (data.size() != size)
      throw Error(EINVAL, what + " with " + std::to_string(data.size()) + " bytes of data, " + std::to_string(size) +
                              " expected");
  };
  switch (feature) {
    case kFeatureMigration: {
      want_data(0);
      answer(as_bytes(kMigrationStopCopy));
      return;
    }
    case kFeatureMigDeviceState: {
      if (get) {
        want_data(0);
        answer(as_bytes(MigDeviceState{static_cast<uint32_t>(mig.state()), -1}));
        return;
      }
      want_data(sizeof(MigDeviceState));
      MigDeviceState s;
      std::memcpy(&s, data.data(), sizeof s);
      mig.set_state(s.device_state);
      answer(as_bytes(MigDeviceState{static_cast<uint32_t>(mig.state()), -1}));
      return;
    }
    case kFeatureDmaLoggingStart: {
      if (data.size() < sizeof(DmaLoggingControl)) want_data(sizeof(DmaLoggingControl));
      DmaLoggingControl c;
      std::memcpy(&c, data.data(), sizeof c);
      if (c.num_ranges > DmaLog::kMaxRanges)
        throw Error(EINVAL, what + " of " + std::to_string(c.num_ranges) + " ranges (at most " +
                                std::to_string(DmaLog::kMaxRanges) + ")");
      want_data(sizeof c + size_t{c.num_ranges} * sizeof(DmaRange));
      std::vector<DmaRange> ranges(c.num_ranges);
      if (c.num_ranges) std::memcpy(ranges.data(), data.data() + sizeof c, c.num_ranges * sizeof(DmaRange));
      if (ranges.empty()) {
        // None: every write is logged - over the windows the device can
        // write now (DMA_MAP of another writable one is refused meanwhile).
        for (const DmaWindow& w : windows_)
          if (w.writable && w.host) ranges.push_back({w.iova, w.size});
        if (ranges.empty()) throw Error(EINVAL, what + " of every write with no writable DMA window mapped");
      }
      const uint64_t before = c.page_size;
      c.page_size = mig.start_logging(c.page_size, ranges);
      if (c.page_size != before)
        log_limited(log_limits_.logging, spdlog::level::info,
                    "vfio-user: {}: DMA logging by {} byte pages ({} asked for)", device_.name(), c.page_size, before);
      answer(as_bytes(c), data.subspan(sizeof c));
      return;
    }
    case kFeatureDmaLoggingStop: {
      want_data(0);
      mig.stop_logging();
      answer({});
      return;
    }
    case kFeatureDmaLoggingReport: {
      want_data(sizeof(DmaLoggingReport));
      DmaLoggingReport q;
      std::memcpy(&q, data.data(), sizeof q);
      if (!mig.dma_log()) throw Error(EINVAL, what + ": DMA logging is not on");
      if (q.page_size == 0 || (q.page_size & (q.page_size - 1)) != 0)
        throw Error(EINVAL, what + ": page size " + std::to_string(q.page_size) + " is not a power of two");
      if (q.length / q.page_size / 8 > peer_max_xfer_)
        throw Error(E2BIG, what + " of [" + hex(q.iova) + ", +" + hex(q.length) + ") by " +
                               std::to_string(q.page_size) + " byte pages: a bitmap larger than " +
                               std::to_string(peer_max_xfer_) + " bytes; ask for less at a time");
      const uint64_t words = DmaLog::report_words(q.length, q.page_size);
      if (f.argsz < sizeof f + sizeof q + words * 8)
        throw Error(EINVAL, what + " with argsz " + std::to_string(f.argsz) + ": the reply is " +
                                std::to_string(sizeof f + sizeof q + words * 8) + " bytes");
      std::vector<uint64_t> bitmap(words, 0);
      mig.report(q.iova, q.length, q.page_size, bitmap);
      answer(as_bytes(q), std::span(reinterpret_cast<const uint8_t*>(bitmap.data()), words * 8));
      return;
    }
  }
}

// MIG_DATA_READ: the next part of the state STOP_COPY took; fewer bytes
// than asked for is its end.
void Server::mig_data_read(Message& m, Reply& r) {
  const auto q = load<MigData>(m.payload);
  if (!migration_) throw Error(ENOTTY, "MIG_DATA_READ: " + device_.name() + " cannot be migrated");
  if (q.size > peer_max_xfer_)
    throw Error(EINVAL, "MIG_DATA_READ of " + std::to_string(q.size) + " bytes (at most " +
                            std::to_string(peer_max_xfer_) + ")");
  if (q.argsz < sizeof q + uint64_t{q.size})
    throw Error(EINVAL, "MIG_DATA_READ of " + std::to_string(q.size) + " bytes with argsz " + std::to_string(q.argsz));
  r.payload.resize(sizeof q + q.size);
  const size_t n = migration_->read(std::span<uint8_t>(r.payload).subspan(sizeof q));
  r.payload.resize(sizeof q + n);
  const MigData head{static_cast<uint32_t>(sizeof q + n), static_cast<uint32_t>(n)};
  std::memcpy(r.payload.data(), &head, sizeof head);
}

void Server::mig_data_write(Message& m, Reply& /*r*/) {
  const auto q = load<MigData>(m.payload);
  if (!migration_) throw Error(ENOTTY, "MIG_DATA_WRITE: " + device_.name() + " cannot be migrated");
  if (m.payload.size() != sizeof q + uint64_t{q.size})
    throw Error(EINVAL, "MIG_DATA_WRITE of " + std::to_string(q.size) + " bytes carrying " +
                            std::to_string(m.payload.size() - sizeof q));
  migration_->write(std::span<const uint8_t>(m.payload).subspan(sizeof q));
}

void Server::version(Message& m, Reply& r) {
  const auto major = load<uint16_t>(m.payload, 0);
  const auto minor = load<uint16_t>(m.payload, 2);
  if (major != kMajor)
    throw Error(ENOTSUP, "protocol version " + std::to_string(major) + "." + std::to_string(minor) + ": only major " +
                             std::to_string(kMajor) + " is spoken");
  bool write_multiple = false;  // offered back only when proposed (the reply's capabilities are a subset)
  if (m.payload.size() > 4) {
    std::string text(reinterpret_cast<const char*>(m.payload.data()) + 4, m.payload.size() - 4);
    if (!text.empty() && text.back() == '\0') text.pop_back();
    if (text.find('\0') != std::string::npos) throw Error(EINVAL, "VERSION data with a NUL inside");
    if (!text.empty()) {
      const auto j = nlohmann::json::parse(text, nullptr, false);
      if (j.is_discarded() || !j.is_object())
        throw Error(EINVAL, "VERSION data is not a JSON object: " + printable(text));
      if (j.contains("capabilities")) {
        const auto& caps = j["capabilities"];
        if (!caps.is_object()) throw Error(EINVAL, "VERSION capabilities is not an object");
        if (caps.contains("max_msg_fds")) {
          if (!caps["max_msg_fds"].is_number_unsigned()) throw Error(EINVAL, "max_msg_fds is not a number");
          peer_max_fds_ = std::min<uint32_t>(caps["max_msg_fds"].get<uint32_t>(), kMaxMsgFds);
        }
        if (caps.contains("write_multiple")) {
          if (!caps["write_multiple"].is_boolean()) throw Error(EINVAL, "write_multiple is not a boolean");
          write_multiple = caps["write_multiple"].get<bool>();
        }
        if (caps.contains("max_data_xfer_size")) {
          if (!caps["max_data_xfer_size"].is_number_unsigned() || caps["max_data_xfer_size"].get<uint64_t>() == 0)
            throw Error(EINVAL, "max_data_xfer_size is not a positive number");
          peer_max_xfer_ =
              static_cast<uint32_t>(std::min<uint64_t>(caps["max_data_xfer_size"].get<uint64_t>(), kMaxDataXfer));
        }
      }
    }
  }
  negotiated_ = true;
  nlohmann::json caps = {{"capabilities",
                          {{"max_msg_fds", kMaxMsgFds},
                           {"max_data_xfer_size", kMaxDataXfer},
                           {"max_dma_maps", kMaxDmaMaps},
                           {"pgsizes", kPageSizes}}}};
  if (write_multiple) caps["capabilities"]["write_multiple"] = true;
  const std::string text = caps.dump();
  append(r.payload, kMajor);
  append(r.payload, std::min(minor, kMinor));
  r.payload.insert(r.payload.end(), text.begin(), text.end());
  r.payload.push_back(0);
  return;
}

void Server::dma_map(Message& m, Reply& /*r*/) {
  const auto d = load<DmaMap>(m.payload);
  const std::string what = "DMA window [" + hex(d.address) + ", +" + hex(d.size) + ")";
  // Not a query: argsz is the size of this message's structure (the spec's
  // 32 bytes), not of a buffer for a reply - anything else is malformed.
  if (d.argsz != sizeof d) throw Error(EINVAL, "DMA_MAP argsz " + std::to_string(d.argsz) + ", 32 expected");
  if (d.flags & ~(kDmaFlagRead | kDmaFlagWrite)) throw Error(EINVAL, what + " with unknown flags " + hex(d.flags));
  if (d.size == 0 || d.address + d.size < d.address) throw Error(EINVAL, what + ": empty or wrapping");
  if ((d.address | d.size) % kPageSizes) throw Error(EINVAL, what + " is not page aligned");
  if (windows_.size() >= kMaxDmaMaps)
    throw Error(ENOSPC, what + ": " + std::to_string(kMaxDmaMaps) + " windows already");
  for (const DmaWindow& w : windows_)
    if (d.address < w.iova + w.size && w.iova < d.address + d.size)
      throw Error(EEXIST, what + " overlaps [" + hex(w.iova) + ", +" + hex(w.size) + ")");
  // While a migration logs the device's writes, a window it could write
  // outside the logged ranges would be written unseen by the copy.
  if (migration_ && migration_->dma_log() && (d.flags & kDmaFlagWrite) && !m.fds.empty() &&
      !migration_->dma_log()->tracks(d.address, d.size))
    throw Error(EBUSY, what + ": DMA logging is on and does not cover it (a page written there would not be copied)");
  DmaWindow w{d.address, d.size, nullptr, (d.flags & kDmaFlagRead) != 0, (d.flags & kDmaFlagWrite) != 0};
  Mapping map;
  if (!m.fds.empty()) {
    // The fd's real size bounds the window, and the client may truncate its
    // file under it later: that fails its connection, not the daemon
    // (util/peer_mapping.hpp). Charged to this client's share.
    const int prot = (w.readable ? PROT_READ : 0) | (w.writable ? PROT_WRITE : 0);
    try {
      map.memory = std::make_unique<PeerMemory>(m.fds[0].get(), d.offset, d.size, prot, &quota_,
                                                what + " at fd offset " + hex(d.offset));
    } catch (const PeerMemoryError& e) {
      throw Error(e.error, e.what());
    }
    w.host = map.memory->data();
    w.guard = &map.memory->guard();
    map.fd = std::move(m.fds[0]);  // for a handover
    map.offset = d.offset;
  }
  device_.dma_mapped(w);  // on a throw, map unmaps itself
  windows_.push_back(w);
  mappings_.push_back(std::move(map));
  return;
}

void Server::dma_unmap(Message& m, Reply& r) {
  const auto d = load<DmaUnmap>(m.payload);
  if (d.flags & ~kDmaUnmapAll) throw Error(EINVAL, "DMA_UNMAP with unknown flags " + hex(d.flags));
  append(r.payload, d);
  if (d.flags & kDmaUnmapAll) {
    if (d.address || d.size) throw Error(EINVAL, "DMA_UNMAP of everything with an address or size");
    unmap_all();
    return;
  }
  for (size_t i = 0; i < windows_.size(); ++i) {
    if (windows_[i].iova != d.address || windows_[i].size != d.size) continue;
    device_.dma_unmapped(windows_[i]);
    mappings_[i].memory.reset();
    windows_.erase(windows_.begin() + static_cast<ptrdiff_t>(i));
    mappings_.erase(mappings_.begin() + static_cast<ptrdiff_t>(i));
    return;
  }
  throw Error(ENOENT, "DMA_UNMAP of [" + hex(d.address) + ", +" + hex(d.size) + "): no such window");
}

void Server::unmap_all() {
  for (size_t i = windows_.size(); i-- > 0;) {
    try {
      device_.dma_unmapped(windows_[i]);
      mappings_[i].memory.reset();
    } catch (const std::exception& e) {
      // The device still uses the window (a worker that did not stop): it
      // stays mapped, for as long as the server lives, rather than be
      // pulled from under that thread.
      spdlog::error("vfio-user: {}: DMA window {} stays mapped: {}", device_.name(), hex(windows_[i].iova), e.what());
      held_.push_back(std::move(mappings_[i].memory));
    }
  }
  windows_.clear();
  mappings_.clear();
}

// One region access, checked against the bounds taken at connect: the
// region exists and allows it, 1..max bytes, inside the region (no wrap).
void Server::check_access(uint32_t region, uint64_t offset, uint32_t count, bool write) const {
  const char* verb = write ? "write" : "read";
  if (region >= bounds_.size())
    throw Error(EINVAL, std::string(verb) + " of region " + std::to_string(region) + ": no such region");
  if (count == 0 || count > kMaxDataXfer)
    throw Error(EINVAL, std::string(verb) + " of " + std::to_string(count) + " bytes (1.." +
                            std::to_string(kMaxDataXfer) + ")");
  const RegionBounds& reg = bounds_[region];
  if (!(reg.flags & (write ? VFIO_REGION_INFO_FLAG_WRITE : VFIO_REGION_INFO_FLAG_READ)))
    throw Error(EINVAL, std::string(verb) + " of region " + std::to_string(region) + ", which does not allow it");
  if (offset > reg.size || count > reg.size - offset)
    throw Error(EINVAL, std::string(verb) + " of [" + hex(offset) + ", +" + std::to_string(count) +
                            ") outside region " + std::to_string(region) + " of " + hex(reg.size) + " bytes");
}

// REGION_WRITE_MULTI: every write is checked before the first is done, so
// a batch with one bad entry changes nothing; then they are done in order.
void Server::region_write_multi(Message& m, Reply& r) {
  const auto count = load<uint64_t>(m.payload);
  if (count == 0 || count > kMaxWriteMulti)
    throw Error(EINVAL, "REGION_WRITE_MULTI of " + std::to_string(count) + " writes (1.." +
                            std::to_string(kMaxWriteMulti) + ")");
  if (m.payload.size() != sizeof count + count * sizeof(WriteOne))
    throw Error(EINVAL, "REGION_WRITE_MULTI of " + std::to_string(count) + " writes in a payload of " +
                            std::to_string(m.payload.size()) + " bytes");
  for (uint64_t i = 0; i < count; ++i) {
    const auto w = load<WriteOne>(m.payload, sizeof count + i * sizeof(WriteOne));
    if (w.count > sizeof w.data)
      throw Error(EINVAL,
                  "REGION_WRITE_MULTI write " + std::to_string(i) + " of " + std::to_string(w.count) + " bytes (1..8)");
    check_access(w.region, w.offset, w.count, true);
  }
  for (uint64_t i = 0; i < count; ++i) {
    const size_t at = sizeof count + i * sizeof(WriteOne);
    const auto w = load<WriteOne>(m.payload, at);
    device_.write(w.region, w.offset,
                  std::span<const uint8_t>(m.payload).subspan(at + offsetof(WriteOne, data), w.count));
  }
  append(r.payload, count);
}

void Server::region_info(Message& m, Reply& r) {
  const auto q = load<RegionInfo>(m.payload);
  if (q.index >= device_.num_regions()) throw Error(EINVAL, "no region " + std::to_string(q.index));
  const RegionDescription d = device_.region(q.index);
  RegionInfo info{sizeof(RegionInfo), d.flags, q.index, 0, d.size, d.fd >= 0 ? d.fd_offset : 0};
  std::vector<uint8_t> caps;
  if (d.fd >= 0 && !d.sparse.empty()) {
    SparseMmapCap cap{{kCapSparseMmap, 1, 0}, static_cast<uint32_t>(d.sparse.size()), 0};
    append(caps, cap);
    for (const auto& a : d.sparse) append(caps, SparseArea{a.offset, a.size});
  }
  if (d.fd < 0) info.flags &= ~VFIO_REGION_INFO_FLAG_MMAP;
  info.argsz = static_cast<uint32_t>(sizeof info + caps.size());
  if (!caps.empty()) {
    info.flags |= VFIO_REGION_INFO_FLAG_CAPS;
    info.cap_offset = sizeof info;
  }
  append(r.payload, info);
  // A client whose buffer (argsz) is too small for the capabilities gets
  // the fixed part with the argsz it needs, as VFIO does.
  if (q.argsz >= info.argsz) r.payload.insert(r.payload.end(), caps.begin(), caps.end());
  if (d.fd >= 0) {
    r.fds.push_back(d.fd);
    if (std::find(fd_recipients_.begin(), fd_recipients_.end(), client_pid_) == fd_recipients_.end())
      fd_recipients_.push_back(client_pid_);
  }
  return;
}

void Server::region_io_fds(Message& m, Reply& r) {
  const auto q = load<RegionIoFds>(m.payload);
  if (q.index >= device_.num_regions()) throw Error(EINVAL, "no region " + std::to_string(q.index));
  if (q.flags != 0 || q.count != 0) throw Error(EINVAL, "GET_REGION_IO_FDS with flags or count set");
  const std::vector<IoFd> io = device_.region_io_fds(q.index);
  if (io.empty()) throw Error(EINVAL, "region " + std::to_string(q.index) + " has no io fds");
  RegionIoFds head{static_cast<uint32_t>(sizeof head + io.size() * sizeof(IoFdEntry)), 0, q.index,
                   static_cast<uint32_t>(io.size())};
  append(r.payload, head);
  if (q.argsz < head.argsz) return;  // too small: the size it needs, no entries, no fds
  if (io.size() > peer_max_fds_)
    throw Error(E2BIG, "region " + std::to_string(q.index) + " has " + std::to_string(io.size()) +
                           " io fds; the client takes " + std::to_string(peer_max_fds_) + " per message");
  for (size_t i = 0; i < io.size(); ++i) {
    append(r.payload, IoFdEntry{io[i].offset, io[i].size, static_cast<uint32_t>(i), kIoFdTypeIoeventfd, 0, 0, 0});
    r.fds.push_back(io[i].fd);
  }
  return;
}

void Server::set_irqs(Message& m, Reply& /*r*/) {
  const auto s = load<IrqSet>(m.payload);
  // Not a query: argsz is the size of this message's structure and its data
  // (the spec), so it must be the payload's; a bigger one claims data that
  // is not there.
  if (s.argsz != m.payload.size())
    throw Error(EINVAL,
                "SET_IRQS argsz " + std::to_string(s.argsz) + " for a payload of " + std::to_string(m.payload.size()));
  const uint32_t data = s.flags & (VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_DATA_BOOL | VFIO_IRQ_SET_DATA_EVENTFD);
  const uint32_t action =
      s.flags & (VFIO_IRQ_SET_ACTION_MASK | VFIO_IRQ_SET_ACTION_UNMASK | VFIO_IRQ_SET_ACTION_TRIGGER);
  if (s.flags & ~(data | action) || __builtin_popcount(data) != 1 || __builtin_popcount(action) != 1)
    throw Error(EINVAL, "SET_IRQS flags " + hex(s.flags) + ": one data type and one action");
  if (s.index >= device_.num_irqs()) throw Error(EINVAL, "SET_IRQS of IRQ index " + std::to_string(s.index));
  const vfio::IrqInfo info = device_.irq(s.index);
  const std::string range = "IRQ index " + std::to_string(s.index) + " vectors [" + std::to_string(s.start) + ", +" +
                            std::to_string(s.count) + ")";
  if (data == VFIO_IRQ_SET_DATA_NONE && action == VFIO_IRQ_SET_ACTION_TRIGGER && s.count == 0) {
    if (s.start != 0 || m.payload.size() != sizeof s) throw Error(EINVAL, "SET_IRQS disable with a start or data");
    device_.disable_irqs(s.index);
    return;
  }
  if (s.count == 0 || s.start >= info.count || s.count > info.count - s.start)
    throw Error(EINVAL, range + " outside its " + std::to_string(info.count) + " vectors");
  const size_t extra = m.payload.size() - sizeof s;
  if (data == VFIO_IRQ_SET_DATA_EVENTFD) {
    if (extra != 0) throw Error(EINVAL, "SET_IRQS with eventfds and payload data");
    if (action != VFIO_IRQ_SET_ACTION_TRIGGER)
      throw Error(ENOTSUP, "SET_IRQS: eventfds for mask/unmask notifications are not offered");
    if (!(info.flags & VFIO_IRQ_INFO_EVENTFD)) throw Error(EINVAL, range + ": the index does not signal eventfds");
    // No fds de-assigns the range; otherwise one per vector.
    if (!m.fds.empty() && m.fds.size() != s.count)
      throw Error(EINVAL, "SET_IRQS for " + std::to_string(s.count) + " vectors with " + std::to_string(m.fds.size()) +
                              " eventfds");
    std::vector<UniqueFd> fds = std::move(m.fds);
    for (uint32_t i = 0; i < fds.size(); ++i) {
      try {
        fds[i] = checked_peer_eventfd(std::move(fds[i]), "SET_IRQS vector " + std::to_string(s.start + i));
      } catch (const std::invalid_argument& e) {
        throw Error(EINVAL, e.what());
      }
    }
    fds.resize(s.count);
    device_.set_irq_eventfds(s.index, s.start, std::move(fds));
    return;
  }
  if (!m.fds.empty()) throw Error(EINVAL, "SET_IRQS without eventfd data carries fds");
  if (data == VFIO_IRQ_SET_DATA_NONE && extra != 0) throw Error(EINVAL, "SET_IRQS DATA_NONE with payload data");
  if (data == VFIO_IRQ_SET_DATA_BOOL && extra != s.count)
    throw Error(EINVAL, "SET_IRQS DATA_BOOL with " + std::to_string(extra) + " bytes for " + std::to_string(s.count) +
                            " vectors");
  if (action != VFIO_IRQ_SET_ACTION_TRIGGER && !(info.flags & VFIO_IRQ_INFO_MASKABLE))
    throw Error(EINVAL, range + " is not maskable");
  for (uint32_t i = 0; i < s.count; ++i) {
    if (data == VFIO_IRQ_SET_DATA_BOOL && m.payload[sizeof s + i] == 0) continue;
    if (action == VFIO_IRQ_SET_ACTION_TRIGGER)
      device_.trigger_irq(s.index, s.start + i);
    else
      device_.mask_irq(s.index, s.start + i, action == VFIO_IRQ_SET_ACTION_MASK);
  }
  return;
}

const DmaWindow& Server::window_for(uint64_t iova, uint64_t size, bool write) const {
  for (const DmaWindow& w : windows_)
    if (iova >= w.iova && size <= w.size && iova - w.iova <= w.size - size) {
      if (write ? !w.writable : !w.readable)
        throw Error(EPERM, "DMA " + std::string(write ? "write to" : "read from") + " " + hex(iova) +
                               ": the window does not allow it");
      return w;
    }
  throw Error(EFAULT, "DMA at [" + hex(iova) + ", +" + std::to_string(size) + "): not inside one window");
}

void Server::dma_read(uint64_t iova, std::span<uint8_t> out) {
  const DmaWindow& w = window_for(iova, out.size(), false);
  if (w.host) {
    std::memcpy(out.data(), w.host + (iova - w.iova), out.size());
    return;
  }
  for (size_t done = 0; done < out.size();) {
    const size_t n = std::min<size_t>(out.size() - done, peer_max_xfer_);
    dma_transfer(kDmaRead, iova + done, out.subspan(done, n));
    done += n;
  }
}

void Server::dma_write(uint64_t iova, std::span<const uint8_t> in) {
  const DmaWindow& w = window_for(iova, in.size(), true);
  if (w.host) {
    std::memcpy(w.host + (iova - w.iova), in.data(), in.size());
    return;
  }
  for (size_t done = 0; done < in.size();) {
    const size_t n = std::min<size_t>(in.size() - done, peer_max_xfer_);
    std::vector<uint8_t> chunk(in.begin() + static_cast<ptrdiff_t>(done),
                               in.begin() + static_cast<ptrdiff_t>(done + n));
    dma_transfer(kDmaWrite, iova + done, chunk);
    done += n;
  }
}

// Sends one DMA_READ/WRITE and waits for its reply; commands that arrive
// first are kept in order for on_readable().
uint64_t Server::dma_transfer(uint16_t command, uint64_t iova, std::span<uint8_t> data) {
  if (!conn_.connected()) throw Error(ENOTCONN, "no client for DMA");
  const uint16_t id = next_id_++;
  std::vector<uint8_t> payload;
  append(payload, DmaAccess{iova, data.size()});
  if (command == kDmaWrite) payload.insert(payload.end(), data.begin(), data.end());
  send(Header{id, command, static_cast<uint32_t>(sizeof(Header) + payload.size()), kTypeCommand, 0}, payload, {});
  try {
    const auto deadline = std::chrono::steady_clock::now() + conn_.deadline();
    for (;;) {
      Message m;
      if (!conn_.read_blocking(deadline)) {
        conn_.end(kPeerClosed, EndCause::peer_closed);
        throw Error(EIO, std::string(command_name(command)) + ": " + kPeerClosed);
      }
      take(conn_.reader(), m);
      if ((m.hdr.flags & kTypeMask) == kTypeCommand) {
        deferred_.push_back(std::move(m));
        continue;
      }
      if (m.hdr.id != id || m.hdr.command != command)
        throw ProtocolError("a reply to " + std::string(command_name(m.hdr.command)) + " id " +
                            std::to_string(m.hdr.id) + " while waiting for " + command_name(command) + " id " +
                            std::to_string(id));
      if (m.hdr.flags & kError)
        throw Error(m.hdr.error ? static_cast<int>(m.hdr.error) : EIO,
                    std::string("client refused ") + command_name(command) + " at " + hex(iova));
      if (command == kDmaRead) {
        if (m.payload.size() != sizeof(DmaAccess) + data.size())
          throw ProtocolError("DMA_READ reply of " + std::to_string(m.payload.size()) + " bytes for " +
                              std::to_string(data.size()));
        std::memcpy(data.data(), m.payload.data() + sizeof(DmaAccess), data.size());
      } else if (m.payload.size() < 12) {
        throw ProtocolError("DMA_WRITE reply of " + std::to_string(m.payload.size()) + " bytes");
      }
      return data.size();
    }
  } catch (const ProtocolError& e) {
    const std::string why = e.what();
    conn_.end(why, EndCause::framing);
    throw Error(EIO, why);
  } catch (const FramingError& e) {
    const std::string why = e.what();
    conn_.end(why, EndCause::framing);
    throw Error(EIO, why);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const std::string why = e.what();
    conn_.end(why);
    throw Error(EIO, why);
  }
}

void Server::disconnect(const std::string& why) { conn_.end(why); }

// The connection is ending (its socket still open): the client's windows,
// interrupts and fds go with it, and the device is reset for the next one.
void Server::on_end(const std::string& why, EndCause cause) {
  if (cause == EndCause::framing) ++stats_.protocol_errors;
  if (cause == EndCause::peer_closed)
    spdlog::info("vfio-user: {}: client disconnected", device_.name());
  else
    spdlog::warn("vfio-user: {}: client connection ended: {}", device_.name(), why);
  stats_.last_error = why;
  // The device stops first (workers, DMA, interrupts), then its memory
  // goes: unmapping first would pull the windows from under a running
  // device, which then cannot let go of them (a window kept per departed
  // client). A client may vanish without DEVICE_RESET (QEMU on exit).
  try {
    device_.client_gone();
  } catch (const std::exception& e) {
    spdlog::error("vfio-user: {}: releasing the client's state: {}", device_.name(), e.what());
  }
  // A migration the client was making ends with it (its DMA log with the
  // device stopped; one whose worker did not stop keeps it).
  if (migration_) {
    try {
      migration_->client_gone();
    } catch (const std::exception& e) {
      spdlog::error("vfio-user: {}: ending the client's migration: {}", device_.name(), e.what());
    }
  }
  unmap_all();
  deferred_.clear();
  // The last message's fds (a VMM's guest RAM memfd, say) go with the
  // client, not with the next one.
  in_.fds.clear();
  reply_.fds.clear();
  negotiated_ = false;
}

// --- handover (daemon/handover.hpp) ---

std::vector<uint8_t> ServerHandover::serialize() const {
  virtio::StateWriter w;
  w.u32(kVersion);
  w.u32(listener);
  w.u32(listener_handle);
  w.u32(connection);
  w.blob(unframed);
  w.u8(negotiated ? 1 : 0);
  w.u32(peer_max_fds);
  w.u32(peer_max_xfer);
  w.u16(next_id);
  w.u32(static_cast<uint32_t>(client_pid));
  w.u32(static_cast<uint32_t>(fd_recipients.size()));
  for (const int32_t pid : fd_recipients) w.u32(static_cast<uint32_t>(pid));
  w.u32(static_cast<uint32_t>(windows.size()));
  for (const Window& win : windows) {
    w.u64(win.iova);
    w.u64(win.size);
    w.u64(win.fd_offset);
    w.u8(static_cast<uint8_t>((win.readable ? 1U : 0U) | (win.writable ? 2U : 0U)));
    w.u32(win.fd);
  }
  w.blob(device);
  return w.take();
}

ServerHandover ServerHandover::parse(std::span<const uint8_t> bytes, size_t nfds, const std::string& what) {
  virtio::StateReader r(bytes, what);
  ServerHandover h;
  if (const uint32_t version = r.u32(); version != kVersion)
    r.fail("a vfio-user handover of version " + std::to_string(version) + " (this sriovd reads " +
           std::to_string(kVersion) + ")");
  h.listener = read_fd_index(r, nfds, "the listener");
  h.listener_handle = read_fd_index(r, nfds, "the listener's handle");
  h.connection = read_fd_index(r, nfds, "the connection");
  h.unframed = r.blob(kMaxMessage);
  h.negotiated = r.u8() != 0;
  h.peer_max_fds = r.u32();
  h.peer_max_xfer = r.u32();
  if (h.peer_max_fds > kMaxMsgFds || h.peer_max_xfer == 0 || h.peer_max_xfer > kMaxDataXfer)
    r.fail("negotiated " + std::to_string(h.peer_max_fds) + " fds and " + std::to_string(h.peer_max_xfer) +
           " bytes a message");
  h.next_id = r.u16();
  h.client_pid = static_cast<int32_t>(r.u32());
  const uint32_t nrecipients = r.u32();
  if (nrecipients > 4096) r.fail(std::to_string(nrecipients) + " fd recipients");
  for (uint32_t i = 0; i < nrecipients; ++i) h.fd_recipients.push_back(static_cast<int32_t>(r.u32()));
  const uint32_t nwindows = r.u32();
  if (nwindows > kMaxDmaMaps) r.fail(std::to_string(nwindows) + " DMA windows");
  for (uint32_t i = 0; i < nwindows; ++i) {
    Window win;
    win.iova = r.u64();
    win.size = r.u64();
    win.fd_offset = r.u64();
    const uint8_t access = r.u8();
    if (access > 3) r.fail("DMA window access " + std::to_string(access));
    win.readable = (access & 1U) != 0;
    win.writable = (access & 2U) != 0;
    win.fd = read_fd_index(r, nfds, "a DMA window");
    if (win.size == 0 || win.iova + win.size < win.iova || (win.iova | win.size) % kPageSizes)
      r.fail("DMA window [" + hex(win.iova) + ", +" + hex(win.size) + ")");
    for (const Window& other : h.windows)
      if (win.iova < other.iova + other.size && other.iova < win.iova + win.size)
        r.fail("overlapping DMA windows at " + hex(win.iova));
    h.windows.push_back(win);
  }
  h.device = r.blob(16U << 20U);
  r.end();
  return h;
}

ServerHandover Server::freeze_for_handover() {
  if (frozen_) throw HandoverRefused("it is being handed over already");
  if (migration_ && (migration_->state() != MigState::running || migration_->dma_log()))
    throw HandoverRefused("a live migration is under way");
  if (!held_.empty()) throw HandoverRefused("a stuck device worker still holds DMA windows");
  ServerHandover h;
  h.connection = freeze_connection(conn_, h, h.unframed);
  frozen_ = true;
  try {
    UnixListener::Handed l = listener_.pause_for_handover();
    h.listener = h.add_fd(std::move(l.listener));
    h.listener_handle = h.add_fd(std::move(l.handle));
    if (h.connection != ServerHandover::kNoFd) {
      h.negotiated = negotiated_;
      h.peer_max_fds = peer_max_fds_;
      h.peer_max_xfer = peer_max_xfer_;
      h.next_id = next_id_;
      h.client_pid = client_pid_;
      h.fd_recipients.assign(fd_recipients_.begin(), fd_recipients_.end());
      for (size_t i = 0; i < windows_.size(); ++i) {
        const DmaWindow& w = windows_[i];
        const Mapping& m = mappings_[i];
        h.windows.push_back({w.iova, w.size, m.offset, w.readable, w.writable,
                             m.fd ? h.add_fd(dup_fd(m.fd.get(), "a DMA window's fd")) : ServerHandover::kNoFd});
      }
      h.device = device_.freeze_for_handover(h);
    }
  } catch (const std::exception& e) {
    thaw();
    if (dynamic_cast<const HandoverRefused*>(&e)) throw;
    throw HandoverRefused(e.what());
  }
  return h;
}

void Server::thaw() {
  if (!std::exchange(frozen_, false)) return;
  listener_.resume();
  conn_.thaw();
  device_.thaw();
  spdlog::info("vfio-user: {}: the handover did not happen; serving again", device_.name());
}

void Server::handed_over() {
  if (!frozen_) return;  // left out of the handover: it ends as at any stop
  handed_over_ = true;
  listener_.forget_file();
  device_.handed_over();
}

// A takeover that cannot finish: the device forgets the client and its
// windows go, as when a client leaves.
void Server::abandon_takeover() {
  try {
    device_.client_gone();
  } catch (const std::exception& e) {
    spdlog::error("vfio-user: {}: releasing the handed client's state: {}", device_.name(), e.what());
  }
  unmap_all();
}

void Server::take_over(ServerHandover& h) {
  const std::string who = "vfio-user " + device_.name() + "'s handover";
  UniqueFd conn = h.take_fd(h.connection);
  if (!conn) return;  // nobody was connected: listening is all
  negotiated_ = h.negotiated;
  peer_max_fds_ = h.peer_max_fds;
  peer_max_xfer_ = h.peer_max_xfer;
  next_id_ = h.next_id;
  client_pid_ = h.client_pid;
  fd_recipients_.assign(h.fd_recipients.begin(), h.fd_recipients.end());
  begin_session();
  // The windows as the client mapped them, then the device on them; a
  // window that cannot be mapped now (the client truncated its file) or a
  // device part that does not fit ends the connection as after a crash.
  for (const ServerHandover::Window& hw : h.windows) {
    const std::string what = who + ": DMA window [" + hex(hw.iova) + ", +" + hex(hw.size) + ")";
    DmaWindow w{hw.iova, hw.size, nullptr, hw.readable, hw.writable};
    Mapping map;
    if (UniqueFd fd = h.take_fd(hw.fd)) {
      const int prot = (w.readable ? PROT_READ : 0) | (w.writable ? PROT_WRITE : 0);
      try {
        map.memory = std::make_unique<PeerMemory>(fd.get(), hw.fd_offset, hw.size, prot, &quota_, what);
      } catch (const PeerMemoryError& e) {
        throw std::invalid_argument(e.what());
      }
      w.host = map.memory->data();
      w.guard = &map.memory->guard();
      map.fd = std::move(fd);
      map.offset = hw.fd_offset;
    }
    windows_.push_back(w);
    mappings_.push_back(std::move(map));
    try {
      device_.dma_mapped(w);
    } catch (...) {
      windows_.pop_back();
      mappings_.pop_back();
      abandon_takeover();
      throw;
    }
  }
  try {
    device_.take_over(h.device, h);
  } catch (...) {
    abandon_takeover();
    throw;
  }
  conn_.adopt(std::move(conn), h.unframed);
  spdlog::info("vfio-user: {}: client (pid {}) taken over from the previous sriovd ({} DMA windows)", device_.name(),
               client_pid_, windows_.size());
}

}  // namespace sriovd::vfio_user
