// What the WAN codecs promise: pipeline text round-trips, each codec's error stays within its
// stated bound, encodings are deterministic, decoding refuses mismatched sizes, error
// feedback makes the sum of decoded deltas track the true sum, and adaptive mode respects
// budget, floor and ceiling.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "ops/codec.h"
#include "ops/codec_outer.h"
#include "ops/codec_worker.h"

namespace isthmus::codec {
namespace {

Pipeline P(std::string_view text) {
  auto r = ParsePipeline(text);
  EXPECT_TRUE(r.ok()) << text << ": " << r.status().ToString();
  return r.ok() ? r.value() : Pipeline{};
}

std::vector<float> Gaussian(size_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (float& f : v) f = d(gen);
  return v;
}

double Norm(const std::vector<float>& v) {
  double s = 0;
  for (float f : v) s += double{f} * f;
  return std::sqrt(s);
}

double RelErr(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += (double{a[i]} - b[i]) * (double{a[i]} - b[i]);
  return std::sqrt(s) / Norm(a);
}

std::vector<float> RoundTrip(const Pipeline& p, const std::vector<float>& x,
                             std::vector<int64_t> shape = {}) {
  if (shape.empty()) shape = {static_cast<int64_t>(x.size())};
  std::string bytes = Encode(p, x, shape);
  std::vector<float> y(x.size(), -7.0f);
  Status st = Decode(bytes, y);
  EXPECT_TRUE(st.ok()) << ToString(p) << ": " << st.ToString();
  return y;
}

TEST(CodecParse, CanonicalRoundTrip) {
  for (const char* t : {"dense", "int8", "int8+zstd", "topk:0.01+int4+zstd",
                        "blocktopk:0.05:256+int2+zstd", "lowrank:4+zstd", "int4:128", "zstd:9",
                        "lowrank:2+topk:0.5+int8:32+zstd:1", "topk:1", "defer"}) {
    auto p = ParsePipeline(t);
    ASSERT_TRUE(p.ok()) << t << ": " << p.status().ToString();
    EXPECT_EQ(ToString(*p), t);
    auto again = ParsePipeline(ToString(*p));
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(*again, *p);
  }
  EXPECT_EQ(P("int4").quant_block, 64u);
  EXPECT_EQ(P("zstd").zstd_level, 3);
  EXPECT_TRUE(ParsePipeline(kDefaultPipeline).ok());
}

TEST(CodecParse, RejectsBadText) {
  for (const char* t :
       {"",           "dense+zstd", "int3",          "topk",          "topk:0",
        "topk:1.5",   "topk:-0.1",  "topk:abc",      "blocktopk:0.1", "blocktopk:0.1:0",
        "int8+int4",  "zstd+int8",  "int8+topk:0.1", "lowrank:0",     "lowrank:999",
        "zstd:0",     "zstd:30",    "int8:0",        "int8+",         "+int8",
        "topk:0.1:5", "snappy",     "defer+zstd",    "int8+defer"}) {
    auto p = ParsePipeline(t);
    EXPECT_FALSE(p.ok()) << "accepted '" << t << "'";
    if (!p.ok()) {
      EXPECT_EQ(p.status().code(), Code::kInvalidArgument);
    }
  }
}

TEST(CodecRoundTrip, DenseIsExact) {
  std::vector<float> x = Gaussian(1000, 1);
  EXPECT_EQ(RoundTrip(P("dense"), x), x);
  EXPECT_EQ(RoundTrip(P("zstd"), x), x);
  std::vector<float> empty;
  EXPECT_TRUE(RoundTrip(P("topk:0.1+int4+zstd"), empty).empty());
}

// Per element: |x - y| <= scale / 2 where scale = max|block| / qmax.
TEST(CodecRoundTrip, QuantisersStayWithinHalfAStep) {
  std::vector<float> x = Gaussian(10007, 2);
  x[5] = 40.0f;  // an outlier only hurts its own block
  for (auto [text, qmax] :
       {std::pair{"int8", 127}, {"int4", 7}, {"int8:16+zstd", 127}, {"int4:256+zstd", 7}}) {
    Pipeline p = P(text);
    std::vector<float> y = RoundTrip(p, x);
    const size_t b = p.quant_block;
    for (size_t start = 0; start < x.size(); start += b) {
      float m = 0;
      for (size_t i = start; i < std::min(x.size(), start + b); ++i)
        m = std::max(m, std::fabs(x[i]));
      const float bound = m / qmax * 0.5f * 1.0001f;
      for (size_t i = start; i < std::min(x.size(), start + b); ++i)
        ASSERT_LE(std::fabs(x[i] - y[i]), bound) << text << " at " << i;
    }
  }
  EXPECT_LT(RelErr(x, RoundTrip(P("int8"), x)), 0.01);
  EXPECT_LT(RelErr(x, RoundTrip(P("int4"), x)), 0.15);
}

TEST(CodecRoundTrip, Int2IsTernaryWithBoundedError) {
  std::vector<float> x = Gaussian(8192, 3);
  std::vector<float> y = RoundTrip(P("int2:64"), x);
  for (size_t start = 0; start < x.size(); start += 64) {
    float scale = 0;
    for (size_t i = start; i < start + 64; ++i) scale = std::max(scale, std::fabs(y[i]));
    for (size_t i = start; i < start + 64; ++i)
      ASSERT_TRUE(y[i] == 0.0f || std::fabs(y[i]) == scale) << "not ternary at " << i;
  }
  const double err = RelErr(x, y);
  EXPECT_LT(err, 0.6);  // Gaussian: optimal ternary is about 0.53
  EXPECT_GT(err, 0.2);
}

TEST(CodecRoundTrip, TopKKeepsTheLargestExactly) {
  std::vector<float> x = Gaussian(5000, 4);
  std::vector<float> y = RoundTrip(P("topk:0.03"), x);
  size_t kept = 0;
  float min_kept = INFINITY, max_dropped = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (y[i] != 0.0f) {
      ++kept;
      EXPECT_EQ(y[i], x[i]);
      min_kept = std::min(min_kept, std::fabs(x[i]));
    } else {
      max_dropped = std::max(max_dropped, std::fabs(x[i]));
    }
  }
  EXPECT_EQ(kept, 150u);  // ceil(0.03 * 5000)
  EXPECT_GE(min_kept, max_dropped);
}

TEST(CodecRoundTrip, TopKWithTiesIsDeterministic) {
  std::vector<float> x(100, 1.0f);  // all tied: the lowest indices win
  std::vector<float> y = RoundTrip(P("topk:0.1"), x);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(y[i], i < 10 ? 1.0f : 0.0f) << i;
}

// The kept set is the k largest magnitudes with ties to the lower index, also when many
// values tie at the threshold (values from a small set): checked against a sort by that
// order, for whole-tensor and per-block top-k.
TEST(CodecRoundTrip, TopKIsTheLargestWithTiesToTheLowerIndex) {
  std::mt19937 gen(17);
  std::uniform_int_distribution<int> pick(-4, 4);
  std::vector<float> x(3001);
  for (float& f : x) f = 0.5f * static_cast<float>(pick(gen));
  auto reference = [&](size_t begin, size_t end, double density) {
    std::vector<size_t> idx(end - begin);
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = begin + i;
    std::stable_sort(idx.begin(), idx.end(),
                     [&](size_t a, size_t b) { return std::fabs(x[a]) > std::fabs(x[b]); });
    const size_t k = std::min(idx.size(), static_cast<size_t>(std::ceil(density * idx.size())));
    idx.resize(k);
    return idx;
  };
  for (double density : {0.001, 0.05, 0.3, 0.9}) {
    std::vector<float> want(x.size(), 0.0f);
    for (size_t i : reference(0, x.size(), density)) want[i] = x[i];
    EXPECT_EQ(RoundTrip(P("topk:" + std::to_string(density)), x), want) << density;
    std::vector<float> want_blocks(x.size(), 0.0f);
    for (size_t b = 0; b < x.size(); b += 250) {
      for (size_t i : reference(b, std::min(x.size(), b + 250), density)) want_blocks[i] = x[i];
    }
    EXPECT_EQ(RoundTrip(P("blocktopk:" + std::to_string(density) + ":250"), x), want_blocks)
        << density;
  }
}

// On a large tensor top-k selects among the values at least a strided sample's bound
// (ops/codec.cc, SelectTopK); the kept set must still be exactly the k largest with ties to the
// lower index, whatever the data: Gaussian, a few values with many ties at the threshold,
// sorted, mostly zeros, and a pattern whose large values sit exactly on the sample's
// positions (2^18 values, stride 64), so that the sample overestimates and the selection
// falls back to every magnitude.
TEST(CodecRoundTrip, TopKOnALargeTensorIsTheLargestWithTiesToTheLowerIndex) {
  const size_t n = size_t{1} << 18;
  std::mt19937 gen(23);
  std::uniform_int_distribution<int> pick(-4, 4);
  std::vector<std::pair<std::string, std::vector<float>>> cases;
  cases.emplace_back("gaussian", Gaussian(n, 9));
  std::vector<float> ties(n);
  for (float& f : ties) f = 0.25f * static_cast<float>(pick(gen));
  cases.emplace_back("ties", ties);
  std::vector<float> sorted = Gaussian(n, 10);
  std::sort(sorted.begin(), sorted.end());
  cases.emplace_back("sorted", sorted);
  std::vector<float> sparse(n, 0.0f);
  for (size_t i = 0; i < n; i += 97) sparse[i] = static_cast<float>(i % 13) - 6.0f;
  cases.emplace_back("mostly zeros", sparse);
  std::vector<float> aligned(n);
  for (size_t i = 0; i < n; ++i) aligned[i] = i % 64 == 0 ? 100.0f : 1.0f + 1e-6f * (i % 7);
  cases.emplace_back("aligned with the sample", aligned);
  for (const auto& [name, x] : cases) {
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return std::fabs(x[a]) > std::fabs(x[b]); });
    for (double density : {0.0001, 0.01, 0.05, 0.2, 0.6}) {
      const size_t k = static_cast<size_t>(std::ceil(density * static_cast<double>(n)));
      std::vector<float> want(n, 0.0f);
      for (size_t j = 0; j < k; ++j) want[order[j]] = x[order[j]];
      EXPECT_EQ(RoundTrip(P("topk:" + std::to_string(density)), x), want)
          << name << ", density " << density;
    }
  }
}

TEST(CodecRoundTrip, BlockTopKKeepsPerBlock) {
  std::vector<float> x = Gaussian(1000, 5);
  for (size_t i = 0; i < 100; ++i) x[i] *= 100.0f;  // global top-k would take only block 0
  std::vector<float> y = RoundTrip(P("blocktopk:0.1:100"), x);
  for (size_t b = 0; b < 10; ++b) {
    int kept = 0;
    for (size_t i = b * 100; i < b * 100 + 100; ++i) kept += y[i] != 0.0f;
    EXPECT_EQ(kept, 10) << "block " << b;
  }
}

TEST(CodecRoundTrip, TopKThenInt4Bounded) {
  std::vector<float> x = Gaussian(20000, 6);
  std::vector<float> dense_topk = RoundTrip(P("topk:0.05"), x);
  std::vector<float> y = RoundTrip(P("topk:0.05+int4+zstd"), x);
  // Quantisation adds at most half a step (max/14 of each block of kept values).
  double q_err = RelErr(dense_topk, y);
  EXPECT_LT(q_err, 0.08);
  for (size_t i = 0; i < x.size(); ++i)
    if (dense_topk[i] == 0.0f) {
      ASSERT_EQ(y[i], 0.0f);
    }
}

TEST(CodecRoundTrip, LowRankRecoversALowRankMatrix) {
  const int64_t rows = 96, cols = 80, rank = 3;
  std::vector<float> u = Gaussian(rows * rank, 7), v = Gaussian(cols * rank, 8);
  std::vector<float> m(rows * cols, 0.0f);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t k = 0; k < rank; ++k) m[i * cols + j] += u[i * rank + k] * v[j * rank + k];
  std::vector<int64_t> shape = {rows, cols};
  EXPECT_LT(RelErr(m, RoundTrip(P("lowrank:3"), m, shape)), 1e-5);
  EXPECT_LT(RelErr(m, RoundTrip(P("lowrank:4+zstd"), m, shape)), 1e-5);
  EXPECT_LT(RelErr(m, RoundTrip(P("lowrank:3+int8+zstd"), m, shape)), 0.02);
  std::string bytes = Encode(P("lowrank:3"), m, shape);
  EXPECT_LT(bytes.size(), m.size() * 4 / 10);
  // A rank-1 codec captures the dominant direction only: error well below 1, above 0.
  double e1 = RelErr(m, RoundTrip(P("lowrank:1"), m, shape));
  EXPECT_GT(e1, 0.05);
  EXPECT_LT(e1, 0.95);
}

TEST(CodecRoundTrip, LowRankFallsBackFor1DAndSmall) {
  std::vector<float> x = Gaussian(64, 9);
  // 1-D: the rest of the pipeline (int8) applies.
  std::vector<float> y = RoundTrip(P("lowrank:4+int8"), x, {64});
  EXPECT_LT(RelErr(x, y), 0.01);
  EXPECT_EQ(Encode(P("lowrank:4+int8"), x, std::vector<int64_t>{64}),
            Encode(P("int8"), x, std::vector<int64_t>{64}));
  // 8x8 with rank 4: factors as large as the matrix -> dense fallback, exact.
  EXPECT_EQ(RoundTrip(P("lowrank:4"), x, {8, 8}), x);
}

TEST(CodecRoundTrip, NonFiniteInputsBecomeZero) {
  std::vector<float> x = {1.0f, NAN, INFINITY, -INFINITY, 2.0f};
  std::vector<float> y = RoundTrip(P("dense"), x);
  EXPECT_EQ(y, (std::vector<float>{1.0f, 0.0f, 0.0f, 0.0f, 2.0f}));
  y = RoundTrip(P("topk:0.4+int8"), x);
  for (float f : y) EXPECT_TRUE(std::isfinite(f));
}

TEST(CodecDecode, RefusesWrongSizeAndLeavesOutputUntouched) {
  std::vector<float> x = Gaussian(100, 10);
  std::string bytes = Encode(P("int8+zstd"), x, std::vector<int64_t>{100});
  std::vector<float> out(99, 3.0f);
  Status st = Decode(bytes, out);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  for (float f : out) EXPECT_EQ(f, 3.0f);
  std::vector<float> ok(100);
  EXPECT_TRUE(Decode(bytes, ok).ok());
  EXPECT_FALSE(Decode(bytes.substr(0, bytes.size() - 1), ok).ok());
  EXPECT_FALSE(Decode(bytes + "x", ok).ok());
  EXPECT_FALSE(Decode("", ok).ok());
}

// The merge's decode-and-add equals decoding into a buffer and AddWeighted, bit for bit, for
// every kind of encoding, onto sums that started from +0.0 (which hold no -0.0) and onto
// arbitrary values; a refused encoding leaves the sum untouched.
TEST(CodecDecode, DecodeAddWeightedIsDecodeThenAddWeightedBitForBit) {
  const std::vector<int64_t> shape = {48, 40};
  const size_t n = 48 * 40;
  const std::vector<std::string> pipelines = {
      "dense",     "int2:256+zstd",         "int8",           "topk:0.01+int4:256+zstd",
      "topk:0.05", "blocktopk:0.1:64+int8", "lowrank:4+int8", "defer"};
  for (const auto& text : pipelines) {
    SCOPED_TRACE(text);
    const Pipeline p = P(text);
    // Three sites' deltas summed with weights, as a commit merges them.
    std::vector<float> reference(n, 0.0f), sum(n, 0.0f), decoded(n);
    const float weights[] = {0.5f, 0.3125f, 0.1875f};
    for (uint32_t site = 0; site < 3; ++site) {
      std::vector<float> x = Gaussian(n, 100 + site, 1e-3f);
      x[site] = -0.0f;  // a stored -0.0 must not leave a -0.0 in the sum either
      const std::string bytes = Encode(p, x, shape);
      std::fill(decoded.begin(), decoded.end(), 0.0f);
      ASSERT_TRUE(Decode(bytes, decoded).ok());
      AddWeighted(reference, weights[site], decoded);
      ASSERT_TRUE(DecodeAddWeighted(bytes, weights[site], sum).ok());
    }
    ASSERT_EQ(0, std::memcmp(reference.data(), sum.data(), n * sizeof(float)));
    // Onto arbitrary (non-zero) values.
    std::vector<float> base = Gaussian(n, 7);
    std::vector<float> a = base, b = base;
    const std::string bytes = Encode(p, Gaussian(n, 8, 1e-2f), shape);
    std::fill(decoded.begin(), decoded.end(), 0.0f);
    ASSERT_TRUE(Decode(bytes, decoded).ok());
    AddWeighted(a, 0.75f, decoded);
    ASSERT_TRUE(DecodeAddWeighted(bytes, 0.75f, b).ok());
    ASSERT_EQ(0, std::memcmp(a.data(), b.data(), n * sizeof(float)));
    // A damaged or wrongly sized encoding is refused and adds nothing.
    std::vector<float> untouched = base;
    EXPECT_FALSE(DecodeAddWeighted(bytes + "x", 0.75f, untouched).ok());
    std::vector<float> shorter(n - 1, 2.0f);
    EXPECT_FALSE(DecodeAddWeighted(bytes, 0.75f, shorter).ok());
    EXPECT_EQ(0, std::memcmp(untouched.data(), base.data(), n * sizeof(float)));
    for (float f : shorter) EXPECT_EQ(f, 2.0f);
  }
}

// The commit's outer step into new buffers equals the worker's in-place one on copies, bit
// for bit, with and without momentum, and reports a non-finite result.
TEST(CodecOuter, StepToNewBuffersIsTheInPlaceStepBitForBit) {
  const size_t n = 1000;
  const std::vector<float> theta = Gaussian(n, 1), m = Gaussian(n, 2, 0.1f),
                           g = Gaussian(n, 3, 0.01f);
  for (float mu : {0.0f, 0.6f, 0.9f}) {
    SCOPED_TRACE(mu);
    std::vector<float> t_in_place = theta, m_in_place = m;
    ApplyOuterStep(t_in_place.data(), mu != 0.0f ? m_in_place.data() : nullptr, g.data(), n, 1.25f,
                   mu);
    std::vector<float> t_out(n), m_out(n, 5.0f);
    EXPECT_TRUE(ApplyOuterStepTo(theta.data(), mu != 0.0f ? m.data() : nullptr, g.data(),
                                 t_out.data(), mu != 0.0f ? m_out.data() : nullptr, n, 1.25f, mu));
    EXPECT_EQ(0, std::memcmp(t_in_place.data(), t_out.data(), n * sizeof(float)));
    if (mu != 0.0f) {
      EXPECT_EQ(0, std::memcmp(m_in_place.data(), m_out.data(), n * sizeof(float)));
    }
  }
  std::vector<float> huge = g, t_out(n), m_out(n);
  huge[n / 2] = 3e38f;
  EXPECT_FALSE(ApplyOuterStepTo(theta.data(), m.data(), huge.data(), t_out.data(), m_out.data(), n,
                                1.25f, 0.6f));
}

// FNV-1a of the bytes: pins the format so an accidental change (or a platform difference)
// shows up. Pipelines without zstd only: zstd's output may change across its versions.
uint64_t Fnv(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::vector<float> Deterministic(size_t n) {
  std::vector<float> v(n);
  uint32_t s = 12345;
  for (float& f : v) {
    s = s * 1664525u + 1013904223u;
    f = static_cast<float>(static_cast<int32_t>(s >> 8) - (1 << 23)) / 1048576.0f;
  }
  return v;
}

TEST(CodecDeterminism, SameInputSameBytes) {
  std::vector<float> x = Deterministic(4096);
  std::vector<int64_t> shape = {64, 64};
  for (const char* t : {"dense", "int8", "int4+zstd", "topk:0.05+int4+zstd",
                        "blocktopk:0.1:128+int2+zstd", "lowrank:4+int8+zstd"}) {
    EXPECT_EQ(Encode(P(t), x, shape), Encode(P(t), x, shape)) << t;
  }
  // Golden hashes of format version 2 (computed once by this implementation on x86-64).
  EXPECT_EQ(Fnv(Encode(P("int8"), x, shape)), 13645659509286084637ull) << "int8";
  EXPECT_EQ(Fnv(Encode(P("topk:0.05+int4"), x, shape)), 1240958532269505570ull) << "topk int4";
  EXPECT_EQ(Fnv(Encode(P("blocktopk:0.1:128+int2"), x, shape)), 14255745357322333322ull)
      << "blocktopk int2";
  EXPECT_EQ(Fnv(Encode(P("lowrank:4"), x, shape)), 6014824146119675286ull) << "lowrank";
  // And decoding is bitwise pinned too (the low-rank product is the float-order sensitive one).
  std::vector<float> y(x.size());
  ASSERT_TRUE(Decode(Encode(P("lowrank:4+int8"), x, shape), y).ok());
  std::string ybytes(reinterpret_cast<const char*>(y.data()), y.size() * sizeof(float));
  EXPECT_EQ(Fnv(ybytes), 16482832234838550833ull) << "lowrank decode";
}

TEST(CodecFeedback, SumOfDecodedTracksSumOfTrue) {
  const size_t n = 4096;
  std::vector<int64_t> shape = {64, 64};
  // Bound on (error with feedback) / (error without), per pipeline: the coarser the codec,
  // the more of the error sits in the not-yet-sent residual after 50 rounds.
  for (auto [t, max_ratio, max_err] :
       {std::tuple{std::string_view("topk:0.05+int4+zstd"), 0.5, 0.4},
        {std::string_view("topk:0.05+int2+zstd"), 0.5, 0.4},
        {std::string_view(kDefaultPipeline), 0.5, 0.4},
        {"topk:0.01+int2+zstd", 0.7, 0.6},
        {"lowrank:2+int8", 0.8, 0.7}}) {
    Pipeline p = P(t);
    std::vector<float> residual(n, 0.0f), decoded(n), sum_true(n, 0.0f), sum_fb(n, 0.0f),
        sum_nofb(n, 0.0f);
    std::vector<float> drift = Gaussian(n, 11, 0.2f);
    for (int round = 0; round < 50; ++round) {
      std::vector<float> delta = Gaussian(n, 100 + round);
      for (size_t i = 0; i < n; ++i) delta[i] += drift[i];
      EncodeWithFeedback(p, delta, shape, residual, decoded);
      std::vector<float> plain = RoundTrip(p, delta, shape);
      for (size_t i = 0; i < n; ++i) {
        sum_true[i] += delta[i];
        sum_fb[i] += decoded[i];
        sum_nofb[i] += plain[i];
      }
      // Invariant: sum of decoded + residual == sum of true (up to float rounding).
      if (round == 49) {
        std::vector<float> recon(n);
        for (size_t i = 0; i < n; ++i) recon[i] = sum_fb[i] + residual[i];
        EXPECT_LT(RelErr(sum_true, recon), 1e-4) << t;
      }
    }
    const double fb = RelErr(sum_true, sum_fb), nofb = RelErr(sum_true, sum_nofb);
    EXPECT_LT(fb, max_ratio * nofb) << t << " feedback " << fb << " without " << nofb;
    EXPECT_LT(fb, max_err) << t;
  }
}

// A round's tensors encoded on several threads give bitwise what one thread gives tensor by
// tensor: bytes, new residuals and decoded values, for every kind of pipeline, and the old
// residuals are left alone when the new ones go elsewhere.
TEST(CodecFeedback, ManyOnSeveralThreadsIsBitwiseOneAtATime) {
  const std::vector<std::pair<std::string, std::vector<int64_t>>> specs = {
      {"topk:0.05+int2+zstd", {300, 200}},
      {"dense", {77}},
      {"lowrank:4+int8+zstd", {64, 96}},
      {"blocktopk:0.1:128+int4+zstd", {5000}},
      {"defer", {1000}},
      {"int8+zstd", {40, 40}},
      {"topk:0.01+int4", {20000}},
      {"topk:0.05+int2+zstd", {1}}};
  std::vector<std::vector<float>> deltas, residuals;
  for (size_t i = 0; i < specs.size(); ++i) {
    size_t n = 1;
    for (int64_t d : specs[i].second) n *= static_cast<size_t>(d);
    deltas.push_back(Gaussian(n, 300 + static_cast<uint32_t>(i)));
    residuals.push_back(Gaussian(n, 400 + static_cast<uint32_t>(i), 0.1f));
  }
  // One at a time, in place.
  std::vector<std::string> want_bytes;
  std::vector<std::vector<float>> want_res = residuals, want_dec;
  for (size_t i = 0; i < specs.size(); ++i) {
    want_dec.emplace_back(deltas[i].size());
    want_bytes.push_back(EncodeWithFeedback(P(specs[i].first), deltas[i], specs[i].second,
                                            want_res[i], want_dec[i]));
  }
  for (int threads : {1, 2, 3, 8}) {
    std::vector<std::vector<float>> out(specs.size()), dec(specs.size());
    std::vector<FeedbackTask> tasks(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) {
      out[i].assign(deltas[i].size(), -1.0f);
      dec[i].assign(deltas[i].size(), -1.0f);
      tasks[i].pipeline = P(specs[i].first);
      tasks[i].delta = deltas[i];
      tasks[i].shape = specs[i].second;
      tasks[i].residual_in = residuals[i];
      tasks[i].residual_out = out[i];
      // Half the tasks want their decoded values back, the others none.
      if (i % 2 == 0) tasks[i].decoded = dec[i];
    }
    EncodeWithFeedbackMany(tasks, threads);
    for (size_t i = 0; i < specs.size(); ++i) {
      EXPECT_EQ(tasks[i].bytes, want_bytes[i]) << specs[i].first << " threads " << threads;
      EXPECT_EQ(0, std::memcmp(out[i].data(), want_res[i].data(), out[i].size() * 4))
          << specs[i].first << " threads " << threads;
      if (i % 2 == 0) {
        EXPECT_EQ(0, std::memcmp(dec[i].data(), want_dec[i].data(), dec[i].size() * 4))
            << specs[i].first << " threads " << threads;
      }
    }
  }
  // The inputs were only read.
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(residuals[i], Gaussian(residuals[i].size(), 400 + static_cast<uint32_t>(i), 0.1f));
  }
}

// Without a decoded tensor the residual comes from the encoding's stored values alone
// (ops/codec.h): bit for bit the residual of the call that decodes, on every pipeline kind,
// on a tensor large enough for top-k's sampled selection, and with values that need care:
// -0.0 (v - (+0.0) must stay -0.0), NaN and infinities (encoded as 0, kept in the
// residual), magnitudes beyond the clamp.
TEST(CodecFeedback, WithoutDecodedValuesTheResidualIsBitForBitTheSame) {
  const size_t n = size_t{1} << 17;
  std::vector<float> delta = Gaussian(n, 71), residual = Gaussian(n, 72, 0.1f);
  for (size_t i = 0; i < n; i += 1009) delta[i] = residual[i] = -0.0f;
  delta[3] = std::numeric_limits<float>::quiet_NaN();
  delta[5] = std::numeric_limits<float>::infinity();
  delta[7] = -std::numeric_limits<float>::infinity();
  delta[11] = 4e31f;
  residual[13] = -4e31f;
  for (const std::string pipe :
       {"topk:0.005+int4+zstd", "topk:0.3+int8", "blocktopk:0.05:256+int2+zstd", "int2:256+zstd",
        "dense", "lowrank:4+int8+zstd", "defer"}) {
    const std::vector<int64_t> shape = pipe.starts_with("lowrank")
                                           ? std::vector<int64_t>{256, 512}
                                           : std::vector<int64_t>{static_cast<int64_t>(n)};
    std::vector<float> want(n), decoded(n), got(n, 7.0f);
    const std::string want_bytes =
        EncodeWithFeedback(P(pipe), delta, shape, residual, want, decoded);
    const std::string got_bytes = EncodeWithFeedback(P(pipe), delta, shape, residual, got, {});
    EXPECT_EQ(got_bytes, want_bytes) << pipe;
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), n * sizeof(float))) << pipe;
    EXPECT_TRUE(std::isnan(got[3])) << pipe;
  }
}

TEST(CodecFeedback, DeferSendsAHeaderAndKeepsEverythingInTheResidual) {
  const size_t n = 3000;
  std::vector<int64_t> shape = {30, 100};
  std::vector<float> residual(n, 0.0f), decoded(n, 1.0f);
  std::vector<float> d1 = Gaussian(n, 5), d2 = Gaussian(n, 6);
  std::string q = EncodeWithFeedback(P("defer"), d1, shape, residual, decoded);
  EXPECT_TRUE(IsDeferred(q));
  EXPECT_LE(q.size(), EstimateBytes(P("defer"), n));
  EXPECT_LT(q.size(), 10u);
  EXPECT_EQ(decoded, std::vector<float>(n, 0.0f));
  EXPECT_EQ(residual, d1);
  EncodeWithFeedback(P("defer"), d2, shape, residual, decoded);
  // The round it is sent, the deferred rounds go with it.
  std::string sent =
      EncodeWithFeedback(P("dense"), std::vector<float>(n, 0.0f), shape, residual, decoded);
  EXPECT_FALSE(IsDeferred(sent));
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(decoded[i], d1[i] + d2[i]);
  EXPECT_EQ(residual, std::vector<float>(n, 0.0f));
  // A deferred encoding with a body or flags, or for another size, is refused.
  std::vector<float> out(n, 7.0f);
  EXPECT_FALSE(Decode(q + "x", out).ok());
  std::string flagged = q;
  flagged[4] = 1;
  EXPECT_FALSE(Decode(flagged, out).ok());
  std::vector<float> small(n - 1);
  EXPECT_FALSE(Decode(q, small).ok());
  EXPECT_EQ(out, std::vector<float>(n, 7.0f));
  EXPECT_FALSE(IsDeferred(""));
}

// The sparse pipeline that was the default before int2:256+zstd (docs/SYNC.md, "Defaults").
constexpr std::string_view kSparsePipeline = "topk:0.05+int2+zstd";

TEST(CodecFeedback, SparsePipelineIsFiftyTimesSmaller) {
  std::vector<float> x = Gaussian(768 * 16, 12);
  std::string bytes = Encode(P(kSparsePipeline), x, std::vector<int64_t>{768, 16});
  EXPECT_GE(x.size() * 4.0 / bytes.size(), 50.0) << bytes.size() << " bytes";
}

// The round deltas of a small LoRA model are 1024-4096-element tensors: the fixed overhead
// (compact header, zstd only where it pays) must leave the sparse pipeline >= 50x there too,
// and the default (2 bits a value and one fp32 scale per 256: at most 15.06x) >= 14x.
TEST(CodecFormat, SmallTensorsStayFiftyTimesSmaller) {
  for (size_t n : {1024u, 2048u, 4096u}) {
    std::vector<float> x = Gaussian(n, 20 + n);
    const std::vector<int64_t> shape{static_cast<int64_t>(n)};
    std::string sparse = Encode(P(kSparsePipeline), x, shape);
    EXPECT_GE(n * 4.0 / sparse.size(), 50.0) << n << ": " << sparse.size() << " bytes";
    std::string dflt = Encode(P(kDefaultPipeline), x, shape);
    EXPECT_GE(n * 4.0 / dflt.size(), 14.0) << n << ": " << dflt.size() << " bytes";
  }
}

TEST(CodecFormat, ZstdKeptOnlyWhereItShrinks) {
  // Random int8 codes of 64 elements: zstd cannot win, the body goes raw (flag bit 4 clear).
  std::vector<float> x = Gaussian(64, 21);
  std::string with = Encode(P("int8+zstd"), x, std::vector<int64_t>{64});
  EXPECT_EQ(with, Encode(P("int8"), x, std::vector<int64_t>{64}));
  EXPECT_EQ(static_cast<uint8_t>(with[4]) & 0x10, 0);
  // Zeros compress: the flag is set, and the result is smaller and decodes.
  std::vector<float> z(4096, 0.0f);
  std::string zb = Encode(P("int8+zstd"), z, std::vector<int64_t>{4096});
  EXPECT_EQ(static_cast<uint8_t>(zb[4]) & 0x10, 0x10);
  EXPECT_LT(zb.size(), Encode(P("int8"), z, std::vector<int64_t>{4096}).size());
  std::vector<float> y(4096, 5.0f);
  ASSERT_TRUE(Decode(zb, y).ok());
  EXPECT_EQ(y, z);
}

TEST(CodecFormat, HeaderIsCompact) {
  // 5 fixed bytes + numel (2) + nnz (1) + quantisation block (1) for topk on 1024 elements.
  std::vector<float> x = Gaussian(1024, 22);
  std::string b = Encode(P("topk:0.05+int2"), x, std::vector<int64_t>{1024});
  EXPECT_EQ(b[2], 2);
  const size_t nnz = 52, index_min = nnz, values = 4 * 1 + (nnz * 2 + 7) / 8;
  EXPECT_GE(b.size(), 9 + index_min + values);
  EXPECT_LE(b.size(), 9 + 2 * nnz + values);
}

TEST(CodecFormat, RefusesVersionOneAndBadVarints) {
  std::vector<float> x = Gaussian(300, 23);
  std::string b = Encode(P("topk:0.1+int4"), x, std::vector<int64_t>{300});
  std::vector<float> out(300, 2.0f);
  std::string v1 = b;
  v1[2] = 1;
  Status st = Decode(v1, out);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("version 1"), std::string::npos) << st.ToString();
  // numel varint that never terminates / overflows 64 bits / is overlong.
  std::string h = b.substr(0, 5);
  EXPECT_FALSE(Decode(h + std::string(12, '\xff'), out).ok());
  EXPECT_FALSE(Decode(h + std::string(9, '\xff') + '\x02', out).ok());
  EXPECT_FALSE(Decode(h + std::string("\xac\x82\x00", 3) + b.substr(7), out).ok());
  // nnz above numel.
  std::string big = h + b.substr(5, 2) + std::string("\xad\x02", 2) + b.substr(8);
  st = Decode(big, out);
  EXPECT_NE(st.message().find("nonzero count"), std::string::npos) << st.ToString();
  // Reserved flag bits.
  std::string fl = b;
  fl[4] = static_cast<char>(fl[4] | 0x80);
  EXPECT_FALSE(Decode(fl, out).ok());
  for (float f : out) EXPECT_EQ(f, 2.0f);
  ASSERT_TRUE(Decode(b, out).ok());
}

TEST(CodecAdaptive, LadderIsOrderedAndBudgetRespected) {
  const auto& ladder = AdaptiveLadder();
  ASSERT_GE(ladder.size(), 5u);
  EXPECT_EQ(ladder.front(), P("dense"));
  const uint64_t n = 1 << 20;
  for (size_t i = 1; i < ladder.size(); ++i)
    EXPECT_LT(EstimateBytes(ladder[i], n), EstimateBytes(ladder[i - 1], n)) << ToString(ladder[i]);
  const Pipeline coarsest = ladder.back(), finest = ladder.front();
  // Plenty of budget: the ceiling.
  EXPECT_EQ(ChooseAdaptive(n, 1ull << 40, coarsest, finest), finest);
  EXPECT_EQ(ChooseAdaptive(n, 1ull << 40, coarsest, P("int8+zstd")), P("int8+zstd"));
  // No budget: the floor.
  EXPECT_EQ(ChooseAdaptive(n, 1, coarsest, finest), coarsest);
  EXPECT_EQ(ChooseAdaptive(n, 1, P("topk:0.05+int4+zstd"), finest), P("topk:0.05+int4+zstd"));
  // In between: the finest that fits, and the next finer does not fit.
  for (uint64_t budget : {n / 2, n / 10, n / 40, n / 200}) {
    Pipeline c = ChooseAdaptive(n, budget, coarsest, finest);
    EXPECT_LE(EstimateBytes(c, n), budget);
    size_t i = 0;
    while (!(ladder[i] == c)) ++i;
    if (i > 0) {
      EXPECT_GT(EstimateBytes(ladder[i - 1], n), budget);
    }
  }
}

TEST(CodecAdaptive, EstimateIsCloseToActual) {
  std::vector<float> x = Gaussian(100000, 13);
  for (const Pipeline& p : AdaptiveLadder()) {
    const double est = static_cast<double>(EstimateBytes(p, x.size()));
    const double actual = static_cast<double>(Encode(p, x, std::vector<int64_t>{100000}).size());
    EXPECT_GE(est, actual * 0.95) << ToString(p);
    EXPECT_LE(est, actual * 1.6) << ToString(p);
  }
}

// The worker's encoder (ops/codec_worker.h): the bytes and residuals of EncodeWithFeedback
// round after round; a retried push of a round gets the first bytes without feeding the
// delta into the residual again; a round never Done leaves the residuals as they were; a
// checkpoint's residuals restore the state; a tensor without a pipeline is refused.
TEST(FeedbackEncoder, EncodesWithFeedbackOnceARoundWhateverTheRetries) {
  const std::vector<int64_t> shape = {64, 32};
  const std::string text = "topk:0.05+int4+zstd";
  auto pipe = ParsePipeline(text);
  ASSERT_TRUE(pipe.ok());
  const std::map<std::string, std::string> pipes = {{"w", text}};
  FeedbackEncoder enc(2);
  std::vector<float> residual(2048, 0.0f), decoded(2048);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 0.1f);
  for (uint64_t r = 1; r <= 4; ++r) {
    std::vector<float> d(2048);
    for (auto& x : d) x = nd(rng);
    const std::string want = EncodeWithFeedback(*pipe, d, shape, residual, decoded);
    const TensorView view{"w", shape, d.data()};
    for (int attempt = 0; attempt < 3; ++attempt) {
      auto got = enc.Encode(r, {view}, pipes);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_TRUE((*got)[0] == want) << "round " << r << " attempt " << attempt;
      if (attempt == 1) enc.Done(r);  // a push retried after it completed
    }
    EXPECT_EQ(enc.done_round(), r);
    EXPECT_EQ(enc.residuals().at("w"), residual);
  }
  // Round 5 encoded but never pushed everywhere: round 6 starts from round 4's residuals.
  std::vector<float> d5(2048, 0.5f), d6(2048, -0.25f);
  ASSERT_TRUE(enc.Encode(5, {{"w", shape, d5.data()}}, pipes).ok());
  const auto saved = enc.residuals();
  EXPECT_EQ(saved.at("w"), residual);
  const std::string want6 = EncodeWithFeedback(*pipe, d6, shape, residual, decoded);
  auto got6 = enc.Encode(6, {{"w", shape, d6.data()}}, pipes);
  ASSERT_TRUE(got6.ok());
  EXPECT_TRUE((*got6)[0] == want6);
  // A checkpoint's residuals: another encoder from them encodes round 6 the same.
  FeedbackEncoder restored(1);
  restored.SetResiduals(saved);
  auto again = restored.Encode(6, {{"w", shape, d6.data()}}, pipes);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE((*again)[0] == want6);
  EXPECT_EQ(restored.Encode(7, {{"b", {4}, d6.data()}}, pipes).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(restored.Encode(8, {{"w", shape, d6.data()}}, {{"w", "topk:2"}}).status().code(),
            Code::kInvalidArgument);
  // A call refused for its second tensor keeps nothing of the first: a retry encodes it.
  FeedbackEncoder fresh(1);
  std::vector<float> zero(2048, 0.0f);
  const std::string want_w = EncodeWithFeedback(*pipe, d6, shape, zero, decoded);
  EXPECT_EQ(
      fresh.Encode(1, {{"w", shape, d6.data()}, {"v", {4}, d6.data()}}, pipes).status().code(),
      Code::kInvalidArgument);
  auto retried = fresh.Encode(1, {{"w", shape, d6.data()}}, pipes);
  ASSERT_TRUE(retried.ok());
  EXPECT_TRUE((*retried)[0] == want_w);
}

// Memory taken at start-up (Reserve) changes no byte: an encoder that reserved its buffers
// encodes rounds exactly as one that did not, a checkpoint's residual is kept, and a
// residual reserved at another size than the delta's is refused at the encode.
TEST(FeedbackEncoder, ReservedBuffersEncodeTheSameBytes) {
  const std::vector<int64_t> shape = {64, 32};
  const std::map<std::string, std::string> pipes = {{"w", "topk:0.05+int4+zstd"},
                                                    {"v", "int2:256+zstd"}};
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 0.1f);
  FeedbackEncoder plain(2), reserved(2);
  reserved.Reserve({{"w", 2048}, {"v", 256}});
  EXPECT_EQ(reserved.residuals().at("w"), std::vector<float>(2048, 0.0f));
  for (uint64_t r = 1; r <= 3; ++r) {
    std::vector<float> w(2048), v(256);
    for (auto& x : w) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    const std::vector<TensorView> views = {{"w", shape, w.data()}, {"v", {256}, v.data()}};
    auto a = plain.Encode(r, views, pipes);
    auto b = reserved.Encode(r, views, pipes);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE((*a)[0] == (*b)[0] && (*a)[1] == (*b)[1]) << "round " << r;
    plain.Done(r);
    reserved.Done(r);
    EXPECT_EQ(plain.residuals(), reserved.residuals());
  }
  // A checkpoint's residual stays what it was.
  FeedbackEncoder resumed(1);
  resumed.SetResiduals(plain.residuals());
  resumed.Reserve({{"w", 2048}, {"v", 256}});
  EXPECT_EQ(resumed.residuals(), plain.residuals());
  // Reserved at another size: the encode says so.
  FeedbackEncoder wrong(1);
  wrong.Reserve({{"v", 100}});
  std::vector<float> v(256, 0.5f);
  EXPECT_EQ(wrong.Encode(1, {{"v", {256}, v.data()}}, pipes).status().code(),
            Code::kInvalidArgument);
}

// A worker that restarts in the middle of a round's push encodes that round again with the
// pipelines its first attempt used (KeepPipelinesIn), whatever it is given now: the bytes,
// and the residual after the round, are the first attempt's. The file is written before
// the bytes are returned and holds every pipeline given (the shard's dense tensors too);
namespace fs = std::filesystem;

// a later round replaces it; a file that is not one is refused.
TEST(FeedbackEncoder, KeepsARoundsPipelinesForARestartThatEncodesItAgain) {
  const fs::path dir = fs::temp_directory_path() / ("isthmus-kept-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string path = (dir / "rank-0.pipelines.json").string();
  const std::vector<int64_t> shape = {64, 32};
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 0.1f);
  std::vector<float> d1(2048), d2(2048), v(4, 0.25f);
  for (auto& x : d1) x = nd(rng);
  for (auto& x : d2) x = nd(rng);
  const std::map<std::string, std::string> first = {{"w", "topk:0.05+int4+zstd"}, {"v", "dense"}};
  const std::map<std::string, std::string> later = {{"w", "topk:0.2+int8+zstd"}, {"v", "dense"}};
  FeedbackEncoder enc(2);
  ASSERT_TRUE(enc.KeepPipelinesIn(path).ok());
  EXPECT_EQ(enc.kept_round(), 0u);
  ASSERT_TRUE(enc.Encode(1, {{"w", shape, d1.data()}}, first).ok());
  enc.Done(1);
  const auto after1 = enc.residuals();  // what the checkpoint of round 1 holds
  auto bytes2 = enc.Encode(2, {{"w", shape, d2.data()}}, first);
  ASSERT_TRUE(bytes2.ok());
  const std::string want2((*bytes2)[0]);
  enc.Done(2);
  const auto after2 = enc.residuals();
  std::map<std::string, std::string> p;
  EXPECT_TRUE(enc.Kept(2, {{"w", shape, d2.data()}, {"v", {4}, v.data()}}, &p));
  EXPECT_EQ(p, first);
  EXPECT_FALSE(enc.Kept(3, {{"w", shape, d2.data()}}, &p));
  // The restart: round 2 again from round 1's residual, offered other pipelines now.
  FeedbackEncoder again(1);
  again.SetResiduals(after1);
  ASSERT_TRUE(again.KeepPipelinesIn(path).ok());
  EXPECT_EQ(again.kept_round(), 2u);
  EXPECT_TRUE(again.Kept(2, {{"w", shape, d2.data()}}, &p));
  EXPECT_FALSE(again.Kept(2, {{"u", shape, d2.data()}}, &p));
  auto redo = again.Encode(2, {{"w", shape, d2.data()}}, later);
  ASSERT_TRUE(redo.ok()) << redo.status().ToString();
  EXPECT_TRUE((*redo)[0] == want2);
  again.Done(2);
  EXPECT_EQ(again.residuals().at("w"), after2.at("w"));
  // Round 3 replaces what is kept; another encoder offered nothing kept asks (Kept false).
  ASSERT_TRUE(again.Encode(3, {{"w", shape, d1.data()}}, later).ok());
  FeedbackEncoder third(1);
  ASSERT_TRUE(third.KeepPipelinesIn(path).ok());
  EXPECT_EQ(third.kept_round(), 3u);
  EXPECT_FALSE(third.Kept(2, {{"w", shape, d2.data()}}, &p));
  EXPECT_TRUE(third.Kept(3, {{"w", shape, d2.data()}}, &p));
  EXPECT_EQ(p, later);
  // Without a file nothing is kept.
  FeedbackEncoder none(1);
  ASSERT_TRUE(none.Encode(1, {{"w", shape, d1.data()}}, first).ok());
  EXPECT_FALSE(none.Kept(1, {{"w", shape, d1.data()}}, &p));
  for (const char* bad :
       {"{\"round\": 2}", "not json", "{\"round\": 1, \"pipelines\": {\"w\": \"topk:2\"}}"}) {
    std::ofstream(path) << bad;
    FeedbackEncoder broken(1);
    EXPECT_EQ(broken.KeepPipelinesIn(path).code(), Code::kCorruption) << bad;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace isthmus::codec
