#pragma once

#include <cerrno>
#include <stdexcept>
#include <string>
#include <system_error>

namespace sriovd {

// A control-plane failure of a system call: carries the errno and a message
// that says what was being done and to which object.
class SystemError : public std::system_error {
 public:
  SystemError(int err, const std::string& what) : std::system_error(err, std::generic_category(), what) {}
};

// Throws SystemError with the current errno.
[[noreturn]] inline void throw_errno(const std::string& what) { throw SystemError(errno, what); }

}  // namespace sriovd
