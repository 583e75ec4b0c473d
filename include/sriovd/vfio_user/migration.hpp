#pragma once
// Live migration of an exported device over vfio-user (the protocol's
// VFIO_USER_DEVICE_FEATURE with MIGRATION, MIG_DEVICE_STATE and the DMA
// logging features; MIG_DATA_READ/WRITE in place of VFIO's data_fd).
//
// Migration is the device state machine of linux/vfio.h with STOP_COPY
// (RUNNING, STOP, STOP_COPY, RESUMING, ERROR): the server asks for a state,
// this walks the arcs to it (every path here goes through STOP) and calls
// the device on each. STOP -> STOP_COPY takes the device's state as one
// stream the client reads; STOP -> RESUMING starts a stream the client
// writes, which RESUMING -> STOP checks whole and loads (a stream that does
// not parse fails that arc and changes nothing). An arc the device cannot
// finish (a worker that does not stop) leaves ERROR, which DEVICE_RESET
// ends.
//
// DmaLog is the device's DMA dirty tracking (DMA_LOGGING_START/REPORT/
// STOP): a bitmap the server owns over the IOVA ranges the client names,
// marked by the device through the same virtio::DirtyLog as vhost-user's,
// read and cleared by REPORT. The bitmap is anonymous memory reserved for
// the whole span and touched only where pages are written.

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "sriovd/util/log_limit.hpp"
#include "sriovd/util/counters.hpp"
#include "sriovd/virtio/dirty_log.hpp"
#include "sriovd/vfio_user/protocol.hpp"

namespace sriovd::virtio {
class GuestMemory;
}

namespace sriovd::vfio_user {

// enum vfio_device_mig_state (linux/vfio.h); only the first five are
// served (no P2P, no PRE_COPY).
enum class MigState : uint32_t { error = 0, stop = 1, running = 2, stop_copy = 3, resuming = 4 };
const char* mig_state_name(uint32_t state);

// What a device does on the arcs (virtio-net-pci: VirtioPci). Each throws
// Error for a request it refuses with nothing changed, anything else for
// an arc it could not finish.
class Migratable {
 public:
  virtual ~Migratable() = default;
  // RUNNING -> STOP: no DMA, no interrupt, no change of internal state;
  // region accesses are still served (config space, MSI-X).
  virtual void mig_stop() = 0;
  // STOP -> RUNNING: on from where it stood (a loaded state: from there).
  virtual void mig_run() = 0;
  // STOP -> STOP_COPY: the whole state, the device stopped.
  virtual std::vector<uint8_t> mig_save() = 0;
  // STOP -> RESUMING: ready to take a state (a driver's state dropped).
  virtual void mig_prepare_resume() = 0;
  // RESUMING -> STOP: the stream, checked whole before anything changes
  // (std::invalid_argument names what is wrong).
  virtual void mig_load(std::span<const uint8_t> data) = 0;
  // The memory the device writes through (what a DmaLog's marks by host
  // pointer are resolved against), and the log to mark (null: none).
  // Installed with the device's workers stopped.
  [[nodiscard]] virtual const virtio::GuestMemory& dma_memory() const = 0;
  virtual void set_dma_log(const virtio::DirtyLog* log) = 0;
};

class DmaLog {
 public:
  static constexpr uint64_t kPage = virtio::DirtyLog::kPage;  // the page tracked (what START answers)
  static constexpr uint64_t kMaxSpan = 1ULL << 43U;           // 8 TiB: a 256 MiB bitmap reserved at most
  static constexpr uint32_t kMaxRanges = 1024;
  // Throws Error(EINVAL) naming the range: empty, wrapping, not page
  // aligned, overlapping another, or a span past kMaxSpan.
  DmaLog(std::span<const DmaRange> ranges, const virtio::GuestMemory& memory);
  ~DmaLog();
  DmaLog(const DmaLog&) = delete;
  DmaLog& operator=(const DmaLog&) = delete;

  [[nodiscard]] const virtio::DirtyLog& log() const { return *log_; }
  [[nodiscard]] const std::vector<DmaRange>& ranges() const { return ranges_; }
  // Whether [iova, +size) lies inside one tracked range.
  [[nodiscard]] bool tracks(uint64_t iova, uint64_t size) const;
  // Sets the bits of the pages written in [iova, +length) in `bitmap` (one
  // bit per page_size unit from iova; bits are only set, never cleared) and
  // clears them here. Throws Error(EINVAL) for a range not inside one
  // tracked range, not page aligned, or a page_size that is not a power of
  // two; `bitmap` must have report_words() words.
  void report(uint64_t iova, uint64_t length, uint64_t page_size, std::span<uint64_t> bitmap);
  static uint64_t report_words(uint64_t length, uint64_t page_size);
  // Bitmap bytes the reports read so far: those of bitmap pages a mark
  // touched, never the whole claimed range.
  [[nodiscard]] uint64_t scanned_bytes() const { return scanned_bytes_; }

 private:
  static constexpr uint64_t kBitmapPage = 4096;
  void report_bytes(uint64_t from, uint64_t to, uint64_t first, uint64_t pages, uint64_t page_size,
                    std::span<uint64_t> bitmap);
  std::vector<unsigned char> resident_;  // mincore's answer (kept: no allocation per report)
  uint64_t scanned_bytes_ = 0;
  std::vector<DmaRange> ranges_;
  uint64_t base_ = 0;
  uint8_t* bits_ = nullptr;
  uint64_t bytes_ = 0;
  std::optional<virtio::DirtyLog> log_;
};

struct MigrationStats {
  uint64_t transitions = 0;     // arcs walked
  uint64_t saved_bytes = 0;     // device state read out (STOP_COPY)
  uint64_t loaded_bytes = 0;    // device state loaded (RESUMING -> STOP)
  uint64_t refused_loads = 0;   // streams that did not parse or fit
  uint64_t dma_log_starts = 0;  // DMA_LOGGING_START taken
  uint64_t dma_log_reports = 0;
};

inline constexpr Counter<MigrationStats> kMigrationCounters[] = {
    {"transitions", "live migration state changes (arcs walked)", &MigrationStats::transitions},
    {"saved_bytes", "device state bytes read out by the client (STOP_COPY)", &MigrationStats::saved_bytes},
    {"loaded_bytes", "device state bytes loaded (RESUMING)", &MigrationStats::loaded_bytes},
    {"refused_loads", "migration streams that did not load", &MigrationStats::refused_loads},
    {"dma_log_starts", "DMA dirty logging started", &MigrationStats::dma_log_starts},
    {"dma_log_reports", "DMA dirty page reports read", &MigrationStats::dma_log_reports},
};

class Migration {
 public:
  static constexpr size_t kMaxStream = 64U << 20U;  // a state written (RESUMING) larger than this is refused
  Migration(Migratable& device, std::string name) : device_(device), name_(std::move(name)) {}
  ~Migration();
  Migration(const Migration&) = delete;
  Migration& operator=(const Migration&) = delete;

  [[nodiscard]] MigState state() const { return state_; }
  // MIG_DEVICE_STATE SET: to `target` through the arcs. Throws Error:
  // EINVAL for a state not served or a stream that does not load (the
  // state stays where the failed arc began), EIO when the device could not
  // finish an arc (the state is then ERROR).
  void set_state(uint32_t target);
  // MIG_DATA_READ: up to out.size() bytes of the stream; fewer is its end.
  size_t read(std::span<uint8_t> out);
  // MIG_DATA_WRITE.
  void write(std::span<const uint8_t> in);
  // DEVICE_RESET (the device reset already): RUNNING, no stream. DMA
  // logging goes on (a guest that resets its NIC during a migration).
  void device_reset();
  // The client left: RUNNING, no stream, no DMA log.
  void client_gone();

  // DMA_LOGGING_START: EBUSY while one runs. Returns the page size used.
  uint64_t start_logging(uint64_t page_size, std::span<const DmaRange> ranges);
  void stop_logging();
  [[nodiscard]] DmaLog* dma_log() { return log_.get(); }
  [[nodiscard]] const DmaLog* dma_log() const { return log_.get(); }
  // DMA_LOGGING_REPORT (DmaLog::report, counted): EINVAL when no log runs.
  void report(uint64_t iova, uint64_t length, uint64_t page_size, std::span<uint64_t> bitmap);
  [[nodiscard]] const MigrationStats& stats() const { return stats_; }

 private:
  void arc(MigState to);
  Migratable& device_;
  std::string name_;
  struct {
    LogLimit state, logging;  // a client can change both at will
  } log_limits_;
  MigState state_ = MigState::running;
  std::vector<uint8_t> stream_;  // STOP_COPY: what is left to read; RESUMING: what was written
  size_t read_at_ = 0;
  std::unique_ptr<DmaLog> log_;
  MigrationStats stats_;
};

}  // namespace sriovd::vfio_user
