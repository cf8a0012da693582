// isthmus-data: turns a site's text files into the token shards that isthmus-worker reads
// (see shard_builder.h for the format), and prints pieces of a shard back as text.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>

#include "worker/data/bpe_tokenizer.h"
#include "worker/data/shard_builder.h"
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

// GPT-2's BPE from `dir`; null, with the reason printed as "isthmus-data COMMAND: ...",
// when it cannot be read.
std::unique_ptr<isthmus::data::BpeTokenizer> LoadBpe(const char* command, const std::string& dir) {
  auto bpe = isthmus::data::BpeTokenizer::LoadFolder(dir);
  if (!bpe.ok()) {
    std::fprintf(stderr, "isthmus-data %s: %s\n", command, bpe.status().ToString().c_str());
    return nullptr;
  }
  return std::move(bpe).value();
}

// Prints the text of `ids` (byte tokens, or the BPE of `tokenizer_dir`) and returns 0; else
// prints why, prefixed by `what`, and returns the exit code (2: the folder, 1: the ids).
int PrintDecoded(const char* command, const std::string& what, const std::vector<int32_t>& ids,
                 const std::string& tokenizer_dir) {
  isthmus::Result<std::string> text = isthmus::Status::Internal("unset");
  if (tokenizer_dir.empty()) {
    std::vector<uint16_t> bytes;
    for (int32_t id : ids) bytes.push_back(static_cast<uint16_t>(std::min<int32_t>(id, 65535)));
    text = isthmus::data::ByteTokenizer::Decode(bytes);
  } else {
    auto bpe = LoadBpe(command, tokenizer_dir);
    if (bpe == nullptr) return 2;
    text = bpe->Decode(ids);
  }
  if (!text.ok()) {
    std::fprintf(stderr, "isthmus-data %s: %s%s%s\n", command, what.c_str(),
                 text.status().ToString().c_str(),
                 tokenizer_dir.empty() ? " (byte tokens; pass --tokenizer for BPE ids)" : "");
    return 1;
  }
  std::cout << *text << "\n";
  return 0;
}

int RunShow(const std::string& path, uint64_t offset, uint64_t count,
            const std::string& tokenizer_dir) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "isthmus-data show: cannot open %s\n", path.c_str());
    return 1;
  }
  in.seekg(static_cast<std::streamoff>(offset * 2));
  std::vector<uint16_t> tokens(count);
  in.read(reinterpret_cast<char*>(tokens.data()), static_cast<std::streamsize>(count * 2));
  tokens.resize(static_cast<size_t>(in.gcount()) / 2);
  return PrintDecoded("show", path + ": ", std::vector<int32_t>(tokens.begin(), tokens.end()),
                      tokenizer_dir);
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

int RunEncode(const std::vector<std::string>& words, const std::string& tokenizer_dir) {
  const std::string text = TextOf(words);
  std::vector<int64_t> ids;
  if (tokenizer_dir.empty()) {
    for (uint16_t t : isthmus::data::ByteTokenizer::Encode(text)) ids.push_back(t);
  } else {
    auto bpe = LoadBpe("encode", tokenizer_dir);
    if (bpe == nullptr) return 2;
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

int RunDecode(const std::vector<std::string>& words, const std::string& tokenizer_dir) {
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
  return PrintDecoded("decode", "", ids, tokenizer_dir);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "isthmus-data: build token shards (train.bin, val.bin, manifest.json) from text files, "
      "deterministically, one token per byte or with GPT-2's BPE, inspect them, and encode "
      "or decode a text."};
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
                "Folder with GPT-2's BPE files (vocab.json + merges.txt, e.g. a Hugging Face "
                "GPT-2 folder); default: one token per byte")
      ->check(CLI::ExistingDirectory);
  b->add_option("files", build.inputs, "Text files, plain UTF-8 or gzip (.gz)")
      ->required()
      ->check(CLI::ExistingFile);

  std::string show_path;
  uint64_t offset = 0;
  uint64_t count = 512;
  CLI::App* s = app.add_subcommand("show", "Print tokens of a .bin shard as text");
  s->add_option("file", show_path, "A train.bin or val.bin")->required()->check(CLI::ExistingFile);
  s->add_option("--offset", offset, "First token to print")->capture_default_str();
  s->add_option("--count", count, "Number of tokens to print")->capture_default_str();
  std::string show_tokenizer;
  s->add_option("--tokenizer", show_tokenizer,
                "The BPE folder the shard was built with (default: byte tokens)")
      ->check(CLI::ExistingDirectory);

  std::vector<std::string> encode_words, decode_words;
  std::string encode_tokenizer, decode_tokenizer;
  CLI::App* e = app.add_subcommand(
      "encode", "Print the token ids of a text (the words given, or standard input), one line");
  e->add_option("text", encode_words, "The text (joined by spaces); none: read standard input");
  e->add_option("--tokenizer", encode_tokenizer,
                "Folder with GPT-2's BPE files, as for build (default: one token per byte)")
      ->check(CLI::ExistingDirectory);
  CLI::App* d = app.add_subcommand(
      "decode", "Print the text of token ids (given, or on standard input; spaces or commas)");
  d->add_option("ids", decode_words, "Token ids; none: read standard input");
  d->add_option("--tokenizer", decode_tokenizer,
                "Folder with GPT-2's BPE files, as for build (default: one token per byte)")
      ->check(CLI::ExistingDirectory);

  CLI11_PARSE(app, argc, argv);
  if (b->parsed()) return RunBuild(build);
  if (e->parsed()) return RunEncode(encode_words, encode_tokenizer);
  if (d->parsed()) return RunDecode(decode_words, decode_tokenizer);
  return RunShow(show_path, offset, count, show_tokenizer);
}
