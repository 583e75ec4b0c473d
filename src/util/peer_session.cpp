#include "sriovd/util/peer_session.hpp"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include <spdlog/spdlog.h>

#include "sriovd/util/error.hpp"
#include "sriovd/util/unix_socket.hpp"

namespace sriovd {

using stream = asio::local::stream_protocol;

std::string peer_refusal(const std::optional<ucred>& peer, std::span<const uid_t> allowed, const std::string& list) {
  if (peer_admitted(peer, allowed)) return {};
  if (!peer) return "refused a peer whose credentials the kernel cannot give (SO_PEERCRED)";
  return "refused uid " + std::to_string(peer->uid) + ": not in " + list + " (pid " + std::to_string(peer->pid) + ")";
}

// ---- UnixListener ---------------------------------------------------------

UnixListener::UnixListener(asio::io_context& io, std::string path, Options options, Admit admit, Busy busy,
                           Refuse refuse)
    : path_(std::move(path)),
      options_(std::move(options)),
      admit_(std::move(admit)),
      busy_(std::move(busy)),
      refuse_(std::move(refuse)),
      acceptor_(io),
      retry_(io) {
  file_ = listen_unix(acceptor_, path_, {options_.uid, options_.gid, options_.mode}, options_.what);
  accept_next();
}

UnixListener::UnixListener(asio::io_context& io, SocketFile adopted, Options options, Admit admit, Busy busy,
                           Refuse refuse)
    : path_(adopted.path()),
      options_(std::move(options)),
      admit_(std::move(admit)),
      busy_(std::move(busy)),
      refuse_(std::move(refuse)),
      acceptor_(io),
      file_(std::move(adopted)),
      retry_(io) {
  UniqueFd fd = file_.take_listener();
  acceptor_.assign(asio::local::stream_protocol(), fd.get());
  (void)fd.release();
  accept_next();
}

UnixListener::Handed UnixListener::pause_for_handover() {
  Handed h{dup_fd(acceptor_.native_handle(), options_.what), file_.dup_handle()};
  boost::system::error_code ignored;
  acceptor_.cancel(ignored);
  retry_.cancel();
  paused_ = true;
  return h;
}

void UnixListener::resume() {
  if (!std::exchange(paused_, false)) return;
  for (auto& fd : std::exchange(held_, {})) admit_or_refuse(std::move(fd));
  accept_next();
}

UnixListener::~UnixListener() {
  boost::system::error_code ignored;
  retry_.cancel();
  acceptor_.close(ignored);
  file_.remove();
}

void UnixListener::accept_next() {
  acceptor_.async_accept([this](boost::system::error_code ec, stream::socket socket) {
    if (ec == asio::error::operation_aborted) return;  // the listener is gone: touch nothing
    if (ec) {
      accept_later(ec);  // EMFILE and the like: this peer waits, the socket stays
      return;
    }
    if (std::exchange(failing_, false))
      spdlog::info("{}: accepting again ({} failed accepts meanwhile)", options_.what, accept_failures_);
    UniqueFd fd(socket.release());
    if (paused_) {  // accepted just before a handover paused the listener: admitted if it resumes
      held_.push_back(std::move(fd));
      return;
    }
    admit_or_refuse(std::move(fd));
    accept_next();
  });
}

void UnixListener::admit_or_refuse(UniqueFd fd) {
  const std::optional<ucred> peer = peer_credentials(fd.get());
  std::string why = peer_refusal(peer, options_.allowed_uids, options_.list);
  if (why.empty() && busy_ && busy_())
    why = "refused " + options_.busy_refusal + " (pid " + std::to_string(peer->pid) + ")";
  if (why.empty()) {
    ++accepted_;
    admit_(std::move(fd), *peer);
  } else {
    ++refused_;
    last_refusal_ = why;
    spdlog::warn("{}: {}", options_.what, why);
    if (refuse_) refuse_(std::move(fd), why);
  }
}

void UnixListener::accept_later(const boost::system::error_code& why) {
  ++accept_failures_;
  if (!std::exchange(failing_, true))
    spdlog::error("{}: accept failed: {}; trying again every {} ms", options_.what, why.message(),
                  kAcceptRetry.count());
  retry_.expires_after(kAcceptRetry);
  retry_.async_wait([this](boost::system::error_code ec) {
    if (!ec) accept_next();
  });
}

// ---- FramedReader ---------------------------------------------------------

FramedReader::FramedReader(size_t header_size, size_t max_fds, PayloadSize payload_size)
    : header_(header_size), max_fds_(max_fds), payload_size_(std::move(payload_size)), ahead_(kReadAhead) {}

FramedReader::Status FramedReader::read(int fd) {
  for (;;) {
    uint8_t* to;
    size_t want;
    if (!header_done_) {
      to = header_.data() + got_;
      want = header_.size() - got_;
    } else {
      const size_t at = got_ - header_.size();
      to = payload_.data() + at;
      want = payload_.size() - at;
    }
    if (want > 0 && ahead_pos_ < ahead_end_) {
      const size_t n = std::min(want, ahead_end_ - ahead_pos_);
      std::memcpy(to, ahead_.data() + ahead_pos_, n);
      ahead_pos_ += n;
      got_ += n;
    } else if (want > 0) {
      // Nothing read ahead: a large rest goes straight into place, else
      // as much as the socket holds is read ahead.
      const bool direct = want >= ahead_.size();
      uint8_t* into = direct ? to : ahead_.data();
      const size_t room = direct ? want : ahead_.size();
      bool truncated = false;
      incoming_.clear();
      ++reads_;
      const ssize_t n = recv_with_fds(fd, into, room, incoming_, MSG_DONTWAIT, truncated, max_fds_);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Status::again;
      if (n < 0) throw_errno("reading from the peer");
      if (n == 0) return Status::closed;
      if (truncated) throw FramingError("more than " + std::to_string(max_fds_) + " fds with one message");
      received_ += static_cast<size_t>(n);
      if (!incoming_.empty()) {
        // Read only when nothing is read ahead: every byte read so far
        // belongs to the message being framed or one before it, so the
        // fds still waiting are all for this message (a peer that trickles
        // a message with fds on every part is stopped at the cap).
        size_t held = fds_.size() + incoming_.size();
        for (const Arrived& w : arrived_) held += w.fds.size();
        if (held > max_fds_) throw FramingError("more than " + std::to_string(max_fds_) + " fds with one message");
        Arrived a{received_ - 1, {}};
        a.fds.swap(incoming_);
        arrived_.push_back(std::move(a));
      }
      if (direct) {
        got_ += static_cast<size_t>(n);
      } else {
        ahead_pos_ = 0;
        ahead_end_ = static_cast<size_t>(n);
      }
      continue;
    }
    if (!header_done_) {
      if (got_ < header_.size()) continue;
      payload_.resize(payload_size_(header_));
      header_done_ = true;
    }
    if (got_ == header_.size() + payload_.size()) {
      attach_fds();
      return Status::message;
    }
  }
}

// The fds whose read ended inside this message are its own.
void FramedReader::attach_fds() {
  if (arrived_.empty()) return;
  const uint64_t end = msg_start_ + got_;
  size_t used = 0;
  for (Arrived& a : arrived_) {
    if (a.last >= end) break;
    if (fds_.size() + a.fds.size() > max_fds_)
      throw FramingError("more than " + std::to_string(max_fds_) + " fds with one message");
    for (UniqueFd& f : a.fds) fds_.push_back(std::move(f));
    ++used;
  }
  arrived_.erase(arrived_.begin(), arrived_.begin() + static_cast<std::ptrdiff_t>(used));
}

void FramedReader::take(std::span<uint8_t> header, std::vector<uint8_t>& payload, std::vector<UniqueFd>& fds) {
  std::copy_n(header_.begin(), std::min(header.size(), header_.size()), header.begin());
  payload.swap(payload_);
  fds.swap(fds_);
  next_message();
}

std::vector<uint8_t> FramedReader::unframed() const {
  std::vector<uint8_t> out;
  out.reserve(bytes());
  const size_t in_header = std::min(got_, header_.size());
  out.insert(out.end(), header_.begin(), header_.begin() + static_cast<std::ptrdiff_t>(in_header));
  if (got_ > header_.size())
    out.insert(out.end(), payload_.begin(), payload_.begin() + static_cast<std::ptrdiff_t>(got_ - header_.size()));
  out.insert(out.end(), ahead_.begin() + static_cast<std::ptrdiff_t>(ahead_pos_),
             ahead_.begin() + static_cast<std::ptrdiff_t>(ahead_end_));
  return out;
}

void FramedReader::prefill(std::span<const uint8_t> bytes) {
  reset();
  if (bytes.size() > ahead_.size()) ahead_.resize(bytes.size());
  std::memcpy(ahead_.data(), bytes.data(), bytes.size());
  ahead_end_ = bytes.size();
  received_ = bytes.size();
}

void FramedReader::next_message() {
  msg_start_ += got_;
  payload_.clear();
  fds_.clear();
  got_ = 0;
  header_done_ = false;
}

void FramedReader::reset() {
  next_message();
  ahead_pos_ = ahead_end_ = 0;
  msg_start_ = received_ = 0;
  arrived_.clear();
}

// ---- PeerConnection -------------------------------------------------------

namespace {
// A peer's turn: at most this many messages, and no new one after this
// long, before the other work on the io_context (the thread's other
// sessions) gets its turn. A peer that sends without pause cannot starve
// the others: a request of another session on the thread waits at most
// one turn per busy session, plus the message each was in.
constexpr int kMessagesPerTurn = 64;
constexpr std::chrono::microseconds kTurn{20};
}  // namespace

PeerConnection::PeerConnection(asio::io_context& io, FramedReader reader, std::chrono::milliseconds message_deadline,
                               OnMessage on_message, OnEnd on_end, OnIdle on_idle)
    : io_(io),
      reader_(std::move(reader)),
      deadline_(message_deadline),
      on_message_(std::move(on_message)),
      on_end_(std::move(on_end)),
      on_idle_(std::move(on_idle)),
      timer_(io),
      drain_timer_(io) {}

PeerConnection::~PeerConnection() { close(); }

void PeerConnection::adopt(UniqueFd fd) {
  close();
  limit_send_wait(fd.get());
  fd_ = std::move(fd);
  ++message_seq_;
  ++generation_;
  watch_ = std::make_unique<asio::posix::stream_descriptor>(io_, fd_.get());
  wait_readable();
}

void PeerConnection::wait_readable() {
  if (read_armed_) return;  // one wait at a time (a continuation may come first)
  read_armed_ = true;
  watch_->async_wait(asio::posix::stream_descriptor::wait_read,
                     [this, gen = generation_](boost::system::error_code ec) {
                       if (ec) return;  // cancelled: the connection (or this object) is gone
                       if (gen != generation_) return;
                       read_armed_ = false;
                       on_readable();
                     });
}

// Behind whatever the thread's next look at its sockets finds ready: a
// post from here would run before a session that became ready meanwhile
// (the scheduler looks at the sockets once per pass over its queue), so
// the continuation is posted from a post, which runs after that look. A
// quiet session waits for one turn of each busy one, not two.
void PeerConnection::continue_later() {
  asio::post(io_, [this, gen = generation_] {
    if (gen != generation_) return;
    asio::post(io_, [this, gen] {
      if (gen == generation_ && fd_) on_readable();
    });
  });
}

void PeerConnection::on_readable() {
  if (frozen_) return;
  const int fd = fd_.get();
  const auto turn_ends = std::chrono::steady_clock::now() + kTurn;
  bool more = true;  // the turn ended with the peer's stream not drained
  try {
    for (int handled = 0; fd_.get() == fd; ++handled) {
      if (handled == kMessagesPerTurn || (handled > 0 && std::chrono::steady_clock::now() >= turn_ends)) break;
      if (!queue_.empty()) {  // replies the peer has not read: its requests wait
        read_paused_ = true;
        return;
      }
      const FramedReader::Status s = reader_.read(fd);
      if (s == FramedReader::Status::closed) {
        end(kPeerClosed, EndCause::peer_closed);
        return;
      }
      if (s == FramedReader::Status::again) {
        if (reader_.partial()) arm_deadline();
        if (on_idle_) on_idle_();
        more = false;
        break;
      }
      message_done();
      on_message_(reader_);
    }
    // The turn is over with more to read (read ahead, or in the socket):
    // it comes back after the other handlers' turn, whether or not the
    // socket has anything new to wake it for.
    if (more && fd_.get() == fd) {
      if (queue_.empty())
        continue_later();
      else
        read_paused_ = true;  // the queue's drain resumes it (flush)
      return;
    }
  } catch (const FramingError& e) {
    if (fd_.get() == fd) end(e.what(), EndCause::framing);
    return;
  } catch (const std::exception& e) {
    if (fd_.get() == fd) end(e.what(), EndCause::local);
    return;
  }
  if (fd_.get() == fd && watch_) wait_readable();
}

// The deadline that runs belongs to the message just completed.
void PeerConnection::message_done() {
  ++message_seq_;
  if (!timer_armed_) return;  // the common case: a message that came whole costs no timer
  timer_armed_ = false;
  timer_.cancel();
}

void PeerConnection::arm_deadline() {
  if (timer_armed_) return;
  timer_armed_ = true;
  timer_.expires_after(deadline_);
  timer_.async_wait([this, seq = message_seq_](boost::system::error_code ec) {
    if (ec) return;
    if (seq != message_seq_ || !fd_ || !reader_.partial()) return;
    end("a message was not complete within " + std::to_string(deadline_.count()) + " ms (" +
            std::to_string(reader_.bytes()) + " of " + std::to_string(reader_.expected()) + " bytes)",
        EndCause::framing);
  });
}

void PeerConnection::send(std::span<const iovec> iov, std::span<const int> fds) {
  if (!fd_) throw std::runtime_error("the connection ended");
  size_t total = 0;
  for (const iovec& v : iov) total += v.iov_len;
  size_t sent = 0;
  if (queue_.empty()) {
    const ssize_t n = send_with_fds(fd_.get(), iov, fds, MSG_DONTWAIT);
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) throw SystemError(errno, "sending to the peer");
    if (n == static_cast<ssize_t>(total)) return;
    sent = n > 0 ? static_cast<size_t>(n) : 0;
  }
  if (queued_bytes_ + (total - sent) > kMaxQueuedBytes)
    throw std::runtime_error("the peer does not read what it is sent (" + std::to_string(queued_bytes_) +
                             " bytes wait for it, " + std::to_string(total - sent) + " more would pass the " +
                             std::to_string(kMaxQueuedBytes) + " a peer may have waiting)");
  Queued q;
  q.bytes.reserve(total - sent);
  size_t skip = sent;
  for (const iovec& v : iov) {
    const auto* p = static_cast<const uint8_t*>(v.iov_base);
    const size_t take = std::min(skip, v.iov_len);
    q.bytes.insert(q.bytes.end(), p + take, p + v.iov_len);
    skip -= take;
  }
  if (sent == 0)
    for (const int fd : fds) {
      UniqueFd copy(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
      if (!copy) throw SystemError(errno, "keeping an fd for a queued message");
      q.fds.push_back(std::move(copy));
    }
  queued_bytes_ += q.bytes.size();
  queue_.push_back(std::move(q));
  if (queue_.size() == 1) {
    // Each wait is for the queue begun now: a wait that completed as the
    // queue drained must not end the next one (a cancel cannot stop it then).
    drain_timer_.expires_after(deadline_);
    drain_timer_.async_wait([this, seq = ++drain_seq_](boost::system::error_code ec) {
      if (ec || queue_.empty() || seq != drain_seq_) return;
      end("the peer did not read what it was sent within " + std::to_string(deadline_.count()) + " ms (" +
          std::to_string(queued_bytes_) + " bytes wait)");
    });
  }
  wait_writable();
}

void PeerConnection::wait_writable() {
  if (write_armed_ || !watch_) return;
  write_armed_ = true;
  watch_->async_wait(asio::posix::stream_descriptor::wait_write, [this](boost::system::error_code ec) {
    write_armed_ = false;
    if (ec) return;  // cancelled: the connection (or this object) is gone
    flush();
  });
}

void PeerConnection::flush() {
  while (!queue_.empty()) {
    Queued& q = queue_.front();
    const iovec v{q.bytes.data() + q.sent, q.bytes.size() - q.sent};
    std::vector<int> raw;
    for (const UniqueFd& f : q.fds) raw.push_back(f.get());
    const ssize_t n = send_with_fds(fd_.get(), std::span<const iovec>(&v, 1), raw, MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wait_writable();
        return;
      }
      end(std::string("sending to the peer: ") + std::strerror(errno));
      return;
    }
    q.fds.clear();  // they went with the first byte
    q.sent += static_cast<size_t>(n);
    queued_bytes_ -= static_cast<size_t>(n);
    if (q.sent == q.bytes.size()) queue_.pop_front();
  }
  drain_timer_.cancel();
  ++drain_seq_;
  if (read_paused_ && watch_ && !frozen_) {
    read_paused_ = false;
    on_readable();  // what came meanwhile may be in the socket already
  }
}

PeerConnection::Frozen PeerConnection::freeze() {
  if (!fd_) throw std::runtime_error("no connection");
  if (!queue_.empty())
    throw std::runtime_error(std::to_string(queued_bytes_) + " bytes of replies not taken by the peer yet");
  if (reader_.holds_fds()) throw std::runtime_error("fds of a message not handled yet");
  Frozen f{dup_fd(fd_.get(), "a peer's connection"), reader_.unframed()};
  boost::system::error_code ignored;
  if (watch_) watch_->cancel(ignored);
  read_armed_ = false;
  timer_.cancel();
  timer_armed_ = false;
  ++message_seq_;
  ++generation_;  // a posted continuation does nothing
  frozen_ = true;
  return f;
}

void PeerConnection::thaw() {
  if (!frozen_) return;
  frozen_ = false;
  if (!fd_ || !watch_) return;
  if (reader_.partial()) arm_deadline();
  if (reader_.buffered()) continue_later();
  if (!read_paused_) wait_readable();
}

void PeerConnection::adopt(UniqueFd fd, std::span<const uint8_t> unframed) {
  adopt(std::move(fd));
  if (unframed.empty()) return;
  reader_.prefill(unframed);
  arm_deadline();
  continue_later();
}

bool PeerConnection::settle_if_closed() {
  if (!fd_) return true;
  pollfd p{fd_.get(), POLLRDHUP, 0};
  if (::poll(&p, 1, 0) != 1 || !(p.revents & (POLLRDHUP | POLLHUP | POLLERR))) return false;
  // What is left is finite (the socket's buffer and what was read ahead):
  // turn after turn until its end, unless replies wait for a peer that
  // still reads (a half close).
  for (int turns = 0; fd_ && !read_paused_ && turns < 4096; ++turns) on_readable();
  return !fd_;
}

bool PeerConnection::read_blocking(std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    const FramedReader::Status s = reader_.read(fd_.get());
    if (s == FramedReader::Status::message) {
      message_done();
      // What came after the answer was read ahead with it: served after
      // the caller's handler, even if the socket has nothing new.
      if (reader_.buffered()) continue_later();
      return true;
    }
    if (s == FramedReader::Status::closed) return false;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    pollfd p{fd_.get(), POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) == 0)
      throw FramingError("no answer within " + std::to_string(deadline_.count()) + " ms (" +
                         std::to_string(reader_.bytes()) + " bytes of it came)");
  }
}

void PeerConnection::end(const std::string& why, EndCause cause) {
  if (!fd_ || ending_) return;
  ending_ = true;
  try {
    on_end_(why, cause);
  } catch (const std::exception& e) {
    spdlog::error("ending a peer's connection: {}", e.what());
  }
  ending_ = false;
  close();
}

void PeerConnection::close() {
  boost::system::error_code ignored;
  timer_.cancel();
  timer_armed_ = false;
  drain_timer_.cancel();
  ++drain_seq_;
  queue_.clear();
  queued_bytes_ = 0;
  read_paused_ = false;
  frozen_ = false;
  write_armed_ = false;
  read_armed_ = false;
  ++message_seq_;
  if (watch_) {
    watch_->cancel(ignored);
    (void)watch_->release();  // the fd is fd_'s
    watch_.reset();
  }
  reader_.reset();
  fd_.reset();
  ++generation_;
}

uint32_t freeze_connection(PeerConnection& conn, HandedFds& fds, std::vector<uint8_t>& unframed) {
  if (!conn.connected()) return HandedFds::kNoFd;
  try {
    PeerConnection::Frozen f = conn.freeze();
    unframed = std::move(f.unframed);
    return fds.add_fd(std::move(f.fd));
  } catch (const std::exception& e) {
    throw HandoverRefused(std::string("its connection: ") + e.what());
  }
}

}  // namespace sriovd
