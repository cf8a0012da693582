// Tests of common/safetensors: round trips, F16/BF16 widening, refusal of every kind of
// malformed file, and the order-independent content hash.
#include "common/safetensors.h"

#include "common/hf_checkpoint.h"
#include "tests/test_dir.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <random>

namespace isthmus {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public testing::TestWithDir {
 protected:
  SafetensorsTest() : TestWithDir("isthmus_st") {}

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // Writes a file by hand: 8-byte length, header text, then raw data bytes.
  std::string WriteRaw(const std::string& name, const std::string& header, const std::string& data,
                       int64_t length_override = -1) {
    std::string p = Path(name);
    std::ofstream f(p, std::ios::binary);
    uint64_t len = length_override >= 0 ? static_cast<uint64_t>(length_override) : header.size();
    f.write(reinterpret_cast<const char*>(&len), 8);
    f << header << data;
    return p;
  }
};

std::string Floats(std::initializer_list<float> v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), std::data(v), s.size());
  return s;
}

Tensor MakeTensor(std::string name, std::vector<int64_t> shape, float start) {
  Tensor t{std::move(name), std::move(shape), {}};
  t.data.resize(static_cast<size_t>(NumElements(t.shape)));
  for (size_t i = 0; i < t.data.size(); ++i) t.data[i] = start + 0.25f * static_cast<float>(i);
  return t;
}

TEST_F(SafetensorsTest, RoundTripKeepsTensorsAndMetadata) {
  std::vector<Tensor> in = {MakeTensor("wte.weight", {4, 3}, -1.0f),
                            MakeTensor("h.0.ln_1.bias", {3}, 7.0f), MakeTensor("scalar", {}, 3.5f),
                            MakeTensor("empty", {0, 5}, 0.0f)};
  in[0].data[1] = -0.0f;
  in[0].data[2] = std::numeric_limits<float>::infinity();
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"round", "12"}};
  std::string p = Path("a.safetensors");
  ASSERT_TRUE(WriteSafetensors(p, in, meta).ok());
  std::ifstream f(p, std::ios::binary);
  uint64_t header_len = 0;
  f.read(reinterpret_cast<char*>(&header_len), 8);
  EXPECT_EQ(header_len % 8, 0u) << "header must be padded to 8 bytes";

  auto r = ReadSafetensors(p);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->metadata, meta);
  ASSERT_EQ(r->tensors.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(r->tensors[i].name, in[i].name);
    EXPECT_EQ(r->tensors[i].shape, in[i].shape);
    ASSERT_EQ(r->tensors[i].data.size(), in[i].data.size());
    EXPECT_EQ(r->tensors[i].data, in[i].data);
  }
  EXPECT_EQ(TensorsContentHash(r->tensors), TensorsContentHash(in));
  // No temporary files left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);

  auto plain = ReadSafetensorsTensors(p);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->size(), in.size());
}

TEST_F(SafetensorsTest, OverwriteReplacesAtomically) {
  std::string p = Path("b.safetensors");
  ASSERT_TRUE(WriteSafetensors(p, {MakeTensor("x", {2}, 1.0f)}).ok());
  ASSERT_TRUE(WriteSafetensors(p, {MakeTensor("y", {3}, 2.0f)}).ok());
  auto r = ReadSafetensors(p);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->tensors.size(), 1u);
  EXPECT_EQ(r->tensors[0].name, "y");
  EXPECT_TRUE(r->metadata.empty());
}

TEST_F(SafetensorsTest, WriteRefusesBadInput) {
  Tensor bad = MakeTensor("x", {2, 2}, 0.0f);
  bad.data.pop_back();
  EXPECT_EQ(WriteSafetensors(Path("c"), {bad}).code(), Code::kInvalidArgument);
  EXPECT_EQ(WriteSafetensors(Path("c"), {MakeTensor("x", {1}, 0), MakeTensor("x", {1}, 0)}).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(WriteSafetensors(Path("c"), {MakeTensor("__metadata__", {1}, 0)}).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(WriteSafetensors(Path("c"), {MakeTensor("", {1}, 0)}).code(), Code::kInvalidArgument);
  EXPECT_FALSE(fs::exists(Path("c")));
  EXPECT_EQ(WriteSafetensors(Path("no/such/dir/c"), {}).code(), Code::kIoError);
}

TEST_F(SafetensorsTest, ReadsF16AndBf16) {
  // F16: 1.0, -2.0, 65504 (max), 2^-24 (smallest subnormal), inf, 0.5.
  const uint16_t f16[] = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x7c00, 0x3800};
  // BF16: 1.0, -3.0, 1e-38-ish normal (0x00800000 -> 0x0080), 3.140625.
  const uint16_t bf16[] = {0x3f80, 0xc040, 0x0080, 0x4049};
  std::string data(reinterpret_cast<const char*>(f16), sizeof(f16));
  data.append(reinterpret_cast<const char*>(bf16), sizeof(bf16));
  std::string header = R"({"h":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]},)"
                       R"("b":{"dtype":"BF16","shape":[4],"data_offsets":[12,20]}})";
  auto r = ReadSafetensors(WriteRaw("h.safetensors", header, data));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->tensors.size(), 2u);
  const Tensor& h = r->tensors[0];
  EXPECT_EQ(h.name, "h");
  EXPECT_EQ(h.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(h.data, (std::vector<float>{1.0f, -2.0f, 65504.0f, std::ldexp(1.0f, -24),
                                        std::numeric_limits<float>::infinity(), 0.5f}));
  const Tensor& b = r->tensors[1];
  EXPECT_EQ(b.name, "b");
  EXPECT_EQ(b.data,
            (std::vector<float>{1.0f, -3.0f, std::bit_cast<float>(0x00800000u), 3.140625f}));
  // Every F16 bit pattern widens exactly like the hardware conversion would.
  std::string all(65536 * 2, '\0');
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t v = static_cast<uint16_t>(i);
    std::memcpy(all.data() + 2 * i, &v, 2);
  }
  auto full = ReadSafetensors(
      WriteRaw("all.safetensors",
               R"({"a":{"dtype":"F16","shape":[65536],"data_offsets":[0,131072]}})", all));
  ASSERT_TRUE(full.ok());
  for (uint32_t i = 0; i < 65536; ++i) {
    const float got = full->tensors[0].data[i];
    const _Float16 ref = std::bit_cast<_Float16>(static_cast<uint16_t>(i));
    if (std::isnan(static_cast<float>(ref))) {
      ASSERT_TRUE(std::isnan(got)) << i;
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(static_cast<float>(ref)))
          << "bits " << i;
    }
  }
}

struct BadFile {
  const char* label;
  std::string header;
  std::string data;
  int64_t length_override;
  Code code;
  const char* message_part;
};

TEST_F(SafetensorsTest, RefusesEveryCorruptionKind) {
  const std::string f8 = Floats({1, 2});
  const std::vector<BadFile> cases = {
      {"length beyond file", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", f8, 1000,
       Code::kCorruption, "exceeds the file size"},
      {"huge length", "{}", "", int64_t{1} << 62, Code::kCorruption, "exceeds the file size"},
      {"not json", "{this is not json", "", -1, Code::kCorruption, "not valid JSON"},
      {"not an object", "[1,2]", "", -1, Code::kCorruption, "does not start with '{'"},
      {"too deep", R"({"a":{"b":[[[[1]]]]}})", "", -1, Code::kCorruption, "nests too deep"},
      {"missing field", R"({"a":{"dtype":"F32","shape":[2]}})", f8, -1, Code::kCorruption,
       "lacks dtype"},
      {"bad dtype", R"({"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", f8, -1,
       Code::kInvalidArgument, "not supported"},
      {"negative dim", R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f8, -1,
       Code::kCorruption, "negative"},
      {"overflowing shape",
       R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", f8, -1,
       Code::kCorruption, "overflows"},
      // Element counts whose byte count wraps to 0 in 64 bits, with an empty data range.
      {"shape wrapping to 0 bytes",
       R"({"a":{"dtype":"F32","shape":[4611686018427387904],)"
       R"("data_offsets":[0,0]}})",
       "", -1, Code::kCorruption, "overflows"},
      {"two dims wrapping to 0 bytes",
       R"({"a":{"dtype":"F32","shape":[2147483648,2147483648],)"
       R"("data_offsets":[0,0]}})",
       "", -1, Code::kCorruption, "overflows"},
      {"bf16 wrapping to 0 bytes",
       R"({"a":{"dtype":"BF16","shape":[2305843009213693952,4],)"
       R"("data_offsets":[0,0]}})",
       "", -1, Code::kCorruption, "overflows"},
      {"fractional dim", R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,8]}})", f8, -1,
       Code::kCorruption, "non-integer"},
      {"size mismatch", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", f8, -1,
       Code::kCorruption, "does not match shape"},
      {"end before begin", R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", f8, -1,
       Code::kCorruption, "end before begin"},
      {"negative offset", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", f8, -1,
       Code::kCorruption, "data_offsets"},
      {"offsets beyond data", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", f8, -1,
       Code::kCorruption, "beyond the data buffer"},
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       f8, -1, Code::kCorruption, "overlap"},
      {"gap",
       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
       R"("b":{"dtype":"F32","shape":[0],"data_offsets":[8,8]}})",
       f8, -1, Code::kCorruption, "gap"},
      {"trailing bytes", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", f8, -1,
       Code::kCorruption, "trailing bytes"},
      {"duplicate name",
       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
       R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       f8, -1, Code::kCorruption, "duplicate key 'a'"},
      {"metadata not strings", R"({"__metadata__":{"k":1}})", "", -1, Code::kCorruption,
       "not a string"},
      {"metadata not object", R"({"__metadata__":"x"})", "", -1, Code::kCorruption,
       "__metadata__ is not an object"},
      {"entry not object", R"({"a":3})", "", -1, Code::kCorruption, "not an object"},
      {"empty name", R"({"":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})", "", -1,
       Code::kCorruption, "empty name"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const BadFile& c = cases[i];
    std::string p = WriteRaw("bad" + std::to_string(i), c.header, c.data, c.length_override);
    auto r = ReadSafetensors(p);
    ASSERT_FALSE(r.ok()) << c.label;
    EXPECT_EQ(r.status().code(), c.code) << c.label << ": " << r.status().ToString();
    EXPECT_NE(r.status().message().find(p), std::string::npos) << c.label;
    EXPECT_NE(r.status().message().find(c.message_part), std::string::npos)
        << c.label << ": " << r.status().ToString();
  }
  // Shorter than the length prefix itself.
  {
    std::string p = Path("short");
    std::ofstream(p) << "abc";
    EXPECT_EQ(ReadSafetensors(p).status().code(), Code::kCorruption);
  }
  EXPECT_EQ(ReadSafetensors(Path("missing")).status().code(), Code::kNotFound);
  EXPECT_EQ(ReadSafetensors(dir_.string()).status().code(), Code::kInvalidArgument);
}

// Random byte flips and truncations of a valid file must give a clean error or a valid
// result, never a crash (run under ISTHMUS_ASAN to catch memory errors).
TEST_F(SafetensorsTest, MutatedFilesNeverCrash) {
  std::string p = Path("ok.safetensors");
  ASSERT_TRUE(
      WriteSafetensors(p, {MakeTensor("a", {3, 2}, 1.0f), MakeTensor("b", {5}, 0.0f)}, {{"k", "v"}})
          .ok());
  std::ifstream in(p, std::ios::binary);
  const std::string good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::mt19937 rng(1234);
  int refused = 0;
  const std::string q = Path("mutant");
  for (int iter = 0; iter < 1500; ++iter) {
    std::string bytes = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      // Bias towards the header, where the interesting damage happens.
      const size_t limit = (rng() % 4 == 0) ? bytes.size() : std::min<size_t>(bytes.size(), 120);
      bytes[rng() % limit] = static_cast<char>(rng());
    }
    if (rng() % 5 == 0) bytes.resize(rng() % bytes.size());
    std::ofstream(q, std::ios::binary | std::ios::trunc) << bytes;
    auto r = ReadSafetensors(q);
    if (!r.ok()) {
      ++refused;
      EXPECT_TRUE(r.status().code() == Code::kCorruption ||
                  r.status().code() == Code::kInvalidArgument)
          << r.status().ToString();
    }
  }
  EXPECT_GT(refused, 500);
}

TEST_F(SafetensorsTest, HashIsOrderIndependentAndSensitive) {
  std::vector<Tensor> a = {MakeTensor("x", {2, 3}, 0.0f), MakeTensor("y", {4}, 1.0f),
                           MakeTensor("z", {}, 2.0f)};
  const std::string h = TensorsContentHash(a);
  EXPECT_EQ(h.size(), 64u);
  EXPECT_EQ(h.find_first_not_of("0123456789abcdef"), std::string::npos);
  std::vector<Tensor> b = {a[2], a[0], a[1]};
  EXPECT_EQ(TensorsContentHash(b), h);

  auto changed = [&](auto mutate) {
    std::vector<Tensor> c = a;
    mutate(c);
    return TensorsContentHash(c);
  };
  EXPECT_NE(changed([](auto& c) { c[0].name = "w"; }), h);
  EXPECT_NE(changed([](auto& c) { c[0].shape = {3, 2}; }), h);
  EXPECT_NE(changed([](auto& c) { c[0].shape = {6}; }), h);
  EXPECT_NE(changed([](auto& c) { c[1].data[3] = std::nextafter(c[1].data[3], 100.0f); }), h);
  EXPECT_NE(changed([](auto& c) { c[0].data[0] = -0.0f; }), h);  // was +0.0
  EXPECT_NE(changed([](auto& c) { c.pop_back(); }), h);
  EXPECT_NE(changed([](auto& c) { c.push_back(MakeTensor("e", {0}, 0.0f)); }), h);
  // Moving a byte between a name and the next field must not collide.
  std::vector<Tensor> p1 = {{"ab", {1}, {1.0f}}};
  std::vector<Tensor> p2 = {{"a", {1}, {1.0f}}};
  EXPECT_NE(TensorsContentHash(p1), TensorsContentHash(p2));
  // Two tensors swapping values (names fixed) is a change.
  std::vector<Tensor> s1 = {{"p", {1}, {1.0f}}, {"q", {1}, {2.0f}}};
  std::vector<Tensor> s2 = {{"p", {1}, {2.0f}}, {"q", {1}, {1.0f}}};
  EXPECT_NE(TensorsContentHash(s1), TensorsContentHash(s2));
  EXPECT_EQ(TensorsContentHash({}), TensorsContentHash({}));
}

// Hugging Face's sharded layout: shards of at most the size asked (a bigger tensor alone),
// an index naming each tensor's shard, read back as the same tensors; a later one-file
// write removes the shards; an index that disagrees with its shards is refused by name.
TEST_F(SafetensorsTest, HuggingFaceShardsAndIndexRoundTripAndDisagreementsAreRefused) {
  std::vector<Tensor> tensors;
  for (int k = 0; k < 7; ++k) {
    tensors.push_back(MakeTensor("t" + std::to_string(k), {k == 3 ? 300 : 40}, k));
  }
  const std::string dir = dir_.string();
  ASSERT_TRUE(WriteHfCheckpoint(dir, tensors, {{"format", "pt"}}, 400).ok());
  auto index = FindHfCheckpoint(dir);
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  EXPECT_EQ(*index, Path(kHfIndexFile));
  EXPECT_FALSE(fs::exists(Path(kHfSingleFile)));
  // 40 floats = 160 bytes: two to a 400-byte shard; t3 (1200 bytes) alone.
  const char* shards[] = {"model-00001-of-00005.safetensors", "model-00002-of-00005.safetensors",
                          "model-00003-of-00005.safetensors", "model-00004-of-00005.safetensors",
                          "model-00005-of-00005.safetensors"};
  for (const char* s : shards) EXPECT_TRUE(fs::exists(Path(s))) << s;
  EXPECT_EQ(ReadSafetensorsInfo(Path(shards[1])).value().tensors[0].name, "t2");
  EXPECT_EQ(ReadSafetensorsInfo(Path(shards[2])).value().tensors[0].name, "t3");
  auto back = ReadHfCheckpoint(*index);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(TensorsContentHash(back->tensors), TensorsContentHash(tensors));
  EXPECT_EQ(back->metadata.at("format"), "pt");
  EXPECT_EQ(ReadHfCheckpointInfo(*index).value().tensors.size(), 7u);

  auto refused = [&](const std::string& weight_map, const std::string& words) {
    std::ofstream(Path("bad.index.json")) << R"({"weight_map": )" << weight_map << "}";
    auto r = ReadHfCheckpoint(Path("bad.index.json"));
    EXPECT_EQ(r.status().code(), Code::kCorruption) << weight_map;
    EXPECT_NE(r.status().message().find(words), std::string::npos) << r.status().ToString();
  };
  std::string map = R"({"t0": "A", "t1": "A", "t2": "B", "t3": "C", "t4": "D", "t5": "D",
                        "t6": "E"})";
  auto with = [&](std::string m) {
    for (int k = 0; k < 5; ++k) {
      const std::string from = std::string("\"") + char('A' + k) + "\"";
      for (size_t at; (at = m.find(from)) != std::string::npos;) {
        m.replace(at, from.size(), std::string("\"") + shards[k] + "\"");
      }
    }
    return m;
  };
  std::ofstream(Path("good.index.json")) << R"({"weight_map": )" << with(map) << "}";
  EXPECT_TRUE(ReadHfCheckpoint(Path("good.index.json")).ok());
  refused(with(R"({"t0": "A", "t1": "B", "t2": "B", "t3": "C", "t4": "D", "t5": "D",
                   "t6": "E"})"),
          "holds tensor t1, which");
  refused(with(R"({"t0": "A", "t1": "A", "t2": "B", "t3": "C", "t4": "D", "t5": "D",
                   "t6": "E", "t9": "E"})"),
          "places tensor t9");
  refused(R"({"t0": "../model-00001-of-00005.safetensors"})", "is not a file name");
  refused(R"(["not", "a", "map"])", "not an index");

  // One file again: the shards and the index are gone.
  ASSERT_TRUE(WriteHfCheckpoint(dir, tensors, {}, kHfDefaultShardBytes).ok());
  EXPECT_EQ(*FindHfCheckpoint(dir), Path(kHfSingleFile));
  for (const char* s : shards) EXPECT_FALSE(fs::exists(Path(s))) << s;
  EXPECT_FALSE(fs::exists(Path(kHfIndexFile)));
  EXPECT_EQ(FindHfCheckpoint(Path("nothing-here")).value(), Path("nothing-here"));
  fs::create_directories(Path("empty"));
  EXPECT_EQ(FindHfCheckpoint(Path("empty")).status().code(), Code::kNotFound);
}

// BF16 and F16 files: each value rounded to the nearest representable one, ties to even;
// F16 overflows to infinity from 65520 and goes through its subnormals to zero; NaN stays
// NaN. Read back (widened to fp32) they are exactly those values.
TEST_F(SafetensorsTest, WritesBf16AndF16RoundedToNearestEven) {
  const float inf = std::numeric_limits<float>::infinity();
  const float p8 = std::ldexp(1.0f, -8), p24 = std::ldexp(1.0f, -24);
  struct Case {
    float in, bf16, f16;
  };
  const std::vector<Case> cases = {
      {1.0f, 1.0f, 1.0f},
      {-2.5f, -2.5f, -2.5f},
      {1.0f + p8, 1.0f, 1.0f + p8},                          // bf16: a tie, to the even 1.0
      {1.0f + 3 * p8, 1.0f + 4 * p8, 1.0f + 3 * p8},         // bf16: a tie, to the even neighbour
      {65504.0f, 65536.0f, 65504.0f},                        // F16's largest
      {65519.0f, 65536.0f, 65504.0f},                        // just below the tie
      {65520.0f, 65536.0f, inf},                             // the tie: to infinity
      {std::ldexp(1.0f, -27), std::ldexp(1.0f, -27), 0.0f},  // below half of F16's least subnormal
      {3 * p24 / 2, 3 * p24 / 2, 2 * p24},                   // 1.5 subnormal units: to 2
      {std::ldexp(1.0f, -14), std::ldexp(1.0f, -14), std::ldexp(1.0f, -14)},  // least normal
      {1.0f / 3.0f, 0.333984375f, 0.333251953125f},
      {-inf, -inf, -inf},
  };
  Tensor t{"x", {static_cast<int64_t>(cases.size()) + 1}, {}};
  for (const Case& c : cases) t.data.push_back(c.in);
  t.data.push_back(std::numeric_limits<float>::quiet_NaN());
  for (FileDtype d : {FileDtype::kBF16, FileDtype::kF16}) {
    const std::string path = Path(std::string("x.") + FileDtypeName(d));
    ASSERT_TRUE(WriteSafetensors(path, {t}, {}, d).ok());
    EXPECT_EQ(fs::file_size(path) % 8, (cases.size() + 1) * 2 % 8);
    auto back = ReadSafetensors(path);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    const std::vector<float>& v = back->tensors[0].data;
    for (size_t i = 0; i < cases.size(); ++i) {
      const float want = d == FileDtype::kBF16 ? cases[i].bf16 : cases[i].f16;
      EXPECT_EQ(std::bit_cast<uint32_t>(v[i]), std::bit_cast<uint32_t>(want))
          << FileDtypeName(d) << " of " << cases[i].in << ": " << v[i] << " want " << want;
    }
    EXPECT_TRUE(std::isnan(v.back()));
  }
  EXPECT_EQ(ParseFileDtype("BFloat16").value(), FileDtype::kBF16);
  EXPECT_EQ(ParseFileDtype("fp16").value(), FileDtype::kF16);
  EXPECT_EQ(ParseFileDtype("double").status().code(), Code::kInvalidArgument);
}

// Checkpoints are written past the page cache (O_DIRECT, padded to whole blocks and cut
// back): the file must be byte for byte the buffered one, for sizes that are no multiple of
// a block and tensors larger than the writer's buffer, in every file dtype.
TEST_F(SafetensorsTest, DirectAndBufferedWritesGiveTheSameBytes) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<Tensor> tensors;
  for (const int64_t n : {int64_t{1}, int64_t{1023}, int64_t{(9 << 20) / 4 + 77}, int64_t{5}}) {
    Tensor t{"t" + std::to_string(tensors.size()), {n}, {}};
    for (int64_t i = 0; i < n; ++i) t.data.push_back(u(rng));
    tensors.push_back(std::move(t));
  }
  const std::map<std::string, std::string> meta = {{"format", "isthmus-checkpoint"}};
  auto read_bytes = [](const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  };
  for (FileDtype d : {FileDtype::kF32, FileDtype::kBF16, FileDtype::kF16}) {
    const std::string direct = Path(std::string("direct.") + FileDtypeName(d));
    const std::string buffered = Path(std::string("buffered.") + FileDtypeName(d));
    // Over an older, longer file: the rename replaces it whole.
    ASSERT_TRUE(WriteSafetensors(direct, tensors, meta, FileDtype::kF32, true).ok());
    ASSERT_TRUE(WriteSafetensors(direct, tensors, meta, d, true).ok());
    ASSERT_TRUE(WriteSafetensors(buffered, tensors, meta, d, false).ok());
    const std::string a = read_bytes(direct), b = read_bytes(buffered);
    ASSERT_EQ(a.size(), b.size()) << FileDtypeName(d);
    EXPECT_TRUE(a == b) << FileDtypeName(d);
    auto back = ReadSafetensors(direct);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    ASSERT_EQ(back->tensors.size(), tensors.size());
    if (d == FileDtype::kF32) {
      for (size_t i = 0; i < tensors.size(); ++i) EXPECT_EQ(back->tensors[i].data, tensors[i].data);
    }
  }
  for (const auto& e : fs::directory_iterator(dir_)) {
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();
  }
}

}  // namespace
}  // namespace isthmus
