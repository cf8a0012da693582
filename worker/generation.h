// Text generation with a model: the tokenizer seen as text in and ids out (a byte-level BPE
// or bytes), sampling one token at a time (greedy, or temperature and top-k), and the
// translation template of isthmus-data parallel. Used by isthmus-worker generate and by the
// round loop's translation sets (train --translate-set).
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "worker/data/bpe_tokenizer.h"
#include "worker/model/gpt.h"

namespace isthmus::worker {

// Text to ids and back: `bpe`'s, or one token per byte without one.
class TextCodec {
 public:
  explicit TextCodec(std::unique_ptr<data::BpeTokenizer> bpe = nullptr);
  int vocab_size() const;
  Result<std::vector<int32_t>> Encode(const std::string& text) const;
  Result<std::string> Decode(std::span<const int32_t> ids) const;

 private:
  std::unique_ptr<data::BpeTokenizer> bpe_;
};

struct Sampling {
  int max_tokens = 200;
  double temperature = 0.0;  // 0: the most likely token every time
  int top_k = 0;             // sample among the k most likely (0: all)
  uint64_t seed = 1;
};

// Samples from `gpt` (reserved for at least one row of n_ctx) through `codec`; both must
// outlive it. Only the codec's ids are ever chosen (a model may pad its vocabulary).
class Generator {
 public:
  Generator(model::Gpt& gpt, const TextCodec& codec, const Sampling& sampling);

  // Appends up to max_tokens tokens to `ids`, each from the softmax of the last position's
  // logits, the window sliding over the last n_ctx tokens; with `stop_at_blank_line`, stops
  // once the continuation holds "\n\n" (the end of a translation example).
  Status Extend(std::vector<int32_t>& ids, bool stop_at_blank_line);

  // The translation of English `source` into `language` by a model trained on
  // isthmus-data parallel's task: the prompt "en: <source>\n<language>: ", then Extend to
  // the blank line; the text before it.
  Result<std::string> Translate(const std::string& source, const std::string& language);

 private:
  model::Gpt& gpt_;
  const TextCodec& codec_;
  Sampling sampling_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int>> ranked_;
};

// One line of a heldout-<language>.jsonl (isthmus-data parallel): the English source and
// the reference translation (empty when the line has none).
struct TranslationPair {
  std::string source;
  std::string reference;
  bool has_reference = false;
};

// The first `max_lines` pairs of `path` (blank lines skipped). NotFound for the file,
// InvalidArgument naming the line that is no JSON object with a "source" string.
Result<std::vector<TranslationPair>> ReadTranslationPairs(const std::string& path,
                                                          size_t max_lines = SIZE_MAX);

// {"source", "translation", "reference"} as one JSON line (invalid UTF-8 replaced), what
// deploy/chrf.py scores.
std::string TranslationJsonLine(const TranslationPair& pair, const std::string& translation);

}  // namespace isthmus::worker
