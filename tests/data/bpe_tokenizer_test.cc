// Byte-level BPE (worker/data/bpe_tokenizer.*) against GPT-2's real vocabulary and
// merges, on fixed texts in several scripts and languages whose ids were produced by an
// independent encoder (tests/data/gpt2/README.md): every text encodes to exactly those
// ids and decodes back byte for byte. And the tokenizer.json files of GPT-2, Llama 3 and
// Qwen3 against Hugging Face's tokenizers.js on 3,310 texts (tests/data/tokenizers/).
#include <gtest/gtest.h>
#include <unistd.h>
#include <zstd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "tests/command.h"
#include "worker/data/bpe_tokenizer.h"
#include "worker/data/shard_builder.h"
#include "worker/data/token_dataset.h"

namespace isthmus::data {
namespace {

std::unique_ptr<BpeTokenizer> Gpt2() {
  auto t = BpeTokenizer::LoadFolder(ISTHMUS_GPT2_VOCAB_DIR);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

TEST(BpeTokenizer, MatchesGpt2OnTextsInManyScripts) {
  auto tok = Gpt2();
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 50257);
  std::ifstream in(std::string(ISTHMUS_GPT2_VOCAB_DIR) + "/expected.json");
  auto cases = nlohmann::json::parse(in);
  ASSERT_GE(cases.size(), 15u);
  for (const auto& c : cases) {
    const std::string text = c["text"].get<std::string>();
    const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    auto got = tok->Encode(text);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, want) << text;
    auto back = tok->Decode(want);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, text);
  }
  // A second pass goes through the piece cache and must give the same ids.
  for (const auto& c : cases) {
    EXPECT_EQ(*tok->Encode(c["text"].get<std::string>()), c["ids"].get<std::vector<int32_t>>());
  }
}

// `isthmus-data encode` and `decode` print those same ids and texts (standard input and
// arguments), in BPE and in byte mode, and refuse what is not a token id.
TEST(BpeTokenizer, IsthmusDataEncodeAndDecodePrintTheIdsAndTheText) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("isthmus-data-cli-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string bin = ISTHMUS_DATA_BIN, vocab = ISTHMUS_GPT2_VOCAB_DIR;
  std::ifstream in(vocab + "/expected.json");
  auto cases = nlohmann::json::parse(in);
  for (const auto& c : cases) {
    const std::string text = c["text"].get<std::string>();
    std::ofstream(dir / "text", std::ios::binary) << text;
    auto enc =
        testing::RunCommand(bin + " encode --tokenizer " + vocab + " < " + (dir / "text").string());
    ASSERT_EQ(enc.exit_code, 0) << enc.output;
    std::string want;
    for (int32_t id : c["ids"].get<std::vector<int32_t>>()) {
      want += (want.empty() ? "" : " ") + std::to_string(id);
    }
    EXPECT_EQ(enc.output, want + "\n") << text;
    std::ofstream(dir / "ids") << c["ids"].dump();  // "[1, 2, 3]" is read too
    auto dec =
        testing::RunCommand(bin + " decode --tokenizer " + vocab + " < " + (dir / "ids").string());
    ASSERT_EQ(dec.exit_code, 0) << dec.output;
    EXPECT_EQ(dec.output, text + "\n");
  }
  auto bytes = testing::RunCommand(bin + " encode hé");
  EXPECT_EQ(bytes.output, "104 195 169\n");
  auto back = testing::RunCommand(bin + " decode 104 195 169");
  EXPECT_EQ(back.output, "hé\n");
  auto outside = testing::RunCommand(bin + " decode 300 2>&1");
  EXPECT_EQ(outside.exit_code, 1);
  EXPECT_NE(outside.output.find("pass --tokenizer for BPE ids"), std::string::npos)
      << outside.output;
  auto junk = testing::RunCommand(bin + " decode 7 x1 2>&1");
  EXPECT_EQ(junk.exit_code, 2);
  EXPECT_NE(junk.output.find("'x1' is not a token id"), std::string::npos) << junk.output;
  std::filesystem::remove_all(dir);
}

TEST(BpeTokenizer, BytesThatAreNotUtf8RoundTrip) {
  auto tok = Gpt2();
  ASSERT_NE(tok, nullptr);
  const std::string text = std::string("ok \xff\xfe bytes \xc3") + "\x28 end\x80";
  auto ids = tok->Encode(text);
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  auto back = tok->Decode(*ids);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, text);
}

TEST(BpeTokenizer, BadIdsAndFilesAreRefusedWithTheirName) {
  auto tok = Gpt2();
  ASSERT_NE(tok, nullptr);
  std::vector<int32_t> bad{15496, 50257};
  auto d = tok->Decode(bad);
  EXPECT_EQ(d.status().code(), Code::kInvalidArgument);
  EXPECT_NE(d.status().message().find("50257"), std::string::npos);
  EXPECT_EQ(BpeTokenizer::LoadFolder("/nonexistent-folder").status().code(), Code::kNotFound);
  const std::string dir = ::testing::TempDir() + "/bpe-bad";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/vocab.json") << R"({"a": 0, "b": 1, "ab": 2})";
  std::ofstream(dir + "/merges.txt") << "#version: 0.2\na b c\n";
  auto t = BpeTokenizer::LoadFolder(dir);
  EXPECT_EQ(t.status().code(), Code::kInvalidArgument);
  EXPECT_NE(t.status().message().find("merges.txt:2"), std::string::npos) << t.status().ToString();
  std::ofstream(dir + "/vocab.json") << R"(["not", "an", "object"])";
  EXPECT_EQ(BpeTokenizer::LoadFolder(dir).status().code(), Code::kInvalidArgument);
}

// isthmus-data's shards with --tokenizer: GPT-2 ids that decode to the train documents
// joined by the separator, and a manifest that says so.
TEST(BpeTokenizer, ShardsBuiltWithItDecodeToTheirDocuments) {
  const std::string dir = ::testing::TempDir() + "/bpe-shards";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string text =
      "First paragraph, in English.\n\nZweiter Absatz: schöne Grüße.\n\n"
      "Третий абзац.\n\n第四段。\n\nA fifth one, don't forget it.\n";
  std::ofstream(dir + "/in.txt") << text;
  BuildOptions o;
  o.inputs = {dir + "/in.txt"};
  o.out_dir = dir + "/out";
  o.val_fraction = 0.3;
  o.tokenizer_dir = ISTHMUS_GPT2_VOCAB_DIR;
  auto built = BuildShards(o);
  ASSERT_TRUE(built.ok()) << built.status().ToString();
  std::string want[2];  // train, val
  for (auto doc : SplitDocuments(text)) {
    std::string& side = want[IsValidationDocument(doc, o.seed, o.val_fraction) ? 1 : 0];
    side += (side.empty() ? "" : kDocumentSeparator) + std::string(doc);
  }
  auto tok = Gpt2();
  ASSERT_NE(tok, nullptr);
  const char* files[2] = {"/out/train.bin", "/out/val.bin"};
  for (int k = 0; k < 2; ++k) {
    std::vector<uint16_t> tokens;
    std::ifstream in(dir + files[k], std::ios::binary);
    uint16_t t;
    while (in.read(reinterpret_cast<char*>(&t), 2)) tokens.push_back(t);
    std::vector<int32_t> ids(tokens.begin(), tokens.end());
    auto back = tok->Decode(ids);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, want[k]) << files[k];
    EXPECT_LT(ids.size(), want[k].size());  // BPE: fewer tokens than bytes
  }
  EXPECT_FALSE(want[0].empty());
  EXPECT_FALSE(want[1].empty());
  std::ifstream m(dir + "/out/manifest.json");
  auto manifest = nlohmann::json::parse(m);
  EXPECT_EQ(manifest["tokenizer"], "gpt2-bpe");
  EXPECT_EQ(manifest["vocab_size"], 50257);
}

// The bytes of a zstd file (one frame that records its size, as the zstd tool writes).
std::string Unzstd(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string packed((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const unsigned long long size = ZSTD_getFrameContentSize(packed.data(), packed.size());
  if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN) return "";
  std::string out(size, '\0');
  const size_t n = ZSTD_decompress(out.data(), out.size(), packed.data(), packed.size());
  if (ZSTD_isError(n) || n != size) return "";
  return out;
}

// The tokenizer.json files (Llama 3 and Qwen3 unpacked, GPT-2's built from its vocabulary
// and merges as Hugging Face builds it) in <folder>/<name>/tokenizer.json, and the ids
// tokenizers.js gives the texts.
class TokenizerJson : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    folder_ =
        new std::string(::testing::TempDir() + "/tokenizer-json-" + std::to_string(::getpid()));
    const std::string data = std::string(ISTHMUS_GPT2_VOCAB_DIR) + "/../tokenizers/";
    for (const char* name : {"llama3", "qwen3"}) {
      std::filesystem::create_directories(*folder_ + "/" + name);
      std::ofstream(*folder_ + "/" + name + "/tokenizer.json", std::ios::binary)
          << Unzstd(data + name + "-tokenizer.json.zst");
    }
    nlohmann::json vocab =
        nlohmann::json::parse(std::ifstream(std::string(ISTHMUS_GPT2_VOCAB_DIR) + "/encoder.json"));
    nlohmann::json merges = nlohmann::json::array();
    std::ifstream lines(std::string(ISTHMUS_GPT2_VOCAB_DIR) + "/vocab.bpe");
    for (std::string line; std::getline(lines, line);) {
      if (!line.empty() && line.rfind("#version", 0) != 0) merges.push_back(line);
    }
    const nlohmann::json byte_level = {
        {"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
    const nlohmann::json gpt2 = {
        {"added_tokens", {{{"id", 50256}, {"content", "<|endoftext|>"}, {"special", true}}}},
        {"normalizer", nullptr},
        {"pre_tokenizer", byte_level},
        {"decoder", byte_level},
        {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
    std::filesystem::create_directories(*folder_ + "/gpt2");
    std::ofstream(*folder_ + "/gpt2/tokenizer.json") << gpt2.dump();
    expected_ = new nlohmann::json(nlohmann::json::parse(Unzstd(data + "expected.json.zst")));
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*folder_);
    delete folder_;
    delete expected_;
  }

  static std::unique_ptr<BpeTokenizer> Tokenizer(const std::string& name) {
    auto t = BpeTokenizer::LoadFolder(*folder_ + "/" + name);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? std::move(t).value() : nullptr;
  }

  static std::string* folder_;
  static nlohmann::json* expected_;
};
std::string* TokenizerJson::folder_ = nullptr;
nlohmann::json* TokenizerJson::expected_ = nullptr;

TEST_F(TokenizerJson, MatchesTokenizersJsOnTheCorpusAndAddedTokens) {
  const auto& texts = (*expected_)["texts"];
  ASSERT_GE(texts.size(), 3300u);
  const std::map<std::string, int> vocab_sizes{
      {"gpt2", 50257}, {"llama3", 128256}, {"qwen3", 151669}};
  for (const auto& [name, vocab_size] : vocab_sizes) {
    auto tok = Tokenizer(name);
    ASSERT_NE(tok, nullptr) << name;
    EXPECT_EQ(tok->kind(), "tokenizer.json");
    EXPECT_EQ(tok->vocab_size(), vocab_size) << name;
    const auto& ids = (*expected_)["ids"][name];
    ASSERT_EQ(ids.size(), texts.size());
    int differ = 0, round_trips = 0;
    uint64_t tokens = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
      const std::string text = texts[i].get<std::string>();
      const std::vector<int32_t> want = ids[i].get<std::vector<int32_t>>();
      tokens += want.size();
      auto got = tok->Encode(text);
      ASSERT_TRUE(got.ok()) << name << ": " << got.status().ToString();
      if (*got != want && ++differ <= 5) ADD_FAILURE() << name << " differs on: " << text;
      auto back = tok->Decode(want);
      ASSERT_TRUE(back.ok()) << name << ": " << back.status().ToString();
      // Qwen3 normalizes to NFC, so its ids give the composed text back.
      if (*back == text || (name == "qwen3" && *tok->Encode(*back) == want)) ++round_trips;
    }
    EXPECT_EQ(differ, 0) << name << ": texts whose ids differ from tokenizers.js'";
    // A second pass goes through the piece cache and gives the same ids.
    int cached_differ = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
      cached_differ +=
          *tok->Encode(texts[i].get<std::string>()) != ids[i].get<std::vector<int32_t>>();
    }
    EXPECT_EQ(cached_differ, 0) << name;
    EXPECT_EQ(round_trips, static_cast<int>(texts.size())) << name;
    EXPECT_GT(tokens, 40000u) << name;
  }
}

// The same GPT-2 read from tokenizer.json and from vocab.json + merges.txt gives the same
// ids (except that tokenizer.json makes <|endoftext|> its special token).
TEST_F(TokenizerJson, Gpt2FromTokenizerJsonEqualsGpt2FromItsVocabularyFiles) {
  auto json_tok = Tokenizer("gpt2");
  auto files_tok = Gpt2();
  ASSERT_NE(json_tok, nullptr);
  ASSERT_NE(files_tok, nullptr);
  EXPECT_EQ(files_tok->kind(), "gpt2-bpe");
  int compared = 0;
  for (const auto& t : (*expected_)["texts"]) {
    const std::string text = t.get<std::string>();
    if (text.find("<|endoftext|>") != std::string::npos) continue;
    ASSERT_EQ(*json_tok->Encode(text), *files_tok->Encode(text)) << text;
    ++compared;
  }
  EXPECT_GT(compared, 3300);
  EXPECT_EQ(*json_tok->Encode("a<|endoftext|>b"), (std::vector<int32_t>{64, 50256, 65}));
  EXPECT_EQ(json_tok->AddedTokenId("<|endoftext|>"), 50256);
}

TEST_F(TokenizerJson, AddedTokensAreCutOutAndDecodeToTheirText) {
  auto llama = Tokenizer("llama3");
  ASSERT_NE(llama, nullptr);
  EXPECT_EQ(llama->AddedTokenId("<|begin_of_text|>"), 128000);
  EXPECT_EQ(llama->AddedTokenId("<|end_of_text|>"), 128001);
  EXPECT_FALSE(llama->AddedTokenId("<|nonsense|>").has_value());
  auto ids = llama->Encode("<|begin_of_text|>Hi<|end_of_text|>");
  ASSERT_TRUE(ids.ok());
  ASSERT_EQ(ids->size(), 3u);
  EXPECT_EQ((*ids)[0], 128000);
  EXPECT_EQ((*ids)[2], 128001);
  EXPECT_EQ(*llama->Decode(*ids), "<|begin_of_text|>Hi<|end_of_text|>");
  // Invalid UTF-8 still round-trips byte for byte.
  const std::string bytes = std::string("ok \xff\xfe bytes \xc3") + "\x28 end\x80";
  EXPECT_EQ(*llama->Decode(*llama->Encode(bytes)), bytes);
  auto bad = llama->Decode(std::vector<int32_t>{128256});
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("128256"), std::string::npos);
}

// What isthmus does not read is refused when the file is loaded, saying what it is.
TEST_F(TokenizerJson, UnsupportedTokenizersAreRefusedByName) {
  const std::string dir = *folder_ + "/bad";
  std::filesystem::create_directories(dir);
  nlohmann::json base = nlohmann::json::parse(std::ifstream(*folder_ + "/gpt2/tokenizer.json"));
  auto refused = [&](const nlohmann::json& doc, const std::string& words) {
    std::ofstream(dir + "/tokenizer.json") << doc.dump();
    auto t = BpeTokenizer::LoadPath(dir + "/tokenizer.json");
    EXPECT_EQ(t.status().code(), Code::kInvalidArgument) << words;
    EXPECT_NE(t.status().message().find(words), std::string::npos) << t.status().ToString();
    EXPECT_NE(t.status().message().find(dir + "/tokenizer.json"), std::string::npos);
  };
  auto doc = base;
  doc["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "▁"}};
  refused(doc, "pre-tokenizer Metaspace is not supported");
  doc = base;
  doc["model"]["byte_fallback"] = true;
  refused(doc, "byte_fallback");
  doc = base;
  doc["model"]["type"] = "WordPiece";
  refused(doc, "model type WordPiece is not supported");
  doc = base;
  doc["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"behavior", "Removed"}},
        base["pre_tokenizer"]}}};
  refused(doc, "behavior Removed");
  doc["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Isolated";
  doc["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  refused(doc, "ICU cannot compile the pattern");
  doc = base;
  doc["normalizer"] = {{"type", "Lowercase"}};
  refused(doc, "normalizer Lowercase is not supported");
  doc = base;
  doc["model"]["merges"][3] = 7;
  refused(doc, "merge 3 is neither");
  std::ofstream(dir + "/tokenizer.json") << "{not json";
  EXPECT_EQ(BpeTokenizer::LoadFolder(dir).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(BpeTokenizer::LoadPath(dir + "/missing.json").status().code(), Code::kNotFound);
}

// Llama 3's 128,256 ids do not fit uint16: its shards hold uint32 tokens, the manifest says
// so, TokenDataset reads them for a model of that vocabulary, and refuses them, saying why,
// for a model with a smaller one.
TEST_F(TokenizerJson, Llama3ShardsHoldUint32TokensThatTheDatasetReads) {
  const std::string dir = *folder_ + "/llama3-shards";
  std::string text;
  const auto& texts = (*expected_)["texts"];
  for (size_t i = 0; i < 400; ++i) text += texts[i].get<std::string>() + "\n\n";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/in.txt") << text;
  BuildOptions o;
  o.inputs = {dir + "/in.txt"};
  o.out_dir = dir + "/out";
  o.val_fraction = 0.1;
  o.tokenizer_dir = *folder_ + "/llama3/tokenizer.json";
  auto built = BuildShards(o);
  ASSERT_TRUE(built.ok()) << built.status().ToString();
  auto manifest = nlohmann::json::parse(std::ifstream(dir + "/out/manifest.json"));
  EXPECT_EQ(manifest["tokenizer"], "tokenizer.json");
  EXPECT_EQ(manifest["vocab_size"], 128256);
  EXPECT_EQ(manifest["token_dtype"], "uint32-le");
  EXPECT_EQ(std::filesystem::file_size(dir + "/out/train.bin"), built->train.tokens * 4);

  auto tok = Tokenizer("llama3");
  ASSERT_NE(tok, nullptr);
  auto ds = TokenDataset::Open(dir + "/out/train.bin",
                               {.batch_size = 2, .seq_len = 64, .vocab_size = 128256});
  ASSERT_TRUE(ds.ok()) << ds.status().ToString();
  std::vector<int32_t> all(ds->num_tokens());
  bool above_uint16 = false;
  for (uint64_t i = 0; i < all.size(); ++i) {
    all[i] = static_cast<int32_t>(ds->token(i));
    above_uint16 |= all[i] > 65535;
  }
  EXPECT_TRUE(above_uint16);  // the width matters: some ids need more than 16 bits
  std::string train;
  for (auto doc : SplitDocuments(text)) {
    if (!IsValidationDocument(doc, o.seed, o.val_fraction)) {
      train += (train.empty() ? "" : kDocumentSeparator) + std::string(doc);
    }
  }
  EXPECT_EQ(*tok->Decode(all), train);
  Batch b = ds->Next();
  const uint64_t w = ds->epoch_order()[0] * 64;
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(b.tokens[i], all[w + i]);
    EXPECT_EQ(b.targets[i], all[w + i + 1]);
  }
  auto wrong = TokenDataset::Open(dir + "/out/train.bin",
                                  {.batch_size = 2, .seq_len = 64, .vocab_size = 50304});
  EXPECT_EQ(wrong.status().code(), Code::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find("\"uint32-le\" (vocabulary 128256)"), std::string::npos)
      << wrong.status().ToString();
  // show reads the same width.
  auto shown = testing::RunCommand(std::string(ISTHMUS_DATA_BIN) + " show " + dir +
                                   "/out/train.bin --count 5 --tokenizer " + o.tokenizer_dir);
  ASSERT_EQ(shown.exit_code, 0) << shown.output;
  EXPECT_EQ(shown.output, *tok->Decode(std::span(all).first(5)) + "\n");
}

// isthmus-data encode and decode read a tokenizer.json, given as a folder or as the file.
TEST_F(TokenizerJson, IsthmusDataEncodesAndDecodesWithATokenizerJson) {
  const std::string bin = ISTHMUS_DATA_BIN;
  const std::string file = *folder_ + "/qwen3/tokenizer.json";
  const auto& texts = (*expected_)["texts"];
  size_t at = 0;  // the chat text, with Qwen3's special and plain added tokens
  while (at < texts.size() && texts[at].get<std::string>().find("<think>") == std::string::npos) {
    ++at;
  }
  ASSERT_LT(at, texts.size());
  const std::string text = texts[at].get<std::string>();
  std::ofstream(*folder_ + "/text", std::ios::binary) << text;
  std::string want;
  for (int32_t id : (*expected_)["ids"]["qwen3"][at].get<std::vector<int32_t>>()) {
    want += (want.empty() ? "" : " ") + std::to_string(id);
  }
  for (const std::string& where : {file, *folder_ + "/qwen3"}) {
    auto enc =
        testing::RunCommand(bin + " encode --tokenizer " + where + " < " + *folder_ + "/text");
    ASSERT_EQ(enc.exit_code, 0) << enc.output;
    EXPECT_EQ(enc.output, want + "\n");
  }
  std::ofstream(*folder_ + "/ids") << want;
  auto dec = testing::RunCommand(bin + " decode --tokenizer " + file + " < " + *folder_ + "/ids");
  ASSERT_EQ(dec.exit_code, 0) << dec.output;
  EXPECT_EQ(dec.output, text + "\n");
  auto missing = testing::RunCommand(bin + " encode --tokenizer " + *folder_ + "/none x 2>&1");
  EXPECT_NE(missing.exit_code, 0);
}

}  // namespace
}  // namespace isthmus::data
