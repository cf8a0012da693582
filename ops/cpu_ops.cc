// The CPU reference backend of ops/ops.h. It is the ground truth the CUDA kernels are
// checked against, so it favours clear, numerically careful code: every matmul goes through
// OpenBLAS sgemm, reductions accumulate in double, and row loops use OpenMP.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/cpu_internal.h"
#include "ops/ops.h"

namespace isthmus::ops {
namespace cpu {

void Sgemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
           const float* b, int ldb, float beta, float* c, int ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace cpu

namespace {

constexpr float kLayerNormEps = 1e-5f;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCubic = 0.044715f;

// tanh as 1 - 2 / (e^{2u} + 1): glibc's expf is about 3x faster than its tanhf and the
// absolute error stays below 2e-7 (e^{2u} = inf gives exactly 1).
inline float Tanh(float u) { return 1.0f - 2.0f / (std::exp(2.0f * u) + 1.0f); }

// Adds the column sums of m [rows, cols] into out [cols].
void AccumulateColumnSums(const float* m, float* out, int rows, int cols) {
#pragma omp parallel
  {
    std::vector<double> partial(cols, 0.0);
#pragma omp for schedule(static)
    for (int r = 0; r < rows; ++r) {
      const float* row = m + static_cast<int64_t>(r) * cols;
      for (int j = 0; j < cols; ++j) partial[j] += row[j];
    }
#pragma omp critical
    for (int j = 0; j < cols; ++j) out[j] += static_cast<float>(partial[j]);
  }
}

class CpuOpsImpl : public Ops {
 public:
  const char* Name() const override { return "cpu"; }

  void Matmul(const float* a, const float* b, float* c, int m, int n, int k, bool trans_a,
              bool trans_b, float alpha, float beta) override {
    cpu::Sgemm(trans_a, trans_b, m, n, k, alpha, a, trans_a ? m : k, b, trans_b ? k : n, beta, c,
               n);
  }

  void EmbeddingForward(const int32_t* tokens, const float* wte, const float* wpe, float* out,
                        int B, int T, int C) override {
#pragma omp parallel for schedule(static)
    for (int i = 0; i < B * T; ++i) {
      const float* e = wte + static_cast<int64_t>(tokens[i]) * C;
      const float* p = wpe + static_cast<int64_t>(i % T) * C;
      float* o = out + static_cast<int64_t>(i) * C;
      for (int c = 0; c < C; ++c) o[c] = e[c] + p[c];
    }
  }

  void EmbeddingBackward(const float* dout, const int32_t* tokens, float* dwte, float* dwpe, int B,
                         int T, int C) override {
    // Rows may repeat a token, so threads split the channels, not the rows.
#pragma omp parallel
    {
      const int nt = omp_get_num_threads();
      const int id = omp_get_thread_num();
      const int c0 = static_cast<int>(static_cast<int64_t>(C) * id / nt);
      const int c1 = static_cast<int>(static_cast<int64_t>(C) * (id + 1) / nt);
      for (int i = 0; i < B * T; ++i) {
        const float* d = dout + static_cast<int64_t>(i) * C;
        if (dwte != nullptr) {
          float* g = dwte + static_cast<int64_t>(tokens[i]) * C;
          for (int c = c0; c < c1; ++c) g[c] += d[c];
        }
        if (dwpe != nullptr) {
          float* g = dwpe + static_cast<int64_t>(i % T) * C;
          for (int c = c0; c < c1; ++c) g[c] += d[c];
        }
      }
    }
  }

  void LayerNormForward(const float* x, const float* weight, const float* bias, float* out,
                        float* mean, float* rstd, int N, int C) override {
#pragma omp parallel for schedule(static)
    for (int i = 0; i < N; ++i) {
      const float* xi = x + static_cast<int64_t>(i) * C;
      double sum = 0.0;
      for (int c = 0; c < C; ++c) sum += xi[c];
      const double mu = sum / C;
      double var = 0.0;  // two-pass: no cancellation from E[x^2] - E[x]^2
      for (int c = 0; c < C; ++c) {
        const double d = xi[c] - mu;
        var += d * d;
      }
      var /= C;
      const float m = static_cast<float>(mu);
      const float s = static_cast<float>(1.0 / std::sqrt(var + kLayerNormEps));
      float* oi = out + static_cast<int64_t>(i) * C;
      for (int c = 0; c < C; ++c) oi[c] = (xi[c] - m) * s * weight[c] + bias[c];
      mean[i] = m;
      rstd[i] = s;
    }
  }

  void LayerNormBackward(const float* dout, const float* x, const float* weight, const float* mean,
                         const float* rstd, float* dx, float* dweight, float* dbias, int N,
                         int C) override {
#pragma omp parallel
    {
      std::vector<double> dw_part(dweight != nullptr ? C : 0, 0.0);
      std::vector<double> db_part(dbias != nullptr ? C : 0, 0.0);
#pragma omp for schedule(static)
      for (int i = 0; i < N; ++i) {
        const float* di = dout + static_cast<int64_t>(i) * C;
        const float* xi = x + static_cast<int64_t>(i) * C;
        const float m = mean[i];
        const float s = rstd[i];
        if (dx != nullptr) {
          // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dout * weight.
          double g_sum = 0.0, gx_sum = 0.0;
          for (int c = 0; c < C; ++c) {
            const double g = static_cast<double>(di[c]) * weight[c];
            g_sum += g;
            gx_sum += g * ((xi[c] - m) * s);
          }
          const float g_mean = static_cast<float>(g_sum / C);
          const float gx_mean = static_cast<float>(gx_sum / C);
          float* dxi = dx + static_cast<int64_t>(i) * C;
          for (int c = 0; c < C; ++c) {
            const float xhat = (xi[c] - m) * s;
            dxi[c] += s * (di[c] * weight[c] - g_mean - xhat * gx_mean);
          }
        }
        if (dweight != nullptr) {
          for (int c = 0; c < C; ++c) dw_part[c] += di[c] * ((xi[c] - m) * s);
        }
        if (dbias != nullptr) {
          for (int c = 0; c < C; ++c) db_part[c] += di[c];
        }
      }
#pragma omp critical
      {
        if (dweight != nullptr) {
          for (int c = 0; c < C; ++c) dweight[c] += static_cast<float>(dw_part[c]);
        }
        if (dbias != nullptr) {
          for (int c = 0; c < C; ++c) dbias[c] += static_cast<float>(db_part[c]);
        }
      }
    }
  }

  void LinearForward(const float* x, const float* w, const float* bias, float* out, int N,
                     int in_dim, int out_dim) override {
    float beta = 0.0f;
    if (bias != nullptr) {
#pragma omp parallel for schedule(static)
      for (int i = 0; i < N; ++i) {
        std::memcpy(out + static_cast<int64_t>(i) * out_dim, bias, sizeof(float) * out_dim);
      }
      beta = 1.0f;
    }
    cpu::Sgemm(false, false, N, out_dim, in_dim, 1.0f, x, in_dim, w, out_dim, beta, out, out_dim);
  }

  void LinearBackward(const float* dout, const float* x, const float* w, float* dx, float* dw,
                      float* dbias, int N, int in_dim, int out_dim) override {
    if (dx != nullptr) {  // dx += dout W^T
      cpu::Sgemm(false, true, N, in_dim, out_dim, 1.0f, dout, out_dim, w, out_dim, 1.0f, dx,
                 in_dim);
    }
    if (dw != nullptr) {  // dw += x^T dout
      cpu::Sgemm(true, false, in_dim, out_dim, N, 1.0f, x, in_dim, dout, out_dim, 1.0f, dw,
                 out_dim);
    }
    if (dbias != nullptr) AccumulateColumnSums(dout, dbias, N, out_dim);
  }

  void LoraLinearForward(const float* x, const float* w, const float* bias, const float* lora_a,
                         const float* lora_b, float scale, float* out, float* xa, int N, int in_dim,
                         int out_dim, int rank) override {
    LinearForward(x, w, bias, out, N, in_dim, out_dim);
    // xa = x A^T, then out += scale * xa B^T.
    cpu::Sgemm(false, true, N, rank, in_dim, 1.0f, x, in_dim, lora_a, in_dim, 0.0f, xa, rank);
    cpu::Sgemm(false, true, N, out_dim, rank, scale, xa, rank, lora_b, rank, 1.0f, out, out_dim);
  }

  void LoraLinearBackward(const float* dout, const float* x, const float* w, const float* lora_a,
                          const float* lora_b, float scale, const float* xa, float* dx, float* dw,
                          float* dbias, float* dlora_a, float* dlora_b, float* dxa_scratch, int N,
                          int in_dim, int out_dim, int rank) override {
    LinearBackward(dout, x, w, dx, dw, dbias, N, in_dim, out_dim);
    if (dlora_b != nullptr) {  // dB += scale * dout^T xa
      cpu::Sgemm(true, false, out_dim, rank, N, scale, dout, out_dim, xa, rank, 1.0f, dlora_b,
                 rank);
    }
    if (dx == nullptr && dlora_a == nullptr) return;
    // dxa = scale * dout B, the gradient reaching x A^T.
    cpu::Sgemm(false, false, N, rank, out_dim, scale, dout, out_dim, lora_b, rank, 0.0f,
               dxa_scratch, rank);
    if (dlora_a != nullptr) {  // dA += dxa^T x
      cpu::Sgemm(true, false, rank, in_dim, N, 1.0f, dxa_scratch, rank, x, in_dim, 1.0f, dlora_a,
                 in_dim);
    }
    if (dx != nullptr) {  // dx += dxa A
      cpu::Sgemm(false, false, N, in_dim, rank, 1.0f, dxa_scratch, rank, lora_a, in_dim, 1.0f, dx,
                 in_dim);
    }
  }

  void GeluForward(const float* x, float* out, int64_t n) override {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[i];
      out[i] = 0.5f * v * (1.0f + Tanh(kGeluScale * (v + kGeluCubic * v * v * v)));
    }
  }

  void GeluBackward(const float* dout, const float* x, float* dx, int64_t n) override {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[i];
      const float u = kGeluScale * (v + kGeluCubic * v * v * v);
      const float t = Tanh(u);
      const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * v * v);
      dx[i] += dout[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
    }
  }

  void AttentionForward(const float* qkv, float* out, float* att, int B, int T, int C,
                        int H) override {
    cpu::AttentionForward(qkv, out, att, B, T, C, H);
  }

  void AttentionBackward(const float* dout, const float* qkv, const float* att, float* dqkv,
                         float* datt_scratch, int B, int T, int C, int H) override {
    cpu::AttentionBackward(dout, qkv, att, dqkv, datt_scratch, B, T, C, H);
  }

  void Add(const float* a, const float* b, float* out, int64_t n) override {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
  }

  float CrossEntropyForward(const float* logits, const int32_t* targets, float* probs,
                            float* losses, int N, int V) override {
    double total = 0.0;
    int64_t counted = 0;
#pragma omp parallel for schedule(static) reduction(+ : total, counted)
    for (int i = 0; i < N; ++i) {
      const float* li = logits + static_cast<int64_t>(i) * V;
      float* pi = probs + static_cast<int64_t>(i) * V;
      float max_logit = li[0];
      for (int j = 1; j < V; ++j) max_logit = std::max(max_logit, li[j]);
      double sum = 0.0;
      for (int j = 0; j < V; ++j) {
        pi[j] = std::exp(li[j] - max_logit);
        sum += pi[j];
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int j = 0; j < V; ++j) pi[j] *= inv;
      const int32_t target = targets[i];
      if (target >= 0) {
        assert(target < V);
        // log-sum-exp form; stays finite even when probs[target] underflows to 0.
        const double loss = std::log(sum) - (static_cast<double>(li[target]) - max_logit);
        losses[i] = static_cast<float>(loss);
        total += loss;
        ++counted;
      } else {
        losses[i] = 0.0f;
      }
    }
    return counted > 0 ? static_cast<float>(total / static_cast<double>(counted)) : 0.0f;
  }

  void CrossEntropyBackward(const float* probs, const int32_t* targets, float* dlogits, int N,
                            int V) override {
    int64_t counted = 0;
    for (int i = 0; i < N; ++i) counted += targets[i] >= 0 ? 1 : 0;
    if (counted == 0) return;
    const float dloss = 1.0f / static_cast<float>(counted);
#pragma omp parallel for schedule(static)
    for (int i = 0; i < N; ++i) {
      const int32_t target = targets[i];
      if (target < 0) continue;
      const float* pi = probs + static_cast<int64_t>(i) * V;
      float* di = dlogits + static_cast<int64_t>(i) * V;
      for (int j = 0; j < V; ++j) di[j] += pi[j] * dloss;
      di[target] -= dloss;
    }
  }

  void AdamWStep(float* param, const float* grad, float* m, float* v, int64_t n, float lr,
                 float beta1, float beta2, float eps, float weight_decay, int64_t step) override {
    assert(step >= 1);
    const float bc1 = 1.0f - static_cast<float>(std::pow(static_cast<double>(beta1), step));
    const float bc2 = 1.0f - static_cast<float>(std::pow(static_cast<double>(beta2), step));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float g = grad[i];
      const float mi = beta1 * m[i] + (1.0f - beta1) * g;
      const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
      m[i] = mi;
      v[i] = vi;
      const float m_hat = mi / bc1;
      const float v_hat = vi / bc2;
      // Decoupled decay uses the pre-step parameter (same as PyTorch's AdamW).
      param[i] -= lr * (m_hat / (std::sqrt(v_hat) + eps) + weight_decay * param[i]);
    }
  }

  double SumSquares(const float* x, int64_t n) override {
    double sum = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
    return sum;
  }

  void Scale(float* x, int64_t n, float s) override {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) x[i] *= s;
  }
};

}  // namespace

Ops& CpuOps() {
  static CpuOpsImpl* const ops = new CpuOpsImpl();  // never destroyed: safe at exit
  return *ops;
}

}  // namespace isthmus::ops
