#include "sriovd/vfio/kernel.hpp"

#include <fcntl.h>
#include <linux/vfio.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include <nlohmann/json.hpp>

#include "sriovd/util/error.hpp"
#include "sriovd/util/hex.hpp"

namespace sriovd::vfio {

bool RegionInfo::readable() const { return flags & VFIO_REGION_INFO_FLAG_READ; }
bool RegionInfo::writable() const { return flags & VFIO_REGION_INFO_FLAG_WRITE; }
bool RegionInfo::mappable() const { return flags & VFIO_REGION_INFO_FLAG_MMAP; }
bool IrqInfo::eventfd() const { return flags & VFIO_IRQ_INFO_EVENTFD; }
bool IrqInfo::maskable() const { return flags & VFIO_IRQ_INFO_MASKABLE; }
bool IrqInfo::noresize() const { return flags & VFIO_IRQ_INFO_NORESIZE; }

Container::Container() : fd_(::open("/dev/vfio/vfio", O_RDWR | O_CLOEXEC)) {
  if (!fd_) throw_errno("opening /dev/vfio/vfio (is the vfio module loaded?)");
  const int version = ::ioctl(fd_.get(), VFIO_GET_API_VERSION);
  if (version != VFIO_API_VERSION)
    throw std::runtime_error("VFIO API version " + std::to_string(version) + ", expected " +
                             std::to_string(VFIO_API_VERSION));
  if (::ioctl(fd_.get(), VFIO_CHECK_EXTENSION, VFIO_TYPE1v2_IOMMU) != 1)
    throw std::runtime_error("VFIO container does not support the type1v2 IOMMU (vfio_iommu_type1 not loaded?)");
}

Container::Container(UniqueFd adopted) : fd_(std::move(adopted)), iommu_set_(true) {
  if (::ioctl(fd_.get(), VFIO_GET_API_VERSION) != VFIO_API_VERSION)
    throw std::invalid_argument("the handed VFIO container is not one (VFIO_GET_API_VERSION)");
  read_iova_ranges();
}

bool Container::can_update_vaddr() const { return ::ioctl(fd_.get(), VFIO_CHECK_EXTENSION, VFIO_UPDATE_VADDR) == 1; }

void Container::invalidate_vaddr(uint64_t iova, uint64_t size) {
  vfio_iommu_type1_dma_unmap unmap{};
  unmap.argsz = sizeof unmap;
  unmap.flags = VFIO_DMA_UNMAP_FLAG_VADDR;
  unmap.iova = iova;
  unmap.size = size;
  if (::ioctl(fd_.get(), VFIO_IOMMU_UNMAP_DMA, &unmap) != 0)
    throw_errno("VFIO_IOMMU_UNMAP_DMA (FLAG_VADDR) iova " + hex(iova));
}

void Container::update_vaddr(uint64_t iova, void* vaddr, uint64_t size) {
  vfio_iommu_type1_dma_map map{};
  map.argsz = sizeof map;
  map.flags = VFIO_DMA_MAP_FLAG_VADDR;  // protection stays as mapped
  map.vaddr = reinterpret_cast<uint64_t>(vaddr);
  map.iova = iova;
  map.size = size;
  if (::ioctl(fd_.get(), VFIO_IOMMU_MAP_DMA, &map) != 0)
    throw_errno("VFIO_IOMMU_MAP_DMA (FLAG_VADDR) iova " + hex(iova) + " size " + hex(size));
}

void Container::set_iommu() {
  if (iommu_set_) return;
  if (::ioctl(fd_.get(), VFIO_SET_IOMMU, VFIO_TYPE1v2_IOMMU) != 0) throw_errno("VFIO_SET_IOMMU type1v2");
  iommu_set_ = true;
  read_iova_ranges();
}

namespace {
// Walks a VFIO capability chain in what the kernel wrote to `buf`, from
// `first`: fn(id, offset) for each header that fits, stopping at a chain
// that leaves the buffer or goes back.
template <typename Fn>
void for_each_cap(const std::vector<uint8_t>& buf, uint32_t first, Fn fn) {
  for (uint32_t off = first; off != 0 && off + sizeof(vfio_info_cap_header) <= buf.size();) {
    vfio_info_cap_header h;
    std::memcpy(&h, buf.data() + off, sizeof h);
    fn(h.id, off);
    if (h.next <= off) return;
    off = h.next;
  }
}

// The `count` entries of type T that a capability at `at` carries right
// after its own struct; only those that lie wholly inside `buf`.
template <typename Cap, typename T, typename Fn>
void for_each_entry(const std::vector<uint8_t>& buf, uint32_t at, uint32_t count, Fn fn) {
  const size_t first = at + sizeof(Cap);
  for (uint32_t i = 0; i < count && first + (i + 1) * sizeof(T) <= buf.size(); ++i) {
    T e;
    std::memcpy(&e, buf.data() + first + i * sizeof e, sizeof e);
    fn(e);
  }
}
}  // namespace

// The IOVA ranges the IOMMU can map (VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE):
// an emulated intel-iommu with 39 address bits, say, takes nothing above
// 2^39, and a client whose IOVAs are its virtual addresses (~2^45) is told
// so by name instead of with an EINVAL from deep in the kernel. No
// capability (an old kernel): nothing is known, everything is tried.
void Container::read_iova_ranges() {
  std::vector<uint8_t> buf(sizeof(vfio_iommu_type1_info));
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto* info = reinterpret_cast<vfio_iommu_type1_info*>(buf.data());
    info->argsz = static_cast<uint32_t>(buf.size());
    if (::ioctl(fd_.get(), VFIO_IOMMU_GET_INFO, info) != 0) return;
    if (info->argsz > buf.size()) {
      buf.resize(info->argsz);
      continue;
    }
    if (!(info->flags & VFIO_IOMMU_INFO_CAPS)) return;
    for_each_cap(buf, info->cap_offset, [&](uint16_t id, uint32_t off) {
      if (id != VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE || off + sizeof(vfio_iommu_type1_info_cap_iova_range) > buf.size())
        return;
      vfio_iommu_type1_info_cap_iova_range cap;
      std::memcpy(&cap, buf.data() + off, sizeof cap);
      for_each_entry<decltype(cap), vfio_iova_range>(buf, off, cap.nr_iovas, [&](const vfio_iova_range& r) {
        iova_ranges_.push_back({r.start, r.end});
      });
    });
    return;
  }
}

void Container::map_dma(uint64_t iova, void* vaddr, uint64_t size, bool writable) {
  if (!iova_ranges_.empty() && size > 0) {
    const uint64_t last = iova + (size - 1);
    bool inside = false;
    std::string usable;
    for (const auto& r : iova_ranges_) {
      inside = inside || (iova >= r.start && last >= iova && last <= r.end);
      usable += (usable.empty() ? "" : ", ") + std::string("[") + hex(r.start) + ", " + hex(r.end) + "]";
    }
    if (!inside)
      throw SystemError(ERANGE, "DMA window [" + hex(iova) + ", +" + hex(size) +
                                    ") is outside the IOVA ranges this IOMMU maps: " + usable);
  }
  vfio_iommu_type1_dma_map map{};
  map.argsz = sizeof map;
  map.flags = VFIO_DMA_MAP_FLAG_READ | (writable ? VFIO_DMA_MAP_FLAG_WRITE : 0U);
  map.vaddr = reinterpret_cast<uint64_t>(vaddr);
  map.iova = iova;
  map.size = size;
  if (::ioctl(fd_.get(), VFIO_IOMMU_MAP_DMA, &map) != 0)
    throw_errno("VFIO_IOMMU_MAP_DMA iova " + hex(iova) + " size " + hex(size));
}

void Container::unmap_dma(uint64_t iova, uint64_t size) {
  vfio_iommu_type1_dma_unmap unmap{};
  unmap.argsz = sizeof unmap;
  unmap.iova = iova;
  unmap.size = size;
  if (::ioctl(fd_.get(), VFIO_IOMMU_UNMAP_DMA, &unmap) != 0) throw_errno("VFIO_IOMMU_UNMAP_DMA iova " + hex(iova));
}

Group::Group(Container& container, int number)
    : fd_(::open(("/dev/vfio/" + std::to_string(number)).c_str(), O_RDWR | O_CLOEXEC)), number_(number) {
  const std::string name = "VFIO group " + std::to_string(number);
  if (!fd_) throw_errno("opening /dev/vfio/" + std::to_string(number));
  vfio_group_status status{};
  status.argsz = sizeof status;
  if (::ioctl(fd_.get(), VFIO_GROUP_GET_STATUS, &status) != 0) throw_errno(name + ": VFIO_GROUP_GET_STATUS");
  if (!(status.flags & VFIO_GROUP_FLAGS_VIABLE))
    throw std::runtime_error(name + " is not viable: bind every device in it to vfio-pci");
  int cfd = container.fd();
  if (::ioctl(fd_.get(), VFIO_GROUP_SET_CONTAINER, &cfd) != 0) throw_errno(name + ": VFIO_GROUP_SET_CONTAINER");
  container.set_iommu();
}

Group::Group(int number, UniqueFd adopted) : fd_(std::move(adopted)), number_(number) {
  vfio_group_status status{};
  status.argsz = sizeof status;
  if (::ioctl(fd_.get(), VFIO_GROUP_GET_STATUS, &status) != 0 || !(status.flags & VFIO_GROUP_FLAGS_VIABLE) ||
      !(status.flags & VFIO_GROUP_FLAGS_CONTAINER_SET))
    throw std::invalid_argument("the handed VFIO group " + std::to_string(number) +
                                " is not a viable group set to a container");
}

Group::~Group() {
  if (fd_) ::ioctl(fd_.get(), VFIO_GROUP_UNSET_CONTAINER);
}

KernelDevice::KernelDevice(Group& group, const PciAddress& address) : name_(address.to_string()) {
  fd_.reset(::ioctl(group.fd(), VFIO_GROUP_GET_DEVICE_FD, name_.c_str()));
  if (!fd_) throw_errno(name_ + ": VFIO_GROUP_GET_DEVICE_FD");
  take_info();
}

std::unique_ptr<KernelDevice> KernelDevice::adopt(const std::string& name, UniqueFd container, UniqueFd group,
                                                  int group_number, UniqueFd device,
                                                  const std::vector<Window>& inherited) {
  std::unique_ptr<KernelDevice> d(new KernelDevice(name));
  d->owned_container_ = std::make_unique<Container>(std::move(container));
  d->owned_group_ = std::make_unique<Group>(group_number, std::move(group));
  d->fd_ = std::move(device);
  d->take_info();
  for (const Window& w : inherited) d->mapped_.push_back({w.iova, w.size, nullptr, false});
  return d;
}

KernelDevice::~KernelDevice() {
  // The successor has the group in its container: leaving it would take
  // the IOMMU's mappings from under the device.
  if (handed_ && owned_group_) owned_group_->forget();
}

std::vector<uint8_t> KernelDevice::freeze_for_handover(HandedFds& fds) {
  if (!owned_container_ || !owned_group_) throw HandoverRefused(name_ + ": not opened with a container of its own");
  if (!owned_container_->can_update_vaddr())
    throw HandoverRefused(name_ + ": the kernel's VFIO cannot update a mapping's address (VFIO_UPDATE_VADDR)");
  nlohmann::json windows = nlohmann::json::array();
  size_t done = 0;
  try {
    for (Mapped& m : mapped_) {
      if (m.vaddr_valid) owned_container_->invalidate_vaddr(m.iova, m.size);
      m.vaddr_valid = false;
      ++done;
      windows.push_back({m.iova, m.size});
    }
  } catch (const std::exception& e) {
    for (size_t i = 0; i < done; ++i) {
      Mapped& m = mapped_[i];
      if (m.vaddr) {
        owned_container_->update_vaddr(m.iova, m.vaddr, m.size);
        m.vaddr_valid = true;
      }
    }
    throw HandoverRefused(name_ + ": " + e.what());
  }
  frozen_ = true;
  const nlohmann::json j = {{"kind", "kernel"},
                            {"name", name_},
                            {"container", fds.add_fd(dup_fd(owned_container_->fd(), "a VFIO container"))},
                            {"group", fds.add_fd(dup_fd(owned_group_->fd(), "a VFIO group"))},
                            {"group_number", owned_group_->number()},
                            {"device", fds.add_fd(dup_fd(fd_.get(), "a VFIO device"))},
                            {"windows", windows}};
  const std::string text = j.dump();
  return {text.begin(), text.end()};
}

void KernelDevice::thaw() {
  if (!std::exchange(frozen_, false)) return;
  for (Mapped& m : mapped_)
    if (m.vaddr && !m.vaddr_valid) {
      owned_container_->update_vaddr(m.iova, m.vaddr, m.size);
      m.vaddr_valid = true;
    }
}

void KernelDevice::take_info() {
  vfio_device_info info{};
  info.argsz = sizeof info;
  if (::ioctl(fd_.get(), VFIO_DEVICE_GET_INFO, &info) != 0) throw_errno(name_ + ": VFIO_DEVICE_GET_INFO");
  if (!(info.flags & VFIO_DEVICE_FLAGS_PCI)) throw std::runtime_error(name_ + " is not a VFIO PCI device");
  num_regions_ = info.num_regions;
  num_irqs_ = info.num_irqs;
  flags_ = info.flags;
  for (uint32_t i = 0; i < num_regions_; ++i) {
    try {
      const RegionInfo r = region(i);
      bounds_.push_back({r.offset, r.size});
    } catch (const SystemError&) {
      bounds_.push_back({0, 0});  // a region the device does not have (VGA without VGA: EINVAL)
    }
  }
}

const KernelDevice::Bounds& KernelDevice::bounds(uint32_t index, uint64_t offset, size_t size, const char* verb) const {
  if (index >= bounds_.size() || offset > bounds_[index].size || size > bounds_[index].size - offset)
    throw std::out_of_range(name_ + ": " + verb + " past region " + std::to_string(index));
  return bounds_[index];
}

std::unique_ptr<KernelDevice> KernelDevice::open(const PciAddress& address, const std::string& sysfs_root) {
  std::error_code ec;
  const auto group_link =
      std::filesystem::read_symlink(sysfs_root + "/bus/pci/devices/" + address.to_string() + "/iommu_group", ec);
  if (ec) throw std::runtime_error(address.to_string() + " has no IOMMU group (is the IOMMU on?)");
  const int number = std::stoi(group_link.filename().string());
  auto container = std::make_unique<Container>();
  auto group = std::make_unique<Group>(*container, number);
  auto device = std::make_unique<KernelDevice>(*group, address);
  device->owned_container_ = std::move(container);
  device->owned_group_ = std::move(group);
  return device;
}

RegionInfo KernelDevice::region(uint32_t index) {
  std::vector<uint8_t> buf(sizeof(vfio_region_info));
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto* info = reinterpret_cast<vfio_region_info*>(buf.data());
    info->argsz = static_cast<uint32_t>(buf.size());
    info->index = index;
    if (::ioctl(fd_.get(), VFIO_DEVICE_GET_REGION_INFO, info) != 0)
      throw_errno(name_ + ": VFIO_DEVICE_GET_REGION_INFO " + std::to_string(index));
    if (info->argsz > buf.size()) {  // capabilities follow: ask again with room
      buf.resize(info->argsz);
      continue;
    }
    RegionInfo out{index, info->flags, info->size, info->offset, {}, false};
    if (info->flags & VFIO_REGION_INFO_FLAG_CAPS) {
      for_each_cap(buf, info->cap_offset, [&](uint16_t id, uint32_t off) {
        if (id == VFIO_REGION_INFO_CAP_MSIX_MAPPABLE) out.msix_mappable = true;
        if (id != VFIO_REGION_INFO_CAP_SPARSE_MMAP || off + sizeof(vfio_region_info_cap_sparse_mmap) > buf.size())
          return;
        vfio_region_info_cap_sparse_mmap sparse;
        std::memcpy(&sparse, buf.data() + off, sizeof sparse);
        for_each_entry<decltype(sparse), vfio_region_sparse_mmap_area>(buf, off, sparse.nr_areas,
                                                                       [&](const vfio_region_sparse_mmap_area& a) {
                                                                         out.sparse.push_back({a.offset, a.size});
                                                                       });
      });
    }
    return out;
  }
  throw std::runtime_error(name_ + ": region " + std::to_string(index) + " info keeps growing");
}

void KernelDevice::read(uint32_t index, uint64_t offset, void* data, size_t size) {
  const Bounds& r = bounds(index, offset, size, "read");
  if (::pread(fd_.get(), data, size, static_cast<off_t>(r.offset + offset)) != static_cast<ssize_t>(size))
    throw_errno(name_ + ": read region " + std::to_string(index) + " at " + std::to_string(offset));
}

void KernelDevice::write(uint32_t index, uint64_t offset, const void* data, size_t size) {
  const Bounds& r = bounds(index, offset, size, "write");
  if (::pwrite(fd_.get(), data, size, static_cast<off_t>(r.offset + offset)) != static_cast<ssize_t>(size))
    throw_errno(name_ + ": write region " + std::to_string(index) + " at " + std::to_string(offset));
}

IrqInfo KernelDevice::irq(uint32_t index) {
  vfio_irq_info info{};
  info.argsz = sizeof info;
  info.index = index;
  if (::ioctl(fd_.get(), VFIO_DEVICE_GET_IRQ_INFO, &info) != 0)
    throw_errno(name_ + ": VFIO_DEVICE_GET_IRQ_INFO " + std::to_string(index));
  return {index, info.flags, info.count};
}

void KernelDevice::set_irq_eventfds(uint32_t index, uint32_t start, std::span<const int> fds) {
  std::vector<uint8_t> buf(sizeof(vfio_irq_set) + fds.size() * sizeof(int32_t));
  auto* set = reinterpret_cast<vfio_irq_set*>(buf.data());
  set->argsz = static_cast<uint32_t>(buf.size());
  set->flags = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER;
  set->index = index;
  set->start = start;
  set->count = static_cast<uint32_t>(fds.size());
  for (size_t i = 0; i < fds.size(); ++i) {
    const int32_t fd = fds[i];
    std::memcpy(buf.data() + sizeof(vfio_irq_set) + i * sizeof fd, &fd, sizeof fd);
  }
  if (::ioctl(fd_.get(), VFIO_DEVICE_SET_IRQS, set) != 0)
    throw_errno(name_ + ": VFIO_DEVICE_SET_IRQS index " + std::to_string(index) + " vectors " + std::to_string(start) +
                ".." + std::to_string(start + fds.size() - 1));
}

void KernelDevice::disable_irqs(uint32_t index) {
  vfio_irq_set set{};
  set.argsz = sizeof set;
  set.flags = VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER;
  set.index = index;
  if (::ioctl(fd_.get(), VFIO_DEVICE_SET_IRQS, &set) != 0)
    throw_errno(name_ + ": disabling IRQ index " + std::to_string(index));
}

void KernelDevice::trigger(uint32_t index, uint32_t vector) {
  vfio_irq_set set{};
  set.argsz = sizeof set;
  set.flags = VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER;
  set.index = index;
  set.start = vector;
  set.count = 1;
  if (::ioctl(fd_.get(), VFIO_DEVICE_SET_IRQS, &set) != 0)
    throw_errno(name_ + ": loopback trigger of vector " + std::to_string(vector));
}

void KernelDevice::reset() {
  if (!(flags_ & VFIO_DEVICE_FLAGS_RESET)) throw std::runtime_error(name_ + " does not support VFIO_DEVICE_RESET");
  if (::ioctl(fd_.get(), VFIO_DEVICE_RESET) != 0) throw_errno(name_ + ": VFIO_DEVICE_RESET");
}

int KernelDevice::mmap_fd(uint32_t index, uint64_t& offset) {
  const RegionInfo r = region(index);
  if (!r.mappable()) return -1;
  offset = r.offset;
  return fd_.get();
}

void KernelDevice::map_dma(uint64_t iova, void* host, uint64_t size, bool writable) {
  if (!owned_container_)
    throw std::runtime_error(name_ + ": DMA mapping needs the container the device was opened with");
  // A window the predecessor mapped: the same memory at this process's
  // address (the IOMMU's translation never changed).
  for (Mapped& m : mapped_)
    if (m.iova == iova && m.size == size && !m.vaddr_valid && !m.vaddr) {
      owned_container_->update_vaddr(iova, host, size);
      m.vaddr = host;
      m.vaddr_valid = true;
      return;
    }
  owned_container_->map_dma(iova, host, size, writable);
  mapped_.push_back({iova, size, host, true});
}

void KernelDevice::unmap_dma(uint64_t iova, uint64_t size) {
  if (!owned_container_)
    throw std::runtime_error(name_ + ": DMA mapping needs the container the device was opened with");
  owned_container_->unmap_dma(iova, size);
  std::erase_if(mapped_, [&](const Mapped& m) { return m.iova == iova && m.size == size; });
}

}  // namespace sriovd::vfio
