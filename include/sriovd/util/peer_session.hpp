#pragma once
// The skeleton the daemon's Unix-socket servers share (vhost-user,
// vfio-user, the control API): a listener that checks each peer before the
// server sees it, and a connection that frames a peer's messages without
// ever blocking the control thread on it.
//
//   UnixListener   accept, SO_PEERCRED against the socket's allow-list
//                  (fails closed), the server's client limit, every
//                  refusal logged with its reason and counted; the socket
//                  file removed with it.
//   FramedReader   one length-prefixed message at a time, with the fds
//                  that came with it, capped over all its parts; sizes
//                  checked when the header is whole.
//   PeerConnection a peer's socket on the io_context: reads what is there
//                  (never waits for the rest of a message), a deadline for
//                  each message from its first byte, sends that never wait
//                  for a peer that does not read (what its socket does not
//                  take is queued, bounded, and its requests are not read
//                  until the queue drains), one teardown.

#include <sys/socket.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "sriovd/util/asio.hpp"
#include "sriovd/util/fd.hpp"
#include "sriovd/util/handed_fds.hpp"
#include "sriovd/util/unix_socket.hpp"

namespace sriovd {

// Why `peer` may not use a socket whose allow-list is `allowed` (named
// `list` in the reason, "the export's allowed_uids"); empty when it may.
// See peer_admitted (util/unix_socket.hpp) for the rule.
std::string peer_refusal(const std::optional<ucred>& peer, std::span<const uid_t> allowed, const std::string& list);

class UnixListener {
 public:
  struct Options {
    std::string what;  // the socket in errors and logs: "vfio-user socket of vf0"
    std::string list;  // the allow-list in refusals: "the export's allowed_uids"
    mode_t mode = 0660;
    std::vector<uid_t> allowed_uids;
    // What a peer refused while the server is busy is told (after "refused ").
    std::string busy_refusal = "a second client while one is connected";
    std::optional<uid_t> uid{};  // the socket file's owner and group (unset: the daemon's)
    std::optional<gid_t> gid{};
  };
  // An admitted peer: its connection (blocking, close-on-exec) and who it is.
  using Admit = std::function<void(UniqueFd fd, const ucred& peer)>;
  // True while the server takes no further client (its one-client policy).
  using Busy = std::function<bool()>;
  // A refused peer, for a server that tells it why before closing (the
  // control API sends an error line); unset: the connection is closed.
  using Refuse = std::function<void(UniqueFd fd, const std::string& why)>;

  // Listens on `path` (a SocketFile: a stale socket replaced, a live one or
  // a non-socket refused, the file's access set before it is in place;
  // throws).
  UnixListener(asio::io_context& io, std::string path, Options options, Admit admit, Busy busy = {},
               Refuse refuse = {});
  // A successor's listener on its predecessor's socket (SocketFile::adopt:
  // the socket and its file as they were, clients in its backlog kept).
  UnixListener(asio::io_context& io, SocketFile adopted, Options options, Admit admit, Busy busy = {},
               Refuse refuse = {});
  ~UnixListener();  // stops accepting and removes the socket file (if the path is still it)
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;

  // A reload's list: the next peer is checked against it.
  void set_allowed_uids(std::vector<uid_t> uids) { options_.allowed_uids = std::move(uids); }
  // A reload's owner, group and mode, given to this socket's file (never
  // to whatever its path holds now).
  void set_access(const SocketAccess& access) { file_.set_access(access); }
  [[nodiscard]] const std::vector<uid_t>& allowed_uids() const { return options_.allowed_uids; }
  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] uint64_t accepted() const { return accepted_; }
  [[nodiscard]] uint64_t refused() const { return refused_; }
  [[nodiscard]] const std::string& last_refusal() const { return last_refusal_; }
  [[nodiscard]] uint64_t accept_failures() const { return accept_failures_; }
  // Handover: accepting stops (who connects waits in the backlog) and the
  // listening socket and its file's handle are duplicated for the
  // successor; resume() when the handover did not happen. forget_file():
  // the successor has the file, whose removal is no longer this one's.
  struct Handed {
    UniqueFd listener, handle;
  };
  Handed pause_for_handover();
  void resume();
  void forget_file() { file_ = SocketFile(); }

  // After a failed accept (EMFILE: the process is out of fds) the listener
  // waits this long before it tries again: accepting at once would fail at
  // once, in a loop that takes a core and floods the log.
  static constexpr std::chrono::milliseconds kAcceptRetry{100};

 private:
  void accept_next();
  void accept_later(const boost::system::error_code& why);
  void admit_or_refuse(UniqueFd fd);

  std::string path_;
  Options options_;
  Admit admit_;
  Busy busy_;
  Refuse refuse_;
  asio::local::stream_protocol::acceptor acceptor_;
  SocketFile file_;
  uint64_t accepted_ = 0;
  uint64_t refused_ = 0;
  uint64_t accept_failures_ = 0;
  bool failing_ = false;  // accepts fail: logged once until one succeeds
  bool paused_ = false;
  std::vector<UniqueFd> held_;  // accepted while paused
  std::string last_refusal_;
  asio::steady_timer retry_;
};

// Ends a connection: its bytes cannot be framed (an impossible size, too
// many fds, a message not whole in time). Servers count these apart from
// requests refused with an error reply.
class FramingError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Frames messages that start with a fixed-size header from which the
// payload's size follows. The buffers are kept from message to message
// (take() swaps them out and the caller's come back), so a steady stream
// allocates nothing.
//
// Reads are batched: what the socket holds is read ahead, up to
// kReadAhead bytes in one recvmsg, and framed from there, so a burst of
// small messages (posted doorbell writes) costs one system call, not two
// per message. A payload larger than that is read straight into place.
//
// Fds: the kernel ends a read at the segment that carries fds (SCM_RIGHTS
// on a stream socket), and a segment begins where its sendmsg began, so
// the fds that come with a read belong to the message that holds the
// read's last byte: the message whose sendmsg carried them, when each
// message is sent whole by one sendmsg (the protocols' rule), and the
// message being read when the reads stop at message boundaries (as an
// unbatched reader's do).
class FramedReader {
 public:
  // The payload size a whole header announces; throws FramingError for
  // one the protocol does not allow (the caller's limits).
  using PayloadSize = std::function<size_t(std::span<const uint8_t> header)>;
  enum class Status { message, again, closed };

  static constexpr size_t kReadAhead = 16U << 10U;

  FramedReader(size_t header_size, size_t max_fds, PayloadSize payload_size);

  // Frames the next message from what was read ahead, reading from the
  // non-blocking socket `fd` as needed: `message` when it is whole,
  // `again` when the socket has no more now, `closed` at end of stream.
  // Throws FramingError (too many fds, the header's size) or SystemError
  // (a read error).
  Status read(int fd);
  // Whether part of a message has come (its deadline runs): bytes of the
  // message being framed, or read ahead of the next.
  [[nodiscard]] bool partial() const { return got_ > 0 || ahead_pos_ < ahead_end_; }
  [[nodiscard]] size_t bytes() const { return got_ + (ahead_end_ - ahead_pos_); }
  [[nodiscard]] size_t expected() const { return header_.size() + (header_done_ ? payload_.size() : 0); }
  // Read ahead and not framed yet (a server that stops after a batch must
  // come back for these: the socket will not wake it for them).
  [[nodiscard]] bool buffered() const { return ahead_pos_ < ahead_end_; }
  // System calls that read (for the benchmarks and tests of batching).
  [[nodiscard]] uint64_t reads() const { return reads_; }

  // The whole message: its header bytes, and payload and fds swapped with
  // the caller's (whose old contents are cleared and reused next time).
  void take(std::span<uint8_t> header, std::vector<uint8_t>& payload, std::vector<UniqueFd>& fds);
  // Drops what has come of the current message and what was read ahead
  // (a connection that ends).
  void reset();
  // Handover: the bytes read and not taken (the message being framed,
  // then what was read ahead), and whether fds came with them (they cannot
  // be handed over apart from their bytes: the handover waits). prefill():
  // a successor's first bytes, framed before anything read from the socket.
  [[nodiscard]] std::vector<uint8_t> unframed() const;
  [[nodiscard]] bool holds_fds() const { return !fds_.empty() || !arrived_.empty(); }
  void prefill(std::span<const uint8_t> bytes);

 private:
  void next_message();
  void attach_fds();

  std::vector<uint8_t> header_;
  std::vector<uint8_t> payload_;
  std::vector<UniqueFd> fds_;
  size_t max_fds_;
  PayloadSize payload_size_;
  size_t got_ = 0;
  bool header_done_ = false;
  // Read ahead: [ahead_pos_, ahead_end_) of ahead_ not framed yet.
  std::vector<uint8_t> ahead_;
  size_t ahead_pos_ = 0;
  size_t ahead_end_ = 0;
  uint64_t received_ = 0;   // bytes read from the socket so far
  uint64_t msg_start_ = 0;  // where the message being framed starts, in those
  // Fds that came with a read, for the message holding `last`, the read's
  // last byte (rare: kept apart so the common message allocates nothing).
  struct Arrived {
    uint64_t last;
    std::vector<UniqueFd> fds;
  };
  std::vector<Arrived> arrived_;
  std::vector<UniqueFd> incoming_;  // a read's fds (buffer kept)
  uint64_t reads_ = 0;
};

// What on_end hears when the peer closed its end.
inline constexpr const char* kPeerClosed = "the peer closed the connection";

// Why a connection ended.
enum class EndCause {
  peer_closed,  // the peer closed its end
  framing,      // the peer's bytes broke the protocol: a malformed message, one not complete in time
  local,        // this side ended it: a handler that threw, a refusal, a stop
};

class PeerConnection {
 public:
  // The reader has a whole message: take() it and handle it. Throwing ends
  // the connection (on_end with the exception's text).
  using OnMessage = std::function<void(FramedReader& reader)>;
  // After each batch of messages, when the socket has no more for now.
  using OnIdle = std::function<void()>;
  // The connection ended (closed by the peer, a read error, a framing
  // error, a deadline, a handler that threw): `why` says it in words,
  // `cause` which of those it was. The socket is still open so the server
  // can clean up; it is closed when this returns.
  using OnEnd = std::function<void(const std::string& why, EndCause cause)>;

  PeerConnection(asio::io_context& io, FramedReader reader, std::chrono::milliseconds message_deadline,
                 OnMessage on_message, OnEnd on_end, OnIdle on_idle = {});
  ~PeerConnection();
  PeerConnection(const PeerConnection&) = delete;
  PeerConnection& operator=(const PeerConnection&) = delete;

  // Starts serving `fd`: made non-blocking for reads, sends bounded
  // (limit_send_wait), watched on the io_context.
  void adopt(UniqueFd fd);
  // Ends the connection now (on_end is called with `why`).
  void end(const std::string& why, EndCause cause = EndCause::local);
  [[nodiscard]] bool connected() const { return fd_.valid(); }
  // For a one-client server asked to admit another: when the peer has
  // closed its end, what it sent before is served now and the connection
  // ends (true), so a client that reconnects at once is not refused
  // because the old one's end had not had its turn yet. False while the
  // peer is there.
  bool settle_if_closed();
  [[nodiscard]] int fd() const { return fd_.get(); }
  [[nodiscard]] FramedReader& reader() { return reader_; }
  [[nodiscard]] std::chrono::milliseconds deadline() const { return deadline_; }

  // Sends one message (its parts `iov`, with `fds` as SCM_RIGHTS on its
  // first byte) without waiting: what the socket does not take now is
  // queued (the fds dup'ed) and sent as the peer reads, and the peer's
  // next requests wait in its socket until then. Nothing is allocated
  // when the socket takes it all (the common case). Throws
  // std::runtime_error when the queue would pass kMaxQueuedBytes (the peer
  // does not read what it is sent: the server ends its connection), and
  // SystemError on a send error. The queue not drained within the message
  // deadline ends the connection too.
  void send(std::span<const iovec> iov, std::span<const int> fds);
  [[nodiscard]] size_t queued_bytes() const { return queued_bytes_; }
  static constexpr size_t kMaxQueuedBytes = 4U << 20U;

  // For a server that must wait for one answer in the middle of handling
  // (vfio-user's DMA_READ from the client): reads until a whole message is
  // there or `deadline` passes (then throws FramingError), on the calling
  // thread. Returns false at end of stream.
  bool read_blocking(std::chrono::steady_clock::time_point deadline);
  // Handover (daemon/handover.hpp): reading stops at a message boundary,
  // what the peer sends waits in its socket, and the socket (duplicated)
  // and the bytes read and not handled yet are the successor's. Throws
  // std::runtime_error, and stays as it was, while replies are still
  // queued for the peer or fds came with the unhandled bytes (the
  // handover is tried again). thaw(): it did not happen; reading goes on.
  struct Frozen {
    UniqueFd fd;
    std::vector<uint8_t> unframed;
  };
  Frozen freeze();
  void thaw();
  [[nodiscard]] bool frozen() const { return frozen_; }
  // A successor's adopt: the predecessor's unhandled bytes are served
  // first.
  void adopt(UniqueFd fd, std::span<const uint8_t> unframed);

 private:
  void wait_readable();
  void on_readable();
  // Serves what was read ahead after the other handlers' turn.
  void continue_later();
  void wait_writable();
  void flush();
  void arm_deadline();
  void message_done();
  void close();

  asio::io_context& io_;
  FramedReader reader_;
  std::chrono::milliseconds deadline_;
  OnMessage on_message_;
  OnEnd on_end_;
  OnIdle on_idle_;
  UniqueFd fd_;
  std::unique_ptr<asio::posix::stream_descriptor> watch_;
  asio::steady_timer timer_;
  uint64_t message_seq_ = 0;  // which message the armed deadline belongs to
  uint64_t generation_ = 0;   // which connection a posted continuation belongs to
  bool timer_armed_ = false;
  bool ending_ = false;
  // What the peer's socket did not take yet, oldest first.
  struct Queued {
    std::vector<uint8_t> bytes;
    size_t sent = 0;
    std::vector<UniqueFd> fds;  // to go with its first byte (none once any went)
  };
  std::deque<Queued> queue_;
  size_t queued_bytes_ = 0;
  bool write_armed_ = false;
  bool read_armed_ = false;
  bool read_paused_ = false;        // requests wait while replies are queued
  bool frozen_ = false;             // handed over (freeze): nothing is read
  asio::steady_timer drain_timer_;  // the queue's deadline
  uint64_t drain_seq_ = 0;          // which queue the armed deadline belongs to
};

// A handover's part of a session (vhost-user's and vfio-user's alike): the
// connection, when there is one, frozen into `fds` and the bytes read and
// not handled into `unframed`; returns its index (kNoFd: nobody is
// connected). Throws HandoverRefused naming why it cannot be now.
uint32_t freeze_connection(PeerConnection& conn, HandedFds& fds, std::vector<uint8_t>& unframed);

}  // namespace sriovd
