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

#include <span>
#include <string>
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

}  // namespace sriovd::vfio
