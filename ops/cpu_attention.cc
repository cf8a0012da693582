// CPU reference of causal multi-head self-attention (ops/ops.h), materialising the full
// [T,T] probability matrix per (batch, head). The QK^T, att*V and their backward products
// run as strided sgemm calls straight on the packed qkv buffer; softmax rows use OpenMP.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops/cpu_internal.h"

namespace isthmus::ops::cpu {
namespace {

// Offsets of one (b,h) block in the packed buffers.
struct HeadView {
  int64_t qkv;  // q of (b,h) inside qkv/dqkv; k at +C, v at +2C, rows 3C apart
  int64_t out;  // (b,h) inside out/dout, rows C apart
  int64_t att;  // (b,h) [T,T] block inside att/datt
};

HeadView View(int b, int h, int T, int C, int H) {
  const int hs = C / H;
  return {static_cast<int64_t>(b) * T * 3 * C + static_cast<int64_t>(h) * hs,
          static_cast<int64_t>(b) * T * C + static_cast<int64_t>(h) * hs,
          (static_cast<int64_t>(b) * H + h) * T * T};
}

}  // namespace

void AttentionForward(const float* qkv, float* out, float* att, int B, int T, int C, int H) {
  const int hs = C / H;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int ld = 3 * C;
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const HeadView v = View(b, h, T, C, H);
      // scores = scale * q k^T (the upper triangle is computed, then overwritten below).
      Sgemm(false, true, T, T, hs, scale, qkv + v.qkv, ld, qkv + v.qkv + C, ld, 0.0f, att + v.att,
            T);
    }
  }
  const int64_t rows = static_cast<int64_t>(B) * H * T;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int t = static_cast<int>(r % T);
    float* row = att + r * T;
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
  }
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const HeadView v = View(b, h, T, C, H);
      Sgemm(false, false, T, hs, T, 1.0f, att + v.att, T, qkv + v.qkv + 2 * C, ld, 0.0f,
            out + v.out, C);
    }
  }
}

void AttentionBackward(const float* dout, const float* qkv, const float* att, float* dqkv,
                       float* datt_scratch, int B, int T, int C, int H) {
  const int hs = C / H;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int ld = 3 * C;
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const HeadView v = View(b, h, T, C, H);
      // datt = dout v^T; dv += att^T dout.
      Sgemm(false, true, T, T, hs, 1.0f, dout + v.out, C, qkv + v.qkv + 2 * C, ld, 0.0f,
            datt_scratch + v.att, T);
      Sgemm(true, false, T, hs, T, 1.0f, att + v.att, T, dout + v.out, C, 1.0f,
            dqkv + v.qkv + 2 * C, ld);
    }
  }
  // Through the softmax, in place: dscores = scale * att * (datt - sum_s att * datt).
  const int64_t rows = static_cast<int64_t>(B) * H * T;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int t = static_cast<int>(r % T);
    const float* p = att + r * T;
    float* d = datt_scratch + r * T;
    double dot = 0.0;
    for (int s = 0; s <= t; ++s) dot += static_cast<double>(p[s]) * d[s];
    const float dotf = static_cast<float>(dot);
    for (int s = 0; s <= t; ++s) d[s] = scale * p[s] * (d[s] - dotf);
    for (int s = t + 1; s < T; ++s) d[s] = 0.0f;
  }
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const HeadView v = View(b, h, T, C, H);
      // dq += dscores k; dk += dscores^T q.
      Sgemm(false, false, T, hs, T, 1.0f, datt_scratch + v.att, T, qkv + v.qkv + C, ld, 1.0f,
            dqkv + v.qkv, ld);
      Sgemm(true, false, T, hs, T, 1.0f, datt_scratch + v.att, T, qkv + v.qkv, ld, 1.0f,
            dqkv + v.qkv + C, ld);
    }
  }
}

}  // namespace isthmus::ops::cpu
