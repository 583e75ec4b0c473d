#pragma once
// What daemon.cpp and control.cpp (the control views) share, and nothing
// outside src/daemon uses.
#include <cstddef>
#include <string>

#include "sriovd/config/config.hpp"

namespace sriovd::daemon {

// The VFs the config asks for, over all PFs.
size_t count_vfs(const config::Config& cfg);
// "1 PF(s), 2 VF(s), 0 virtio device(s), host simulated"
std::string summary(const config::Config& cfg);

}  // namespace sriovd::daemon
