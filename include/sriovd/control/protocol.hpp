#pragma once
// The control API: one JSON object per line in each direction over a Unix
// stream socket. A request is {"cmd": NAME, ...arguments, "id": optional};
// a reply is {"ok": true, "result": ...} or
// {"ok": false, "error": {"code": CODE, "message": TEXT}}, echoing "id".

#include <cstddef>
#include <string>

#include <nlohmann/json.hpp>

namespace sriovd::control {

using json = nlohmann::json;

inline constexpr const char* kDefaultSocket = "/run/sriovd/control.sock";
// A request line longer than this ends the connection with an error.
inline constexpr size_t kMaxLineBytes = 64 * 1024;

// Error codes a reply can carry.
namespace errc {
inline constexpr const char* kBadJson = "bad_json";
inline constexpr const char* kBadRequest = "bad_request";
inline constexpr const char* kUnknownCommand = "unknown_command";
inline constexpr const char* kPermissionDenied = "permission_denied";
inline constexpr const char* kLineTooLong = "line_too_long";
inline constexpr const char* kFailed = "failed";
}  // namespace errc

inline json make_error(const std::string& code, const std::string& message) {
  return {{"ok", false}, {"error", {{"code", code}, {"message", message}}}};
}
inline json make_result(json result) { return {{"ok", true}, {"result", std::move(result)}}; }

}  // namespace sriovd::control
