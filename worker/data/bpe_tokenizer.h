// GPT-2's byte-level BPE tokenizer, read from a vocabulary (token -> id, JSON) and a merge
// list (one "a b" pair per line, best first), the files a Hugging Face GPT-2 folder holds
// as vocab.json and merges.txt (OpenAI's release names them encoder.json and vocab.bpe).
//
// Encoding follows GPT-2: the text (UTF-8) is split by GPT-2's pattern ('s 't 're 've 'm
// 'll 'd, optionally-space-led runs of letters, of digits, of other non-space characters,
// and whitespace runs) using ICU's regular expressions for the Unicode classes; each
// piece's bytes are mapped one to one onto printable code points, and adjacent symbols are
// merged, the pair of lowest merge rank first, until no listed pair is left; each final
// symbol is a vocabulary token. Decoding maps the tokens back to bytes exactly, so any
// text round-trips. Not thread-safe (a per-object cache of encoded pieces).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"

namespace isthmus::data {

class BpeTokenizer {
 public:
  // From a folder holding vocab.json + merges.txt (or encoder.json + vocab.bpe). NotFound
  // when neither pair is there; InvalidArgument for a malformed file, naming it.
  static Result<std::unique_ptr<BpeTokenizer>> LoadFolder(const std::string& dir);
  static Result<std::unique_ptr<BpeTokenizer>> Load(const std::string& vocab_json,
                                                    const std::string& merges_txt);

  // Token ids of `text` (UTF-8; invalid sequences are encoded by their bytes as well:
  // nothing is dropped). InvalidArgument if a symbol is missing from the vocabulary.
  Result<std::vector<int32_t>> Encode(std::string_view text);
  // The bytes of `ids`. InvalidArgument naming the first id outside the vocabulary.
  Result<std::string> Decode(std::span<const int32_t> ids) const;

  // One more than the largest id.
  int vocab_size() const { return vocab_size_; }

 private:
  BpeTokenizer() = default;
  // The ids of one pre-tokenized piece.
  Status EncodePiece(std::string_view piece, std::vector<int32_t>* out);

  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> tokens_;                    // id -> token (byte-mapped UTF-8)
  std::unordered_map<std::string, int> ranks_;         // "a b" -> merge rank
  std::string byte_symbol_[256];                       // byte -> its printable code point
  std::unordered_map<uint32_t, uint8_t> symbol_byte_;  // code point -> byte
  std::unordered_map<std::string, std::vector<int32_t>> cache_;
  int vocab_size_ = 0;
};

}  // namespace isthmus::data
