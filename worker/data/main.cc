// isthmus-data: turns a site's text files into the token shards that isthmus-worker reads
// (see shard_builder.h for the format), and prints pieces of a shard back as text.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>

#include "worker/data/bpe_tokenizer.h"
#include "worker/data/shard_builder.h"
#include "worker/data/token_dataset.h"
#include "worker/data/tokenizer.h"

namespace {

int RunBuild(const isthmus::data::BuildOptions& options) {
  auto r = isthmus::data::BuildShards(options);
  if (!r.ok()) {
    std::fprintf(stderr, "isthmus-data build: %s\n", r.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "train.bin: %llu tokens, %llu documents\nval.bin:   %llu tokens, %llu documents\n"
      "wrote %s/{train.bin,val.bin,manifest.json}\n",
      static_cast<unsigned long long>(r->train.tokens),
      static_cast<unsigned long long>(r->train.documents),
      static_cast<unsigned long long>(r->val.tokens),
      static_cast<unsigned long long>(r->val.documents), options.out_dir.c_str());
  return 0;
}

int RunParallel(isthmus::data::TranslationOptions& options,
                const std::vector<std::string>& teacher_targets) {
  for (const std::string& t : teacher_targets) {
    const size_t eq = t.find('=');
    if (eq == 0 || eq == std::string::npos || eq + 1 == t.size()) {
      std::fprintf(stderr, "isthmus-data parallel: --teacher-targets %s: give LANGUAGE=FILE\n",
                   t.c_str());
      return 2;
    }
    options.teacher_targets[t.substr(0, eq)] = t.substr(eq + 1);
  }
  auto r = isthmus::data::BuildTranslationShards(options);
  if (!r.ok()) {
    std::fprintf(stderr, "isthmus-data parallel: %s\n", r.status().ToString().c_str());
    return 1;
  }
  std::printf("%-8s %10s %10s %10s %10s %10s %12s\n", "language", "catalogues", "pairs", "train",
              "held-out", "too long", "en words");
  for (const auto& l : r->languages) {
    std::printf("%-8s %10llu %10llu %10llu %10llu %10llu %12llu\n", l.language.c_str(),
                static_cast<unsigned long long>(l.catalogues),
                static_cast<unsigned long long>(l.pairs), static_cast<unsigned long long>(l.train),
                static_cast<unsigned long long>(l.val), static_cast<unsigned long long>(l.too_long),
                static_cast<unsigned long long>(l.source_words));
  }
  for (const auto& l : r->languages) {
    if (l.teacher_targets + l.teacher_dropped == 0) continue;
    std::printf(
        "%s: %llu training targets are the teacher's translations (%s); %llu pairs "
        "dropped (empty or repeated translation)\n",
        l.language.c_str(), static_cast<unsigned long long>(l.teacher_targets),
        options.teacher_targets.at(l.language).c_str(),
        static_cast<unsigned long long>(l.teacher_dropped));
  }
  std::printf(
      "train.bin: %llu tokens, %llu examples\nval.bin:   %llu tokens, %llu examples\n"
      "wrote %s/{train,val}.{bin,mask}, {train,heldout}-<language>.jsonl and manifest.json "
      "(examples of %d tokens: isthmus-worker train --context %d)\n",
      static_cast<unsigned long long>(r->train.tokens),
      static_cast<unsigned long long>(r->train.documents),
      static_cast<unsigned long long>(r->val.tokens),
      static_cast<unsigned long long>(r->val.documents), options.out_dir.c_str(),
      options.example_tokens, options.example_tokens);
  return 0;
}

// The BPE of `path` (a folder or a tokenizer.json); null, with the reason printed as
// "isthmus-data COMMAND: ...", when it cannot be read.
std::unique_ptr<isthmus::data::BpeTokenizer> LoadBpe(const char* command, const std::string& path) {
  auto bpe = isthmus::data::BpeTokenizer::LoadPath(path);
  if (!bpe.ok()) {
    std::fprintf(stderr, "isthmus-data %s: %s\n", command, bpe.status().ToString().c_str());
    return nullptr;
  }
  return std::move(bpe).value();
}

// Prints the text of `ids` (byte tokens, or the BPE `bpe` when set) and returns 0; else
// prints why, prefixed by `what`, and returns 1.
int PrintDecoded(const char* command, const std::string& what, const std::vector<int32_t>& ids,
                 const isthmus::data::BpeTokenizer* bpe) {
  isthmus::Result<std::string> text = isthmus::Status::Internal("unset");
  if (bpe == nullptr) {
    std::vector<uint16_t> bytes;
    for (int32_t id : ids) bytes.push_back(static_cast<uint16_t>(std::min<int32_t>(id, 65535)));
    text = isthmus::data::ByteTokenizer::Decode(bytes);
  } else {
    text = bpe->Decode(ids);
  }
  if (!text.ok()) {
    std::fprintf(stderr, "isthmus-data %s: %s%s%s\n", command, what.c_str(),
                 text.status().ToString().c_str(),
                 bpe == nullptr ? " (byte tokens; pass --tokenizer for BPE ids)" : "");
    return 1;
  }
  std::cout << *text << "\n";
  return 0;
}

int RunShow(const std::string& path, uint64_t offset, uint64_t count,
            const std::string& tokenizer_path) {
  std::unique_ptr<isthmus::data::BpeTokenizer> bpe;
  if (!tokenizer_path.empty() && (bpe = LoadBpe("show", tokenizer_path)) == nullptr) return 2;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "isthmus-data show: cannot open %s\n", path.c_str());
    return 1;
  }
  // The shard's token width follows the vocabulary (uint32 above 65,536 ids).
  const int width =
      isthmus::data::TokenBytes(bpe ? bpe->vocab_size() : isthmus::data::ByteTokenizer::kVocabSize);
  in.seekg(static_cast<std::streamoff>(offset * width));
  std::vector<char> raw(count * width);
  in.read(raw.data(), static_cast<std::streamsize>(raw.size()));
  std::vector<int32_t> ids(static_cast<size_t>(in.gcount()) / width);
  for (size_t i = 0; i < ids.size(); ++i) {
    uint32_t v = 0;
    std::memcpy(&v, raw.data() + i * width, width);  // little-endian
    ids[i] = static_cast<int32_t>(v);
  }
  return PrintDecoded("show", path + ": ", ids, bpe.get());
}

// The words given, joined by single spaces, or standard input whole when there are none.
std::string TextOf(const std::vector<std::string>& words) {
  if (words.empty()) {
    return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  }
  std::string text;
  for (const auto& w : words) text += (text.empty() ? "" : " ") + w;
  return text;
}

int RunEncode(const std::vector<std::string>& words, const std::string& tokenizer_path) {
  std::unique_ptr<isthmus::data::BpeTokenizer> bpe;
  if (!tokenizer_path.empty() && (bpe = LoadBpe("encode", tokenizer_path)) == nullptr) return 2;
  const std::string text = TextOf(words);
  std::vector<int64_t> ids;
  if (bpe == nullptr) {
    for (uint16_t t : isthmus::data::ByteTokenizer::Encode(text)) ids.push_back(t);
  } else {
    auto encoded = bpe->Encode(text);
    if (!encoded.ok()) {
      std::fprintf(stderr, "isthmus-data encode: %s\n", encoded.status().ToString().c_str());
      return 1;
    }
    ids.assign(encoded->begin(), encoded->end());
  }
  std::string line;
  for (int64_t id : ids) line += (line.empty() ? "" : " ") + std::to_string(id);
  std::printf("%s\n", line.c_str());
  return 0;
}

int RunDecode(const std::vector<std::string>& words, const std::string& tokenizer_path) {
  std::unique_ptr<isthmus::data::BpeTokenizer> bpe;
  if (!tokenizer_path.empty() && (bpe = LoadBpe("decode", tokenizer_path)) == nullptr) return 2;
  // Ids as arguments or on standard input, separated by spaces, commas or new lines.
  std::string text = TextOf(words);
  for (char& c : text) {
    if (c == ',' || c == '[' || c == ']') c = ' ';
  }
  std::istringstream in(text);
  std::vector<int32_t> ids;
  for (std::string word; in >> word;) {
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(word.c_str(), &end, 10);
    if (errno != 0 || *end != '\0' || v < 0 || v > INT32_MAX) {
      std::fprintf(stderr, "isthmus-data decode: '%s' is not a token id (ids are integers >= 0)\n",
                   word.c_str());
      return 2;
    }
    ids.push_back(static_cast<int32_t>(v));
  }
  return PrintDecoded("decode", "", ids, bpe.get());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "isthmus-data: build token shards (train.bin, val.bin, manifest.json) from text files, "
      "deterministically, one token per byte or with a byte-level BPE (GPT-2's, or a Hugging "
      "Face tokenizer.json such as Llama 3's or Qwen's), build the translation task from the "
      "machine's gettext catalogues, inspect shards, and encode or decode a text."};
  app.require_subcommand(1);

  isthmus::data::BuildOptions build;
  CLI::App* b = app.add_subcommand(
      "build",
      "Split text files into paragraphs (documents), send each to train or validation by a "
      "hash of its content and the seed, and write uint16 token shards plus a manifest. "
      "The same files, seed and fraction always give the same shards, byte for byte.");
  b->add_option("--out", build.out_dir, "Output folder (created if missing)")->required();
  b->add_option("--val-fraction", build.val_fraction, "Share of documents that go to val.bin")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  b->add_option("--seed", build.seed, "Seed of the train/validation assignment")
      ->capture_default_str();
  b->add_option("--tokenizer", build.tokenizer_dir,
                "A Hugging Face model folder (its tokenizer.json, else vocab.json + merges.txt) "
                "or a tokenizer.json file: byte-level BPE ids (uint16 shards, uint32 above "
                "65,536 ids); default: one token per byte")
      ->check(CLI::ExistingPath);
  b->add_option("files", build.inputs, "Text files, plain UTF-8 or gzip (.gz)")
      ->required()
      ->check(CLI::ExistingFile);

  isthmus::data::TranslationOptions parallel;
  CLI::App* p = app.add_subcommand(
      "parallel",
      "Build the translation task from the gettext catalogues of the machine's packages "
      "(<locale-dir>/<language>/LC_MESSAGES/*.mo): English -> each language's message pairs "
      "(empty, untranslated, non-UTF-8 and repeated pairs dropped; format strings and markup "
      "kept), one example per window of --seq-len tokens, \"en: <source>\\n<language>: \" "
      "then the translation, learned on the translation only (a loss mask beside each "
      "shard). A pair is held out by a hash of its English message and the seed, the same "
      "in every language and run; the held-out pairs are also written as text "
      "(heldout-<language>.jsonl) for evaluation.");
  p->add_option("--out", parallel.out_dir, "Output folder (created if missing)")->required();
  p->add_option("--lang", parallel.languages,
                "Target language, a locale folder name (de, fr, es, it, pt_BR, ...); repeat "
                "or separate by commas")
      ->required()
      ->delimiter(',');
  p->add_option("--locale-dir", parallel.locale_dir, "Where the catalogues are")
      ->capture_default_str()
      ->check(CLI::ExistingDirectory);
  p->add_option("--seq-len", parallel.example_tokens,
                "Tokens per example (isthmus-worker's --context must be the same); longer pairs "
                "are left out and counted")
      ->check(CLI::Range(8, 1 << 20))
      ->capture_default_str();
  p->add_option("--val-fraction", parallel.val_fraction, "Share of messages held out")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  p->add_option("--seed", parallel.seed, "Seed of the held-out choice")->capture_default_str();
  std::vector<std::string> teacher_targets;
  p->add_option("--teacher-targets", teacher_targets,
                "LANGUAGE=FILE: sequence-level distillation, the training targets of LANGUAGE "
                "are a teacher's translations of its train-<language>.jsonl (FILE as "
                "isthmus-worker generate --translate --input writes it; every training "
                "message must be there); held-out pairs keep the catalogue's. Repeatable");
  p->add_option("--tokenizer", parallel.tokenizer_dir,
                "A tokenizer, as for build (default: one token per byte)")
      ->check(CLI::ExistingPath);

  std::string show_path;
  uint64_t offset = 0;
  uint64_t count = 512;
  CLI::App* s = app.add_subcommand("show", "Print tokens of a .bin shard as text");
  s->add_option("file", show_path, "A train.bin or val.bin")->required()->check(CLI::ExistingFile);
  s->add_option("--offset", offset, "First token to print")->capture_default_str();
  s->add_option("--count", count, "Number of tokens to print")->capture_default_str();
  std::string show_tokenizer;
  s->add_option("--tokenizer", show_tokenizer,
                "The tokenizer the shard was built with, as for build (default: byte tokens)")
      ->check(CLI::ExistingPath);

  std::vector<std::string> encode_words, decode_words;
  std::string encode_tokenizer, decode_tokenizer;
  CLI::App* e = app.add_subcommand(
      "encode", "Print the token ids of a text (the words given, or standard input), one line");
  e->add_option("text", encode_words, "The text (joined by spaces); none: read standard input");
  e->add_option("--tokenizer", encode_tokenizer,
                "A tokenizer, as for build (default: one token per byte). Added tokens such "
                "as <|end_of_text|> in the text become their ids; no begin-of-text id is added")
      ->check(CLI::ExistingPath);
  CLI::App* d = app.add_subcommand(
      "decode", "Print the text of token ids (given, or on standard input; spaces or commas)");
  d->add_option("ids", decode_words, "Token ids; none: read standard input");
  d->add_option("--tokenizer", decode_tokenizer,
                "A tokenizer, as for build (default: one token per byte)")
      ->check(CLI::ExistingPath);

  CLI11_PARSE(app, argc, argv);
  if (b->parsed()) return RunBuild(build);
  if (p->parsed()) return RunParallel(parallel, teacher_targets);
  if (e->parsed()) return RunEncode(encode_words, encode_tokenizer);
  if (d->parsed()) return RunDecode(decode_words, decode_tokenizer);
  return RunShow(show_path, offset, count, show_tokenizer);
}
