// Byte-level BPE tokenizers: GPT-2's, read from its vocabulary (token -> id, JSON) and merge
// list (one "a b" pair per line, best first), the files a Hugging Face GPT-2 folder holds
// as vocab.json and merges.txt (OpenAI's release names them encoder.json and vocab.bpe);
// and the byte-level BPE tokenizers Hugging Face ships as one `tokenizer.json` (GPT-2,
// Llama 3, Qwen2/Qwen3 and others of that kind).
//
// Encoding: the added tokens of a tokenizer.json (special ones such as <|begin_of_text|>
// and plain ones such as Qwen3's <think>) are cut out of the text first, the longest at the
// leftmost place, and each becomes its id; the rest is normalized (NFC, NFKC, NFD, NFKD, or
// none), split by the pre-tokenizer's patterns (GPT-2's 's 't 're 've 'm 'll 'd,
// optionally-space-led runs of letters, of digits, of other non-space characters, and
// whitespace runs, or the file's own regex, such as Llama 3's three-digit groups) using
// ICU's regular expressions for the Unicode classes; each piece's bytes are mapped one to
// one onto printable code points and, unless the file says `ignore_merges` and the whole
// piece is a token, adjacent symbols are merged, the pair of lowest merge rank first,
// until no listed pair is left; each final symbol is a vocabulary token. Decoding maps the
// tokens back to bytes exactly (an added token to its text), so any text round-trips. No
// post-processing is applied: Encode adds no begin-of-text token.
//
// What a tokenizer.json may hold: model BPE without byte fallback or word affixes;
// normalizer null, NFC/NFKC/NFD/NFKD or a Sequence of them; pre-tokenizer ByteLevel, Split
// (a Regex or String pattern, behavior Isolated) or a Sequence of them with one ByteLevel;
// decoder ByteLevel or null. Anything else (SentencePiece-style Metaspace and byte
// fallback, WordPiece, Unigram) is refused by name when the file is loaded.
//
// Not thread-safe (a per-object cache of encoded pieces).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"

#include <unicode/uversion.h>

U_NAMESPACE_BEGIN
class RegexPattern;
class Normalizer2;
U_NAMESPACE_END

namespace isthmus::data {

class BpeTokenizer {
 public:
  ~BpeTokenizer();

  // From a folder holding tokenizer.json, else vocab.json + merges.txt (or encoder.json +
  // vocab.bpe). NotFound when none is there; InvalidArgument for a malformed or unsupported
  // file, naming it.
  static Result<std::unique_ptr<BpeTokenizer>> LoadFolder(const std::string& dir);
  // A folder (as LoadFolder) or a tokenizer.json file.
  static Result<std::unique_ptr<BpeTokenizer>> LoadPath(const std::string& path);
  static Result<std::unique_ptr<BpeTokenizer>> Load(const std::string& vocab_json,
                                                    const std::string& merges_txt);
  static Result<std::unique_ptr<BpeTokenizer>> LoadTokenizerJson(const std::string& path);

  // Token ids of `text` (UTF-8; invalid sequences are encoded by their bytes as well:
  // nothing is dropped). InvalidArgument if a symbol is missing from the vocabulary.
  Result<std::vector<int32_t>> Encode(std::string_view text);
  // The bytes of `ids`. InvalidArgument naming the first id outside the vocabulary.
  Result<std::string> Decode(std::span<const int32_t> ids) const;

  // One more than the largest id (added tokens included).
  int vocab_size() const { return vocab_size_; }
  // "gpt2-bpe" for vocab.json + merges.txt, "tokenizer.json" for a tokenizer.json.
  const std::string& kind() const { return kind_; }
  // The id of an added token ("<|end_of_text|>"), if the tokenizer has it.
  std::optional<int32_t> AddedTokenId(std::string_view content) const;

 private:
  struct Added {
    std::string content;
    int32_t id = 0;
    bool lstrip = false;  // also takes the whitespace before it
    bool rstrip = false;  // and after it
  };

  BpeTokenizer();
  void MapBytes();
  Status SetVocab(const std::string& path, const void* json_object);
  // Encodes text with no added tokens in it: normalizes, splits, encodes the pieces.
  Status EncodePlain(std::string_view text, std::vector<int32_t>* out);
  // Encodes valid UTF-8 (after normalization): splits by the patterns in turn.
  Status EncodeSplit(std::string_view text, size_t pattern, std::vector<int32_t>* out);
  // The ids of one pre-tokenized piece.
  Status EncodePiece(std::string_view piece, std::vector<int32_t>* out);

  std::string kind_;
  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> tokens_;                    // id -> token (byte-mapped UTF-8)
  std::unordered_map<std::string, int> ranks_;         // "a b" -> merge rank
  std::string byte_symbol_[256];                       // byte -> its printable code point
  std::unordered_map<uint32_t, uint8_t> symbol_byte_;  // code point -> byte
  std::unordered_map<std::string, std::vector<int32_t>> cache_;
  std::vector<std::unique_ptr<icu::RegexPattern>> patterns_;  // applied in turn
  std::vector<const icu::Normalizer2*> normalizers_;          // applied in turn
  std::vector<Added> added_;                                  // longest first
  std::unordered_map<int32_t, size_t> added_by_id_;           // id -> index in added_
  bool added_first_byte_[256] = {};                           // some added token starts so
  bool add_prefix_space_ = false;
  bool ignore_merges_ = false;
  int vocab_size_ = 0;
};

}  // namespace isthmus::data
