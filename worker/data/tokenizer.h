// The built-in tokenizer: one token per byte (vocabulary 256), so any text in any language
// and encoding round-trips exactly and no vocabulary file has to travel between sites.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace isthmus::data {

// Stateless; all members are static and thread-safe.
class ByteTokenizer {
 public:
  static constexpr int kVocabSize = 256;

  // Token i is byte i: "Ä" in UTF-8 becomes {0xC3, 0x84}. Never fails.
  static std::vector<uint16_t> Encode(std::string_view text);

  // The inverse of Encode. InvalidArgument naming the position if a token is >= 256.
  static Result<std::string> Decode(std::span<const uint16_t> tokens);
};

}  // namespace isthmus::data
