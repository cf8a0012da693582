// Encoding speed of isthmus's byte-level BPE (worker/data/bpe_tokenizer.*): each file is
// split into documents as isthmus-data build splits it, and every document is encoded by a
// freshly loaded tokenizer (its piece cache starts empty each repetition; loading is not
// timed). Prints one JSON line per repetition: tokens, bytes, seconds, tokens/s, and a
// digest of the ids so that another implementation's run can be checked to do the same work.
//   bench_tokenizer --tokenizer PATH [--repeat N] FILE...
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "worker/data/bpe_tokenizer.h"
#include "worker/data/shard_builder.h"

int main(int argc, char** argv) {
  std::string tokenizer;
  int repeat = 3;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--tokenizer") && i + 1 < argc) {
      tokenizer = argv[++i];
    } else if (!std::strcmp(argv[i], "--repeat") && i + 1 < argc) {
      repeat = std::atoi(argv[++i]);
    } else if (argv[i][0] == '-') {
      std::fprintf(stderr, "usage: bench_tokenizer --tokenizer PATH [--repeat N] FILE...\n");
      return 2;
    } else {
      files.push_back(argv[i]);
    }
  }
  if (tokenizer.empty() || files.empty() || repeat < 1) {
    std::fprintf(stderr, "usage: bench_tokenizer --tokenizer PATH [--repeat N] FILE...\n");
    return 2;
  }
  std::vector<std::string> texts;
  std::vector<std::string_view> docs;
  for (const auto& f : files) {
    auto t = isthmus::data::ReadTextFile(f);
    if (!t.ok()) {
      std::fprintf(stderr, "bench_tokenizer: %s\n", t.status().ToString().c_str());
      return 1;
    }
    texts.push_back(std::move(t).value());
  }
  uint64_t bytes = 0;
  for (const auto& t : texts) {
    for (auto d : isthmus::data::SplitDocuments(t)) {
      docs.push_back(d);
      bytes += d.size();
    }
  }
  for (int r = 0; r < repeat; ++r) {
    auto tok = isthmus::data::BpeTokenizer::LoadPath(tokenizer);
    if (!tok.ok()) {
      std::fprintf(stderr, "bench_tokenizer: %s\n", tok.status().ToString().c_str());
      return 1;
    }
    uint64_t tokens = 0, digest = 1469598103934665603ull;  // FNV-1a over the ids
    const auto start = std::chrono::steady_clock::now();
    for (auto d : docs) {
      auto ids = (*tok)->Encode(d);
      if (!ids.ok()) {
        std::fprintf(stderr, "bench_tokenizer: %s\n", ids.status().ToString().c_str());
        return 1;
      }
      tokens += ids->size();
      for (int32_t id : *ids) digest = (digest ^ static_cast<uint32_t>(id)) * 1099511628211ull;
    }
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    nlohmann::ordered_json line = {{"impl", "isthmus"},
                                   {"documents", docs.size()},
                                   {"bytes", bytes},
                                   {"tokens", tokens},
                                   {"seconds", s},
                                   {"tokens_per_s", tokens / s},
                                   {"ids_fnv1a", std::to_string(digest)}};
    std::printf("%s\n", line.dump().c_str());
  }
  return 0;
}
