// The fuzz harnesses built without libFuzzer: each argument is a file or a
// directory of files (a corpus), and every file is run once through the
// harness. The unit suite runs every target over its seed corpus and its
// regression inputs (tests/fuzz/corpus/TARGET) this way, so a finding, once
// added there, is checked on every build, sanitizers or not.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {
int run(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  return 1;
}
}  // namespace

int main(int argc, char** argv) {
  size_t files = 0;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path p(argv[i]);
    if (std::filesystem::is_directory(p)) {
      for (const auto& e : std::filesystem::recursive_directory_iterator(p))
        if (e.is_regular_file()) files += run(e.path());
    } else {
      files += run(p);
    }
  }
  if (files == 0) {
    std::fprintf(stderr, "no inputs in the corpus given: nothing was replayed\n");
    return 1;
  }
  std::printf("replayed %zu inputs\n", files);
  return 0;
}
