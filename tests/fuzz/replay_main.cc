// The driver of a fuzz target in builds without libFuzzer (gcc): runs the target on every
// seed file given (files or folders) and on a fixed set of byte-level mutations of each,
// so `ctest` replays the corpus on every build. Coverage-guided runs use libFuzzer
// (ISTHMUS_FUZZ=ON, docs/TESTING.md).
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  for (int i = 1; i < argc; ++i) {
    if (fs::is_directory(argv[i])) {
      for (const auto& e : fs::directory_iterator(argv[i])) files.push_back(e.path());
    } else {
      files.emplace_back(argv[i]);
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "usage: %s SEED_FILE_OR_DIR...\n", argv[0]);
    return 2;
  }
  std::mt19937 rng(12345);
  uint64_t runs = 0;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::string seed((std::istreambuf_iterator<char>(in)), {});
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(seed.data()), seed.size());
    ++runs;
    for (int m = 0; m < 200 && !seed.empty(); ++m) {
      std::string x = seed;
      const int flips = 1 + static_cast<int>(rng() % 4);
      for (int k = 0; k < flips; ++k) x[rng() % x.size()] = static_cast<char>(rng());
      if (rng() % 4 == 0) x.resize(rng() % (x.size() + 1));
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(x.data()), x.size());
      ++runs;
    }
  }
  std::printf("%zu seeds, %llu inputs replayed without a crash\n", files.size(),
              static_cast<unsigned long long>(runs));
  return 0;
}
