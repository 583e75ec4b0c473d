// Writes every bad configuration of bad_configs.hpp as DIR/<name>.yaml, for
// tests/config/check_schema.py.
//   dump_bad_configs DIR
#include <cstdio>
#include <fstream>
#include <string>

#include "bad_configs.hpp"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: dump_bad_configs DIR\n");
    return 64;
  }
  for (const auto& c : sriovd::config::bad_configs::kCases) {
    const std::string path = std::string(argv[1]) + "/" + c.name + ".yaml";
    std::ofstream out(path, std::ios::binary);
    out << c.text;
    if (!out) {
      std::fprintf(stderr, "dump_bad_configs: cannot write %s\n", path.c_str());
      return 1;
    }
  }
  return 0;
}
