#pragma once
// Kernel VFIO: the type1v2 container, a group, and a device of the group,
// each owned by an RAII object. Every error names the device or group and
// carries the errno text.

#include <memory>
#include <string>
#include <vector>

#include "sriovd/util/fd.hpp"
#include "sriovd/util/pci_address.hpp"
#include "sriovd/vfio/device.hpp"

namespace sriovd::vfio {

class Container {
 public:
  // Opens /dev/vfio/vfio and checks the API version and type1v2 support.
  Container();
  // A successor's: the predecessor's container, its IOMMU set and its
  // mappings in place.
  explicit Container(UniqueFd adopted);
  [[nodiscard]] int fd() const { return fd_.get(); }
  // VFIO_IOMMU_MAP_DMA / UNMAP_DMA (after the first group is attached).
  // A window outside the IOMMU's usable IOVA ranges is refused (ERANGE,
  // naming them) before the kernel is asked.
  void map_dma(uint64_t iova, void* vaddr, uint64_t size, bool writable = true);
  void unmap_dma(uint64_t iova, uint64_t size);
  // A mapping's process address, withdrawn before an exec and given again
  // after it (VFIO_UPDATE_VADDR): the device's DMA goes on meanwhile.
  [[nodiscard]] bool can_update_vaddr() const;
  void invalidate_vaddr(uint64_t iova, uint64_t size);
  void update_vaddr(uint64_t iova, void* vaddr, uint64_t size);
  struct IovaRange {
    uint64_t start, end;  // inclusive
  };
  [[nodiscard]] const std::vector<IovaRange>& iova_ranges() const { return iova_ranges_; }

 private:
  friend class Group;
  void set_iommu();
  void read_iova_ranges();
  UniqueFd fd_;
  bool iommu_set_ = false;
  std::vector<IovaRange> iova_ranges_;  // empty: the kernel did not say
};

class Group {
 public:
  // Opens /dev/vfio/<number>, checks that it is viable, and attaches it to
  // the container (setting the container's IOMMU type on the first group).
  Group(Container& container, int number);
  // A successor's: the predecessor's group, set to its container.
  Group(int number, UniqueFd adopted);
  ~Group();
  // The successor has the group: closed without leaving the container.
  void forget() { fd_.reset(); }
  [[nodiscard]] int number() const { return number_; }
  [[nodiscard]] int fd() const { return fd_.get(); }

 private:
  UniqueFd fd_;
  int number_;
};

class KernelDevice : public Device {
 public:
  KernelDevice(Group& group, const PciAddress& address);
  // Container, group and device for one PCI function bound to vfio-pci.
  static std::unique_ptr<KernelDevice> open(const PciAddress& address, const std::string& sysfs_root = "/sys");
  // A successor's device from its predecessor's fds: `inherited` are the
  // DMA windows still mapped in the container, whose process addresses
  // map_dma gives again.
  struct Window {
    uint64_t iova = 0, size = 0;
  };
  static std::unique_ptr<KernelDevice> adopt(const std::string& name, UniqueFd container, UniqueFd group,
                                             int group_number, UniqueFd device, const std::vector<Window>& inherited);
  ~KernelDevice() override;

  [[nodiscard]] const std::string& name() const override { return name_; }
  [[nodiscard]] uint32_t num_regions() const override { return num_regions_; }
  [[nodiscard]] uint32_t num_irqs() const override { return num_irqs_; }
  RegionInfo region(uint32_t index) override;
  void read(uint32_t region, uint64_t offset, void* data, size_t size) override;
  void write(uint32_t region, uint64_t offset, const void* data, size_t size) override;
  IrqInfo irq(uint32_t index) override;
  void set_irq_eventfds(uint32_t index, uint32_t start, std::span<const int> fds) override;
  void disable_irqs(uint32_t index) override;
  void trigger(uint32_t index, uint32_t vector) override;
  void reset() override;
  int mmap_fd(uint32_t region, uint64_t& offset) override;
  // Through the container this device was opened with (open()).
  void map_dma(uint64_t iova, void* host, uint64_t size, bool writable) override;
  void unmap_dma(uint64_t iova, uint64_t size) override;
  // The container, group and device fds and the windows mapped; the
  // windows' process addresses are withdrawn until thaw() (refused
  // without VFIO_UPDATE_VADDR).
  std::vector<uint8_t> freeze_for_handover(HandedFds& fds) override;
  void thaw() override;
  void handed_over() override { handed_ = true; }

  [[nodiscard]] int fd() const { return fd_.get(); }
  Container& container() { return *owned_container_; }

 private:
  std::unique_ptr<Container> owned_container_;  // set by open()
  std::unique_ptr<Group> owned_group_;
  std::string name_;
  UniqueFd fd_;
  uint32_t num_regions_ = 0;
  uint32_t num_irqs_ = 0;
  uint32_t flags_ = 0;
  // Where each region is in the device fd and how long: fixed for the
  // device's life, taken once, so a trapped BAR access is one pread/pwrite
  // and no GET_REGION_INFO ioctl.
  struct Bounds {
    uint64_t offset = 0;
    uint64_t size = 0;
  };
  std::vector<Bounds> bounds_;
  // The DMA windows mapped through the container, with the process address
  // each was given (invalid: withdrawn for a handover, or inherited and not
  // given again yet).
  struct Mapped {
    uint64_t iova = 0, size = 0;
    void* vaddr = nullptr;
    bool vaddr_valid = false;
  };
  std::vector<Mapped> mapped_;
  bool frozen_ = false, handed_ = false;
  explicit KernelDevice(std::string name) : name_(std::move(name)) {}
  void take_info();
  const Bounds& bounds(uint32_t index, uint64_t offset, size_t size, const char* verb) const;
};

}  // namespace sriovd::vfio
