#pragma once
// The vfio-user wire format (QEMU docs/interop/vfio-user.rst, version 0.1):
// a 16-byte header, then a command-specific payload laid out as the VFIO
// structures of linux/vfio.h. All fields are in host byte order.

#include <cstdint>
#include <stdexcept>
#include <string>

namespace sriovd::vfio_user {

// A request refused with an errno (a server's error reply, or a client's).
class Error : public std::runtime_error {
 public:
  Error(int err, const std::string& what) : std::runtime_error(what), errno_(err) {}
  [[nodiscard]] int code() const { return errno_; }

 private:
  int errno_;
};

inline constexpr uint16_t kMajor = 0;
inline constexpr uint16_t kMinor = 1;

enum Command : uint16_t {
  kVersion = 1,
  kDmaMap = 2,
  kDmaUnmap = 3,
  kDeviceGetInfo = 4,
  kDeviceGetRegionInfo = 5,
  kDeviceGetRegionIoFds = 6,
  kDeviceGetIrqInfo = 7,
  kDeviceSetIrqs = 8,
  kRegionRead = 9,
  kRegionWrite = 10,
  kDmaRead = 11,
  kDmaWrite = 12,
  kDeviceReset = 13,
  kRegionWriteMulti = 15,
  kDeviceFeature = 16,
  kMigDataRead = 17,
  kMigDataWrite = 18,
};

const char* command_name(uint16_t command);

// Header flags.
inline constexpr uint32_t kTypeMask = 0xf;
inline constexpr uint32_t kTypeCommand = 0;
inline constexpr uint32_t kTypeReply = 1;
inline constexpr uint32_t kNoReply = 1U << 4U;
inline constexpr uint32_t kError = 1U << 5U;

struct Header {
  uint16_t id = 0;
  uint16_t command = 0;
  uint32_t size = 0;  // the whole message, header included
  uint32_t flags = 0;
  uint32_t error = 0;
};
static_assert(sizeof(Header) == 16);

// What this server offers in VERSION (and assumes of a peer that says nothing).
inline constexpr uint32_t kMaxMsgFds = 16;
inline constexpr uint32_t kMaxDataXfer = 1U << 20U;  // the protocol's default
inline constexpr uint32_t kMaxDmaMaps = 1024;
inline constexpr uint64_t kPageSizes = 4096;
// The biggest message either side sends: a region/DMA transfer plus its
// fixed part; anything bigger is a framing error.
inline constexpr uint32_t kMaxMessage = sizeof(Header) + 16 + kMaxDataXfer;

struct DmaMap {
  uint32_t argsz = 0;
  uint32_t flags = 0;  // kDmaRead | kDmaWrite
  uint64_t offset = 0;
  uint64_t address = 0;
  uint64_t size = 0;
};
static_assert(sizeof(DmaMap) == 32);
inline constexpr uint32_t kDmaFlagRead = 1U << 0U;
inline constexpr uint32_t kDmaFlagWrite = 1U << 1U;

struct DmaUnmap {
  uint32_t argsz = 0;
  uint32_t flags = 0;
  uint64_t address = 0;
  uint64_t size = 0;
};
static_assert(sizeof(DmaUnmap) == 24);
inline constexpr uint32_t kDmaUnmapAll = 1U << 1U;  // VFIO_DMA_UNMAP_FLAG_ALL

struct DeviceInfo {
  uint32_t argsz = 0;
  uint32_t flags = 0;
  uint32_t num_regions = 0;
  uint32_t num_irqs = 0;
};
static_assert(sizeof(DeviceInfo) == 16);

struct RegionInfo {
  uint32_t argsz = 0;
  uint32_t flags = 0;
  uint32_t index = 0;
  uint32_t cap_offset = 0;
  uint64_t size = 0;
  uint64_t offset = 0;
};
static_assert(sizeof(RegionInfo) == 32);

struct CapHeader {
  uint16_t id = 0;
  uint16_t version = 0;
  uint32_t next = 0;
};
struct SparseMmapCap {
  CapHeader header;
  uint32_t nr_areas = 0;
  uint32_t reserved = 0;
};
struct SparseArea {
  uint64_t offset = 0;
  uint64_t size = 0;
};
inline constexpr uint16_t kCapSparseMmap = 1;  // VFIO_REGION_INFO_CAP_SPARSE_MMAP

struct RegionIoFds {
  uint32_t argsz = 0;
  uint32_t flags = 0;
  uint32_t index = 0;
  uint32_t count = 0;
};
struct IoFdEntry {
  uint64_t offset = 0;
  uint64_t size = 0;
  uint32_t fd_index = 0;
  uint32_t type = 0;   // kIoFdTypeIoeventfd
  uint32_t flags = 0;  // KVM_IOEVENTFD_FLAG_DATAMATCH when datamatch applies
  uint32_t padding = 0;
  uint64_t datamatch = 0;
};
static_assert(sizeof(IoFdEntry) == 40);
inline constexpr uint32_t kIoFdTypeIoeventfd = 0;
inline constexpr uint32_t kIoeventfdFlagDatamatch = 1U << 0U;

struct IrqInfo {
  uint32_t argsz = 0;
  uint32_t flags = 0;
  uint32_t index = 0;
  uint32_t count = 0;
};
static_assert(sizeof(IrqInfo) == 16);

struct IrqSet {
  uint32_t argsz = 0;
  uint32_t flags = 0;
  uint32_t index = 0;
  uint32_t start = 0;
  uint32_t count = 0;
};
static_assert(sizeof(IrqSet) == 20);

struct RegionAccess {
  uint64_t offset = 0;
  uint32_t region = 0;
  uint32_t count = 0;
};
static_assert(sizeof(RegionAccess) == 16);

// VFIO_USER_REGION_WRITE_MULTI: a u64 count, then that many of these, each
// a write of 1..8 bytes (the spec's "Single Device Write Format"). A client
// coalesces posted writes into one when its queue backs up (QEMU: 200 at most).
struct WriteOne {
  uint64_t offset = 0;
  uint32_t region = 0;
  uint32_t count = 0;
  uint8_t data[8] = {};
};
static_assert(sizeof(WriteOne) == 24);
inline constexpr uint64_t kMaxWriteMulti = 256;

struct DmaAccess {
  uint64_t address = 0;
  uint64_t count = 0;
};
static_assert(sizeof(DmaAccess) == 16);

// VFIO_USER_DEVICE_FEATURE: VFIO's struct vfio_device_feature, its data
// after it. The feature index is the low 16 bits of flags; GET, SET and
// PROBE the bits above (linux/vfio.h's VFIO_DEVICE_FEATURE_*).
struct DeviceFeature {
  uint32_t argsz = 0;
  uint32_t flags = 0;
};
static_assert(sizeof(DeviceFeature) == 8);
inline constexpr uint32_t kFeatureMask = 0xffff;
inline constexpr uint32_t kFeatureGet = 1U << 16U;
inline constexpr uint32_t kFeatureSet = 1U << 17U;
inline constexpr uint32_t kFeatureProbe = 1U << 18U;
// The features vfio-user carries: migration's.
inline constexpr uint32_t kFeatureMigration = 1;
inline constexpr uint32_t kFeatureMigDeviceState = 2;
inline constexpr uint32_t kFeatureDmaLoggingStart = 6;
inline constexpr uint32_t kFeatureDmaLoggingStop = 7;
inline constexpr uint32_t kFeatureDmaLoggingReport = 8;
inline constexpr uint64_t kMigrationStopCopy = 1U << 0U;  // VFIO_MIGRATION_STOP_COPY

// MIG_DEVICE_STATE's data: the state (enum vfio_device_mig_state) and a
// data_fd vfio-user does not use (MIG_DATA_READ/WRITE carry the data).
struct MigDeviceState {
  uint32_t device_state = 0;
  int32_t data_fd = -1;
};
static_assert(sizeof(MigDeviceState) == 8);

// DMA_LOGGING_START's data, then num_ranges of DmaRange.
struct DmaLoggingControl {
  uint64_t page_size = 0;
  uint32_t num_ranges = 0;
  uint32_t reserved = 0;
};
static_assert(sizeof(DmaLoggingControl) == 16);
struct DmaRange {
  uint64_t iova = 0;
  uint64_t length = 0;
};
static_assert(sizeof(DmaRange) == 16);
// DMA_LOGGING_REPORT's data; the reply's adds the bitmap (u64s, bit n for
// the page_size unit at iova + n * page_size).
struct DmaLoggingReport {
  uint64_t iova = 0;
  uint64_t length = 0;
  uint64_t page_size = 0;
};
static_assert(sizeof(DmaLoggingReport) == 24);

// MIG_DATA_READ / MIG_DATA_WRITE: argsz, size, then (reply / write) data.
struct MigData {
  uint32_t argsz = 0;
  uint32_t size = 0;
};
static_assert(sizeof(MigData) == 8);

}  // namespace sriovd::vfio_user
