// The kernel half of the CUDA backend: every kernel of ops/ops.h expressed as launches of
// the kernels in ops/cuda_kernels.cuh and ops/cuda_attention.cuh and calls of Matmul.
// Memory, copies, errors, graphs and Matmul itself belong to the subclass: ops/cuda_ops.cu
// (a GPU, cuBLASLt) or the emulated backend of the tests (host memory, the CPU emulator of
// tests/ops/cuda_emu.h, sgemm). Compiled once per flavour; see ops/cuda_compat.h.
#pragma once

#include <string>
#include <type_traits>
#include "common/check.h"

#include "ops/cuda_attention.cuh"
#include "ops/cuda_compat.h"
#include "ops/cuda_kernels.cuh"
#include "ops/ops.h"

namespace isthmus::ops::ISTHMUS_CUDA_NS {

// Calls f with a null pointer of the element type `d` names (float or bf16).
template <typename F>
void WithType(Dtype d, F&& f) {
  if (d == Dtype::kF32) {
    f(static_cast<float*>(nullptr));
  } else {
    f(static_cast<bf16*>(nullptr));
  }
}

template <typename T>
const T* As(CRef r) {
  return static_cast<const T*>(r.data);
}
template <typename T>
T* As(Ref r) {
  return static_cast<T*>(r.data);
}

class KernelOps : public Ops {
 public:
  Status CheckAttention(int C, int H) const override {
    if (AttentionSupported(C, H)) return Status::Ok();
    return Status::InvalidArgument("the CUDA attention kernels take head sizes up to 256; " +
                                   std::to_string(C) + " channels over " + std::to_string(H) +
                                   " heads is " + std::to_string(C / (H > 0 ? H : 1)) +
                                   ": use more heads");
  }

  void Cast(CRef src, Ref out, int64_t n) override {
    if (Skip(n)) return;
    WithType(src.dtype, [&](auto* in_type) {
      using In = std::remove_pointer_t<decltype(in_type)>;
      WithType(out.dtype, [&](auto* out_type) {
        using O = std::remove_pointer_t<decltype(out_type)>;
        LaunchCast<In, O>(As<In>(src), As<O>(out), n, stream());
      });
    });
    Launched("Cast", __FILE__, __LINE__);
  }

  void Subtract(const float* a, const float* b, float* out, int64_t n) override {
    if (Skip(n)) return;
    LaunchSubtract(a, b, out, n, stream());
    Launched("Subtract", __FILE__, __LINE__);
  }

  void EmbeddingForward(const int32_t* tokens, const float* wte, const float* wpe, float* out,
                        int B, int T, int C) override {
    if (Skip(static_cast<int64_t>(B) * T * C)) return;
    LaunchEmbeddingForward(tokens, wte, wpe, out, B, T, C, stream());
    Launched("EmbeddingForward", __FILE__, __LINE__);
  }

  void EmbeddingBackward(const float* dout, const int32_t* order, const int32_t* starts,
                         float* dwte, float* dwpe, int B, int T, int C, int V) override {
    if (Skip(static_cast<int64_t>(B) * T * C)) return;
    LaunchEmbeddingBackward(dout, order, starts, dwte, dwpe, B, T, C, V, stream());
    Launched("EmbeddingBackward", __FILE__, __LINE__);
  }

  void LayerNormForward(const float* x, const float* weight, const float* bias, Ref out,
                        float* mean, float* rstd, int N, int C) override {
    if (Skip(static_cast<int64_t>(N) * C)) return;
    WithType(out.dtype, [&](auto* t) {
      using T = std::remove_pointer_t<decltype(t)>;
      LaunchLayerNormForward<T>(x, weight, bias, As<T>(out), mean, rstd, N, C, stream());
    });
    Launched("LayerNormForward", __FILE__, __LINE__);
  }

  void LayerNormBackward(CRef dout, const float* x, const float* weight, const float* mean,
                         const float* rstd, float* dx, float* dweight, float* dbias, int N,
                         int C) override {
    if (Skip(static_cast<int64_t>(N) * C)) return;
    WithType(dout.dtype, [&](auto* t) {
      using T = std::remove_pointer_t<decltype(t)>;
      LaunchLayerNormBackward<T>(As<T>(dout), x, weight, mean, rstd, dx, dweight, dbias, N, C,
                                 workspace(), stream());
    });
    Launched("LayerNormBackward", __FILE__, __LINE__);
  }

  void LinearForward(CRef x, CRef w, const float* bias, const float* residual, Ref out, int N,
                     int in_dim, int out_dim) override {
    if (Skip(static_cast<int64_t>(N) * out_dim)) return;
    float beta = 0.0f;
    if (bias != nullptr || residual != nullptr) {
      // out = bias + residual first, so that the matmul adds into it (beta = 1).
      WithType(out.dtype, [&](auto* t) {
        using T = std::remove_pointer_t<decltype(t)>;
        LaunchBiasResidual<T>(bias, residual, As<T>(out), N, out_dim, stream());
      });
      Launched("BiasResidual", __FILE__, __LINE__);
      beta = 1.0f;
    }
    Matmul(x, w, out, N, out_dim, in_dim, false, false, 1.0f, beta);
  }

  void LinearBackward(CRef dout, CRef x, CRef w, Ref dx, float* dw, float* dbias, int N, int in_dim,
                      int out_dim) override {
    if (Skip(static_cast<int64_t>(N) * out_dim)) return;
    if (dx) Matmul(dout, w, dx, N, in_dim, out_dim, false, true, 1.0f, 0.0f);
    if (dw != nullptr) Matmul(x, dout, dw, in_dim, out_dim, N, true, false, 1.0f, 1.0f);
    if (dbias != nullptr) {
      WithType(dout.dtype, [&](auto* t) {
        using T = std::remove_pointer_t<decltype(t)>;
        LaunchColumnSumAccumulate<T>(As<T>(dout), dbias, N, out_dim, workspace(), stream());
      });
      Launched("ColumnSumAccumulate", __FILE__, __LINE__);
    }
  }

  void LoraLinearForward(CRef x, CRef w, const float* bias, CRef lora_a, CRef lora_b, float scale,
                         const float* residual, Ref out, Ref xa, int N, int in_dim, int out_dim,
                         int rank) override {
    LinearForward(x, w, bias, residual, out, N, in_dim, out_dim);
    Matmul(x, lora_a, xa, N, rank, in_dim, false, true, 1.0f, 0.0f);
    Matmul(xa, lora_b, out, N, out_dim, rank, false, true, scale, 1.0f);
  }

  void LoraLinearBackward(CRef dout, CRef x, CRef w, CRef lora_a, CRef lora_b, float scale, CRef xa,
                          Ref dx, float* dw, float* dbias, float* dlora_a, float* dlora_b, Ref dxa,
                          int N, int in_dim, int out_dim, int rank) override {
    LinearBackward(dout, x, w, dx, dw, dbias, N, in_dim, out_dim);
    if (dlora_b != nullptr) Matmul(dout, xa, dlora_b, out_dim, rank, N, true, false, scale, 1.0f);
    if (!dx && dlora_a == nullptr) return;
    Matmul(dout, lora_b, dxa, N, rank, out_dim, false, false, scale, 0.0f);
    if (dlora_a != nullptr) Matmul(dxa, x, dlora_a, rank, in_dim, N, true, false, 1.0f, 1.0f);
    if (dx) Matmul(dxa, lora_a, dx, N, in_dim, rank, false, false, 1.0f, 1.0f);
  }

  void RmsNormForward(const float* x, const float* weight, Ref out, float* rstd, int N, int C,
                      float eps) override {
    if (Skip(static_cast<int64_t>(N) * C)) return;
    WithType(out.dtype, [&](auto* t) {
      using T = std::remove_pointer_t<decltype(t)>;
      LaunchRmsNormForward<T>(x, weight, As<T>(out), rstd, N, C, eps, stream());
    });
    Launched("RmsNormForward", __FILE__, __LINE__);
  }

  void RmsNormBackward(CRef dout, const float* x, const float* weight, const float* rstd, float* dx,
                       float* dweight, int N, int C) override {
    if (Skip(static_cast<int64_t>(N) * C)) return;
    WithType(dout.dtype, [&](auto* t) {
      using T = std::remove_pointer_t<decltype(t)>;
      LaunchRmsNormBackward<T>(As<T>(dout), x, weight, rstd, dx, dweight, N, C, workspace(),
                               stream());
    });
    Launched("RmsNormBackward", __FILE__, __LINE__);
  }

  void SwigluForward(CRef gate, CRef up, Ref out, int64_t n) override {
    if (Skip(n)) return;
    ISTHMUS_CHECK(gate.dtype == up.dtype && up.dtype == out.dtype,
                  "SwiGLU operands of different dtypes");
    WithType(gate.dtype, [&](auto* t) {
      using T = std::remove_pointer_t<decltype(t)>;
      LaunchSwigluForward<T>(As<T>(gate), As<T>(up), As<T>(out), n, stream());
    });
    Launched("SwigluForward", __FILE__, __LINE__);
  }

  void SwigluBackward(CRef dout, CRef gate, CRef up, Ref dgate, Ref dup, int64_t n) override {
    if (Skip(n)) return;
    ISTHMUS_CHECK(dout.dtype == gate.dtype && gate.dtype == up.dtype,
                  "SwiGLU gradients of different dtypes");
    WithType(gate.dtype, [&](auto* t) {
      using T = std::remove_pointer_t<decltype(t)>;
      LaunchSwigluBackward<T>(As<T>(dout), As<T>(gate), As<T>(up), As<T>(dgate), As<T>(dup), n,
                              stream());
    });
    Launched("SwigluBackward", __FILE__, __LINE__);
  }

  void RopeGqaForward(CRef q, CRef k, CRef v, const float* rope, Ref qkv, int B, int T, int H,
                      int Hkv, int D) override {
    if (Skip(static_cast<int64_t>(B) * T * H * D)) return;
    ISTHMUS_CHECK(q.dtype == k.dtype && k.dtype == v.dtype && v.dtype == qkv.dtype,
                  "RoPE operands of different dtypes");
    WithType(q.dtype, [&](auto* t) {
      using E = std::remove_pointer_t<decltype(t)>;
      LaunchRopeGqaForward<E>(As<E>(q), As<E>(k), As<E>(v), rope, As<E>(qkv), B, T, H, Hkv, D,
                              stream());
    });
    Launched("RopeGqaForward", __FILE__, __LINE__);
  }

  void RopeGqaBackward(CRef dqkv, const float* rope, Ref dq, Ref dk, Ref dv, int B, int T, int H,
                       int Hkv, int D) override {
    if (Skip(static_cast<int64_t>(B) * T * H * D)) return;
    WithType(dqkv.dtype, [&](auto* t) {
      using E = std::remove_pointer_t<decltype(t)>;
      LaunchRopeGqaBackward<E>(As<E>(dqkv), rope, As<E>(dq), As<E>(dk), As<E>(dv), B, T, H, Hkv, D,
                               stream());
    });
    Launched("RopeGqaBackward", __FILE__, __LINE__);
  }

  void GeluForward(CRef x, Ref out, int64_t n) override {
    if (Skip(n)) return;
    ISTHMUS_CHECK(x.dtype == out.dtype, "input and output of different dtypes");
    WithType(x.dtype, [&](auto* t) {
      using T = std::remove_pointer_t<decltype(t)>;
      LaunchGeluForward<T>(As<T>(x), As<T>(out), n, stream());
    });
    Launched("GeluForward", __FILE__, __LINE__);
  }

  void GeluBackward(CRef dout, CRef x, Ref dx, int64_t n) override {
    if (Skip(n)) return;
    ISTHMUS_CHECK(dout.dtype == x.dtype && x.dtype == dx.dtype, "gradients of different dtypes");
    WithType(x.dtype, [&](auto* t) {
      using T = std::remove_pointer_t<decltype(t)>;
      LaunchGeluBackward<T>(As<T>(dout), As<T>(x), As<T>(dx), n, stream());
    });
    Launched("GeluBackward", __FILE__, __LINE__);
  }

  void AttentionForward(CRef qkv, Ref out, float* lse, int B, int T, int C, int H) override {
    if (Skip(static_cast<int64_t>(B) * T * C)) return;
    WithType(qkv.dtype, [&](auto* t) {
      using E = std::remove_pointer_t<decltype(t)>;
      LaunchAttentionForward<E>(As<E>(qkv), As<E>(out), lse, B, T, C, H, stream());
    });
    Launched("AttentionForward", __FILE__, __LINE__);
  }

  void AttentionBackward(CRef dout, CRef qkv, CRef out, const float* lse, Ref dqkv, float* scratch,
                         int B, int T, int C, int H) override {
    if (Skip(static_cast<int64_t>(B) * T * C)) return;
    WithType(qkv.dtype, [&](auto* t) {
      using E = std::remove_pointer_t<decltype(t)>;
      LaunchAttentionBackward<E>(As<E>(dout), As<E>(qkv), As<E>(out), lse, As<E>(dqkv), scratch, B,
                                 T, C, H, stream());
    });
    Launched("AttentionBackward", __FILE__, __LINE__);
  }

  void SoftmaxCrossEntropy(CRef logits, const int32_t* targets, float* losses, Ref dlogits,
                           const float* dloss, int N, int V) override {
    if (Skip(static_cast<int64_t>(N) * V)) return;
    WithType(logits.dtype, [&](auto* t) {
      using T = std::remove_pointer_t<decltype(t)>;
      LaunchSoftmaxCrossEntropy<T>(As<T>(logits), targets, losses, As<T>(dlogits), dloss, N, V,
                                   stream());
    });
    Launched("SoftmaxCrossEntropy", __FILE__, __LINE__);
  }

  void DistillCrossEntropy(CRef logits, const int32_t* targets, const int32_t* teacher_ids,
                           const float* teacher_logits, const DistillLoss& loss, float* losses,
                           Ref dlogits, const float* dloss, int N, int V) override {
    if (Skip(static_cast<int64_t>(N) * V)) return;
    WithType(logits.dtype, [&](auto* t) {
      using T = std::remove_pointer_t<decltype(t)>;
      LaunchDistillCrossEntropy<T>(As<T>(logits), targets, teacher_ids, teacher_logits, loss.k,
                                   loss.alpha, loss.temperature, losses, As<T>(dlogits), dloss, N,
                                   V, stream());
    });
    Launched("DistillCrossEntropy", __FILE__, __LINE__);
  }

  void SumSquares(const float* x, int64_t n, float* out) override {
    if (failed()) return;
    LaunchSumSquares(x, n, out, workspace(), stream());
    Launched("SumSquares", __FILE__, __LINE__);
  }

  void AdamW(float* param, const float* grad, float* m, float* v, Ref param_copy,
             const AdamWChunk* chunks, int num_chunks, const float* sumsq,
             const AdamWScalars* scalars, const AdamWConfig& config) override {
    if (Skip(num_chunks)) return;
    if (!param_copy) {
      LaunchAdamW<float>(param, grad, m, v, nullptr, chunks, num_chunks, sumsq, scalars, config,
                         stream());
    } else {
      WithType(param_copy.dtype, [&](auto* t) {
        using T = std::remove_pointer_t<decltype(t)>;
        LaunchAdamW<T>(param, grad, m, v, As<T>(param_copy), chunks, num_chunks, sumsq, scalars,
                       config, stream());
      });
    }
    Launched("AdamW", __FILE__, __LINE__);
  }

 protected:
  // The stream every launch goes to, and kWorkspaceFloats of scratch in backend memory.
  virtual cudaStream_t stream() = 0;
  virtual float* workspace() = 0;
  // Whether an earlier call failed (then every call is a no-op).
  virtual bool failed() const = 0;
  // Records a failed launch (the first one is what status() reports).
  virtual void RecordError(const std::string& what, const char* file, int line) = 0;

 private:
  // True when nothing must be launched: an earlier failure, or no elements.
  bool Skip(int64_t elements) const { return failed() || elements <= 0; }
  void Launched(const char* what, const char* file, int line) {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      RecordError(std::string(what) + " launch failed: " + cudaGetErrorString(err), file, line);
    }
  }
};

}  // namespace isthmus::ops::ISTHMUS_CUDA_NS
