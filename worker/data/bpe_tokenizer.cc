// Byte-level BPE tokenizers (see bpe_tokenizer.h).
#include "worker/data/bpe_tokenizer.h"

#include <unicode/normalizer2.h>
#include <unicode/regex.h>
#include <unicode/unistr.h>
#include <unicode/utf8.h>

#include <algorithm>
#include <climits>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace isthmus::data {
namespace {

// GPT-2's pre-tokenization pattern.
constexpr char kPattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string CodePointUtf8(uint32_t cp) {
  std::string out;
  icu::UnicodeString(static_cast<UChar32>(cp)).toUTF8String(out);
  return out;
}

Result<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound(path + ": cannot open");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// "a b": two non-empty symbols and one space (the merge lists' line format).
bool IsMergePair(const std::string& pair) {
  const auto space = pair.find(' ');
  return space != std::string::npos && space != 0 && space + 1 != pair.size() &&
         pair.find(' ', space + 1) == std::string::npos;
}

Result<std::unique_ptr<icu::RegexPattern>> Compile(const std::string& pattern,
                                                   const std::string& where) {
  UErrorCode status = U_ZERO_ERROR;
  UParseError error;
  std::unique_ptr<icu::RegexPattern> p(
      icu::RegexPattern::compile(icu::UnicodeString::fromUTF8(pattern), error, status));
  if (U_FAILURE(status) || !p) {
    return Status::InvalidArgument(where + ": ICU cannot compile the pattern \"" + pattern +
                                   "\" (" + u_errorName(status) + " at offset " +
                                   std::to_string(error.offset) + ")");
  }
  return p;
}

// A normalizer of a tokenizer.json by its type.
Result<const icu::Normalizer2*> NormalizerNamed(const std::string& type, const std::string& where) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = nullptr;
  if (type == "NFC") n = icu::Normalizer2::getNFCInstance(status);
  if (type == "NFD") n = icu::Normalizer2::getNFDInstance(status);
  if (type == "NFKC") n = icu::Normalizer2::getNFKCInstance(status);
  if (type == "NFKD") n = icu::Normalizer2::getNFKDInstance(status);
  if (n == nullptr || U_FAILURE(status)) {
    return Status::InvalidArgument(where + ": normalizer " + type +
                                   " is not supported (NFC, NFD, NFKC, NFKD or none)");
  }
  return n;
}

}  // namespace

BpeTokenizer::BpeTokenizer() = default;
BpeTokenizer::~BpeTokenizer() = default;

void BpeTokenizer::MapBytes() {
  // Bytes that are printable Latin-1 stand for themselves; the others take the code
  // points from 256 up, in byte order (GPT-2's bytes_to_unicode).
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : next++;
    byte_symbol_[b] = CodePointUtf8(cp);
    symbol_byte_[cp] = static_cast<uint8_t>(b);
  }
}

Status BpeTokenizer::SetVocab(const std::string& path, const void* json_object) {
  const auto& vocab = *static_cast<const nlohmann::json*>(json_object);
  if (!vocab.is_object() || vocab.empty()) {
    return Status::InvalidArgument(path + ": the vocabulary is not a JSON object of token -> id");
  }
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
        it.value().get<int64_t>() > INT32_MAX / 2) {
      return Status::InvalidArgument(path + ": token " + it.key() + " has a bad id");
    }
    const int32_t id = it.value().get<int32_t>();
    vocab_[it.key()] = id;
    if (static_cast<size_t>(id) >= tokens_.size()) tokens_.resize(id + 1);
    tokens_[id] = it.key();
  }
  vocab_size_ = static_cast<int>(tokens_.size());
  return Status::Ok();
}

Result<std::unique_ptr<BpeTokenizer>> BpeTokenizer::LoadFolder(const std::string& dir) {
  namespace fs = std::filesystem;
  if (fs::exists(fs::path(dir) / "tokenizer.json")) {
    return LoadTokenizerJson((fs::path(dir) / "tokenizer.json").string());
  }
  for (const auto& [vocab, merges] :
       {std::pair{"vocab.json", "merges.txt"}, std::pair{"encoder.json", "vocab.bpe"}}) {
    if (fs::exists(fs::path(dir) / vocab) && fs::exists(fs::path(dir) / merges)) {
      return Load((fs::path(dir) / vocab).string(), (fs::path(dir) / merges).string());
    }
  }
  return Status::NotFound(dir +
                          ": no tokenizer.json, vocab.json + merges.txt or encoder.json + "
                          "vocab.bpe (a Hugging Face model folder holds one of them)");
}

Result<std::unique_ptr<BpeTokenizer>> BpeTokenizer::LoadPath(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return LoadFolder(path);
  if (!std::filesystem::exists(path, ec))
    return Status::NotFound(path + ": no such file or folder");
  return LoadTokenizerJson(path);
}

Result<std::unique_ptr<BpeTokenizer>> BpeTokenizer::Load(const std::string& vocab_json,
                                                         const std::string& merges_txt) {
  auto t = std::unique_ptr<BpeTokenizer>(new BpeTokenizer());
  t->kind_ = "gpt2-bpe";
  t->MapBytes();
  ISTHMUS_ASSIGN_OR_RETURN(std::string vocab_text, ReadFile(vocab_json));
  auto vocab = nlohmann::json::parse(vocab_text, nullptr, false);
  if (vocab.is_discarded()) {
    return Status::InvalidArgument(vocab_json + ": not a JSON object of token -> id");
  }
  ISTHMUS_RETURN_IF_ERROR(t->SetVocab(vocab_json, &vocab));

  ISTHMUS_ASSIGN_OR_RETURN(std::string merges, ReadFile(merges_txt));
  std::istringstream lines(merges);
  std::string line;
  int rank = 0, number = 0;
  while (std::getline(lines, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    if (!IsMergePair(line)) {
      return Status::InvalidArgument(merges_txt + ":" + std::to_string(number) +
                                     ": not a pair \"a b\"");
    }
    t->ranks_.emplace(line, rank++);
  }
  if (rank == 0) return Status::InvalidArgument(merges_txt + ": no merges");
  ISTHMUS_ASSIGN_OR_RETURN(auto pattern, Compile(kPattern, "GPT-2's pattern"));
  t->patterns_.push_back(std::move(pattern));
  return t;
}

Result<std::unique_ptr<BpeTokenizer>> BpeTokenizer::LoadTokenizerJson(const std::string& path) {
  using nlohmann::json;
  auto t = std::unique_ptr<BpeTokenizer>(new BpeTokenizer());
  t->kind_ = "tokenizer.json";
  t->MapBytes();
  ISTHMUS_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  const json doc = json::parse(text, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) {
    return Status::InvalidArgument(path + ": not a JSON object (a Hugging Face tokenizer.json)");
  }
  auto refuse = [&](const std::string& what) {
    return Status::InvalidArgument(path + ": " + what +
                                   "; isthmus reads byte-level BPE tokenizers (GPT-2, Llama 3, "
                                   "Qwen2/Qwen3 and their kind)");
  };
  auto str = [](const json& j, const char* key) {
    auto it = j.find(key);
    return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  auto flag = [](const json& j, const char* key) {
    auto it = j.find(key);
    return it != j.end() && it->is_boolean() && it->get<bool>();
  };

  // The model: BPE over byte symbols.
  const json& model = doc.contains("model") ? doc["model"] : json();
  if (!model.is_object()) return refuse("no \"model\" object");
  if (str(model, "type") != "BPE" && !(str(model, "type").empty() && model.contains("merges"))) {
    return refuse("model type " + str(model, "type") + " is not supported");
  }
  if (flag(model, "byte_fallback")) {
    return refuse(
        "a BPE with byte_fallback (SentencePiece style, as Llama 2's and Mistral's) is "
        "not supported");
  }
  if (!str(model, "continuing_subword_prefix").empty() ||
      !str(model, "end_of_word_suffix").empty()) {
    return refuse("BPE word prefixes or suffixes are not supported");
  }
  if (!model.contains("vocab")) return refuse("the model has no vocab");
  ISTHMUS_RETURN_IF_ERROR(t->SetVocab(path, &model["vocab"]));
  t->ignore_merges_ = flag(model, "ignore_merges");
  const json& merges = model.contains("merges") ? model["merges"] : json();
  if (!merges.is_array() || merges.empty()) return refuse("the model has no merges");
  int rank = 0;
  for (const json& m : merges) {
    std::string pair;
    if (m.is_string()) {  // "a b"
      pair = m.get<std::string>();
      if (!IsMergePair(pair)) {
        return Status::InvalidArgument(path + ": merge " + std::to_string(rank) +
                                       " is not a pair \"a b\"");
      }
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      pair = m[0].get<std::string>() + " " + m[1].get<std::string>();  // ["a", "b"]
    } else {
      return Status::InvalidArgument(path + ": merge " + std::to_string(rank) +
                                     " is neither \"a b\" nor [\"a\", \"b\"]");
    }
    t->ranks_.emplace(std::move(pair), rank++);
  }

  // The normalizer.
  const json& normalizer = doc.contains("normalizer") ? doc["normalizer"] : json();
  if (!normalizer.is_null()) {
    std::vector<json> parts{normalizer};
    if (str(normalizer, "type") == "Sequence") {
      const json list = normalizer.value("normalizers", json::array());
      parts.assign(list.begin(), list.end());
    }
    for (const json& n : parts) {
      ISTHMUS_ASSIGN_OR_RETURN(const icu::Normalizer2* norm, NormalizerNamed(str(n, "type"), path));
      t->normalizers_.push_back(norm);
    }
  }

  // The pre-tokenizer: splits, then the byte mapping.
  const json& pre = doc.contains("pre_tokenizer") ? doc["pre_tokenizer"] : json();
  std::vector<json> steps{pre};
  if (str(pre, "type") == "Sequence") {
    const json list = pre.value("pretokenizers", json::array());
    steps.assign(list.begin(), list.end());
  }
  int byte_levels = 0;
  for (const json& step : steps) {
    const std::string type = str(step, "type");
    if (type == "ByteLevel") {
      ++byte_levels;
      t->add_prefix_space_ = flag(step, "add_prefix_space");
      if (step.value("use_regex", true)) {
        ISTHMUS_ASSIGN_OR_RETURN(auto p, Compile(kPattern, path + ": ByteLevel"));
        t->patterns_.push_back(std::move(p));
      }
    } else if (type == "Split") {
      const json& pattern = step.contains("pattern") ? step["pattern"] : json();
      if (str(step, "behavior") != "Isolated" || flag(step, "invert")) {
        return refuse("a Split pre-tokenizer with behavior " + str(step, "behavior") +
                      (flag(step, "invert") ? " (inverted)" : "") +
                      " is not supported (Isolated only)");
      }
      std::string regex;
      if (!str(pattern, "Regex").empty()) {
        regex = str(pattern, "Regex");
      } else if (!str(pattern, "String").empty()) {
        // A literal string: quoted for ICU.
        regex = "\\Q" + str(pattern, "String") + "\\E";
      } else {
        return refuse("a Split pre-tokenizer without a Regex or String pattern");
      }
      ISTHMUS_ASSIGN_OR_RETURN(auto p, Compile(regex, path + ": Split"));
      t->patterns_.push_back(std::move(p));
    } else {
      return refuse("pre-tokenizer " + (type.empty() ? std::string("null") : type) +
                    " is not supported (ByteLevel, Split or a Sequence of them)");
    }
  }
  if (byte_levels != 1) return refuse("the pre-tokenizer has no ByteLevel step");
  const json& decoder = doc.contains("decoder") ? doc["decoder"] : json();
  if (!decoder.is_null() && str(decoder, "type") != "ByteLevel") {
    return refuse("decoder " + str(decoder, "type") + " is not supported (ByteLevel)");
  }

  // Added tokens: cut out of the text before anything else, longest first.
  for (const json& a : doc.value("added_tokens", json::array())) {
    if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() ||
        a["id"].get<int64_t>() < 0 || a["id"].get<int64_t>() > INT32_MAX / 2 ||
        str(a, "content").empty()) {
      return Status::InvalidArgument(path +
                                     ": an added token without content or a good id: " + a.dump());
    }
    if (flag(a, "single_word")) {
      return refuse("added token " + str(a, "content") + " is single_word, not supported");
    }
    Added added{str(a, "content"), a["id"].get<int32_t>(), flag(a, "lstrip"), flag(a, "rstrip")};
    t->vocab_size_ = std::max(t->vocab_size_, added.id + 1);
    t->added_.push_back(std::move(added));
  }
  std::stable_sort(t->added_.begin(), t->added_.end(), [](const Added& x, const Added& y) {
    return x.content.size() > y.content.size();
  });
  for (size_t i = 0; i < t->added_.size(); ++i) {
    t->added_by_id_[t->added_[i].id] = i;
    t->added_first_byte_[static_cast<uint8_t>(t->added_[i].content[0])] = true;
  }
  return t;
}

std::optional<int32_t> BpeTokenizer::AddedTokenId(std::string_view content) const {
  for (const Added& a : added_) {
    if (a.content == content) return a.id;
  }
  return std::nullopt;
}

Status BpeTokenizer::EncodePiece(std::string_view piece, std::vector<int32_t>* out) {
  auto hit = cache_.find(std::string(piece));
  if (hit != cache_.end()) {
    out->insert(out->end(), hit->second.begin(), hit->second.end());
    return Status::Ok();
  }
  std::vector<std::string> symbols;
  for (unsigned char b : piece) symbols.push_back(byte_symbol_[b]);
  if (ignore_merges_ && symbols.size() > 1) {
    std::string whole;
    for (const auto& s : symbols) whole += s;
    if (vocab_.count(whole) != 0) symbols = {std::move(whole)};
  }
  while (symbols.size() > 1) {
    int best = INT_MAX;
    size_t at = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      auto r = ranks_.find(symbols[i] + " " + symbols[i + 1]);
      if (r != ranks_.end() && r->second < best) {
        best = r->second;
        at = i;
      }
    }
    if (best == INT_MAX) break;
    const std::string first = symbols[at], second = symbols[at + 1];
    std::vector<std::string> merged;
    for (size_t i = 0; i < symbols.size();) {
      if (i + 1 < symbols.size() && symbols[i] == first && symbols[i + 1] == second) {
        merged.push_back(first + second);
        i += 2;
      } else {
        merged.push_back(symbols[i++]);
      }
    }
    symbols = std::move(merged);
  }
  std::vector<int32_t> ids;
  for (const auto& s : symbols) {
    auto v = vocab_.find(s);
    if (v == vocab_.end()) {
      return Status::InvalidArgument("symbol \"" + s + "\" is not in the vocabulary");
    }
    ids.push_back(v->second);
  }
  out->insert(out->end(), ids.begin(), ids.end());
  if (cache_.size() < 100000) cache_.emplace(std::string(piece), std::move(ids));
  return Status::Ok();
}

Status BpeTokenizer::EncodeSplit(std::string_view text, size_t pattern, std::vector<int32_t>* out) {
  if (text.empty()) return Status::Ok();
  if (pattern == patterns_.size()) return EncodePiece(text, out);
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(
      icu::StringPiece(text.data(), static_cast<int32_t>(text.size())));
  UErrorCode status = U_ZERO_ERROR;
  std::unique_ptr<icu::RegexMatcher> m(patterns_[pattern]->matcher(u, status));
  if (U_FAILURE(status)) return Status::Internal(std::string("ICU: ") + u_errorName(status));
  // Isolated: each match is a piece, and so is each stretch between matches.
  int32_t done = 0;
  std::string piece;
  auto emit = [&](int32_t from, int32_t to) -> Status {
    if (to <= from) return Status::Ok();
    piece.clear();
    u.tempSubStringBetween(from, to).toUTF8String(piece);
    return EncodeSplit(piece, pattern + 1, out);
  };
  while (m->find(status) && U_SUCCESS(status)) {
    const int32_t start = m->start(status), end = m->end(status);
    ISTHMUS_RETURN_IF_ERROR(emit(done, start));
    ISTHMUS_RETURN_IF_ERROR(emit(start, end));
    done = end;
  }
  if (U_FAILURE(status)) return Status::Internal(std::string("ICU: ") + u_errorName(status));
  return emit(done, u.length());
}

Status BpeTokenizer::EncodePlain(std::string_view text, std::vector<int32_t>* out) {
  if (text.empty()) return Status::Ok();
  std::string prefixed;
  if (add_prefix_space_ && text.front() != ' ') {
    prefixed = " " + std::string(text);
    text = prefixed;
  }
  // Valid UTF-8 runs are normalized and go through the patterns; a byte that starts no
  // valid sequence is a piece of its own (so nothing is lost, though the reference
  // tokenizers never see such bytes).
  size_t run = 0, i = 0;
  auto flush = [&](size_t end) -> Status {
    if (end == run) return Status::Ok();
    std::string_view valid = text.substr(run, end - run);
    std::string normalized;
    for (const icu::Normalizer2* n : normalizers_) {
      UErrorCode status = U_ZERO_ERROR;
      icu::UnicodeString u = n->normalize(icu::UnicodeString::fromUTF8(icu::StringPiece(
                                              valid.data(), static_cast<int32_t>(valid.size()))),
                                          status);
      if (U_FAILURE(status)) {
        return Status::Internal(std::string("ICU normalizer: ") + u_errorName(status));
      }
      normalized.clear();
      u.toUTF8String(normalized);
      valid = normalized;
    }
    return EncodeSplit(valid, 0, out);
  };
  const auto* bytes = reinterpret_cast<const uint8_t*>(text.data());
  const int32_t n = static_cast<int32_t>(text.size());
  while (i < text.size()) {
    int32_t at = static_cast<int32_t>(i);
    UChar32 c;
    U8_NEXT(bytes, at, n, c);
    if (c < 0) {
      ISTHMUS_RETURN_IF_ERROR(flush(i));
      ISTHMUS_RETURN_IF_ERROR(EncodePiece(text.substr(i, 1), out));
      i += 1;
      run = i;
    } else {
      i = static_cast<size_t>(at);
    }
  }
  return flush(text.size());
}

Result<std::vector<int32_t>> BpeTokenizer::Encode(std::string_view text) {
  std::vector<int32_t> out;
  size_t plain = 0;  // start of the text not yet encoded
  auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  for (size_t i = 0; i < text.size() && !added_.empty(); ++i) {
    if (!added_first_byte_[static_cast<uint8_t>(text[i])]) continue;
    const Added* hit = nullptr;
    for (const Added& a : added_) {
      if (text.compare(i, a.content.size(), a.content) == 0) {
        hit = &a;  // longest first
        break;
      }
    }
    if (hit == nullptr) continue;
    size_t before = i, after = i + hit->content.size();
    if (hit->lstrip) {
      while (before > plain && is_space(text[before - 1])) --before;
    }
    if (hit->rstrip) {
      while (after < text.size() && is_space(text[after])) ++after;
    }
    ISTHMUS_RETURN_IF_ERROR(EncodePlain(text.substr(plain, before - plain), &out));
    out.push_back(hit->id);
    plain = after;
    i = after - 1;
  }
  ISTHMUS_RETURN_IF_ERROR(EncodePlain(text.substr(plain), &out));
  return out;
}
Result<std::string> BpeTokenizer::Decode(std::span<const int32_t> ids) const {
  std::string out;
  for (size_t k = 0; k < ids.size(); ++k) {
    const int32_t id = ids[k];
    if (auto a = added_by_id_.find(id); a != added_by_id_.end()) {
      out += added_[a->second].content;
      continue;
    }
    if (id < 0 || static_cast<size_t>(id) >= tokens_.size() || tokens_[id].empty()) {
      return Status::InvalidArgument("token " + std::to_string(id) + " at position " +
                                     std::to_string(k) + " is not in the vocabulary");
    }
    const std::string& t = tokens_[id];
    const auto* b = reinterpret_cast<const uint8_t*>(t.data());
    int32_t at = 0;
    const int32_t n = static_cast<int32_t>(t.size());
    while (at < n) {
      UChar32 c;
      U8_NEXT(b, at, n, c);
      auto it = symbol_byte_.find(static_cast<uint32_t>(c));
      if (c < 0 || it == symbol_byte_.end()) {
        return Status::InvalidArgument("token " + std::to_string(id) +
                                       " holds a symbol that stands for no byte");
      }
      out.push_back(static_cast<char>(it->second));
    }
  }
  return out;
}

}  // namespace isthmus::data
