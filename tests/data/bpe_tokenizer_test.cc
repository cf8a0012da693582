// GPT-2's byte-level BPE (worker/data/bpe_tokenizer.*) against GPT-2's real vocabulary and
// merges, on fixed texts in several scripts and languages whose ids were produced by an
// independent encoder (tests/data/gpt2/README.md): every text encodes to exactly those
// ids and decodes back byte for byte.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/command.h"
#include "worker/data/bpe_tokenizer.h"
#include "worker/data/shard_builder.h"

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

}  // namespace
}  // namespace isthmus::data
