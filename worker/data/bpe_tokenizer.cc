// GPT-2's byte-level BPE (see bpe_tokenizer.h).
#include "worker/data/bpe_tokenizer.h"

#include <unicode/regex.h>
#include <unicode/unistr.h>
#include <unicode/utf8.h>

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

// The compiled pattern, shared (ICU patterns are immutable and thread-safe to share).
Result<const icu::RegexPattern*> Pattern() {
  static UErrorCode status = U_ZERO_ERROR;
  static std::unique_ptr<icu::RegexPattern> pattern(
      icu::RegexPattern::compile(icu::UnicodeString::fromUTF8(kPattern), 0, status));
  if (U_FAILURE(status) || !pattern) {
    return Status::Internal(std::string("ICU cannot compile GPT-2's pattern: ") +
                            u_errorName(status));
  }
  return pattern.get();
}

}  // namespace

Result<std::unique_ptr<BpeTokenizer>> BpeTokenizer::LoadFolder(const std::string& dir) {
  namespace fs = std::filesystem;
  for (const auto& [vocab, merges] :
       {std::pair{"vocab.json", "merges.txt"}, std::pair{"encoder.json", "vocab.bpe"}}) {
    if (fs::exists(fs::path(dir) / vocab) && fs::exists(fs::path(dir) / merges)) {
      return Load((fs::path(dir) / vocab).string(), (fs::path(dir) / merges).string());
    }
  }
  return Status::NotFound(dir + ": no vocab.json + merges.txt (or encoder.json + vocab.bpe)");
}

Result<std::unique_ptr<BpeTokenizer>> BpeTokenizer::Load(const std::string& vocab_json,
                                                         const std::string& merges_txt) {
  auto t = std::unique_ptr<BpeTokenizer>(new BpeTokenizer());
  // Bytes that are printable Latin-1 stand for themselves; the others take the code
  // points from 256 up, in byte order (GPT-2's bytes_to_unicode).
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : next++;
    t->byte_symbol_[b] = CodePointUtf8(cp);
    t->symbol_byte_[cp] = static_cast<uint8_t>(b);
  }

  ISTHMUS_ASSIGN_OR_RETURN(std::string vocab_text, ReadFile(vocab_json));
  auto vocab = nlohmann::json::parse(vocab_text, nullptr, false);
  if (vocab.is_discarded() || !vocab.is_object() || vocab.empty()) {
    return Status::InvalidArgument(vocab_json + ": not a JSON object of token -> id");
  }
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
        it.value().get<int64_t>() > INT32_MAX / 2) {
      return Status::InvalidArgument(vocab_json + ": token " + it.key() + " has a bad id");
    }
    const int32_t id = it.value().get<int32_t>();
    t->vocab_[it.key()] = id;
    if (static_cast<size_t>(id) >= t->tokens_.size()) t->tokens_.resize(id + 1);
    t->tokens_[id] = it.key();
  }
  t->vocab_size_ = static_cast<int>(t->tokens_.size());

  ISTHMUS_ASSIGN_OR_RETURN(std::string merges, ReadFile(merges_txt));
  std::istringstream lines(merges);
  std::string line;
  int rank = 0, number = 0;
  while (std::getline(lines, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    const auto space = line.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 == line.size() ||
        line.find(' ', space + 1) != std::string::npos) {
      return Status::InvalidArgument(merges_txt + ":" + std::to_string(number) +
                                     ": not a pair \"a b\"");
    }
    t->ranks_.emplace(line, rank++);
  }
  if (rank == 0) return Status::InvalidArgument(merges_txt + ": no merges");
  return t;
}

Status BpeTokenizer::EncodePiece(std::string_view piece, std::vector<int32_t>* out) {
  auto hit = cache_.find(std::string(piece));
  if (hit != cache_.end()) {
    out->insert(out->end(), hit->second.begin(), hit->second.end());
    return Status::Ok();
  }
  std::vector<std::string> symbols;
  for (unsigned char b : piece) symbols.push_back(byte_symbol_[b]);
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

Result<std::vector<int32_t>> BpeTokenizer::Encode(std::string_view text) {
  ISTHMUS_ASSIGN_OR_RETURN(const icu::RegexPattern* pattern, Pattern());
  std::vector<int32_t> out;
  // Valid UTF-8 runs go through the pattern; a byte that starts no valid sequence is a
  // piece of its own (so nothing is lost, though GPT-2 itself never sees such bytes).
  size_t run = 0, i = 0;
  auto flush = [&](size_t end) -> Status {
    if (end == run) return Status::Ok();
    const std::string_view valid = text.substr(run, end - run);
    icu::UnicodeString u = icu::UnicodeString::fromUTF8(
        icu::StringPiece(valid.data(), static_cast<int32_t>(valid.size())));
    UErrorCode status = U_ZERO_ERROR;
    std::unique_ptr<icu::RegexMatcher> m(pattern->matcher(u, status));
    if (U_FAILURE(status)) return Status::Internal(std::string("ICU: ") + u_errorName(status));
    while (m->find(status) && U_SUCCESS(status)) {
      std::string piece;
      u.tempSubStringBetween(m->start(status), m->end(status)).toUTF8String(piece);
      ISTHMUS_RETURN_IF_ERROR(EncodePiece(piece, &out));
    }
    if (U_FAILURE(status)) return Status::Internal(std::string("ICU: ") + u_errorName(status));
    return Status::Ok();
  };
  const auto* bytes = reinterpret_cast<const uint8_t*>(text.data());
  const int32_t n = static_cast<int32_t>(text.size());
  while (i < text.size()) {
    int32_t at = static_cast<int32_t>(i);
    UChar32 c;
    U8_NEXT(bytes, at, n, c);
    if (c < 0) {
      ISTHMUS_RETURN_IF_ERROR(flush(i));
      ISTHMUS_RETURN_IF_ERROR(EncodePiece(text.substr(i, 1), &out));
      i += 1;
      run = i;
    } else {
      i = static_cast<size_t>(at);
    }
  }
  ISTHMUS_RETURN_IF_ERROR(flush(text.size()));
  return out;
}

Result<std::string> BpeTokenizer::Decode(std::span<const int32_t> ids) const {
  std::string out;
  for (size_t k = 0; k < ids.size(); ++k) {
    const int32_t id = ids[k];
    if (id < 0 || id >= vocab_size_ || tokens_[id].empty()) {
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
