#include "sriovd/vfio_user/protocol.hpp"

namespace sriovd::vfio_user {

const char* command_name(uint16_t c) {
  switch (c) {
    case kVersion: return "VERSION";
    case kDmaMap: return "DMA_MAP";
    case kDmaUnmap: return "DMA_UNMAP";
    case kDeviceGetInfo: return "DEVICE_GET_INFO";
    case kDeviceGetRegionInfo: return "DEVICE_GET_REGION_INFO";
    case kDeviceGetRegionIoFds: return "DEVICE_GET_REGION_IO_FDS";
    case kDeviceGetIrqInfo: return "DEVICE_GET_IRQ_INFO";
    case kDeviceSetIrqs: return "DEVICE_SET_IRQS";
    case kRegionRead: return "REGION_READ";
    case kRegionWrite: return "REGION_WRITE";
    case kDmaRead: return "DMA_READ";
    case kDmaWrite: return "DMA_WRITE";
    case kDeviceReset: return "DEVICE_RESET";
    case kRegionWriteMulti: return "REGION_WRITE_MULTI";
    case kDeviceFeature: return "DEVICE_FEATURE";
    case kMigDataRead: return "MIG_DATA_READ";
    case kMigDataWrite: return "MIG_DATA_WRITE";
    default: return "unknown";
  }
}

}  // namespace sriovd::vfio_user
