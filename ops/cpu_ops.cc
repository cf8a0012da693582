// The CPU reference backend of ops/ops.h. It is the ground truth the CUDA kernels are
// checked against, so it favours clear, numerically careful code: every matmul goes through
// OpenBLAS sgemm, reductions accumulate in double, and row loops use OpenMP. bf16 tensors
// are emulated: each kernel reads them into fp32, computes in fp32 and rounds once when it
// stores, which is also what the CUDA kernels do. Unlike other backends this one is safe to
// call from several threads at once (kernels are stateless; allocation is locked).
#include <cblas.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/bf16.h"
#include "common/check.h"
#include "ops/buffer.h"
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

void ToBf16(const float* src, Bf16* dst, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) dst[i] = ops::ToBf16(src[i]);
}

void FromBf16(const Bf16* src, float* dst, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) dst[i] = ops::FromBf16(src[i]);
}

In::In(CRef ref, int64_t n) {
  if (ref.dtype == Dtype::kF32 || ref.data == nullptr) {
    ptr_ = static_cast<const float*>(ref.data);
    return;
  }
  copy_.resize(n);
  FromBf16(static_cast<const Bf16*>(ref.data), copy_.data(), n);
  ptr_ = copy_.data();
}

Out::Out(Ref ref, int64_t n, bool load) : ref_(ref), n_(n) {
  if (ref.dtype == Dtype::kF32 || ref.data == nullptr) {
    ptr_ = static_cast<float*>(ref.data);
    return;
  }
  copy_.resize(n);
  if (load) FromBf16(static_cast<const Bf16*>(ref.data), copy_.data(), n);
  ptr_ = copy_.data();
}

void Out::Commit() {
  if (!copy_.empty()) ToBf16(copy_.data(), static_cast<Bf16*>(ref_.data), n_);
}

}  // namespace cpu

namespace {

constexpr float kLayerNormEps = 1e-5f;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCubic = 0.044715f;
constexpr size_t kAlignment = 256;

// tanh as 1 - 2 / (e^{2u} + 1): glibc's expf is about 3x faster than its tanhf and the
// absolute error stays below 2e-7 (e^{2u} = inf gives exactly 1).
inline float Tanh(float u) { return 1.0f - 2.0f / (std::exp(2.0f * u) + 1.0f); }

inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

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

// out[N,C] = bias (broadcast) + residual, either may be null (then 0).
void BiasResidual(const float* bias, const float* residual, float* out, int N, int C) {
#pragma omp parallel for schedule(static)
  for (int i = 0; i < N; ++i) {
    float* o = out + static_cast<int64_t>(i) * C;
    const float* r = residual != nullptr ? residual + static_cast<int64_t>(i) * C : nullptr;
    for (int c = 0; c < C; ++c) o[c] = (r != nullptr ? r[c] : 0.0f) + (bias ? bias[c] : 0.0f);
  }
}

// The logits a loss reads as fp32; a copy of them when the gradient overwrites them in
// place (fp32 aliasing), so every row reads the logits and never a finished gradient.
class LossLogits {
 public:
  LossLogits(CRef logits, Ref dlogits, int64_t n) : in_(logits, n), ptr_(in_.get()) {
    if (dlogits && dlogits.data == logits.data && dlogits.dtype == Dtype::kF32) {
      keep_.assign(ptr_, ptr_ + n);
      ptr_ = keep_.data();
    }
  }
  const float* get() const { return ptr_; }

 private:
  cpu::In in_;
  std::vector<float> keep_;
  const float* ptr_;
};

class CpuOpsImpl : public Ops {
 public:
  const char* Name() const override { return "cpu"; }
  std::string Describe() const override {
    return "cpu (" + std::to_string(omp_get_max_threads()) + " threads, OpenBLAS)";
  }
  bool HostMemory() const override { return true; }

  Result<void*> Alloc(size_t bytes) override {
    if (bytes == 0) return static_cast<void*>(nullptr);
    const size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    void* p = std::aligned_alloc(kAlignment, rounded);
    if (p == nullptr) {
      return Status::ResourceExhausted("out of host memory allocating " + std::to_string(bytes) +
                                       " bytes");
    }
    counter_.Added(p, rounded);
    return p;
  }
  void Free(void* p) override {
    if (p == nullptr) return;
    counter_.Removed(p);
    std::free(p);
  }
  Result<void*> AllocHost(size_t bytes) override { return Alloc(bytes); }
  void FreeHost(void* p) override { Free(p); }

  void Upload(void* dst, const void* src, size_t bytes) override { Move(dst, src, bytes); }
  void Download(void* dst, const void* src, size_t bytes) override { Move(dst, src, bytes); }
  void UploadAsync(void* dst, const void* src, size_t bytes) override { Move(dst, src, bytes); }
  void DownloadAsync(void* dst, const void* src, size_t bytes) override { Move(dst, src, bytes); }
  void Copy(void* dst, const void* src, size_t bytes) override { Move(dst, src, bytes); }
  void Zero(void* dst, size_t bytes) override {
    if (bytes > 0) std::memset(dst, 0, bytes);
  }
  Status Synchronize() override { return Status::Ok(); }
  Status status() const override { return Status::Ok(); }
  MemoryInfo Memory() const override {
    MemoryInfo m;
    const long page = sysconf(_SC_PAGESIZE);
    m.total = static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * page;
    m.free = static_cast<size_t>(sysconf(_SC_AVPHYS_PAGES)) * page;
    counter_.Fill(&m);
    return m;
  }

  void Matmul(CRef a, CRef b, Ref c, int m, int n, int k, bool trans_a, bool trans_b, float alpha,
              float beta) override {
    ISTHMUS_CHECK(a.dtype == b.dtype, "operands of different dtypes");
    cpu::In av(a, static_cast<int64_t>(m) * k), bv(b, static_cast<int64_t>(k) * n);
    cpu::Out cv(c, static_cast<int64_t>(m) * n, beta != 0.0f);
    cpu::Sgemm(trans_a, trans_b, m, n, k, alpha, av.get(), trans_a ? m : k, bv.get(),
               trans_b ? k : n, beta, cv.get(), n);
    cv.Commit();
  }

  void Cast(CRef src, Ref out, int64_t n) override {
    if (src.dtype == out.dtype) {
      Move(out.data, src.data, n * DtypeSize(src.dtype));
    } else if (src.dtype == Dtype::kF32) {
      cpu::ToBf16(static_cast<const float*>(src.data), static_cast<Bf16*>(out.data), n);
    } else {
      cpu::FromBf16(static_cast<const Bf16*>(src.data), static_cast<float*>(out.data), n);
    }
  }

  void Subtract(const float* a, const float* b, float* out, int64_t n) override {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] - b[i];
  }

  void EmbeddingForward(const int32_t* tokens, const float* wte, const float* wpe, float* out,
                        int B, int T, int C) override {
#pragma omp parallel for schedule(static)
    for (int i = 0; i < B * T; ++i) {
      const float* e = wte + static_cast<int64_t>(tokens[i]) * C;
      float* o = out + static_cast<int64_t>(i) * C;
      if (wpe == nullptr) {
        std::copy(e, e + C, o);
        continue;
      }
      const float* p = wpe + static_cast<int64_t>(i % T) * C;
      for (int c = 0; c < C; ++c) o[c] = e[c] + p[c];
    }
  }

  void EmbeddingBackward(const float* dout, const int32_t* order, const int32_t* starts,
                         float* dwte, float* dwpe, int B, int T, int C, int V) override {
    if (dwte != nullptr) {
#pragma omp parallel for schedule(dynamic, 4)
      for (int v = 0; v < V; ++v) {
        float* g = dwte + static_cast<int64_t>(v) * C;
        for (int32_t j = starts[v]; j < starts[v + 1]; ++j) {
          const float* d = dout + static_cast<int64_t>(order[j]) * C;
          for (int c = 0; c < C; ++c) g[c] += d[c];
        }
      }
    }
    if (dwpe != nullptr) {
#pragma omp parallel for schedule(static)
      for (int t = 0; t < T; ++t) {
        float* g = dwpe + static_cast<int64_t>(t) * C;
        for (int b = 0; b < B; ++b) {
          const float* d = dout + (static_cast<int64_t>(b) * T + t) * C;
          for (int c = 0; c < C; ++c) g[c] += d[c];
        }
      }
    }
  }

  void LayerNormForward(const float* x, const float* weight, const float* bias, Ref out_ref,
                        float* mean, float* rstd, int N, int C) override {
    cpu::Out out(out_ref, static_cast<int64_t>(N) * C, false);
    float* o = out.get();
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
      float* oi = o + static_cast<int64_t>(i) * C;
      for (int c = 0; c < C; ++c) oi[c] = (xi[c] - m) * s * weight[c] + bias[c];
      mean[i] = m;
      rstd[i] = s;
    }
    out.Commit();
  }

  void LayerNormBackward(CRef dout_ref, const float* x, const float* weight, const float* mean,
                         const float* rstd, float* dx, float* dweight, float* dbias, int N,
                         int C) override {
    cpu::In dout_in(dout_ref, static_cast<int64_t>(N) * C);
    const float* dout = dout_in.get();
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

  void LinearForward(CRef x_ref, CRef w_ref, const float* bias, const float* residual, Ref out_ref,
                     int N, int in_dim, int out_dim) override {
    cpu::In x(x_ref, static_cast<int64_t>(N) * in_dim);
    cpu::In w(w_ref, static_cast<int64_t>(in_dim) * out_dim);
    cpu::Out out(out_ref, static_cast<int64_t>(N) * out_dim, false);
    LinearInto(x.get(), w.get(), bias, residual, out.get(), N, in_dim, out_dim);
    out.Commit();
  }

  void LinearBackward(CRef dout_ref, CRef x_ref, CRef w_ref, Ref dx_ref, float* dw, float* dbias,
                      int N, int in_dim, int out_dim) override {
    cpu::In dout(dout_ref, static_cast<int64_t>(N) * out_dim);
    cpu::In x(dw != nullptr ? x_ref : CRef(), static_cast<int64_t>(N) * in_dim);
    cpu::In w(dx_ref ? w_ref : CRef(), static_cast<int64_t>(in_dim) * out_dim);
    cpu::Out dx(dx_ref, static_cast<int64_t>(N) * in_dim, false);
    LinearBackInto(dout.get(), x.get(), w.get(), dx.get(), dw, dbias, N, in_dim, out_dim);
    dx.Commit();
  }

  void LoraLinearForward(CRef x_ref, CRef w_ref, const float* bias, CRef a_ref, CRef b_ref,
                         float scale, const float* residual, Ref out_ref, Ref xa_ref, int N,
                         int in_dim, int out_dim, int rank) override {
    cpu::In x(x_ref, static_cast<int64_t>(N) * in_dim);
    cpu::In w(w_ref, static_cast<int64_t>(in_dim) * out_dim);
    cpu::In a(a_ref, static_cast<int64_t>(rank) * in_dim);
    cpu::In b(b_ref, static_cast<int64_t>(out_dim) * rank);
    cpu::Out out(out_ref, static_cast<int64_t>(N) * out_dim, false);
    cpu::Out xa(xa_ref, static_cast<int64_t>(N) * rank, false);
    LinearInto(x.get(), w.get(), bias, residual, out.get(), N, in_dim, out_dim);
    // xa = x A^T, then out += scale * xa B^T.
    cpu::Sgemm(false, true, N, rank, in_dim, 1.0f, x.get(), in_dim, a.get(), in_dim, 0.0f, xa.get(),
               rank);
    cpu::Sgemm(false, true, N, out_dim, rank, scale, xa.get(), rank, b.get(), rank, 1.0f, out.get(),
               out_dim);
    out.Commit();
    xa.Commit();
  }

  void LoraLinearBackward(CRef dout_ref, CRef x_ref, CRef w_ref, CRef a_ref, CRef b_ref,
                          float scale, CRef xa_ref, Ref dx_ref, float* dw, float* dbias,
                          float* dlora_a, float* dlora_b, Ref dxa_ref, int N, int in_dim,
                          int out_dim, int rank) override {
    cpu::In dout(dout_ref, static_cast<int64_t>(N) * out_dim);
    cpu::In x(x_ref, static_cast<int64_t>(N) * in_dim);
    cpu::In w(dx_ref ? w_ref : CRef(), static_cast<int64_t>(in_dim) * out_dim);
    cpu::In a(a_ref, static_cast<int64_t>(rank) * in_dim);
    cpu::In b(b_ref, static_cast<int64_t>(out_dim) * rank);
    cpu::In xa(xa_ref, static_cast<int64_t>(N) * rank);
    cpu::Out dx(dx_ref, static_cast<int64_t>(N) * in_dim, false);
    cpu::Out dxa(dxa_ref, static_cast<int64_t>(N) * rank, false);
    LinearBackInto(dout.get(), x.get(), w.get(), dx.get(), dw, dbias, N, in_dim, out_dim);
    if (dlora_b != nullptr) {  // dB += scale * dout^T xa
      cpu::Sgemm(true, false, out_dim, rank, N, scale, dout.get(), out_dim, xa.get(), rank, 1.0f,
                 dlora_b, rank);
    }
    if (dx.get() != nullptr || dlora_a != nullptr) {
      // dxa = scale * dout B, the gradient reaching x A^T.
      cpu::Sgemm(false, false, N, rank, out_dim, scale, dout.get(), out_dim, b.get(), rank, 0.0f,
                 dxa.get(), rank);
      if (dlora_a != nullptr) {  // dA += dxa^T x
        cpu::Sgemm(true, false, rank, in_dim, N, 1.0f, dxa.get(), rank, x.get(), in_dim, 1.0f,
                   dlora_a, in_dim);
      }
      if (dx.get() != nullptr) {  // dx += dxa A
        cpu::Sgemm(false, false, N, in_dim, rank, 1.0f, dxa.get(), rank, a.get(), in_dim, 1.0f,
                   dx.get(), in_dim);
      }
    }
    dx.Commit();
    dxa.Commit();
  }

  void RmsNormForward(const float* x, const float* weight, Ref out_ref, float* rstd, int N, int C,
                      float eps) override {
    cpu::Out out(out_ref, static_cast<int64_t>(N) * C, false);
    float* o = out.get();
#pragma omp parallel for schedule(static)
    for (int i = 0; i < N; ++i) {
      const float* xi = x + static_cast<int64_t>(i) * C;
      double sq = 0.0;
      for (int c = 0; c < C; ++c) sq += static_cast<double>(xi[c]) * xi[c];
      const float s = static_cast<float>(1.0 / std::sqrt(sq / C + eps));
      float* oi = o + static_cast<int64_t>(i) * C;
      for (int c = 0; c < C; ++c) oi[c] = xi[c] * s * weight[c];
      rstd[i] = s;
    }
    out.Commit();
  }

  void RmsNormBackward(CRef dout_ref, const float* x, const float* weight, const float* rstd,
                       float* dx, float* dweight, int N, int C) override {
    cpu::In dout_in(dout_ref, static_cast<int64_t>(N) * C);
    const float* dout = dout_in.get();
#pragma omp parallel
    {
      std::vector<double> dw_part(dweight != nullptr ? C : 0, 0.0);
#pragma omp for schedule(static)
      for (int i = 0; i < N; ++i) {
        const float* di = dout + static_cast<int64_t>(i) * C;
        const float* xi = x + static_cast<int64_t>(i) * C;
        const float s = rstd[i];
        if (dx != nullptr) {
          // dx = rstd * (g - xhat * mean(g * xhat)), g = dout * weight, xhat = x * rstd.
          double gx_sum = 0.0;
          for (int c = 0; c < C; ++c) {
            gx_sum += static_cast<double>(di[c]) * weight[c] * (xi[c] * s);
          }
          const float gx_mean = static_cast<float>(gx_sum / C);
          float* dxi = dx + static_cast<int64_t>(i) * C;
          for (int c = 0; c < C; ++c) dxi[c] += s * (di[c] * weight[c] - xi[c] * s * gx_mean);
        }
        if (dweight != nullptr) {
          for (int c = 0; c < C; ++c) dw_part[c] += di[c] * (xi[c] * s);
        }
      }
      if (dweight != nullptr) {
#pragma omp critical
        for (int c = 0; c < C; ++c) dweight[c] += static_cast<float>(dw_part[c]);
      }
    }
  }

  void SwigluForward(CRef gate_ref, CRef up_ref, Ref out_ref, int64_t n) override {
    ISTHMUS_CHECK(gate_ref.dtype == up_ref.dtype && up_ref.dtype == out_ref.dtype,
                  "SwiGLU operands of different dtypes");
    cpu::In gate(gate_ref, n), up(up_ref, n);
    cpu::Out out(out_ref, n, false);
    const float* g = gate.get();
    const float* u = up.get();
    float* o = out.get();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) o[i] = g[i] * Sigmoid(g[i]) * u[i];
    out.Commit();
  }

  void SwigluBackward(CRef dout_ref, CRef gate_ref, CRef up_ref, Ref dgate_ref, Ref dup_ref,
                      int64_t n) override {
    ISTHMUS_CHECK(dout_ref.dtype == gate_ref.dtype && gate_ref.dtype == up_ref.dtype,
                  "SwiGLU gradients of different dtypes");
    cpu::In dout(dout_ref, n), gate(gate_ref, n), up(up_ref, n);
    cpu::Out dgate(dgate_ref, n, false), dup(dup_ref, n, false);
    const float* d = dout.get();
    const float* g = gate.get();
    const float* u = up.get();
    float* dg = dgate.get();
    float* du = dup.get();
    // Each element is read before either gradient is stored: dgate and dup may be gate and up.
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float gi = g[i], ui = u[i], di = d[i];
      const float sig = Sigmoid(gi);
      if (dg != nullptr) dg[i] = di * ui * sig * (1.0f + gi * (1.0f - sig));
      if (du != nullptr) du[i] = di * gi * sig;
    }
    dgate.Commit();
    dup.Commit();
  }

  void RopeGqaForward(CRef q_ref, CRef k_ref, CRef v_ref, const float* rope, Ref qkv_ref, int B,
                      int T, int H, int Hkv, int D) override {
    ISTHMUS_CHECK(
        q_ref.dtype == k_ref.dtype && k_ref.dtype == v_ref.dtype && v_ref.dtype == qkv_ref.dtype,
        "RoPE operands of different dtypes");
    const int N = B * T, group = H / Hkv, half = D / 2;
    const int64_t qd = static_cast<int64_t>(H) * D, kd = static_cast<int64_t>(Hkv) * D;
    cpu::In q(q_ref, N * qd), k(k_ref, N * kd), v(v_ref, N * kd);
    cpu::Out qkv(qkv_ref, N * 3 * qd, false);
#pragma omp parallel for schedule(static)
    for (int row = 0; row < N; ++row) {
      const float* cs = rope + static_cast<int64_t>(row % T) * D;
      const float* qr = q.get() + row * qd;
      const float* kr = k.get() + row * kd;
      const float* vr = v.get() + row * kd;
      float* o = qkv.get() + row * 3 * qd;
      for (int h = 0; h < H; ++h) {
        const int64_t kv = static_cast<int64_t>(h / group) * D;
        Rotate(qr + static_cast<int64_t>(h) * D, cs, half, o + static_cast<int64_t>(h) * D);
        Rotate(kr + kv, cs, half, o + qd + static_cast<int64_t>(h) * D);
        std::copy(vr + kv, vr + kv + D, o + 2 * qd + static_cast<int64_t>(h) * D);
      }
    }
    qkv.Commit();
  }

  void RopeGqaBackward(CRef dqkv_ref, const float* rope, Ref dq_ref, Ref dk_ref, Ref dv_ref, int B,
                       int T, int H, int Hkv, int D) override {
    const int N = B * T, group = H / Hkv, half = D / 2;
    const int64_t qd = static_cast<int64_t>(H) * D, kd = static_cast<int64_t>(Hkv) * D;
    cpu::In dqkv(dqkv_ref, N * 3 * qd);
    cpu::Out dq(dq_ref, N * qd, false), dk(dk_ref, N * kd, false), dv(dv_ref, N * kd, false);
#pragma omp parallel
    {
      std::vector<float> k_sum(D), v_sum(D);
#pragma omp for schedule(static)
      for (int row = 0; row < N; ++row) {
        const float* cs = rope + static_cast<int64_t>(row % T) * D;
        const float* dr = dqkv.get() + row * 3 * qd;
        if (dq.get() != nullptr) {
          for (int h = 0; h < H; ++h) {
            const int64_t at = static_cast<int64_t>(h) * D;
            RotateBack(dr + at, cs, half, dq.get() + row * qd + at);
          }
        }
        for (int kh = 0; kh < Hkv; ++kh) {
          // The group's heads in increasing order, as the CUDA kernel adds them.
          std::fill(k_sum.begin(), k_sum.end(), 0.0f);
          std::fill(v_sum.begin(), v_sum.end(), 0.0f);
          for (int j = 0; j < group; ++j) {
            const int64_t at = static_cast<int64_t>(kh * group + j) * D;
            for (int d = 0; d < D; ++d) {
              k_sum[d] += dr[qd + at + d];
              v_sum[d] += dr[2 * qd + at + d];
            }
          }
          const int64_t at = row * kd + static_cast<int64_t>(kh) * D;
          if (dk.get() != nullptr) RotateBack(k_sum.data(), cs, half, dk.get() + at);
          if (dv.get() != nullptr) std::copy(v_sum.begin(), v_sum.end(), dv.get() + at);
        }
      }
    }
    dq.Commit();
    dk.Commit();
    dv.Commit();
  }

  void GeluForward(CRef x_ref, Ref out_ref, int64_t n) override {
    cpu::In x(x_ref, n);
    cpu::Out out(out_ref, n, false);
    const float* xs = x.get();
    float* o = out.get();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float v = xs[i];
      o[i] = 0.5f * v * (1.0f + Tanh(kGeluScale * (v + kGeluCubic * v * v * v)));
    }
    out.Commit();
  }

  void GeluBackward(CRef dout_ref, CRef x_ref, Ref dx_ref, int64_t n) override {
    cpu::In dout(dout_ref, n), x(x_ref, n);
    cpu::Out dx(dx_ref, n, false);
    const float* d = dout.get();
    const float* xs = x.get();
    float* o = dx.get();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float v = xs[i];
      const float u = kGeluScale * (v + kGeluCubic * v * v * v);
      const float t = Tanh(u);
      const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * v * v);
      o[i] = d[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
    }
    dx.Commit();
  }

  void AttentionForward(CRef qkv_ref, Ref out_ref, float* lse, int B, int T, int C,
                        int H) override {
    const int64_t n = static_cast<int64_t>(B) * T * C;
    cpu::In qkv(qkv_ref, 3 * n);
    cpu::Out out(out_ref, n, false);
    cpu::AttentionForward(qkv.get(), out.get(), lse, B, T, C, H);
    out.Commit();
  }

  void AttentionBackward(CRef dout_ref, CRef qkv_ref, CRef out_ref, const float* lse, Ref dqkv_ref,
                         float* scratch, int B, int T, int C, int H) override {
    const int64_t n = static_cast<int64_t>(B) * T * C;
    cpu::In dout(dout_ref, n), qkv(qkv_ref, 3 * n), out(out_ref, n);
    cpu::Out dqkv(dqkv_ref, 3 * n, false);
    cpu::AttentionBackward(dout.get(), qkv.get(), out.get(), lse, dqkv.get(), B, T, C, H);
    dqkv.Commit();
  }

  void SoftmaxCrossEntropy(CRef logits_ref, const int32_t* targets, float* losses, Ref dlogits_ref,
                           const float* dloss, int N, int V) override {
    const int64_t n = static_cast<int64_t>(N) * V;
    LossLogits in(logits_ref, dlogits_ref, n);
    const float* logits = in.get();
    cpu::Out dlogits(dlogits_ref, n, false);
    float* dl = dlogits.get();
    const float scale = dl != nullptr ? *dloss : 0.0f;
#pragma omp parallel for schedule(static)
    for (int i = 0; i < N; ++i) {
      const float* li = logits + static_cast<int64_t>(i) * V;
      const int32_t target = targets[i];
      float max_logit = li[0];
      for (int j = 1; j < V; ++j) max_logit = std::max(max_logit, li[j]);
      double sum = 0.0;
      for (int j = 0; j < V; ++j) sum += std::exp(static_cast<double>(li[j] - max_logit));
      // log-sum-exp form; stays finite even when the target's probability underflows.
      losses[i] = target >= 0 ? static_cast<float>(std::log(sum) - (li[target] - max_logit)) : 0.0f;
      if (dl == nullptr) continue;
      float* di = dl + static_cast<int64_t>(i) * V;
      if (target < 0) {
        std::fill(di, di + V, 0.0f);
        continue;
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int j = 0; j < V; ++j) di[j] = std::exp(li[j] - max_logit) * inv * scale;
      di[target] -= scale;
    }
    dlogits.Commit();
  }

  void DistillCrossEntropy(CRef logits_ref, const int32_t* targets, const int32_t* teacher_ids,
                           const float* teacher_logits, const DistillLoss& loss, float* losses,
                           Ref dlogits_ref, const float* dloss, int N, int V) override {
    const int64_t n = static_cast<int64_t>(N) * V;
    LossLogits in(logits_ref, dlogits_ref, n);
    const float* logits = in.get();
    cpu::Out dlogits(dlogits_ref, n, false);
    float* dl = dlogits.get();
    const float scale = dl != nullptr ? *dloss : 0.0f;
    const int k = loss.k;
    const double alpha = loss.alpha, temp = loss.temperature;
#pragma omp parallel for schedule(static)
    for (int i = 0; i < N; ++i) {
      const float* li = logits + static_cast<int64_t>(i) * V;
      const int32_t target = targets[i];
      float* di = dl != nullptr ? dl + static_cast<int64_t>(i) * V : nullptr;
      if (target < 0) {
        losses[i] = 0.0f;
        if (di != nullptr) std::fill(di, di + V, 0.0f);
        continue;
      }
      // log-sum-exp of the logits at temperature 1 and T.
      const double mx = *std::max_element(li, li + V);
      double sum = 0.0, sum_t = 0.0;
      for (int j = 0; j < V; ++j) {
        sum += std::exp(li[j] - mx);
        sum_t += std::exp((li[j] - mx) / temp);
      }
      const double lse = mx + std::log(sum), lse_t = mx / temp + std::log(sum_t);
      // The teacher's distribution over its k entries.
      const int32_t* ids = teacher_ids + static_cast<int64_t>(i) * k;
      const float* tl = teacher_logits + static_cast<int64_t>(i) * k;
      const double tmx = *std::max_element(tl, tl + k);
      double tsum = 0.0;
      for (int e = 0; e < k; ++e) tsum += std::exp((tl[e] - tmx) / temp);
      const double lse_p = tmx / temp + std::log(tsum);
      double kl = 0.0;
      for (int e = 0; e < k; ++e) {
        const double log_p = tl[e] / temp - lse_p;
        kl += std::exp(log_p) * (log_p - (li[ids[e]] / temp - lse_t));
      }
      losses[i] = static_cast<float>(alpha * (lse - li[target]) + (1.0 - alpha) * temp * temp * kl);
      if (di == nullptr) continue;
      const double hard = alpha * scale, soft = (1.0 - alpha) * temp * scale;
      for (int j = 0; j < V; ++j) {
        di[j] = static_cast<float>(hard * std::exp(li[j] - lse) +
                                   soft * std::exp(li[j] / temp - lse_t));
      }
      di[target] -= static_cast<float>(hard);
      for (int e = 0; e < k; ++e)
        di[ids[e]] -= static_cast<float>(soft * std::exp(tl[e] / temp - lse_p));
    }
    dlogits.Commit();
  }

  void SumSquares(const float* x, int64_t n, float* out) override {
    double sum = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
    *out = static_cast<float>(sum);
  }

  void AdamW(float* param, const float* grad, float* m, float* v, Ref param_copy,
             const AdamWChunk* chunks, int num_chunks, const float* sumsq,
             const AdamWScalars* scalars, const AdamWConfig& config) override {
    if (!std::isfinite(*sumsq)) return;
    float clip = 1.0f;
    const double norm = std::sqrt(static_cast<double>(*sumsq));
    if (config.grad_clip > 0 && norm > config.grad_clip) {
      clip = static_cast<float>(config.grad_clip / (norm + 1e-6));
    }
    const float lr = scalars->lr, bc1 = scalars->bias_correction1;
    const float bc2 = scalars->bias_correction2;
    const float b1 = config.beta1, b2 = config.beta2, eps = config.eps;
#pragma omp parallel for schedule(dynamic, 1)
    for (int c = 0; c < num_chunks; ++c) {
      const AdamWChunk ch = chunks[c];
      const float wd = ch.decay ? config.weight_decay : 0.0f;
      float* const p = param + ch.offset;
      const float* const gc = grad + ch.offset;
      float* const mc = m + (ch.offset - ch.shard_start);
      float* const vc = v + (ch.offset - ch.shard_start);
      for (int64_t i = 0; i < ch.count; ++i) {
        const float g = gc[i] * clip;
        const float mi = b1 * mc[i] + (1.0f - b1) * g;
        const float vi = b2 * vc[i] + (1.0f - b2) * g * g;
        mc[i] = mi;
        vc[i] = vi;
        const float m_hat = mi / bc1;
        const float v_hat = vi / bc2;
        // Decoupled decay uses the pre-step parameter (same as PyTorch's AdamW).
        p[i] -= lr * (m_hat / (std::sqrt(v_hat) + eps) + wd * p[i]);
      }
      if (param_copy) Cast(param + ch.offset, param_copy.At(ch.offset), ch.count);
    }
  }

 private:
  static void Move(void* dst, const void* src, size_t bytes) {
    if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
  }

  // RopeGqaForward's rotation of one head (x and y [2 * half]; cs = cos then sin [2 * half]),
  // and its transpose.
  static void Rotate(const float* x, const float* cs, int half, float* y) {
    for (int i = 0; i < half; ++i) {
      const float c = cs[i], s = cs[half + i], x0 = x[i], x1 = x[half + i];
      y[i] = x0 * c - x1 * s;
      y[half + i] = x1 * c + x0 * s;
    }
  }
  static void RotateBack(const float* y, const float* cs, int half, float* x) {
    for (int i = 0; i < half; ++i) {
      const float c = cs[i], s = cs[half + i], y0 = y[i], y1 = y[half + i];
      x[i] = y0 * c + y1 * s;
      x[half + i] = y1 * c - y0 * s;
    }
  }

  static void LinearInto(const float* x, const float* w, const float* bias, const float* residual,
                         float* out, int N, int in_dim, int out_dim) {
    float beta = 0.0f;
    if (bias != nullptr || residual != nullptr) {
      BiasResidual(bias, residual, out, N, out_dim);
      beta = 1.0f;
    }
    cpu::Sgemm(false, false, N, out_dim, in_dim, 1.0f, x, in_dim, w, out_dim, beta, out, out_dim);
  }

  static void LinearBackInto(const float* dout, const float* x, const float* w, float* dx,
                             float* dw, float* dbias, int N, int in_dim, int out_dim) {
    if (dx != nullptr) {  // dx = dout W^T
      cpu::Sgemm(false, true, N, in_dim, out_dim, 1.0f, dout, out_dim, w, out_dim, 0.0f, dx,
                 in_dim);
    }
    if (dw != nullptr) {  // dw += x^T dout
      cpu::Sgemm(true, false, in_dim, out_dim, N, 1.0f, x, in_dim, dout, out_dim, 1.0f, dw,
                 out_dim);
    }
    if (dbias != nullptr) AccumulateColumnSums(dout, dbias, N, out_dim);
  }

  AllocationCounter counter_;
};

}  // namespace

const char* DtypeName(Dtype d) { return d == Dtype::kF32 ? "fp32" : "bf16"; }

Bf16 ToBf16(float x) { return {FloatToBf16Bits(x)}; }

Status Ops::BeginCapture() {
  return Status::FailedPrecondition(std::string(Name()) + " backend has no graphs");
}

Result<std::unique_ptr<Graph>> Ops::EndCapture() {
  return Status::FailedPrecondition(std::string(Name()) + " backend has no graphs");
}

std::function<Status()> Ops::Mark() {
  // Work has run by the time Mark() is called; the status is read now, on this thread.
  Status st = status();
  return [st] { return st; };
}

std::vector<AdamWChunk> MakeAdamWChunks(const std::vector<AdamWSegment>& segments, int64_t lo,
                                        int64_t hi) {
  std::vector<AdamWChunk> chunks;
  for (const AdamWSegment& s : segments) {
    const int64_t begin = std::max(s.offset, lo);
    const int64_t end = hi < 0 ? s.offset + s.count : std::min(s.offset + s.count, hi);
    for (int64_t at = begin; at < end; at += kAdamWChunkElems) {
      chunks.push_back({at, static_cast<int32_t>(std::min<int64_t>(kAdamWChunkElems, end - at)),
                        s.decay ? 1 : 0, lo});
    }
  }
  return chunks;
}

std::vector<int64_t> AdamWShardBounds(int64_t n, int parts) {
  constexpr int64_t kAlign = 16;
  const int64_t w = std::max(parts, 1);
  const int64_t part = ((n + w - 1) / w + kAlign - 1) / kAlign * kAlign;
  std::vector<int64_t> bounds(static_cast<size_t>(w) + 1);
  for (int64_t r = 0; r <= w; ++r) bounds[static_cast<size_t>(r)] = std::min(r * part, n);
  return bounds;
}

void GroupByToken(const int32_t* tokens, int N, int V, int32_t* order, int32_t* starts) {
  std::fill(starts, starts + V + 1, 0);
  for (int i = 0; i < N; ++i) ++starts[tokens[i] + 1];
  for (int v = 0; v < V; ++v) starts[v + 1] += starts[v];
  std::vector<int32_t> next(starts, starts + V);
  for (int i = 0; i < N; ++i) order[next[tokens[i]]++] = i;
}

Ops& CpuOps() {
  static CpuOpsImpl* const ops = new CpuOpsImpl();  // never destroyed: safe at exit
  return *ops;
}

}  // namespace isthmus::ops
