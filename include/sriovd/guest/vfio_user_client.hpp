#pragma once
// A vfio-user client: what a VMM does on the other end of an export. Used
// by sriovd-guest, the tests, the benchmarks and the demo. Blocking, one
// request at a time; while it waits for a reply it serves the server's
// DMA_READ/WRITE from the windows it shared without an fd.

#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sriovd/util/fd.hpp"
#include "sriovd/vfio_user/protocol.hpp"

namespace sriovd::guest {

// How a client speaks the protocol. The default is this project's own
// client; foreign() is an independent client that sriovd must serve
// unmodified (a storage toolkit's NVMe driver, tried against sriovd):
// everything it does is allowed by the spec, and none of it is what QEMU
// does. The server tests run with both.
struct Dialect {
  bool version_json = true;        // VERSION carries the capabilities JSON (false: version 0.1, 4 bytes)
  bool id_zero = false;            // every message has id 0
  uint32_t region_info_argsz = 0;  // GET_REGION_INFO's argsz and payload size (0: the fixed struct + 4064 argsz)
  bool fd_with_unmap = false;      // DMA_UNMAP carries the window's fd back
  static Dialect own() { return {}; }
  static Dialect foreign() { return {false, true, 4064, true}; }
};

class VfioUserClient {
 public:
  // Connects and negotiates VERSION (throws Error if the server refuses).
  explicit VfioUserClient(const std::string& socket_path, nlohmann::json capabilities = nullptr, Dialect dialect = {});
  VfioUserClient(const std::string& socket_path, Dialect dialect) : VfioUserClient(socket_path, nullptr, dialect) {}

  struct Reply {
    vfio_user::Header hdr;
    std::vector<uint8_t> payload;
    std::vector<UniqueFd> fds;
  };
  // Any message, as is; the reply as it came (for conformance tests).
  Reply request(uint16_t command, std::span<const uint8_t> payload, std::span<const int> fds = {}, uint32_t flags = 0);
  // The same, throwing Error(errno) on an error reply.
  Reply call(uint16_t command, std::span<const uint8_t> payload, std::span<const int> fds = {});

  [[nodiscard]] const nlohmann::json& server_capabilities() const { return server_caps_; }
  [[nodiscard]] uint16_t minor() const { return minor_; }

  vfio_user::DeviceInfo device_info();
  struct Region {
    vfio_user::RegionInfo info;
    std::vector<vfio_user::SparseArea> sparse;
    UniqueFd fd;
  };
  Region region(uint32_t index);
  struct IoFds {
    std::vector<vfio_user::IoFdEntry> entries;
    std::vector<UniqueFd> fds;
  };
  IoFds region_io_fds(uint32_t index);
  vfio_user::IrqInfo irq_info(uint32_t index);

  void read(uint32_t region, uint64_t offset, std::span<uint8_t> out);
  void write(uint32_t region, uint64_t offset, std::span<const uint8_t> in);
  uint32_t read32(uint32_t region, uint64_t offset);
  void write32(uint32_t region, uint64_t offset, uint32_t value);
  // A posted write (the header's No_reply flag), as QEMU's client sends a
  // guest's BAR writes: PCI memory writes are posted, so the VMM does not
  // wait for the server. Ordered before every later message on the socket,
  // so a read (any request with a reply) flushes it, as a PCI read does.
  // At most 8 bytes; nothing allocated. A refused one is not heard of.
  void post_write(uint32_t region, uint64_t offset, std::span<const uint8_t> in);

  // TRIGGER eventfds for [start, start + fds.size()); -1 entries de-assign.
  void set_irq_eventfds(uint32_t index, uint32_t start, std::span<const int> fds);
  void disable_irqs(uint32_t index);
  void mask(uint32_t index, uint32_t vector, bool masked);
  void trigger(uint32_t index, uint32_t vector);

  void dma_map(uint64_t iova, uint64_t size, int fd, uint64_t offset, bool writable = true);
  // Shared without an fd: the server reaches it through DMA_READ/WRITE,
  // which this client serves from `local`.
  void dma_map_local(uint64_t iova, uint64_t size, uint8_t* local, bool writable = true);
  void dma_unmap(uint64_t iova, uint64_t size);
  void reset();

  // Live migration (DEVICE_FEATURE and MIG_DATA_READ/WRITE), as a VMM
  // moving its guest: the migration flags (VFIO_MIGRATION_*), the device's
  // state, a state change (returns the state reached), the state's bytes.
  uint64_t migration_flags();
  uint32_t mig_state();
  uint32_t set_mig_state(uint32_t state);
  // Reads the whole stream in `chunk`-byte reads (until a short one).
  std::vector<uint8_t> mig_read_all(uint32_t chunk = 64 * 1024);
  void mig_write_all(std::span<const uint8_t> data, uint32_t chunk = 64 * 1024);
  // DMA logging: returns the page size the device took; the report is
  // one bit per page_size from iova (pages written since the last report).
  uint64_t dma_logging_start(uint64_t page_size, std::span<const vfio_user::DmaRange> ranges);
  void dma_logging_stop();
  std::vector<uint64_t> dma_logging_report(uint64_t iova, uint64_t length, uint64_t page_size);
  // One DEVICE_FEATURE as is: flags (feature | GET/SET/PROBE), data; the
  // reply's data (after the argsz/flags header).
  std::vector<uint8_t> feature(uint32_t flags, std::span<const uint8_t> data, uint32_t reply_data = 0);

  [[nodiscard]] int fd() const { return sock_.get(); }
  [[nodiscard]] uint64_t dma_requests_served() const { return dma_served_; }

 private:
  void send(const vfio_user::Header& h, std::span<const uint8_t> payload, std::span<const int> fds);
  Reply receive();
  void serve_dma(const Reply& m);

  UniqueFd sock_;
  // One request and its reply at a time: a VMM's threads share the
  // connection (the guest's posted writes, a migration's log reader).
  std::recursive_mutex io_;
  Dialect dialect_;
  struct Mapped {
    uint64_t iova;
    uint64_t size;
    UniqueFd fd;  // kept for a dialect that sends it back with DMA_UNMAP
  };
  std::vector<Mapped> mapped_;
  uint16_t next_id_ = 1;
  uint16_t minor_ = 0;
  nlohmann::json server_caps_;
  struct Local {
    uint64_t iova;
    uint64_t size;
    uint8_t* host;
    bool writable;
  };
  std::vector<Local> local_;
  uint64_t dma_served_ = 0;
};

}  // namespace sriovd::guest
