#pragma once
// The vhost-user protocol (QEMU docs/interop/vhost-user.rst), back-end side:
// message header and payloads laid out from the spec, checked sizes.

#include <cstdint>

namespace sriovd::vhost_user {

enum Request : uint32_t {
  kGetFeatures = 1,
  kSetFeatures = 2,
  kSetOwner = 3,
  kResetOwner = 4,
  kSetMemTable = 5,
  kSetLogBase = 6,
  kSetLogFd = 7,
  kSetVringNum = 8,
  kSetVringAddr = 9,
  kSetVringBase = 10,
  kGetVringBase = 11,
  kSetVringKick = 12,
  kSetVringCall = 13,
  kSetVringErr = 14,
  kGetProtocolFeatures = 15,
  kSetProtocolFeatures = 16,
  kGetQueueNum = 17,
  kSetVringEnable = 18,
  kSendRarp = 19,
  kNetSetMtu = 20,
  kSetBackendReqFd = 21,
  kIotlbMsg = 22,
  kGetConfig = 24,
  kSetConfig = 25,
  kGetInflightFd = 31,
  kSetInflightFd = 32,
  kResetDevice = 34,
  kGetMaxMemSlots = 36,
  kAddMemReg = 37,
  kRemMemReg = 38,
  kSetStatus = 39,
  kGetStatus = 40,
};
const char* request_name(uint32_t request);

inline constexpr uint32_t kVersion = 0x1;
inline constexpr uint32_t kFlagVersionMask = 0x3;
inline constexpr uint32_t kFlagReply = 1U << 2U;
inline constexpr uint32_t kFlagNeedReply = 1U << 3U;

// Protocol feature bits.
inline constexpr uint64_t kProtoMq = 1ULL << 0U;
inline constexpr uint64_t kProtoLogShmfd = 1ULL << 1U;
inline constexpr uint64_t kProtoRarp = 1ULL << 2U;
inline constexpr uint64_t kProtoReplyAck = 1ULL << 3U;
inline constexpr uint64_t kProtoMtu = 1ULL << 4U;
inline constexpr uint64_t kProtoBackendReq = 1ULL << 5U;
inline constexpr uint64_t kProtoConfig = 1ULL << 9U;
inline constexpr uint64_t kProtoInflightShmfd = 1ULL << 12U;
inline constexpr uint64_t kProtoResetDevice = 1ULL << 13U;
inline constexpr uint64_t kProtoConfigureMemSlots = 1ULL << 15U;
inline constexpr uint64_t kProtoStatus = 1ULL << 16U;
inline constexpr uint64_t kFeatureProtocolFeatures = 1ULL << 30U;  // VHOST_USER_F_PROTOCOL_FEATURES
inline constexpr uint64_t kFeatureLogAll = 1ULL << 26U;            // VHOST_F_LOG_ALL: log every write (migration)
// SET_VRING_ADDR's flags: VHOST_VRING_F_LOG, log the ring's writes at log_guest_addr.
inline constexpr uint32_t kVringFlagLog = 1U << 0U;

// A vring fd message's u64: bits 0-7 the queue index, bit 8 "no fd".
inline constexpr uint64_t kVringIndexMask = 0xff;
inline constexpr uint64_t kVringNoFd = 1ULL << 8U;

inline constexpr uint32_t kMaxRegions = 8;
inline constexpr uint32_t kMaxFds = 8;
inline constexpr uint32_t kMaxPayload = 4096;

struct Header {
  uint32_t request;
  uint32_t flags;
  uint32_t size;
};
static_assert(sizeof(Header) == 12);

struct VringState {
  uint32_t index;
  uint32_t num;
};
static_assert(sizeof(VringState) == 8);

struct VringAddr {
  uint32_t index;
  uint32_t flags;
  uint64_t desc;  // front-end virtual addresses
  uint64_t used;
  uint64_t avail;
  uint64_t log;
};
static_assert(sizeof(VringAddr) == 40);

struct MemRegion {
  uint64_t guest_addr;
  uint64_t size;
  uint64_t user_addr;
  uint64_t mmap_offset;
};
static_assert(sizeof(MemRegion) == 32);

struct MemTable {
  uint32_t nregions;
  uint32_t padding;
  MemRegion regions[kMaxRegions];
};
static_assert(sizeof(MemTable) == 8 + 32 * kMaxRegions);

struct SingleMemRegion {
  uint64_t padding;
  MemRegion region;
};
static_assert(sizeof(SingleMemRegion) == 40);

// struct vhost_iotlb_msg (linux/vhost_types.h), as IOTLB_MSG carries it.
struct IotlbMsg {
  uint64_t iova;
  uint64_t size;
  uint64_t uaddr;
  uint8_t perm;
  uint8_t type;
  uint8_t padding[6];
};
static_assert(sizeof(IotlbMsg) == 32);
inline constexpr uint8_t kIotlbMiss = 1, kIotlbUpdate = 2, kIotlbInvalidate = 3, kIotlbAccessFail = 4;
// Back-end channel requests (back-end -> front-end).
inline constexpr uint32_t kBackendIotlbMsg = 1;

// SET_LOG_BASE's payload (with LOG_SHMFD): the log's bytes in its fd.
struct LogDesc {
  uint64_t mmap_size;
  uint64_t mmap_offset;
};
static_assert(sizeof(LogDesc) == 16);

// GET/SET_INFLIGHT_FD's payload (the inflight description).
struct InflightDesc {
  uint64_t mmap_size;
  uint64_t mmap_offset;
  uint16_t num_queues;
  uint16_t queue_size;
  uint32_t padding;
};
static_assert(sizeof(InflightDesc) == 24);

struct ConfigSpace {
  uint32_t offset;
  uint32_t size;
  uint32_t flags;
  uint8_t payload[256];
};

}  // namespace sriovd::vhost_user
