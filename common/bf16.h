// bfloat16 as its 16 bits (the upper half of an IEEE fp32): the one rounding every layer
// uses (the compute backends, safetensors files, the in-site all-reduce in bf16).
#pragma once

#include <bit>
#include <cstdint>

namespace isthmus {

// Round to nearest, ties to even (as CUDA's __float2bfloat16_rn); a NaN stays a quiet NaN.
inline uint16_t FloatToBf16Bits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float Bf16BitsToFloat(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

}  // namespace isthmus
