// The compute kernels of the model and optimizer, behind one interface so that a CUDA
// implementation can stand beside the CPU reference (ops/cpu_ops.cc). All tensors are
// contiguous row-major fp32 buffers owned by the caller; pointers are in the backend's
// memory space (host memory for the CPU backend). Conventions:
//   - Shapes: B batch, T time (sequence), C channels, H heads, V vocabulary, N = B*T rows.
//   - Linear weights use GPT-2's Conv1D layout: W is [in, out] and y = x W + b.
//   - LoRA factors use PEFT's layout: A is [r, in], B is [out, r]; y += scale * (x A^T) B^T.
//   - Every Backward ACCUMULATES (+=) into the gradient buffers it is given, so residual
//     branches and shared weights sum naturally; callers zero gradients between steps.
//     A null gradient pointer means "not needed" and is skipped.
// Thread-safety: an Ops object is stateless after construction; calls from several
// threads on disjoint buffers are safe. Kernels may use several threads internally.
#pragma once

#include <cstdint>
#include <memory>

namespace isthmus::ops {

class Ops {
 public:
  virtual ~Ops() = default;

  // "cpu" or "cuda".
  virtual const char* Name() const = 0;

  // c = alpha * op(a) * op(b) + beta * c, op(x) = x or x^T; op(a) is [m,k], op(b) is [k,n].
  virtual void Matmul(const float* a, const float* b, float* c, int m, int n, int k,
                      bool trans_a, bool trans_b, float alpha, float beta) = 0;

  // out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:].  tokens in [0, V).
  virtual void EmbeddingForward(const int32_t* tokens, const float* wte, const float* wpe,
                                float* out, int B, int T, int C) = 0;
  virtual void EmbeddingBackward(const float* dout, const int32_t* tokens, float* dwte,
                                 float* dwpe, int B, int T, int C) = 0;

  // Per-row layer norm over C (eps 1e-5). Saves mean[N] and rstd[N] for the backward.
  virtual void LayerNormForward(const float* x, const float* weight, const float* bias,
                                float* out, float* mean, float* rstd, int N, int C) = 0;
  virtual void LayerNormBackward(const float* dout, const float* x, const float* weight,
                                 const float* mean, const float* rstd, float* dx,
                                 float* dweight, float* dbias, int N, int C) = 0;

  // out[N,out_dim] = x[N,in_dim] W[in_dim,out_dim] + bias (bias may be null).
  virtual void LinearForward(const float* x, const float* w, const float* bias, float* out,
                             int N, int in_dim, int out_dim) = 0;
  virtual void LinearBackward(const float* dout, const float* x, const float* w, float* dx,
                              float* dw, float* dbias, int N, int in_dim, int out_dim) = 0;

  // LoRA linear: out = x W + bias + scale * (x A^T) B^T, A [rank,in], B [out,rank].
  // xa [N,rank] is scratch the forward fills and the backward reads (x A^T).
  virtual void LoraLinearForward(const float* x, const float* w, const float* bias,
                                 const float* lora_a, const float* lora_b, float scale,
                                 float* out, float* xa, int N, int in_dim, int out_dim,
                                 int rank) = 0;
  // dw/dbias may be null (frozen base). dxa_scratch is [N,rank] scratch.
  virtual void LoraLinearBackward(const float* dout, const float* x, const float* w,
                                  const float* lora_a, const float* lora_b, float scale,
                                  const float* xa, float* dx, float* dw, float* dbias,
                                  float* dlora_a, float* dlora_b, float* dxa_scratch, int N,
                                  int in_dim, int out_dim, int rank) = 0;

  // GELU, tanh approximation (as GPT-2).
  virtual void GeluForward(const float* x, float* out, int64_t n) = 0;
  virtual void GeluBackward(const float* dout, const float* x, float* dx, int64_t n) = 0;

  // Causal multi-head self-attention. qkv is [B,T,3C] (q, k, v concatenated on the last
  // axis, head h owning channels [h*C/H, (h+1)*C/H) of each). out is [B,T,C]. att
  // [B,H,T,T] holds the softmax probabilities for the backward (entries above the
  // diagonal are zero). Scale 1/sqrt(C/H).
  virtual void AttentionForward(const float* qkv, float* out, float* att, int B, int T,
                                int C, int H) = 0;
  // datt_scratch is [B,H,T,T] scratch. Accumulates into dqkv.
  virtual void AttentionBackward(const float* dout, const float* qkv, const float* att,
                                 float* dqkv, float* datt_scratch, int B, int T, int C,
                                 int H) = 0;

  // out = a + b elementwise (out may alias a or b).
  virtual void Add(const float* a, const float* b, float* out, int64_t n) = 0;

  // Fused softmax + cross-entropy over V for N rows. Writes probs [N,V] and per-row
  // losses [N]; returns the mean loss over rows whose target is >= 0 (target < 0 = ignore).
  virtual float CrossEntropyForward(const float* logits, const int32_t* targets, float* probs,
                                    float* losses, int N, int V) = 0;
  // dlogits += (probs - onehot(target)) * dloss, with dloss = 1 / (number of counted rows)
  // so that it is the gradient of the mean loss.
  virtual void CrossEntropyBackward(const float* probs, const int32_t* targets,
                                    float* dlogits, int N, int V) = 0;

  // One AdamW step (decoupled weight decay, bias-corrected, step counted from 1).
  virtual void AdamWStep(float* param, const float* grad, float* m, float* v, int64_t n,
                         float lr, float beta1, float beta2, float eps, float weight_decay,
                         int64_t step) = 0;

  // Sum of squares (accumulated in double), and x *= s.
  virtual double SumSquares(const float* x, int64_t n) = 0;
  virtual void Scale(float* x, int64_t n, float s) = 0;
};

// The CPU reference backend (OpenBLAS sgemm for every matmul). Never null; shared.
Ops& CpuOps();

// Learning rate at `step` (0-based): linear warmup from 0 to max_lr over warmup_steps,
// then cosine decay to min_lr at total_steps, min_lr after that.
float WarmupCosineLr(int64_t step, int64_t warmup_steps, int64_t total_steps, float max_lr,
                     float min_lr);

}  // namespace isthmus::ops
