// Fuzz target: the server's TOML config loader and its validation on a hostile file.
#include <cstddef>
#include <cstdint>

#include "server/config/config.h"
#include "tests/fuzz/fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  isthmus::fuzz::InputFile file(data, size);
  if (!file.ok()) return 0;
  auto config = isthmus::LoadServerConfig(file.path(), {});
  if (config.ok()) (void)isthmus::ValidateServerConfig(*config);
  return 0;
}
