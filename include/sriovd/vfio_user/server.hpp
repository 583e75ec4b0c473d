#pragma once
// A vfio-user server: one Unix socket per exported device, one client at a
// time. The protocol runs on the control thread's io_context. Every message
// is checked here, in one place, before the device sees it: sizes, fd
// counts, region and IRQ ranges, DMA windows. A well-formed request that
// cannot be done gets an error reply with an errno; a message that breaks
// the framing (an impossible size, a reply where a command belongs, too
// many fds, anything before VERSION) ends that connection with a logged
// reason. Either way the daemon and the socket stay, and when a client
// goes, its DMA windows and fds are released and the device is reset, so
// the next one starts clean.

#include <sys/types.h>

#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "sriovd/util/log_limit.hpp"
#include "sriovd/util/counters.hpp"
#include "sriovd/util/asio.hpp"
#include "sriovd/util/fd.hpp"
#include "sriovd/util/handed_fds.hpp"
#include "sriovd/util/unix_socket.hpp"
#include "sriovd/util/peer_session.hpp"
#include "sriovd/vfio_user/device.hpp"
#include "sriovd/vfio_user/migration.hpp"
#include "sriovd/vfio_user/protocol.hpp"

namespace sriovd::vfio_user {

struct ServerStats {
  uint64_t connections = 0;
  uint64_t messages = 0;
  uint64_t error_replies = 0;    // requests refused with an errno
  uint64_t protocol_errors = 0;  // connections ended for a malformed message
  uint64_t refused_peers = 0;    // SO_PEERCRED not on the allow-list, or a second client
  std::string last_error;
};

inline constexpr Counter<ServerStats> kServerCounters[] = {
    {"connections", "VMM connections accepted", &ServerStats::connections},
    {"messages", "vfio-user messages handled", &ServerStats::messages},
    {"error_replies", "requests refused with an error reply", &ServerStats::error_replies},
    {"protocol_errors", "connections ended for a malformed message", &ServerStats::protocol_errors},
    {"refused_peers", "connections refused (peer credentials, one client at a time)", &ServerStats::refused_peers},
};

// What a successor needs to go on serving a server's client where it
// stopped (an upgrade in place, daemon/handover.hpp): the listening socket
// and its file, the connection and the bytes read from it and not handled
// yet, what VERSION negotiated, each DMA window with its fd, and the
// exported device's own part (ExportedDevice::freeze_for_handover), whose
// fds are in the same list.
struct ServerHandover : HandedFds {
  static constexpr uint32_t kVersion = 1;
  struct Window {
    uint64_t iova = 0, size = 0, fd_offset = 0;
    bool readable = false, writable = false;
    uint32_t fd = kNoFd;  // none: a window shared without an fd
  };
  uint32_t listener = kNoFd, listener_handle = kNoFd;
  uint32_t connection = kNoFd;
  std::vector<uint8_t> unframed;
  bool negotiated = false;
  uint32_t peer_max_fds = 1, peer_max_xfer = kMaxDataXfer;
  uint16_t next_id = 0;
  int32_t client_pid = 0;
  std::vector<int32_t> fd_recipients;
  std::vector<Window> windows;
  std::vector<uint8_t> device;

  // serialize() writes all but the fds; parse() throws
  // std::invalid_argument naming `what` on bytes that do not fit.
  [[nodiscard]] std::vector<uint8_t> serialize() const;
  static ServerHandover parse(std::span<const uint8_t> bytes, size_t nfds, const std::string& what);
};

class Server {
 public:
  // A reply (up to the largest transfer, 1 MiB, plus its header) is sent
  // whole within this, however the client reads it; then the session ends.
  // allowed_uids: see peer_admitted (util/unix_socket.hpp); empty admits
  // any peer whose credentials are known and the socket's mode lets in.
  Server(asio::io_context& io, std::string socket_path, ExportedDevice& device, std::vector<uid_t> allowed_uids = {});
  // A successor's server: serves the client of `handover` where its
  // predecessor stopped (socket, connection, DMA windows and the device as
  // they were). Throws std::invalid_argument when the handover does not
  // fit this device (its fds are closed then: the client sees its
  // connection end).
  Server(asio::io_context& io, const std::string& socket_path, ExportedDevice& device, std::vector<uid_t> allowed_uids,
         ServerHandover handover);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // A reload's new list: the next client is checked against it (the one
  // connected stays).
  void set_allowed_uids(std::vector<uid_t> uids) { listener_.set_allowed_uids(std::move(uids)); }
  // The socket file's owner, group and mode (through the listener's handle
  // on its file, never by path).
  void set_socket_access(const SocketAccess& access) { listener_.set_access(access); }
  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] bool connected() const { return conn_.connected(); }
  [[nodiscard]] const ServerStats& stats() const { return stats_; }
  [[nodiscard]] const std::vector<DmaWindow>& dma_windows() const { return windows_; }
  // The device's live migration (null: it cannot be migrated).
  [[nodiscard]] const Migration* migration() const { return migration_.get(); }
  // The clients (pids) this server handed a region's fd to - with
  // bar_access: mmap, the VF's own device fd, which such a client may keep
  // after it disconnects (vfio/holders.hpp).
  [[nodiscard]] const std::vector<pid_t>& fd_recipients() const { return fd_recipients_; }

  // Server-to-client DMA (VFIO_USER_DMA_READ/WRITE) for memory the client
  // shared without an fd. Control thread only; waits for the reply and
  // keeps any command that arrives meanwhile for afterwards. Throws Error
  // when the range is not inside one readable/writable window or the
  // client refuses it.
  void dma_read(uint64_t iova, std::span<uint8_t> out);
  void dma_write(uint64_t iova, std::span<const uint8_t> in);

  // Handover: the client's next messages and connections wait in their
  // sockets, the device stops, and what a successor needs is returned,
  // fds duplicated: nothing is given up yet. Throws HandoverRefused, and
  // goes on as it was, while it cannot be handed over (a live migration
  // under way, a device that cannot be, replies the client has not read).
  // thaw(): the handover did not happen; serving goes on. handed_over():
  // the successor serves it now; this server's end touches nothing the
  // client or the device's port sees (the socket file, the device).
  ServerHandover freeze_for_handover();
  void thaw();
  void handed_over();

 private:
  struct Message {
    Header hdr;
    std::vector<uint8_t> payload;
    std::vector<UniqueFd> fds;
  };
  struct Reply {
    std::vector<uint8_t> payload;
    std::vector<int> fds;  // borrowed, sent with the reply
  };

  Server(asio::io_context& io, std::string socket_path, ExportedDevice& device, std::vector<uid_t> allowed_uids,
         std::optional<SocketFile> adopted);
  void adopt(UniqueFd fd);
  // A connection's start: the quota and each region's bounds.
  void begin_session();
  UnixListener make_listener(asio::io_context& io, std::optional<SocketFile> adopted, std::vector<uid_t> allowed_uids);
  void take_over(ServerHandover& h);
  void abandon_takeover();
  void on_message(FramedReader& reader);
  void on_end(const std::string& why, EndCause cause);
  void take(FramedReader& reader, Message& m);
  void dispatch(Message& m);
  // One entry per served command: what it must carry and the method that
  // serves it (server.cpp, command_of). Names are the protocol's
  // (command_name), shared with the client.
  struct Command {
    uint16_t command;
    uint32_t payload;  // exact size, or the minimum when !exact
    bool exact;
    uint32_t max_fds;
    void (Server::*handler)(Message& m, Reply& r);
  };
  static const Command* command_of(uint16_t command);
  void send(const Header& h, std::span<const uint8_t> payload, std::span<const int> fds);
  void disconnect(const std::string& why);
  uint64_t dma_transfer(uint16_t command, uint64_t iova, std::span<uint8_t> in_out);
  const DmaWindow& window_for(uint64_t iova, uint64_t size, bool write) const;

  void version(Message& m, Reply& r);
  void dma_map(Message& m, Reply& r);
  void dma_unmap(Message& m, Reply& r);
  void device_info(Message& m, Reply& r);
  void region_info(Message& m, Reply& r);
  void region_io_fds(Message& m, Reply& r);
  void irq_info(Message& m, Reply& r);
  void set_irqs(Message& m, Reply& r);
  void region_access(Message& m, Reply& r);
  void region_write_multi(Message& m, Reply& r);
  void device_reset(Message& m, Reply& r);
  void device_feature(Message& m, Reply& r);
  void mig_data_read(Message& m, Reply& r);
  void mig_data_write(Message& m, Reply& r);
  void check_access(uint32_t region, uint64_t offset, uint32_t count, bool write) const;
  void unmap_all();

  std::string path_;
  ExportedDevice& device_;
  bool negotiated_ = false;
  uint32_t peer_max_fds_ = 1;
  uint32_t peer_max_xfer_ = kMaxDataXfer;
  uint16_t next_id_ = 0;
  std::deque<Message> deferred_;  // commands that came while waiting for a DMA reply
  Message in_;                    // the message being handled (buffers kept)
  struct RegionBounds {
    uint32_t flags;
    uint64_t size;
  };
  std::vector<RegionBounds> bounds_;  // per region, taken when the client connects
  Reply reply_;                       // its reply (buffers kept)
  std::vector<DmaWindow> windows_;
  // Parallel to windows_: the window's mapping (null without an fd), on
  // the heap so that its guard's address (DmaWindow::guard) stays put,
  // and its fd and offset (kept for a handover).
  struct Mapping {
    std::unique_ptr<PeerMemory> memory;
    UniqueFd fd;
    uint64_t offset = 0;
  };
  std::vector<Mapping> mappings_;
  bool frozen_ = false;       // being handed over
  bool handed_over_ = false;  // the successor serves the client
  PeerMemoryQuota quota_;     // what this export's clients may make it map
  std::vector<pid_t> fd_recipients_;
  pid_t client_pid_ = 0;
  std::vector<std::unique_ptr<PeerMemory>> held_;  // windows a device could not let go (never unmapped)
  uint64_t faults_seen_ = 0;                       // peer_mapping_faults() when last looked at
  void log_refusal(uint16_t command, const char* why);
  struct {
    LogLimit refusal, logging;  // what a client can make it log at will
  } log_limits_;
  [[nodiscard]] bool memory_faulted() const;
  ServerStats stats_;
  std::unique_ptr<Migration> migration_;  // when the device is migratable
  // Last: the connection and listener call into everything above.
  PeerConnection conn_;
  UnixListener listener_;
};

}  // namespace sriovd::vfio_user
