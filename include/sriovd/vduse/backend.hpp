#pragma once
// VDUSE - a vDPA device in userspace (linux/vduse.h): a virtio device the
// kernel itself drives. sriovd creates it through /dev/vduse/control,
// answers the kernel's requests on /dev/vduse/NAME (status, queue state,
// IOTLB changes), maps the kernel's DMA domain on demand (IOTLB_GET_FD),
// takes kicks from eventfds and injects interrupts with VQ_INJECT_IRQ.
// Added to the vDPA bus over the vdpa generic netlink family, it is bound
// to virtio_vdpa (an ordinary host netdev: a container's interface) or to
// vhost_vdpa (/dev/vhost-vdpa-N, which QEMU takes with -netdev vhost-vdpa).
//
// The kernel is a driver sriovd does not have to trust less than itself,
// but it waits for answers: every host operation that makes it talk to the
// device (adding it to the bus, binding a driver, removing it) runs on a
// helper thread while this thread answers (serve_while). A device that
// does not answer for the kernel's message timeout is failed by it.
//
// Every device made is recorded in a journal first (a file of names); a
// crash's next start removes what the journal names (remove_left_over).
// On the thread of the io_context it is given, which makes and deletes it.

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "sriovd/irq/engine.hpp"
#include "sriovd/util/asio.hpp"
#include "sriovd/util/counters.hpp"
#include "sriovd/util/fd.hpp"
#include "sriovd/virtio/device.hpp"
#include "sriovd/virtio/guest_memory.hpp"
#include "sriovd/virtio/iotlb.hpp"

struct vduse_dev_request;  // linux/vduse.h
struct vduse_dev_response;

namespace sriovd::vduse {

// The vDPA driver a device is bound to.
enum class Bind { netdev, vhost_vdpa };
const char* driver_name(Bind b);  // "virtio_vdpa" | "vhost_vdpa"

struct BackendStats {
  uint64_t requests = 0;         // messages from the kernel answered
  uint64_t status_changes = 0;   // SET_STATUS
  uint64_t starts = 0;           // DRIVER_OK set (the driver started the device)
  uint64_t resets = 0;           // status 0
  uint64_t mappings = 0;         // DMA domain ranges mapped (IOTLB_GET_FD)
  uint64_t invalidations = 0;    // UPDATE_IOTLB
  uint64_t interrupts = 0;       // VQ_INJECT_IRQ
  uint64_t failed_requests = 0;  // answered VDUSE_REQ_RESULT_FAILED
  std::string last_error;
};
inline constexpr Counter<BackendStats> kBackendCounters[] = {
    {"requests", "messages from the kernel answered", &BackendStats::requests},
    {"status_changes", "device status writes by the kernel's driver", &BackendStats::status_changes},
    {"starts", "times the kernel's driver started the device (DRIVER_OK)", &BackendStats::starts},
    {"resets", "device resets by the kernel's driver", &BackendStats::resets},
    {"mappings", "ranges of the kernel's DMA domain mapped", &BackendStats::mappings},
    {"invalidations", "IOTLB invalidations from the kernel", &BackendStats::invalidations},
    {"interrupts", "interrupts injected into the kernel's driver", &BackendStats::interrupts},
    {"failed_requests", "kernel requests answered as failed", &BackendStats::failed_requests},
};

// Whether this kernel can have VDUSE devices bound to `bind`'s driver;
// false with the reason (a module to load) in `why`. Changes nothing.
bool available(Bind bind, std::string& why);

// The journal of the VDUSE devices an sriovd instance made (one name per
// line; written whole, fsync'd, renamed).
std::vector<std::string> read_journal(const std::string& path);

class Backend {
 public:
  // Creates the VDUSE device `name` for `device` (its type, features,
  // queues and config space), records it in `journal`, serves it on `io`'s
  // thread, adds it to the vDPA bus and binds `bind`'s driver. Returns when
  // the driver has probed it. Throws std::runtime_error naming what failed
  // (no VDUSE, the name taken, a driver not loaded, the kernel refusing
  // the device); nothing made is left behind then.
  Backend(asio::io_context& io, std::string name, virtio::Device& device, irq::Engine& engine, Bind bind,
          std::string journal);
  // Off the bus (the driver's reset answered meanwhile) and destroyed.
  ~Backend();
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  // The driver has set DRIVER_OK.
  [[nodiscard]] bool driver_ok() const;
  [[nodiscard]] uint8_t status() const { return status_; }
  // What the driver made of it: the netdev's name (virtio_vdpa) or the
  // character device (vhost_vdpa: /dev/vhost-vdpa-N).
  [[nodiscard]] const std::string& kernel_device() const { return kernel_device_; }
  [[nodiscard]] Bind bind() const { return bind_; }
  [[nodiscard]] uint64_t offered_features() const { return features_; }
  // The device's configuration space changed (its link): the kernel's copy
  // is updated and the driver interrupted.
  void config_changed();
  [[nodiscard]] const BackendStats& stats() const { return stats_; }

  // The devices `journal` names that `keep` does not (a crashed run's):
  // removed from the bus (their drivers' resets answered) and destroyed;
  // returns their names. Throws only when the journal cannot be read.
  static std::vector<std::string> remove_left_over(const std::string& journal, const std::vector<std::string>& keep);

 private:
  struct Mapping {
    uint64_t iova = 0, size = 0;
    void* host = nullptr;
  };
  void create();
  void bind_driver();
  void find_kernel_device();
  void destroy() noexcept;
  void watch_requests();
  void drain_requests();
  void answer(const ::vduse_dev_request& req, ::vduse_dev_response& resp);
  void set_status(uint8_t status);
  void start_device();
  void finish_reset();
  void invalidate(uint64_t first, uint64_t last);
  void watch_misses();
  void map_miss();
  void watch_call(unsigned q);
  void unmap_all();
  // Runs `op` on a helper thread while this one answers the kernel's
  // requests; rethrows what `op` threw.
  void serve_while(const std::function<void()>& op);

  asio::io_context& io_;
  std::string name_;
  virtio::Device& device_;
  irq::Engine& engine_;
  Bind bind_;
  std::string journal_;
  uint64_t features_ = 0;
  UniqueFd control_;  // /dev/vduse/control
  UniqueFd dev_;      // /dev/vduse/NAME
  bool created_ = false;
  bool on_bus_ = false;
  uint8_t status_ = 0;
  // Work a status asked for, done once the kernel has the answer.
  enum class Deferred { none, start, reset };
  Deferred deferred_ = Deferred::none;
  std::string kernel_device_;
  virtio::GuestMemory memory_;
  virtio::Iotlb iotlb_;
  std::vector<Mapping> mappings_;
  std::vector<UniqueFd> kicks_;  // the kernel signals these (VQ_SETUP_KICKFD)
  std::vector<UniqueFd> calls_;  // the routes' sinks: read here, injected as VQ_INJECT_IRQ
  std::vector<irq::RouteId> routes_;
  std::vector<std::unique_ptr<asio::posix::stream_descriptor>> call_watch_;
  std::unique_ptr<asio::posix::stream_descriptor> dev_watch_;
  std::unique_ptr<asio::posix::stream_descriptor> miss_watch_;
  BackendStats stats_;
};

}  // namespace sriovd::vduse
