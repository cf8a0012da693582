// Turns a site's text files into token shards that workers train on: documents are
// assigned to train or validation by a hash of their content, so the split is the same on
// every machine and every run, and the same paragraph never lands on both sides.
//
// Output folder layout (format "isthmus-tokens-v1"):
//   train.bin, val.bin  tokens as little-endian uint16 (uint32 for a vocabulary above
//                       65,536 ids, TokenBytes), documents joined by "\n\n"
//   manifest.json       tokenizer ("byte", "gpt2-bpe" or "tokenizer.json"), vocab_size,
//                       token_dtype, token and document counts, SHA-256 of each shard,
//                       source files with sizes and SHA-256, seed, val_fraction
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace isthmus::data {

inline constexpr char kShardFormat[] = "isthmus-tokens-v1";
inline constexpr char kDocumentSeparator[] = "\n\n";

struct BuildOptions {
  std::vector<std::string> inputs;  // text files, plain or gzip (detected by magic bytes)
  std::string out_dir;              // created if missing; existing shards are replaced
  double val_fraction = 0.05;       // share of documents sent to val.bin, in [0, 1]
  uint64_t seed = 1;                // changes which documents go to validation
  // Empty: one token per byte (vocabulary 256). Else a byte-level BPE (BpeTokenizer::
  // LoadPath): a Hugging Face folder with tokenizer.json or vocab.json + merges.txt, or a
  // tokenizer.json file.
  std::string tokenizer_dir;
};

struct ShardStats {
  uint64_t tokens = 0;
  uint64_t documents = 0;
  std::string sha256;  // of the .bin file's bytes
};

struct BuildSummary {
  ShardStats train;
  ShardStats val;
  uint64_t source_bytes = 0;  // total text bytes after decompression
};

// Reads a whole text file, gunzipping it when it starts with the gzip magic (several
// concatenated gzip members are read as one text). NotFound / IoError for the file,
// Corruption for a damaged gzip stream, ResourceExhausted above 4 GiB of text.
// `raw_sha256` (optional) receives the hex SHA-256 of the file's bytes as stored.
Result<std::string> ReadTextFile(const std::string& path, std::string* raw_sha256 = nullptr);

// Splits text into documents: maximal runs of lines that are not blank (blank = only
// spaces, tabs and '\r'). A document keeps its inner newlines and has no trailing
// newline. The views point into `text`.
std::vector<std::string_view> SplitDocuments(std::string_view text);

// True when `document` belongs to the validation split: the first 8 bytes of
// SHA-256(seed as 8 little-endian bytes || document) read as a little-endian integer fall
// below val_fraction * 2^64. Deterministic across machines and runs.
bool IsValidationDocument(std::string_view document, uint64_t seed, double val_fraction);

// Builds the shards and manifest described above from `options.inputs`, in input order
// then document order. Output files are written atomically (temporary file + fsync +
// rename). The same inputs, seed and fraction give byte-identical train.bin and val.bin.
// InvalidArgument for a fraction outside [0, 1] or no inputs; errors of ReadTextFile.
Result<BuildSummary> BuildShards(const BuildOptions& options);

// The translation task (isthmus-data parallel): English -> `languages` message pairs from
// the machine's gettext catalogues (parallel_corpus.h), one example per pair:
//   "en: <source>\n<lang>: " then "<translation>\n\n"
// tokenized as two parts and laid out in slots of exactly `example_tokens` (T) tokens,
// padded after the example (an example longer than T is left out and counted), plus one
// padding token at the end of each shard, so that window w of a T-token reader (token_
// dataset.h) is slot w. Beside each shard a loss mask (train.mask, val.mask): one byte per
// token, 1 where the token is a target to learn (the translation and its end), 0 for the
// prompt and the padding; the reader turns every other target into -1 (no loss). A pair
// is held out (val.bin, and heldout-<lang>.jsonl with the text for evaluation) when
// IsValidationDocument(its English source, seed, val_fraction): the same message is on
// the same side in every language and every run. The training pairs are written as text
// too (train-<lang>.jsonl), for a teacher to translate (teacher_targets). The manifest
// adds "task": "translate", "example_tokens", the template, the masks' SHA-256 and the
// counts per language.
struct TranslationOptions {
  std::string locale_dir = "/usr/share/locale";
  std::vector<std::string> languages;  // e.g. {"de", "fr"}
  std::string out_dir;
  std::string tokenizer_dir;  // as BuildOptions: empty = bytes
  int example_tokens = 256;   // T: isthmus-worker's --context must equal it
  double val_fraction = 0.05;
  uint64_t seed = 1;
  // Sequence-level distillation: language -> a teacher's translations of that language's
  // training pairs (JSON lines with "source" and "translation", as isthmus-worker generate
  // --translate --input train-<lang>.jsonl writes them), which replace the catalogue's
  // translations as the training targets. Held-out pairs keep the catalogue's. Every
  // training source must be in the file; an empty translation drops its pair (counted).
  std::map<std::string, std::string> teacher_targets;
};

struct TranslationLanguage {
  std::string language;
  uint64_t catalogues = 0, not_utf8_catalogues = 0;
  uint64_t messages = 0;         // pairs in the catalogues before cleaning
  uint64_t pairs = 0;            // after cleaning (parallel_corpus.h)
  uint64_t train = 0, val = 0;   // examples written to each shard
  uint64_t too_long = 0;         // pairs left out: longer than example_tokens
  uint64_t source_words = 0;     // English words (whitespace-separated) of the kept pairs
  uint64_t teacher_targets = 0;  // training targets that are a teacher's translation
  uint64_t teacher_dropped = 0;  // training pairs dropped: the teacher's translation was
                                 // empty, or repeats another's of the same source
};

struct TranslationSummary {
  std::vector<TranslationLanguage> languages;
  ShardStats train;  // documents = examples
  ShardStats val;
};

// InvalidArgument for no language, a language that is not a locale folder name, T < 8,
// or a fraction outside [0, 1], or a teacher file for a language not built, that cannot be
// read as JSON lines, or that lacks a training source (naming the file, the line or the
// count and an example); NotFound for a language without catalogues (naming what to
// install); FailedPrecondition when no pair fits T tokens. Nothing is written on error.
Result<TranslationSummary> BuildTranslationShards(const TranslationOptions& options);

}  // namespace isthmus::data
