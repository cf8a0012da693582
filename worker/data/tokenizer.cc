// Byte tokenizer: the mapping is the identity on bytes.
#include "worker/data/tokenizer.h"

namespace isthmus::data {

std::vector<uint16_t> ByteTokenizer::Encode(std::string_view text) {
  std::vector<uint16_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

Result<std::string> ByteTokenizer::Decode(std::span<const uint16_t> tokens) {
  std::string text(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= kVocabSize) {
      return Status::InvalidArgument("token " + std::to_string(tokens[i]) + " at position " +
                                     std::to_string(i) + " is outside the byte vocabulary");
    }
    text[i] = static_cast<char>(tokens[i]);
  }
  return text;
}

}  // namespace isthmus::data
