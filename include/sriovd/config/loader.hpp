#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "sriovd/config/config.hpp"

namespace sriovd::config {

// One problem found in a config file, in the compiler's format
// "FILE:LINE:COL: MESSAGE". line/column are 1-based; 0 when the problem is
// with the file as a whole (it cannot be read).
struct Diagnostic {
  std::string file;
  int line = 0;
  int column = 0;
  std::string message;

  [[nodiscard]] std::string to_string() const;
};

// Thrown by load()/parse() with every problem found, in file order.
class ConfigError : public std::runtime_error {
 public:
  explicit ConfigError(std::vector<Diagnostic> diagnostics);
  [[nodiscard]] const std::vector<Diagnostic>& diagnostics() const { return diagnostics_; }

 private:
  std::vector<Diagnostic> diagnostics_;
};

// Reads and validates a config file completely. Has no side effects besides
// reading the file and looking up the control group's name.
Config load(const std::string& path);

// The same for text already in memory; `file` names it in diagnostics.
Config parse(std::string_view text, const std::string& file);

}  // namespace sriovd::config

namespace sriovd::config {

// The config as YAML that load() reads back to the same values (defaults
// written out). Used by `sriovctl config` and the round-trip tests.
std::string to_yaml(const Config& cfg);

}  // namespace sriovd::config
