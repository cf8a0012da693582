// Tests of worker/data: byte tokenizer, deterministic shard building (plain and gzip
// inputs), and the per-rank TokenDataset (slices, targets, epochs, resume).
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "tests/test_dir.h"
#include "worker/data/shard_builder.h"
#include "worker/data/token_dataset.h"
#include "worker/data/tokenizer.h"

namespace isthmus::data {
namespace {

namespace fs = std::filesystem;

std::string ReadAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void WriteAll(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

// Deterministic, varied paragraphs in several scripts.
std::string MakeText(int paragraphs, int salt) {
  static const char* kWords[] = {"debian", "paket",   "système", "réseau",      "ファイル",
                                 "设置",   "kernel",  "apt",     "über",        "configuración",
                                 "shell",  "systemd", "ñandú",   "εξυπηρετητής"};
  std::string text;
  uint32_t x = 2463534242u + static_cast<uint32_t>(salt);
  for (int p = 0; p < paragraphs; ++p) {
    const int lines = 1 + p % 3;
    for (int l = 0; l < lines; ++l) {
      text += "  ";
      for (int w = 0; w < 6; ++w) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        text += kWords[x % 14];
        text += ' ';
      }
      text += std::to_string(p) + "\n";
    }
    text += (p % 4 == 0) ? "\n   \n" : "\n";  // blank lines, some with spaces
  }
  return text;
}

std::string Gzip(const std::string& data) {
  z_stream zs{};
  EXPECT_EQ(deflateInit2(&zs, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&zs, data.size()) + 64, '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  zs.avail_in = static_cast<uInt>(data.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&zs, Z_FINISH), Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

class DataTest : public testing::TestWithDir {
 protected:
  DataTest() : TestWithDir("isthmus_data") {}

  // Writes a shard of `n` tokens whose value is a function of position (mod 256).
  std::string WriteShard(const std::string& name, uint64_t n) {
    std::vector<uint16_t> t(n);
    for (uint64_t i = 0; i < n; ++i) t[i] = static_cast<uint16_t>((i * 7 + i / 256) % 256);
    fs::path p = dir_ / name;
    WriteAll(p, std::string(reinterpret_cast<const char*>(t.data()), n * 2));
    return p.string();
  }
};

TEST(ByteTokenizerTest, EveryByteRoundTrips) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  all += "Grüße, 世界, ñ\r\n\0end";
  std::vector<uint16_t> tokens = ByteTokenizer::Encode(all);
  ASSERT_EQ(tokens.size(), all.size());
  for (int b = 0; b < 256; ++b) EXPECT_EQ(tokens[b], b);
  auto back = ByteTokenizer::Decode(tokens);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, all);
  std::vector<uint16_t> bad = {65, 256, 66};
  auto r = ByteTokenizer::Decode(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find("position 1"), std::string::npos);
}

TEST(SplitDocumentsTest, ParagraphsAreDocuments) {
  std::string text = "\n\nfirst line\nsecond line\n\n \t\nthird\r\n\r\nfourth\nlast";
  auto docs = SplitDocuments(text);
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(docs[0], "first line\nsecond line");
  EXPECT_EQ(docs[1], "third");
  EXPECT_EQ(docs[2], "fourth\nlast");
  EXPECT_TRUE(SplitDocuments("  \n\n\t\n").empty());
}

TEST_F(DataTest, BuildIsDeterministicAndHonoursTheFraction) {
  const std::string a = MakeText(1500, 1);
  const std::string b = MakeText(1500, 2);
  WriteAll(dir_ / "a.txt", a);
  WriteAll(dir_ / "b.txt.gz", Gzip(b));
  BuildOptions opt;
  opt.inputs = {(dir_ / "a.txt").string(), (dir_ / "b.txt.gz").string()};
  opt.val_fraction = 0.1;
  opt.seed = 7;
  opt.out_dir = (dir_ / "out1").string();
  auto s1 = BuildShards(opt);
  ASSERT_TRUE(s1.ok()) << s1.status().ToString();
  opt.out_dir = (dir_ / "out2").string();
  auto s2 = BuildShards(opt);
  ASSERT_TRUE(s2.ok());
  for (const char* f : {"train.bin", "val.bin", "manifest.json"}) {
    EXPECT_EQ(ReadAll(dir_ / "out1" / f), ReadAll(dir_ / "out2" / f)) << f;
  }
  EXPECT_EQ(s1->source_bytes, a.size() + b.size());
  const uint64_t docs = s1->train.documents + s1->val.documents;
  EXPECT_EQ(docs, SplitDocuments(a).size() + SplitDocuments(b).size());
  const double share = static_cast<double>(s1->val.documents) / static_cast<double>(docs);
  EXPECT_NEAR(share, 0.1, 0.03) << s1->val.documents << " of " << docs;

  // Every token is a byte and the text is the documents joined by the separator.
  const std::string train = ReadAll(dir_ / "out1" / "train.bin");
  const std::string val = ReadAll(dir_ / "out1" / "val.bin");
  EXPECT_EQ(train.size(), s1->train.tokens * 2);
  EXPECT_EQ(val.size(), s1->val.tokens * 2);
  std::vector<uint16_t> tokens(train.size() / 2);
  std::memcpy(tokens.data(), train.data(), train.size());
  auto text = ByteTokenizer::Decode(tokens);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(text->find("\n\n\n"), std::string::npos);
  EXPECT_NE(text->find("ファイル"), std::string::npos);
  // A validation paragraph never appears in train.
  for (std::string_view d : SplitDocuments(a)) {
    if (IsValidationDocument(d, 7, 0.1)) {
      EXPECT_EQ(text->find(std::string(d) + "\n"), std::string::npos);
      break;
    }
  }

  auto manifest = nlohmann::json::parse(ReadAll(dir_ / "out1" / "manifest.json"));
  EXPECT_EQ(manifest["vocab_size"], 256);
  EXPECT_EQ(manifest["seed"], 7);
  EXPECT_EQ(manifest["train"]["tokens"], s1->train.tokens);
  EXPECT_EQ(manifest["val"]["sha256"], s1->val.sha256);
  ASSERT_EQ(manifest["sources"].size(), 2u);
  EXPECT_EQ(manifest["sources"][1]["text_bytes"], b.size());
  EXPECT_EQ(manifest["sources"][1]["bytes"], fs::file_size(dir_ / "b.txt.gz"));
  EXPECT_EQ(manifest["sources"][0]["sha256"].get<std::string>().size(), 64u);

  // Another seed gives another split.
  opt.seed = 8;
  opt.out_dir = (dir_ / "out3").string();
  ASSERT_TRUE(BuildShards(opt).ok());
  EXPECT_NE(ReadAll(dir_ / "out1" / "val.bin"), ReadAll(dir_ / "out3" / "val.bin"));
}

TEST_F(DataTest, BuildRefusesBadInput) {
  BuildOptions opt;
  opt.out_dir = (dir_ / "out").string();
  EXPECT_EQ(BuildShards(opt).status().code(), Code::kInvalidArgument);
  opt.inputs = {(dir_ / "missing.txt").string()};
  EXPECT_EQ(BuildShards(opt).status().code(), Code::kNotFound);
  std::string gz = Gzip(MakeText(50, 3));
  WriteAll(dir_ / "cut.gz", gz.substr(0, gz.size() / 2));
  opt.inputs = {(dir_ / "cut.gz").string()};
  auto r = BuildShards(opt);
  EXPECT_EQ(r.status().code(), Code::kCorruption) << r.status().ToString();
  WriteAll(dir_ / "ok.txt", "hello\n");
  opt.inputs = {(dir_ / "ok.txt").string()};
  opt.val_fraction = 1.5;
  EXPECT_EQ(BuildShards(opt).status().code(), Code::kInvalidArgument);
}

TEST_F(DataTest, ConcatenatedGzipMembersReadAsOne) {
  WriteAll(dir_ / "two.gz", Gzip("part one\n\n") + Gzip("part two\n"));
  auto text = ReadTextFile((dir_ / "two.gz").string());
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_EQ(*text, "part one\n\npart two\n");
}

TEST_F(DataTest, TargetsAreTokensShiftedByOne) {
  const std::string path = WriteShard("s.bin", 10000);
  auto ds = TokenDataset::Open(path, {.batch_size = 4, .seq_len = 32, .seed = 3});
  ASSERT_TRUE(ds.ok()) << ds.status().ToString();
  std::vector<int32_t> all(ds->num_tokens());
  for (uint64_t i = 0; i < all.size(); ++i) all[i] = static_cast<int32_t>(ds->token(i));
  for (int step = 0; step < 5; ++step) {
    Batch b = ds->Next();
    ASSERT_EQ(b.tokens.size(), 4u * 32);
    for (int64_t r = 0; r < 4; ++r) {
      // Find the window by its first token position: rows start at multiples of T.
      bool found = false;
      for (uint64_t w = 0; w * 32 + 33 <= all.size() && !found; ++w) {
        bool match = true;
        for (int64_t i = 0; i < 32 && match; ++i) {
          match = b.tokens[r * 32 + i] == all[w * 32 + i] &&
                  b.targets[r * 32 + i] == all[w * 32 + i + 1];
        }
        found = match;
      }
      EXPECT_TRUE(found) << "row " << r << " of step " << step;
      for (int64_t i = 0; i + 1 < 32; ++i) {
        EXPECT_EQ(b.targets[r * 32 + i], b.tokens[r * 32 + i + 1]);
      }
    }
  }
}

class RankSliceTest : public DataTest, public ::testing::WithParamInterface<int> {};

TEST_P(RankSliceTest, RanksAreDisjointAndCoverTheShard) {
  const int world = GetParam();
  const int64_t t = 16;
  const int64_t b = 2;
  // 1 + t * windows tokens with windows divisible by every world size tested.
  const uint64_t windows = 2 * 3 * 4 * 5;
  const std::string path = WriteShard("s.bin", 1 + t * windows);
  std::set<uint64_t> seen;
  uint64_t per_rank = 0;
  for (int r = 0; r < world; ++r) {
    auto ds = TokenDataset::Open(
        path, {.batch_size = b, .seq_len = t, .rank = r, .world_size = world, .seed = 11});
    ASSERT_TRUE(ds.ok()) << ds.status().ToString();
    per_rank = ds->windows_per_rank();
    std::set<uint64_t> mine(ds->epoch_order().begin(), ds->epoch_order().end());
    EXPECT_EQ(mine.size(), per_rank);
    for (uint64_t w : mine) {
      EXPECT_GE(w, ds->first_window());
      EXPECT_LT(w, ds->first_window() + per_rank);
      EXPECT_TRUE(seen.insert(w).second) << "window " << w << " read by two ranks";
    }
    EXPECT_EQ(ds->batches_per_epoch(), per_rank / b);
  }
  EXPECT_EQ(per_rank * world, windows);
  EXPECT_EQ(seen.size(), windows);
  EXPECT_EQ(*seen.rbegin(), windows - 1);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, RankSliceTest, ::testing::Values(1, 2, 3, 4, 5));

TEST_F(DataTest, UnevenShardGivesEveryRankTheSameBatches) {
  const std::string path = WriteShard("s.bin", 1 + 16 * 103);
  for (int r = 0; r < 4; ++r) {
    auto ds =
        TokenDataset::Open(path, {.batch_size = 5, .seq_len = 16, .rank = r, .world_size = 4});
    ASSERT_TRUE(ds.ok());
    EXPECT_EQ(ds->windows_per_rank(), 25u);
    EXPECT_EQ(ds->batches_per_epoch(), 5u);
  }
}

TEST_F(DataTest, SameSeedSameBatchesNewEpochNewOrder) {
  const std::string path = WriteShard("s.bin", 1 + 8 * 400);
  DatasetOptions o{.batch_size = 10, .seq_len = 8, .seed = 5};
  auto a = TokenDataset::Open(path, o);
  auto b = TokenDataset::Open(path, o);
  o.seed = 6;
  auto c = TokenDataset::Open(path, o);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->batches_per_epoch(), 40u);
  EXPECT_NE(a->epoch_order(), c->epoch_order());
  const auto first_order = a->epoch_order();
  for (int i = 0; i < 40; ++i) {
    Batch x = a->Next();
    Batch y = b->Next();
    EXPECT_EQ(x.tokens, y.tokens);
    EXPECT_EQ(x.targets, y.targets);
  }
  EXPECT_EQ(a->position(), (DatasetPosition{0, 40}));
  a->Next();  // rolls into epoch 1
  EXPECT_EQ(a->position(), (DatasetPosition{1, 1}));
  EXPECT_NE(a->epoch_order(), first_order);
  auto sorted = a->epoch_order();
  std::sort(sorted.begin(), sorted.end());
  auto sorted0 = first_order;
  std::sort(sorted0.begin(), sorted0.end());
  EXPECT_EQ(sorted, sorted0) << "an epoch is a permutation of the same windows";
}

TEST_F(DataTest, PositionSaveAndRestore) {
  const std::string path = WriteShard("s.bin", 1 + 8 * 100);
  DatasetOptions o{.batch_size = 4, .seq_len = 8, .rank = 1, .world_size = 2, .seed = 9};
  auto a = TokenDataset::Open(path, o);
  ASSERT_TRUE(a.ok());
  for (int i = 0; i < 17; ++i) a->Next();  // 12 batches per epoch: now in epoch 1
  const std::string saved = a->position().ToString();
  EXPECT_EQ(saved, "1:5");
  std::vector<Batch> expected;
  for (int i = 0; i < 15; ++i) expected.push_back(a->Next());

  auto b = TokenDataset::Open(path, o);
  ASSERT_TRUE(b.ok());
  auto pos = DatasetPosition::Parse(saved);
  ASSERT_TRUE(pos.ok());
  ASSERT_TRUE(b->Restore(*pos).ok());
  for (int i = 0; i < 15; ++i) {
    Batch got = b->Next();
    EXPECT_EQ(got.tokens, expected[i].tokens) << "batch " << i;
    EXPECT_EQ(got.targets, expected[i].targets);
  }
  EXPECT_EQ(b->position(), a->position());
  EXPECT_EQ(b->Restore({0, 13}).code(), Code::kInvalidArgument);
  for (const char* bad : {"", "1", "1:", ":2", "a:b", "1:2:3", "-1:2"}) {
    EXPECT_FALSE(DatasetPosition::Parse(bad).ok()) << bad;
  }
}

TEST_F(DataTest, OpenRefusesBadShards) {
  WriteAll(dir_ / "odd.bin", "abc");
  EXPECT_EQ(TokenDataset::Open((dir_ / "odd.bin").string(), {}).status().code(), Code::kCorruption);
  const uint16_t big[] = {1, 2, 300, 4};
  WriteAll(dir_ / "big.bin", std::string(reinterpret_cast<const char*>(big), sizeof(big)));
  auto r = TokenDataset::Open((dir_ / "big.bin").string(), {.batch_size = 1, .seq_len = 1});
  EXPECT_EQ(r.status().code(), Code::kCorruption);
  EXPECT_NE(r.status().message().find("position 2"), std::string::npos);
  const std::string small = WriteShard("small.bin", 100);
  EXPECT_EQ(TokenDataset::Open(small, {.batch_size = 8, .seq_len = 64}).status().code(),
            Code::kFailedPrecondition);
  EXPECT_EQ(TokenDataset::Open(small, {.batch_size = 1, .seq_len = 8, .rank = 2, .world_size = 2})
                .status()
                .code(),
            Code::kInvalidArgument);
  EXPECT_EQ(TokenDataset::Open((dir_ / "none.bin").string(), {}).status().code(), Code::kNotFound);
  WriteAll(dir_ / "empty.bin", "");
  EXPECT_EQ(TokenDataset::Open((dir_ / "empty.bin").string(), {}).status().code(),
            Code::kFailedPrecondition);
}

}  // namespace
}  // namespace isthmus::data
