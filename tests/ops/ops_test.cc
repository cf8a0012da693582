// Checks the CPU reference backend (ops/ops.h): every backward against central finite
// differences of a scalar loss sum(out * w) with random w, the forwards against naive
// double-precision references and hand-computed values, the write-versus-accumulate
// contract of every gradient, and the bf16 emulation against fp32. The CUDA backend is
// checked against this one (tests/ops/backend_conformance.h), so these tests are what
// anchors both.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "ops/ops.h"

namespace isthmus::ops {
namespace {

using Vec = std::vector<float>;

Vec Random(size_t n, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  Vec v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

double WeightedSum(const Vec& out, const Vec& w) {
  double s = 0.0;
  for (size_t i = 0; i < out.size(); ++i) s += static_cast<double>(out[i]) * w[i];
  return s;
}

Vec Minus(const Vec& a, const Vec& b) {
  Vec d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

// Finite-difference settings. The kernels run in fp32, so the step cannot be tiny: with
// step 1e-2 the fp32 rounding of the loss contributes ~1e-5 and the O(step^2) truncation
// of smooth ops ~1e-5 to each numeric derivative.
struct FdTolerance {
  float step = 1e-2f;
  double atol = 5e-4;
  double rtol = 5e-3;
};

// Compares `analytic` (the gradient the backward ACCUMULATED, i.e. after minus before)
// with central differences of `loss` with respect to every entry of *param.
void ExpectGradientMatches(const std::string& what, Vec* param, const Vec& analytic,
                           const std::function<double()>& loss, FdTolerance tol = {}) {
  ASSERT_EQ(param->size(), analytic.size()) << what;
  double max_abs_err = 0.0, max_grad = 0.0;
  int failures = 0;
  for (size_t i = 0; i < param->size(); ++i) {
    const float saved = (*param)[i];
    const float up = saved + tol.step;
    const float down = saved - tol.step;
    (*param)[i] = up;
    const double loss_up = loss();
    (*param)[i] = down;
    const double loss_down = loss();
    (*param)[i] = saved;
    const double numeric = (loss_up - loss_down) / (static_cast<double>(up) - down);
    const double err = std::abs(numeric - analytic[i]);
    max_abs_err = std::max(max_abs_err, err);
    max_grad = std::max(max_grad, std::abs(numeric));
    if (err > tol.atol + tol.rtol * std::abs(numeric) && ++failures <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: analytic " << analytic[i] << " numeric " << numeric;
    }
  }
  std::printf("  FD %-26s n=%-4zu max|grad|=%-9.3g max abs err=%.3g\n", what.c_str(), param->size(),
              max_grad, max_abs_err);
  EXPECT_EQ(failures, 0) << what;
  EXPECT_GT(max_grad, 0.0) << what << ": gradient is identically zero, the check is vacuous";
}

Ops& ops() { return CpuOps(); }

TEST(CpuOpsTest, NameIsCpu) { EXPECT_STREQ(ops().Name(), "cpu"); }

// ---------------------------------------------------------------------------------------
// Matmul

TEST(MatmulTest, AllTransposeCombinationsMatchNaive) {
  std::mt19937 rng(1);
  const int m = 5, n = 7, k = 3;
  const float alpha = 0.5f, beta = 2.0f;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const Vec a = Random(m * k, rng), b = Random(k * n, rng);
      const Vec c0 = Random(m * n, rng);
      Vec c = c0;
      ops().Matmul(a.data(), b.data(), c.data(), m, n, k, ta, tb, alpha, beta);
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          double s = 0.0;
          for (int p = 0; p < k; ++p) {
            const float av = ta ? a[p * m + i] : a[i * k + p];  // stored [k,m] when ta
            const float bv = tb ? b[j * k + p] : b[p * n + j];  // stored [n,k] when tb
            s += static_cast<double>(av) * bv;
          }
          EXPECT_NEAR(c[i * n + j], alpha * s + beta * c0[i * n + j], 1e-5)
              << "ta=" << ta << " tb=" << tb << " (" << i << "," << j << ")";
        }
      }
    }
  }
}

TEST(MatmulTest, LargeMatchesNaive) {
  std::mt19937 rng(2);
  const int m = 67, n = 129, k = 95;  // odd sizes exercise the sgemm edge kernels
  const Vec a = Random(m * k, rng), b = Random(k * n, rng);
  Vec c(m * n, 0.0f);
  ops().Matmul(a.data(), b.data(), c.data(), m, n, k, false, false, 1.0f, 0.0f);
  double max_err = 0.0;
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double s = 0.0;
      for (int p = 0; p < k; ++p) s += static_cast<double>(a[i * k + p]) * b[p * n + j];
      max_err = std::max(max_err, std::abs(s - c[i * n + j]));
    }
  }
  EXPECT_LT(max_err, 1e-4);
}

// ---------------------------------------------------------------------------------------
// Embedding

TEST(EmbeddingTest, GroupByTokenIsAStableCountingSort) {
  const std::vector<int32_t> tokens = {3, 1, 3, 0, 1, 3};
  std::vector<int32_t> order(tokens.size()), starts(5);
  GroupByToken(tokens.data(), static_cast<int>(tokens.size()), 4, order.data(), starts.data());
  EXPECT_EQ(starts, (std::vector<int32_t>{0, 1, 3, 3, 6}));
  EXPECT_EQ(order, (std::vector<int32_t>{3, 1, 4, 0, 2, 5}));
}

TEST(EmbeddingTest, ForwardAndGradients) {
  std::mt19937 rng(3);
  const int B = 2, T = 3, C = 4, V = 5;
  const std::vector<int32_t> tokens = {1, 4, 1, 0, 1, 3};  // token 1 repeats
  Vec wte = Random(V * C, rng), wpe = Random(T * C, rng);
  const Vec w = Random(B * T * C, rng);
  Vec out(B * T * C);
  ops().EmbeddingForward(tokens.data(), wte.data(), wpe.data(), out.data(), B, T, C);
  for (int i = 0; i < B * T; ++i) {
    for (int c = 0; c < C; ++c) {
      EXPECT_FLOAT_EQ(out[i * C + c], wte[tokens[i] * C + c] + wpe[(i % T) * C + c]);
    }
  }
  auto loss = [&] {
    ops().EmbeddingForward(tokens.data(), wte.data(), wpe.data(), out.data(), B, T, C);
    return WeightedSum(out, w);
  };
  std::vector<int32_t> order(B * T), starts(V + 1);
  GroupByToken(tokens.data(), B * T, V, order.data(), starts.data());
  const Vec dwte0 = Random(V * C, rng), dwpe0 = Random(T * C, rng);
  Vec dwte = dwte0, dwpe = dwpe0;
  ops().EmbeddingBackward(w.data(), order.data(), starts.data(), dwte.data(), dwpe.data(), B, T, C,
                          V);
  ExpectGradientMatches("embedding dwte", &wte, Minus(dwte, dwte0), loss);
  ExpectGradientMatches("embedding dwpe", &wpe, Minus(dwpe, dwpe0), loss);
  // Token 2 never occurs, so its row must be untouched.
  for (int c = 0; c < C; ++c) EXPECT_EQ(dwte[2 * C + c], dwte0[2 * C + c]);
}

// ---------------------------------------------------------------------------------------
// LayerNorm

TEST(LayerNormTest, ForwardMatchesReference) {
  std::mt19937 rng(4);
  const int N = 3, C = 16;
  Vec x = Random(N * C, rng, 2.0f);
  for (float& v : x) v += 1000.0f;  // a large offset: the two-pass variance must cope
  const Vec weight = Random(C, rng), bias = Random(C, rng);
  Vec out(N * C), mean(N), rstd(N);
  ops().LayerNormForward(x.data(), weight.data(), bias.data(), out.data(), mean.data(), rstd.data(),
                         N, C);
  for (int i = 0; i < N; ++i) {
    double mu = 0.0, var = 0.0;
    for (int c = 0; c < C; ++c) mu += x[i * C + c];
    mu /= C;
    for (int c = 0; c < C; ++c) var += (x[i * C + c] - mu) * (x[i * C + c] - mu);
    var /= C;
    const double rs = 1.0 / std::sqrt(var + 1e-5);
    EXPECT_NEAR(mean[i], mu, 1e-3);
    EXPECT_NEAR(rstd[i], rs, 1e-4 * rs);
    for (int c = 0; c < C; ++c) {
      const double ref = (x[i * C + c] - mu) * rs * weight[c] + bias[c];
      EXPECT_NEAR(out[i * C + c], ref, 2e-3) << i << "," << c;
    }
  }
}

TEST(LayerNormTest, Gradients) {
  std::mt19937 rng(5);
  const int N = 4, C = 8;
  Vec x = Random(N * C, rng), weight = Random(C, rng), bias = Random(C, rng);
  const Vec w = Random(N * C, rng);
  Vec out(N * C), mean(N), rstd(N);
  auto loss = [&] {
    ops().LayerNormForward(x.data(), weight.data(), bias.data(), out.data(), mean.data(),
                           rstd.data(), N, C);
    return WeightedSum(out, w);
  };
  loss();
  // All three accumulate (dx is the residual stream's gradient).
  const Vec dx0 = Random(N * C, rng), dw0 = Random(C, rng), db0 = Random(C, rng);
  Vec dx = dx0, dweight = dw0, dbias = db0;
  ops().LayerNormBackward(w.data(), x.data(), weight.data(), mean.data(), rstd.data(), dx.data(),
                          dweight.data(), dbias.data(), N, C);
  ExpectGradientMatches("layernorm dx", &x, Minus(dx, dx0), loss);
  ExpectGradientMatches("layernorm dweight", &weight, Minus(dweight, dw0), loss);
  ExpectGradientMatches("layernorm dbias", &bias, Minus(dbias, db0), loss);
}

// ---------------------------------------------------------------------------------------
// Linear and LoRA

TEST(LinearTest, ForwardMatchesReferenceWithBiasAndResidual) {
  std::mt19937 rng(6);
  const int N = 3, in = 4, out_dim = 5;
  const Vec x = Random(N * in, rng), w = Random(in * out_dim, rng), b = Random(out_dim, rng);
  const Vec res = Random(N * out_dim, rng);
  Vec out(N * out_dim, 123.0f), out_nobias(N * out_dim, 123.0f);  // must be overwritten
  Vec out_res = res;                                              // residual aliases out
  ops().LinearForward(x.data(), w.data(), b.data(), nullptr, out.data(), N, in, out_dim);
  ops().LinearForward(x.data(), w.data(), nullptr, nullptr, out_nobias.data(), N, in, out_dim);
  ops().LinearForward(x.data(), w.data(), b.data(), out_res.data(), out_res.data(), N, in, out_dim);
  for (int i = 0; i < N; ++i) {
    for (int j = 0; j < out_dim; ++j) {
      double s = 0.0;
      for (int p = 0; p < in; ++p) s += static_cast<double>(x[i * in + p]) * w[p * out_dim + j];
      EXPECT_NEAR(out_nobias[i * out_dim + j], s, 1e-5);
      EXPECT_NEAR(out[i * out_dim + j], s + b[j], 1e-5);
      EXPECT_NEAR(out_res[i * out_dim + j], s + b[j] + res[i * out_dim + j], 1e-5);
    }
  }
}

TEST(LinearTest, Gradients) {
  std::mt19937 rng(7);
  const int N = 3, in = 4, out_dim = 5;
  Vec x = Random(N * in, rng), w = Random(in * out_dim, rng), b = Random(out_dim, rng);
  const Vec lw = Random(N * out_dim, rng);
  Vec out(N * out_dim);
  auto loss = [&] {
    ops().LinearForward(x.data(), w.data(), b.data(), nullptr, out.data(), N, in, out_dim);
    return WeightedSum(out, lw);
  };
  // dx is written; dw and dbias accumulate.
  const Vec dw0 = Random(in * out_dim, rng), db0 = Random(out_dim, rng);
  Vec dx(N * in, 77.0f), dw = dw0, db = db0;
  ops().LinearBackward(lw.data(), x.data(), w.data(), dx.data(), dw.data(), db.data(), N, in,
                       out_dim);
  ExpectGradientMatches("linear dx", &x, dx, loss);
  ExpectGradientMatches("linear dw", &w, Minus(dw, dw0), loss);
  ExpectGradientMatches("linear dbias", &b, Minus(db, db0), loss);
}

struct LoraProblem {
  static constexpr int kN = 4, kIn = 6, kOut = 5, kRank = 3;
  static constexpr float kScale = 2.0f;  // alpha / rank
  Vec x, w, b, a, bb, lw, out, xa;
  explicit LoraProblem(std::mt19937& rng)
      : x(Random(kN * kIn, rng)),
        w(Random(kIn * kOut, rng)),
        b(Random(kOut, rng)),
        a(Random(kRank * kIn, rng)),
        bb(Random(kOut * kRank, rng)),
        lw(Random(kN * kOut, rng)),
        out(kN * kOut),
        xa(kN * kRank) {}
  double Loss() {
    ops().LoraLinearForward(x.data(), w.data(), b.data(), a.data(), bb.data(), kScale, nullptr,
                            out.data(), xa.data(), kN, kIn, kOut, kRank);
    return WeightedSum(out, lw);
  }
};

TEST(LoraTest, ForwardMatchesReference) {
  std::mt19937 rng(8);
  LoraProblem p(rng);
  p.Loss();
  const int N = p.kN, in = p.kIn, out_dim = p.kOut, r = p.kRank;
  for (int i = 0; i < N; ++i) {
    std::vector<double> xa(r, 0.0);
    for (int q = 0; q < r; ++q) {
      for (int k = 0; k < in; ++k) xa[q] += static_cast<double>(p.x[i * in + k]) * p.a[q * in + k];
      EXPECT_NEAR(p.xa[i * r + q], xa[q], 1e-5);
    }
    for (int j = 0; j < out_dim; ++j) {
      double s = p.b[j];
      for (int k = 0; k < in; ++k) s += static_cast<double>(p.x[i * in + k]) * p.w[k * out_dim + j];
      for (int q = 0; q < r; ++q) s += p.kScale * xa[q] * p.bb[j * r + q];
      EXPECT_NEAR(p.out[i * out_dim + j], s, 1e-4);
    }
  }
}

TEST(LoraTest, Gradients) {
  std::mt19937 rng(9);
  LoraProblem p(rng);
  p.Loss();
  const int N = p.kN, in = p.kIn, out_dim = p.kOut, r = p.kRank;
  const Vec dw0 = Random(in * out_dim, rng), db0 = Random(out_dim, rng);
  const Vec da0 = Random(r * in, rng), dbb0 = Random(out_dim * r, rng);
  Vec dx(N * in, 55.0f), dw = dw0, db = db0, da = da0, dbb = dbb0, dxa(N * r, 99.0f);
  ops().LoraLinearBackward(p.lw.data(), p.x.data(), p.w.data(), p.a.data(), p.bb.data(), p.kScale,
                           p.xa.data(), dx.data(), dw.data(), db.data(), da.data(), dbb.data(),
                           dxa.data(), N, in, out_dim, r);
  auto loss = [&] { return p.Loss(); };
  ExpectGradientMatches("lora dx", &p.x, dx, loss);
  ExpectGradientMatches("lora dw", &p.w, Minus(dw, dw0), loss);
  ExpectGradientMatches("lora dbias", &p.b, Minus(db, db0), loss);
  ExpectGradientMatches("lora dA", &p.a, Minus(da, da0), loss);
  ExpectGradientMatches("lora dB", &p.bb, Minus(dbb, dbb0), loss);

  // Frozen base (dw, dbias null): dx, dA, dB must be the same as with them.
  p.Loss();
  Vec dx2(N * in, -3.0f), da2 = da0, dbb2 = dbb0;
  ops().LoraLinearBackward(p.lw.data(), p.x.data(), p.w.data(), p.a.data(), p.bb.data(), p.kScale,
                           p.xa.data(), dx2.data(), nullptr, nullptr, da2.data(), dbb2.data(),
                           dxa.data(), N, in, out_dim, r);
  for (size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx2[i], dx[i], 1e-6);
  for (size_t i = 0; i < da.size(); ++i) EXPECT_NEAR(da2[i], da[i], 1e-6);
  for (size_t i = 0; i < dbb.size(); ++i) EXPECT_NEAR(dbb2[i], dbb[i], 1e-6);
}

// ---------------------------------------------------------------------------------------
// GELU

TEST(GeluTest, ForwardKnownValues) {
  const Vec x = {0.0f, 1.0f, -1.0f, 10.0f, -10.0f};
  Vec out(x.size());
  ops().GeluForward(x.data(), out.data(), static_cast<int64_t>(x.size()));
  EXPECT_FLOAT_EQ(out[0], 0.0f);
  EXPECT_NEAR(out[1], 0.841192f, 1e-5);  // tanh approximation of GELU(1)
  EXPECT_NEAR(out[2], -0.158808f, 1e-5);
  EXPECT_NEAR(out[3], 10.0f, 1e-5);
  EXPECT_NEAR(out[4], 0.0f, 1e-5);
  // Against the formula in double over the range activations live in.
  Vec xs, ys;
  for (float v = -8.0f; v <= 8.0f; v += 0.01f) xs.push_back(v);
  ys.resize(xs.size());
  ops().GeluForward(xs.data(), ys.data(), static_cast<int64_t>(xs.size()));
  for (size_t i = 0; i < xs.size(); ++i) {
    const double v = xs[i];
    const double ref =
        0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
    EXPECT_NEAR(ys[i], ref, 2e-6) << "x=" << v;
  }
}

TEST(GeluTest, GradientIsWrittenAndMayBeInPlace) {
  std::mt19937 rng(10);
  const int n = 40;
  Vec x = Random(n, rng, 2.0f);
  const Vec w = Random(n, rng);
  Vec out(n);
  auto loss = [&] {
    ops().GeluForward(x.data(), out.data(), n);
    return WeightedSum(out, w);
  };
  Vec dx(n, 42.0f);
  ops().GeluBackward(w.data(), x.data(), dx.data(), n);
  ExpectGradientMatches("gelu dx", &x, dx, loss);
  Vec in_place = w;
  ops().GeluBackward(in_place.data(), x.data(), in_place.data(), n);
  EXPECT_EQ(in_place, dx);
}

// ---------------------------------------------------------------------------------------
// Attention

// Naive double-precision causal attention: out[b,t,h*hs+d] and lse[b,h,t].
std::vector<double> NaiveAttention(const Vec& qkv, int B, int T, int C, int H,
                                   std::vector<double>* lse = nullptr) {
  const int hs = C / H;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  std::vector<double> out(static_cast<size_t>(B) * T * C, 0.0);
  if (lse != nullptr) lse->assign(static_cast<size_t>(B) * H * T, 0.0);
  auto at = [&](int b, int t, int part, int h, int d) {
    return static_cast<double>(
        qkv[(static_cast<size_t>(b) * T + t) * 3 * C + part * C + h * hs + d]);
  };
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      for (int t = 0; t < T; ++t) {
        std::vector<double> p(t + 1);
        double mx = -1e300, sum = 0.0;
        for (int s = 0; s <= t; ++s) {
          double dot = 0.0;
          for (int d = 0; d < hs; ++d) dot += at(b, t, 0, h, d) * at(b, s, 1, h, d);
          p[s] = dot * scale;
          mx = std::max(mx, p[s]);
        }
        for (int s = 0; s <= t; ++s) sum += (p[s] = std::exp(p[s] - mx));
        if (lse != nullptr) (*lse)[(static_cast<size_t>(b) * H + h) * T + t] = mx + std::log(sum);
        for (int d = 0; d < hs; ++d) {
          double o = 0.0;
          for (int s = 0; s <= t; ++s) o += p[s] / sum * at(b, s, 2, h, d);
          out[(static_cast<size_t>(b) * T + t) * C + h * hs + d] = o;
        }
      }
    }
  }
  return out;
}

TEST(AttentionTest, ForwardMatchesNaiveIncludingLogSumExp) {
  std::mt19937 rng(11);
  for (auto [B, T, C, H] : {std::array{2, 5, 8, 2}, std::array{2, 64, 64, 4}}) {
    const Vec qkv = Random(static_cast<size_t>(B) * T * 3 * C, rng);
    Vec out(static_cast<size_t>(B) * T * C), lse(static_cast<size_t>(B) * H * T, 7.0f);
    ops().AttentionForward(qkv.data(), out.data(), lse.data(), B, T, C, H);
    std::vector<double> ref_lse;
    const std::vector<double> ref = NaiveAttention(qkv, B, T, C, H, &ref_lse);
    double max_err = 0.0, max_lse_err = 0.0;
    for (size_t i = 0; i < out.size(); ++i) max_err = std::max(max_err, std::abs(out[i] - ref[i]));
    for (size_t i = 0; i < lse.size(); ++i) {
      max_lse_err = std::max(max_lse_err, std::abs(lse[i] - ref_lse[i]));
    }
    EXPECT_LT(max_err, 1e-5) << "T=" << T;
    EXPECT_LT(max_lse_err, 1e-5) << "T=" << T;
  }
}

TEST(AttentionTest, FutureTokenDoesNotChangeEarlierOutputs) {
  std::mt19937 rng(12);
  const int B = 2, T = 6, C = 8, H = 2, t0 = 3;
  Vec qkv = Random(B * T * 3 * C, rng);
  Vec out1(B * T * C), out2(B * T * C), lse(B * H * T);
  ops().AttentionForward(qkv.data(), out1.data(), lse.data(), B, T, C, H);
  for (int j = 0; j < 3 * C; ++j) qkv[(1 * T + t0) * 3 * C + j] += 3.0f;  // batch 1, time t0
  ops().AttentionForward(qkv.data(), out2.data(), lse.data(), B, T, C, H);
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      double diff = 0.0;
      for (int c = 0; c < C; ++c)
        diff += std::abs(out1[(b * T + t) * C + c] - out2[(b * T + t) * C + c]);
      if (b == 1 && t >= t0) {
        EXPECT_GT(diff, 1e-3) << "t=" << t << " should see the change";
      } else {
        EXPECT_EQ(diff, 0.0) << "b=" << b << " t=" << t << " saw a future or other-batch token";
      }
    }
  }
}

TEST(AttentionTest, GradientIsWritten) {
  std::mt19937 rng(13);
  const int B = 2, T = 5, C = 8, H = 2;
  Vec qkv = Random(B * T * 3 * C, rng);
  const Vec w = Random(B * T * C, rng);
  Vec out(B * T * C), lse(B * H * T), scratch(AttentionScratchFloats(B, T, C, H));
  auto loss = [&] {
    ops().AttentionForward(qkv.data(), out.data(), lse.data(), B, T, C, H);
    return WeightedSum(out, w);
  };
  loss();
  Vec dqkv(qkv.size(), 31.0f);
  ops().AttentionBackward(w.data(), qkv.data(), out.data(), lse.data(), dqkv.data(), scratch.data(),
                          B, T, C, H);
  ExpectGradientMatches("attention dqkv", &qkv, dqkv, loss);
}

// ---------------------------------------------------------------------------------------
// The Llama family: no position table, RMS norm, SwiGLU, RoPE with grouped-query heads

TEST(EmbeddingTest, NullPositionTableGivesTheTokenRows) {
  std::mt19937 rng(30);
  const int B = 2, T = 3, C = 4, V = 5;
  const std::vector<int32_t> tokens = {1, 4, 1, 0, 1, 3};
  const Vec wte = Random(V * C, rng);
  Vec out(B * T * C, 99.0f);
  ops().EmbeddingForward(tokens.data(), wte.data(), nullptr, out.data(), B, T, C);
  for (int i = 0; i < B * T; ++i) {
    for (int c = 0; c < C; ++c) EXPECT_EQ(out[i * C + c], wte[tokens[i] * C + c]) << i << "," << c;
  }
}

TEST(RmsNormTest, ForwardMatchesReference) {
  std::mt19937 rng(31);
  const int N = 3, C = 16;
  const float eps = 1e-6f;
  Vec x = Random(N * C, rng, 2.0f);
  for (int c = 0; c < C; ++c) x[2 * C + c] *= 1e-4f;  // a tiny row: eps matters
  const Vec weight = Random(C, rng);
  Vec out(N * C, 7.0f), rstd(N, 7.0f);
  ops().RmsNormForward(x.data(), weight.data(), out.data(), rstd.data(), N, C, eps);
  for (int i = 0; i < N; ++i) {
    double ms = 0.0;
    for (int c = 0; c < C; ++c) ms += static_cast<double>(x[i * C + c]) * x[i * C + c];
    const double rs = 1.0 / std::sqrt(ms / C + eps);
    EXPECT_NEAR(rstd[i], rs, 1e-6 * rs) << i;
    for (int c = 0; c < C; ++c) {
      const double ref = x[i * C + c] * rs * weight[c];
      EXPECT_NEAR(out[i * C + c], ref, 1e-6 * (1.0 + std::abs(ref))) << i << "," << c;
    }
  }
}

TEST(RmsNormTest, GradientsAccumulateAndAFrozenWeightMayBeNull) {
  std::mt19937 rng(32);
  const int N = 4, C = 8;
  const float eps = 1e-5f;
  Vec x = Random(N * C, rng), weight = Random(C, rng);
  const Vec w = Random(N * C, rng);
  Vec out(N * C), rstd(N);
  auto loss = [&] {
    ops().RmsNormForward(x.data(), weight.data(), out.data(), rstd.data(), N, C, eps);
    return WeightedSum(out, w);
  };
  loss();
  // Both accumulate (dx is the residual stream's gradient).
  const Vec dx0 = Random(N * C, rng), dw0 = Random(C, rng);
  Vec dx = dx0, dweight = dw0;
  ops().RmsNormBackward(w.data(), x.data(), weight.data(), rstd.data(), dx.data(), dweight.data(),
                        N, C);
  ExpectGradientMatches("rmsnorm dx", &x, Minus(dx, dx0), loss);
  ExpectGradientMatches("rmsnorm dweight", &weight, Minus(dweight, dw0), loss);
  // Frozen weight: the same dx without a dweight.
  loss();
  Vec dx2 = dx0;
  ops().RmsNormBackward(w.data(), x.data(), weight.data(), rstd.data(), dx2.data(), nullptr, N, C);
  EXPECT_EQ(dx2, dx);
}

TEST(SwigluTest, ForwardMatchesReference) {
  std::mt19937 rng(33);
  Vec gate = Random(64, rng, 3.0f), up = Random(64, rng);
  gate.insert(gate.end(), {0.0f, 100.0f, -100.0f, -1000.0f});  // exp(1000) overflows: silu 0
  up.insert(up.end(), {1.0f, 2.0f, 3.0f, 4.0f});
  const int64_t n = static_cast<int64_t>(gate.size());
  Vec out(n, 5.0f);
  ops().SwigluForward(gate.data(), up.data(), out.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i];
    const double ref = g / (1.0 + std::exp(-g)) * up[i];
    EXPECT_NEAR(out[i], ref, 1e-6 * (1.0 + std::abs(ref))) << "gate=" << g;
  }
  EXPECT_EQ(out[n - 4], 0.0f);
  EXPECT_EQ(out[n - 1], 0.0f);
}

TEST(SwigluTest, GradientsAreWrittenAndMayBeInPlace) {
  std::mt19937 rng(34);
  const int n = 40;
  Vec gate = Random(n, rng, 2.0f), up = Random(n, rng);
  const Vec w = Random(n, rng);
  Vec out(n);
  auto loss = [&] {
    ops().SwigluForward(gate.data(), up.data(), out.data(), n);
    return WeightedSum(out, w);
  };
  Vec dgate(n, 42.0f), dup(n, 43.0f);
  ops().SwigluBackward(w.data(), gate.data(), up.data(), dgate.data(), dup.data(), n);
  ExpectGradientMatches("swiglu dgate", &gate, dgate, loss);
  ExpectGradientMatches("swiglu dup", &up, dup, loss);
  // In place: dgate over gate, dup over up.
  Vec g2 = gate, u2 = up;
  ops().SwigluBackward(w.data(), g2.data(), u2.data(), g2.data(), u2.data(), n);
  EXPECT_EQ(g2, dgate);
  EXPECT_EQ(u2, dup);
}

// cos, then sin, of the D/2 angles t * theta^(-2i/D) of each position t < T.
Vec RopeTable(int T, int D, double theta = 10000.0) {
  Vec rope(static_cast<size_t>(T) * D);
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < D / 2; ++i) {
      const double angle = t * std::pow(theta, -2.0 * i / D);
      rope[t * D + i] = static_cast<float>(std::cos(angle));
      rope[t * D + D / 2 + i] = static_cast<float>(std::sin(angle));
    }
  }
  return rope;
}

// qkv [B,T,3*H*D] from q [B,T,H*D] and k, v [B,T,Hkv*D], in double (ops.h's formula).
std::vector<double> NaiveRopeGqa(const Vec& q, const Vec& k, const Vec& v, const Vec& rope, int B,
                                 int T, int H, int Hkv, int D) {
  const int half = D / 2, qd = H * D, kd = Hkv * D;
  std::vector<double> out(static_cast<size_t>(B) * T * 3 * qd);
  for (int row = 0; row < B * T; ++row) {
    const int t = row % T;
    for (int h = 0; h < H; ++h) {
      const int kh = h / (H / Hkv);
      const float* src[2] = {&q[row * qd + h * D], &k[row * kd + kh * D]};
      for (int part = 0; part < 2; ++part) {
        double* o = &out[static_cast<size_t>(row) * 3 * qd + part * qd + h * D];
        for (int i = 0; i < half; ++i) {
          const double c = rope[t * D + i], s = rope[t * D + half + i];
          const double x0 = src[part][i], x1 = src[part][half + i];
          o[i] = x0 * c - x1 * s;
          o[half + i] = x1 * c + x0 * s;
        }
      }
      for (int d = 0; d < D; ++d) {
        out[static_cast<size_t>(row) * 3 * qd + 2 * qd + h * D + d] = v[row * kd + kh * D + d];
      }
    }
  }
  return out;
}

struct RopeShape {
  int H, Hkv;
};
constexpr RopeShape kRopeShapes[] = {{4, 2}, {4, 4}, {4, 1}};

TEST(RopeGqaTest, ForwardMatchesReference) {
  std::mt19937 rng(35);
  const int B = 2, T = 5, D = 8;
  const Vec rope = RopeTable(T, D);
  for (const RopeShape& sh : kRopeShapes) {
    SCOPED_TRACE("H=" + std::to_string(sh.H) + " Hkv=" + std::to_string(sh.Hkv));
    const Vec q = Random(B * T * sh.H * D, rng), k = Random(B * T * sh.Hkv * D, rng),
              v = Random(B * T * sh.Hkv * D, rng);
    Vec qkv(B * T * 3 * sh.H * D, 8.0f);
    ops().RopeGqaForward(q.data(), k.data(), v.data(), rope.data(), qkv.data(), B, T, sh.H, sh.Hkv,
                         D);
    const std::vector<double> ref = NaiveRopeGqa(q, k, v, rope, B, T, sh.H, sh.Hkv, D);
    for (size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(qkv[i], ref[i], 1e-6) << i;
    // Position 0 is the identity rotation.
    for (int d = 0; d < sh.H * D; ++d) EXPECT_EQ(qkv[d], q[d]);
  }
}

TEST(RopeGqaTest, BackwardIsTheAdjoint) {
  std::mt19937 rng(36);
  const int B = 2, T = 5, D = 8;
  const Vec rope = RopeTable(T, D);
  for (const RopeShape& sh : kRopeShapes) {
    SCOPED_TRACE("H=" + std::to_string(sh.H) + " Hkv=" + std::to_string(sh.Hkv));
    const int qn = B * T * sh.H * D, kn = B * T * sh.Hkv * D;
    const Vec q = Random(qn, rng), k = Random(kn, rng), v = Random(kn, rng);
    const Vec g = Random(3 * qn, rng);
    Vec qkv(3 * qn), dq(qn, 5.0f), dk(kn, 6.0f), dv(kn, 7.0f);
    ops().RopeGqaForward(q.data(), k.data(), v.data(), rope.data(), qkv.data(), B, T, sh.H, sh.Hkv,
                         D);
    ops().RopeGqaBackward(g.data(), rope.data(), dq.data(), dk.data(), dv.data(), B, T, sh.H,
                          sh.Hkv, D);
    // <F(q,k,v), g> == <(q,k,v), F^T g>, relative to the sum of the terms' magnitudes.
    double lhs = 0.0, rhs = 0.0, scale = 0.0;
    for (int i = 0; i < 3 * qn; ++i) {
      lhs += static_cast<double>(qkv[i]) * g[i];
      scale += std::abs(static_cast<double>(qkv[i]) * g[i]);
    }
    for (int i = 0; i < qn; ++i) rhs += static_cast<double>(q[i]) * dq[i];
    for (int i = 0; i < kn; ++i) {
      rhs += static_cast<double>(k[i]) * dk[i] + static_cast<double>(v[i]) * dv[i];
    }
    EXPECT_NEAR(lhs, rhs, 1e-5 * scale) << "lhs " << lhs << " rhs " << rhs;
  }
}

TEST(RopeGqaTest, GradientsAreWritten) {
  std::mt19937 rng(37);
  const int B = 2, T = 5, D = 8;
  const Vec rope = RopeTable(T, D);
  for (const RopeShape& sh : kRopeShapes) {
    const std::string tag = " H" + std::to_string(sh.H) + " Hkv" + std::to_string(sh.Hkv);
    const int qn = B * T * sh.H * D, kn = B * T * sh.Hkv * D;
    Vec q = Random(qn, rng), k = Random(kn, rng), v = Random(kn, rng);
    const Vec w = Random(3 * qn, rng);
    Vec qkv(3 * qn);
    auto loss = [&] {
      ops().RopeGqaForward(q.data(), k.data(), v.data(), rope.data(), qkv.data(), B, T, sh.H,
                           sh.Hkv, D);
      return WeightedSum(qkv, w);
    };
    Vec dq(qn, 5.0f), dk(kn, 6.0f), dv(kn, 7.0f);
    ops().RopeGqaBackward(w.data(), rope.data(), dq.data(), dk.data(), dv.data(), B, T, sh.H,
                          sh.Hkv, D);
    ExpectGradientMatches("rope dq" + tag, &q, dq, loss);
    ExpectGradientMatches("rope dk" + tag, &k, dk, loss);
    ExpectGradientMatches("rope dv" + tag, &v, dv, loss);
  }
}

// ---------------------------------------------------------------------------------------
// Elementwise: Cast, Subtract, SumSquares

TEST(ElementwiseTest, CastSubtractSumSquares) {
  const Vec a = {1.0f, -2.0f, 3.5f}, b = {0.5f, 0.5f, -1.0f};
  Vec d(3);
  ops().Subtract(a.data(), b.data(), d.data(), 3);
  EXPECT_EQ(d, (Vec{0.5f, -2.5f, 4.5f}));
  float sumsq = -1.0f;
  ops().SumSquares(a.data(), 3, &sumsq);
  EXPECT_FLOAT_EQ(sumsq, 1.0f + 4.0f + 12.25f);
  // Many small terms: a float accumulator would drift, the double one must not.
  const Vec small(1 << 20, 1e-3f);
  ops().SumSquares(small.data(), static_cast<int64_t>(small.size()), &sumsq);
  EXPECT_NEAR(sumsq, (1 << 20) * static_cast<double>(1e-3f) * 1e-3f, 1e-6);
  // fp32 -> bf16 -> fp32 keeps 8 significant bits, rounding to nearest even.
  const Vec values = {1.0f, 1.00390625f, 1.005f, -3.14159f, 1e-30f};
  std::vector<Bf16> h(values.size());
  Vec back(values.size());
  ops().Cast(values.data(), h.data(), static_cast<int64_t>(values.size()));
  ops().Cast(h.data(), back.data(), static_cast<int64_t>(values.size()));
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], 1.0f);  // a tie: goes to the even mantissa
  EXPECT_EQ(back[2], 1.0078125f);
  EXPECT_NEAR(back[3], -3.14159f, 3.14159f / 256);
  EXPECT_NEAR(back[4], 1e-30f, 1e-32f);
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(back[i], RoundBf16(values[i]));
}

// ---------------------------------------------------------------------------------------
// Cross-entropy

TEST(CrossEntropyTest, KnownValuesAndGradientRows) {
  const int N = 4, V = 4;
  const Vec logits = {
      0.0f,           0.0f,           0.0f,           0.0f,            // uniform: log 4
      std::log(0.1f), std::log(0.2f), std::log(0.3f), std::log(0.4f),  // -log 0.3
      1000.0f,        0.0f,           0.0f,           0.0f,            // huge logit: 1000
      5.0f,           1.0f,           2.0f,           3.0f,            // ignored
  };
  const std::vector<int32_t> targets = {2, 2, 1, -1};
  const float dloss = 1.0f / 3.0f;
  Vec losses(N, 9.0f), dlogits(N * V, 8.0f);
  ops().SoftmaxCrossEntropy(logits.data(), targets.data(), losses.data(), dlogits.data(), &dloss, N,
                            V);
  EXPECT_NEAR(losses[0], std::log(4.0), 1e-6);
  EXPECT_NEAR(losses[1], -std::log(0.3), 1e-6);
  EXPECT_NEAR(losses[2], 1000.0, 1e-3);
  EXPECT_EQ(losses[3], 0.0f);
  // (softmax - onehot) * dloss; rows sum to zero; the ignored row is zero.
  EXPECT_NEAR(dlogits[0], 0.25f / 3, 1e-7);
  EXPECT_NEAR(dlogits[2], (0.25f - 1.0f) / 3, 1e-7);
  EXPECT_NEAR(dlogits[1 * V + 3], 0.4f / 3, 1e-6);
  EXPECT_NEAR(dlogits[2 * V + 0], 1.0f / 3, 1e-7);
  for (int i = 0; i < 3; ++i) {
    double s = 0.0;
    for (int j = 0; j < V; ++j) s += dlogits[i * V + j];
    EXPECT_NEAR(s, 0.0, 1e-6);
  }
  for (int j = 0; j < V; ++j) EXPECT_EQ(dlogits[3 * V + j], 0.0f);
  // Losses only, and the gradient in place of the logits.
  Vec only(N);
  ops().SoftmaxCrossEntropy(logits.data(), targets.data(), only.data(), nullptr, &dloss, N, V);
  EXPECT_EQ(only, losses);
  Vec in_place = logits;
  ops().SoftmaxCrossEntropy(in_place.data(), targets.data(), only.data(), in_place.data(), &dloss,
                            N, V);
  EXPECT_EQ(in_place, dlogits);
}

TEST(CrossEntropyTest, GradientOfTheMeanLoss) {
  std::mt19937 rng(14);
  const int N = 5, V = 7;
  Vec logits = Random(N * V, rng, 2.0f);
  const std::vector<int32_t> targets = {3, -1, 0, 6, 2};
  const float dloss = 1.0f / 4.0f;  // four counted rows
  Vec losses(N);
  auto loss = [&] {
    ops().SoftmaxCrossEntropy(logits.data(), targets.data(), losses.data(), nullptr, &dloss, N, V);
    double s = 0.0;
    for (float l : losses) s += l;
    return s / 4.0;
  };
  Vec d(N * V);
  ops().SoftmaxCrossEntropy(logits.data(), targets.data(), losses.data(), d.data(), &dloss, N, V);
  ExpectGradientMatches("cross-entropy dlogits", &logits, d, loss);
}

// ---------------------------------------------------------------------------------------
// Distillation loss

// k distinct ids per row (a random top-k stand-in) and the teacher's logits at them.
void RandomTeacher(int N, int V, int k, std::mt19937& rng, std::vector<int32_t>* ids, Vec* tl) {
  ids->clear();
  for (int i = 0; i < N; ++i) {
    std::vector<int32_t> all(V);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    ids->insert(ids->end(), all.begin(), all.begin() + k);
  }
  *tl = Random(static_cast<size_t>(N) * k, rng, 3.0f);
}

TEST(DistillLossTest, KnownValuesAlphaOneIsCrossEntropyAndMatchingTeacherIsFree) {
  const int N = 3, V = 4;
  const Vec logits = {0.0f, 0.0f, 0.0f, 0.0f,  //
                      1.0f, 2.0f, 3.0f, 4.0f,  //
                      5.0f, 1.0f, 2.0f, 3.0f};
  const std::vector<int32_t> targets = {2, 0, -1};
  // Full-vocabulary teachers: row 0 uniform (equal to the student), row 1 a different one.
  const std::vector<int32_t> ids = {3, 2, 1, 0, 0, 1, 2, 3, 0, 1, 2, 3};
  const Vec tl = {7.0f, 7.0f, 7.0f, 7.0f, 4.0f, 3.0f, 2.0f, 1.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  const float dloss = 0.5f;
  Vec ce(N), ce_grad(N * V), losses(N), grad(N * V);
  ops().SoftmaxCrossEntropy(logits.data(), targets.data(), ce.data(), ce_grad.data(), &dloss, N, V);
  ops().DistillCrossEntropy(logits.data(), targets.data(), ids.data(), tl.data(), {V, 1.0f, 2.0f},
                            losses.data(), grad.data(), &dloss, N, V);
  for (int i = 0; i < N; ++i) EXPECT_NEAR(losses[i], ce[i], 1e-6) << i;
  for (int j = 0; j < N * V; ++j) EXPECT_NEAR(grad[j], ce_grad[j], 1e-7) << j;
  // alpha 0: the loss is T^2 KL; the uniform teacher matches row 0 exactly.
  ops().DistillCrossEntropy(logits.data(), targets.data(), ids.data(), tl.data(), {V, 0.0f, 2.0f},
                            losses.data(), grad.data(), &dloss, N, V);
  EXPECT_NEAR(losses[0], 0.0, 1e-6);
  for (int j = 0; j < V; ++j) EXPECT_NEAR(grad[j], 0.0, 1e-7);
  // Row 1 by hand: p = softmax([4,3,2,1]/2), q = softmax([1,2,3,4]/2), loss = 4 KL(p||q).
  double p[4], q[4], zp = 0, zq = 0;
  for (int j = 0; j < 4; ++j) zp += std::exp((4 - j) / 2.0), zq += std::exp((j + 1) / 2.0);
  double kl = 0;
  for (int j = 0; j < 4; ++j) {
    p[j] = std::exp((4 - j) / 2.0) / zp, q[j] = std::exp((j + 1) / 2.0) / zq;
    kl += p[j] * std::log(p[j] / q[j]);
  }
  EXPECT_NEAR(losses[1], 4 * kl, 1e-5);
  for (int j = 0; j < V; ++j) EXPECT_NEAR(grad[V + j], 0.5 * 2 * (q[j] - p[j]), 1e-6) << j;
  EXPECT_EQ(losses[2], 0.0f);
  for (int j = 0; j < V; ++j) EXPECT_EQ(grad[2 * V + j], 0.0f);
}

TEST(DistillLossTest, GradientOfTheMeanLossMatchesFiniteDifferences) {
  std::mt19937 rng(21);
  const int N = 5, V = 9;
  for (int k : {3, V}) {
    for (const DistillLoss& cfg : {DistillLoss{k, 0.3f, 2.0f}, DistillLoss{k, 0.0f, 0.7f}}) {
      Vec logits = Random(N * V, rng, 2.0f);
      std::vector<int32_t> ids;
      Vec tl;
      RandomTeacher(N, V, k, rng, &ids, &tl);
      const std::vector<int32_t> targets = {3, -1, 0, 8, 2};
      const float dloss = 1.0f / 4.0f;
      Vec losses(N);
      auto loss = [&] {
        ops().DistillCrossEntropy(logits.data(), targets.data(), ids.data(), tl.data(), cfg,
                                  losses.data(), nullptr, &dloss, N, V);
        double s = 0.0;
        for (float l : losses) s += l;
        return s / 4.0;
      };
      Vec d(N * V);
      ops().DistillCrossEntropy(logits.data(), targets.data(), ids.data(), tl.data(), cfg,
                                losses.data(), d.data(), &dloss, N, V);
      for (float l : losses) EXPECT_GE(l, 0.0f);
      ExpectGradientMatches("distillation dlogits, k " + std::to_string(k), &logits, d, loss);
      // In place gives the same gradient.
      Vec in_place = logits;
      ops().DistillCrossEntropy(in_place.data(), targets.data(), ids.data(), tl.data(), cfg,
                                losses.data(), in_place.data(), &dloss, N, V);
      EXPECT_EQ(in_place, d);
    }
  }
}

// The C++ loss and gradient against tests/ops/distill_reference.py, a from-scratch PyTorch
// KL in float64 with autograd (python3-torch, which deploy/install-deps.sh installs).
TEST(DistillLossTest, MatchesAFromScratchPyTorchKl) {
  const std::string dir = ::testing::TempDir() + "distill-ref-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  std::mt19937 rng(33);
  const int N = 6, V = 50, k = 8;
  const Vec logits = Random(N * V, rng, 3.0f);
  const std::vector<int32_t> targets = {4, -1, 0, 49, 17, 23};
  std::vector<int32_t> ids;
  Vec tl;
  RandomTeacher(N, V, k, rng, &ids, &tl);
  auto write = [&](const char* name, const void* p, size_t bytes) {
    std::FILE* f = std::fopen((dir + "/" + name).c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(p, 1, bytes, f), bytes);
    std::fclose(f);
  };
  write("logits", logits.data(), logits.size() * 4);
  write("targets", targets.data(), targets.size() * 4);
  write("ids", ids.data(), ids.size() * 4);
  write("teacher", tl.data(), tl.size() * 4);
  const DistillLoss cfg{k, 0.4f, 1.5f};
  const std::string cmd = std::string("/usr/bin/python3 ") + DISTILL_REFERENCE_PY + " " + dir +
                          " " + std::to_string(N) + " " + std::to_string(V) + " " +
                          std::to_string(k) + " 0.4 1.5";
  ASSERT_EQ(std::system(cmd.c_str()), 0)
      << cmd << " failed: python3-torch and python3-numpy are needed (deploy/install-deps.sh)";
  auto read = [&](const char* name, size_t n) {
    Vec out(n);
    std::FILE* f = std::fopen((dir + "/" + name).c_str(), "rb");
    EXPECT_NE(f, nullptr);
    if (f != nullptr) {
      EXPECT_EQ(std::fread(out.data(), 4, n, f), n);
      std::fclose(f);
    }
    return out;
  };
  const Vec want_losses = read("losses", N), want_grad = read("grad", N * V);
  std::filesystem::remove_all(dir);
  const float dloss = 1.0f / 5.0f;  // five rows with a target
  Vec losses(N), grad(N * V);
  ops().DistillCrossEntropy(logits.data(), targets.data(), ids.data(), tl.data(), cfg,
                            losses.data(), grad.data(), &dloss, N, V);
  for (int i = 0; i < N; ++i) EXPECT_NEAR(losses[i], want_losses[i], 1e-5) << i;
  double worst = 0, largest = 0;
  for (int j = 0; j < N * V; ++j) {
    worst = std::max(worst, static_cast<double>(std::abs(grad[j] - want_grad[j])));
    largest = std::max(largest, static_cast<double>(std::abs(want_grad[j])));
  }
  EXPECT_LT(worst, 1e-7) << "largest gradient " << largest;
  EXPECT_GT(largest, 1e-3);
}

// ---------------------------------------------------------------------------------------
// AdamW and the schedule

TEST(AdamWTest, MakeAdamWChunksSplitsSegments) {
  const auto chunks = MakeAdamWChunks({{0, 3, true}, {64, kAdamWChunkElems + 5, false}});
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0].offset, 0);
  EXPECT_EQ(chunks[0].count, 3);
  EXPECT_EQ(chunks[0].decay, 1);
  EXPECT_EQ(chunks[1].offset, 64);
  EXPECT_EQ(chunks[1].count, kAdamWChunkElems);
  EXPECT_EQ(chunks[2].offset, 64 + kAdamWChunkElems);
  EXPECT_EQ(chunks[2].count, 5);
  EXPECT_EQ(chunks[2].decay, 0);
}

// A part [lo, hi) of the chunks: only the elements inside, their moments counted from lo.
TEST(AdamWTest, MakeAdamWChunksKeepsAPartWithItsMomentsCountedFromItsStart) {
  const auto chunks = MakeAdamWChunks({{0, 40, true}, {40, 10, false}, {50, 30, true}}, 32, 64);
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0].offset, 32);
  EXPECT_EQ(chunks[0].count, 8);
  EXPECT_EQ(chunks[1].offset, 40);
  EXPECT_EQ(chunks[1].count, 10);
  EXPECT_EQ(chunks[1].decay, 0);
  EXPECT_EQ(chunks[2].offset, 50);
  EXPECT_EQ(chunks[2].count, 14);
  for (const AdamWChunk& c : chunks) EXPECT_EQ(c.shard_start, 32);
  EXPECT_TRUE(MakeAdamWChunks({{0, 40, true}}, 48, 64).empty());
}

TEST(AdamWTest, ShardBoundsCoverTheBufferInAlignedParts) {
  for (int64_t n : {0, 1, 10, 17, 1000, 65536 * 3 + 5}) {
    for (int parts : {1, 2, 3, 4, 7}) {
      const std::vector<int64_t> b = AdamWShardBounds(n, parts);
      ASSERT_EQ(b.size(), static_cast<size_t>(parts) + 1);
      EXPECT_EQ(b.front(), 0);
      EXPECT_EQ(b.back(), n);
      for (int r = 0; r < parts; ++r) {
        EXPECT_LE(b[r], b[r + 1]);
        if (b[r] < n) {
          EXPECT_EQ(b[r] % 16, 0) << n << " / " << parts << ": part " << r;
        }
        // No part longer than an even split rounded up to 16.
        EXPECT_LE(b[r + 1] - b[r], ((n + parts - 1) / parts + 15) / 16 * 16);
      }
    }
  }
}

// Runs the chunked AdamW of ops.h on small host buffers.
struct AdamWRun {
  Vec p, g, m, v;
  std::vector<AdamWChunk> chunks;
  AdamWConfig config;
  std::vector<Bf16> copy;
  void Step(float lr, int64_t step, float sumsq_override = -1.0f) {
    AdamWScalars s{lr, 1.0f - static_cast<float>(std::pow(double{config.beta1}, step)),
                   1.0f - static_cast<float>(std::pow(double{config.beta2}, step)), 0.0f};
    float sumsq = 0.0f;
    ops().SumSquares(g.data(), static_cast<int64_t>(g.size()), &sumsq);
    if (sumsq_override >= 0.0f || std::isnan(sumsq_override)) sumsq = sumsq_override;
    copy.resize(p.size());
    ops().AdamW(p.data(), g.data(), m.data(), v.data(), copy.data(), chunks.data(),
                static_cast<int>(chunks.size()), &sumsq, &s, config);
  }
};

TEST(AdamWTest, MatchesHandComputedSteps) {
  // lr 0.1, betas (0.9, 0.999), eps 1e-8, weight decay 0.1; p0 = 1.
  // Step 1, g = 0.5: m = 0.05, v = 2.5e-4, m_hat = 0.5, v_hat = 0.25,
  //   p = 1 - 0.1 * (0.5 / 0.5 + 0.1 * 1) = 0.89.
  // Step 2, g = -0.25: m = 0.02, v = 3.1225e-4, m_hat = 0.02 / 0.19, v_hat = 3.1225e-4 / 0.001999,
  //   p = 0.89 - 0.1 * (m_hat / sqrt(v_hat) + 0.1 * 0.89) = 0.854466299.
  AdamWRun r;
  r.p = {1.0f, 2.0f, 2.0f};
  r.m = r.v = {0.0f, 0.0f, 0.0f};
  r.g = {0.5f, 0.0f, 0.0f};
  r.chunks = {{0, 2, 1}, {2, 1, 0}};  // the last element is not decayed
  r.config = {0.9f, 0.999f, 1e-8f, 0.1f, 0.0f};
  r.Step(0.1f, 1);
  EXPECT_NEAR(r.p[0], 0.89f, 1e-6);
  EXPECT_NEAR(r.m[0], 0.05f, 1e-7);
  EXPECT_NEAR(r.v[0], 2.5e-4f, 1e-8);                      // 0.999f is not 0.999: ~1e-5 relative
  EXPECT_NEAR(r.p[1], 2.0f * (1.0f - 0.1f * 0.1f), 1e-6);  // zero gradient: decay only
  EXPECT_EQ(r.p[2], 2.0f);                                 // no decay, no gradient
  EXPECT_EQ(FromBf16(r.copy[0]), RoundBf16(r.p[0]));       // the copy follows
  r.g = {-0.25f, 0.0f, 0.0f};
  r.Step(0.1f, 2);
  EXPECT_NEAR(r.m[0], 0.02f, 1e-7);
  EXPECT_NEAR(r.v[0], 3.1225e-4f, 1e-8);
  EXPECT_NEAR(r.p[0], 0.8544663f, 2e-6);
}

// The sharded optimizer's step: each part's AdamW over its own moments gives, bit for bit,
// the parameters, bf16 copies and moments of one AdamW over the whole buffer.
TEST(AdamWTest, PartsWithTheirOwnMomentsStepBitForBitLikeTheWholeBuffer) {
  constexpr int64_t kN = 3 * kAdamWChunkElems / 2 + 37;
  const std::vector<AdamWSegment> segments = {
      {0, 1000, true}, {1000, 77, false}, {1077, kN - 1077, true}};
  std::mt19937 gen(5);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  AdamWRun whole;
  whole.p.resize(kN);
  whole.g.resize(kN);
  for (auto& x : whole.p) x = dist(gen);
  for (auto& x : whole.g) x = dist(gen);
  whole.m.assign(kN, 0.0f);
  whole.v.assign(kN, 0.0f);
  whole.chunks = MakeAdamWChunks(segments);
  whole.config = {0.9f, 0.95f, 1e-8f, 0.1f, 1.0f};
  const float first = whole.p[0];
  const int kParts = 3;
  const std::vector<int64_t> bounds = AdamWShardBounds(kN, kParts);
  std::vector<AdamWRun> parts(kParts, whole);
  for (int r = 0; r < kParts; ++r) {
    parts[r].chunks = MakeAdamWChunks(segments, bounds[r], bounds[r + 1]);
    parts[r].m.assign(static_cast<size_t>(bounds[r + 1] - bounds[r]), 0.0f);
    parts[r].v = parts[r].m;
  }
  for (int step = 1; step <= 3; ++step) {
    whole.Step(1e-2f, step);
    for (auto& part : parts) part.Step(1e-2f, step);
  }
  for (int r = 0; r < kParts; ++r) {
    for (int64_t i = bounds[r]; i < bounds[r + 1]; ++i) {
      const int64_t j = i - bounds[r];
      ASSERT_EQ(std::bit_cast<uint32_t>(parts[r].p[i]), std::bit_cast<uint32_t>(whole.p[i])) << i;
      ASSERT_EQ(parts[r].copy[i].bits, whole.copy[i].bits) << i;
      ASSERT_EQ(std::bit_cast<uint32_t>(parts[r].m[j]), std::bit_cast<uint32_t>(whole.m[i])) << i;
      ASSERT_EQ(std::bit_cast<uint32_t>(parts[r].v[j]), std::bit_cast<uint32_t>(whole.v[i])) << i;
    }
  }
  EXPECT_NE(whole.p[0], first);
  EXPECT_EQ(parts[1].p[0], first) << "a part changed a parameter outside itself";
}

TEST(AdamWTest, ClipsByTheGlobalNormAndSkipsNonFiniteSteps) {
  AdamWRun clipped, scaled;
  for (AdamWRun* r : {&clipped, &scaled}) {
    r->p = {1.0f, 1.0f};
    r->m = r->v = {0.0f, 0.0f};
    r->chunks = {{0, 2, 0}};
    r->config = {0.9f, 0.95f, 1e-8f, 0.0f, 1.0f};
  }
  clipped.g = {3.0f, 4.0f};  // norm 5: scaled by 1 / (5 + 1e-6)
  scaled.g = {3.0f / (5.0f + 1e-6f), 4.0f / (5.0f + 1e-6f)};
  clipped.Step(0.01f, 1);
  scaled.Step(0.01f, 1);
  EXPECT_NEAR(clipped.m[0], scaled.m[0], 1e-7);
  EXPECT_NEAR(clipped.v[1], scaled.v[1], 1e-7);
  EXPECT_NEAR(clipped.p[0], scaled.p[0], 1e-7);
  const Vec p = clipped.p, m = clipped.m;
  clipped.Step(0.01f, 2, std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(clipped.p, p);
  EXPECT_EQ(clipped.m, m);
  clipped.Step(0.01f, 2, std::numeric_limits<float>::infinity());
  EXPECT_EQ(clipped.p, p);
}

TEST(ScheduleTest, WarmupCosineEndpointsAndMonotonicity) {
  const int64_t warmup = 10, total = 100;
  const float max_lr = 1e-3f, min_lr = 1e-4f;
  EXPECT_EQ(WarmupCosineLr(0, warmup, total, max_lr, min_lr), 0.0f);
  EXPECT_NEAR(WarmupCosineLr(5, warmup, total, max_lr, min_lr), 0.5f * max_lr, 1e-9);
  EXPECT_FLOAT_EQ(WarmupCosineLr(warmup, warmup, total, max_lr, min_lr), max_lr);
  EXPECT_FLOAT_EQ(WarmupCosineLr(55, warmup, total, max_lr, min_lr), 0.5f * (max_lr + min_lr));
  EXPECT_FLOAT_EQ(WarmupCosineLr(total, warmup, total, max_lr, min_lr), min_lr);
  EXPECT_FLOAT_EQ(WarmupCosineLr(total + 1000, warmup, total, max_lr, min_lr), min_lr);
  float prev = -1.0f;
  for (int64_t s = 0; s <= warmup; ++s) {
    const float lr = WarmupCosineLr(s, warmup, total, max_lr, min_lr);
    EXPECT_GT(lr, prev) << s;
    prev = lr;
  }
  for (int64_t s = warmup + 1; s <= total + 5; ++s) {
    const float lr = WarmupCosineLr(s, warmup, total, max_lr, min_lr);
    EXPECT_LE(lr, prev) << s;
    EXPECT_GE(lr, min_lr) << s;
    prev = lr;
  }
  // No warmup: starts at the peak.
  EXPECT_FLOAT_EQ(WarmupCosineLr(0, 0, total, max_lr, min_lr), max_lr);
}

// ---------------------------------------------------------------------------------------
// bf16 emulation: a bf16 kernel equals its fp32 run on the same (bf16-exact) inputs,
// rounded once at the store.

TEST(Bf16Test, KernelsRoundTheirFp32ResultOnce) {
  std::mt19937 rng(15);
  auto rounded = [](Vec v) {
    for (float& x : v) x = RoundBf16(x);
    return v;
  };
  auto to_bf16 = [](const Vec& v) {
    std::vector<Bf16> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = ToBf16(v[i]);
    return h;
  };
  auto from_bf16 = [](const std::vector<Bf16>& h) {
    Vec v(h.size());
    for (size_t i = 0; i < h.size(); ++i) v[i] = FromBf16(h[i]);
    return v;
  };
  const int N = 6, in = 16, out_dim = 24;
  const Vec x = rounded(Random(N * in, rng)), w = rounded(Random(in * out_dim, rng));
  const Vec b = Random(out_dim, rng);
  Vec ref(N * out_dim);
  ops().LinearForward(x.data(), w.data(), b.data(), nullptr, ref.data(), N, in, out_dim);
  const auto xh = to_bf16(x), wh = to_bf16(w);
  std::vector<Bf16> outh(N * out_dim);
  ops().LinearForward(xh.data(), wh.data(), b.data(), nullptr, outh.data(), N, in, out_dim);
  EXPECT_EQ(from_bf16(outh), rounded(ref));

  Vec gref(N * in);
  ops().GeluForward(x.data(), gref.data(), N * in);
  std::vector<Bf16> gh(N * in);
  ops().GeluForward(xh.data(), gh.data(), N * in);
  EXPECT_EQ(from_bf16(gh), rounded(gref));

  const Vec weight = Random(in, rng), bias = Random(in, rng);
  Vec lref(N * in), mean(N), rstd(N);
  ops().LayerNormForward(x.data(), weight.data(), bias.data(), lref.data(), mean.data(),
                         rstd.data(), N, in);
  std::vector<Bf16> lh(N * in);
  ops().LayerNormForward(x.data(), weight.data(), bias.data(), lh.data(), mean.data(), rstd.data(),
                         N, in);
  EXPECT_EQ(from_bf16(lh), rounded(lref));

  Vec rref(N * in), rs(N);
  ops().RmsNormForward(x.data(), weight.data(), rref.data(), rs.data(), N, in, 1e-5f);
  std::vector<Bf16> rh(N * in);
  ops().RmsNormForward(x.data(), weight.data(), rh.data(), rs.data(), N, in, 1e-5f);
  EXPECT_EQ(from_bf16(rh), rounded(rref));

  const Vec up = rounded(Random(N * in, rng));
  const auto uh = to_bf16(up);
  Vec sref(N * in), dgref(N * in), duref(N * in);
  ops().SwigluForward(x.data(), up.data(), sref.data(), N * in);
  ops().SwigluBackward(up.data(), x.data(), up.data(), dgref.data(), duref.data(), N * in);
  std::vector<Bf16> sh(N * in), dgh(N * in), duh(N * in);
  ops().SwigluForward(xh.data(), uh.data(), sh.data(), N * in);
  ops().SwigluBackward(uh.data(), xh.data(), uh.data(), dgh.data(), duh.data(), N * in);
  EXPECT_EQ(from_bf16(sh), rounded(sref));
  EXPECT_EQ(from_bf16(dgh), rounded(dgref));
  EXPECT_EQ(from_bf16(duh), rounded(duref));

  // RoPE with B = 1, T = N, H = 2, Hkv = 1, D = 8: q is x, k and v are halves of up.
  const int H = 2, Hkv = 1, D = 8;
  const Vec rope = RopeTable(N, D);
  Vec qkv(N * 3 * H * D), dq(N * H * D), dk(N * Hkv * D), dv(N * Hkv * D);
  ops().RopeGqaForward(x.data(), up.data(), up.data() + N * D, rope.data(), qkv.data(), 1, N, H,
                       Hkv, D);
  std::vector<Bf16> qkvh(qkv.size()), dqh(dq.size()), dkh(dk.size()), dvh(dv.size());
  ops().RopeGqaForward(xh.data(), uh.data(), uh.data() + N * D, rope.data(), qkvh.data(), 1, N, H,
                       Hkv, D);
  EXPECT_EQ(from_bf16(qkvh), rounded(qkv));
  const Vec g = rounded(qkv);
  ops().RopeGqaBackward(g.data(), rope.data(), dq.data(), dk.data(), dv.data(), 1, N, H, Hkv, D);
  ops().RopeGqaBackward(qkvh.data(), rope.data(), dqh.data(), dkh.data(), dvh.data(), 1, N, H, Hkv,
                        D);
  EXPECT_EQ(from_bf16(dqh), rounded(dq));
  EXPECT_EQ(from_bf16(dkh), rounded(dk));
  EXPECT_EQ(from_bf16(dvh), rounded(dv));
}

}  // namespace
}  // namespace isthmus::ops
