#include "worker/generation.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "worker/data/tokenizer.h"

namespace isthmus::worker {

TextCodec::TextCodec(std::unique_ptr<data::BpeTokenizer> bpe) : bpe_(std::move(bpe)) {}

int TextCodec::vocab_size() const {
  return bpe_ ? bpe_->vocab_size() : data::ByteTokenizer::kVocabSize;
}

Result<std::vector<int32_t>> TextCodec::Encode(const std::string& text) const {
  if (bpe_) return bpe_->Encode(text);
  std::vector<int32_t> ids;
  for (uint16_t t : data::ByteTokenizer::Encode(text)) ids.push_back(t);
  return ids;
}

Result<std::string> TextCodec::Decode(std::span<const int32_t> ids) const {
  if (bpe_) return bpe_->Decode(std::vector<int32_t>(ids.begin(), ids.end()));
  std::vector<uint16_t> bytes(ids.begin(), ids.end());
  return data::ByteTokenizer::Decode(bytes);
}

Generator::Generator(model::Gpt& gpt, const TextCodec& codec, const Sampling& sampling)
    : gpt_(gpt),
      codec_(codec),
      sampling_(sampling),
      rng_(sampling.seed),
      ranked_(static_cast<size_t>(codec.vocab_size())) {}

Status Generator::Extend(std::vector<int32_t>& ids, bool stop_at_blank_line) {
  const size_t n_ctx = static_cast<size_t>(gpt_.config().n_ctx);
  const int vocab = gpt_.config().vocab_size, tok_vocab = codec_.vocab_size();
  const size_t start = ids.size();
  for (int n = 0; n < sampling_.max_tokens; ++n) {
    const int T = static_cast<int>(std::min(ids.size(), n_ctx));
    gpt_.Forward(ids.data() + ids.size() - T, nullptr, 1, T);
    ISTHMUS_RETURN_IF_ERROR(gpt_.ops().status());
    const std::vector<float> logits = gpt_.Logits();
    const float* last = logits.data() + static_cast<size_t>(T - 1) * vocab;
    for (int v = 0; v < tok_vocab; ++v) ranked_[v] = {last[v], v};
    int next = 0;
    if (sampling_.temperature == 0) {
      next = std::max_element(ranked_.begin(), ranked_.end())->second;
    } else {
      const int k = sampling_.top_k > 0 ? std::min(sampling_.top_k, tok_vocab) : tok_vocab;
      std::partial_sort(ranked_.begin(), ranked_.begin() + k, ranked_.end(),
                        [](const auto& x, const auto& y) { return x.first > y.first; });
      std::vector<double> p(k);
      for (int i = 0; i < k; ++i) {
        p[i] = std::exp((ranked_[i].first - ranked_[0].first) / sampling_.temperature);
      }
      next = ranked_[std::discrete_distribution<int>(p.begin(), p.end())(rng_)].second;
    }
    ids.push_back(next);
    if (stop_at_blank_line) {
      auto tail = codec_.Decode(std::span<const int32_t>(ids).subspan(start));
      if (tail.ok() && tail->find("\n\n") != std::string::npos) break;
    }
  }
  return Status::Ok();
}

Result<std::string> Generator::Translate(const std::string& source, const std::string& language) {
  ISTHMUS_ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                           codec_.Encode("en: " + source + "\n" + language + ": "));
  const size_t prompt_len = ids.size();
  ISTHMUS_RETURN_IF_ERROR(Extend(ids, /*stop_at_blank_line=*/true));
  ISTHMUS_ASSIGN_OR_RETURN(std::string text,
                           codec_.Decode(std::span<const int32_t>(ids).subspan(prompt_len)));
  return text.substr(0, text.find("\n\n"));
}

Result<std::vector<TranslationPair>> ReadTranslationPairs(const std::string& path,
                                                          size_t max_lines) {
  std::ifstream in(path);
  if (!in) return Status::NotFound(path + ": cannot open");
  std::vector<TranslationPair> pairs;
  int line_no = 0;
  for (std::string line; pairs.size() < max_lines && std::getline(in, line);) {
    ++line_no;
    if (line.empty()) continue;
    auto row = nlohmann::json::parse(line, nullptr, false);
    if (!row.is_object() || !row.contains("source") || !row["source"].is_string()) {
      return Status::InvalidArgument(path + " line " + std::to_string(line_no) +
                                     ": not a JSON object with a \"source\" string (as "
                                     "isthmus-data parallel's heldout-<language>.jsonl)");
    }
    TranslationPair p;
    p.source = row["source"].get<std::string>();
    if (row.contains("target") && row["target"].is_string()) {
      p.reference = row["target"].get<std::string>();
      p.has_reference = true;
    }
    pairs.push_back(std::move(p));
  }
  return pairs;
}

std::string TranslationJsonLine(const TranslationPair& pair, const std::string& translation) {
  nlohmann::json line = {{"source", pair.source}, {"translation", translation}};
  if (pair.has_reference) line["reference"] = pair.reference;
  return line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace isthmus::worker
