// Builds train/val token shards and their manifest from text files.
#include "worker/data/shard_builder.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "common/durable.h"
#include "common/sha256.h"
#include "worker/data/bpe_tokenizer.h"
#include "worker/data/parallel_corpus.h"
#include "worker/data/token_dataset.h"
#include "worker/data/tokenizer.h"

namespace isthmus::data {
namespace {

static_assert(std::endian::native == std::endian::little,
              "shards are little-endian; a big-endian port needs byte swaps here");

constexpr uint64_t kMaxTextBytes = uint64_t{4} << 30;

std::string ErrnoText() { return std::strerror(errno); }

Status ReadRawFile(const std::string& path, std::string* bytes) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return Status::NotFound(path + ": no such file");
  if (!std::filesystem::is_regular_file(path, ec)) {
    return Status::InvalidArgument(path + ": not a regular file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IoError(path + ": cannot open: " + ErrnoText());
  bytes->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (in.bad()) return Status::IoError(path + ": read failed");
  return Status::Ok();
}

Result<std::string> Gunzip(const std::string& path, const std::string& compressed) {
  std::string out;
  z_stream zs{};
  // 15 + 32: accept a zlib or gzip header, detected automatically.
  if (inflateInit2(&zs, 15 + 32) != Z_OK) return Status::Internal("inflateInit2 failed");
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(compressed.data()));
  zs.avail_in = static_cast<uInt>(compressed.size());
  char buf[1 << 16];
  int rc = Z_OK;
  while (true) {
    zs.next_out = reinterpret_cast<Bytef*>(buf);
    zs.avail_out = sizeof(buf);
    rc = inflate(&zs, Z_NO_FLUSH);
    if (rc != Z_OK && rc != Z_STREAM_END) break;
    out.append(buf, sizeof(buf) - zs.avail_out);
    if (out.size() > kMaxTextBytes) {
      inflateEnd(&zs);
      return Status::ResourceExhausted(path + ": more than 4 GiB of text after gunzip");
    }
    if (rc == Z_STREAM_END) {
      if (zs.avail_in == 0) break;
      // Another gzip member follows (as `cat a.gz b.gz` makes).
      if (inflateReset(&zs) != Z_OK) break;
    } else if (zs.avail_in == 0 && zs.avail_out != 0) {
      rc = Z_BUF_ERROR;  // input ended inside a stream
      break;
    }
  }
  inflateEnd(&zs);
  if (rc != Z_STREAM_END) {
    return Status::Corruption(path + ": damaged or truncated gzip data");
  }
  return out;
}

Status WriteFileAtomic(const std::string& path, const void* data, size_t size) {
  std::string tmp = path + ".tmp.XXXXXX";
  int fd = ::mkstemp(tmp.data());
  if (fd < 0) return Status::IoError(path + ": cannot create temporary file: " + ErrnoText());
  Status s;
  const auto* p = static_cast<const char*>(data);
  size_t left = size;
  while (s.ok() && left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) s = Status::IoError(tmp + ": write failed: " + ErrnoText());
    if (n > 0) {
      p += n;
      left -= static_cast<size_t>(n);
    }
  }
  if (s.ok() && ::fchmod(fd, 0644) != 0) s = Status::IoError(tmp + ": chmod: " + ErrnoText());
  if (s.ok() && ::fsync(fd) != 0) s = Status::IoError(tmp + ": fsync: " + ErrnoText());
  if (::close(fd) != 0 && s.ok()) s = Status::IoError(tmp + ": close: " + ErrnoText());
  if (s.ok()) s = RenameDurably(tmp, path);
  if (!s.ok()) ::unlink(tmp.c_str());
  return s;
}

// Writes `tokens` as a shard of `width`-byte tokens; fills stats->tokens and sha256.
Status WriteTokenShard(const std::string& path, const std::vector<uint32_t>& tokens, int width,
                       ShardStats* stats) {
  stats->tokens = tokens.size();
  std::vector<uint16_t> narrow;
  const void* data = tokens.data();
  if (width == 2) {
    narrow.assign(tokens.begin(), tokens.end());
    data = narrow.data();
  }
  const size_t bytes = tokens.size() * width;
  Sha256 h;
  h.Update(data, bytes);
  stats->sha256 = h.HexDigest();
  return WriteFileAtomic(path, data, bytes);
}

nlohmann::ordered_json ShardJson(const char* file, const ShardStats& s) {
  return nlohmann::ordered_json{
      {"file", file}, {"tokens", s.tokens}, {"documents", s.documents}, {"sha256", s.sha256}};
}

// manifest.json, written last, then the folder synced so that every rename is durable.
Status WriteManifest(const std::string& out_dir, const nlohmann::ordered_json& manifest) {
  const std::string text = manifest.dump(2) + "\n";
  ISTHMUS_RETURN_IF_ERROR(WriteFileAtomic(out_dir + "/manifest.json", text.data(), text.size()));
  int dfd = ::open(out_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0 || ::fsync(dfd) != 0) {
    if (dfd >= 0) ::close(dfd);
    return Status::IoError(out_dir + ": fsync of the folder failed: " + ErrnoText());
  }
  ::close(dfd);
  return Status::Ok();
}

bool IsBlank(std::string_view line) {
  return line.find_first_not_of(" \t\r") == std::string_view::npos;
}

// Text -> token ids: bytes, or the BPE when `bpe` is set.
struct Encoder {
  BpeTokenizer* bpe = nullptr;

  Status Append(std::string_view text, std::vector<uint32_t>* out) const {
    if (bpe == nullptr) {
      std::vector<uint16_t> t = ByteTokenizer::Encode(text);
      out->insert(out->end(), t.begin(), t.end());
      return Status::Ok();
    }
    ISTHMUS_ASSIGN_OR_RETURN(std::vector<int32_t> ids, bpe->Encode(text));
    out->insert(out->end(), ids.begin(), ids.end());
    return Status::Ok();
  }
};

struct ShardBuffer {
  std::vector<uint32_t> tokens;
  uint64_t documents = 0;

  Status Add(std::string_view doc, const Encoder& encoder) {
    if (documents > 0) ISTHMUS_RETURN_IF_ERROR(encoder.Append(kDocumentSeparator, &tokens));
    ISTHMUS_RETURN_IF_ERROR(encoder.Append(doc, &tokens));
    ++documents;
    return Status::Ok();
  }
};

}  // namespace

Result<std::string> ReadTextFile(const std::string& path, std::string* raw_sha256) {
  // An out-parameter rather than a Result: GCC 12 warns falsely about moving the string
  // out of the variant.
  std::string raw;
  ISTHMUS_RETURN_IF_ERROR(ReadRawFile(path, &raw));
  if (raw_sha256 != nullptr) {
    Sha256 h;
    h.Update(raw.data(), raw.size());
    *raw_sha256 = h.HexDigest();
  }
  if (std::string_view(raw).starts_with("\x1f\x8b")) {  // gzip magic
    return Gunzip(path, raw);
  }
  if (raw.size() > kMaxTextBytes) {
    return Status::ResourceExhausted(path + ": more than 4 GiB of text");
  }
  return raw;
}

std::vector<std::string_view> SplitDocuments(std::string_view text) {
  std::vector<std::string_view> docs;
  size_t doc_start = std::string_view::npos;
  size_t doc_end = 0;  // end of the last non-blank line of the open document
  size_t pos = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    const size_t line_end = nl == std::string_view::npos ? text.size() : nl;
    std::string_view line = text.substr(pos, line_end - pos);
    if (IsBlank(line)) {
      if (doc_start != std::string_view::npos) {
        docs.push_back(text.substr(doc_start, doc_end - doc_start));
        doc_start = std::string_view::npos;
      }
    } else {
      if (doc_start == std::string_view::npos) doc_start = pos;
      doc_end = line_end;
      // Keep the document free of a trailing '\r' from CRLF text.
      if (doc_end > doc_start && text[doc_end - 1] == '\r') --doc_end;
    }
    pos = nl == std::string_view::npos ? text.size() : nl + 1;
  }
  if (doc_start != std::string_view::npos)
    docs.push_back(text.substr(doc_start, doc_end - doc_start));
  return docs;
}

bool IsValidationDocument(std::string_view document, uint64_t seed, double val_fraction) {
  if (val_fraction <= 0.0) return false;
  if (val_fraction >= 1.0) return true;
  Sha256 h;
  h.Update(&seed, 8);
  h.Update(document.data(), document.size());
  const auto d = h.Digest();
  uint64_t v = 0;
  std::memcpy(&v, d.data(), 8);
  // 2^64 * fraction computed in long double keeps 64 bits of precision on x86-64.
  const long double threshold = static_cast<long double>(val_fraction) * 18446744073709551616.0L;
  return static_cast<long double>(v) < threshold;
}

Result<BuildSummary> BuildShards(const BuildOptions& options) {
  if (options.inputs.empty()) return Status::InvalidArgument("no input files given");
  if (!(options.val_fraction >= 0.0 && options.val_fraction <= 1.0)) {
    return Status::InvalidArgument("val_fraction must be in [0, 1], got " +
                                   std::to_string(options.val_fraction));
  }
  std::error_code ec;
  std::filesystem::create_directories(options.out_dir, ec);
  if (ec) return Status::IoError(options.out_dir + ": cannot create folder: " + ec.message());

  BuildSummary summary;
  Encoder encoder;
  std::unique_ptr<BpeTokenizer> bpe;
  if (!options.tokenizer_dir.empty()) {
    ISTHMUS_ASSIGN_OR_RETURN(bpe, BpeTokenizer::LoadPath(options.tokenizer_dir));
    encoder.bpe = bpe.get();
  }
  ShardBuffer train;
  ShardBuffer val;
  nlohmann::ordered_json sources = nlohmann::ordered_json::array();
  for (const std::string& input : options.inputs) {
    std::string raw_sha;
    ISTHMUS_ASSIGN_OR_RETURN(std::string text, ReadTextFile(input, &raw_sha));
    uint64_t docs = 0;
    for (std::string_view doc : SplitDocuments(text)) {
      ISTHMUS_RETURN_IF_ERROR(
          (IsValidationDocument(doc, options.seed, options.val_fraction) ? val : train)
              .Add(doc, encoder));
      ++docs;
    }
    summary.source_bytes += text.size();
    sources.push_back({{"path", input},
                       {"bytes", std::filesystem::file_size(input, ec)},
                       {"text_bytes", text.size()},
                       {"documents", docs},
                       {"sha256", raw_sha}});
  }

  const int vocab_size = bpe ? bpe->vocab_size() : ByteTokenizer::kVocabSize;
  const int width = TokenBytes(vocab_size);
  summary.train.documents = train.documents;
  summary.val.documents = val.documents;
  ISTHMUS_RETURN_IF_ERROR(
      WriteTokenShard(options.out_dir + "/train.bin", train.tokens, width, &summary.train));
  ISTHMUS_RETURN_IF_ERROR(
      WriteTokenShard(options.out_dir + "/val.bin", val.tokens, width, &summary.val));
  nlohmann::ordered_json manifest = {
      {"format", kShardFormat},
      {"tokenizer", bpe ? bpe->kind() : "byte"},
      {"vocab_size", vocab_size},
      {"token_dtype", width == 4 ? "uint32-le" : "uint16-le"},
      {"document_separator", kDocumentSeparator},
      {"seed", options.seed},
      {"val_fraction", options.val_fraction},
      {"train", ShardJson("train.bin", summary.train)},
      {"val", ShardJson("val.bin", summary.val)},
      {"sources", sources},
  };
  ISTHMUS_RETURN_IF_ERROR(WriteManifest(options.out_dir, manifest));
  return summary;
}

Result<TranslationSummary> BuildTranslationShards(const TranslationOptions& options) {
  if (options.languages.empty()) return Status::InvalidArgument("no language given (e.g. de)");
  for (const std::string& lang : options.languages) {
    if (lang.empty() || lang.find_first_of("/.") != std::string::npos || lang == "en") {
      return Status::InvalidArgument("'" + lang +
                                     "' is not a target language: name a locale "
                                     "folder such as de, fr, es, it or pt_BR");
    }
  }
  if (options.example_tokens < 8) {
    return Status::InvalidArgument("example_tokens must be at least 8, got " +
                                   std::to_string(options.example_tokens));
  }
  if (!(options.val_fraction >= 0.0 && options.val_fraction <= 1.0)) {
    return Status::InvalidArgument("val_fraction must be in [0, 1], got " +
                                   std::to_string(options.val_fraction));
  }
  // Every language is read (and its absence reported) before anything is written.
  std::vector<LanguagePairs> corpora;
  for (const std::string& lang : options.languages) {
    ISTHMUS_ASSIGN_OR_RETURN(LanguagePairs pairs, CollectPairs(options.locale_dir, lang));
    corpora.push_back(std::move(pairs));
  }
  // The teachers' translations (sequence-level distillation), checked whole up front.
  std::map<std::string, std::map<std::string, std::string>> teacher;
  for (const auto& [lang, file] : options.teacher_targets) {
    auto corpus = std::find_if(corpora.begin(), corpora.end(),
                               [&](const LanguagePairs& c) { return c.language == lang; });
    if (corpus == corpora.end()) {
      return Status::InvalidArgument("teacher translations for '" + lang + "' (" + file +
                                     "), a language not being built: add it to --lang");
    }
    std::ifstream in(file);
    if (!in) return Status::NotFound(file + ": cannot open the teacher's translations");
    auto& translations = teacher[lang];
    int line_no = 0;
    for (std::string line; std::getline(in, line);) {
      ++line_no;
      if (line.empty()) continue;
      const auto row = nlohmann::json::parse(line, nullptr, false);
      if (!row.is_object() || !row.contains("source") || !row["source"].is_string() ||
          !row.contains("translation") || !row["translation"].is_string()) {
        return Status::InvalidArgument(
            file + " line " + std::to_string(line_no) +
            ": not a JSON object with \"source\" and \"translation\" strings (as "
            "isthmus-worker generate --translate --input writes them)");
      }
      translations[row["source"].get<std::string>()] = row["translation"].get<std::string>();
    }
    uint64_t missing = 0;
    std::string example;
    for (const MessagePair& pair : corpus->pairs) {
      if (!IsValidationDocument(pair.source, options.seed, options.val_fraction) &&
          !translations.contains(pair.source)) {
        if (missing++ == 0) example = pair.source;
      }
    }
    if (missing > 0) {
      return Status::InvalidArgument(file + " lacks the teacher's translation of " +
                                     std::to_string(missing) + " training messages of '" + lang +
                                     "' (e.g. " + nlohmann::json(example).dump() +
                                     "): translate the whole train-" + lang +
                                     ".jsonl, with the same --seed and "
                                     "--val-fraction");
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(options.out_dir, ec);
  if (ec) return Status::IoError(options.out_dir + ": cannot create folder: " + ec.message());

  Encoder encoder;
  std::unique_ptr<BpeTokenizer> bpe;
  if (!options.tokenizer_dir.empty()) {
    ISTHMUS_ASSIGN_OR_RETURN(bpe, BpeTokenizer::LoadPath(options.tokenizer_dir));
    encoder.bpe = bpe.get();
  }
  std::vector<uint32_t> pad;
  ISTHMUS_RETURN_IF_ERROR(encoder.Append("\n", &pad));
  const size_t t = static_cast<size_t>(options.example_tokens);
  struct Shard {
    std::vector<uint32_t> tokens;
    std::vector<uint8_t> mask;
    uint64_t examples = 0;
  };
  Shard train, val;
  TranslationSummary summary;
  nlohmann::ordered_json languages = nlohmann::ordered_json::object();
  std::vector<uint32_t> prompt, target;
  for (const LanguagePairs& corpus : corpora) {
    TranslationLanguage stats;
    stats.language = corpus.language;
    stats.catalogues = corpus.catalogues.size();
    stats.not_utf8_catalogues = corpus.not_utf8.size();
    stats.messages = corpus.messages;
    stats.pairs = corpus.pairs.size();
    std::string heldout, training;
    const auto taught = teacher.find(corpus.language);
    std::set<std::pair<std::string, std::string>> taught_pairs;
    for (const MessagePair& pair : corpus.pairs) {
      const bool held_out = IsValidationDocument(pair.source, options.seed, options.val_fraction);
      (held_out ? heldout : training) +=
          nlohmann::json{{"source", pair.source}, {"target", pair.target}}.dump() + "\n";
      const std::string* text = &pair.target;
      if (!held_out && taught != teacher.end()) {
        text = &taught->second.at(pair.source);
        if (text->empty() || !taught_pairs.emplace(pair.source, *text).second) {
          ++stats.teacher_dropped;
          continue;
        }
        ++stats.teacher_targets;
      }
      prompt.clear();
      target.clear();
      ISTHMUS_RETURN_IF_ERROR(
          encoder.Append("en: " + pair.source + "\n" + corpus.language + ": ", &prompt));
      ISTHMUS_RETURN_IF_ERROR(encoder.Append(*text + kDocumentSeparator, &target));
      if (prompt.size() + target.size() > t) {
        ++stats.too_long;
        continue;
      }
      Shard& shard = held_out ? val : train;
      shard.tokens.insert(shard.tokens.end(), prompt.begin(), prompt.end());
      shard.tokens.insert(shard.tokens.end(), target.begin(), target.end());
      shard.mask.insert(shard.mask.end(), prompt.size(), 0);
      shard.mask.insert(shard.mask.end(), target.size(), 1);
      const size_t fill = t - prompt.size() - target.size();
      shard.tokens.insert(shard.tokens.end(), fill, pad[0]);
      shard.mask.insert(shard.mask.end(), fill, 0);
      ++shard.examples;
      ++(held_out ? stats.val : stats.train);
      for (size_t i = 0; i < pair.source.size();) {
        const size_t word = pair.source.find_first_not_of(" \t\n\r", i);
        if (word == std::string::npos) break;
        ++stats.source_words;
        i = pair.source.find_first_of(" \t\n\r", word);
      }
    }
    ISTHMUS_RETURN_IF_ERROR(
        WriteFileAtomic(options.out_dir + "/heldout-" + corpus.language + ".jsonl", heldout.data(),
                        heldout.size()));
    ISTHMUS_RETURN_IF_ERROR(
        WriteFileAtomic(options.out_dir + "/train-" + corpus.language + ".jsonl", training.data(),
                        training.size()));
    languages[corpus.language] = {{"catalogues", stats.catalogues},
                                  {"catalogues_not_utf8", corpus.not_utf8},
                                  {"messages", stats.messages},
                                  {"dropped_empty", corpus.empty},
                                  {"dropped_untranslated", corpus.untranslated},
                                  {"dropped_duplicates", corpus.duplicates},
                                  {"dropped_bad_utf8", corpus.bad_utf8},
                                  {"pairs", stats.pairs},
                                  {"too_long", stats.too_long},
                                  {"train_examples", stats.train},
                                  {"val_examples", stats.val},
                                  {"source_words", stats.source_words},
                                  {"heldout_file", "heldout-" + corpus.language + ".jsonl"},
                                  {"train_file", "train-" + corpus.language + ".jsonl"}};
    if (taught != teacher.end()) {
      languages[corpus.language]["teacher_targets"] = {
          {"file", options.teacher_targets.at(corpus.language)},
          {"replaced", stats.teacher_targets},
          {"dropped", stats.teacher_dropped}};
    }
    summary.languages.push_back(stats);
  }
  if (train.examples + val.examples == 0) {
    return Status::FailedPrecondition("no message pair fits " + std::to_string(t) +
                                      " tokens: raise the example length (--seq-len)");
  }
  const int vocab_size = bpe ? bpe->vocab_size() : ByteTokenizer::kVocabSize;
  const int width = TokenBytes(vocab_size);
  nlohmann::ordered_json masks = nlohmann::ordered_json::object();
  for (auto [shard, name, stats] :
       {std::tuple{&train, "train", &summary.train}, std::tuple{&val, "val", &summary.val}}) {
    // The last slot's window reads one token past it: a padding token, not learned.
    shard->tokens.push_back(pad[0]);
    shard->mask.push_back(0);
    stats->documents = shard->examples;
    ISTHMUS_RETURN_IF_ERROR(
        WriteTokenShard(options.out_dir + "/" + name + ".bin", shard->tokens, width, stats));
    Sha256 h;
    h.Update(shard->mask.data(), shard->mask.size());
    const std::string mask_file = std::string(name) + ".mask";
    masks[name] = {{"file", mask_file}, {"sha256", h.HexDigest()}};
    ISTHMUS_RETURN_IF_ERROR(
        WriteFileAtomic(options.out_dir + "/" + mask_file, shard->mask.data(), shard->mask.size()));
  }
  nlohmann::ordered_json manifest = {
      {"format", kShardFormat},
      {"task", "translate"},
      {"tokenizer", bpe ? bpe->kind() : "byte"},
      {"vocab_size", vocab_size},
      {"token_dtype", width == 4 ? "uint32-le" : "uint16-le"},
      {"example_tokens", options.example_tokens},
      {"template", {{"prompt", "en: {source}\n{language}: "}, {"target", "{target}\n\n"}}},
      {"seed", options.seed},
      {"val_fraction", options.val_fraction},
      {"locale_dir", options.locale_dir},
      {"train", ShardJson("train.bin", summary.train)},
      {"val", ShardJson("val.bin", summary.val)},
      {"loss_mask", masks},
      {"languages", languages},
  };
  ISTHMUS_RETURN_IF_ERROR(WriteManifest(options.out_dir, manifest));
  return summary;
}

}  // namespace isthmus::data
