#include "sriovd/vfio_user/migration.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include <spdlog/spdlog.h>

#include "sriovd/util/log_limit.hpp"
#include "sriovd/util/hex.hpp"
#include "sriovd/virtio/guest_memory.hpp"

namespace sriovd::vfio_user {

const char* mig_state_name(uint32_t state) {
  switch (state) {
    case 0: return "ERROR";
    case 1: return "STOP";
    case 2: return "RUNNING";
    case 3: return "STOP_COPY";
    case 4: return "RESUMING";
    case 5: return "RUNNING_P2P";
    case 6: return "PRE_COPY";
    case 7: return "PRE_COPY_P2P";
    default: return "unknown";
  }
}

// --- DmaLog ---

namespace {

std::string range_text(uint64_t iova, uint64_t length) { return "[" + hex(iova) + ", +" + hex(length) + ")"; }

}  // namespace

DmaLog::DmaLog(std::span<const DmaRange> ranges, const virtio::GuestMemory& memory)
    : ranges_(ranges.begin(), ranges.end()) {
  if (ranges_.empty()) throw Error(EINVAL, "DMA logging of no range");
  if (ranges_.size() > kMaxRanges)
    throw Error(EINVAL, "DMA logging of " + std::to_string(ranges_.size()) + " ranges (at most " +
                            std::to_string(kMaxRanges) + ")");
  std::sort(ranges_.begin(), ranges_.end(), [](const DmaRange& a, const DmaRange& b) { return a.iova < b.iova; });
  for (size_t i = 0; i < ranges_.size(); ++i) {
    const DmaRange& r = ranges_[i];
    const std::string what = "DMA logging range " + range_text(r.iova, r.length);
    if (r.length == 0 || r.iova + r.length < r.iova) throw Error(EINVAL, what + ": empty or wrapping");
    if ((r.iova | r.length) % kPage) throw Error(EINVAL, what + " is not aligned to " + std::to_string(kPage));
    if (i > 0 && ranges_[i - 1].iova + ranges_[i - 1].length > r.iova)
      throw Error(EINVAL, what + " overlaps " + range_text(ranges_[i - 1].iova, ranges_[i - 1].length));
  }
  base_ = ranges_.front().iova;
  const uint64_t span = ranges_.back().iova + ranges_.back().length - base_;
  if (span > kMaxSpan)
    throw Error(EINVAL, "DMA logging ranges spanning " + hex(span) + " bytes from " + hex(base_) + " (at most " +
                            hex(kMaxSpan) + ")");
  bytes_ = (span / kPage + 7) / 8;
  // Reserved, not committed: only the pages of the bitmap a write marks
  // (or a report clears) are ever backed.
  void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    throw Error(ENOMEM, "a DMA log of " + std::to_string(bytes_) + " bytes: " + std::strerror(errno));
  bits_ = static_cast<uint8_t*>(p);
  log_.emplace(bits_, bytes_, memory, base_);
}

DmaLog::~DmaLog() {
  log_.reset();
  if (bits_) ::munmap(bits_, bytes_);
}

bool DmaLog::tracks(uint64_t iova, uint64_t size) const {
  for (const DmaRange& r : ranges_)
    if (iova >= r.iova && size <= r.length && iova - r.iova <= r.length - size) return true;
  return false;
}

uint64_t DmaLog::report_words(uint64_t length, uint64_t page_size) {
  const uint64_t bits = length / page_size + (length % page_size ? 1 : 0);
  return (bits + 63) / 64;
}

void DmaLog::report(uint64_t iova, uint64_t length, uint64_t page_size, std::span<uint64_t> bitmap) {
  const std::string what = "DMA logging report of " + range_text(iova, length);
  if (page_size == 0 || (page_size & (page_size - 1)) != 0)
    throw Error(EINVAL, what + ": page size " + std::to_string(page_size) + " is not a power of two");
  if (length == 0 || (iova | length) % kPage) throw Error(EINVAL, what + ": empty or not aligned to 4096");
  if (!tracks(iova, length)) throw Error(EINVAL, what + ": not inside one logged range");
  if (bitmap.size() != report_words(length, page_size)) throw std::logic_error(what + ": bitmap of the wrong size");
  const uint64_t first = (iova - base_) / kPage;
  const uint64_t pages = length / kPage;
  // Only the bitmap's pages that a mark ever touched are read: the others
  // are not resident (never written, MAP_NORESERVE) and hold no bit. So a
  // report costs what the device wrote, not the range the client claims
  // (a client that logs 8 TiB and asks for all of it in a loop held the
  // control thread 0.4 s per report).
  const uint64_t lo = first / 8, hi = (first + pages - 1) / 8;  // bitmap bytes
  const uint64_t page_lo = lo & ~(kBitmapPage - 1);
  const uint64_t bitmap_pages = (hi - page_lo) / kBitmapPage + 1;
  resident_.resize(bitmap_pages);
  if (::mincore(bits_ + page_lo, hi + 1 - page_lo, resident_.data()) != 0)
    throw Error(EIO, what + ": mincore of the log: " + std::strerror(errno));
  for (uint64_t i = 0; i < bitmap_pages; ++i) {
    if (!(resident_[i] & 1U)) continue;
    const uint64_t from = std::max(lo, page_lo + i * kBitmapPage);
    const uint64_t to = std::min(hi, page_lo + (i + 1) * kBitmapPage - 1);
    scanned_bytes_ += to - from + 1;
    report_bytes(from, to, first, pages, page_size, bitmap);
  }
}

// The marks in bitmap bytes [from, to] of the pages [first, first + pages),
// moved into `bitmap` (report units of page_size from page `first`).
void DmaLog::report_bytes(uint64_t from, uint64_t to, uint64_t first, uint64_t pages, uint64_t page_size,
                          std::span<uint64_t> bitmap) {
  for (uint64_t page = std::max(first, from * 8); page < first + pages && page / 8 <= to;) {
    const uint64_t byte = page / 8;
    const uint64_t end = std::min(first + pages - 1, byte * 8 + 7);
    const auto mask = static_cast<uint8_t>(((1U << (end - page + 1)) - 1U) << (page % 8));
    std::atomic_ref<uint8_t> cell(bits_[byte]);
    // Untouched bitmap pages stay unbacked: only a marked byte is written.
    uint8_t got = cell.load(std::memory_order_relaxed) & mask;
    if (got) got = cell.fetch_and(static_cast<uint8_t>(~mask), std::memory_order_acquire) & mask;
    for (unsigned b = 0; got; ++b, got >>= 1U) {
      if (!(got & 1U)) continue;
      // The tracked page's bytes, relative to iova, in report units.
      const uint64_t at = (byte * 8 + b - first) * kPage;
      for (uint64_t unit = at / page_size; unit <= (at + kPage - 1) / page_size; ++unit)
        bitmap[unit / 64] |= 1ULL << (unit % 64);
    }
    page = end + 1;
  }
}

// --- Migration ---

Migration::~Migration() {
  if (log_) {
    try {
      device_.set_dma_log(nullptr);
    } catch (...) {
    }
  }
}

void Migration::arc(MigState to) {
  const MigState from = state_;
  try {
    switch (to) {
      case MigState::stop:
        if (from == MigState::running) device_.mig_stop();
        if (from == MigState::resuming) {
          try {
            device_.mig_load(stream_);
          } catch (const std::invalid_argument& e) {
            ++stats_.refused_loads;
            throw Error(EINVAL, std::string("the migration data does not load: ") + e.what());
          }
          stats_.loaded_bytes += stream_.size();
        }
        stream_.clear();
        stream_.shrink_to_fit();
        read_at_ = 0;
        break;
      case MigState::running: device_.mig_run(); break;
      case MigState::stop_copy:
        stream_ = device_.mig_save();
        read_at_ = 0;
        break;
      case MigState::resuming:
        device_.mig_prepare_resume();
        stream_.clear();
        read_at_ = 0;
        break;
      case MigState::error: throw std::logic_error("an arc to ERROR");
    }
  } catch (const Error&) {
    throw;  // refused, nothing changed: the state stays
  } catch (const std::exception& e) {
    state_ = MigState::error;
    spdlog::error("vfio-user: {}: migration {} -> {} failed, the device is in ERROR until reset: {}", name_,
                  mig_state_name(static_cast<uint32_t>(from)), mig_state_name(static_cast<uint32_t>(to)), e.what());
    throw Error(EIO, std::string(mig_state_name(static_cast<uint32_t>(from))) + " -> " +
                         mig_state_name(static_cast<uint32_t>(to)) + " failed: " + e.what());
  }
  state_ = to;
  ++stats_.transitions;
  log_limited(log_limits_.state, spdlog::level::info, "vfio-user: {}: migration state {} -> {}", name_,
              mig_state_name(static_cast<uint32_t>(from)), mig_state_name(static_cast<uint32_t>(to)));
}

void Migration::set_state(uint32_t target) {
  if (target < static_cast<uint32_t>(MigState::stop) || target > static_cast<uint32_t>(MigState::resuming))
    throw Error(EINVAL, std::string("migration state ") + std::to_string(target) + " (" + mig_state_name(target) +
                            "): this device has STOP, RUNNING, STOP_COPY and RESUMING");
  if (state_ == MigState::error)
    throw Error(EINVAL, std::string("migration state ") + mig_state_name(target) +
                            " asked for in ERROR: only DEVICE_RESET leaves it");
  const auto to = static_cast<MigState>(target);
  // Every combination goes through STOP (linux/vfio.h: the shortest path,
  // no saving state inside it).
  if (state_ != to && state_ != MigState::stop && to != MigState::stop) arc(MigState::stop);
  if (state_ != to) arc(to);
}

size_t Migration::read(std::span<uint8_t> out) {
  if (state_ != MigState::stop_copy)
    throw Error(EINVAL, std::string("MIG_DATA_READ in ") + mig_state_name(static_cast<uint32_t>(state_)) +
                            " (the data is read in STOP_COPY)");
  const size_t n = std::min(out.size(), stream_.size() - read_at_);
  std::memcpy(out.data(), stream_.data() + read_at_, n);
  read_at_ += n;
  stats_.saved_bytes += n;
  return n;
}

void Migration::write(std::span<const uint8_t> in) {
  if (state_ != MigState::resuming)
    throw Error(EINVAL, std::string("MIG_DATA_WRITE in ") + mig_state_name(static_cast<uint32_t>(state_)) +
                            " (the data is written in RESUMING)");
  if (in.size() > kMaxStream - stream_.size())
    throw Error(EFBIG, "MIG_DATA_WRITE past " + std::to_string(kMaxStream) + " bytes of migration data");
  stream_.insert(stream_.end(), in.begin(), in.end());
}

void Migration::device_reset() {
  state_ = MigState::running;
  stream_.clear();
  stream_.shrink_to_fit();
  read_at_ = 0;
}

void Migration::client_gone() {
  device_reset();
  stop_logging();
}

uint64_t Migration::start_logging(uint64_t page_size, std::span<const DmaRange> ranges) {
  if (log_) throw Error(EBUSY, "DMA logging is on already (DMA_LOGGING_STOP first)");
  if (page_size == 0 || (page_size & (page_size - 1)) != 0)
    throw Error(EINVAL, "DMA logging page size " + std::to_string(page_size) + " is not a power of two");
  auto log = std::make_unique<DmaLog>(ranges, device_.dma_memory());
  device_.set_dma_log(&log->log());
  log_ = std::move(log);
  ++stats_.dma_log_starts;
  log_limited(log_limits_.logging, spdlog::level::info,
              "vfio-user: {}: DMA logging on ({} range(s) from {}, a live migration)", name_, log_->ranges().size(),
              hex(log_->ranges().front().iova));
  return DmaLog::kPage;
}

void Migration::report(uint64_t iova, uint64_t length, uint64_t page_size, std::span<uint64_t> bitmap) {
  if (!log_) throw Error(EINVAL, "DMA logging report: DMA logging is not on");
  log_->report(iova, length, page_size, bitmap);
  ++stats_.dma_log_reports;
}

void Migration::stop_logging() {
  if (!log_) return;
  device_.set_dma_log(nullptr);  // the workers stopped and restarted without it: nothing marks it now
  log_.reset();
  log_limited(log_limits_.logging, spdlog::level::info, "vfio-user: {}: DMA logging off", name_);
}

}  // namespace sriovd::vfio_user
