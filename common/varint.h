// LEB128 varints: 7 bits per byte, low bits first, the high bit set on every byte but the
// last. Used by the codec's streams (ops/codec.cc) and packed peer deltas' sizes
// (schemas/isthmus.fbs, PeerDelta). Only the canonical (shortest) form is read back.
#pragma once

#include <cstdint>
#include <string>

namespace isthmus {

inline void PutVarint(std::string* s, uint64_t v) {
  while (v >= 0x80) {
    s->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  s->push_back(static_cast<char>(v));
}

// Reads one varint from [*p, end) and advances *p past it. False (and *p unspecified) on
// truncated input, a value over 64 bits, or an overlong encoding.
inline bool ReadVarint(const uint8_t** p, const uint8_t* end, uint64_t* v) {
  uint64_t r = 0;
  for (int i = 0; i < 10; ++i) {
    if (*p >= end) return false;
    const uint8_t b = *(*p)++;
    if (i == 9 && b > 1) return false;  // would overflow 64 bits
    r |= uint64_t{b & 0x7fu} << (7 * i);
    if (!(b & 0x80)) {
      if (i > 0 && b == 0) return false;  // non-canonical (overlong) encoding
      *v = r;
      return true;
    }
  }
  return false;
}

}  // namespace isthmus
