#include "sriovd/vhost_user/backend.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>
#include <utility>

#include <spdlog/spdlog.h>

#include "sriovd/util/error.hpp"
#include "sriovd/util/hex.hpp"
#include "sriovd/util/log_limit.hpp"
#include "sriovd/util/protocol_error.hpp"
#include "sriovd/util/eventfd.hpp"
#include "sriovd/util/peer_mapping.hpp"
#include "sriovd/util/peer_session.hpp"
#include "sriovd/util/unix_socket.hpp"
#include "sriovd/vhost_user/protocol.hpp"

namespace sriovd::vhost_user {

using stream = asio::local::stream_protocol;

const char* request_name(uint32_t r) {
  switch (r) {
    case kGetFeatures: return "GET_FEATURES";
    case kSetFeatures: return "SET_FEATURES";
    case kSetOwner: return "SET_OWNER";
    case kResetOwner: return "RESET_OWNER";
    case kSetMemTable: return "SET_MEM_TABLE";
    case kSetLogBase: return "SET_LOG_BASE";
    case kSetLogFd: return "SET_LOG_FD";
    case kSetVringNum: return "SET_VRING_NUM";
    case kSetVringAddr: return "SET_VRING_ADDR";
    case kSetVringBase: return "SET_VRING_BASE";
    case kGetVringBase: return "GET_VRING_BASE";
    case kSetVringKick: return "SET_VRING_KICK";
    case kSetVringCall: return "SET_VRING_CALL";
    case kSetVringErr: return "SET_VRING_ERR";
    case kGetProtocolFeatures: return "GET_PROTOCOL_FEATURES";
    case kSetProtocolFeatures: return "SET_PROTOCOL_FEATURES";
    case kGetQueueNum: return "GET_QUEUE_NUM";
    case kSetVringEnable: return "SET_VRING_ENABLE";
    case kSendRarp: return "SEND_RARP";
    case kNetSetMtu: return "NET_SET_MTU";
    case kSetBackendReqFd: return "SET_BACKEND_REQ_FD";
    case kIotlbMsg: return "IOTLB_MSG";
    case kGetConfig: return "GET_CONFIG";
    case kSetConfig: return "SET_CONFIG";
    case kGetInflightFd: return "GET_INFLIGHT_FD";
    case kSetInflightFd: return "SET_INFLIGHT_FD";
    case kResetDevice: return "RESET_DEVICE";
    case kGetMaxMemSlots: return "GET_MAX_MEM_SLOTS";
    case kAddMemReg: return "ADD_MEM_REG";
    case kRemMemReg: return "REM_MEM_REG";
    case kSetStatus: return "SET_STATUS";
    case kGetStatus: return "GET_STATUS";
    default: return "unknown";
  }
}

namespace {

constexpr uint64_t kOfferedProtocol = kProtoMq | kProtoReplyAck | kProtoMtu | kProtoBackendReq | kProtoResetDevice |
                                      kProtoStatus | kProtoConfig | kProtoConfigureMemSlots | kProtoInflightShmfd |
                                      kProtoLogShmfd | kProtoRarp;
// A dirty log for a guest of up to 32 TiB (one bit per 4 KiB page).
constexpr uint64_t kMaxLogBytes = 1ULL << 30U;
constexpr uint32_t kBackendConfigChange = 2;  // VHOST_USER_BACKEND_CONFIG_CHANGE_MSG
constexpr uint32_t kConfigHeader = 12;        // offset, size, flags before the config bytes

template <typename T>
T payload_as(const std::vector<uint8_t>& p) {
  T v;
  std::memcpy(&v, p.data(), sizeof v);
  return v;
}

}  // namespace

struct Backend::Message {
  Header hdr{};
  std::vector<uint8_t> payload;
  std::vector<UniqueFd> fds;
};

namespace {
// How long one message may take from its first byte to its last.
constexpr std::chrono::milliseconds kMessageDeadline{1000};
}  // namespace

Backend::CallRoutes::CallRoutes(irq::Engine& e, virtio::Device& device) : engine(e) {
  for (unsigned q = 0; q < device.num_queues(); ++q) {
    ids.push_back(engine.add({device.name(), q, irq::Policy::relay, nullptr}));
    device.set_queue_interrupt(q, ids.back());
  }
}

Backend::CallRoutes::~CallRoutes() {
  for (const irq::RouteId id : ids) engine.remove(id);
}

void Backend::CallRoutes::set(unsigned q, UniqueFd call) {
  const bool valid = call.valid();
  engine.set_sink(ids.at(q), std::move(call));
  if (valid)
    engine.unmask(ids[q]);
  else
    engine.mask(ids[q]);
}

void Backend::CallRoutes::clear() {
  for (const irq::RouteId id : ids) {
    engine.set_sink(id, UniqueFd());
    engine.mask(id);
  }
}

Backend::Backend(asio::io_context& io, std::string socket_path, virtio::Device& device, irq::Engine& engine, Mode mode,
                 std::vector<uid_t> allowed_uids)
    : Backend(io, std::move(socket_path), device, engine, mode, std::move(allowed_uids), BackendHandover{}) {}

void Backend::make_listener(std::optional<SocketFile> adopted) {
  UnixListener::Options options{"vhost-user: " + device_.name(), "the device's allowed_uids", 0660, allowed_uids_};
  auto admit = [this](UniqueFd fd, const ucred&) { adopt(std::move(fd)); };
  auto busy = [this] { return conn_.connected() && !conn_.settle_if_closed(); };
  auto refuse = [this](UniqueFd, const std::string& why) {
    ++stats_.refused_peers;
    stats_.last_error = why;
  };
  listener_ = adopted ? std::make_unique<UnixListener>(io_, std::move(*adopted), options, admit, busy, refuse)
                      : std::make_unique<UnixListener>(io_, path_, options, admit, busy, refuse);
  spdlog::info("vhost-user: {} {} {}", device_.name(), adopted ? "listening again (handed over) on" : "listening on",
               path_);
}

Backend::Backend(asio::io_context& io, std::string socket_path, virtio::Device& device, irq::Engine& engine, Mode mode,
                 std::vector<uid_t> allowed_uids, BackendHandover handover)
    : path_(std::move(socket_path)),
      device_(device),
      calls_(engine, device),
      mode_(mode),
      allowed_uids_(std::move(allowed_uids)),
      io_(io),
      retry_(io),
      err_fds_(device.num_queues()),
      miss_watch_(io, ::dup(iotlb_.miss_fd())),
      in_(std::make_unique<Message>()),
      conn_(
          io,
          FramedReader(sizeof(Header), kMaxFds,
                       [](std::span<const uint8_t> bytes) {
                         Header h;
                         std::memcpy(&h, bytes.data(), sizeof h);
                         if ((h.flags & kFlagVersionMask) != kVersion)
                           throw FramingError("unsupported protocol version in flags 0x" + std::to_string(h.flags));
                         if (h.size > kMaxPayload)
                           throw FramingError("a payload of " + std::to_string(h.size) + " bytes");
                         return size_t{h.size};
                       }),
          kMessageDeadline, [this](FramedReader& r) { on_message(r); },
          [this](const std::string& why, EndCause cause) { on_end(why, cause); },
          // Once per burst of messages, not after each: the IOTLB updates
          // become visible to the workers at once, and the device starts
          // when the front-end has said all it had to say (a setup's dozens
          // of messages do not start and stop it dozens of times).
          [this] {
            publish_translations();
            try_start();
          }) {
  memory_.set_quota(&quota_);
  kick_fds_.resize(device_.num_queues());
  call_fds_.resize(device_.num_queues());
  watch_misses();
  if (!handover.device.empty()) {
    take_over(handover);
    return;
  }
  if (mode_ == Mode::client) {
    spdlog::info("vhost-user: {} connecting to {}", device_.name(), path_);
    try_connect();
    return;
  }
  make_listener(std::nullopt);
}

void Backend::set_allowed_uids(std::vector<uid_t> uids) {
  allowed_uids_ = uids;
  if (listener_) listener_->set_allowed_uids(std::move(uids));
}

void Backend::connect_later(std::chrono::milliseconds delay) {
  retry_.expires_after(delay);
  retry_.async_wait([this](boost::system::error_code ec) {
    if (!ec) try_connect();
  });
}

// Client mode: the front-end listens; a missing or refusing socket is
// tried again every second (a VMM that is starting, or restarting). The
// connect never blocks the control thread: a listener that does not accept
// (a full backlog) is one more try later.
void Backend::try_connect() {
  UniqueFd fd;
  try {
    fd = connect_unix(path_, "vhost-user front-end socket", true);
  } catch (const SystemError& e) {
    if (e.code().value() == ENAMETOOLONG) throw;  // no retry mends that
    connect_later(std::chrono::seconds(1));
    return;
  }
  // The VMM that listens is checked as a connecting one would be.
  const std::string why = peer_refusal(peer_credentials(fd.get()), allowed_uids_, "the device's allowed_uids");
  if (!why.empty()) {
    ++stats_.refused_peers;
    stats_.last_error = why;
    spdlog::warn("vhost-user: {}: {}", device_.name(), why);
    connect_later(std::chrono::seconds(1));
    return;
  }
  adopt(std::move(fd));
}

void Backend::adopt(UniqueFd fd) {
  ++stats_.connections;
  quota_.set_limits(default_peer_memory_limits());
  spdlog::info("vhost-user: {}: front-end connected", device_.name());
  conn_.adopt(std::move(fd));
}

Backend::~Backend() {
  boost::system::error_code ignored;
  miss_watch_.cancel(ignored);
  retry_.cancel();
  listener_.reset();  // the socket file goes with it (server mode)
  device_.stop();
  device_.wait_for_workers();  // guest memory, the inflight buffer and the log are ours, freed below
  drop_inflight();
  drop_log();
  device_.reset();
  for (unsigned q = 0; q < device_.num_queues(); ++q) device_.set_queue_interrupt(q, std::nullopt);  // routes go next
}

// One whole message (PeerConnection reads it without blocking, a second
// from its first byte to its last); its buffers are the connection's, kept.
void Backend::on_message(FramedReader& reader) {
  Message& m = *in_;
  reader.take({reinterpret_cast<uint8_t*>(&m.hdr), sizeof m.hdr}, m.payload, m.fds);
  // A worker that did not stop (NetDevice::wedged) still uses the last
  // session's memory: no front-end is served until it is out, and then the
  // release that had to wait is finished first.
  if (release_pending_) {
    if (!device_.reap())
      throw ProtocolError(
          "the device's worker has not stopped since the last session: it serves no front-end until it does");
    release_session();
  }
  if (device_.wedged() && !device_.reap())
    throw ProtocolError("the device's worker did not stop when asked: the session ends");
  // The front-end shrank the inflight buffer under its mapping (guest RAM
  // faults are the workers' to see): its pages read as zeros now, and the
  // session ends.
  if (peer_mapping_faults() != faults_seen_) {
    faults_seen_ = peer_mapping_faults();
    if (inflight_.faulted()) throw ProtocolError("the front-end truncated its inflight buffer under the mapping");
    if (log_map_.faulted()) throw ProtocolError("the front-end truncated its dirty log under the mapping");
  }
  ++stats_.messages;
  handle(m);
  m.fds.clear();  // what the handler did not take is closed now
}

void Backend::reply(const Message& m, const void* payload, uint32_t size, int fd) {
  Header h{m.hdr.request, kVersion | kFlagReply, size};
  const iovec iov[2] = {{&h, sizeof h}, {const_cast<void*>(payload), size}};
  const std::span<const int> fds(&fd, fd >= 0 ? 1 : 0);
  try {
    conn_.send(iov, fds);  // never waits for the front-end (PeerConnection)
  } catch (const std::exception& e) {
    throw ProtocolError(std::string("cannot reply: ") + e.what());
  }
}

void Backend::ack(const Message& m, uint64_t status) {
  if ((protocol_features_ & kProtoReplyAck) && (m.hdr.flags & kFlagNeedReply)) reply(m, &status, sizeof status);
}

void Backend::try_start() {
  // Logging asked for and no log yet (QEMU sends SET_FEATURES before
  // SET_LOG_BASE when it starts a device during a migration): a write now
  // would be one the destination never gets.
  if (log_all_ && !log_) return;
  if (!device_.running()) device_.start();
}

// The one table of requests: what each must carry (payload bytes, fds)
// and the method that serves it. Shapes are checked here, once, before any
// handler runs; a handler returns whether it replied (else REPLY_ACK does).
const Backend::Request* Backend::request_of(uint32_t request) {
  static constexpr int kAny = -1;  // checked by the handler
  static const Request table[] = {
      {kGetFeatures, 0, 0, &Backend::get_features},
      {kSetFeatures, 8, 0, &Backend::set_features},
      {kSetOwner, 0, 0, &Backend::nothing},
      {kResetOwner, 0, 0, &Backend::reset_device},
      {kResetDevice, 0, 0, &Backend::reset_device},
      {kSetMemTable, kAny, kAny, &Backend::set_mem_table},
      {kSetVringNum, sizeof(VringState), 0, &Backend::set_vring_num},
      {kSetVringAddr, sizeof(VringAddr), 0, &Backend::set_vring_addr},
      {kSetVringBase, sizeof(VringState), 0, &Backend::set_vring_base},
      {kGetVringBase, sizeof(VringState), 0, &Backend::get_vring_base},
      // Vring fds carry a "no fd" flag in the payload: 0 or 1, checked there.
      {kSetVringKick, 8, kAny, &Backend::set_vring_fd},
      {kSetVringCall, 8, kAny, &Backend::set_vring_fd},
      {kSetVringErr, 8, kAny, &Backend::set_vring_fd},
      {kGetProtocolFeatures, 0, 0, &Backend::get_protocol_features},
      {kSetProtocolFeatures, 8, 0, &Backend::set_protocol_features},
      {kGetQueueNum, 0, 0, &Backend::get_queue_num},
      {kSetVringEnable, sizeof(VringState), 0, &Backend::set_vring_enable},
      {kSetLogBase, sizeof(LogDesc), 1, &Backend::set_log_base},
      {kSetLogFd, 0, 1, &Backend::set_log_fd},
      {kSendRarp, 8, 0, &Backend::send_rarp},
      {kNetSetMtu, 8, 0, &Backend::nothing},
      {kSetBackendReqFd, 0, 1, &Backend::set_backend_req_fd},
      {kIotlbMsg, sizeof(IotlbMsg), 0, &Backend::iotlb_request},
      {kGetConfig, kAny, 0, &Backend::config_request},
      {kSetConfig, kAny, 0, &Backend::config_request},
      {kGetInflightFd, sizeof(InflightDesc), 0, &Backend::get_inflight},
      {kSetInflightFd, sizeof(InflightDesc), 1, &Backend::set_inflight},
      {kGetMaxMemSlots, 0, 0, &Backend::get_max_mem_slots},
      {kAddMemReg, sizeof(SingleMemRegion), 1, &Backend::mem_reg},
      // QEMU before 7.1 sent an fd with REM_MEM_REG; it is ignored.
      {kRemMemReg, sizeof(SingleMemRegion), kAny, &Backend::mem_reg},
      {kSetStatus, 8, 0, &Backend::set_status},
      {kGetStatus, 0, 0, &Backend::get_status},
  };
  for (const Request& r : table)
    if (r.request == request) return &r;
  return nullptr;
}

std::string Backend::what(const Message& m) {
  return std::string(request_name(m.hdr.request)) + " (" + std::to_string(m.hdr.request) + ")";
}

void Backend::handle(Message& m) {
  spdlog::debug("vhost-user: {}: {} ({} bytes, {} fds)", device_.name(), request_name(m.hdr.request), m.hdr.size,
                m.fds.size());
  // Any other request sees the translations the updates before it gave
  // (a burst of IOTLB updates is still one publish).
  if (m.hdr.request != kIotlbMsg) publish_translations();
  const Request* r = request_of(m.hdr.request);
  if (!r) throw ProtocolError("request " + what(m) + " is not served");
  if (r->payload >= 0 && m.hdr.size != static_cast<uint32_t>(r->payload))
    throw ProtocolError(what(m) + " with " + std::to_string(m.hdr.size) + " payload bytes, expected " +
                        std::to_string(r->payload));
  if (r->fds >= 0 && m.fds.size() != static_cast<size_t>(r->fds))
    throw ProtocolError(what(m) + " with " + std::to_string(m.fds.size()) + " fds, expected " + std::to_string(r->fds));
  if (!(this->*(r->handler))(m)) ack(m, 0);
}

unsigned Backend::queue_index(const Message& m, uint32_t index) const {
  if (index >= device_.num_queues())
    throw ProtocolError(what(m) + " for queue " + std::to_string(index) + " of " +
                        std::to_string(device_.num_queues()));
  return index;
}

bool Backend::nothing(Message& /*m*/) { return false; }

bool Backend::get_features(Message& m) {
  const uint64_t f = device_.offered_features() | kFeatureProtocolFeatures | kFeatureLogAll;
  reply(m, &f, sizeof f);
  return true;
}

bool Backend::set_features(Message& m) {
  const auto f = payload_as<uint64_t>(m.payload);
  device_.stop();
  device_.set_features(f & ~(kFeatureProtocolFeatures | kFeatureLogAll));
  protocol_negotiated_ = f & kFeatureProtocolFeatures;
  // ACCESS_PLATFORM: ring and buffer addresses are IOVAs from now on.
  access_platform_ = device_.features() & virtio::kAccessPlatform;
  memory_.set_iotlb(access_platform_ ? &iotlb_ : nullptr);
  // LOG_ALL on: a migration started (or goes on across a reconnect); off:
  // it ended or was cancelled.
  log_all_ = f & kFeatureLogAll;
  install_log();
  return false;
}

// RARP only where there is a wire to send it on (a network device).
uint64_t Backend::offered_protocol() const {
  return device_.device_id() == virtio::kDeviceIdNet ? kOfferedProtocol : kOfferedProtocol & ~kProtoRarp;
}

bool Backend::get_protocol_features(Message& m) {
  const uint64_t f = offered_protocol();
  reply(m, &f, sizeof f);
  return true;
}

bool Backend::set_protocol_features(Message& m) {
  protocol_features_ = payload_as<uint64_t>(m.payload) & offered_protocol();
  return false;
}

bool Backend::reset_device(Message& /*m*/) {
  // What the session lent is taken back only from stopped workers; one
  // that does not stop keeps it (on_end leaves the release pending).
  device_.stop();
  if (device_.wedged()) throw ProtocolError("the device's worker did not stop for the reset");
  release_session();
  status_ = 0;
  return false;
}

// Stops the device before `what` changes what its workers use (memory,
// rings): a worker that does not stop may still be touching it, so the
// change is refused and the session ends - memory is never unmapped under
// a stuck worker (a SEGV the SIGBUS handler does not catch).
void Backend::quiesce(const char* what) {
  device_.stop();
  if (device_.wedged())
    throw ProtocolError(std::string(what) + ": the device's worker did not stop; what it may still touch stays");
}

bool Backend::set_mem_table(Message& m) {
  if (m.hdr.size < 8) throw ProtocolError("SET_MEM_TABLE without a region count");
  MemTable t{};
  std::memcpy(&t, m.payload.data(), std::min<size_t>(m.payload.size(), sizeof t));
  if (t.nregions == 0 || t.nregions > kMaxRegions)
    throw ProtocolError("SET_MEM_TABLE with " + std::to_string(t.nregions) + " regions");
  if (m.hdr.size != 8 + t.nregions * sizeof(MemRegion))
    throw ProtocolError("SET_MEM_TABLE size " + std::to_string(m.hdr.size) + " for " + std::to_string(t.nregions) +
                        " regions");
  if (m.fds.size() != t.nregions)
    throw ProtocolError("SET_MEM_TABLE with " + std::to_string(m.fds.size()) + " fds for " +
                        std::to_string(t.nregions) + " regions");
  quiesce("SET_MEM_TABLE");
  device_.set_memory(nullptr);
  memory_.clear();
  held_regions_.clear();
  for (uint32_t i = 0; i < t.nregions; ++i) {
    const MemRegion& reg = t.regions[i];
    add_region(reg.guest_addr, reg.size, reg.user_addr, reg.mmap_offset, std::move(m.fds[i]));
  }
  device_.set_memory(&memory_);
  install_log();  // the log must cover the new table
  return false;
}

bool Backend::set_vring_num(Message& m) {
  const auto s = payload_as<VringState>(m.payload);
  quiesce("SET_VRING_NUM");
  device_.set_queue_size(queue_index(m, s.index), static_cast<uint16_t>(std::min<uint32_t>(s.num, 0xffff)));
  return false;
}

bool Backend::set_vring_addr(Message& m) {
  const auto a = payload_as<VringAddr>(m.payload);
  const unsigned q = queue_index(m, a.index);
  virtio::RingAddresses rings;
  if (access_platform_) {
    // IOVAs: translated through the IOTLB when the queue starts.
    rings = {a.desc, a.avail, a.used};
  } else if (!memory_.user_to_guest(a.desc, 1, rings.desc) || !memory_.user_to_guest(a.avail, 1, rings.driver) ||
             !memory_.user_to_guest(a.used, 1, rings.device)) {
    throw ProtocolError("SET_VRING_ADDR for queue " + std::to_string(q) + ": a ring outside the shared memory");
  }
  quiesce("SET_VRING_ADDR");
  device_.set_queue_rings(q, rings);
  // VHOST_VRING_F_LOG: the ring's own writes are logged, its used ring at
  // log_guest_addr. With an IOTLB that address is an IOVA (QEMU gives the
  // ring's address as the driver wrote it): logged by host pointer instead.
  std::optional<uint64_t> log;
  if (a.flags & kVringFlagLog) log = access_platform_ ? virtio::RingLog::kByHost : a.log;
  device_.set_queue_log(q, log);
  return false;
}

bool Backend::set_vring_base(Message& m) {
  const auto s = payload_as<VringState>(m.payload);
  quiesce("SET_VRING_BASE");
  device_.set_queue_base(queue_index(m, s.index), s.num);
  return false;
}

bool Backend::get_vring_base(Message& m) {
  auto s = payload_as<VringState>(m.payload);
  s.num = device_.stop_queue(queue_index(m, s.index));
  reply(m, &s, sizeof s);
  return true;
}

// SET_VRING_KICK / CALL / ERR: the queue index and a "no fd" flag in the u64.
bool Backend::set_vring_fd(Message& m) {
  const auto v = payload_as<uint64_t>(m.payload);
  const unsigned q = queue_index(m, static_cast<uint32_t>(v & kVringIndexMask));
  const bool no_fd = v & kVringNoFd;
  if (m.fds.size() != (no_fd ? 0U : 1U))
    throw ProtocolError(what(m) + " with " + std::to_string(m.fds.size()) + " fds and the no-fd flag " +
                        (no_fd ? "set" : "clear"));
  // Eventfds only, used non-blocking: one fd given as two queues' kick
  // must not leave a worker blocked in read() once the first drained it.
  UniqueFd fd =
      checked_peer_eventfd(no_fd ? UniqueFd() : std::move(m.fds[0]), what(m) + " for queue " + std::to_string(q));
  if (m.hdr.request == kSetVringKick) {
    if (no_fd) throw ProtocolError("SET_VRING_KICK without an fd (polling mode is not supported)");
    device_.stop();
    use_kick(q, std::move(fd));
    // Without protocol features a ring starts when its kick fd arrives.
    if (!protocol_negotiated_) device_.set_queue_enabled(q, true);
  } else if (m.hdr.request == kSetVringCall) {
    use_call(q, std::move(fd));
  } else {
    // Never signalled (the device reports no ring errors), but held: one
    // per queue, the last one given, so a peer cannot pile them up.
    err_fds_[q] = std::move(fd);
  }
  return false;
}

bool Backend::get_queue_num(Message& m) {
  const uint64_t n = device_.queue_groups();
  reply(m, &n, sizeof n);
  return true;
}

bool Backend::set_vring_enable(Message& m) {
  const auto s = payload_as<VringState>(m.payload);
  device_.stop();
  device_.set_queue_enabled(queue_index(m, s.index), s.num != 0);
  return false;
}

bool Backend::set_status(Message& m) {
  status_ = static_cast<uint8_t>(payload_as<uint64_t>(m.payload));
  if (status_ == 0) device_.stop();
  return false;
}

bool Backend::get_status(Message& m) {
  const uint64_t s = status_;
  reply(m, &s, sizeof s);
  return true;
}

bool Backend::get_max_mem_slots(Message& m) {
  const uint64_t n = kMaxRegions;
  reply(m, &n, sizeof n);
  return true;
}

bool Backend::set_backend_req_fd(Message& m) {
  backend_req_ = std::move(m.fds[0]);
  return false;
}

bool Backend::iotlb_request(Message& m) {
  iotlb_message(payload_as<IotlbMsg>(m.payload));
  return false;
}

// CONFIGURE_MEM_SLOTS: one region at a time instead of SET_MEM_TABLE.
bool Backend::mem_reg(Message& m) {
  const auto reg = payload_as<SingleMemRegion>(m.payload).region;
  quiesce(m.hdr.request == kAddMemReg ? "ADD_MEM_REG" : "REM_MEM_REG");
  device_.set_memory(nullptr);
  if (m.hdr.request == kAddMemReg) {
    if (memory_.regions().size() >= kMaxRegions)
      throw ProtocolError("ADD_MEM_REG beyond " + std::to_string(kMaxRegions) + " memory slots");
    add_region(reg.guest_addr, reg.size, reg.user_addr, reg.mmap_offset, std::move(m.fds[0]));
  } else if (!memory_.remove_region(reg.guest_addr, reg.size)) {
    throw ProtocolError("REM_MEM_REG of a region that was not added (0x" + std::to_string(reg.guest_addr) + ")");
  } else {
    std::erase_if(held_regions_,
                  [&](const HeldRegion& h) { return h.guest_addr == reg.guest_addr && h.size == reg.size; });
  }
  device_.set_memory(&memory_);
  install_log();
  return false;
}

// GET_CONFIG / SET_CONFIG: struct { u32 offset, size, flags; u8
// payload[size]; } over the device type's configuration space (virtio-net:
// §5.1.4), as the device keeps it and takes writes.
bool Backend::config_request(Message& m) {
  if (m.payload.size() < kConfigHeader) throw ProtocolError(what(m) + " without offset and size");
  uint32_t offset = 0, size = 0;
  std::memcpy(&offset, m.payload.data(), 4);
  std::memcpy(&size, m.payload.data() + 4, 4);
  if (size > 256 || m.payload.size() != kConfigHeader + size)
    throw ProtocolError(what(m) + " of " + std::to_string(size) + " bytes in a payload of " +
                        std::to_string(m.payload.size()));
  if (m.hdr.request == kSetConfig) {
    // A write the device type does not take (virtio-net has no field the
    // driver may write), or past its configuration: refused, not fatal.
    const bool inside = uint64_t{offset} + size <= device_.config_size();
    ack(m, inside && device_.write_config(offset, m.payload.data() + kConfigHeader, size) ? 0 : 1);
    return true;
  }
  std::vector<uint8_t> out = m.payload;
  device_.read_config(offset, out.data() + kConfigHeader, size);
  reply(m, out.data(), static_cast<uint32_t>(out.size()));
  return true;
}

namespace {
InflightDesc checked_inflight(const std::vector<uint8_t>& payload, unsigned device_queues, const char* what) {
  const auto d = payload_as<InflightDesc>(payload);
  if (d.num_queues == 0 || d.num_queues > device_queues)
    throw ProtocolError(std::string(what) + " for " + std::to_string(d.num_queues) + " queues (the device has " +
                        std::to_string(device_queues) + ")");
  if (d.queue_size == 0 || d.queue_size > virtio::kMaxQueueSize)
    throw ProtocolError(std::string(what) + " for queues of " + std::to_string(d.queue_size) + " entries");
  return d;
}
}  // namespace

// GET_INFLIGHT_FD: a zeroed buffer (a memfd) with a region per queue; the
// front-end keeps it and hands it back with SET_INFLIGHT_FD whenever a
// back-end starts, this one or the one after a crash.
bool Backend::get_inflight(Message& m) {
  const InflightDesc want = checked_inflight(m.payload, device_.num_queues(), "GET_INFLIGHT_FD");
  const uint64_t bytes = want.num_queues * virtio::inflight_queue_bytes(want.queue_size);
  UniqueFd fd(::memfd_create("sriovd-inflight", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd || ::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0)
    throw SystemError(errno, device_.name() + ": inflight buffer of " + std::to_string(bytes) + " bytes");
  // Its size is fixed: no front-end can shrink it under a mapping (a
  // worker touching a page past the end would take SIGBUS).
  (void)::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
  const InflightDesc out{bytes, 0, want.num_queues, want.queue_size, 0};
  reply(m, &out, sizeof out, fd.get());
  return true;
}

bool Backend::set_inflight(Message& m) {
  const InflightDesc d = checked_inflight(m.payload, device_.num_queues(), "SET_INFLIGHT_FD");
  const uint64_t need = d.num_queues * virtio::inflight_queue_bytes(d.queue_size);
  const std::string what =
      "SET_INFLIGHT_FD of " + std::to_string(d.mmap_size) + " bytes at offset " + std::to_string(d.mmap_offset);
  if (d.mmap_size < need || d.mmap_offset % 64 != 0)
    throw ProtocolError(what + ": " + std::to_string(d.num_queues) + " queues of " + std::to_string(d.queue_size) +
                        " need " + std::to_string(need) + " bytes, 64-byte aligned");
  // A buffer that can still shrink (not one of ours) is sealed now if it
  // allows it; if not, it is used as guest RAM is: trusted not to shrink.
  const int seals = ::fcntl(m.fds[0].get(), F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    if (::fcntl(m.fds[0].get(), F_ADD_SEALS, F_SEAL_SHRINK) != 0)
      spdlog::warn("vhost-user: {}: the inflight buffer cannot be sealed against shrinking: {}", device_.name(),
                   std::strerror(errno));
  }
  drop_inflight();
  if (device_.wedged())
    throw ProtocolError(what + ": the device's worker did not stop and may still mark chains in the old buffer");
  // Sealed or not, a fault there fails this connection, not the daemon.
  use_inflight(std::move(m.fds[0]), d.mmap_offset, d.mmap_size, d.num_queues, d.queue_size, what);
  log_limited(log_limits_.inflight, spdlog::level::info, "vhost-user: {}: inflight buffer for {} queues of {}",
              device_.name(), d.num_queues, d.queue_size);
  return false;
}

void Backend::drop_inflight() {
  device_.stop();
  if (device_.wedged()) return;  // its worker may still mark chains in it
  device_.set_inflight(nullptr, 0, 0);
  inflight_.reset();
  inflight_fd_.reset();
}

// A buffer of the front-end's (the inflight buffer, the dirty log): exactly
// the range it declared, charged to its share, under PeerMapping's guard
// (the front-end truncating it fails that session, not the daemon).
PeerMemory Backend::map_peer_buffer(int fd, uint64_t offset, uint64_t size, const std::string& what) {
  try {
    return PeerMemory(fd, offset, size, PROT_READ | PROT_WRITE, &quota_, what);
  } catch (const PeerMemoryError& e) {
    throw ProtocolError(e.what());
  }
}

// SET_LOG_BASE (LOG_SHMFD): the dirty log of a live migration, in the
// front-end's memory. Checked and mapped as the inflight buffer is (the
// front-end may truncate it: guarded); the old log goes with the workers
// stopped, since after the reply the front-end reads only the new one and
// frees the old. QEMU waits for the reply (no payload).
bool Backend::set_log_base(Message& m) {
  if (!(protocol_features_ & kProtoLogShmfd))
    throw ProtocolError("SET_LOG_BASE without VHOST_USER_PROTOCOL_F_LOG_SHMFD negotiated");
  const auto d = payload_as<LogDesc>(m.payload);
  const std::string what =
      "SET_LOG_BASE of " + std::to_string(d.mmap_size) + " bytes at offset " + std::to_string(d.mmap_offset);
  if (d.mmap_size == 0 || d.mmap_size > kMaxLogBytes)
    throw ProtocolError(what + ": a log is 1 to " + std::to_string(kMaxLogBytes) + " bytes");
  PeerMemory fresh = map_peer_buffer(m.fds[0].get(), d.mmap_offset, d.mmap_size, what);
  device_.stop();
  if (device_.wedged())
    throw ProtocolError(what + ": the device's worker did not stop and may still write the old log");
  drop_log();
  log_map_ = std::move(fresh);
  log_ = std::make_unique<virtio::DirtyLog>(log_map_.data(), d.mmap_size, memory_);
  if (log_fd_) log_->set_notify_fd(log_fd_.get());
  ++stats_.log_bases;
  install_log();
  log_limited(log_limits_.log_base, spdlog::level::info,
              "vhost-user: {}: dirty log of {} bytes (guest addresses below 0x{:x})", device_.name(), d.mmap_size,
              log_->covers());
  reply(m, nullptr, 0);
  return true;
}

// SET_LOG_FD: an eventfd the device signals after publishing writes it
// logged (the front-end may wait on it instead of polling the log).
bool Backend::set_log_fd(Message& m) {
  UniqueFd fd = checked_peer_eventfd(std::move(m.fds[0]), "SET_LOG_FD");
  device_.stop();
  if (device_.wedged()) throw ProtocolError("SET_LOG_FD: the device's worker did not stop");
  log_fd_ = std::move(fd);
  if (log_) log_->set_notify_fd(log_fd_.get());
  return false;
}

// The log is guest memory's (and so the device's) while VHOST_F_LOG_ALL is
// negotiated and a log is mapped, and it must cover every region (QEMU
// grows it before it adds memory, shrinks it after). Changed with the
// workers stopped: rings and workers take it when they start.
void Backend::install_log() {
  const virtio::DirtyLog* want = log_all_ ? log_.get() : nullptr;
  if (want) {
    for (const virtio::MemoryRegion& r : memory_.regions())
      if (r.guest_addr + r.size > want->covers())
        throw ProtocolError("the dirty log of " + std::to_string(want->bytes()) +
                            " bytes covers guest addresses below " + hex(want->covers()) + "; the memory region at " +
                            hex(r.guest_addr) + " ends at " + hex(r.guest_addr + r.size));
  }
  if (memory_.dirty_log() == want) return;
  device_.stop();
  if (device_.wedged()) throw ProtocolError("the device's worker did not stop: its dirty log cannot change under it");
  memory_.set_dirty_log(want);
  log_limited(log_limits_.logging, spdlog::level::info, "vhost-user: {}: dirty logging {}", device_.name(),
              want ? "on (a live migration)" : "off");
}

void Backend::drop_log() {
  device_.stop();
  if (device_.wedged()) return;  // its worker may still mark pages in it
  memory_.set_dirty_log(nullptr);
  log_.reset();
  log_map_.reset();
}

// SEND_RARP (PROTOCOL_F_RARP): the front-end, on the migration's
// destination, asks for the guest to be announced - a guest without
// VIRTIO_NET_F_GUEST_ANNOUNCE does not do it itself - so the switches learn
// where its MAC is now.
bool Backend::send_rarp(Message& m) {
  if (!(protocol_features_ & kProtoRarp))
    throw ProtocolError("SEND_RARP without VHOST_USER_PROTOCOL_F_RARP negotiated");
  std::array<uint8_t, 6> mac{};
  std::memcpy(mac.data(), m.payload.data(), mac.size());
  switch (device_.announce(mac)) {
    case virtio::Announcement::no_wire: throw ProtocolError("SEND_RARP to a device with no wire");
    case virtio::Announcement::not_its_mac:
      // Another's MAC would move that guest's traffic here on every
      // switch that learns from the RARP: not sent; the session goes on.
      ++stats_.rarps_refused;
      log_limited(
          log_limits_.rarp, spdlog::level::warn,
          "vhost-user: {}: SEND_RARP for {:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x} refused: not the device's MAC",
          device_.name(), mac[0], mac[1], mac[2], mac[3], mac[4], mac[5]);
      return false;
    case virtio::Announcement::sent: break;
  }
  ++stats_.rarps;
  log_limited(log_limits_.rarp, spdlog::level::info,
              "vhost-user: {}: announcing {:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x} on the wire (SEND_RARP)",
              device_.name(), mac[0], mac[1], mac[2], mac[3], mac[4], mac[5]);
  return false;
}

// The connection ended (PeerConnection: the peer closed, a malformed
// message, a deadline, a handler that threw): the device stops and
// forgets the session.
void Backend::on_end(const std::string& why, EndCause cause) {
  if (cause == EndCause::peer_closed) {
    spdlog::info("vhost-user: {}: front-end disconnected", device_.name());
  } else {
    ++stats_.protocol_errors;
    spdlog::warn("vhost-user: {}: connection ended: {}", device_.name(), why);
  }
  stats_.last_error = why;
  protocol_features_ = 0;
  protocol_negotiated_ = false;
  status_ = 0;
  for (auto& fd : err_fds_) fd.reset();
  backend_req_.reset();
  in_->fds.clear();
  device_.stop();
  if (device_.wedged()) {
    // Memory, IOTLB, inflight buffer and log stay mapped for the stuck worker;
    // the next front-end's first message finishes this (on_message).
    release_pending_ = true;
  } else {
    release_session();
  }
  if (mode_ == Mode::client) connect_later(std::chrono::seconds(1));
}

// What a session lent the device, taken back with the workers stopped.
void Backend::release_session() {
  release_pending_ = false;
  drop_inflight();
  drop_log();
  log_all_ = false;
  log_fd_.reset();
  device_.reset();
  calls_.clear();
  for (auto& fd : call_fds_) fd.reset();
  for (auto& fd : kick_fds_) fd.reset();
  held_regions_.clear();
  memory_.clear();
  memory_.set_iotlb(nullptr);
  access_platform_ = false;
  iotlb_.clear();
  iotlb_.reclaim();  // the device is stopped: no worker looks any more
}

// IOTLB_MSG from the front-end (§ "IOMMU support" of the vhost-user spec).
// An update may unblock stalled rings (kick them) or queues that could not
// start; an invalidation takes effect with the workers stopped, so no
// translation from before it is in use once it is acknowledged.
void Backend::iotlb_message(const IotlbMsg& msg) {
  spdlog::debug("vhost-user: {}: IOTLB type {} iova 0x{:x} size 0x{:x} uaddr 0x{:x} perm {}", device_.name(), msg.type,
                msg.iova, msg.size, msg.uaddr, msg.perm);
  // Without ACCESS_PLATFORM ring addresses are not IOVAs: a table nobody
  // reads would only be memory and work the peer makes the daemon spend.
  if (!access_platform_) throw ProtocolError("IOTLB_MSG without VIRTIO_F_ACCESS_PLATFORM negotiated");
  switch (msg.type) {
    case kIotlbUpdate:
      // Staged: the burst of updates a front-end sends is published once,
      // when the socket has nothing more (publish_translations).
      iotlb_.update({msg.iova, msg.size, msg.uaddr, msg.perm});  // checked there: size, wrap, permission, cap
      break;
    case kIotlbInvalidate: {
      const bool was_running = device_.running();
      device_.stop();
      iotlb_.invalidate(msg.iova, msg.size);
      iotlb_.publish();
      iotlb_.reclaim();
      if (was_running) try_start();
      break;
    }
    case kIotlbAccessFail:
      spdlog::warn("vhost-user: {}: front-end reports an IOTLB access failure at 0x{:x}", device_.name(), msg.iova);
      break;
    default: throw ProtocolError("IOTLB message of type " + std::to_string(msg.type));
  }
}

// After a burst of messages: staged IOTLB updates become what the workers
// see, and may unblock stalled rings (kick them) or queues that could not
// start.
void Backend::publish_translations() {
  if (!iotlb_.staged()) return;
  iotlb_.publish();
  if (iotlb_.retired() > 64 || device_.waiting_for_translations()) {
    // Old tables freed, and pairs that waited for their rings started,
    // from a stopped device.
    const bool was_running = device_.running();
    device_.stop();
    iotlb_.reclaim();
    if (was_running || device_.waiting_for_translations()) try_start();
  } else if (device_.running()) {
    device_.kick_all();
  } else {
    try_start();
  }
}

void Backend::config_changed() {
  if (!backend_req_ || !(protocol_features_ & kProtoConfig)) return;
  const Header h{kBackendConfigChange, kVersion, 0};
  if (::send(backend_req_.get(), &h, sizeof h, MSG_NOSIGNAL | MSG_DONTWAIT) != static_cast<ssize_t>(sizeof h))
    spdlog::warn("vhost-user: {}: cannot send a config change: {}", device_.name(), std::strerror(errno));
}

void Backend::watch_misses() {
  miss_watch_.async_wait(asio::posix::stream_descriptor::wait_read, [this](boost::system::error_code ec) {
    if (ec) return;
    send_miss();
    watch_misses();
  });
}

// A worker found an IOVA the IOTLB lacks: ask the front-end on the
// back-end channel; its UPDATE arrives as an IOTLB_MSG on the main one.
void Backend::send_miss() {
  uint64_t iova = 0;
  uint8_t perm = 0;
  if (!iotlb_.take_miss(iova, perm)) return;
  spdlog::debug("vhost-user: {}: IOTLB miss at 0x{:x} (perm {})", device_.name(), iova, perm);
  if (!backend_req_) {
    spdlog::warn("vhost-user: {}: IOTLB miss at 0x{:x} and no back-end channel to ask on", device_.name(), iova);
    return;
  }
  struct {
    Header hdr;
    IotlbMsg msg;
  } __attribute__((packed)) out{{kBackendIotlbMsg, kVersion, sizeof(IotlbMsg)}, {iova, 4096, 0, perm, kIotlbMiss, {}}};
  if (::send(backend_req_.get(), &out, sizeof out, MSG_NOSIGNAL | MSG_DONTWAIT) != static_cast<ssize_t>(sizeof out))
    spdlog::warn("vhost-user: {}: cannot send an IOTLB miss: {}", device_.name(), std::strerror(errno));
}

}  // namespace sriovd::vhost_user

namespace sriovd::vhost_user {

// ---- handover ----------------------------------------------------------------

std::vector<uint8_t> BackendHandover::serialize() const {
  virtio::StateWriter w;
  w.u32(kVersion);
  w.u8(mode);
  w.u32(listener);
  w.u32(listener_handle);
  w.u32(connection);
  w.blob(unframed);
  w.u64(protocol_features);
  w.u8(protocol_negotiated ? 1 : 0);
  w.u8(status);
  w.u8(running ? 1 : 0);
  w.u32(static_cast<uint32_t>(regions.size()));
  for (const Region& r : regions) {
    w.u64(r.guest_addr);
    w.u64(r.size);
    w.u64(r.user_addr);
    w.u64(r.mmap_offset);
    w.u32(r.fd);
  }
  w.u32(static_cast<uint32_t>(queues.size()));
  for (const Queue& q : queues) {
    w.u32(q.kick);
    w.u32(q.call);
    w.u32(q.err);
  }
  w.u32(backend_req);
  w.u32(inflight);
  w.u64(inflight_offset);
  w.u64(inflight_size);
  w.u16(inflight_queues);
  w.u16(inflight_queue_size);
  w.blob(device);
  return w.take();
}

BackendHandover BackendHandover::parse(std::span<const uint8_t> bytes, size_t nfds, const std::string& what) {
  virtio::StateReader r(bytes, what);
  BackendHandover h;
  const uint32_t version = r.u32();
  if (version != kVersion)
    r.fail("a vhost-user handover of version " + std::to_string(version) + " (this sriovd reads " +
           std::to_string(kVersion) + ")");
  const auto fd_index = [&](const char* field) { return read_fd_index(r, nfds, field); };
  h.mode = r.u8();
  if (h.mode > 1) r.fail("mode " + std::to_string(h.mode));
  h.listener = fd_index("the listener");
  h.listener_handle = fd_index("the listener's handle");
  h.connection = fd_index("the connection");
  h.unframed = r.blob(kMaxPayload + sizeof(Header));
  h.protocol_features = r.u64();
  h.protocol_negotiated = r.u8() != 0;
  h.status = r.u8();
  h.running = r.u8() != 0;
  const uint32_t nregions = r.u32();
  if (nregions > kMaxRegions) r.fail(std::to_string(nregions) + " memory regions");
  for (uint32_t i = 0; i < nregions; ++i) {
    Region g;
    g.guest_addr = r.u64();
    g.size = r.u64();
    g.user_addr = r.u64();
    g.mmap_offset = r.u64();
    g.fd = fd_index("a memory region");
    if (g.fd == kNoFd) r.fail("a memory region without its fd");
    h.regions.push_back(g);
  }
  const uint32_t nqueues = r.u32();
  if (nqueues > 1024) r.fail(std::to_string(nqueues) + " queues");
  for (uint32_t i = 0; i < nqueues; ++i) {
    Queue q;
    q.kick = fd_index("a kick fd");
    q.call = fd_index("a call fd");
    q.err = fd_index("an error fd");
    h.queues.push_back(q);
  }
  h.backend_req = fd_index("the back-end channel");
  h.inflight = fd_index("the inflight buffer");
  h.inflight_offset = r.u64();
  h.inflight_size = r.u64();
  h.inflight_queues = r.u16();
  h.inflight_queue_size = r.u16();
  h.device = r.blob(16U << 20U);
  r.end();
  return h;
}

BackendHandover Backend::freeze_for_handover() {
  if (frozen_) throw HandoverRefused("it is being handed over already");
  if (release_pending_ || device_.wedged())
    throw HandoverRefused("the device's worker has not stopped since it was asked to");
  if (log_all_ || log_) throw HandoverRefused("a live migration is logging the device's writes");
  if (access_platform_)
    throw HandoverRefused("VIRTIO_F_ACCESS_PLATFORM is negotiated (the IOTLB's translations are not handed over)");
  BackendHandover h;
  h.mode = static_cast<uint8_t>(mode_);
  h.connection = freeze_connection(conn_, h, h.unframed);
  frozen_ = true;
  was_running_ = device_.running();
  try {
    retry_.cancel();
    if (listener_) {
      UnixListener::Handed l = listener_->pause_for_handover();
      h.listener = h.add_fd(std::move(l.listener));
      h.listener_handle = h.add_fd(std::move(l.handle));
    }
    if (conn_.connected()) {
      device_.stop();
      if (device_.wedged()) throw HandoverRefused("the device's worker did not stop");
      h.device = device_.save_state().serialize();
      h.running = was_running_;
      h.protocol_features = protocol_features_;
      h.protocol_negotiated = protocol_negotiated_;
      h.status = status_;
      for (const HeldRegion& r : held_regions_)
        h.regions.push_back(
            {r.guest_addr, r.size, r.user_addr, r.mmap_offset, h.add_fd(dup_fd(r.fd.get(), "a memory region's fd"))});
      for (unsigned q = 0; q < device_.num_queues(); ++q)
        h.queues.push_back({h.add_fd(dup_fd(kick_fds_[q].get(), "a kick fd")),
                            h.add_fd(dup_fd(call_fds_[q].get(), "a call fd")),
                            h.add_fd(dup_fd(err_fds_[q].get(), "an error fd"))});
      h.backend_req = h.add_fd(dup_fd(backend_req_.get(), "the back-end channel"));
      if (inflight_) {
        h.inflight = h.add_fd(dup_fd(inflight_fd_.get(), "the inflight buffer"));
        h.inflight_offset = inflight_offset_;
        h.inflight_size = inflight_.size();
        h.inflight_queues = inflight_queues_;
        h.inflight_queue_size = inflight_queue_size_;
      }
    } else {
      // Nobody connected: the successor only listens (or connects) again.
      h.device = device_.save_state().serialize();
    }
  } catch (const HandoverRefused&) {
    thaw();
    throw;
  } catch (const std::exception& e) {
    thaw();
    throw HandoverRefused(e.what());
  }
  spdlog::info("vhost-user: {}: frozen for a handover ({} fds)", device_.name(), h.fds.size());
  return h;
}

void Backend::thaw() {
  if (!std::exchange(frozen_, false)) return;
  if (listener_) listener_->resume();
  conn_.thaw();
  if (was_running_) {
    try_start();
    device_.kick_all();
  }
  if (mode_ == Mode::client && !conn_.connected()) connect_later(std::chrono::milliseconds(0));
  spdlog::info("vhost-user: {}: the handover did not happen; serving again", device_.name());
}

void Backend::add_region(uint64_t guest_addr, uint64_t size, uint64_t user_addr, uint64_t mmap_offset, UniqueFd fd) {
  memory_.add_fd_region(guest_addr, size, user_addr, fd.get(), mmap_offset);
  held_regions_.push_back({guest_addr, size, user_addr, mmap_offset, std::move(fd)});
}

void Backend::use_kick(unsigned q, UniqueFd fd) {
  kick_fds_[q] = dup_fd(fd.get(), "a kick eventfd");
  device_.set_queue_kick(q, std::move(fd));
}

void Backend::use_call(unsigned q, UniqueFd fd) {
  call_fds_[q] = dup_fd(fd.get(), "a call eventfd");
  calls_.set(q, std::move(fd));
}

void Backend::use_inflight(UniqueFd fd, uint64_t offset, uint64_t size, uint16_t queues, uint16_t queue_size,
                           const std::string& what) {
  inflight_ = map_peer_buffer(fd.get(), offset, size, what);
  device_.set_inflight(inflight_.data(), queues, queue_size);
  inflight_fd_ = std::move(fd);
  inflight_offset_ = offset;
  inflight_queues_ = queues;
  inflight_queue_size_ = queue_size;
}

void Backend::handed_over() {
  if (!frozen_) return;  // left out of the handover: it ends as at any stop
  if (listener_) listener_->forget_file();
}

void Backend::take_over(BackendHandover& h) {
  const std::string who = "vhost-user " + device_.name() + "'s handover";
  if (h.mode != static_cast<uint8_t>(mode_)) throw std::invalid_argument(who + ": a back-end in the other socket mode");
  const virtio::DeviceState state = virtio::DeviceState::parse(h.device, who);
  if (mode_ == Mode::server) {
    std::optional<SocketFile> adopted;
    if (h.listener != BackendHandover::kNoFd) {
      try {
        adopted = SocketFile::adopt(path_, "vhost-user socket of " + device_.name(), h.take_fd(h.listener),
                                    h.take_fd(h.listener_handle));
      } catch (const std::exception& e) {
        spdlog::warn("vhost-user: {}: {}; listening on a new socket", device_.name(), e.what());
      }
    }
    make_listener(std::move(adopted));
  }
  UniqueFd conn = h.take_fd(h.connection);
  if (!conn) {
    if (mode_ == Mode::client) try_connect();
    return;
  }
  if (h.queues.size() != device_.num_queues())
    throw std::invalid_argument(who + ": " + std::to_string(h.queues.size()) + " queues for a device of " +
                                std::to_string(device_.num_queues()));
  device_.restore_state(state);
  protocol_features_ = h.protocol_features;
  protocol_negotiated_ = h.protocol_negotiated;
  status_ = h.status;
  for (const auto& r : h.regions) add_region(r.guest_addr, r.size, r.user_addr, r.mmap_offset, h.take_fd(r.fd));
  if (!h.regions.empty()) device_.set_memory(&memory_);
  if (UniqueFd fd = h.take_fd(h.inflight))
    use_inflight(std::move(fd), h.inflight_offset, h.inflight_size, h.inflight_queues, h.inflight_queue_size,
                 who + ": the inflight buffer");
  // The front-end may have changed its eventfds' flags since the
  // predecessor checked them: checked again.
  for (unsigned q = 0; q < device_.num_queues(); ++q) {
    const BackendHandover::Queue& hq = h.queues[q];
    if (UniqueFd kick = h.take_fd(hq.kick))
      use_kick(q, checked_peer_eventfd(std::move(kick), who + ": queue " + std::to_string(q) + "'s kick"));
    if (UniqueFd call = h.take_fd(hq.call))
      use_call(q, checked_peer_eventfd(std::move(call), who + ": queue " + std::to_string(q) + "'s call"));
    err_fds_[q] = h.take_fd(hq.err);
  }
  backend_req_ = h.take_fd(h.backend_req);
  ++stats_.connections;
  conn_.adopt(std::move(conn), h.unframed);
  if (h.running) {
    try_start();
    device_.kick_all();
  }
  // An interrupt the predecessor owed when it stopped is delivered now (a
  // spurious one costs a driver a look at its used ring).
  for (unsigned q = 0; q < device_.num_queues(); ++q)
    if (call_fds_[q]) calls_.engine.trigger(calls_.ids[q]);
  spdlog::info("vhost-user: {}: front-end taken over from the previous sriovd ({} regions, device {})", device_.name(),
               h.regions.size(), h.running ? "running" : "stopped");
}

}  // namespace sriovd::vhost_user
