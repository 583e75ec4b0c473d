#pragma once
// A peer's text as it may go into a log line or an error reply: at most
// `max` bytes, and every byte outside printable ASCII shown as \xNN - so a
// newline cannot start a forged line (with the journal's "<0>" priority
// prefix, say) and no escape sequence reaches a terminal.
#include <cstdio>
#include <string>
#include <string_view>

namespace sriovd {

inline std::string printable(std::string_view text, size_t max = 80) {
  std::string out;
  for (size_t i = 0; i < text.size() && i < max; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      out += b;
    }
  }
  if (text.size() > max) out += "...";
  return out;
}

}  // namespace sriovd
