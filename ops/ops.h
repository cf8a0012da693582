// The compute backend of the model and optimizer: memory, copies, and every kernel the GPT
// and its AdamW step use, behind one interface so that the CUDA implementation
// (ops/cuda_*.cu) stands beside the CPU reference (ops/cpu_ops.cc) and is checked against
// it. The model (worker/model) allocates everything through this interface and never
// touches backend memory directly, so the same training code runs on either.
//
// Memory. Every pointer a kernel takes lives in the backend's memory (host memory for the
// CPU backend, device memory of one GPU for CUDA) and is owned by the caller (see
// ops/buffer.h for owning handles). Tensors are contiguous and row-major.
//
// Element types. Master weights, gradients of weights, optimizer state, layer-norm
// statistics, the residual stream and its gradient are always fp32. Activations that feed
// matmuls (and matmul weight copies) may be fp32 or bf16; such arguments are a Ref/CRef
// (pointer plus Dtype). A bf16 kernel computes in fp32 and rounds once when it stores, on
// every backend, so the CPU backend is also the reference of the bf16 CUDA kernels.
//
// Conventions:
//   - Shapes: B batch, T time (sequence), C channels, H heads, V vocabulary, N = B*T rows.
//   - Linear weights use GPT-2's Conv1D layout: W is [in, out] and y = x W + b.
//   - LoRA factors use PEFT's layout: A is [r, in], B is [out, r]; y += scale * (x A^T) B^T.
//   - Gradients of WEIGHTS are ACCUMULATED (+=), so shared weights (the tied embedding) and
//     several micro-steps sum naturally; callers zero them between steps. Gradients of
//     ACTIVATIONS are WRITTEN (=), except the dx of LayerNormBackward and RmsNormBackward,
//     which accumulates into the residual stream's gradient. A null gradient pointer means
//     "not needed".
//
// Execution and errors. Kernels and copies are enqueued in order on the backend's one
// stream and may run after the call returns (the CPU backend runs them before returning).
// Kernel calls return nothing: a failure (a CUDA or cuBLAS error) is recorded with file,
// line and the library's message, every later call becomes a no-op, and Synchronize() and
// status() return that first error. Out-of-memory is reported where memory is allocated
// (Alloc), never inside a kernel: kernels allocate nothing.
//
// Thread-safety: one thread drives an Ops object at a time (the calls share one stream).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace isthmus::ops {

enum class Dtype : uint8_t { kF32 = 0, kBF16 = 1 };

inline size_t DtypeSize(Dtype d) { return d == Dtype::kF32 ? 4 : 2; }
const char* DtypeName(Dtype d);  // "fp32" / "bf16"

// A bfloat16 value as stored: the upper 16 bits of an IEEE fp32. CUDA code reinterprets
// the same bits as __nv_bfloat16.
struct Bf16 {
  uint16_t bits;
};
static_assert(sizeof(Bf16) == 2);

// Round to nearest, ties to even (as __float2bfloat16_rn); NaN stays a quiet NaN.
Bf16 ToBf16(float x);
inline float FromBf16(Bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}
// x rounded to bf16 and back: what storing x in a bf16 tensor keeps.
inline float RoundBf16(float x) { return FromBf16(ToBf16(x)); }

// A pointer into backend memory and the type of the elements it points to.
struct Ref {
  void* data = nullptr;
  Dtype dtype = Dtype::kF32;

  Ref() = default;
  Ref(std::nullptr_t) {}                          // NOLINT: "no buffer"
  Ref(float* p) : data(p), dtype(Dtype::kF32) {}  // NOLINT: implicit by design
  Ref(Bf16* p) : data(p), dtype(Dtype::kBF16) {}  // NOLINT
  Ref(void* p, Dtype d) : data(p), dtype(d) {}
  explicit operator bool() const { return data != nullptr; }
  // The element `i` elements further on.
  Ref At(int64_t i) const {
    return {static_cast<char*>(data) + i * static_cast<int64_t>(DtypeSize(dtype)), dtype};
  }
};

struct CRef {
  const void* data = nullptr;
  Dtype dtype = Dtype::kF32;

  CRef() = default;
  CRef(std::nullptr_t) {}                                // NOLINT
  CRef(const float* p) : data(p), dtype(Dtype::kF32) {}  // NOLINT
  CRef(const Bf16* p) : data(p), dtype(Dtype::kBF16) {}  // NOLINT
  CRef(Ref r) : data(r.data), dtype(r.dtype) {}          // NOLINT
  CRef(const void* p, Dtype d) : data(p), dtype(d) {}
  explicit operator bool() const { return data != nullptr; }
  CRef At(int64_t i) const {
    return {static_cast<const char*>(data) + i * static_cast<int64_t>(DtypeSize(dtype)), dtype};
  }
};

// Bytes of backend memory: what the device has and what this backend allocated.
struct MemoryInfo {
  size_t total = 0;           // the device's memory (CPU: physical memory)
  size_t free = 0;            // free now, as the driver (or the kernel) reports it
  size_t allocated = 0;       // held by this backend's Alloc now
  size_t peak_allocated = 0;  // the most Alloc ever held at once
};

// One chunk of a flat parameter buffer for the multi-tensor AdamW: `count` elements from
// `offset`, with weight decay when `decay` is 1. MakeAdamWChunks splits segments into
// chunks of at most kAdamWChunkElems so that a GPU kernel spreads them evenly over blocks.
// The moments m and v of element i are at i - shard_start: 0 when they cover the whole
// buffer, the start of this rank's part when the optimizer state is sharded across ranks
// (ZeRO-1, the trainer's OptimizerShards) and m and v hold only that part.
struct AdamWChunk {
  int64_t offset;
  int32_t count;
  int32_t decay;
  int64_t shard_start = 0;
};
inline constexpr int32_t kAdamWChunkElems = 1 << 16;

// Hyper-parameters that stay fixed for a run.
// Word-level distillation (Hinton et al. 2015; Kim & Rush 2016): a teacher's distribution
// over the vocabulary at each position, given as its k largest logits (ids distinct within a
// row; k = V gives the whole distribution), and how the loss mixes it with the target.
struct DistillLoss {
  int k = 0;                 // teacher entries per row, in [1, V]
  float alpha = 0.5f;        // weight of the cross-entropy on the target, in [0, 1]
  float temperature = 1.0f;  // T > 0: both distributions are softmax(logits / T)
};

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  float grad_clip = 1.0f;  // global L2 norm bound; <= 0 disables clipping
};

// What changes every step, read by the kernel from backend memory (so that a captured step
// can be replayed with new values): the learning rate and the bias corrections
// 1 - beta1^step and 1 - beta2^step of the step being taken.
struct AdamWScalars {
  float lr;
  float bias_correction1;
  float bias_correction2;
  float unused;
};

// A replayable recording of enqueued work (a CUDA graph).
class Graph {
 public:
  virtual ~Graph() = default;
  // Enqueues the recorded work again, with the pointers it was recorded with.
  virtual void Replay() = 0;
};

class Ops {
 public:
  virtual ~Ops() = default;

  // "cpu" or "cuda".
  virtual const char* Name() const = 0;
  // One line for logs: "cpu (2 threads)", "cuda:0 (NVIDIA H100 80GB HBM3, 79.1 GiB, sm_90)".
  virtual std::string Describe() const = 0;
  // True when backend memory is host memory (the CPU backend): callers may then read and
  // write through the pointers directly.
  virtual bool HostMemory() const = 0;

  // ---- Memory and copies ------------------------------------------------------------
  // Backend memory, 256-byte aligned. ResourceExhausted when there is not enough (the
  // message says how much was asked for and how much is free); bytes == 0 gives null.
  virtual Result<void*> Alloc(size_t bytes) = 0;
  virtual void Free(void* p) = 0;
  // Page-locked host memory for staging copies (CPU backend: ordinary memory).
  virtual Result<void*> AllocHost(size_t bytes) = 0;
  virtual void FreeHost(void* p) = 0;

  // Host -> backend. Returns once `src` may be reused (any host memory).
  virtual void Upload(void* dst, const void* src, size_t bytes) = 0;
  // Backend -> host. Returns once the bytes are in `dst` (any host memory); waits for the
  // work enqueued before it.
  virtual void Download(void* dst, const void* src, size_t bytes) = 0;
  // Stream-ordered copies with AllocHost memory on the host side: enqueued like a kernel
  // and recordable in a Graph. `src` must not change until the copy ran (Synchronize);
  // `dst` holds the bytes after the next Synchronize.
  virtual void UploadAsync(void* dst, const void* pinned_src, size_t bytes) = 0;
  virtual void DownloadAsync(void* pinned_dst, const void* src, size_t bytes) = 0;
  // Backend -> backend, and zero-filling.
  virtual void Copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void Zero(void* dst, size_t bytes) = 0;

  // Waits for all enqueued work. Returns the first error of any call so far (sticky).
  virtual Status Synchronize() = 0;
  // The first error of any call so far, without waiting.
  virtual Status status() const = 0;
  // A mark in the stream of enqueued work: the returned function blocks the thread that
  // calls it (any thread, once) until the work enqueued before Mark() has run, and returns
  // the backend's status then. It lets another thread start on results (an all-reduce of a
  // finished gradient piece) while this one goes on enqueueing. Backends that run work as
  // it is enqueued (the CPU) return a function that only reports status(). Not while
  // capturing a graph.
  virtual std::function<Status()> Mark();
  virtual MemoryInfo Memory() const = 0;

  // Whether this backend can run attention with n_embd C and H heads (the CUDA kernels
  // hold up to 256 channels per head, and their shared memory must fit the device).
  // InvalidArgument saying what would fit otherwise.
  virtual Status CheckAttention(int C, int H) const { return Status::Ok(); }

  // ---- Graphs (launch overhead) -----------------------------------------------------
  // Records the calls made between BeginCapture and EndCapture instead of running them.
  // Backends without graphs (the CPU) return Unimplemented-style FailedPrecondition from
  // BeginCapture and the caller simply runs the work. No Alloc, Download, Upload or
  // Synchronize may happen while capturing.
  virtual bool SupportsGraphs() const { return false; }
  virtual Status BeginCapture();
  virtual Result<std::unique_ptr<Graph>> EndCapture();

  // ---- Kernels ----------------------------------------------------------------------
  // c = alpha * op(a) op(b) + beta * c, op(x) = x or x^T; op(a) is [m,k], op(b) is [k,n],
  // c is [m,n]. a and b share one dtype (bf16 runs on tensor cores); c is fp32, or bf16
  // when a and b are bf16 (cuBLAS has no fp32-in, bf16-out kernel); accumulation is fp32.
  // fp32 inputs compute in full fp32 (no TF32).
  virtual void Matmul(CRef a, CRef b, Ref c, int m, int n, int k, bool trans_a, bool trans_b,
                      float alpha, float beta) = 0;

  // out = src converted to out's dtype (n elements).
  virtual void Cast(CRef src, Ref out, int64_t n) = 0;

  // out = a - b (n fp32 elements).
  virtual void Subtract(const float* a, const float* b, float* out, int64_t n) = 0;

  // out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:] (wpe null: no position table, as in the
  // Llama family). tokens in [0, V).
  virtual void EmbeddingForward(const int32_t* tokens, const float* wte, const float* wpe,
                                float* out, int B, int T, int C) = 0;
  // dwte[v,:] += sum of dout over the positions holding token v; dwpe[t,:] += sum over b of
  // dout[b,t,:]. The positions come grouped by token (GroupByToken below, built on the host
  // from the batch): order[starts[v] .. starts[v+1]) are the positions of token v, in
  // increasing order, so the sums have a fixed order and no atomics are needed. Either
  // gradient may be null.
  virtual void EmbeddingBackward(const float* dout, const int32_t* order, const int32_t* starts,
                                 float* dwte, float* dwpe, int B, int T, int C, int V) = 0;

  // Per-row layer norm over C (eps 1e-5) of the fp32 x; out in fp32 or bf16. Saves mean[N]
  // and rstd[N] for the backward.
  virtual void LayerNormForward(const float* x, const float* weight, const float* bias, Ref out,
                                float* mean, float* rstd, int N, int C) = 0;
  // dx += (the residual stream's gradient accumulates); dweight, dbias +=.
  virtual void LayerNormBackward(CRef dout, const float* x, const float* weight, const float* mean,
                                 const float* rstd, float* dx, float* dweight, float* dbias, int N,
                                 int C) = 0;

  // out[N,out_dim] = x[N,in_dim] W[in_dim,out_dim] + bias (+ residual). x and w share one
  // dtype; bias (may be null) and residual (may be null; may alias out, which must then be
  // fp32) are fp32; out is fp32 or bf16. (On CUDA a bf16 out with a bias is rounded twice:
  // bias + residual are stored first and the matmul adds into them.)
  virtual void LinearForward(CRef x, CRef w, const float* bias, const float* residual, Ref out,
                             int N, int in_dim, int out_dim) = 0;
  // dx = dout W^T (written); dw += x^T dout; dbias += column sums of dout. dout, x and w
  // share one dtype; dx has it too.
  virtual void LinearBackward(CRef dout, CRef x, CRef w, Ref dx, float* dw, float* dbias, int N,
                              int in_dim, int out_dim) = 0;

  // LoRA linear: out = x W + bias + scale * (x A^T) B^T (+ residual), A [rank,in] and
  // B [out,rank] in the dtype of x and w. xa [N,rank] (that dtype) receives x A^T for the
  // backward.
  virtual void LoraLinearForward(CRef x, CRef w, const float* bias, CRef lora_a, CRef lora_b,
                                 float scale, const float* residual, Ref out, Ref xa, int N,
                                 int in_dim, int out_dim, int rank) = 0;
  // dx written; dw/dbias (null for a frozen base) and dlora_a/dlora_b (fp32) accumulate.
  // dxa_scratch [N,rank] in the activations' dtype.
  virtual void LoraLinearBackward(CRef dout, CRef x, CRef w, CRef lora_a, CRef lora_b, float scale,
                                  CRef xa, Ref dx, float* dw, float* dbias, float* dlora_a,
                                  float* dlora_b, Ref dxa_scratch, int N, int in_dim, int out_dim,
                                  int rank) = 0;

  // ---- The Llama family (worker/model/gpt.h, ModelFamily::kLlama) ----
  // Per-row RMS norm over C of the fp32 x: out = x * rstd * weight, rstd = 1 / sqrt(mean of
  // x^2 + eps), out in fp32 or bf16. Saves rstd[N] for the backward.
  virtual void RmsNormForward(const float* x, const float* weight, Ref out, float* rstd, int N,
                              int C, float eps) = 0;
  // dx += (the residual stream's gradient accumulates); dweight += (null: frozen).
  virtual void RmsNormBackward(CRef dout, const float* x, const float* weight, const float* rstd,
                               float* dx, float* dweight, int N, int C) = 0;

  // SwiGLU's product: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)); gate, up and out
  // share one dtype (n elements). out may alias neither input.
  virtual void SwigluForward(CRef gate, CRef up, Ref out, int64_t n) = 0;
  // dgate = dout * up * silu'(gate), dup = dout * silu(gate) (written, in gate's dtype);
  // dgate and dup may alias gate and up respectively (in place).
  virtual void SwigluBackward(CRef dout, CRef gate, CRef up, Ref dgate, Ref dup, int64_t n) = 0;

  // Rotary position embedding and grouped-query heads, packed for AttentionForward: from
  // q [B,T,H*D] and k, v [B,T,Hkv*D] (Hkv divides H) writes qkv [B,T,3*H*D] whose q part is
  // q rotated, whose k part holds for head h the rotated k of kv head h / (H / Hkv), and
  // whose v part that kv head's v. The rotation of a head's D values x at position t (the
  // index within the sequence), Hugging Face's rotate_half convention, for i < D/2 with
  // c = rope[t*D + i], s = rope[t*D + D/2 + i]:
  //   y[i] = x[i] c - x[i + D/2] s,   y[i + D/2] = x[i + D/2] c + x[i] s.
  // rope is fp32 in backend memory, one row of D per position (cos, then sin, of the D/2
  // angles; at least T rows). q, k, v and qkv share one dtype; D is even.
  virtual void RopeGqaForward(CRef q, CRef k, CRef v, const float* rope, Ref qkv, int B, int T,
                              int H, int Hkv, int D) = 0;
  // The adjoint of RopeGqaForward: dq = the q part rotated back; dk and dv = the k and v
  // parts summed over the heads that share each kv head, k's rotated back (all written, in
  // dqkv's dtype).
  virtual void RopeGqaBackward(CRef dqkv, const float* rope, Ref dq, Ref dk, Ref dv, int B, int T,
                               int H, int Hkv, int D) = 0;

  // GELU, tanh approximation (as GPT-2). out / dx may alias their inputs.
  virtual void GeluForward(CRef x, Ref out, int64_t n) = 0;
  // dx = dout * gelu'(x) (written).
  virtual void GeluBackward(CRef dout, CRef x, Ref dx, int64_t n) = 0;

  // Causal multi-head self-attention that never stores the [T,T] scores (flash-style).
  // qkv is [B,T,3C] (q, k, v concatenated on the last axis, head h owning channels
  // [h*C/H, (h+1)*C/H) of each); out is [B,T,C] in qkv's dtype; lse [B,H,T] receives each
  // row's log-sum-exp of the scaled scores, all the backward needs besides out. Scale
  // 1/sqrt(C/H).
  virtual void AttentionForward(CRef qkv, Ref out, float* lse, int B, int T, int C, int H) = 0;
  // dqkv [B,T,3C] written (qkv's dtype). scratch holds AttentionScratchFloats(B,T,C,H) fp32.
  virtual void AttentionBackward(CRef dout, CRef qkv, CRef out, const float* lse, Ref dqkv,
                                 float* scratch, int B, int T, int C, int H) = 0;

  // Softmax cross-entropy over V for N rows, forward and (optionally) backward in one pass:
  // losses[i] = logsumexp(logits[i]) - logits[i][target[i]], 0 when target[i] < 0. When
  // dlogits is not null it receives (softmax(logits[i]) - onehot(target[i])) * dloss[0],
  // zero rows for ignored targets. dloss is one fp32 in backend memory (1 / counted rows
  // makes it the gradient of the mean loss). targets in [-1, V).
  virtual void SoftmaxCrossEntropy(CRef logits, const int32_t* targets, float* losses, Ref dlogits,
                                   const float* dloss, int N, int V) = 0;

  // SoftmaxCrossEntropy's contract with a teacher (DistillLoss): for a row with a target,
  //   losses[i] = alpha * CE(logits[i], target[i])
  //             + (1 - alpha) * T^2 * KL(p_i || q_i),
  // where p_i = softmax(teacher_logits[i] / T) over the row's k entries (ids
  // teacher_ids[i*k .. i*k+k), distinct, in [0, V); the top-k renormalised) and q_i =
  // softmax(logits[i] / T) over all V, evaluated at those ids. dlogits (may alias logits)
  // receives dloss[0] * (alpha * (softmax(logits) - onehot(target)) + (1 - alpha) * T *
  // (q - p)), p zero off its ids: the gradient of the loss. Rows with target -1: 0, zero rows.
  virtual void DistillCrossEntropy(CRef logits, const int32_t* targets, const int32_t* teacher_ids,
                                   const float* teacher_logits, const DistillLoss& loss,
                                   float* losses, Ref dlogits, const float* dloss, int N,
                                   int V) = 0;

  // *out = sum of x[i]^2 over n fp32 elements (one fp32 in backend memory), accumulated in
  // at least fp32 pairwise/blocked order; deterministic for a given n.
  virtual void SumSquares(const float* x, int64_t n, float* out) = 0;

  // One AdamW step (decoupled weight decay on the pre-step parameter, bias-corrected) over
  // the chunks of flat buffers param/grad/m/v, with global-norm clipping folded in:
  // sumsq (backend memory) is the sum of squares of the whole gradient; when it is not
  // finite nothing changes at all (the step is skipped); otherwise grads are scaled by
  // min(1, grad_clip / (sqrt(sumsq) + 1e-6)) when grad_clip > 0. chunks and scalars are in
  // backend memory. When param_copy is not null it receives the updated parameters in its
  // dtype (the bf16 matmul copies), at the same offsets.
  virtual void AdamW(float* param, const float* grad, float* m, float* v, Ref param_copy,
                     const AdamWChunk* chunks, int num_chunks, const float* sumsq,
                     const AdamWScalars* scalars, const AdamWConfig& config) = 0;
};

// fp32 scratch values AttentionBackward needs (one per row and head: B*H*T).
inline int64_t AttentionScratchFloats(int B, int T, int C, int H) {
  return static_cast<int64_t>(B) * H * T;
}

// Chunks of [offset, offset+count) segments for AdamW, each at most kAdamWChunkElems long.
// With a part [lo, hi) (the optimizer-state shard of one rank), only the segments' elements
// inside it, their moments counted from lo; hi < 0: the whole buffer.
struct AdamWSegment {
  int64_t offset;
  int64_t count;
  bool decay;
};
std::vector<AdamWChunk> MakeAdamWChunks(const std::vector<AdamWSegment>& segments, int64_t lo = 0,
                                        int64_t hi = -1);

// How the optimizer state of n elements splits across `parts` ranks (ZeRO-1): parts + 1
// bounds from 0 to n, rank r's part being [bounds[r], bounds[r+1]); each part as long as
// ceil(n / parts) rounded up to 16 elements (so that the moments keep the parameters'
// alignment), the last ones shorter or empty.
std::vector<int64_t> AdamWShardBounds(int64_t n, int parts);

// The host-side grouping EmbeddingBackward takes: order[N] and starts[V+1] (counting sort of
// the positions by token, stable). tokens must be in [0, V).
void GroupByToken(const int32_t* tokens, int N, int V, int32_t* order, int32_t* starts);

// The CPU reference backend (OpenBLAS sgemm for every matmul). Never null; shared.
Ops& CpuOps();

// Learning rate at `step` (0-based): linear warmup from 0 to max_lr over warmup_steps,
// then cosine decay to min_lr at total_steps, min_lr after that.
float WarmupCosineLr(int64_t step, int64_t warmup_steps, int64_t total_steps, float max_lr,
                     float min_lr);

}  // namespace isthmus::ops
