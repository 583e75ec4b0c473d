#pragma once
// A vhost-user back-end serving one virtio-net device on a Unix socket:
// server mode (sriovd listens, the VMM or DPDK virtio_user connects) or
// client mode (the VMM listens; sriovd connects, and connects again
// whenever the connection ends or the socket is not there yet). The
// protocol runs on the control thread's io_context; the datapath on the
// device's workers. A malformed message (wrong size, wrong fd count, an
// unknown request, an address outside the shared memory) ends that
// connection with a logged reason and resets the device; the daemon and the
// socket stay, and the front-end can connect again.

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "sriovd/util/counters.hpp"
#include "sriovd/util/asio.hpp"
#include "sriovd/util/fd.hpp"
#include "sriovd/util/handed_fds.hpp"
#include "sriovd/util/peer_mapping.hpp"
#include "sriovd/util/log_limit.hpp"
#include "sriovd/util/peer_session.hpp"
#include "sriovd/virtio/guest_memory.hpp"
#include "sriovd/virtio/iotlb.hpp"
#include "sriovd/vhost_user/protocol.hpp"
#include "sriovd/virtio/device.hpp"

namespace sriovd::vhost_user {

struct BackendStats {
  uint64_t connections = 0;
  uint64_t messages = 0;
  uint64_t protocol_errors = 0;
  uint64_t refused_peers = 0;  // not admitted by allowed_uids, unknown credentials, or a second front-end
  uint64_t log_bases = 0;      // dirty logs the front-end gave (SET_LOG_BASE: a migration starting, or resized)
  uint64_t rarps = 0;          // SEND_RARP: the guest announced on the wire on its behalf
  uint64_t rarps_refused = 0;  // SEND_RARP for a MAC not the device's: not sent
  std::string last_error;
};

inline constexpr Counter<BackendStats> kBackendCounters[] = {
    {"connections", "front-end connections accepted", &BackendStats::connections},
    {"messages", "vhost-user messages handled", &BackendStats::messages},
    {"protocol_errors", "connections ended for a malformed message", &BackendStats::protocol_errors},
    {"refused_peers", "connections refused (peer credentials, one front-end at a time)", &BackendStats::refused_peers},
};
// Live migration's, vhost-user's own (the vfio-user server has no such).
inline constexpr Counter<BackendStats> kMigrationCounters[] = {
    {"log_bases", "dirty logs the front-end gave for a live migration (SET_LOG_BASE)", &BackendStats::log_bases},
    {"rarps", "RARPs sent on the guest's behalf after a migration (SEND_RARP)", &BackendStats::rarps},
    {"rarps_refused", "SEND_RARPs refused: the MAC was not the device's", &BackendStats::rarps_refused},
};

// What a successor needs to go on serving a back-end's front-end where it
// stopped, without the front-end noticing (an upgrade in place,
// daemon/handover.hpp): the listening socket and its file, the connection
// and the bytes read from it and not handled yet, the shared memory, the
// queues' eventfds, the inflight buffer, the negotiated protocol state and
// the device's own state. Fds are indexes into `fds` (none: kNoFd).
struct BackendHandover : HandedFds {
  static constexpr uint32_t kVersion = 1;
  struct Region {
    uint64_t guest_addr = 0, size = 0, user_addr = 0, mmap_offset = 0;
    uint32_t fd = kNoFd;
  };
  struct Queue {
    uint32_t kick = kNoFd, call = kNoFd, err = kNoFd;
  };
  uint8_t mode = 0;  // Backend::Mode
  uint32_t listener = kNoFd, listener_handle = kNoFd;
  uint32_t connection = kNoFd;
  std::vector<uint8_t> unframed;
  uint64_t protocol_features = 0;
  bool protocol_negotiated = false;
  uint8_t status = 0;
  bool running = false;
  std::vector<Region> regions;
  std::vector<Queue> queues;
  uint32_t backend_req = kNoFd;
  uint32_t inflight = kNoFd;
  uint64_t inflight_offset = 0, inflight_size = 0;
  uint16_t inflight_queues = 0, inflight_queue_size = 0;
  std::vector<uint8_t> device;  // virtio::DeviceState, serialized

  // The fds travel apart (inherited across exec, or systemd's fd store):
  // serialize() writes the rest; parse() throws std::invalid_argument
  // naming `what` on bytes that do not fit (another version, an fd index
  // past `nfds`).
  [[nodiscard]] std::vector<uint8_t> serialize() const;
  static BackendHandover parse(std::span<const uint8_t> bytes, size_t nfds, const std::string& what);
};

class Backend {
 public:
  enum class Mode { server, client };
  // allowed_uids: who may be the front-end (peer_admitted, util/unix_socket.hpp);
  // in client mode the VMM that listens is checked.
  // Makes one route per queue on `engine` for the device's used-buffer
  // notifications (the front-end's call eventfds are their sinks).
  Backend(asio::io_context& io, std::string socket_path, virtio::Device& device, irq::Engine& engine,
          Mode mode = Mode::server, std::vector<uid_t> allowed_uids = {});
  // A successor's back-end: serves the front-end of `handover` where its
  // predecessor stopped (the socket, the connection, memory, rings and
  // the device as they were), and delivers each queue's interrupt once
  // (one the predecessor may not have sent before it stopped). Throws
  // std::invalid_argument when the handover does not fit this device (its
  // fds are closed then, and the front-end sees its connection end).
  Backend(asio::io_context& io, std::string socket_path, virtio::Device& device, irq::Engine& engine, Mode mode,
          std::vector<uid_t> allowed_uids, BackendHandover handover);
  ~Backend();
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  // A reload's new list: applies to the next front-end.
  void set_allowed_uids(std::vector<uid_t> uids);
  // Server mode: the socket file's owner, group and mode (through the
  // listener's handle on its file, never by path). Client mode: nothing
  // (the front-end's socket is not ours).
  void set_socket_access(const SocketAccess& access) {
    if (listener_) listener_->set_access(access);
  }
  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] bool connected() const { return conn_.connected(); }
  [[nodiscard]] const BackendStats& stats() const { return stats_; }
  // Live migration: is the device logging its writes (VHOST_F_LOG_ALL with
  // a log), how many bytes of log it has, how many writes the log missed.
  [[nodiscard]] bool logging() const { return memory_.dirty_log() != nullptr; }
  [[nodiscard]] uint64_t log_bytes() const { return log_ ? log_->bytes() : 0; }
  [[nodiscard]] uint64_t log_missed() const { return log_ ? log_->missed() : 0; }
  // The device configuration changed (the link): tells the front-end on
  // the back-end channel when CONFIG was negotiated.
  void config_changed();

  // Handover: the device stops (the data path waits from here to the
  // successor's start), the front-end's next messages and connections
  // wait in their sockets, and what a successor needs is returned, fds
  // duplicated: nothing is given up yet. Throws HandoverRefused, and goes
  // on as it was, while it cannot be handed over (a live migration's
  // dirty log, an IOMMU's translations, a stuck worker, replies the
  // front-end has not read). thaw(): the handover did not happen; serving
  // goes on. handed_over(): the successor serves it now; this back-end's
  // end removes nothing the front-end sees (the socket file).
  BackendHandover freeze_for_handover();
  void thaw();
  void handed_over();
  [[nodiscard]] bool frozen() const { return frozen_; }

 private:
  struct Message;
  using IotlbMsg = vhost_user::IotlbMsg;
  void connect_later(std::chrono::milliseconds delay);
  void try_connect();
  void adopt(UniqueFd fd);
  void on_message(FramedReader& reader);
  void on_end(const std::string& why, EndCause cause);
  void release_session();
  // One entry of the request table (request_of): the shape every message
  // of it must have (-1: its handler checks) and the handler, which
  // returns true when it replied itself.
  struct Request {
    uint32_t request;
    int payload;
    int fds;
    bool (Backend::*handler)(Message&);
  };
  static const Request* request_of(uint32_t request);
  static std::string what(const Message& m);
  void handle(Message& m);
  [[nodiscard]] unsigned queue_index(const Message& m, uint32_t index) const;
  bool nothing(Message& m);
  bool get_features(Message& m);
  bool set_features(Message& m);
  bool get_protocol_features(Message& m);
  bool set_protocol_features(Message& m);
  bool reset_device(Message& m);
  bool set_mem_table(Message& m);
  bool set_vring_num(Message& m);
  bool set_vring_addr(Message& m);
  bool set_vring_base(Message& m);
  bool get_vring_base(Message& m);
  bool set_vring_fd(Message& m);
  bool get_queue_num(Message& m);
  bool set_vring_enable(Message& m);
  bool set_status(Message& m);
  bool get_status(Message& m);
  bool get_max_mem_slots(Message& m);
  bool set_backend_req_fd(Message& m);
  bool iotlb_request(Message& m);
  bool mem_reg(Message& m);
  bool config_request(Message& m);
  bool get_inflight(Message& m);
  bool set_inflight(Message& m);
  bool set_log_base(Message& m);
  bool set_log_fd(Message& m);
  bool send_rarp(Message& m);
  void install_log();
  void drop_log();
  void take_over(BackendHandover& h);
  // What a session gives the back-end, kept for a handover too: a memory
  // region with its fd, a queue's kick and call eventfds, the inflight
  // buffer (mapped, given to the device).
  void add_region(uint64_t guest_addr, uint64_t size, uint64_t user_addr, uint64_t mmap_offset, UniqueFd fd);
  void use_kick(unsigned q, UniqueFd fd);
  void use_call(unsigned q, UniqueFd fd);
  void use_inflight(UniqueFd fd, uint64_t offset, uint64_t size, uint16_t queues, uint16_t queue_size,
                    const std::string& what);
  void make_listener(std::optional<SocketFile> adopted);
  [[nodiscard]] uint64_t offered_protocol() const;
  void reply(const Message& m, const void* payload, uint32_t size, int fd = -1);
  void drop_inflight();
  PeerMemory map_peer_buffer(int fd, uint64_t offset, uint64_t size, const std::string& what);
  void quiesce(const char* what);
  void ack(const Message& m, uint64_t status);
  void try_start();
  void watch_misses();
  void send_miss();
  void iotlb_message(const IotlbMsg& msg);
  void publish_translations();

  // A queue's call: a route whose sink is the front-end's eventfd
  // (SET_VRING_CALL), unmasked while there is one - vhost-user has no
  // vector masking. The transport's, as virtio-pci's MSI-X routes are.
  struct CallRoutes {
    CallRoutes(irq::Engine& e, virtio::Device& device);
    ~CallRoutes();
    CallRoutes(const CallRoutes&) = delete;
    CallRoutes& operator=(const CallRoutes&) = delete;
    void set(unsigned q, UniqueFd call);
    void clear();  // no sinks, masked (a session's end)
    irq::Engine& engine;
    std::vector<irq::RouteId> ids;
  };

  std::string path_;
  virtio::Device& device_;
  CallRoutes calls_;
  Mode mode_;
  std::vector<uid_t> allowed_uids_;
  asio::io_context& io_;
  asio::steady_timer retry_;
  PeerMemoryQuota quota_;  // what one front-end may make the daemon map (outlives the mappings below)
  virtio::GuestMemory memory_;
  uint64_t protocol_features_ = 0;
  bool protocol_negotiated_ = false;
  uint8_t status_ = 0;
  std::vector<UniqueFd> err_fds_;  // SET_VRING_ERR's, one per queue
  UniqueFd backend_req_;           // the back-end channel (SET_BACKEND_REQ_FD)
  virtio::Iotlb iotlb_;            // VIRTIO_F_ACCESS_PLATFORM translations
  asio::posix::stream_descriptor miss_watch_;
  bool access_platform_ = false;
  // The inflight buffer the front-end gave (SET_INFLIGHT_FD), mapped.
  // What a front-end can make it log at will, each line at most
  // LogLimit::kBurst a second.
  struct {
    LogLimit rarp, logging, log_base, inflight;
  } log_limits_;
  PeerMemory inflight_;  // the front-end's inflight buffer, as it declared it
  // What a handover passes on that the mappings and the device do not
  // keep: each region's fd and layout, the queues' kick and call fds, the
  // inflight buffer's fd and layout.
  struct HeldRegion {
    uint64_t guest_addr, size, user_addr, mmap_offset;
    UniqueFd fd;
  };
  std::vector<HeldRegion> held_regions_;
  std::vector<UniqueFd> kick_fds_, call_fds_;
  UniqueFd inflight_fd_;
  uint64_t inflight_offset_ = 0;
  uint16_t inflight_queues_ = 0, inflight_queue_size_ = 0;
  bool frozen_ = false;
  bool was_running_ = false;  // before the freeze
  // The dirty log (SET_LOG_BASE), mapped; in memory_ while VHOST_F_LOG_ALL
  // is negotiated (install_log).
  bool log_all_ = false;
  PeerMemory log_map_;  // its dirty log, as it declared it
  std::unique_ptr<virtio::DirtyLog> log_;
  UniqueFd log_fd_;               // SET_LOG_FD's eventfd: signalled after logged writes are published
  uint64_t faults_seen_ = 0;      // peer_mapping_faults() when last looked at
  bool release_pending_ = false;  // a wedged worker kept the last session's memory (on_end)
  BackendStats stats_;
  // Last: they call into everything above.
  std::unique_ptr<Message> in_;  // the message being handled (buffers kept)
  PeerConnection conn_;
  std::unique_ptr<UnixListener> listener_;  // server mode
};

}  // namespace sriovd::vhost_user
