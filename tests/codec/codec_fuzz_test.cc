// Mutation fuzz of the codec decoder, the one that reads bytes from other sites: random
// byte flips, truncations, extensions and header-field rewrites of valid encodings must give
// InvalidArgument with the output untouched, or success with every output finite; never a
// crash (the build with -DISTHMUS_ASAN=ON runs this under ASan/UBSan).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ops/codec.h"

namespace isthmus::codec {
namespace {

struct Case {
  const char* pipeline;
  std::vector<int64_t> shape;
};

void CheckDecode(const std::string& bytes, size_t n, int* accepted, int* refused) {
  std::vector<float> out(n, 42.0f);
  Status st = Decode(bytes, out);
  // The check a receiver runs before it stores bytes (Check) answers as the decode does.
  const Status checked = Check(bytes, n);
  ASSERT_EQ(checked.ok(), st.ok()) << st.ToString() << " / " << checked.ToString();
  if (!st.ok()) ASSERT_EQ(checked.message(), st.message());
  if (st.ok()) {
    ++*accepted;
    for (float f : out) ASSERT_TRUE(std::isfinite(f));
  } else {
    ++*refused;
    ASSERT_EQ(st.code(), Code::kInvalidArgument);
    for (float f : out) ASSERT_EQ(f, 42.0f) << "output touched on error";
  }
}

TEST(CodecFuzz, MutatedEncodingsNeverCrash) {
  const std::vector<Case> cases = {
      {"dense", {300}},
      {"int8", {300}},
      {"int4:16", {257}},
      {"int2:8+zstd", {300}},
      {"topk:0.1", {500}},
      {"topk:0.1+int4", {500}},
      {"topk:0.05+int4+zstd", {40, 25}},
      {"blocktopk:0.2:32+int8", {333}},
      {"blocktopk:0.2:32+int2+zstd", {333}},
      {"lowrank:2", {24, 20}},
      {"lowrank:3+int8", {30, 20}},
      {"lowrank:2+int4+zstd", {24, 20}},
  };
  std::mt19937_64 rng(2024);
  int accepted = 0, refused = 0;
  for (const Case& c : cases) {
    size_t n = 1;
    for (int64_t d : c.shape) n *= static_cast<size_t>(d);
    std::normal_distribution<float> g;
    std::vector<float> x(n);
    for (float& f : x) f = g(rng);
    const std::string valid = Encode(ParsePipeline(c.pipeline).value(), x, c.shape);
    {
      std::vector<float> out(n);
      ASSERT_TRUE(Decode(valid, out).ok()) << c.pipeline;
    }
    for (int iter = 0; iter < 5000; ++iter) {
      std::string m = valid;
      const int kind = static_cast<int>(rng() % 6);
      const int edits = 1 + static_cast<int>(rng() % 4);
      for (int e = 0; e < edits; ++e) {
        if (m.empty()) break;
        const size_t pos = rng() % m.size();
        switch (kind) {
          case 0:  // flip one bit
            m[pos] = static_cast<char>(m[pos] ^ (1 << (rng() % 8)));
            break;
          case 1:  // random byte
            m[pos] = static_cast<char>(rng());
            break;
          case 2:  // truncate
            m.resize(pos);
            break;
          case 3:  // append junk
            m.push_back(static_cast<char>(rng()));
            break;
          case 4: {  // rewrite the varint header (sizes, counts, blocks) with extreme bytes:
                     // overlong, unterminated, 64-bit overflowing, zero, random
            const size_t field = 5 + rng() % 8;
            const uint8_t vals[] = {0x00, 0x01, 0x7f, 0x80, 0xff};
            const size_t len = 1 + rng() % 11;
            for (size_t b = 0; b < len && field + b < m.size(); ++b)
              m[field + b] = static_cast<char>(rng() % 2 ? vals[rng() % 5] : rng());
            break;
          }
          default:  // rewrite a byte near the start (flags, kinds, bits)
            m[rng() % std::min<size_t>(m.size(), 8)] = static_cast<char>(rng() % 40);
            break;
        }
      }
      CheckDecode(m, n, &accepted, &refused);
      if (iter % 50 == 0) CheckDecode(m, n + 1, &accepted, &refused);  // wrong size
    }
  }
  // Random garbage of many lengths.
  for (int iter = 0; iter < 5000; ++iter) {
    std::string m(rng() % 200, '\0');
    for (char& ch : m) ch = static_cast<char>(rng());
    if (m.size() >= 2 && iter % 2 == 0) {
      m[0] = 'I';
      m[1] = 'C';
      if (m.size() >= 3) m[2] = 2;
    }
    CheckDecode(m, rng() % 64, &accepted, &refused);
  }
  std::printf("fuzz: %d mutated inputs accepted (finite), %d refused\n", accepted, refused);
  EXPECT_GT(refused, 40000);
}

// A zstd frame that claims a huge size must be refused before any allocation of that size.
TEST(CodecFuzz, RefusesZstdBomb) {
  std::vector<float> x(1000, 0.0f);
  std::string valid = Encode(ParsePipeline("int8+zstd").value(), x, std::vector<int64_t>{1000});
  // Header: 5 fixed bytes, numel varint (2 bytes), quantisation block varint (1), then the
  // declared uncompressed length, replaced here by 2^40.
  ASSERT_EQ(static_cast<uint8_t>(valid[4]) & 0x10, 0x10) << "zstd kept for all-zero input";
  size_t end = 8;
  while (static_cast<uint8_t>(valid[end]) & 0x80) ++end;
  const char kHuge[] = {'\x80', '\x80', '\x80', '\x80', '\x80', '\x20'};  // varint 2^40
  std::string m = valid.substr(0, 8) + std::string(kHuge, 6) + valid.substr(end + 1);
  std::vector<float> out(1000, 1.0f);
  Status st = Decode(m, out);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("uncompressed"), std::string::npos) << st.ToString();
  EXPECT_EQ(out[0], 1.0f);
}

}  // namespace
}  // namespace isthmus::codec
