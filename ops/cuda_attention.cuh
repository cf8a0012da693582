// Causal multi-head self-attention of the CUDA backend, flash-style: scores live only in
// tiles, the forward keeps a running max and sum per query row (online softmax) and saves
// each row's log-sum-exp, and the backward recomputes the probabilities from it
// (FlashAttention-2). Two implementations behind one launcher: a CUDA-core path for any
// element type and head size, and a tensor-core path (WMMA, bf16 in, fp32 accumulate) for
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
// Tiles of 64 queries and 64 keys; each of the 4 warps owns 16 rows of the block's tile
// (queries in the forward and dQ kernels, keys in the dK/dV kernel) and computes its 16x64
// score tile with 16x16x16 WMMA products. WMMA's register layout is opaque, so per-row work
// goes through a per-warp fp32 scratch tile: store the scores, let each lane pair own one
// row (lane/2) and every other column of it, write P (or dS) back as bf16 and load it as a
// matrix_a operand. Per-row factors that must scale an accumulator (the online-softmax
// rescale, 1/l) are written as a 16x16 tile whose row r holds row r's factor and loaded as
// an accumulator fragment: two accumulator fragments share one element layout, so an
// element-wise product applies the right factor to every element.
// Output accumulators (O, dQ, dK, dV) stay in registers for the whole kernel.
namespace wmma = nvcuda::wmma;
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;
using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

constexpr int kTTile = 64;             // queries or keys per tile
constexpr int kTBlocks = kTTile / 16;  // 16-row blocks per tile, one per warp
constexpr int kPLd = kTTile + 8;       // bf16 elements per P/dS row: 16-byte multiple, and
                                       // rows 4 banks apart for the fragment loads
constexpr int kAlignSlack = 16;        // dynamic smem is 16-byte aligned; WMMA needs 32

inline bool TensorCoreHeadSize(int hs) { return hs == 32 || hs == 64 || hs == 128; }

template <int HS>
struct TcShape {
  static constexpr int kCb = HS / 16;  // 16-channel blocks
  static constexpr int kLd = HS + 8;   // bf16 elements per row of a Q/K/V/dO tile
  static constexpr int kTileBytes = kTTile * kLd * 2;
  static constexpr int kFLd = (HS > kTTile ? HS : kTTile) + 4;  // floats per scratch row
  static constexpr int kFBytes = 16 * kFLd * 4;                 // a warp's [16][kFLd] fp32 scratch
  static constexpr int kPBytes = 16 * kPLd * 2;                 // a warp's [16][kPLd] bf16 P or dS
  static constexpr int kForwardSmem = 2 * kTileBytes + kWarps * (kFBytes + kPBytes + 1024);
  static constexpr int kBackwardKVSmem =
      4 * kTileBytes + 2 * kTTile * 4 + kWarps * (2 * kFBytes + 2 * kPBytes);
  static constexpr int kBackwardQSmem = 4 * kTileBytes + kWarps * (2 * kFBytes + kPBytes);
  static_assert(HS % 16 == 0 && kTileBytes % 32 == 0 && kFBytes % 32 == 0 && kPBytes % 32 == 0);
};

__device__ __forceinline__ unsigned char* AlignSmem32(unsigned char* p) {
  return p + (32 - reinterpret_cast<uintptr_t>(p) % 32) % 32;
}

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

// Writes a warp's 16 rows of fp32 scratch (row r holds row0 + r) to bf16 global rows `ld`
// apart, skipping rows >= Tn.
template <int HS>
__device__ __forceinline__ void StoreRows(bf16* dst, int64_t ld, const float* sw, int row0,
                                          int Tn) {
  const int lane = threadIdx.x % 32;
  for (int i = lane; i < 16 * HS; i += 32) {
    const int r = i / HS, c = i % HS;
    if (row0 + r < Tn) dst[(row0 + r) * ld + c] = __float2bfloat16(sw[r * TcShape<HS>::kFLd + c]);
  }
}

template <int HS>
__global__ void __launch_bounds__(kThreads)
    ForwardTcKernel(const bf16* qkv, bf16* out, float* lse, int Tn, int C, int H, float scale) {
  using S = TcShape<HS>;
  constexpr int kLd = S::kLd, kFLd = S::kFLd, kCb = S::kCb;
  ISTHMUS_DYNAMIC_SMEM(unsigned char, raw);
  unsigned char* smem = AlignSmem32(raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  bf16* ks = reinterpret_cast<bf16*>(smem);  // [64][kLd]; holds Q before the loop
  bf16* vs = ks + kTTile * kLd;              // [64][kLd]
  unsigned char* mine = smem + 2 * S::kTileBytes + warp * (S::kFBytes + S::kPBytes + 1024);
  float* sw = reinterpret_cast<float*>(mine);                            // [16][kFLd]
  bf16* pw = reinterpret_cast<bf16*>(mine + S::kFBytes);                 // [16][kPLd]
  float* aw = reinterpret_cast<float*>(mine + S::kFBytes + S::kPBytes);  // [16][16]

  const int bh = blockIdx.x, b = bh / H, h = bh % H;
  const int nq = (Tn + kTTile - 1) / kTTile;
  const int qt = nq - 1 - static_cast<int>(blockIdx.y), q0 = qt * kTTile;
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const bf16* base = qkv + static_cast<int64_t>(b) * Tn * ld + static_cast<int64_t>(h) * HS;

  LoadTile<HS>(ks, base + q0 * ld, ld, Tn - q0);
  __syncthreads();
  FragA qf[kCb];
#pragma unroll
  for (int cb = 0; cb < kCb; ++cb)
    wmma::load_matrix_sync(qf[cb], ks + warp * 16 * kLd + cb * 16, kLd);
  FragAcc of[kCb];
#pragma unroll
  for (int cb = 0; cb < kCb; ++cb) wmma::fill_fragment(of[cb], 0.0f);

  const int r = lane / 2, half = lane % 2;  // this lane's softmax row and column parity
  const int t = q0 + warp * 16 + r;
  float m = -INFINITY, l = 0.0f;
  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * kTTile;
    // On the diagonal, key blocks after this warp's block are entirely in the future.
    const int nkb = kt == qt ? warp + 1 : kTBlocks;
    __syncthreads();
    LoadTile<HS>(ks, base + k0 * ld + C, ld, Tn - k0);
    LoadTile<HS>(vs, base + k0 * ld + 2 * C, ld, Tn - k0);
    __syncthreads();
    {
      FragAcc sf[kTBlocks];
#pragma unroll
      for (int kb = 0; kb < kTBlocks; ++kb) wmma::fill_fragment(sf[kb], 0.0f);
#pragma unroll
      for (int cb = 0; cb < kCb; ++cb) {
#pragma unroll
        for (int kb = 0; kb < kTBlocks; ++kb) {
          if (kb < nkb) {
            FragBCol kf;  // K^T: K row-major is K^T column-major
            wmma::load_matrix_sync(kf, ks + kb * 16 * kLd + cb * 16, kLd);
            wmma::mma_sync(sf[kb], qf[cb], kf, sf[kb]);
          }
        }
      }
#pragma unroll
      for (int kb = 0; kb < kTBlocks; ++kb) {
        if (kb < nkb) wmma::store_matrix_sync(sw + kb * 16, sf[kb], kFLd, wmma::mem_row_major);
      }
    }
    __syncwarp();
    const int ncol = nkb * 16;
    float mx = -INFINITY;
    for (int k = 0; k < kTTile / 2; ++k) {
      const int col = 2 * k + half;
      if (col < ncol && k0 + col <= t) mx = fmaxf(mx, sw[r * kFLd + col]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
    const float m_new = fmaxf(m, mx * scale);  // finite: key 0 / the diagonal is in every row
    const float alpha = __expf(m - m_new);
    float sum = 0.0f;
    for (int k = 0; k < kTTile / 2; ++k) {
      const int col = 2 * k + half;
      if (col < ncol) {
        const float p = k0 + col <= t ? __expf(sw[r * kFLd + col] * scale - m_new) : 0.0f;
        pw[r * kPLd + col] = __float2bfloat16(p);
        sum += p;
      }
    }
    sum += __shfl_xor_sync(kFullMask, sum, 1);
    l = l * alpha + sum;
    m = m_new;
    for (int k = 0; k < 8; ++k) aw[r * 16 + half * 8 + k] = alpha;
    __syncwarp();
    FragAcc af;
    wmma::load_matrix_sync(af, aw, 16, wmma::mem_row_major);
#pragma unroll
    for (int cb = 0; cb < kCb; ++cb) {
      for (int i = 0; i < af.num_elements; ++i) of[cb].x[i] *= af.x[i];
    }
#pragma unroll
    for (int kb = 0; kb < kTBlocks; ++kb) {
      if (kb < nkb) {
        FragA pf;
        wmma::load_matrix_sync(pf, pw + kb * 16, kPLd);
#pragma unroll
        for (int cb = 0; cb < kCb; ++cb) {
          FragBRow vf;
          wmma::load_matrix_sync(vf, vs + kb * 16 * kLd + cb * 16, kLd);
          wmma::mma_sync(of[cb], pf, vf, of[cb]);
        }
      }
    }
  }
  __syncwarp();  // every lane has loaded the last factors from aw
  const float inv = 1.0f / l;
  for (int k = 0; k < 8; ++k) aw[r * 16 + half * 8 + k] = inv;
  __syncwarp();
  FragAcc af;
  wmma::load_matrix_sync(af, aw, 16, wmma::mem_row_major);
#pragma unroll
  for (int cb = 0; cb < kCb; ++cb) {
    for (int i = 0; i < af.num_elements; ++i) of[cb].x[i] *= af.x[i];
    wmma::store_matrix_sync(sw + cb * 16, of[cb], kFLd, wmma::mem_row_major);
  }
  __syncwarp();
  StoreRows<HS>(out + static_cast<int64_t>(b) * Tn * C + static_cast<int64_t>(h) * HS, C, sw,
                q0 + warp * 16, Tn);
  if (half == 0 && t < Tn) lse[static_cast<int64_t>(bh) * Tn + t] = m + logf(l);
}

// The two score-shaped products of a backward warp: out0 = a0 b0^T and out1 = a1 b1^T,
// where a0/a1 are the warp's 16 rows (HS channels, rows kLd apart) and b0/b1 64-row tiles,
// for the 16-column blocks [lo, hi) only; written as fp32 rows kFLd apart.
template <int HS>
__device__ __forceinline__ void TwoProducts(const bf16* a0, const bf16* b0, float* out0,
                                            const bf16* a1, const bf16* b1, float* out1, int lo,
                                            int hi) {
  using S = TcShape<HS>;
  FragAcc sf[kTBlocks];
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const bf16* a = pass == 0 ? a0 : a1;
    const bf16* bt = pass == 0 ? b0 : b1;
#pragma unroll
    for (int nb = 0; nb < kTBlocks; ++nb) wmma::fill_fragment(sf[nb], 0.0f);
#pragma unroll
    for (int cb = 0; cb < S::kCb; ++cb) {
      FragA af;
      wmma::load_matrix_sync(af, a + cb * 16, S::kLd);
#pragma unroll
      for (int nb = 0; nb < kTBlocks; ++nb) {
        if (nb >= lo && nb < hi) {
          FragBCol bf;
          wmma::load_matrix_sync(bf, bt + nb * 16 * S::kLd + cb * 16, S::kLd);
          wmma::mma_sync(sf[nb], af, bf, sf[nb]);
        }
      }
    }
    float* dst = pass == 0 ? out0 : out1;
#pragma unroll
    for (int nb = 0; nb < kTBlocks; ++nb) {
      if (nb >= lo && nb < hi) {
        wmma::store_matrix_sync(dst + nb * 16, sf[nb], S::kFLd, wmma::mem_row_major);
      }
    }
  }
}

// dK and dV of one 64-key tile (warp w: keys 16w..16w+15), over the query tiles at or
// after it. Scores are computed transposed (keys x queries) so that P^T and dS^T are the
// matrix_a operands of dV += P^T dO and dK += dS^T Q.
template <int HS>
__global__ void __launch_bounds__(kThreads)
    BackwardKVTcKernel(const bf16* dout, const bf16* qkv, const float* lse, const float* dsum,
                       bf16* dqkv, int Tn, int C, int H, float scale) {
  using S = TcShape<HS>;
  constexpr int kLd = S::kLd, kFLd = S::kFLd, kCb = S::kCb;
  ISTHMUS_DYNAMIC_SMEM(unsigned char, raw);
  unsigned char* smem = AlignSmem32(raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  bf16* ks = reinterpret_cast<bf16*>(smem);  // [64][kLd] this block's keys
  bf16* vs = ks + kTTile * kLd;
  bf16* qs = vs + kTTile * kLd;  // [64][kLd] the current query tile
  bf16* dos = qs + kTTile * kLd;
  float* ls = reinterpret_cast<float*>(dos + kTTile * kLd);  // [64] lse, +inf past Tn
  float* dd = ls + kTTile;                                   // [64] D
  unsigned char* mine =
      reinterpret_cast<unsigned char*>(dd + kTTile) + warp * (2 * S::kFBytes + 2 * S::kPBytes);
  float* sw = reinterpret_cast<float*>(mine);                               // S^T
  float* dpw = reinterpret_cast<float*>(mine + S::kFBytes);                 // dP^T
  bf16* pw = reinterpret_cast<bf16*>(mine + 2 * S::kFBytes);                // P^T
  bf16* dsw = reinterpret_cast<bf16*>(mine + 2 * S::kFBytes + S::kPBytes);  // dS^T

  const int bh = blockIdx.x, b = bh / H, h = bh % H;
  const int nq = (Tn + kTTile - 1) / kTTile;
  const int kt = blockIdx.y, k0 = kt * kTTile;  // the longest loops start first
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const int64_t head = static_cast<int64_t>(h) * HS;
  const bf16* base = qkv + static_cast<int64_t>(b) * Tn * ld + head;
  const bf16* dbase = dout + static_cast<int64_t>(b) * Tn * C + head;

  LoadTile<HS>(ks, base + k0 * ld + C, ld, Tn - k0);
  LoadTile<HS>(vs, base + k0 * ld + 2 * C, ld, Tn - k0);
  FragAcc dkf[kCb], dvf[kCb];
#pragma unroll
  for (int cb = 0; cb < kCb; ++cb) {
    wmma::fill_fragment(dkf[cb], 0.0f);
    wmma::fill_fragment(dvf[cb], 0.0f);
  }
  const int r = lane / 2, half = lane % 2;
  const int key = k0 + warp * 16 + r;
  const bf16* kw = ks + warp * 16 * kLd;
  const bf16* vw = vs + warp * 16 * kLd;
  for (int qt = kt; qt < nq; ++qt) {
    const int q0 = qt * kTTile;
    // On the diagonal, query blocks before this warp's block are entirely in the past.
    const int nb0 = qt == kt ? warp : 0;
    __syncthreads();
    LoadTile<HS>(qs, base + q0 * ld, ld, Tn - q0);
    LoadTile<HS>(dos, dbase + q0 * static_cast<int64_t>(C), C, Tn - q0);
    if (threadIdx.x < kTTile) {
      const int t = q0 + threadIdx.x;
      ls[threadIdx.x] = t < Tn ? lse[static_cast<int64_t>(bh) * Tn + t] : INFINITY;
      dd[threadIdx.x] = t < Tn ? dsum[static_cast<int64_t>(bh) * Tn + t] : 0.0f;
    }
    __syncthreads();
    // S^T = K_w Q^T, then dP^T = V_w dO^T.
    TwoProducts<HS>(kw, qs, sw, vw, dos, dpw, nb0, kTBlocks);
    __syncwarp();
    for (int k = 0; k < kTTile / 2; ++k) {
      const int col = 2 * k + half;  // query q0 + col
      if (col >= nb0 * 16) {
        const float p = q0 + col >= key ? __expf(sw[r * kFLd + col] * scale - ls[col]) : 0.0f;
        pw[r * kPLd + col] = __float2bfloat16(p);
        dsw[r * kPLd + col] = __float2bfloat16(p * (dpw[r * kFLd + col] - dd[col]));
      }
    }
    __syncwarp();
#pragma unroll
    for (int nb = 0; nb < kTBlocks; ++nb) {
      if (nb >= nb0) {
        FragA pf, dsf;
        wmma::load_matrix_sync(pf, pw + nb * 16, kPLd);
        wmma::load_matrix_sync(dsf, dsw + nb * 16, kPLd);
#pragma unroll
        for (int cb = 0; cb < kCb; ++cb) {
          FragBRow bf;
          wmma::load_matrix_sync(bf, dos + nb * 16 * kLd + cb * 16, kLd);
          wmma::mma_sync(dvf[cb], pf, bf, dvf[cb]);
          wmma::load_matrix_sync(bf, qs + nb * 16 * kLd + cb * 16, kLd);
          wmma::mma_sync(dkf[cb], dsf, bf, dkf[cb]);
        }
      }
    }
  }
  bf16* dst = dqkv + static_cast<int64_t>(b) * Tn * ld + head;
  __syncwarp();  // sw is reused for staging
#pragma unroll
  for (int cb = 0; cb < kCb; ++cb) {
    for (int i = 0; i < dkf[cb].num_elements; ++i) dkf[cb].x[i] *= scale;
    wmma::store_matrix_sync(sw + cb * 16, dkf[cb], kFLd, wmma::mem_row_major);
  }
  __syncwarp();
  StoreRows<HS>(dst + C, ld, sw, k0 + warp * 16, Tn);
  __syncwarp();
#pragma unroll
  for (int cb = 0; cb < kCb; ++cb) {
    wmma::store_matrix_sync(sw + cb * 16, dvf[cb], kFLd, wmma::mem_row_major);
  }
  __syncwarp();
  StoreRows<HS>(dst + 2 * C, ld, sw, k0 + warp * 16, Tn);
}

// dQ of one 64-query tile (warp w: queries 16w..16w+15), over the key tiles at or before it.
template <int HS>
__global__ void __launch_bounds__(kThreads)
    BackwardQTcKernel(const bf16* dout, const bf16* qkv, const float* lse, const float* dsum,
                      bf16* dqkv, int Tn, int C, int H, float scale) {
  using S = TcShape<HS>;
  constexpr int kLd = S::kLd, kFLd = S::kFLd, kCb = S::kCb;
  ISTHMUS_DYNAMIC_SMEM(unsigned char, raw);
  unsigned char* smem = AlignSmem32(raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  bf16* qs = reinterpret_cast<bf16*>(smem);  // [64][kLd] this block's queries
  bf16* dos = qs + kTTile * kLd;
  bf16* ks = dos + kTTile * kLd;  // [64][kLd] the current key tile
  bf16* vs = ks + kTTile * kLd;
  unsigned char* mine = smem + 4 * S::kTileBytes + warp * (2 * S::kFBytes + S::kPBytes);
  float* sw = reinterpret_cast<float*>(mine);                  // S
  float* dpw = reinterpret_cast<float*>(mine + S::kFBytes);    // dP
  bf16* dsw = reinterpret_cast<bf16*>(mine + 2 * S::kFBytes);  // dS

  const int bh = blockIdx.x, b = bh / H, h = bh % H;
  const int nq = (Tn + kTTile - 1) / kTTile;
  const int qt = nq - 1 - static_cast<int>(blockIdx.y), q0 = qt * kTTile;
  const int64_t ld = 3 * static_cast<int64_t>(C);
  const int64_t head = static_cast<int64_t>(h) * HS;
  const bf16* base = qkv + static_cast<int64_t>(b) * Tn * ld + head;
  const bf16* dbase = dout + static_cast<int64_t>(b) * Tn * C + head;

  LoadTile<HS>(qs, base + q0 * ld, ld, Tn - q0);
  LoadTile<HS>(dos, dbase + q0 * static_cast<int64_t>(C), C, Tn - q0);
  const int r = lane / 2, half = lane % 2;
  const int t = q0 + warp * 16 + r;
  const float lr = t < Tn ? lse[static_cast<int64_t>(bh) * Tn + t] : 0.0f;
  const float dr = t < Tn ? dsum[static_cast<int64_t>(bh) * Tn + t] : 0.0f;
  FragAcc dqf[kCb];
#pragma unroll
  for (int cb = 0; cb < kCb; ++cb) wmma::fill_fragment(dqf[cb], 0.0f);
  const bf16* qw = qs + warp * 16 * kLd;
  const bf16* dw = dos + warp * 16 * kLd;
  for (int kt = 0; kt <= qt; ++kt) {
    const int k0 = kt * kTTile;
    const int nkb = kt == qt ? warp + 1 : kTBlocks;
    __syncthreads();
    LoadTile<HS>(ks, base + k0 * ld + C, ld, Tn - k0);
    LoadTile<HS>(vs, base + k0 * ld + 2 * C, ld, Tn - k0);
    __syncthreads();
    // S = Q_w K^T, then dP = dO_w V^T.
    TwoProducts<HS>(qw, ks, sw, dw, vs, dpw, 0, nkb);
    __syncwarp();
    for (int k = 0; k < kTTile / 2; ++k) {
      const int col = 2 * k + half;  // key k0 + col
      if (col < nkb * 16) {
        const float p = k0 + col <= t ? __expf(sw[r * kFLd + col] * scale - lr) : 0.0f;
        dsw[r * kPLd + col] = __float2bfloat16(p * (dpw[r * kFLd + col] - dr));
      }
    }
    __syncwarp();
#pragma unroll
    for (int kb = 0; kb < kTBlocks; ++kb) {
      if (kb < nkb) {
        FragA dsf;
        wmma::load_matrix_sync(dsf, dsw + kb * 16, kPLd);
#pragma unroll
        for (int cb = 0; cb < kCb; ++cb) {
          FragBRow kf;
          wmma::load_matrix_sync(kf, ks + kb * 16 * kLd + cb * 16, kLd);
          wmma::mma_sync(dqf[cb], dsf, kf, dqf[cb]);
        }
      }
    }
  }
  __syncwarp();
#pragma unroll
  for (int cb = 0; cb < kCb; ++cb) {
    for (int i = 0; i < dqf[cb].num_elements; ++i) dqf[cb].x[i] *= scale;
    wmma::store_matrix_sync(sw + cb * 16, dqf[cb], kFLd, wmma::mem_row_major);
  }
  __syncwarp();
  StoreRows<HS>(dqkv + static_cast<int64_t>(b) * Tn * ld + head, ld, sw, q0 + warp * 16, Tn);
}

// ---- Dispatch -------------------------------------------------------------------------------

// The most dynamic shared memory one block of any attention kernel asks for at head size
// hs, on whichever path it takes.
inline size_t MaxSmemBytes(int hs) {
  size_t m = ForwardGenericSmem(hs);
  m = m > BackwardKVGenericSmem(hs) ? m : BackwardKVGenericSmem(hs);
  m = m > BackwardQGenericSmem(hs) ? m : BackwardQGenericSmem(hs);
  auto tc = [&m](size_t forward, size_t kv, size_t q) {
    for (size_t x : {forward, kv, q}) m = m > x + kAlignSlack ? m : x + kAlignSlack;
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
  const size_t smem = TcShape<HS>::kForwardSmem + kAlignSlack;
  AllowSmem(ForwardTcKernel<HS>, smem);
  ISTHMUS_LAUNCH(ForwardTcKernel<HS>, dim3(B * H, CeilDiv(Tn, kTTile)), dim3(kThreads), smem,
                 stream, qkv, out, lse, Tn, C, H, Scale(C, H));
}

template <int HS>
void BackwardTc(const bf16* dout, const bf16* qkv, const float* lse, const float* dsum, bf16* dqkv,
                int B, int Tn, int C, int H, cudaStream_t stream) {
  const dim3 grid(B * H, CeilDiv(Tn, kTTile));
  const size_t kv_smem = TcShape<HS>::kBackwardKVSmem + kAlignSlack;
  AllowSmem(BackwardKVTcKernel<HS>, kv_smem);
  ISTHMUS_LAUNCH(BackwardKVTcKernel<HS>, grid, dim3(kThreads), kv_smem, stream, dout, qkv, lse,
                 dsum, dqkv, Tn, C, H, Scale(C, H));
  const size_t q_smem = TcShape<HS>::kBackwardQSmem + kAlignSlack;
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
