// Runs every launch function of ops/cuda_kernels.cuh in the CUDA emulator and checks it
// against a naive double-precision reference written here, so that the kernels' indexing,
// vector and scalar paths, one- and two-pass reductions and write-versus-accumulate
// semantics are verified on machines without a GPU.
//
// Tolerances: results stored in fp32 must be within 1e-5 relative (of the element, plus the
// mean magnitude of the output for elements near zero): the kernels compute in fp32, whose
// rounding is about 6e-8 per operation, and the longest chains here add a few hundred terms.
// Results stored in bf16 get 1e-2: bf16 keeps 8 significant bits, so the one rounding at
// the store alone may be off by 2^-9 (0.2%) of the value, and the fp32 result rounded there
// may itself sit on the other side of a rounding boundary from the exact one. Inputs given
// in bf16 are converted exactly, so the reference sees the same values as the kernel.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ops/cuda_kernels.cuh"

namespace isthmus::ops::ISTHMUS_CUDA_NS {
namespace {

constexpr double kF32Tol = 1e-5;
constexpr double kBf16Tol = 1e-2;

float F(float x) { return x; }
float F(bf16 x) { return __bfloat162float(x); }

template <typename T>
T Make(float f);
template <>
float Make<float>(float f) {
  return f;
}
template <>
bf16 Make<bf16>(float f) {
  return __float2bfloat16(f);
}

template <typename T>
constexpr double StoreTol() {
  return std::is_same_v<T, float> ? kF32Tol : kBf16Tol;
}

template <typename T>
const char* Name() {
  return std::is_same_v<T, float> ? "fp32" : "bf16";
}

std::vector<float> Random(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

template <typename T>
std::vector<T> As(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = Make<T>(v[i]);
  return out;
}

template <typename T>
std::vector<double> ToDouble(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = F(v[i]);
  return out;
}

// Every got[i] within tol * (|ref[i]| + mean |ref|) of ref[i].
template <typename T>
void ExpectClose(const T* got, const std::vector<double>& ref, double tol,
                 const std::string& what) {
  double mean_abs = 0;
  for (double r : ref) mean_abs += std::fabs(r);
  mean_abs = ref.empty() ? 0 : mean_abs / ref.size();
  int failures = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = F(got[i]);
    const double bound = tol * (std::fabs(ref[i]) + mean_abs);
    if (!(std::fabs(g - ref[i]) <= bound)) {
      if (++failures <= 5) {
        ADD_FAILURE() << what << "[" << i << "] = " << g << ", reference " << ref[i] << " (bound "
                      << bound << ")";
      }
    }
  }
  EXPECT_EQ(failures, 0) << what << ": " << failures << " of " << ref.size() << " elements off";
}

template <typename T>
void ExpectClose(const std::vector<T>& got, const std::vector<double>& ref, double tol,
                 const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  ExpectClose(got.data(), ref, tol, what);
}

int64_t Launches() { return emu::GetStats().launches; }

void ExpectLaunchOk() { EXPECT_EQ(cudaGetLastError(), cudaSuccess); }

// A workspace the size the backend gives, filled with NaN so that reading it before writing
// shows.
std::vector<float>& Workspace() {
  static std::vector<float> ws(kWorkspaceFloats);
  std::fill(ws.begin(), ws.end(), std::numeric_limits<float>::quiet_NaN());
  return ws;
}

// ---- Cast, Subtract, BiasResidual ------------------------------------------------------

template <typename Tin, typename Tout>
void CheckCast(int64_t n, int offset) {
  SCOPED_TRACE(std::string(Name<Tin>()) + "->" + Name<Tout>() + " n=" + std::to_string(n) +
               " offset=" + std::to_string(offset));
  std::vector<float> f = Random(n + offset, 11, -100.0f, 100.0f);
  f[offset] = 1.0f + 0.00390625f;  // a tie: rounds to even (1.0) in bf16
  const std::vector<Tin> src = As<Tin>(f);
  std::vector<Tout> out(n + offset, Make<Tout>(-7.0f));
  LaunchCast(src.data() + offset, out.data() + offset, n, nullptr);
  ExpectLaunchOk();
  for (int64_t i = 0; i < n; ++i) {
    const Tout expect = Make<Tout>(F(src[offset + i]));  // exact: one RN rounding or none
    ASSERT_EQ(F(out[offset + i]), F(expect)) << i;
  }
  for (int i = 0; i < offset; ++i) EXPECT_EQ(F(out[i]), -7.0f);
}

TEST(CudaKernelsEmuTest, CastAllTypePairsVectorAndScalarPaths) {
  for (int offset : {0, 1}) {
    for (int64_t n : {int64_t{1000}, int64_t{1003}, int64_t{3}}) {
      CheckCast<float, bf16>(n, offset);
      CheckCast<bf16, float>(n, offset);
      CheckCast<float, float>(n, offset);
      CheckCast<bf16, bf16>(n, offset);
    }
  }
  EXPECT_EQ(__bfloat162float(__float2bfloat16(1.0f + 0.00390625f)), 1.0f);
}

TEST(CudaKernelsEmuTest, ZeroSizesLaunchNothing) {
  const int64_t before = Launches();
  float f = 1.0f;
  bf16 h = Make<bf16>(1.0f);
  LaunchCast(&f, &h, 0, nullptr);
  LaunchSubtract(&f, &f, &f, 0, nullptr);
  LaunchBiasResidual<float>(&f, &f, &f, 0, 5, nullptr);
  LaunchColumnSumAccumulate(&f, &f, 0, 5, Workspace().data(), nullptr);
  LaunchEmbeddingForward(nullptr, &f, &f, &f, 0, 4, 8, nullptr);
  LaunchEmbeddingBackward(&f, nullptr, nullptr, &f, &f, 0, 4, 8, 3, nullptr);
  LaunchLayerNormForward(&f, &f, &f, &f, &f, &f, 0, 8, nullptr);
  LaunchLayerNormBackward(&f, &f, &f, &f, &f, &f, &f, &f, 0, 8, Workspace().data(), nullptr);
  LaunchGeluForward(&f, &f, 0, nullptr);
  LaunchGeluBackward(&f, &f, &f, 0, nullptr);
  LaunchRmsNormForward(&f, &f, &f, &f, 0, 8, 1e-5f, nullptr);
  LaunchRmsNormBackward(&f, &f, &f, &f, &f, &f, 0, 8, Workspace().data(), nullptr);
  LaunchSwigluForward(&f, &f, &f, 0, nullptr);
  LaunchSwigluBackward(&f, &f, &f, &f, &f, 0, nullptr);
  LaunchRopeGqaForward(&f, &f, &f, &f, &f, 0, 5, 4, 2, 8, nullptr);
  LaunchRopeGqaBackward(&f, &f, &f, &f, &f, 2, 0, 4, 2, 8, nullptr);
  LaunchSoftmaxCrossEntropy<float>(&f, nullptr, &f, &f, &f, 0, 7, nullptr);
  LaunchAdamW<float>(&f, &f, &f, &f, nullptr, nullptr, 0, &f, nullptr, AdamWConfig{}, nullptr);
  EXPECT_EQ(Launches(), before);
  EXPECT_EQ(f, 1.0f);
}

TEST(CudaKernelsEmuTest, SubtractIsExact) {
  for (int offset : {0, 1}) {
    const int n = 1003;
    std::vector<float> a = Random(n + 1, 1), b = Random(n + 1, 2), out(n + 1, 5.0f);
    LaunchSubtract(a.data() + offset, b.data() + offset, out.data() + offset, n, nullptr);
    ExpectLaunchOk();
    for (int i = 0; i < n; ++i) ASSERT_EQ(out[offset + i], a[offset + i] - b[offset + i]) << i;
  }
}

template <typename T>
void CheckBiasResidual(int N, int C, bool with_bias, bool with_residual, bool alias) {
  SCOPED_TRACE(std::string(Name<T>()) + " N=" + std::to_string(N) + " C=" + std::to_string(C) +
               " bias=" + std::to_string(with_bias) + " residual=" + std::to_string(with_residual) +
               " alias=" + std::to_string(alias));
  const std::vector<float> bias = Random(C, 3);
  std::vector<float> residual = Random(static_cast<size_t>(N) * C, 4);
  std::vector<double> ref(residual.size());
  for (int i = 0; i < N; ++i) {
    for (int c = 0; c < C; ++c) {
      ref[i * C + c] = (with_bias ? bias[c] : 0.0) + (with_residual ? residual[i * C + c] : 0.0);
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    if (alias) {
      LaunchBiasResidual<float>(with_bias ? bias.data() : nullptr, residual.data(), residual.data(),
                                N, C, nullptr);
      ExpectLaunchOk();
      ExpectClose(residual, ref, kF32Tol, "out (aliasing residual)");
      return;
    }
  }
  std::vector<T> out(residual.size(), Make<T>(123.0f));
  LaunchBiasResidual<T>(with_bias ? bias.data() : nullptr,
                        with_residual ? residual.data() : nullptr, out.data(), N, C, nullptr);
  ExpectLaunchOk();
  ExpectClose(out, ref, StoreTol<T>(), "out");
}

TEST(CudaKernelsEmuTest, BiasResidualWritesBiasPlusResidual) {
  for (int C : {48, 50}) {
    for (bool b : {false, true}) {
      for (bool r : {false, true}) {
        CheckBiasResidual<float>(37, C, b, r, false);
        CheckBiasResidual<bf16>(37, C, b, r, false);
      }
    }
    CheckBiasResidual<float>(37, C, true, true, true);
    CheckBiasResidual<float>(37, C, false, true, true);
  }
}

// ---- Column sums --------------------------------------------------------------------------

template <typename T>
void CheckColumnSum(int rows, int cols, int offset, int expect_slices) {
  SCOPED_TRACE(std::string(Name<T>()) + " rows=" + std::to_string(rows) +
               " cols=" + std::to_string(cols) + " offset=" + std::to_string(offset));
  const std::vector<T> m = As<T>(Random(static_cast<size_t>(rows) * cols + offset, 5));
  const T* mp = m.data() + offset;
  const ColumnSumPlan plan = PlanColumnSum(rows, cols, offset == 0);
  EXPECT_EQ(plan.slices, expect_slices);
  std::vector<float> out = Random(cols, 6);  // accumulates onto this
  std::vector<double> ref(out.begin(), out.end());
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) ref[c] += F(mp[static_cast<size_t>(r) * cols + c]);
  }
  const int64_t before = Launches();
  LaunchColumnSumAccumulate(mp, out.data(), rows, cols, Workspace().data(), nullptr);
  ExpectLaunchOk();
  EXPECT_EQ(Launches() - before, expect_slices > 1 ? 2 : 1);
  ExpectClose(out, ref, kF32Tol, "out");
}

TEST(CudaKernelsEmuTest, ColumnSumAccumulatesOnePassAndTwoPass) {
  for (int offset : {0, 1}) {
    CheckColumnSum<float>(37, 50, offset, 1);
    CheckColumnSum<bf16>(37, 50, offset, 1);
    CheckColumnSum<float>(37, 48, offset, 1);
    CheckColumnSum<bf16>(37, 48, offset, 1);
    CheckColumnSum<float>(300, 48, offset, 5);
    CheckColumnSum<bf16>(300, 52, offset, 5);
  }
  CheckColumnSum<float>(1000, 333, 0, 16);
}

// ---- Embedding -----------------------------------------------------------------------------

TEST(CudaKernelsEmuTest, EmbeddingForwardAddsTokenAndPositionRows) {
  const int B = 3, Tn = 7, V = 29;
  for (int C : {48, 50}) {
    for (int offset : {0, 1}) {
      SCOPED_TRACE("C=" + std::to_string(C) + " offset=" + std::to_string(offset));
      std::mt19937 rng(7);
      std::vector<int32_t> tokens(B * Tn);
      for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % V);
      const std::vector<float> wte = Random(static_cast<size_t>(V) * C + offset, 8);
      const std::vector<float> wpe = Random(static_cast<size_t>(Tn) * C + offset, 9);
      std::vector<float> out(static_cast<size_t>(B) * Tn * C + offset, 77.0f);
      LaunchEmbeddingForward(tokens.data(), wte.data() + offset, wpe.data() + offset,
                             out.data() + offset, B, Tn, C, nullptr);
      ExpectLaunchOk();
      std::vector<double> ref(static_cast<size_t>(B) * Tn * C);
      for (int i = 0; i < B * Tn; ++i) {
        for (int c = 0; c < C; ++c) {
          ref[i * C + c] =
              static_cast<double>(wte[offset + tokens[i] * C + c]) + wpe[offset + (i % Tn) * C + c];
        }
      }
      ExpectClose(out.data() + offset, ref, kF32Tol, "out");
    }
  }
}

// Counting sort of positions by token, stable (ops.h GroupByToken).
void Group(const std::vector<int32_t>& tokens, int V, std::vector<int32_t>& order,
           std::vector<int32_t>& starts) {
  starts.assign(V + 1, 0);
  for (int32_t t : tokens) ++starts[t + 1];
  for (int v = 0; v < V; ++v) starts[v + 1] += starts[v];
  std::vector<int32_t> next(starts.begin(), starts.end() - 1);
  order.assign(tokens.size(), -1);
  for (size_t i = 0; i < tokens.size(); ++i) order[next[tokens[i]]++] = static_cast<int32_t>(i);
}

void CheckEmbeddingBackward(int B, int Tn, int C, int V, int distinct, bool with_wte, bool with_wpe,
                            int offset) {
  SCOPED_TRACE("B=" + std::to_string(B) + " T=" + std::to_string(Tn) + " C=" + std::to_string(C) +
               " wte=" + std::to_string(with_wte) + " wpe=" + std::to_string(with_wpe) +
               " offset=" + std::to_string(offset));
  std::mt19937 rng(10);
  std::vector<int32_t> tokens(B * Tn);
  // Few distinct tokens, so most repeat; token 1 appears at least 20 times when it can.
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % distinct) * 2;
  for (int i = 0; i < 20 && i < B * Tn; ++i) tokens[(i * 7) % (B * Tn)] = 1;
  std::vector<int32_t> order, starts;
  Group(tokens, V, order, starts);
  const std::vector<float> dout = Random(static_cast<size_t>(B) * Tn * C + offset, 12);
  std::vector<float> dwte = Random(static_cast<size_t>(V) * C + offset, 13);
  std::vector<float> dwpe = Random(static_cast<size_t>(Tn) * C + offset, 14);
  std::vector<double> ref_wte(dwte.begin() + offset, dwte.end());
  std::vector<double> ref_wpe(dwpe.begin() + offset, dwpe.end());
  for (int i = 0; i < B * Tn; ++i) {
    for (int c = 0; c < C; ++c) {
      const double d = dout[offset + i * C + c];
      if (with_wte) ref_wte[tokens[i] * C + c] += d;
      if (with_wpe) ref_wpe[(i % Tn) * C + c] += d;
    }
  }
  LaunchEmbeddingBackward(dout.data() + offset, order.data(), starts.data(),
                          with_wte ? dwte.data() + offset : nullptr,
                          with_wpe ? dwpe.data() + offset : nullptr, B, Tn, C, V, nullptr);
  ExpectLaunchOk();
  ExpectClose(dwte.data() + offset, ref_wte, kF32Tol, "dwte");
  ExpectClose(dwpe.data() + offset, ref_wpe, kF32Tol, "dwpe");
}

TEST(CudaKernelsEmuTest, EmbeddingBackwardAccumulatesRepeatedTokens) {
  for (int C : {48, 50}) {
    for (int offset : {0, 1}) {
      CheckEmbeddingBackward(3, 13, C, 29, 5, true, true, offset);
    }
    CheckEmbeddingBackward(3, 13, C, 29, 5, true, false, 0);
    CheckEmbeddingBackward(3, 13, C, 29, 5, false, true, 0);
  }
  CheckEmbeddingBackward(2, 100, 200, 40, 3, true, true, 0);  // several channel tiles
}

// ---- Layer norm -----------------------------------------------------------------------------

struct LnData {
  std::vector<float> x, w, b;
};

LnData MakeLn(int N, int C, float center, uint32_t seed) {
  LnData d;
  d.x = Random(static_cast<size_t>(N) * C, seed, center - 2.0f, center + 2.0f);
  d.w = Random(C, seed + 1, 0.5f, 1.5f);
  d.b = Random(C, seed + 2);
  return d;
}

void LnStats(const float* x, int C, double& mu, double& rs) {
  double s = 0;
  for (int c = 0; c < C; ++c) s += x[c];
  mu = s / C;
  double v = 0;
  for (int c = 0; c < C; ++c) v += (x[c] - mu) * (x[c] - mu);
  rs = 1.0 / std::sqrt(v / C + 1e-5);
}

template <typename Tout>
void CheckLayerNormForward(int N, int C, float center, bool aligned, int expect_cache) {
  SCOPED_TRACE(std::string(Name<Tout>()) + " N=" + std::to_string(N) + " C=" + std::to_string(C) +
               " center=" + std::to_string(center) + " aligned=" + std::to_string(aligned));
  EXPECT_EQ(detail::LayerNormCache(C, aligned), expect_cache);
  const int off = aligned ? 0 : 1;
  LnData d = MakeLn(N, C, center, 20);
  d.x.insert(d.x.begin(), off, 0.0f);
  std::vector<Tout> out(static_cast<size_t>(N) * C + off, Make<Tout>(9.0f));
  std::vector<float> mean(N, 9.0f), rstd(N, 9.0f);
  LaunchLayerNormForward(d.x.data() + off, d.w.data(), d.b.data(), out.data() + off, mean.data(),
                         rstd.data(), N, C, nullptr);
  ExpectLaunchOk();
  std::vector<double> ref(static_cast<size_t>(N) * C), ref_mean(N), ref_rstd(N);
  for (int i = 0; i < N; ++i) {
    const float* xi = d.x.data() + off + static_cast<size_t>(i) * C;
    LnStats(xi, C, ref_mean[i], ref_rstd[i]);
    for (int c = 0; c < C; ++c) {
      ref[i * C + c] = (xi[c] - ref_mean[i]) * ref_rstd[i] * d.w[c] + d.b[c];
    }
  }
  ExpectClose(out.data() + off, ref, StoreTol<Tout>(), "out");
  ExpectClose(mean, ref_mean, kF32Tol, "mean");
  ExpectClose(rstd, ref_rstd, kF32Tol, "rstd");
}

TEST(CudaKernelsEmuTest, LayerNormForwardEveryPath) {
  for (float center : {0.0f, 300.0f}) {  // 300: E[x^2] - E[x]^2 would cancel badly
    CheckLayerNormForward<float>(37, 48, center, true, 2);
    CheckLayerNormForward<bf16>(37, 48, center, true, 2);
    CheckLayerNormForward<float>(37, 48, center, false, 0);
    CheckLayerNormForward<float>(37, 50, center, true, 0);
    CheckLayerNormForward<bf16>(37, 50, center, true, 0);
  }
  CheckLayerNormForward<float>(5, 300, 1.0f, true, 8);
  CheckLayerNormForward<bf16>(5, 1500, 1.0f, true, 16);
  CheckLayerNormForward<float>(3, 2052, 1.0f, true, 0);
}

template <typename Tin>
void CheckLayerNormBackward(int N, int C, bool with_dx, bool with_dw, bool with_db, bool aligned,
                            int expect_slices, int expect_launches) {
  SCOPED_TRACE(std::string(Name<Tin>()) + " N=" + std::to_string(N) + " C=" + std::to_string(C) +
               " dx=" + std::to_string(with_dx) + " dw=" + std::to_string(with_dw) +
               " db=" + std::to_string(with_db) + " aligned=" + std::to_string(aligned));
  const int off = aligned ? 0 : 1;
  const LnData d = MakeLn(N, C, 0.5f, 30);
  std::vector<double> mu(N), rs(N);
  std::vector<float> mean(N), rstd(N);
  for (int i = 0; i < N; ++i) {
    LnStats(d.x.data() + static_cast<size_t>(i) * C, C, mu[i], rs[i]);
    mean[i] = static_cast<float>(mu[i]);
    rstd[i] = static_cast<float>(rs[i]);
  }
  std::vector<Tin> dout = As<Tin>(Random(static_cast<size_t>(N) * C + off, 31));
  std::vector<float> dx = Random(static_cast<size_t>(N) * C, 32);
  std::vector<float> dw = Random(C, 33), db = Random(C, 34);
  std::vector<double> ref_dx(dx.begin(), dx.end()), ref_dw(dw.begin(), dw.end()),
      ref_db(db.begin(), db.end());
  for (int i = 0; i < N; ++i) {
    const Tin* di = dout.data() + off + static_cast<size_t>(i) * C;
    const float* xi = d.x.data() + static_cast<size_t>(i) * C;
    double g_sum = 0, gx_sum = 0;
    for (int c = 0; c < C; ++c) {
      const double g = static_cast<double>(F(di[c])) * d.w[c];
      const double xhat = (xi[c] - static_cast<double>(mean[i])) * rstd[i];
      g_sum += g;
      gx_sum += g * xhat;
      ref_dw[c] += F(di[c]) * xhat;
      ref_db[c] += F(di[c]);
    }
    for (int c = 0; c < C; ++c) {
      const double xhat = (xi[c] - static_cast<double>(mean[i])) * rstd[i];
      ref_dx[i * C + c] +=
          rstd[i] * (F(di[c]) * static_cast<double>(d.w[c]) - g_sum / C - xhat * gx_sum / C);
    }
  }
  const bool want_acc = with_dw || with_db;
  const LayerNormBackwardPlan plan = PlanLayerNormBackward(N, C, want_acc);
  EXPECT_EQ(plan.slices, expect_slices);
  const std::vector<float> dx0 = dx, dw0 = dw, db0 = db;
  const int64_t before = Launches();
  LaunchLayerNormBackward(dout.data() + off, d.x.data(), d.w.data(), mean.data(), rstd.data(),
                          with_dx ? dx.data() : nullptr, with_dw ? dw.data() : nullptr,
                          with_db ? db.data() : nullptr, N, C, Workspace().data(), nullptr);
  ExpectLaunchOk();
  EXPECT_EQ(Launches() - before, expect_launches);
  if (with_dx) {
    ExpectClose(dx, ref_dx, kF32Tol, "dx");
  } else {
    EXPECT_EQ(dx, dx0);
  }
  if (with_dw) {
    ExpectClose(dw, ref_dw, kF32Tol, "dw");
  } else {
    EXPECT_EQ(dw, dw0);
  }
  if (with_db) {
    ExpectClose(db, ref_db, kF32Tol, "db");
  } else {
    EXPECT_EQ(db, db0);
  }
}

TEST(CudaKernelsEmuTest, LayerNormBackwardAccumulatesEveryPath) {
  // 37 rows over 8 warps a block: 5 blocks, partial sums and a second pass.
  for (int C : {48, 50}) {
    CheckLayerNormBackward<float>(37, C, true, true, true, true, 5, 2);
    CheckLayerNormBackward<bf16>(37, C, true, true, true, true, 5, 2);
    CheckLayerNormBackward<float>(37, C, true, true, true, false, 5, 2);
    CheckLayerNormBackward<float>(37, C, true, false, false, true, 0, 1);
    CheckLayerNormBackward<float>(37, C, false, true, false, true, 5, 2);
    CheckLayerNormBackward<bf16>(37, C, false, false, true, true, 5, 2);
    CheckLayerNormBackward<float>(6, C, true, true, true, true, 0, 1);  // one block, one pass
  }
  CheckLayerNormBackward<float>(20, 300, true, true, true, true, 3, 2);   // 8 warps, cache 8
  CheckLayerNormBackward<bf16>(5, 1500, true, true, true, true, 2, 2);    // 4 warps, cache 16
  CheckLayerNormBackward<float>(3, 7000, true, true, true, true, 3, 2);   // 1 warp, > 48 KiB smem
  CheckLayerNormBackward<float>(3, 30001, true, true, true, true, 8, 2);  // global accumulators
}

// ---- GELU -------------------------------------------------------------------------------------

double GeluRef(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}
double GeluGradRef(double x) {
  const double k = std::sqrt(2 / M_PI);
  const double t = std::tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x);
}

template <typename T>
void CheckGelu(int n, int offset, bool in_place) {
  SCOPED_TRACE(std::string(Name<T>()) + " n=" + std::to_string(n) +
               " offset=" + std::to_string(offset) + " in_place=" + std::to_string(in_place));
  std::vector<T> x = As<T>(Random(n + offset, 40, -6.0f, 6.0f));
  std::vector<T> dout = As<T>(Random(n + offset, 41));
  std::vector<double> ref_y(n), ref_dx(n);
  for (int i = 0; i < n; ++i) {
    ref_y[i] = GeluRef(F(x[offset + i]));
    ref_dx[i] = F(dout[offset + i]) * GeluGradRef(F(x[offset + i]));
  }
  // Backward first (it needs x); dx written over garbage or over dout itself.
  std::vector<T> dx(n + offset, Make<T>(55.0f));
  T* dx_ptr = in_place ? dout.data() + offset : dx.data() + offset;
  LaunchGeluBackward(dout.data() + offset, x.data() + offset, dx_ptr, n, nullptr);
  ExpectLaunchOk();
  ExpectClose(dx_ptr, ref_dx, StoreTol<T>(), "dx");
  std::vector<T> y(n + offset, Make<T>(55.0f));
  T* y_ptr = in_place ? x.data() + offset : y.data() + offset;
  LaunchGeluForward(x.data() + offset, y_ptr, n, nullptr);
  ExpectLaunchOk();
  ExpectClose(y_ptr, ref_y, StoreTol<T>(), "y");
}

TEST(CudaKernelsEmuTest, GeluForwardAndBackward) {
  for (int offset : {0, 1}) {
    for (bool in_place : {false, true}) {
      CheckGelu<float>(1000, offset, in_place);
      CheckGelu<bf16>(1000, offset, in_place);
      CheckGelu<float>(1001, offset, in_place);
    }
  }
}

// ---- The Llama family: RMS norm, SwiGLU, RoPE with grouped-query heads ----------------------

template <typename Tout>
void CheckRmsNormForward(int N, int C, int offset) {
  SCOPED_TRACE(std::string(Name<Tout>()) + " N=" + std::to_string(N) + " C=" + std::to_string(C) +
               " offset=" + std::to_string(offset));
  const float eps = 1e-6f;
  const std::vector<float> x = Random(static_cast<size_t>(N) * C + offset, 50, -2.0f, 2.0f);
  const std::vector<float> w = Random(C, 51, 0.5f, 1.5f);
  std::vector<Tout> out(static_cast<size_t>(N) * C + offset, Make<Tout>(9.0f));
  std::vector<float> rstd(N, 9.0f);
  LaunchRmsNormForward(x.data() + offset, w.data(), out.data() + offset, rstd.data(), N, C, eps,
                       nullptr);
  ExpectLaunchOk();
  std::vector<double> ref(static_cast<size_t>(N) * C), ref_rstd(N);
  for (int i = 0; i < N; ++i) {
    const float* xi = x.data() + offset + static_cast<size_t>(i) * C;
    double ms = 0;
    for (int c = 0; c < C; ++c) ms += static_cast<double>(xi[c]) * xi[c];
    ref_rstd[i] = 1.0 / std::sqrt(ms / C + eps);
    for (int c = 0; c < C; ++c) ref[i * C + c] = xi[c] * ref_rstd[i] * w[c];
  }
  ExpectClose(out.data() + offset, ref, StoreTol<Tout>(), "out");
  ExpectClose(rstd, ref_rstd, kF32Tol, "rstd");
}

TEST(CudaKernelsEmuTest, RmsNormForward) {
  for (int offset : {0, 1}) {
    for (int C : {8, 48, 50, 300}) {  // 32 to 256 threads, one or several columns each
      CheckRmsNormForward<float>(7, C, offset);
      CheckRmsNormForward<bf16>(7, C, offset);
    }
  }
  CheckRmsNormForward<float>(3, 1500, 0);
}

template <typename Tin>
void CheckRmsNormBackward(int N, int C, bool with_dx, bool with_dw, int expect_launches) {
  SCOPED_TRACE(std::string(Name<Tin>()) + " N=" + std::to_string(N) + " C=" + std::to_string(C) +
               " dx=" + std::to_string(with_dx) + " dw=" + std::to_string(with_dw));
  const std::vector<float> x = Random(static_cast<size_t>(N) * C, 52, -2.0f, 2.0f);
  const std::vector<float> w = Random(C, 53, 0.5f, 1.5f);
  std::vector<float> rstd(N);
  for (int i = 0; i < N; ++i) {
    double ms = 0;
    for (int c = 0; c < C; ++c) ms += static_cast<double>(x[i * C + c]) * x[i * C + c];
    rstd[i] = static_cast<float>(1.0 / std::sqrt(ms / C + 1e-5));
  }
  const std::vector<Tin> dout = As<Tin>(Random(static_cast<size_t>(N) * C, 54));
  std::vector<float> dx = Random(static_cast<size_t>(N) * C, 55), dw = Random(C, 56);
  std::vector<double> ref_dx(dx.begin(), dx.end()), ref_dw(dw.begin(), dw.end());
  for (int i = 0; i < N; ++i) {
    double gx = 0;
    for (int c = 0; c < C; ++c) {
      const double xhat = static_cast<double>(x[i * C + c]) * rstd[i];
      gx += F(dout[i * C + c]) * static_cast<double>(w[c]) * xhat;
      ref_dw[c] += F(dout[i * C + c]) * xhat;
    }
    for (int c = 0; c < C; ++c) {
      const double xhat = static_cast<double>(x[i * C + c]) * rstd[i];
      ref_dx[i * C + c] +=
          rstd[i] * (F(dout[i * C + c]) * static_cast<double>(w[c]) - xhat * gx / C);
    }
  }
  const std::vector<float> dx0 = dx, dw0 = dw;
  const int64_t before = Launches();
  LaunchRmsNormBackward(dout.data(), x.data(), w.data(), rstd.data(), with_dx ? dx.data() : nullptr,
                        with_dw ? dw.data() : nullptr, N, C, Workspace().data(), nullptr);
  ExpectLaunchOk();
  EXPECT_EQ(Launches() - before, expect_launches);
  if (with_dx) {
    ExpectClose(dx, ref_dx, kF32Tol, "dx (accumulated)");
  } else {
    EXPECT_EQ(dx, dx0);
  }
  if (with_dw) {
    ExpectClose(dw, ref_dw, kF32Tol, "dweight (accumulated)");
  } else {
    EXPECT_EQ(dw, dw0);
  }
}

TEST(CudaKernelsEmuTest, RmsNormBackwardAccumulatesOnePassAndTwoPass) {
  for (int C : {48, 50}) {
    CheckRmsNormBackward<float>(37, C, true, true, 2);  // dweight in one slice
    CheckRmsNormBackward<bf16>(37, C, true, true, 2);
    CheckRmsNormBackward<float>(37, C, true, false, 1);
    CheckRmsNormBackward<bf16>(37, C, false, true, 1);
    CheckRmsNormBackward<float>(300, C, true, true, 3);  // 5 slices and a second pass
    CheckRmsNormBackward<bf16>(300, C, false, true, 2);
  }
  CheckRmsNormBackward<float>(5, 700, true, true, 2);
}

double SiluRef(double g) { return g / (1.0 + std::exp(-g)); }

template <typename T>
void CheckSwiglu(int n, int offset, bool in_place) {
  SCOPED_TRACE(std::string(Name<T>()) + " n=" + std::to_string(n) +
               " offset=" + std::to_string(offset) + " in_place=" + std::to_string(in_place));
  std::vector<T> gate = As<T>(Random(n + offset, 60, -8.0f, 8.0f));
  std::vector<T> up = As<T>(Random(n + offset, 61));
  const std::vector<T> dout = As<T>(Random(n + offset, 62));
  std::vector<double> ref_y(n), ref_dg(n), ref_du(n);
  for (int i = 0; i < n; ++i) {
    const double g = F(gate[offset + i]), u = F(up[offset + i]), d = F(dout[offset + i]);
    const double sig = 1.0 / (1.0 + std::exp(-g));
    ref_y[i] = SiluRef(g) * u;
    ref_dg[i] = d * u * sig * (1.0 + g * (1.0 - sig));
    ref_du[i] = d * SiluRef(g);
  }
  std::vector<T> y(n + offset, Make<T>(55.0f));
  LaunchSwigluForward(gate.data() + offset, up.data() + offset, y.data() + offset, n, nullptr);
  ExpectLaunchOk();
  ExpectClose(y.data() + offset, ref_y, StoreTol<T>(), "out");
  // dgate and dup written over garbage, or over gate and up themselves.
  std::vector<T> dg(n + offset, Make<T>(55.0f)), du(n + offset, Make<T>(56.0f));
  T* dg_ptr = in_place ? gate.data() + offset : dg.data() + offset;
  T* du_ptr = in_place ? up.data() + offset : du.data() + offset;
  LaunchSwigluBackward(dout.data() + offset, gate.data() + offset, up.data() + offset, dg_ptr,
                       du_ptr, n, nullptr);
  ExpectLaunchOk();
  ExpectClose(dg_ptr, ref_dg, StoreTol<T>(), "dgate");
  ExpectClose(du_ptr, ref_du, StoreTol<T>(), "dup");
}

TEST(CudaKernelsEmuTest, SwigluForwardAndBackward) {
  for (int offset : {0, 1}) {
    for (bool in_place : {false, true}) {
      CheckSwiglu<float>(1000, offset, in_place);
      CheckSwiglu<bf16>(1000, offset, in_place);
      CheckSwiglu<float>(1001, offset, in_place);
    }
  }
}

// cos, then sin, of the D/2 angles t * 10000^(-2i/D).
std::vector<float> RopeTable(int Tn, int D) {
  std::vector<float> rope(static_cast<size_t>(Tn) * D);
  for (int t = 0; t < Tn; ++t) {
    for (int i = 0; i < D / 2; ++i) {
      const double angle = t * std::pow(10000.0, -2.0 * i / D);
      rope[t * D + i] = static_cast<float>(std::cos(angle));
      rope[t * D + D / 2 + i] = static_cast<float>(std::sin(angle));
    }
  }
  return rope;
}

template <typename T>
void CheckRopeGqa(int B, int Tn, int H, int Hkv, int D) {
  SCOPED_TRACE(std::string(Name<T>()) + " B=" + std::to_string(B) + " T=" + std::to_string(Tn) +
               " H=" + std::to_string(H) + " Hkv=" + std::to_string(Hkv) +
               " D=" + std::to_string(D));
  const int N = B * Tn, half = D / 2, group = H / Hkv;
  const size_t qd = static_cast<size_t>(H) * D, kd = static_cast<size_t>(Hkv) * D;
  const std::vector<float> rope = RopeTable(Tn + 3, D);  // more rows than T: only T are read
  const std::vector<T> q = As<T>(Random(N * qd, 70)), k = As<T>(Random(N * kd, 71));
  const std::vector<T> v = As<T>(Random(N * kd, 72)), g = As<T>(Random(3 * N * qd, 73));
  std::vector<double> ref(3 * N * qd), ref_dq(N * qd), ref_dk(N * kd, 0.0), ref_dv(N * kd, 0.0);
  for (int row = 0; row < N; ++row) {
    const float* cs = rope.data() + static_cast<size_t>(row % Tn) * D;
    for (int h = 0; h < H; ++h) {
      const int kh = h / group;
      for (int i = 0; i < half; ++i) {
        const double c = cs[i], s = cs[half + i];
        const size_t qa = row * qd + h * D + i, ka = row * kd + kh * D + i;
        const size_t o = row * 3 * qd + h * D + i;
        ref[o] = F(q[qa]) * c - F(q[qa + half]) * s;
        ref[o + half] = F(q[qa + half]) * c + F(q[qa]) * s;
        ref[o + qd] = F(k[ka]) * c - F(k[ka + half]) * s;
        ref[o + qd + half] = F(k[ka + half]) * c + F(k[ka]) * s;
        ref[o + 2 * qd] = F(v[ka]);
        ref[o + 2 * qd + half] = F(v[ka + half]);
        // The transpose of each map.
        const double g0 = F(g[o]), g1 = F(g[o + half]);
        ref_dq[qa] = g0 * c + g1 * s;
        ref_dq[qa + half] = g1 * c - g0 * s;
        const double k0 = F(g[o + qd]), k1 = F(g[o + qd + half]);
        ref_dk[ka] += k0 * c + k1 * s;
        ref_dk[ka + half] += k1 * c - k0 * s;
        ref_dv[ka] += F(g[o + 2 * qd]);
        ref_dv[ka + half] += F(g[o + 2 * qd + half]);
      }
    }
  }
  std::vector<T> qkv(3 * N * qd, Make<T>(55.0f));
  LaunchRopeGqaForward(q.data(), k.data(), v.data(), rope.data(), qkv.data(), B, Tn, H, Hkv, D,
                       nullptr);
  ExpectLaunchOk();
  ExpectClose(qkv, ref, StoreTol<T>(), "qkv");
  std::vector<T> dq(N * qd, Make<T>(55.0f)), dk(N * kd, Make<T>(56.0f)), dv(N * kd, Make<T>(57.0f));
  LaunchRopeGqaBackward(g.data(), rope.data(), dq.data(), dk.data(), dv.data(), B, Tn, H, Hkv, D,
                        nullptr);
  ExpectLaunchOk();
  ExpectClose(dq, ref_dq, StoreTol<T>(), "dq");
  ExpectClose(dk, ref_dk, StoreTol<T>(), "dk");
  ExpectClose(dv, ref_dv, StoreTol<T>(), "dv");
}

TEST(CudaKernelsEmuTest, RopeGqaForwardAndBackward) {
  for (auto [H, Hkv] : {std::pair{4, 2}, std::pair{4, 4}, std::pair{4, 1}}) {
    CheckRopeGqa<float>(2, 5, H, Hkv, 8);
    CheckRopeGqa<bf16>(2, 5, H, Hkv, 8);
  }
  CheckRopeGqa<float>(2, 37, 6, 2, 64);  // several blocks, the last one partial
  CheckRopeGqa<bf16>(1, 9, 3, 3, 6);     // D/2 odd
}

TEST(CudaKernelsEmuTest, EmbeddingForwardWithoutPositionTable) {
  const int B = 3, Tn = 7, V = 29;
  for (int C : {48, 50}) {
    for (int offset : {0, 1}) {
      SCOPED_TRACE("C=" + std::to_string(C) + " offset=" + std::to_string(offset));
      std::vector<int32_t> tokens(B * Tn);
      for (int i = 0; i < B * Tn; ++i) tokens[i] = (i * 11) % V;
      const std::vector<float> wte = Random(static_cast<size_t>(V) * C + offset, 8);
      std::vector<float> out(static_cast<size_t>(B) * Tn * C + offset, 77.0f);
      LaunchEmbeddingForward(tokens.data(), wte.data() + offset, nullptr, out.data() + offset, B,
                             Tn, C, nullptr);
      ExpectLaunchOk();
      for (int i = 0; i < B * Tn; ++i) {
        for (int c = 0; c < C; ++c) {
          ASSERT_EQ(out[offset + i * C + c], wte[offset + tokens[i] * C + c]) << i << "," << c;
        }
      }
    }
  }
}

// ---- Softmax cross-entropy ------------------------------------------------------------------

template <typename T>
void CheckCrossEntropy(int N, int V, bool with_dlogits, bool alias, int offset) {
  SCOPED_TRACE(std::string(Name<T>()) + " N=" + std::to_string(N) + " V=" + std::to_string(V) +
               " dlogits=" + std::to_string(with_dlogits) + " alias=" + std::to_string(alias) +
               " offset=" + std::to_string(offset));
  std::vector<T> logits = As<T>(Random(static_cast<size_t>(N) * V + offset, 50, -8.0f, 8.0f));
  std::mt19937 rng(51);
  std::vector<int32_t> targets(N);
  for (int i = 0; i < N; ++i) targets[i] = i % 5 == 2 ? -1 : static_cast<int32_t>(rng() % V);
  targets[0] = V - 1;
  if (N > 1) targets[1] = 0;
  const float dloss = 1.0f / 3.0f;
  std::vector<double> ref_loss(N), ref_d(static_cast<size_t>(N) * V, 0.0);
  for (int i = 0; i < N; ++i) {
    if (targets[i] < 0) continue;
    const T* li = logits.data() + offset + static_cast<size_t>(i) * V;
    double mx = -1e300;
    for (int j = 0; j < V; ++j) mx = std::max<double>(mx, F(li[j]));
    double s = 0;
    for (int j = 0; j < V; ++j) s += std::exp(F(li[j]) - mx);
    ref_loss[i] = std::log(s) + mx - F(li[targets[i]]);
    for (int j = 0; j < V; ++j) {
      ref_d[i * V + j] = (std::exp(F(li[j]) - mx) / s - (j == targets[i] ? 1 : 0)) * dloss;
    }
  }
  std::vector<float> losses(N, 42.0f);
  std::vector<T> dlogits(static_cast<size_t>(N) * V + offset, Make<T>(42.0f));
  T* d_ptr = !with_dlogits ? nullptr : alias ? logits.data() + offset : dlogits.data() + offset;
  LaunchSoftmaxCrossEntropy(logits.data() + offset, targets.data(), losses.data(), d_ptr, &dloss, N,
                            V, nullptr);
  ExpectLaunchOk();
  ExpectClose(losses, ref_loss, kF32Tol, "losses");
  if (with_dlogits) ExpectClose(d_ptr, ref_d, StoreTol<T>(), "dlogits");
  for (int i = 0; i < N; ++i) {
    if (targets[i] < 0) {
      EXPECT_EQ(losses[i], 0.0f) << i;
    }
  }
}

TEST(CudaKernelsEmuTest, SoftmaxCrossEntropyWarpAndBlockPaths) {
  for (int V : {29, 48, 1}) {
    for (int offset : {0, 1}) {
      CheckCrossEntropy<float>(37, V, true, false, offset);
      CheckCrossEntropy<bf16>(37, V, true, false, offset);
      CheckCrossEntropy<float>(37, V, true, true, offset);
      CheckCrossEntropy<bf16>(37, V, true, true, offset);
    }
    CheckCrossEntropy<float>(37, V, false, false, 0);
  }
  for (int V : {1500, 1501}) {  // a block per row
    CheckCrossEntropy<float>(5, V, true, false, 0);
    CheckCrossEntropy<bf16>(5, V, true, true, 0);
    CheckCrossEntropy<float>(5, V, false, false, 0);
  }
}

TEST(CudaKernelsEmuTest, SoftmaxCrossEntropyExtremeLogits) {
  // Large logits (the online max must rescale), -inf entries and an ignored row.
  const int N = 3, V = 40;
  std::vector<float> logits(N * V);
  for (int j = 0; j < V; ++j) {
    logits[j] = 80.0f + j;                      // row 0: increasing, rescales at every step
    logits[V + j] = j == 7 ? 0.0f : -INFINITY;  // row 1: all mass on 7
    logits[2 * V + j] = 1.0f;                   // row 2: ignored
  }
  const std::vector<int32_t> targets = {3, 7, -1};
  std::vector<float> losses(N, 5.0f), d(N * V, 5.0f);
  const float dloss = 1.0f;
  LaunchSoftmaxCrossEntropy<float>(logits.data(), targets.data(), losses.data(), d.data(), &dloss,
                                   N, V, nullptr);
  ExpectLaunchOk();
  double s = 0;
  for (int j = 0; j < V; ++j) s += std::exp(j - (V - 1.0));
  EXPECT_NEAR(losses[0], std::log(s) + (V - 1.0) - 3.0, 1e-5);
  EXPECT_EQ(losses[1], 0.0f);
  EXPECT_EQ(losses[2], 0.0f);
  for (int j = 0; j < V; ++j) {
    EXPECT_EQ(d[V + j], 0.0f) << j;  // softmax is exactly one-hot at the target
    EXPECT_EQ(d[2 * V + j], 0.0f) << j;
  }
}

// ---- SumSquares -----------------------------------------------------------------------------

TEST(CudaKernelsEmuTest, SumSquaresOneAndTwoStages) {
  for (int64_t n :
       {int64_t{0}, int64_t{1}, int64_t{1000}, int64_t{1003}, int64_t{20000}, int64_t{100001}}) {
    for (int offset : {0, 1}) {
      SCOPED_TRACE("n=" + std::to_string(n) + " offset=" + std::to_string(offset));
      const std::vector<float> x = Random(n + offset, 60);
      double ref = 0;
      for (int64_t i = 0; i < n; ++i) ref += static_cast<double>(x[offset + i]) * x[offset + i];
      float out = -1.0f;
      const int64_t before = Launches();
      LaunchSumSquares(x.data() + offset, n, &out, Workspace().data(), nullptr);
      ExpectLaunchOk();
      EXPECT_EQ(Launches() - before, SumSquaresBlocks(n) > 1 ? 2 : 1);
      EXPECT_NEAR(out, ref, kF32Tol * ref);
      float again = -1.0f;
      LaunchSumSquares(x.data() + offset, n, &again, Workspace().data(), nullptr);
      EXPECT_EQ(again, out);  // deterministic
    }
  }
  EXPECT_GT(SumSquaresBlocks(100001), 1);
}

// ---- AdamW ----------------------------------------------------------------------------------

struct AdamWCase {
  std::vector<float> param, grad, m, v;
  std::vector<AdamWChunk> chunks;
};

// Three segments with gaps between them (untouched) and offsets that are not all
// multiples of 4; the first is longer than one chunk's per-block share.
AdamWCase MakeAdamW(bool zero_state) {
  AdamWCase c;
  const int n = 2600;
  c.param = Random(n, 70);
  c.grad = Random(n, 71, -0.5f, 0.5f);
  c.m = zero_state ? std::vector<float>(n, 0.0f) : Random(n, 72, -0.1f, 0.1f);
  c.v = zero_state ? std::vector<float>(n, 0.0f) : Random(n, 73, 0.0f, 0.02f);
  if (zero_state) std::fill(c.grad.begin(), c.grad.end(), 0.0f);
  c.chunks = {{0, 1000, 1}, {1001, 37, 0}, {1040, 1500, 1}, {2541, 59, 1}};
  return c;
}

template <typename Tcopy>
void CheckAdamW(float sumsq, float clip, bool zero_state, bool with_copy) {
  SCOPED_TRACE(std::string(Name<Tcopy>()) + " sumsq=" + std::to_string(sumsq) +
               " clip=" + std::to_string(clip) + " zero_state=" + std::to_string(zero_state) +
               " copy=" + std::to_string(with_copy));
  AdamWCase c = MakeAdamW(zero_state);
  const AdamWCase before = c;
  AdamWConfig config;
  config.beta1 = 0.9f;
  config.beta2 = 0.95f;
  config.eps = 1e-8f;
  config.weight_decay = 0.1f;
  config.grad_clip = clip;
  const AdamWScalars scalars{3e-2f, 1.0f - std::pow(0.9f, 3.0f), 1.0f - std::pow(0.95f, 3.0f),
                             0.0f};
  const size_t n = c.param.size();
  std::vector<Tcopy> copy(n, Make<Tcopy>(-3.0f));
  LaunchAdamW<Tcopy>(c.param.data(), c.grad.data(), c.m.data(), c.v.data(),
                     with_copy ? copy.data() : nullptr, c.chunks.data(),
                     static_cast<int>(c.chunks.size()), &sumsq, &scalars, config, nullptr);
  ExpectLaunchOk();
  if (!std::isfinite(sumsq)) {
    EXPECT_EQ(c.param, before.param);
    EXPECT_EQ(c.m, before.m);
    EXPECT_EQ(c.v, before.v);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(F(copy[i]), -3.0f) << i;
    return;
  }
  const double norm = std::sqrt(double{sumsq});
  const double scale = clip > 0 && norm > clip ? clip / (norm + 1e-6) : 1.0;
  std::vector<double> ref_p = ToDouble(before.param), ref_m = ToDouble(before.m),
                      ref_v = ToDouble(before.v);
  std::vector<bool> touched(n, false);
  for (const AdamWChunk& ch : c.chunks) {
    for (int j = 0; j < ch.count; ++j) {
      const size_t i = ch.offset + j;
      touched[i] = true;
      const double g = before.grad[i] * scale;
      ref_m[i] = config.beta1 * ref_m[i] + (1.0 - config.beta1) * g;
      ref_v[i] = config.beta2 * ref_v[i] + (1.0 - config.beta2) * g * g;
      const double m_hat = ref_m[i] / scalars.bias_correction1;
      const double v_hat = ref_v[i] / scalars.bias_correction2;
      const double wd = ch.decay ? config.weight_decay : 0.0;
      ref_p[i] -= scalars.lr * (m_hat / (std::sqrt(v_hat) + config.eps) + wd * ref_p[i]);
    }
  }
  ExpectClose(c.param, ref_p, kF32Tol, "param");
  ExpectClose(c.m, ref_m, kF32Tol, "m");
  ExpectClose(c.v, ref_v, kF32Tol, "v");
  for (size_t i = 0; i < n; ++i) {
    if (!touched[i]) {
      ASSERT_EQ(c.param[i], before.param[i]) << i;
      ASSERT_EQ(F(copy[i]), -3.0f) << i;
    } else if (with_copy) {
      ASSERT_EQ(F(copy[i]), F(Make<Tcopy>(c.param[i]))) << i;  // the new param, converted
    }
  }
  if (zero_state) {
    // No gradient and no moments: only decay moves parameters, and only in decay chunks.
    for (int j = 0; j < 37; ++j) ASSERT_EQ(c.param[1001 + j], before.param[1001 + j]) << j;
    for (int j = 0; j < 1000; ++j) {
      ASSERT_NEAR(c.param[j], before.param[j] * (1 - 3e-2 * 0.1), 1e-6) << j;
    }
  }
}

TEST(CudaKernelsEmuTest, AdamWStepClipSkipDecayAndCopy) {
  for (float sumsq : {0.25f, 400.0f}) {  // below and above the clip bound
    CheckAdamW<float>(sumsq, 1.0f, false, true);
    CheckAdamW<bf16>(sumsq, 1.0f, false, true);
  }
  CheckAdamW<float>(400.0f, 0.0f, false, false);  // clipping off
  CheckAdamW<bf16>(400.0f, 0.0f, false, false);
  CheckAdamW<float>(4.0f, 1.0f, true, true);  // decay only
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), INFINITY, -INFINITY}) {
    CheckAdamW<float>(bad, 1.0f, false, true);
    CheckAdamW<bf16>(bad, 1.0f, false, true);
  }
}

TEST(CudaKernelsEmuTest, AdamWUnalignedBuffersTakeTheScalarPath) {
  AdamWCase c = MakeAdamW(false);
  AdamWCase a = c;
  for (auto* v : {&a.param, &a.grad, &a.m, &a.v}) v->insert(v->begin(), 0.0f);
  const AdamWScalars scalars{1e-2f, 0.1f, 0.05f, 0.0f};
  const float sumsq = 2.0f;
  AdamWConfig config;
  config.weight_decay = 0.1f;
  LaunchAdamW<float>(c.param.data(), c.grad.data(), c.m.data(), c.v.data(), nullptr,
                     c.chunks.data(), static_cast<int>(c.chunks.size()), &sumsq, &scalars, config,
                     nullptr);
  LaunchAdamW<float>(a.param.data() + 1, a.grad.data() + 1, a.m.data() + 1, a.v.data() + 1, nullptr,
                     c.chunks.data(), static_cast<int>(c.chunks.size()), &sumsq, &scalars, config,
                     nullptr);
  ExpectLaunchOk();
  // The same arithmetic element by element, whichever path.
  for (size_t i = 0; i < c.param.size(); ++i) {
    ASSERT_EQ(c.param[i], a.param[i + 1]) << i;
    ASSERT_EQ(c.m[i], a.m[i + 1]) << i;
    ASSERT_EQ(c.v[i], a.v[i + 1]) << i;
  }
}

// The sharded optimizer's launch (ZeRO-1): each part [lo, hi) with moments of its own,
// counted from lo, gives the whole buffer's parameters and moments exactly. The parts
// include a start that is not a multiple of 4 (its moments then take the scalar path while
// the parameters could take packs) and an empty one.
TEST(CudaKernelsEmuTest, AdamWPartsWithTheirOwnMomentsMatchTheWholeBuffer) {
  const std::vector<AdamWSegment> segments = {
      {0, 1000, true}, {1001, 37, false}, {1040, 1500, true}, {2541, 59, true}};
  const AdamWScalars scalars{1e-2f, 0.1f, 0.05f, 0.0f};
  const float sumsq = 2.0f;
  AdamWConfig config;
  config.weight_decay = 0.1f;
  AdamWCase whole = MakeAdamW(false);
  const AdamWCase start = whole;
  const auto chunks = MakeAdamWChunks(segments);
  LaunchAdamW<float>(whole.param.data(), whole.grad.data(), whole.m.data(), whole.v.data(), nullptr,
                     chunks.data(), static_cast<int>(chunks.size()), &sumsq, &scalars, config,
                     nullptr);
  for (std::vector<int64_t> bounds :
       {AdamWShardBounds(2600, 3), std::vector<int64_t>{0, 2, 1038, 2600, 2600}}) {
    AdamWCase parts = start;
    for (size_t r = 0; r + 1 < bounds.size(); ++r) {
      const int64_t lo = bounds[r], hi = bounds[r + 1];
      std::vector<float> m(start.m.begin() + lo, start.m.begin() + hi);
      std::vector<float> v(start.v.begin() + lo, start.v.begin() + hi);
      const auto part = MakeAdamWChunks(segments, lo, hi);
      LaunchAdamW<float>(parts.param.data(), parts.grad.data(), m.data(), v.data(), nullptr,
                         part.data(), static_cast<int>(part.size()), &sumsq, &scalars, config,
                         nullptr);
      for (int64_t i = lo; i < hi; ++i) {
        ASSERT_EQ(m[i - lo], whole.m[i]) << "part " << r << " element " << i;
        ASSERT_EQ(v[i - lo], whole.v[i]) << "part " << r << " element " << i;
      }
    }
    ExpectLaunchOk();
    for (size_t i = 0; i < whole.param.size(); ++i) ASSERT_EQ(parts.param[i], whole.param[i]) << i;
  }
}

}  // namespace
}  // namespace isthmus::ops::ISTHMUS_CUDA_NS
