// Fuzz target: the codec decoder on hostile bytes (what a peer's delta carries). The first
// 2 bytes choose the element count the receiver expects (the job's tensor size).
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "ops/codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const size_t numel = 1 + (data[0] | (data[1] << 8));
  std::vector<float> out(numel);
  const std::string_view bytes(reinterpret_cast<const char*>(data + 2), size - 2);
  const bool decoded = isthmus::codec::Decode(bytes, out).ok();
  // The receiver's check without decoding (codec::Check) must answer as the decode does.
  if (isthmus::codec::Check(bytes, numel).ok() != decoded) __builtin_trap();
  return 0;
}
