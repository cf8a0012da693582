// Causal multi-head self-attention of the CUDA backend, flash-style: scores live only in
// tiles, the forward keeps a running max and sum per query row (online softmax) and saves
// each row's log-sum-exp, and the backward recomputes the probabilities from it
// (FlashAttention-2). Two implementations behind one launcher: a CUDA-core path for any
// element type and head size, and a tensor-core path (mma.sync, bf16 in, fp32 accumulate) for
// bf16 with head sizes 32, 64 and 128. Both are deterministic: every output element is
// written by one thread, with no atomics, so dK/dV (per key tile) and dQ (per query tile)
// come from separate kernels that each recompute the probabilities.
//
// Header-only and written against ops/cuda_compat.h, so that it compiles with nvcc and in
// the CPU emulator (tests/ops/cuda_attention_emu_test.cc).
#pragma once

#include <cstdint>
#include <type_traits>

#include "ops/cuda_compat.h"

namespace isthmus::ops::ISTHMUS_CUDA_NS {

// qkv [B,Tn,3C] (q, k, v concatenated on the last axis; head h owns channels
// [h*hs, (h+1)*hs) of each, hs = C/H); out [B,Tn,C]; lse [B,H,Tn] receives each query
// row's log-sum-exp of its scaled scores (scale 1/sqrt(hs), keys s <= t). Only enqueues.
template <typename T>
void LaunchAttentionForward(const T* qkv, T* out, float* lse, int B, int Tn, int C, int H,
                            cudaStream_t stream);

// dqkv [B,Tn,3C] is written (not accumulated). scratch holds B*H*Tn floats (it receives
// D = rowsum(dout * out) per row and head). lse and out are the forward's. Only enqueues.
template <typename T>
void LaunchAttentionBackward(const T* dout, const T* qkv, const T* out, const float* lse, T* dqkv,
                             float* scratch, int B, int Tn, int C, int H, cudaStream_t stream);

// True when C = H * hs with 1 <= hs <= 256 (the shared-memory tiles of the CUDA-core path
// hold up to 256 channels per row).
inline bool AttentionSupported(int C, int H) {
  return H >= 1 && C >= 1 && C % H == 0 && C / H <= 256;
}

// Bytes of dynamic shared memory per block the attention kernels need at this shape (a
// device must allow at least this much: cudaDevAttrMaxSharedMemoryPerBlockOptin).
inline size_t AttentionSharedBytes(int C, int H);

// Kernels have internal linkage: this header is compiled into more than one translation
// unit of a test binary (emulated), and each gets its own copy.
namespace attention_detail {
namespace {

// kBest takes the tensor-core path whenever it applies; kGeneric forces the CUDA-core path
// (tests compare the two).
enum class AttentionPath { kBest, kGeneric };

constexpr int kThreads = 128;  // 4 warps per block on both paths
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

// D[b,h,t] = sum over the head's channels of dout * out: one warp per row.
template <typename T>
__global__ void __launch_bounds__(256)
    RowDotKernel(const T* dout, const T* out, float* d, int B, int Tn, int C, int H) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= static_cast<int64_t>(B) * H * Tn) return;  // whole warps only
  const int lane = threadIdx.x % 32, hs = C / H;
  const int t = static_cast<int>(row % Tn);
  const int bh = static_cast<int>(row / Tn), b = bh / H, h = bh % H;
  const int64_t off = (static_cast<int64_t>(b) * Tn + t) * C + static_cast<int64_t>(h) * hs;
  float s = 0.0f;
  for (int c = lane; c < hs; c += 32) s += ToFloat(dout[off + c]) * ToFloat(out[off + c]);
  s = WarpSum(s);
  if (lane == 0) d[row] = s;
}

// ---- CUDA-core path ------------------------------------------------------------------------
// Tiles of 32 queries and 32 keys, 8 rows (or keys) per warp. In the score phase a lane
// owns one key (or, in the dK/dV kernel, one query) of the tile; in the accumulation phase
// it owns channels lane, lane+32, ... . Tiles a lane walks along a row of are padded by
// one float so that the 32 lanes hit 32 banks. Accumulators live in shared memory, so any
// head size up to 256 fits one kernel.
constexpr int kGTile = 32;
constexpr int kGRows = kGTile / kWarps;  // 8

inline size_t ForwardGenericSmem(int hs) {
  return sizeof(float) * (kGTile * (4 * hs + 1) + kWarps * kGRows * kGTile);
}
inline size_t BackwardKVGenericSmem(int hs) {
  return sizeof(float) *
         (2 * kGTile * (hs + 1) + 4 * kGTile * hs + 2 * kGTile + 2 * kWarps * kGRows * kGTile);
}
inline size_t BackwardQGenericSmem(int hs) {
  return sizeof(float) * (2 * kGTile * (hs + 1) + 3 * kGTile * hs + kWarps * kGRows * kGTile);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    ForwardGenericKernel(const T* qkv, T* out, float* lse, int Tn, int C, int H, float scale) {
  ISTHMUS_DYNAMIC_SMEM(float, smem);
  const int hs = C / H, kpad = hs + 1;
  const int bh = blockIdx.x, b = bh / H, h = bh % H;
  const int nq = (Tn + kGTile - 1) / kGTile;
  const int qt = nq - 1 - static_cast<int>(blockIdx.y);  // the longest rows start first
  const int q0 = qt * kGTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* qs = smem;                                       // [32][hs], scaled
  float* ks = qs + kGTile * hs;                           // [32][hs+1]
  float* vs = ks + kGTile * kpad;                         // [32][hs]
  float* os = vs + kGTile * hs;                           // [32][hs] unnormalised output
  float* ps = os + kGTile * hs + warp * kGRows * kGTile;  // [8][32] this warp's P
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const T* base = qkv + static_cast<int64_t>(b) * Tn * ld + static_cast<int64_t>(h) * hs;

  for (int i = threadIdx.x; i < kGTile * hs; i += kThreads) {
    const int t = q0 + i / hs;
    qs[i] = t < Tn ? ToFloat(base[t * ld + i % hs]) * scale : 0.0f;
    os[i] = 0.0f;
  }
  float m[kGRows], l[kGRows];
  for (int r = 0; r < kGRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  const float* qw = qs + warp * kGRows * hs;
  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * kGTile;
    __syncthreads();
    for (int i = threadIdx.x; i < kGTile * hs; i += kThreads) {
      const int r = i / hs, c = i % hs, t = k0 + r;
      ks[r * kpad + c] = t < Tn ? ToFloat(base[t * ld + C + c]) : 0.0f;
      vs[i] = t < Tn ? ToFloat(base[t * ld + 2 * C + c]) : 0.0f;
    }
    __syncthreads();
    float s[kGRows];
    for (int r = 0; r < kGRows; ++r) s[r] = 0.0f;
    const float* krow = ks + lane * kpad;
    for (int c = 0; c < hs; ++c) {
      const float kc = krow[c];
#pragma unroll
      for (int r = 0; r < kGRows; ++r) s[r] += qw[r * hs + c] * kc;
    }
    float alpha[kGRows];
#pragma unroll
    for (int r = 0; r < kGRows; ++r) {
      const int t = q0 + warp * kGRows + r;
      const float sv = k0 + lane <= t ? s[r] : -INFINITY;
      const float m_new = fmaxf(m[r], WarpMax(sv));  // finite: key 0 is in every row
      alpha[r] = expf(m[r] - m_new);
      const float p = expf(sv - m_new);
      l[r] = l[r] * alpha[r] + WarpSum(p);
      m[r] = m_new;
      ps[r * kGTile + lane] = p;
    }
    __syncwarp();
    for (int c = lane; c < hs; c += 32) {
      float vc[kGTile];
#pragma unroll
      for (int j = 0; j < kGTile; ++j) vc[j] = vs[j * hs + c];
#pragma unroll
      for (int r = 0; r < kGRows; ++r) {
        float* o = os + (warp * kGRows + r) * hs + c;
        float acc = *o * alpha[r];
#pragma unroll
        for (int j = 0; j < kGTile; ++j) acc += ps[r * kGTile + j] * vc[j];
        *o = acc;
      }
    }
  }
  for (int r = 0; r < kGRows; ++r) {
    const int t = q0 + warp * kGRows + r;
    if (t >= Tn) break;
    const float inv = 1.0f / l[r];
    T* o = out + (static_cast<int64_t>(b) * Tn + t) * C + static_cast<int64_t>(h) * hs;
    for (int c = lane; c < hs; c += 32) {
      o[c] = FromFloat<T>(os[(warp * kGRows + r) * hs + c] * inv);
    }
    if (lane == 0) lse[static_cast<int64_t>(bh) * Tn + t] = m[r] + logf(l[r]);
  }
}

// dK and dV of one 32-key tile, over the query tiles at or after it.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    BackwardKVGenericKernel(const T* dout, const T* qkv, const float* lse, const float* dsum,
                            T* dqkv, int Tn, int C, int H, float scale) {
  ISTHMUS_DYNAMIC_SMEM(float, smem);
  const int hs = C / H, kpad = hs + 1;
  const int bh = blockIdx.x, b = bh / H, h = bh % H;
  const int nq = (Tn + kGTile - 1) / kGTile;
  const int kt = blockIdx.y, k0 = kt * kGTile;  // the longest loops start first
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* qs = smem;                                      // [32][hs+1]
  float* dos = qs + kGTile * kpad;                       // [32][hs+1]
  float* ks = dos + kGTile * kpad;                       // [32][hs]
  float* vs = ks + kGTile * hs;                          // [32][hs]
  float* dks = vs + kGTile * hs;                         // [32][hs] accumulators
  float* dvs = dks + kGTile * hs;                        // [32][hs]
  float* ls = dvs + kGTile * hs;                         // [32] lse of the query tile, +inf past Tn
  float* dd = ls + kGTile;                               // [32] D of the query tile
  float* pw = dd + kGTile + warp * 2 * kGRows * kGTile;  // [8 keys][32 queries] P
  float* dsw = pw + kGRows * kGTile;                     // [8][32] dS
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const int64_t head = static_cast<int64_t>(h) * hs;
  const T* base = qkv + static_cast<int64_t>(b) * Tn * ld + head;
  const T* dbase = dout + static_cast<int64_t>(b) * Tn * C + head;

  for (int i = threadIdx.x; i < kGTile * hs; i += kThreads) {
    const int t = k0 + i / hs, c = i % hs;
    ks[i] = t < Tn ? ToFloat(base[t * ld + C + c]) : 0.0f;
    vs[i] = t < Tn ? ToFloat(base[t * ld + 2 * C + c]) : 0.0f;
    dks[i] = 0.0f;
    dvs[i] = 0.0f;
  }
  const float* kw = ks + warp * kGRows * hs;
  const float* vw = vs + warp * kGRows * hs;
  for (int qt = kt; qt < nq; ++qt) {
    const int q0 = qt * kGTile;
    __syncthreads();
    for (int i = threadIdx.x; i < kGTile * hs; i += kThreads) {
      const int r = i / hs, c = i % hs, t = q0 + r;
      qs[r * kpad + c] = t < Tn ? ToFloat(base[t * ld + c]) : 0.0f;
      dos[r * kpad + c] = t < Tn ? ToFloat(dbase[t * static_cast<int64_t>(C) + c]) : 0.0f;
    }
    if (threadIdx.x < kGTile) {
      const int t = q0 + threadIdx.x;
      ls[threadIdx.x] = t < Tn ? lse[static_cast<int64_t>(bh) * Tn + t] : INFINITY;
      dd[threadIdx.x] = t < Tn ? dsum[static_cast<int64_t>(bh) * Tn + t] : 0.0f;
    }
    __syncthreads();
    float s[kGRows], dp[kGRows];
    for (int r = 0; r < kGRows; ++r) s[r] = dp[r] = 0.0f;
    const float* qrow = qs + lane * kpad;
    const float* drow = dos + lane * kpad;
    for (int c = 0; c < hs; ++c) {
      const float qc = qrow[c], dc = drow[c];
#pragma unroll
      for (int r = 0; r < kGRows; ++r) {
        s[r] += qc * kw[r * hs + c];
        dp[r] += dc * vw[r * hs + c];
      }
    }
    const float li = ls[lane], di = dd[lane];
#pragma unroll
    for (int r = 0; r < kGRows; ++r) {
      const int key = k0 + warp * kGRows + r;
      const float p = key <= q0 + lane ? expf(s[r] * scale - li) : 0.0f;
      pw[r * kGTile + lane] = p;
      dsw[r * kGTile + lane] = p * (dp[r] - di);
    }
    __syncwarp();
    for (int c = lane; c < hs; c += 32) {
      float dk[kGRows], dv[kGRows];
#pragma unroll
      for (int r = 0; r < kGRows; ++r) {
        dk[r] = dks[(warp * kGRows + r) * hs + c];
        dv[r] = dvs[(warp * kGRows + r) * hs + c];
      }
      for (int i = 0; i < kGTile; ++i) {
        const float qc = qs[i * kpad + c], dc = dos[i * kpad + c];
#pragma unroll
        for (int r = 0; r < kGRows; ++r) {
          dv[r] += pw[r * kGTile + i] * dc;
          dk[r] += dsw[r * kGTile + i] * qc;
        }
      }
#pragma unroll
      for (int r = 0; r < kGRows; ++r) {
        dks[(warp * kGRows + r) * hs + c] = dk[r];
        dvs[(warp * kGRows + r) * hs + c] = dv[r];
      }
    }
  }
  for (int r = 0; r < kGRows; ++r) {
    const int t = k0 + warp * kGRows + r;
    if (t >= Tn) break;
    T* dst = dqkv + (static_cast<int64_t>(b) * Tn + t) * ld + head;
    for (int c = lane; c < hs; c += 32) {
      dst[C + c] = FromFloat<T>(dks[(warp * kGRows + r) * hs + c] * scale);
      dst[2 * C + c] = FromFloat<T>(dvs[(warp * kGRows + r) * hs + c]);
    }
  }
}

// dQ of one 32-query tile, over the key tiles at or before it.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    BackwardQGenericKernel(const T* dout, const T* qkv, const float* lse, const float* dsum,
                           T* dqkv, int Tn, int C, int H, float scale) {
  ISTHMUS_DYNAMIC_SMEM(float, smem);
  const int hs = C / H, kpad = hs + 1;
  const int bh = blockIdx.x, b = bh / H, h = bh % H;
  const int nq = (Tn + kGTile - 1) / kGTile;
  const int qt = nq - 1 - static_cast<int>(blockIdx.y), q0 = qt * kGTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* qs = smem;                                         // [32][hs]
  float* dos = qs + kGTile * hs;                            // [32][hs]
  float* ks = dos + kGTile * hs;                            // [32][hs+1]
  float* vs = ks + kGTile * kpad;                           // [32][hs+1]
  float* dqs = vs + kGTile * kpad;                          // [32][hs] accumulators
  float* dsw = dqs + kGTile * hs + warp * kGRows * kGTile;  // [8 queries][32 keys] dS
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const int64_t head = static_cast<int64_t>(h) * hs;
  const T* base = qkv + static_cast<int64_t>(b) * Tn * ld + head;
  const T* dbase = dout + static_cast<int64_t>(b) * Tn * C + head;

  for (int i = threadIdx.x; i < kGTile * hs; i += kThreads) {
    const int t = q0 + i / hs, c = i % hs;
    qs[i] = t < Tn ? ToFloat(base[t * ld + c]) : 0.0f;
    dos[i] = t < Tn ? ToFloat(dbase[t * static_cast<int64_t>(C) + c]) : 0.0f;
    dqs[i] = 0.0f;
  }
  float li[kGRows], di[kGRows];
  for (int r = 0; r < kGRows; ++r) {
    const int t = q0 + warp * kGRows + r;
    li[r] = t < Tn ? lse[static_cast<int64_t>(bh) * Tn + t] : 0.0f;
    di[r] = t < Tn ? dsum[static_cast<int64_t>(bh) * Tn + t] : 0.0f;
  }
  const float* qw = qs + warp * kGRows * hs;
  const float* dw = dos + warp * kGRows * hs;
  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * kGTile;
    __syncthreads();
    for (int i = threadIdx.x; i < kGTile * hs; i += kThreads) {
      const int r = i / hs, c = i % hs, t = k0 + r;
      ks[r * kpad + c] = t < Tn ? ToFloat(base[t * ld + C + c]) : 0.0f;
      vs[r * kpad + c] = t < Tn ? ToFloat(base[t * ld + 2 * C + c]) : 0.0f;
    }
    __syncthreads();
    float s[kGRows], dp[kGRows];
    for (int r = 0; r < kGRows; ++r) s[r] = dp[r] = 0.0f;
    const float* krow = ks + lane * kpad;
    const float* vrow = vs + lane * kpad;
    for (int c = 0; c < hs; ++c) {
      const float kc = krow[c], vc = vrow[c];
#pragma unroll
      for (int r = 0; r < kGRows; ++r) {
        s[r] += qw[r * hs + c] * kc;
        dp[r] += dw[r * hs + c] * vc;
      }
    }
#pragma unroll
    for (int r = 0; r < kGRows; ++r) {
      const int t = q0 + warp * kGRows + r;
      const float p = k0 + lane <= t ? expf(s[r] * scale - li[r]) : 0.0f;
      dsw[r * kGTile + lane] = p * (dp[r] - di[r]);
    }
    __syncwarp();
    for (int c = lane; c < hs; c += 32) {
      float dq[kGRows];
#pragma unroll
      for (int r = 0; r < kGRows; ++r) dq[r] = dqs[(warp * kGRows + r) * hs + c];
      for (int j = 0; j < kGTile; ++j) {
        const float kc = ks[j * kpad + c];
#pragma unroll
        for (int r = 0; r < kGRows; ++r) dq[r] += dsw[r * kGTile + j] * kc;
      }
#pragma unroll
      for (int r = 0; r < kGRows; ++r) dqs[(warp * kGRows + r) * hs + c] = dq[r];
    }
  }
  for (int r = 0; r < kGRows; ++r) {
    const int t = q0 + warp * kGRows + r;
    if (t >= Tn) break;
    T* dst = dqkv + (static_cast<int64_t>(b) * Tn + t) * ld + head;
    for (int c = lane; c < hs; c += 32) {
      dst[c] = FromFloat<T>(dqs[(warp * kGRows + r) * hs + c] * scale);
    }
  }
}

// ---- Tensor-core path (bf16, hs in {32, 64, 128}) -----------------------------------------
// FlashAttention-2 on mma.sync: tiles of 64 queries and 64 keys; each of the 4 warps owns
// 16 rows of the block's tile (queries in the forward and dQ kernels, keys in the dK/dV
// kernel) and computes its 16x64 score tile as eight 16x8 products (MmaBf16, fp32
// accumulate). The accumulator layout is fixed by the PTX ISA (ops/cuda_compat.h): lane
// l = 4g + t holds rows g and g + 8, columns 2t and 2t + 1 of each 8-column block. So
// softmax runs in registers (a row's max and sum are reduced over the 4 lanes of its
// quad), and the score accumulators of two adjacent 8-column blocks, rounded to bf16, are
// the matrix_a fragment of the next product (P V, P^T dO, dS K, dS^T Q) as they are.
// Operands that enter a product transposed (V, dO, Q, K as the right-hand side over the
// key or query axis) are read from shared memory with ldmatrix.trans. Tiles live in
// shared memory with rows padded by 8 elements (16 bytes), which makes the 32-bit fragment
// loads and the ldmatrix rows free of bank conflicts. Output accumulators (O, dQ, dK, dV)
// stay in registers for the whole kernel.
constexpr int kTTile = 64;            // queries or keys per tile
constexpr int kTBlocks = kTTile / 8;  // 8-column score blocks per tile
constexpr float kLog2e = 1.4426950408889634f;

inline bool TensorCoreHeadSize(int hs) { return hs == 32 || hs == 64 || hs == 128; }

template <int HS>
struct TcShape {
  static constexpr int kKc = HS / 16;  // 16-channel chunks (the k of Q K^T)
  static constexpr int kNd = HS / 8;   // 8-channel blocks of an output row
  static constexpr int kLd = HS + 8;   // bf16 elements per row of a Q/K/V/dO tile
  static constexpr int kTileBytes = kTTile * kLd * 2;
  static constexpr int kForwardSmem = 3 * kTileBytes;
  static constexpr int kBackwardKVSmem = 4 * kTileBytes + 2 * kTTile * 4;
  static constexpr int kBackwardQSmem = 4 * kTileBytes;
  static_assert(HS % 16 == 0 && kTileBytes % 16 == 0);
};

// Copies rows [0, 64) of a [rows][HS] bf16 tile (global rows `ld` elements apart) into a
// [64][HS+8] shared tile, 16 bytes per thread and step; rows >= valid become zeros.
template <int HS>
__device__ __forceinline__ void LoadTile(bf16* dst, const bf16* src, int64_t ld, int valid) {
  constexpr int kVec = HS / 8;
  for (int i = threadIdx.x; i < kTTile * kVec; i += kThreads) {
    const int r = i / kVec, v = i % kVec;
    int4 x = {0, 0, 0, 0};
    if (r < valid) x = *reinterpret_cast<const int4*>(src + r * ld + v * 8);
    *reinterpret_cast<int4*>(dst + r * TcShape<HS>::kLd + v * 8) = x;
  }
}

template <int N>
__device__ __forceinline__ void Zero(float (&acc)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;
  }
}

__device__ __forceinline__ uint32_t Ld32(const bf16* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// The matrix_a fragment of rows [0, 16) and channels [16c, 16c + 16) of a shared tile whose
// rows are `ld` elements apart (this lane: rows g and g + 8, channels 2t, 2t + 1 and 8 on).
__device__ __forceinline__ void LoadA(uint32_t (&a)[4], const bf16* tile, int ld, int c) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const bf16* p = tile + g * ld + 16 * c + 2 * t;
  a[0] = Ld32(p);
  a[1] = Ld32(p + 8 * ld);
  a[2] = Ld32(p + 8);
  a[3] = Ld32(p + 8 * ld + 8);
}

// s[j] += a-rows x (rows [8j, 8j + 8) of `tile`)^T over HS channels, for the 8-row blocks j
// in [lo, hi): the 16x64 score-shaped product of a warp's rows (fragments from `arows`,
// rows `ld` apart) with a 64-row tile.
template <int HS>
__device__ __forceinline__ void ScoreProduct(float (&s)[kTBlocks][4], const bf16* arows,
                                             const bf16* tile, int lo, int hi) {
  using S = TcShape<HS>;
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  Zero(s);
#pragma unroll
  for (int c = 0; c < S::kKc; ++c) {
    uint32_t a[4];
    LoadA(a, arows, S::kLd, c);
#pragma unroll
    for (int j = 0; j < kTBlocks; ++j) {
      if (j >= lo && j < hi) {
        const bf16* p = tile + (8 * j + g) * S::kLd + 16 * c + 2 * t;
        const uint32_t b[2] = {Ld32(p), Ld32(p + 8)};
        MmaBf16(s[j], a, b);
      }
    }
  }
}

// acc[n] += P x tile over the 64 rows of `tile` (keys or queries), for the 16-row chunks
// kc in [lo, 4): P is a warp's 16x64 score-shaped accumulator (p), rounded to bf16; tile
// rows are the k axis, its HS channels the n axis (read transposed by ldmatrix).
template <int HS>
__device__ __forceinline__ void ProductWithTile(float (&acc)[TcShape<HS>::kNd][4],
                                                const float (&p)[kTBlocks][4], const bf16* tile,
                                                int lo, int hi) {
  using S = TcShape<HS>;
  const int lane = threadIdx.x % 32;
  const int mat = lane / 8, mrow = lane % 8;  // the ldmatrix row this lane addresses
#pragma unroll
  for (int kc = 0; kc < kTTile / 16; ++kc) {
    if (kc >= lo && kc < hi) {
      const uint32_t a[4] = {PackBf16x2(p[2 * kc][0], p[2 * kc][1]),
                             PackBf16x2(p[2 * kc][2], p[2 * kc][3]),
                             PackBf16x2(p[2 * kc + 1][0], p[2 * kc + 1][1]),
                             PackBf16x2(p[2 * kc + 1][2], p[2 * kc + 1][3])};
      const bf16* rows = tile + (16 * kc + (mat % 2) * 8 + mrow) * S::kLd + (mat / 2) * 8;
#pragma unroll
      for (int n = 0; n < S::kNd; n += 2) {
        uint32_t b[4];
        LdMatrixX4Trans(b, rows + 8 * n);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        MmaBf16(acc[n], a, b0);
        MmaBf16(acc[n + 1], a, b1);
      }
    }
  }
}

// Writes a warp's 16 x HS accumulator (rows row0 + g and row0 + g + 8), times `mul`, to bf16
// global rows `ld` apart, skipping rows >= Tn.
template <int HS>
__device__ __forceinline__ void StoreAcc(bf16* dst, int64_t ld, const float (&acc)[HS / 8][4],
                                         int row0, int Tn, float mul0, float mul1) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + g + 8 * half;
    if (row >= Tn) continue;
    const float mul = half == 0 ? mul0 : mul1;
#pragma unroll
    for (int n = 0; n < HS / 8; ++n) {
      *reinterpret_cast<uint32_t*>(dst + row * ld + 8 * n + 2 * t) =
          PackBf16x2(acc[n][2 * half] * mul, acc[n][2 * half + 1] * mul);
    }
  }
}

template <int HS>
__global__ void __launch_bounds__(kThreads)
    ForwardTcKernel(const bf16* qkv, bf16* out, float* lse, int Tn, int C, int H, float scale) {
  using S = TcShape<HS>;
  ISTHMUS_DYNAMIC_SMEM(bf16, qs);   // [64][kLd] this block's queries
  bf16* ks = qs + kTTile * S::kLd;  // [64][kLd] the current key tile
  bf16* vs = ks + kTTile * S::kLd;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int bh = blockIdx.x, b = bh / H, h = bh % H;
  const int nq = (Tn + kTTile - 1) / kTTile;
  const int qt = nq - 1 - static_cast<int>(blockIdx.y), q0 = qt * kTTile;
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const bf16* base = qkv + static_cast<int64_t>(b) * Tn * ld + static_cast<int64_t>(h) * HS;

  LoadTile<HS>(qs, base + q0 * ld, ld, Tn - q0);
  float o[S::kNd][4];
  Zero(o);
  // Per row (g, g + 8): running max of the scaled scores in log2 units, and this lane's
  // part of the running sum (the quad's four parts add up at the end).
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const float sl2 = scale * kLog2e;
  const int row_lo = q0 + warp * 16 + g;  // this lane's first row; the second is + 8
  const bf16* qw = qs + warp * 16 * S::kLd;
  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * kTTile;
    // On the diagonal, key blocks after this warp's rows are entirely in the future.
    const bool diag = kt == qt;
    __syncthreads();
    LoadTile<HS>(ks, base + k0 * ld + C, ld, Tn - k0);
    LoadTile<HS>(vs, base + k0 * ld + 2 * C, ld, Tn - k0);
    __syncthreads();
    float s[kTBlocks][4];
    ScoreProduct<HS>(s, qw, ks, 0, diag ? 2 * warp + 2 : kTBlocks);  // S = Q_w K^T
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kTBlocks; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + 8 * j + 2 * t + e % 2, row = row_lo + 8 * (e / 2);
        s[j][e] = diag && key > row ? -INFINITY : s[j][e] * sl2;
        mx[e / 2] = fmaxf(mx[e / 2], s[j][e]);
      }
    }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(kFullMask, mx[r], 2));
      const float m_new = fmaxf(m[r], mx[r]);  // finite: key 0 / the diagonal is in every row
      alpha[r] = exp2f(m[r] - m_new);
      m[r] = m_new;
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int j = 0; j < kTBlocks; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = exp2f(s[j][e] - m[e / 2]);
        l[e / 2] += s[j][e];
      }
    }
#pragma unroll
    for (int n = 0; n < S::kNd; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e / 2];
    }
    ProductWithTile<HS>(o, s, vs, 0, diag ? warp + 1 : kTTile / 16);
  }
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(kFullMask, l[r], 1);
    l[r] += __shfl_xor_sync(kFullMask, l[r], 2);
    inv[r] = 1.0f / l[r];
  }
  StoreAcc<HS>(out + static_cast<int64_t>(b) * Tn * C + static_cast<int64_t>(h) * HS, C, o,
               q0 + warp * 16, Tn, inv[0], inv[1]);
  if (t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_lo + 8 * r;
      if (row < Tn) lse[static_cast<int64_t>(bh) * Tn + row] = m[r] / kLog2e + logf(l[r]);
    }
  }
}

// dK and dV of one 64-key tile (warp w: keys 16w..16w+15), over the query tiles at or
// after it. Scores are computed transposed (keys x queries), so that P^T and dS^T are the
// matrix_a operands of dV += P^T dO and dK += dS^T Q straight from the accumulators.
template <int HS>
__global__ void __launch_bounds__(kThreads)
    BackwardKVTcKernel(const bf16* dout, const bf16* qkv, const float* lse, const float* dsum,
                       bf16* dqkv, int Tn, int C, int H, float scale) {
  using S = TcShape<HS>;
  ISTHMUS_DYNAMIC_SMEM(bf16, ks);  // [64][kLd] this block's keys
  bf16* vs = ks + kTTile * S::kLd;
  bf16* qs = vs + kTTile * S::kLd;  // [64][kLd] the current query tile
  bf16* dos = qs + kTTile * S::kLd;
  float* ls = reinterpret_cast<float*>(dos + kTTile * S::kLd);  // [64] lse in log2 units
  float* dd = ls + kTTile;                                      // [64] D
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int bh = blockIdx.x, b = bh / H, h = bh % H;
  const int nq = (Tn + kTTile - 1) / kTTile;
  const int kt = blockIdx.y, k0 = kt * kTTile;  // the longest loops start first
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const int64_t head = static_cast<int64_t>(h) * HS;
  const bf16* base = qkv + static_cast<int64_t>(b) * Tn * ld + head;
  const bf16* dbase = dout + static_cast<int64_t>(b) * Tn * C + head;

  LoadTile<HS>(ks, base + k0 * ld + C, ld, Tn - k0);
  LoadTile<HS>(vs, base + k0 * ld + 2 * C, ld, Tn - k0);
  float dk[S::kNd][4], dv[S::kNd][4];
  Zero(dk);
  Zero(dv);
  const float sl2 = scale * kLog2e;
  const int key_lo = k0 + warp * 16 + g;  // this lane's first key row; the second is + 8
  const bf16* kw = ks + warp * 16 * S::kLd;
  const bf16* vw = vs + warp * 16 * S::kLd;
  for (int qt = kt; qt < nq; ++qt) {
    const int q0 = qt * kTTile;
    // On the diagonal, query blocks before this warp's keys are entirely in the past.
    const bool diag = qt == kt;
    __syncthreads();
    LoadTile<HS>(qs, base + q0 * ld, ld, Tn - q0);
    LoadTile<HS>(dos, dbase + q0 * static_cast<int64_t>(C), C, Tn - q0);
    if (threadIdx.x < kTTile) {
      const int q = q0 + threadIdx.x;
      ls[threadIdx.x] = q < Tn ? lse[static_cast<int64_t>(bh) * Tn + q] * kLog2e : INFINITY;
      dd[threadIdx.x] = q < Tn ? dsum[static_cast<int64_t>(bh) * Tn + q] : 0.0f;
    }
    __syncthreads();
    float s[kTBlocks][4], dp[kTBlocks][4];
    const int j0 = diag ? 2 * warp : 0;
    ScoreProduct<HS>(s, kw, qs, j0, kTBlocks);    // S^T = K_w Q^T
    ScoreProduct<HS>(dp, vw, dos, j0, kTBlocks);  // dP^T = V_w dO^T
#pragma unroll
    for (int j = 0; j < kTBlocks; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * j + 2 * t + e % 2;  // query q0 + col
        const float p = q0 + col >= key_lo + 8 * (e / 2) ? exp2f(s[j][e] * sl2 - ls[col]) : 0.0f;
        s[j][e] = p;
        dp[j][e] = p * (dp[j][e] - dd[col]);
      }
    }
    const int kc0 = diag ? warp : 0;
    ProductWithTile<HS>(dv, s, dos, kc0, kTTile / 16);  // dV += P^T dO
    ProductWithTile<HS>(dk, dp, qs, kc0, kTTile / 16);  // dK += dS^T Q
  }
  bf16* dst = dqkv + static_cast<int64_t>(b) * Tn * ld + head;
  StoreAcc<HS>(dst + C, ld, dk, k0 + warp * 16, Tn, scale, scale);
  StoreAcc<HS>(dst + 2 * C, ld, dv, k0 + warp * 16, Tn, 1.0f, 1.0f);
}

// dQ of one 64-query tile (warp w: queries 16w..16w+15), over the key tiles at or before it.
template <int HS>
__global__ void __launch_bounds__(kThreads)
    BackwardQTcKernel(const bf16* dout, const bf16* qkv, const float* lse, const float* dsum,
                      bf16* dqkv, int Tn, int C, int H, float scale) {
  using S = TcShape<HS>;
  ISTHMUS_DYNAMIC_SMEM(bf16, qs);  // [64][kLd] this block's queries
  bf16* dos = qs + kTTile * S::kLd;
  bf16* ks = dos + kTTile * S::kLd;  // [64][kLd] the current key tile
  bf16* vs = ks + kTTile * S::kLd;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int bh = blockIdx.x, b = bh / H, h = bh % H;
  const int nq = (Tn + kTTile - 1) / kTTile;
  const int qt = nq - 1 - static_cast<int>(blockIdx.y), q0 = qt * kTTile;
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const int64_t head = static_cast<int64_t>(h) * HS;
  const bf16* base = qkv + static_cast<int64_t>(b) * Tn * ld + head;
  const bf16* dbase = dout + static_cast<int64_t>(b) * Tn * C + head;

  LoadTile<HS>(qs, base + q0 * ld, ld, Tn - q0);
  LoadTile<HS>(dos, dbase + q0 * static_cast<int64_t>(C), C, Tn - q0);
  const float sl2 = scale * kLog2e;
  const int row_lo = q0 + warp * 16 + g;  // this lane's first query row; the second is + 8
  float lr[2], dr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_lo + 8 * r;
    lr[r] = row < Tn ? lse[static_cast<int64_t>(bh) * Tn + row] * kLog2e : 0.0f;
    dr[r] = row < Tn ? dsum[static_cast<int64_t>(bh) * Tn + row] : 0.0f;
  }
  float dq[S::kNd][4];
  Zero(dq);
  const bf16* qw = qs + warp * 16 * S::kLd;
  const bf16* dw = dos + warp * 16 * S::kLd;
  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * kTTile;
    const bool diag = kt == qt;
    const int nj = diag ? 2 * warp + 2 : kTBlocks;
    __syncthreads();
    LoadTile<HS>(ks, base + k0 * ld + C, ld, Tn - k0);
    LoadTile<HS>(vs, base + k0 * ld + 2 * C, ld, Tn - k0);
    __syncthreads();
    float s[kTBlocks][4], dp[kTBlocks][4];
    ScoreProduct<HS>(s, qw, ks, 0, nj);   // S = Q_w K^T
    ScoreProduct<HS>(dp, dw, vs, 0, nj);  // dP = dO_w V^T
#pragma unroll
    for (int j = 0; j < kTBlocks; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + 8 * j + 2 * t + e % 2;
        const float p = key <= row_lo + 8 * (e / 2) ? exp2f(s[j][e] * sl2 - lr[e / 2]) : 0.0f;
        dp[j][e] = p * (dp[j][e] - dr[e / 2]);
      }
    }
    ProductWithTile<HS>(dq, dp, ks, 0, diag ? warp + 1 : kTTile / 16);  // dQ += dS K
  }
  StoreAcc<HS>(dqkv + static_cast<int64_t>(b) * Tn * ld + head, ld, dq, q0 + warp * 16, Tn, scale,
               scale);
}

// ---- Dispatch -------------------------------------------------------------------------------

// The most dynamic shared memory one block of any attention kernel asks for at head size
// hs, on whichever path it takes.
inline size_t MaxSmemBytes(int hs) {
  size_t m = ForwardGenericSmem(hs);
  m = m > BackwardKVGenericSmem(hs) ? m : BackwardKVGenericSmem(hs);
  m = m > BackwardQGenericSmem(hs) ? m : BackwardQGenericSmem(hs);
  auto tc = [&m](size_t forward, size_t kv, size_t q) {
    for (size_t x : {forward, kv, q}) m = m > x ? m : x;
  };
  if (hs == 32)
    tc(TcShape<32>::kForwardSmem, TcShape<32>::kBackwardKVSmem, TcShape<32>::kBackwardQSmem);
  if (hs == 64)
    tc(TcShape<64>::kForwardSmem, TcShape<64>::kBackwardKVSmem, TcShape<64>::kBackwardQSmem);
  if (hs == 128) {
    tc(TcShape<128>::kForwardSmem, TcShape<128>::kBackwardKVSmem, TcShape<128>::kBackwardQSmem);
  }
  return m;
}

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether the tensor-core path takes these arguments: bf16, a supported head size, and
// tensors whose rows start on 16-byte boundaries (the tile loads are 16 bytes wide).
template <typename T>
bool UsesTensorCores(int C, int H, const void* a, const void* b, const void* c = nullptr,
                     const void* d = nullptr) {
  if constexpr (!std::is_same_v<T, bf16>) {
    return false;
  } else {
    return TensorCoreHeadSize(C / H) && Aligned16(a) && Aligned16(b) && Aligned16(c) &&
           Aligned16(d);
  }
}

template <typename Kernel>
void AllowSmem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) ISTHMUS_ALLOW_SMEM(kernel, static_cast<int>(bytes));
}

inline float Scale(int C, int H) { return 1.0f / sqrtf(static_cast<float>(C / H)); }

template <int HS>
void ForwardTc(const bf16* qkv, bf16* out, float* lse, int B, int Tn, int C, int H,
               cudaStream_t stream) {
  const size_t smem = TcShape<HS>::kForwardSmem;
  AllowSmem(ForwardTcKernel<HS>, smem);
  ISTHMUS_LAUNCH(ForwardTcKernel<HS>, dim3(B * H, CeilDiv(Tn, kTTile)), dim3(kThreads), smem,
                 stream, qkv, out, lse, Tn, C, H, Scale(C, H));
}

template <int HS>
void BackwardTc(const bf16* dout, const bf16* qkv, const float* lse, const float* dsum, bf16* dqkv,
                int B, int Tn, int C, int H, cudaStream_t stream) {
  const dim3 grid(B * H, CeilDiv(Tn, kTTile));
  const size_t kv_smem = TcShape<HS>::kBackwardKVSmem;
  AllowSmem(BackwardKVTcKernel<HS>, kv_smem);
  ISTHMUS_LAUNCH(BackwardKVTcKernel<HS>, grid, dim3(kThreads), kv_smem, stream, dout, qkv, lse,
                 dsum, dqkv, Tn, C, H, Scale(C, H));
  const size_t q_smem = TcShape<HS>::kBackwardQSmem;
  AllowSmem(BackwardQTcKernel<HS>, q_smem);
  ISTHMUS_LAUNCH(BackwardQTcKernel<HS>, grid, dim3(kThreads), q_smem, stream, dout, qkv, lse, dsum,
                 dqkv, Tn, C, H, Scale(C, H));
}

template <typename T>
void Forward(AttentionPath path, const T* qkv, T* out, float* lse, int B, int Tn, int C, int H,
             cudaStream_t stream) {
  if (B <= 0 || Tn <= 0) return;  // nothing to do (and an empty grid is a launch error)
  if constexpr (std::is_same_v<T, bf16>) {
    if (path == AttentionPath::kBest && UsesTensorCores<T>(C, H, qkv, out)) {
      switch (C / H) {
        case 32:
          return ForwardTc<32>(qkv, out, lse, B, Tn, C, H, stream);
        case 64:
          return ForwardTc<64>(qkv, out, lse, B, Tn, C, H, stream);
        case 128:
          return ForwardTc<128>(qkv, out, lse, B, Tn, C, H, stream);
      }
    }
  }
  const size_t smem = ForwardGenericSmem(C / H);
  AllowSmem(ForwardGenericKernel<T>, smem);
  ISTHMUS_LAUNCH(ForwardGenericKernel<T>, dim3(B * H, CeilDiv(Tn, kGTile)), dim3(kThreads), smem,
                 stream, qkv, out, lse, Tn, C, H, Scale(C, H));
}

template <typename T>
void Backward(AttentionPath path, const T* dout, const T* qkv, const T* out, const float* lse,
              T* dqkv, float* scratch, int B, int Tn, int C, int H, cudaStream_t stream) {
  if (B <= 0 || Tn <= 0) return;
  const int64_t rows = static_cast<int64_t>(B) * H * Tn;
  ISTHMUS_LAUNCH(RowDotKernel<T>, dim3(CeilDiv(rows, 8)), dim3(256), 0, stream, dout, out, scratch,
                 B, Tn, C, H);
  if constexpr (std::is_same_v<T, bf16>) {
    if (path == AttentionPath::kBest && UsesTensorCores<T>(C, H, dout, qkv, dqkv)) {
      switch (C / H) {
        case 32:
          return BackwardTc<32>(dout, qkv, lse, scratch, dqkv, B, Tn, C, H, stream);
        case 64:
          return BackwardTc<64>(dout, qkv, lse, scratch, dqkv, B, Tn, C, H, stream);
        case 128:
          return BackwardTc<128>(dout, qkv, lse, scratch, dqkv, B, Tn, C, H, stream);
      }
    }
  }
  const dim3 grid(B * H, CeilDiv(Tn, kGTile));
  const size_t kv_smem = BackwardKVGenericSmem(C / H);
  AllowSmem(BackwardKVGenericKernel<T>, kv_smem);
  ISTHMUS_LAUNCH(BackwardKVGenericKernel<T>, grid, dim3(kThreads), kv_smem, stream, dout, qkv, lse,
                 scratch, dqkv, Tn, C, H, Scale(C, H));
  const size_t q_smem = BackwardQGenericSmem(C / H);
  AllowSmem(BackwardQGenericKernel<T>, q_smem);
  ISTHMUS_LAUNCH(BackwardQGenericKernel<T>, grid, dim3(kThreads), q_smem, stream, dout, qkv, lse,
                 scratch, dqkv, Tn, C, H, Scale(C, H));
}

}  // namespace
}  // namespace attention_detail

template <typename T>
void LaunchAttentionForward(const T* qkv, T* out, float* lse, int B, int Tn, int C, int H,
                            cudaStream_t stream) {
  attention_detail::Forward(attention_detail::AttentionPath::kBest, qkv, out, lse, B, Tn, C, H,
                            stream);
}

template <typename T>
void LaunchAttentionBackward(const T* dout, const T* qkv, const T* out, const float* lse, T* dqkv,
                             float* scratch, int B, int Tn, int C, int H, cudaStream_t stream) {
  attention_detail::Backward(attention_detail::AttentionPath::kBest, dout, qkv, out, lse, dqkv,
                             scratch, B, Tn, C, H, stream);
}

inline size_t AttentionSharedBytes(int C, int H) { return attention_detail::MaxSmemBytes(C / H); }

}  // namespace isthmus::ops::ISTHMUS_CUDA_NS
