// isthmus-data: turns a site's text files into the token shards that isthmus-worker reads
// (see shard_builder.h for the format), and prints pieces of a shard back as text.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>

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
  isthmus::Result<std::string> text = isthmus::Status::Internal("unset");
  if (tokenizer_dir.empty()) {
    text = isthmus::data::ByteTokenizer::Decode(tokens);
  } else {
    auto bpe = isthmus::data::BpeTokenizer::LoadFolder(tokenizer_dir);
    if (!bpe.ok()) {
      std::fprintf(stderr, "isthmus-data show: %s\n", bpe.status().ToString().c_str());
      return 2;
    }
    std::vector<int32_t> ids(tokens.begin(), tokens.end());
    text = (*bpe)->Decode(ids);
  }
  if (!text.ok()) {
    std::fprintf(stderr, "isthmus-data show: %s: %s\n", path.c_str(),
                 text.status().ToString().c_str());
    return 1;
  }
  std::cout << *text << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "isthmus-data: build token shards (train.bin, val.bin, manifest.json) from text files, "
      "deterministically, one token per byte or with GPT-2's BPE, and inspect them."};
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

  CLI11_PARSE(app, argc, argv);
  if (b->parsed()) return RunBuild(build);
  return RunShow(show_path, offset, count, show_tokenizer);
}
