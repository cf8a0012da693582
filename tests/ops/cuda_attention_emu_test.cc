// Runs the attention kernels of ops/cuda_attention.cuh in the CUDA emulator and checks them
// against a naive double-precision attention computed from the same inputs (rounded to bf16
// first when the kernel reads bf16): forward (out, lse) and backward (dq, dk, dv) on both
// paths, causality, and that dqkv is written rather than accumulated. Shapes are small
// because the emulator runs every CUDA thread as a fiber.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ops/cuda_attention.cuh"

namespace isthmus::ops::ISTHMUS_CUDA_NS {
namespace {

using attention_detail::AttentionPath;

// Errors are max |kernel - reference| / max |reference| over a tensor.
// fp32: the kernels compute in fp32 and the only differences from the double reference are
// fp32 rounding in dot products of at most 256 terms, sums over at most 130 keys and
// expf/logf, a few 1e-7 of the largest value.
constexpr double kTolF32 = 1e-5;
// bf16: the reference uses the same bf16-rounded inputs; the kernel also rounds its outputs
// to bf16 (relative error up to 2^-9 = 0.2% of the value), and the tensor-core path rounds
// P and dS to bf16 before each product (another 0.2% per term, partly averaging out over the
// sum). 1% of the largest value leaves about 2x margin over the worst error measured
// (0.3-0.5%) and still fails on any indexing or masking bug, which gives O(1) errors.
constexpr double kTolBf16 = 1e-2;
// lse is fp32 on both paths (computed in fp32 from bf16 inputs); only its inputs are bf16.
constexpr double kTolLse = 1e-5;

constexpr int kGuard = 64;           // elements of guard zone on each side of a buffer
constexpr float kSentinel = -77.0f;  // what guard zones hold (exact in bf16)
constexpr float kGarbage = 1.0e4f;   // what outputs hold before a kernel writes them

float ToF(float x) { return x; }
float ToF(bf16 x) { return __bfloat162float(x); }
template <typename T>
T FromF(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return __float2bfloat16(x);
  }
}

// `n` elements with guard zones on both sides, so that out-of-bounds writes show; `offset`
// elements of slack shift data() off its natural alignment.
template <typename T>
class Buffer {
 public:
  explicit Buffer(size_t n, float fill = kGarbage, int offset = 0)
      : n_(n), offset_(offset), v_(n + 2 * kGuard + offset, FromF<T>(kSentinel)) {
    Fill(fill);
  }
  T* data() { return v_.data() + kGuard + offset_; }
  const T* data() const { return v_.data() + kGuard + offset_; }
  size_t size() const { return n_; }
  void Fill(float x) { std::fill(data(), data() + n_, FromF<T>(x)); }
  void Set(const std::vector<float>& x) {
    for (size_t i = 0; i < n_; ++i) data()[i] = FromF<T>(x[i]);
  }
  std::vector<float> Get() const {
    std::vector<float> x(n_);
    for (size_t i = 0; i < n_; ++i) x[i] = ToF(data()[i]);
    return x;
  }
  bool GuardsIntact() const {
    const size_t lo = kGuard + offset_, hi = lo + n_;
    for (size_t i = 0; i < v_.size(); ++i) {
      if ((i < lo || i >= hi) && ToF(v_[i]) != kSentinel) return false;
    }
    return true;
  }

 private:
  size_t n_;
  int offset_;
  std::vector<T> v_;
};

struct Shape {
  int B, Tn, C, H;
  int hs() const { return C / H; }
  size_t QkvSize() const { return static_cast<size_t>(B) * Tn * 3 * C; }
  size_t OutSize() const { return static_cast<size_t>(B) * Tn * C; }
  size_t LseSize() const { return static_cast<size_t>(B) * H * Tn; }
  size_t Qkv(int b, int t, int which, int h, int c) const {
    return (static_cast<size_t>(b) * Tn + t) * 3 * C + static_cast<size_t>(which) * C +
           static_cast<size_t>(h) * hs() + c;
  }
  size_t Out(int b, int t, int h, int c) const {
    return (static_cast<size_t>(b) * Tn + t) * C + static_cast<size_t>(h) * hs() + c;
  }
  size_t Lse(int b, int h, int t) const { return (static_cast<size_t>(b) * H + h) * Tn + t; }
};

// Scaled causal scores of one (b, h, t) row and their log-sum-exp, in double.
double Scores(const Shape& s, const std::vector<float>& qkv, int b, int h, int t,
              std::vector<double>* row) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.hs()));
  row->assign(t + 1, 0.0);
  double mx = -INFINITY;
  for (int j = 0; j <= t; ++j) {
    double d = 0;
    for (int c = 0; c < s.hs(); ++c) {
      d += static_cast<double>(qkv[s.Qkv(b, t, 0, h, c)]) * qkv[s.Qkv(b, j, 1, h, c)];
    }
    (*row)[j] = d * scale;
    mx = std::max(mx, (*row)[j]);
  }
  double sum = 0;
  for (int j = 0; j <= t; ++j) sum += std::exp((*row)[j] - mx);
  return mx + std::log(sum);
}

void ReferenceForward(const Shape& s, const std::vector<float>& qkv, std::vector<double>* out,
                      std::vector<double>* lse) {
  out->assign(s.OutSize(), 0.0);
  lse->assign(s.LseSize(), 0.0);
  std::vector<double> row;
  for (int b = 0; b < s.B; ++b) {
    for (int h = 0; h < s.H; ++h) {
      for (int t = 0; t < s.Tn; ++t) {
        const double l = Scores(s, qkv, b, h, t, &row);
        (*lse)[s.Lse(b, h, t)] = l;
        for (int j = 0; j <= t; ++j) {
          const double p = std::exp(row[j] - l);
          for (int c = 0; c < s.hs(); ++c) {
            (*out)[s.Out(b, t, h, c)] += p * qkv[s.Qkv(b, j, 2, h, c)];
          }
        }
      }
    }
  }
}

// dqkv of the FlashAttention-2 backward, with D from `out` as the kernel receives it.
std::vector<double> ReferenceBackward(const Shape& s, const std::vector<float>& dout,
                                      const std::vector<float>& qkv,
                                      const std::vector<float>& out) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.hs()));
  std::vector<double> dqkv(s.QkvSize(), 0.0), row;
  for (int b = 0; b < s.B; ++b) {
    for (int h = 0; h < s.H; ++h) {
      for (int t = 0; t < s.Tn; ++t) {
        const double l = Scores(s, qkv, b, h, t, &row);
        double d = 0;
        for (int c = 0; c < s.hs(); ++c) {
          d += static_cast<double>(dout[s.Out(b, t, h, c)]) * out[s.Out(b, t, h, c)];
        }
        for (int j = 0; j <= t; ++j) {
          const double p = std::exp(row[j] - l);
          double dp = 0;
          for (int c = 0; c < s.hs(); ++c) {
            dp += static_cast<double>(dout[s.Out(b, t, h, c)]) * qkv[s.Qkv(b, j, 2, h, c)];
          }
          const double ds = p * (dp - d);
          for (int c = 0; c < s.hs(); ++c) {
            dqkv[s.Qkv(b, j, 2, h, c)] += p * dout[s.Out(b, t, h, c)];
            dqkv[s.Qkv(b, t, 0, h, c)] += scale * ds * qkv[s.Qkv(b, j, 1, h, c)];
            dqkv[s.Qkv(b, j, 1, h, c)] += scale * ds * qkv[s.Qkv(b, t, 0, h, c)];
          }
        }
      }
    }
  }
  return dqkv;
}

// max |got - want| / max |want| over the elements selected by `pick` (all by default);
// infinite when `got` has a non-finite element there.
template <typename Pick>
double RelError(const std::vector<float>& got, const std::vector<double>& want, Pick pick) {
  double err = 0, mag = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!pick(i)) continue;
    if (!std::isfinite(got[i])) return INFINITY;
    err = std::max(err, std::fabs(got[i] - want[i]));
    mag = std::max(mag, std::fabs(want[i]));
  }
  return mag > 0 ? err / mag : err;
}
double RelError(const std::vector<float>& got, const std::vector<double>& want) {
  return RelError(got, want, [](size_t) { return true; });
}

std::vector<float> Random(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> x(n);
  for (float& v : x) v = u(rng);
  return x;
}

// q and k in [-2, 2] give scores with a standard deviation of about 1.3: peaked rows and
// flat ones. Values are rounded to T so that the reference sees what the kernel reads.
template <typename T>
std::vector<float> RandomQkv(const Shape& s, uint32_t seed) {
  std::vector<float> x = Random(s.QkvSize(), -2.0f, 2.0f, seed);
  for (size_t i = 0; i < x.size(); ++i) {
    if ((i / s.C) % 3 == 2) x[i] *= 0.5f;  // v in [-1, 1]
    x[i] = ToF(FromF<T>(x[i]));
  }
  return x;
}

template <typename T>
std::vector<float> Rounded(std::vector<float> x) {
  for (float& v : x) v = ToF(FromF<T>(v));
  return x;
}

int64_t EmulatedBlocks() { return ::isthmus::emu::GetStats().blocks; }

struct Case {
  bool bf16;
  int hs;
  AttentionPath path;
  bool tensor_cores;  // the path the launcher must take
  std::vector<int> tns;
  int offset = 0;  // elements by which every tensor is shifted off 16-byte alignment
};

std::string Name(const Case& c) {
  return std::string(c.bf16 ? "bf16" : "fp32") + " hs" + std::to_string(c.hs) +
         (c.tensor_cores ? " tensor-core" : " generic") + (c.offset ? " misaligned" : "");
}

// Forward and backward of one shape against the reference.
template <typename T>
void CheckAgainstReference(const Case& k, int Tn) {
  const Shape s{2, Tn, 2 * k.hs, 2};
  const double tol = std::is_same_v<T, float> ? kTolF32 : kTolBf16;
  const int tile = k.tensor_cores ? 64 : 32;
  const int64_t tiles = static_cast<int64_t>(s.B) * s.H * ((Tn + tile - 1) / tile);

  Buffer<T> qkv(s.QkvSize(), 0.0f, k.offset), out(s.OutSize(), kGarbage, k.offset);
  Buffer<float> lse(s.LseSize());
  const std::vector<float> qkv_f = RandomQkv<T>(s, 1000 + Tn + k.hs);
  qkv.Set(qkv_f);
  ASSERT_EQ(k.path == AttentionPath::kBest &&
                attention_detail::UsesTensorCores<T>(s.C, s.H, qkv.data(), out.data()),
            k.tensor_cores);

  int64_t blocks = EmulatedBlocks();
  attention_detail::Forward(k.path, qkv.data(), out.data(), lse.data(), s.B, Tn, s.C, s.H, nullptr);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(EmulatedBlocks() - blocks, tiles) << "not the expected path";
  std::vector<double> out_ref, lse_ref;
  ReferenceForward(s, qkv_f, &out_ref, &lse_ref);
  const double out_err = RelError(out.Get(), out_ref);
  const double lse_err = RelError(lse.Get(), lse_ref);
  EXPECT_LE(out_err, tol);
  EXPECT_LE(lse_err, kTolLse);

  // The backward gets the reference's out and lse, so that it is checked on its own.
  Buffer<T> dout(s.OutSize(), 0.0f, k.offset), out_in(s.OutSize(), 0.0f, k.offset);
  Buffer<T> dqkv(s.QkvSize(), kGarbage, k.offset);
  Buffer<float> lse_in(s.LseSize()), scratch(s.LseSize());
  const std::vector<float> dout_f = Rounded<T>(Random(s.OutSize(), -1.0f, 1.0f, 7 + Tn));
  dout.Set(dout_f);
  out_in.Set(std::vector<float>(out_ref.begin(), out_ref.end()));
  lse_in.Set(std::vector<float>(lse_ref.begin(), lse_ref.end()));
  blocks = EmulatedBlocks();
  attention_detail::Backward(k.path, dout.data(), qkv.data(), out_in.data(), lse_in.data(),
                             dqkv.data(), scratch.data(), s.B, Tn, s.C, s.H, nullptr);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(EmulatedBlocks() - blocks, 2 * tiles + (s.LseSize() + 7) / 8);
  const std::vector<double> dqkv_ref = ReferenceBackward(s, dout_f, qkv_f, out_in.Get());
  const std::vector<float> dqkv_got = dqkv.Get();
  const char* const kGradNames[3] = {"dq", "dk", "dv"};
  double grad_err[3];
  for (int which = 0; which < 3; ++which) {
    grad_err[which] = RelError(dqkv_got, dqkv_ref, [&](size_t i) {
      return static_cast<int>((i % (3 * s.C)) / s.C) == which;
    });
    EXPECT_LE(grad_err[which], tol) << kGradNames[which];
  }
  for (const auto* g : {&qkv, &out, &dout, &out_in, &dqkv}) EXPECT_TRUE(g->GuardsIntact());
  for (const auto* g : {&lse, &lse_in, &scratch}) EXPECT_TRUE(g->GuardsIntact());
  std::printf("  %-28s Tn=%3d  out %.1e  lse %.1e  dq %.1e  dk %.1e  dv %.1e\n", Name(k).c_str(),
              Tn, out_err, lse_err, grad_err[0], grad_err[1], grad_err[2]);
}

void PrintTo(const Case& c, std::ostream* os) { *os << Name(c); }

class AttentionEmuTest : public testing::TestWithParam<Case> {};

TEST_P(AttentionEmuTest, MatchesDoubleReference) {
  const Case& k = GetParam();
  for (int Tn : k.tns) {
    SCOPED_TRACE("Tn=" + std::to_string(Tn));
    if (k.bf16) {
      CheckAgainstReference<bf16>(k, Tn);
    } else {
      CheckAgainstReference<float>(k, Tn);
    }
  }
}

const std::vector<int> kAllTn = {1, 17, 64, 100, 130};

// hs 1 and 256 are the limits of AttentionSupported (256 needs 205 KiB of shared memory in
// the dK/dV kernel). The misaligned case shifts every tensor 2 bytes off 16-byte alignment,
// which the tensor-core path's 16-byte tile loads cannot take: bf16 hs64 must fall back.

INSTANTIATE_TEST_SUITE_P(Paths, AttentionEmuTest,
                         testing::Values(Case{false, 64, AttentionPath::kBest, false, kAllTn},
                                         Case{false, 40, AttentionPath::kBest, false, kAllTn},
                                         Case{false, 1, AttentionPath::kBest, false, {1, 33}},
                                         Case{false, 256, AttentionPath::kBest, false, {1, 40}},
                                         Case{true, 64, AttentionPath::kBest, true, kAllTn},
                                         Case{true, 64, AttentionPath::kGeneric, false, kAllTn},
                                         Case{true, 64, AttentionPath::kBest, false, {100}, 1},
                                         Case{true, 24, AttentionPath::kBest, false, kAllTn},
                                         Case{true, 32, AttentionPath::kBest, true, {17, 130}},
                                         Case{true, 128, AttentionPath::kBest, true, {17, 130}}),
                         [](const testing::TestParamInfo<Case>& info) {
                           std::string n = Name(info.param);
                           for (char& c : n) {
                             if (c == ' ' || c == '-') c = '_';
                           }
                           return n;
                         });

// Changing the key and value of token `later` must leave out, lse and dq of every earlier
// token bit for bit as they were (masked probabilities are exact zeros), and change later
// outputs.
template <typename T>
void CheckCausality(AttentionPath path) {
  const Shape s{2, 100, 128, 2};
  const int later = 70;
  std::vector<float> qkv_f = RandomQkv<T>(s, 5);
  const std::vector<float> dout_f = Rounded<T>(Random(s.OutSize(), -1.0f, 1.0f, 6));
  std::vector<float> outs[2], lses[2], dqkvs[2];
  for (int run = 0; run < 2; ++run) {
    if (run == 1) {
      const std::vector<float> fresh = RandomQkv<T>(s, 99);
      for (int b = 0; b < s.B; ++b) {
        for (int c = s.C; c < 3 * s.C; ++c) {
          const size_t i = (static_cast<size_t>(b) * s.Tn + later) * 3 * s.C + c;
          qkv_f[i] = fresh[i];
        }
      }
    }
    Buffer<T> qkv(s.QkvSize()), out(s.OutSize()), dout(s.OutSize()), dqkv(s.QkvSize());
    Buffer<float> lse(s.LseSize()), scratch(s.LseSize());
    qkv.Set(qkv_f);
    dout.Set(dout_f);
    attention_detail::Forward(path, qkv.data(), out.data(), lse.data(), s.B, s.Tn, s.C, s.H,
                              nullptr);
    attention_detail::Backward(path, dout.data(), qkv.data(), out.data(), lse.data(), dqkv.data(),
                               scratch.data(), s.B, s.Tn, s.C, s.H, nullptr);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    outs[run] = out.Get();
    lses[run] = lse.Get();
    dqkvs[run] = dqkv.Get();
  }
  int later_changed = 0;
  for (int b = 0; b < s.B; ++b) {
    for (int h = 0; h < s.H; ++h) {
      for (int t = 0; t < s.Tn; ++t) {
        bool same = lses[0][s.Lse(b, h, t)] == lses[1][s.Lse(b, h, t)];
        for (int c = 0; c < s.hs(); ++c) {
          same = same && outs[0][s.Out(b, t, h, c)] == outs[1][s.Out(b, t, h, c)];
          if (t < later) {
            same = same && dqkvs[0][s.Qkv(b, t, 0, h, c)] == dqkvs[1][s.Qkv(b, t, 0, h, c)];
          }
        }
        if (t < later) {
          EXPECT_TRUE(same) << "b=" << b << " h=" << h << " t=" << t;
        } else {
          later_changed += !same;
        }
      }
    }
  }
  EXPECT_EQ(later_changed, s.B * s.H * (s.Tn - later));
}

TEST(AttentionEmuCausalityTest, Fp32Generic) { CheckCausality<float>(AttentionPath::kBest); }
TEST(AttentionEmuCausalityTest, Bf16TensorCores) { CheckCausality<bf16>(AttentionPath::kBest); }
TEST(AttentionEmuCausalityTest, Bf16Generic) { CheckCausality<bf16>(AttentionPath::kGeneric); }

// dqkv is written: the result does not depend on what the buffer held before, and running
// twice gives the same bits (no accumulation, no run-to-run differences).
template <typename T>
void CheckWrittenNotAccumulated(AttentionPath path) {
  const Shape s{2, 100, 128, 2};
  Buffer<T> qkv(s.QkvSize()), out(s.OutSize()), dout(s.OutSize()), dqkv(s.QkvSize());
  Buffer<float> lse(s.LseSize()), scratch(s.LseSize());
  qkv.Set(RandomQkv<T>(s, 11));
  dout.Set(Rounded<T>(Random(s.OutSize(), -1.0f, 1.0f, 12)));
  attention_detail::Forward(path, qkv.data(), out.data(), lse.data(), s.B, s.Tn, s.C, s.H, nullptr);
  std::vector<float> results[3];
  const float fills[3] = {0.0f, 3.0f, 3.0f};  // the third run reuses the second's output
  for (int run = 0; run < 3; ++run) {
    if (run < 2) dqkv.Fill(fills[run]);
    attention_detail::Backward(path, dout.data(), qkv.data(), out.data(), lse.data(), dqkv.data(),
                               scratch.data(), s.B, s.Tn, s.C, s.H, nullptr);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    results[run] = dqkv.Get();
  }
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[1], results[2]);
}

TEST(AttentionEmuWriteTest, Fp32Generic) {
  CheckWrittenNotAccumulated<float>(AttentionPath::kBest);
}
TEST(AttentionEmuWriteTest, Bf16TensorCores) {
  CheckWrittenNotAccumulated<bf16>(AttentionPath::kBest);
}

TEST(AttentionEmuTest, SupportedShapes) {
  EXPECT_TRUE(AttentionSupported(768, 12));
  EXPECT_TRUE(AttentionSupported(256, 4));
  EXPECT_TRUE(AttentionSupported(3, 3));     // hs 1
  EXPECT_TRUE(AttentionSupported(512, 2));   // hs 256
  EXPECT_FALSE(AttentionSupported(514, 1));  // hs 514
  EXPECT_FALSE(AttentionSupported(770, 12));
  EXPECT_FALSE(AttentionSupported(768, 0));
  EXPECT_TRUE(attention_detail::UsesTensorCores<bf16>(768, 12, nullptr, nullptr));
  EXPECT_FALSE(attention_detail::UsesTensorCores<float>(768, 12, nullptr, nullptr));
  EXPECT_FALSE(attention_detail::UsesTensorCores<bf16>(240, 4, nullptr, nullptr));  // hs 60
}

TEST(AttentionEmuTest, EmptyShapesLaunchNothing) {
  const int64_t blocks = EmulatedBlocks();
  LaunchAttentionForward<float>(nullptr, nullptr, nullptr, 0, 16, 64, 1, nullptr);
  LaunchAttentionBackward<bf16>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 2, 0, 64, 1,
                                nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(EmulatedBlocks(), blocks);
}

}  // namespace
}  // namespace isthmus::ops::ISTHMUS_CUDA_NS
