// CPU reference of causal multi-head self-attention (ops/ops.h). Like the CUDA kernels it
// keeps only each row's log-sum-exp between forward and backward and recomputes the
// probabilities in the backward; unlike them it materialises one batch element's
// [H,T,T] scores at a time, so that QK^T, P V and their backward products run as strided
// sgemm calls straight on the packed qkv buffer, with softmax rows spread over OpenMP.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops/cpu_internal.h"

namespace isthmus::ops::cpu {
namespace {

// Offsets of head h of batch element b in the packed buffers.
struct HeadView {
  int64_t qkv;  // q of (b,h) inside qkv/dqkv; k at +C, v at +2C, rows 3C apart
  int64_t out;  // (b,h) inside out/dout, rows C apart
};

HeadView View(int b, int h, int T, int C, int H) {
  const int hs = C / H;
  return {static_cast<int64_t>(b) * T * 3 * C + static_cast<int64_t>(h) * hs,
          static_cast<int64_t>(b) * T * C + static_cast<int64_t>(h) * hs};
}

// s[h] = scale * q_h k_h^T for every head of batch element b ([H,T,T]; the upper triangle
// is computed and then ignored).
void Scores(const float* qkv, float* s, int b, int T, int C, int H, float scale) {
  const int hs = C / H, ld = 3 * C;
  for (int h = 0; h < H; ++h) {
    const HeadView v = View(b, h, T, C, H);
    Sgemm(false, true, T, T, hs, scale, qkv + v.qkv, ld, qkv + v.qkv + C, ld, 0.0f,
          s + static_cast<int64_t>(h) * T * T, T);
  }
}

}  // namespace

void AttentionForward(const float* qkv, float* out, float* lse, int B, int T, int C, int H) {
  const int hs = C / H, ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  std::vector<float> p(static_cast<size_t>(H) * T * T);
  for (int b = 0; b < B; ++b) {
    Scores(qkv, p.data(), b, T, C, H, scale);
    // Row (h, t): softmax over s <= t, in place; zeros above the diagonal.
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < static_cast<int64_t>(H) * T; ++r) {
      const int t = static_cast<int>(r % T);
      float* row = p.data() + r * T;
      float max_score = row[0];
      for (int s = 1; s <= t; ++s) max_score = std::max(max_score, row[s]);
      double sum = 0.0;
      for (int s = 0; s <= t; ++s) {
        row[s] = std::exp(row[s] - max_score);
        sum += row[s];
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int s = 0; s <= t; ++s) row[s] *= inv;
      for (int s = t + 1; s < T; ++s) row[s] = 0.0f;
      lse[static_cast<int64_t>(b) * H * T + r] = max_score + static_cast<float>(std::log(sum));
    }
    for (int h = 0; h < H; ++h) {
      const HeadView v = View(b, h, T, C, H);
      Sgemm(false, false, T, hs, T, 1.0f, p.data() + static_cast<int64_t>(h) * T * T, T,
            qkv + v.qkv + 2 * C, ld, 0.0f, out + v.out, C);
    }
  }
}

void AttentionBackward(const float* dout, const float* qkv, const float* out, const float* lse,
                       float* dqkv, int B, int T, int C, int H) {
  const int hs = C / H, ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const size_t block = static_cast<size_t>(H) * T * T;
  std::vector<float> p(block), dp(block);
  for (int b = 0; b < B; ++b) {
    Scores(qkv, p.data(), b, T, C, H, scale);
    for (int h = 0; h < H; ++h) {
      const HeadView v = View(b, h, T, C, H);
      // dP = dout v^T.
      Sgemm(false, true, T, T, hs, 1.0f, dout + v.out, C, qkv + v.qkv + 2 * C, ld, 0.0f,
            dp.data() + static_cast<int64_t>(h) * T * T, T);
    }
    // P = exp(S - lse); dS = scale * P * (dP - D), D = sum_c dout * out (= sum_s P dP).
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < static_cast<int64_t>(H) * T; ++r) {
      const int h = static_cast<int>(r / T), t = static_cast<int>(r % T);
      const int64_t row_at = (static_cast<int64_t>(b) * T + t) * C + static_cast<int64_t>(h) * hs;
      double d = 0.0;
      for (int c = 0; c < hs; ++c) d += static_cast<double>(dout[row_at + c]) * out[row_at + c];
      const float df = static_cast<float>(d);
      const float l = lse[static_cast<int64_t>(b) * H * T + r];
      float* prow = p.data() + r * T;
      float* drow = dp.data() + r * T;
      for (int s = 0; s <= t; ++s) {
        prow[s] = std::exp(prow[s] - l);
        drow[s] = scale * prow[s] * (drow[s] - df);
      }
      for (int s = t + 1; s < T; ++s) prow[s] = drow[s] = 0.0f;
    }
    for (int h = 0; h < H; ++h) {
      const HeadView v = View(b, h, T, C, H);
      const float* ph = p.data() + static_cast<int64_t>(h) * T * T;
      const float* dsh = dp.data() + static_cast<int64_t>(h) * T * T;
      // dq = dS k; dk = dS^T q; dv = P^T dout (all written).
      Sgemm(false, false, T, hs, T, 1.0f, dsh, T, qkv + v.qkv + C, ld, 0.0f, dqkv + v.qkv, ld);
      Sgemm(true, false, T, hs, T, 1.0f, dsh, T, qkv + v.qkv, ld, 0.0f, dqkv + v.qkv + C, ld);
      Sgemm(true, false, T, hs, T, 1.0f, ph, T, dout + v.out, C, 0.0f, dqkv + v.qkv + 2 * C, ld);
    }
  }
}

}  // namespace isthmus::ops::cpu
