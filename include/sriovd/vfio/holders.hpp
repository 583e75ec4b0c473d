#pragma once
// Who still holds a VF's VFIO device open. A VMM given the device fd
// (assign.bar_access: mmap) keeps the device as long as it keeps that fd or
// a BAR mapping made through it, and while it does, unbinding the VF from
// vfio-pci waits in the kernel for it to let go. Before the host layer
// unbinds, the daemon looks here, waits a bounded time, and otherwise
// refuses the unbind naming the holder.
//
// Read from /proc: fds that are "anon_inode:[vfio-device]" - attributed to
// a device by their fdinfo's "vfio-device-syspath:" (Linux 6.18 and later)
// or, on older kernels that do not say, counted for the processes the
// device fd was handed to - and BAR mappings ("[vfio-device]" in maps) of
// those processes.

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace sriovd::vfio {

struct Holder {
  pid_t pid = 0;
  std::string comm;  // /proc/PID/comm
  std::string what;  // "fd 23", "fd 23 (a VFIO device fd; the kernel does not say which)", "a BAR mapping"
};

// The processes other than this one that hold the VFIO device of PCI
// address `device` ("0000:3b:02.0"); `given_to`: the pids the daemon handed
// that device's fd to. `proc` is /proc (a test gives a tree of its own).
std::vector<Holder> device_holders(const std::string& device, std::span<const pid_t> given_to,
                                   const std::string& proc = "/proc");

// "pid 4242 (qemu-system-x86) fd 23, ..." for logs and errors.
std::string describe(const std::vector<Holder>& holders);

// The holders as a status shows them, surveyed off the caller's thread. A
// walk reads the fd links of every process on the host: with many fds (an
// unprivileged user can hold hundreds of thousands) it takes seconds, and
// a status is built for every Prometheus scrape and for the device plugin.
// So the control thread only reads the last survey; a survey runs on this
// class's thread when someone has looked since the last one, at most once
// per `interval`. What a status shows is at most interval + one walk old.
class HolderSurvey {
 public:
  using Walk = std::function<std::vector<Holder>(const std::string& device, std::span<const pid_t> given_to)>;
  struct Seen {
    std::vector<Holder> holders;
    std::chrono::steady_clock::time_point when{};  // epoch: not surveyed yet
  };

  explicit HolderSurvey(std::chrono::milliseconds interval = std::chrono::seconds(2), Walk walk = {});
  ~HolderSurvey();
  HolderSurvey(const HolderSurvey&) = delete;
  HolderSurvey& operator=(const HolderSurvey&) = delete;

  // The devices to survey and the pids each one's fd went to (replaces the
  // last set; a device no longer in it is forgotten).
  void watch(std::map<std::string, std::vector<pid_t>> devices);
  // The last survey of `device`; asks for a new one. Never walks /proc.
  [[nodiscard]] Seen seen(const std::string& device);
  [[nodiscard]] uint64_t surveys() const;

 private:
  void run();

  const std::chrono::milliseconds interval_;
  Walk walk_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<pid_t>> devices_;
  std::map<std::string, Seen> seen_;
  bool asked_ = false, stop_ = false;
  uint64_t surveys_ = 0;
  std::thread thread_;
};

}  // namespace sriovd::vfio
