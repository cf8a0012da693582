// Fuzz target: the safetensors reader (base models, checkpoints, exports) on a hostile file.
#include <cstddef>
#include <cstdint>

#include "common/safetensors.h"
#include "tests/fuzz/fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  isthmus::fuzz::InputFile file(data, size);
  if (!file.ok()) return 0;
  (void)isthmus::ReadSafetensors(file.path());
  (void)isthmus::ReadSafetensorsInfo(file.path());
  return 0;
}
