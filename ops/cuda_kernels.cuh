// The CUDA backend's kernels other than matmuls and attention, with their launch functions.
// They are written against ops/cuda_compat.h, so the same source compiles with nvcc for the
// GPU and with the host compiler for the emulator, where tests/ops/cuda_kernels_emu_test.cc
// checks every launch function against a double-precision reference. Semantics are those
// of the matching Ops methods in ops/ops.h.
//
// Every Launch* function only enqueues work on `stream`: it never synchronises, allocates
// or checks errors (the caller reads cudaGetLastError). n == 0 (or an empty shape) launches
// nothing, except LaunchSumSquares, which still writes *out = 0. Kernels compute in fp32 and
// touch bf16 only in loads and stores. Every reduction has a fixed order and there are no
// atomics, so results are bitwise reproducible for given shapes and pointer alignments
// (alignment picks the vectorised or the scalar path, which may add in different orders).
//
// Workspace. Reductions across blocks take `workspace`: kWorkspaceFloats fp32 of backend
// memory that they overwrite (its contents before and after mean nothing; work on one
// stream never overlaps). What each uses, at most:
//   LaunchColumnSumAccumulate  slices * cols floats, slices <= kColumnSumTargetBlocks
//   LaunchLayerNormBackward    PlanLayerNormBackward(...).slices * 2 * C floats
//   LaunchSumSquares           kSumSquaresMaxBlocks floats
//   LaunchRmsNormBackward      PlanColumnSum(N, C, false).slices * C floats (dweight)
// Each plan is capped so that it fits; a shape where even one slice would not fit takes
// the one-pass path, which needs no workspace.
#pragma once

#include <algorithm>
#include <cassert>
#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "common/check.h"
#include "ops/cuda_compat.h"
#include "ops/ops.h"

namespace isthmus::ops::ISTHMUS_CUDA_NS {

inline constexpr int64_t kWorkspaceFloats = int64_t{1} << 22;  // 16 MiB

inline constexpr int kColumnSumTargetBlocks = 512;
inline constexpr int kSumSquaresMaxBlocks = 1024;

// Kernels have internal linkage: this header is compiled into more than one translation
// unit of a test binary (emulated), and each gets its own copy.
namespace detail {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLayerNormEps = 1e-5f;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCubic = 0.044715f;

// ---- Device helpers -------------------------------------------------------------------

// N elements moved as one aligned load or store (16 bytes for 4 floats, 8 for 4 bf16).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// A misaligned vector access faults on the GPU but not on the emulator's host, so the
// emulator checks what the launch functions' alignment tests promise.
template <typename T, int N>
__device__ __forceinline__ void CheckPackAligned(const T* p) {
#if ISTHMUS_EMULATED
  assert(reinterpret_cast<uintptr_t>(p) % sizeof(Pack<T, N>) == 0);
#endif
}

template <int N, typename T>
__device__ __forceinline__ void LoadPack(const T* p, float (&f)[N]) {
  CheckPackAligned<T, N>(p);
  const Pack<T, N> pack = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) f[i] = ToFloat(pack.v[i]);
}

template <int N, typename T>
__device__ __forceinline__ void StorePack(T* p, const float (&f)[N]) {
  CheckPackAligned<T, N>(p);
  Pack<T, N> pack;
#pragma unroll
  for (int i = 0; i < N; ++i) pack.v[i] = FromFloat<T>(f[i]);
  *reinterpret_cast<Pack<T, N>*>(p) = pack;
}

// acc[j] += p[j] for j < N: one aligned pack when N > 1.
template <int N, typename T>
__device__ __forceinline__ void AddPack(const T* p, float (&acc)[N]) {
  if constexpr (N > 1) {
    float f[N];
    LoadPack(p, f);
#pragma unroll
    for (int j = 0; j < N; ++j) acc[j] += f[j];
  } else {
    acc[0] += ToFloat(*p);
  }
}

// The sum over the block (a multiple of 32 threads), the same in every thread; `scratch`
// is 32 floats of shared memory, free again when it returns.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  v = WarpSum(v);
  const int threads = blockDim.x * blockDim.y;
  const int linear = threadIdx.y * blockDim.x + threadIdx.x;
  if ((linear & 31) == 0) scratch[linear >> 5] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < threads / 32; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// ---- Elementwise ----------------------------------------------------------------------

constexpr int kElemThreads = 256;
constexpr int kElemVec = 4;  // consecutive elements per thread

__device__ __forceinline__ int64_t FirstElement() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kElemVec;
}

inline bool Aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline dim3 ElementwiseGrid(int64_t n) {
  constexpr int64_t per_block = int64_t{kElemThreads} * kElemVec;
  return dim3(static_cast<unsigned>((n + per_block - 1) / per_block));
}

// out[j] = op(in[j]...), computed in fp32, kElemVec consecutive elements per thread: one
// aligned pack per tensor when kVec (the launcher checked every pointer), else one by one.
template <typename Op, size_t... I>
__device__ __forceinline__ float ApplyAt(const Op& op, const float (*f)[kElemVec], int k,
                                         std::index_sequence<I...>) {
  return op(f[I][k]...);
}

template <bool kVec, typename Op, typename Tout, typename... Tin>
__global__ void __launch_bounds__(kElemThreads)
    MapKernel(Op op, Tout* out, int64_t n, const Tin*... in) {
  const int64_t i = FirstElement();
  if (kVec && i + kElemVec <= n) {
    float f[sizeof...(Tin)][kElemVec];
    int arg = 0;
    (LoadPack(in + i, f[arg++]), ...);
    float r[kElemVec];
#pragma unroll
    for (int k = 0; k < kElemVec; ++k) {
      r[k] = ApplyAt(op, f, k, std::index_sequence_for<Tin...>{});
    }
    StorePack(out + i, r);
    return;
  }
  for (int64_t j = i; j < n && j < i + kElemVec; ++j)
    out[j] = FromFloat<Tout>(op(ToFloat(in[j])...));
}

struct CopyOp {
  __device__ float operator()(float x) const { return x; }
};
struct SubtractOp {
  __device__ float operator()(float a, float b) const { return a - b; }
};

// kVec needs C % 4 == 0, so that a thread's four elements share a row.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kElemThreads)
    BiasResidualKernel(const float* bias, const float* residual, T* out, int64_t n, int C) {
  const int64_t i = FirstElement();
  if (kVec && i + kElemVec <= n) {
    const int c = static_cast<int>(i % C);
    float f[kElemVec] = {};
    if (bias != nullptr) LoadPack(bias + c, f);
    if (residual != nullptr) {
      float r[kElemVec];
      LoadPack(residual + i, r);
#pragma unroll
      for (int k = 0; k < kElemVec; ++k) f[k] += r[k];
    }
    StorePack(out + i, f);
    return;
  }
  for (int64_t j = i; j < n && j < i + kElemVec; ++j) {
    float f = bias != nullptr ? bias[j % C] : 0.0f;
    if (residual != nullptr) f += residual[j];
    out[j] = FromFloat<T>(f);
  }
}

__device__ __forceinline__ float Gelu(float x) {
  const float u = kGeluScale * (x + kGeluCubic * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}

__device__ __forceinline__ float GeluGrad(float x) {
  const float u = kGeluScale * (x + kGeluCubic * x * x * x);
  const float t = tanhf(u);
  const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}

struct GeluOp {
  __device__ float operator()(float x) const { return Gelu(x); }
};
struct GeluBackwardOp {
  __device__ float operator()(float dout, float x) const { return dout * GeluGrad(x); }
};

// ---- Embedding --------------------------------------------------------------------------

template <bool kVec>
__global__ void __launch_bounds__(kElemThreads)
    EmbeddingForwardKernel(const int32_t* tokens, const float* wte, const float* wpe, float* out,
                           int64_t n, int Tn, int C) {
  const int64_t i = FirstElement();
  if (kVec && i + kElemVec <= n) {
    const int64_t row = i / C;
    const int c = static_cast<int>(i - row * C);
    float e[kElemVec];
    LoadPack(wte + static_cast<int64_t>(tokens[row]) * C + c, e);
    if (wpe != nullptr) {
      float p[kElemVec];
      LoadPack(wpe + (row % Tn) * C + c, p);
#pragma unroll
      for (int k = 0; k < kElemVec; ++k) e[k] += p[k];
    }
    StorePack(out + i, e);
    return;
  }
  for (int64_t j = i; j < n && j < i + kElemVec; ++j) {
    const int64_t row = j / C;
    const int64_t c = j - row * C;
    const float e = wte[static_cast<int64_t>(tokens[row]) * C + c];
    out[j] = wpe != nullptr ? e + wpe[(row % Tn) * C + c] : e;
  }
}

constexpr int kEmbWarps = 8;

// Block (v, tile) for v < wte_rows adds the rows of token v (order[starts[v]..starts[v+1]))
// into dwte[v]; block (wte_rows + t, tile) adds rows t, T + t, ... into dwpe[t]. A tile is
// 32 * kVec channels, one warp wide; the block's warps take every kEmbWarps-th row and
// their sums are added in warp order.
template <int kVec>
__global__ void __launch_bounds__(kEmbWarps * 32)
    EmbeddingBackwardKernel(const float* dout, const int32_t* order, const int32_t* starts,
                            float* dwte, float* dwpe, int B, int Tn, int C, int wte_rows) {
  __shared__ float partial[kEmbWarps][32 * kVec];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool is_wte = static_cast<int>(blockIdx.x) < wte_rows;
  const int t = static_cast<int>(blockIdx.x) - wte_rows;
  const int begin = is_wte ? starts[blockIdx.x] : 0;
  const int count = is_wte ? starts[blockIdx.x + 1] - begin : B;
  if (count == 0) return;
  const int c = (blockIdx.y * 32 + lane) * kVec;
  float acc[kVec] = {};
  if (c < C) {
#pragma unroll 4
    for (int k = warp; k < count; k += kEmbWarps) {
      const int64_t pos = is_wte ? order[begin + k] : static_cast<int64_t>(k) * Tn + t;
      AddPack(dout + pos * C + c, acc);
    }
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) partial[warp][lane * kVec + j] = acc[j];
  __syncthreads();
  if (warp != 0 || c >= C) return;
  float* g =
      is_wte ? dwte + static_cast<int64_t>(blockIdx.x) * C : dwpe + static_cast<int64_t>(t) * C;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    float s = partial[0][lane * kVec + j];
    for (int w = 1; w < kEmbWarps; ++w) s += partial[w][lane * kVec + j];
    g[c + j] += s;
  }
}

// ---- Column sums ------------------------------------------------------------------------

// Block (tile, slice): columns [tile * 32 * kVec, +32 * kVec) over the rows of the slice.
// threadIdx.y takes every 8th row; the 8 sums are added in y order. One slice: out += the
// sum; several: partial[slice] = the sum, for SumPartialsKernel.
template <typename T, int kVec>
__global__ void __launch_bounds__(256)
    ColumnSumKernel(const T* m, int rows, int cols, int rows_per_slice, float* partial,
                    float* out) {
  __shared__ float part[8][32 * kVec];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int c = (blockIdx.x * 32 + tx) * kVec;
  const int r0 = blockIdx.y * rows_per_slice;
  const int r1 = rows - r0 < rows_per_slice ? rows : r0 + rows_per_slice;
  float acc[kVec] = {};
  if (c < cols) {
#pragma unroll 4
    for (int r = r0 + ty; r < r1; r += 8) {
      AddPack(m + static_cast<int64_t>(r) * cols + c, acc);
    }
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) part[ty][tx * kVec + j] = acc[j];
  __syncthreads();
  if (ty != 0 || c >= cols) return;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    float s = part[0][tx * kVec + j];
    for (int y = 1; y < 8; ++y) s += part[y][tx * kVec + j];
    if (partial != nullptr) {
      partial[static_cast<int64_t>(blockIdx.y) * cols + c + j] = s;
    } else {
      out[c + j] += s;
    }
  }
}

// Column c of partial[slices][width], summed over slices in a fixed order, is added to
// out0[c] (c < split) or out1[c - split]; a null output is skipped. Block (32, 8).
__global__ void __launch_bounds__(256)
    SumPartialsKernel(const float* partial, int slices, int width, int split, float* out0,
                      float* out1) {
  __shared__ float part[8][32];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int c = blockIdx.x * 32 + tx;
  float s = 0.0f;
  if (c < width) {
#pragma unroll 4
    for (int k = ty; k < slices; k += 8) s += partial[static_cast<int64_t>(k) * width + c];
  }
  part[ty][tx] = s;
  __syncthreads();
  if (ty != 0 || c >= width) return;
  float total = part[0][tx];
  for (int y = 1; y < 8; ++y) total += part[y][tx];
  if (c < split) {
    if (out0 != nullptr) out0[c] += total;
  } else if (out1 != nullptr) {
    out1[c - split] += total;
  }
}

// ---- Layer norm ---------------------------------------------------------------------------

// One warp per row. kCache > 0: C % 4 == 0, aligned rows, C <= 128 * kCache, and the row
// stays in registers between its passes; kCache == 0: any C, strided scalar loads that
// re-read the row (from L1) in each pass. Two passes: the mean mu, then the deviations d;
// r = mean(d) is the rounding error of mu (corrected two-pass algorithm), which matters
// when |mean| >> std: an fp32 mu alone is off by up to half an ulp of the mean.
constexpr int kLnForwardWarps = 4;

template <typename Tout, int kCache>
__global__ void __launch_bounds__(kLnForwardWarps * 32)
    LayerNormForwardKernel(const float* x, const float* w, const float* b, Tout* out, float* mean,
                           float* rstd, int N, int C) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kLnForwardWarps + (threadIdx.x >> 5);
  if (row >= N) return;
  const float* xr = x + row * C;
  Tout* outr = out + row * C;
  float mu, r, s;
  if constexpr (kCache > 0) {
    float xv[kCache][4];
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kCache; ++k) {
      const int c = (k * 32 + lane) * 4;
      if (c < C) {
        LoadPack(xr + c, xv[k]);
        sum += (xv[k][0] + xv[k][1]) + (xv[k][2] + xv[k][3]);
      }
    }
    mu = WarpSum(sum) / C;
    float dsum = 0.0f, sq = 0.0f;
#pragma unroll
    for (int k = 0; k < kCache; ++k) {
      const int c = (k * 32 + lane) * 4;
      if (c < C) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          xv[k][j] -= mu;
          dsum += xv[k][j];
          sq += xv[k][j] * xv[k][j];
        }
      }
    }
    r = WarpSum(dsum) / C;
    s = rsqrtf(fmaxf(WarpSum(sq) / C - r * r, 0.0f) + kLayerNormEps);
#pragma unroll
    for (int k = 0; k < kCache; ++k) {
      const int c = (k * 32 + lane) * 4;
      if (c < C) {
        float wv[4], bv[4], o[4];
        LoadPack(w + c, wv);
        LoadPack(b + c, bv);
#pragma unroll
        for (int j = 0; j < 4; ++j) o[j] = (xv[k][j] - r) * s * wv[j] + bv[j];
        StorePack(outr + c, o);
      }
    }
  } else {
    float sum = 0.0f;
    for (int c = lane; c < C; c += 32) sum += xr[c];
    mu = WarpSum(sum) / C;
    float dsum = 0.0f, sq = 0.0f;
    for (int c = lane; c < C; c += 32) {
      const float d = xr[c] - mu;
      dsum += d;
      sq += d * d;
    }
    r = WarpSum(dsum) / C;
    s = rsqrtf(fmaxf(WarpSum(sq) / C - r * r, 0.0f) + kLayerNormEps);
    for (int c = lane; c < C; c += 32) {
      outr[c] = FromFloat<Tout>((xr[c] - mu - r) * s * w[c] + b[c]);
    }
  }
  if (lane == 0) {
    if (mean != nullptr) mean[row] = mu + r;
    if (rstd != nullptr) rstd[row] = s;
  }
}

// One warp per row, rows taken in groups of `warps` (one per warp) striding over the grid.
// Each warp adds dout * xhat and dout of its rows into its own accumulators ([2C]: dw then
// db), in shared memory or, with global_acc, in the workspace; kCache as in the forward.
// At the end the block adds its warps' accumulators in warp order into partial[blockIdx.x]
// or, when partial is null (one block), into dw and db. With global_acc each warp's
// accumulators are already its slice of the partial sums.
template <typename Tin, int kCache>
__global__ void __launch_bounds__(256)
    LayerNormBackwardKernel(const Tin* dout, const float* x, const float* w, const float* mean,
                            const float* rstd, float* dx, float* dw, float* db, int N, int C,
                            float* partial, bool global_acc) {
  ISTHMUS_DYNAMIC_SMEM(float, smem);
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool want_acc = dw != nullptr || db != nullptr;
  const int64_t width = int64_t{2} * C;
  float* acc_w = nullptr;
  float* acc_b = nullptr;
  if (want_acc) {
    acc_w = global_acc ? partial + (static_cast<int64_t>(blockIdx.x) * warps + warp) * width
                       : smem + warp * width;
    acc_b = acc_w + C;
    // Zeroed in the pattern each lane accumulates in, so no lane reads another's zeros.
    if constexpr (kCache > 0) {
#pragma unroll
      for (int k = 0; k < kCache; ++k) {
        const int c = (k * 32 + lane) * 4;
        if (c < C) {
#pragma unroll
          for (int j = 0; j < 4; ++j) acc_w[c + j] = acc_b[c + j] = 0.0f;
        }
      }
    } else {
      for (int c = lane; c < C; c += 32) acc_w[c] = acc_b[c] = 0.0f;
    }
  }
  for (int64_t group = blockIdx.x; group * warps < N; group += gridDim.x) {
    const int64_t row = group * warps + warp;
    if (row >= N) break;
    const float mu = mean[row], s = rstd[row];
    const Tin* dr = dout + row * C;
    const float* xr = x + row * C;
    float* dxr = dx != nullptr ? dx + row * C : nullptr;
    if constexpr (kCache > 0) {
      float d[kCache][4], xh[kCache][4];
      float g_sum = 0.0f, gx_sum = 0.0f;
#pragma unroll
      for (int k = 0; k < kCache; ++k) {
        const int c = (k * 32 + lane) * 4;
        if (c < C) {
          float wv[4];
          LoadPack(dr + c, d[k]);
          LoadPack(xr + c, xh[k]);
          LoadPack(w + c, wv);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            xh[k][j] = (xh[k][j] - mu) * s;
            const float g = d[k][j] * wv[j];
            g_sum += g;
            gx_sum += g * xh[k][j];
          }
        }
      }
      const float g_mean = WarpSum(g_sum) / C, gx_mean = WarpSum(gx_sum) / C;
#pragma unroll
      for (int k = 0; k < kCache; ++k) {
        const int c = (k * 32 + lane) * 4;
        if (c >= C) continue;
        if (dxr != nullptr) {
          float wv[4], o[4];
          LoadPack(w + c, wv);
          LoadPack(dxr + c, o);
#pragma unroll
          for (int j = 0; j < 4; ++j) o[j] += s * (d[k][j] * wv[j] - g_mean - xh[k][j] * gx_mean);
          StorePack(dxr + c, o);
        }
        if (want_acc) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            acc_w[c + j] += d[k][j] * xh[k][j];
            acc_b[c + j] += d[k][j];
          }
        }
      }
    } else {
      float g_sum = 0.0f, gx_sum = 0.0f;
      for (int c = lane; c < C; c += 32) {
        const float g = ToFloat(dr[c]) * w[c];
        g_sum += g;
        gx_sum += g * ((xr[c] - mu) * s);
      }
      const float g_mean = WarpSum(g_sum) / C, gx_mean = WarpSum(gx_sum) / C;
      for (int c = lane; c < C; c += 32) {
        const float d = ToFloat(dr[c]);
        const float xhat = (xr[c] - mu) * s;
        if (dxr != nullptr) dxr[c] += s * (d * w[c] - g_mean - xhat * gx_mean);
        if (want_acc) {
          acc_w[c] += d * xhat;
          acc_b[c] += d;
        }
      }
    }
  }
  if (!want_acc || global_acc) return;
  __syncthreads();
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
    float total = smem[c];
    for (int k = 1; k < warps; ++k) total += smem[k * width + c];
    if (partial != nullptr) {
      partial[static_cast<int64_t>(blockIdx.x) * width + c] = total;
    } else if (c < C) {
      if (dw != nullptr) dw[c] += total;
    } else if (db != nullptr) {
      db[c - C] += total;
    }
  }
}

// ---- The Llama family: RMS norm, SwiGLU, RoPE with grouped-query heads --------------------

constexpr int kRmsThreads = 256;

// One block per row: the block's sum of x^2, then out = x * rstd * w.
template <typename Tout>
__global__ void __launch_bounds__(kRmsThreads)
    RmsNormForwardKernel(const float* x, const float* w, Tout* out, float* rstd, int C, float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * C;
  float sq = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) sq += xr[c] * xr[c];
  const float s = rsqrtf(BlockSum(sq, scratch) / C + eps);
  Tout* outr = out + row * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) outr[c] = FromFloat<Tout>(xr[c] * s * w[c]);
  if (threadIdx.x == 0 && rstd != nullptr) rstd[row] = s;
}

// One block per row: dx += rstd * (g - xhat * mean(g * xhat)), g = dout * w, xhat = x * rstd.
template <typename Tin>
__global__ void __launch_bounds__(kRmsThreads)
    RmsNormBackwardKernel(const Tin* dout, const float* x, const float* w, const float* rstd,
                          float* dx, int C) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const Tin* dr = dout + row * C;
  const float* xr = x + row * C;
  const float s = rstd[row];
  float gx = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) gx += ToFloat(dr[c]) * w[c] * (xr[c] * s);
  const float gx_mean = BlockSum(gx, scratch) / C;
  float* dxr = dx + row * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    dxr[c] += s * (ToFloat(dr[c]) * w[c] - xr[c] * s * gx_mean);
  }
}

// The column sums of dout * x * rstd (dweight), blocked as ColumnSumKernel (one column per
// thread): one slice adds into out, several write partial[slice] for SumPartialsKernel.
template <typename Tin>
__global__ void __launch_bounds__(256)
    RmsNormWeightGradKernel(const Tin* dout, const float* x, const float* rstd, int rows, int cols,
                            int rows_per_slice, float* partial, float* out) {
  __shared__ float part[8][32];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int c = blockIdx.x * 32 + tx;
  const int r0 = blockIdx.y * rows_per_slice;
  const int r1 = rows - r0 < rows_per_slice ? rows : r0 + rows_per_slice;
  float acc = 0.0f;
  if (c < cols) {
    for (int r = r0 + ty; r < r1; r += 8) {
      const int64_t at = static_cast<int64_t>(r) * cols + c;
      acc += ToFloat(dout[at]) * (x[at] * rstd[r]);
    }
  }
  part[ty][tx] = acc;
  __syncthreads();
  if (ty != 0 || c >= cols) return;
  float total = part[0][tx];
  for (int y = 1; y < 8; ++y) total += part[y][tx];
  if (partial != nullptr) {
    partial[static_cast<int64_t>(blockIdx.y) * cols + c] = total;
  } else {
    out[c] += total;
  }
}

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

struct SwigluOp {
  __device__ float operator()(float gate, float up) const { return gate * Sigmoid(gate) * up; }
};

// Both gradients from one read of dout, gate and up, so that dgate and dup may overwrite gate
// and up. A null gradient is not stored.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kElemThreads)
    SwigluBackwardKernel(const T* dout, const T* gate, const T* up, T* dgate, T* dup, int64_t n) {
  const int64_t i = FirstElement();
  if (kVec && i + kElemVec <= n) {
    float d[kElemVec], g[kElemVec], u[kElemVec], dg[kElemVec], du[kElemVec];
    LoadPack(dout + i, d);
    LoadPack(gate + i, g);
    LoadPack(up + i, u);
#pragma unroll
    for (int k = 0; k < kElemVec; ++k) {
      const float sig = Sigmoid(g[k]);
      dg[k] = d[k] * u[k] * sig * (1.0f + g[k] * (1.0f - sig));
      du[k] = d[k] * g[k] * sig;
    }
    if (dgate != nullptr) StorePack(dgate + i, dg);
    if (dup != nullptr) StorePack(dup + i, du);
    return;
  }
  for (int64_t j = i; j < n && j < i + kElemVec; ++j) {
    const float d = ToFloat(dout[j]), g = ToFloat(gate[j]), u = ToFloat(up[j]);
    const float sig = Sigmoid(g);
    if (dgate != nullptr) dgate[j] = FromFloat<T>(d * u * sig * (1.0f + g * (1.0f - sig)));
    if (dup != nullptr) dup[j] = FromFloat<T>(d * g * sig);
  }
}

// One thread per (row, head, i < D/2): the pair (i, i + D/2) of head h's q, k and v.
template <typename T>
__global__ void __launch_bounds__(kElemThreads)
    RopeGqaForwardKernel(const T* q, const T* k, const T* v, const float* rope, T* qkv,
                         int64_t pairs, int Tn, int H, int Hkv, int D) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= pairs) return;
  const int half = D / 2;
  const int i = static_cast<int>(idx % half);
  const int64_t head = idx / half;  // row * H + h
  const int h = static_cast<int>(head % H);
  const int64_t row = head / H;
  const int kh = h / (H / Hkv);
  const float* cs = rope + (row % Tn) * D;
  const float c = cs[i], s = cs[half + i];
  const int64_t qd = static_cast<int64_t>(H) * D, kd = static_cast<int64_t>(Hkv) * D;
  const T* qr = q + row * qd + static_cast<int64_t>(h) * D;
  const T* kr = k + row * kd + static_cast<int64_t>(kh) * D;
  const T* vr = v + row * kd + static_cast<int64_t>(kh) * D;
  T* o = qkv + row * 3 * qd + static_cast<int64_t>(h) * D;
  float x0 = ToFloat(qr[i]), x1 = ToFloat(qr[half + i]);
  o[i] = FromFloat<T>(x0 * c - x1 * s);
  o[half + i] = FromFloat<T>(x1 * c + x0 * s);
  x0 = ToFloat(kr[i]);
  x1 = ToFloat(kr[half + i]);
  o[qd + i] = FromFloat<T>(x0 * c - x1 * s);
  o[qd + half + i] = FromFloat<T>(x1 * c + x0 * s);
  o[2 * qd + i] = vr[i];
  o[2 * qd + half + i] = vr[half + i];
}

// Same threads: each rotates its pair of dq back; those of heads h < Hkv also sum the k and
// v parts of kv head h's group (heads h * H/Hkv onwards, in increasing order) into dk, dv.
template <typename T>
__global__ void __launch_bounds__(kElemThreads)
    RopeGqaBackwardKernel(const T* dqkv, const float* rope, T* dq, T* dk, T* dv, int64_t pairs,
                          int Tn, int H, int Hkv, int D) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= pairs) return;
  const int half = D / 2;
  const int i = static_cast<int>(idx % half);
  const int64_t head = idx / half;
  const int h = static_cast<int>(head % H);
  const int64_t row = head / H;
  const float* cs = rope + (row % Tn) * D;
  const float c = cs[i], s = cs[half + i];
  const int64_t qd = static_cast<int64_t>(H) * D, kd = static_cast<int64_t>(Hkv) * D;
  const T* dr = dqkv + row * 3 * qd;
  if (dq != nullptr) {
    const int64_t at = static_cast<int64_t>(h) * D + i;
    const float y0 = ToFloat(dr[at]), y1 = ToFloat(dr[at + half]);
    T* o = dq + row * qd + static_cast<int64_t>(h) * D;
    o[i] = FromFloat<T>(y0 * c + y1 * s);
    o[half + i] = FromFloat<T>(y1 * c - y0 * s);
  }
  if (h >= Hkv) return;
  const int group = H / Hkv;
  float k0 = 0.0f, k1 = 0.0f, v0 = 0.0f, v1 = 0.0f;
  for (int j = 0; j < group; ++j) {
    const int64_t at = static_cast<int64_t>(h * group + j) * D + i;
    k0 += ToFloat(dr[qd + at]);
    k1 += ToFloat(dr[qd + at + half]);
    v0 += ToFloat(dr[2 * qd + at]);
    v1 += ToFloat(dr[2 * qd + at + half]);
  }
  const int64_t at = row * kd + static_cast<int64_t>(h) * D;
  if (dk != nullptr) {
    dk[at + i] = FromFloat<T>(k0 * c + k1 * s);
    dk[at + half + i] = FromFloat<T>(k1 * c - k0 * s);
  }
  if (dv != nullptr) {
    dv[at + i] = FromFloat<T>(v0);
    dv[at + half + i] = FromFloat<T>(v1);
  }
}

// ---- Softmax cross-entropy ----------------------------------------------------------------

__device__ __forceinline__ void OnlineAdd(float f, float& m, float& s) {
  if (f > m) {
    s = s * expf(m - f) + 1.0f;
    m = f;
  } else {
    s += expf(f - m);
  }
}

// (m, s) becomes the running max and sum of exp(x - max) of both sets. Symmetric up to the
// order of one addition, so butterfly merges agree in every lane.
__device__ __forceinline__ void MergeMaxSum(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  s = s * expf(m - mx) + s2 * expf(m2 - mx);
  m = mx;
}

constexpr int kCeWarpMaxV = 1024;  // up to here a warp per row; above, a block of 256

// kRowThreads threads (32 or 256) per row; one pass for the max, the sum of exponentials
// (online) and the target's logit, a second pass (re-reading the row) for dlogits, so that
// dlogits may alias logits. The running max starts at -FLT_MAX, not -inf, so that empty
// lanes and -inf logits never produce inf - inf.
template <typename T, int kRowThreads, bool kVec>
__global__ void __launch_bounds__(kRowThreads == 32 ? 128 : 256)
    SoftmaxCrossEntropyKernel(const T* logits, const int32_t* targets, float* losses, T* dlogits,
                              const float* dloss, int N, int V) {
  constexpr int kBlockThreads = kRowThreads == 32 ? 128 : 256;
  constexpr int kRowsPerBlock = kBlockThreads / kRowThreads;
  constexpr int kStep = kRowThreads * (kVec ? 4 : 1);
  const int t = threadIdx.x % kRowThreads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kRowThreads;
  if (row >= N) return;
  const int target = targets[row];
  const T* xr = logits + row * V;
  T* dr = dlogits != nullptr ? dlogits + row * V : nullptr;
  if (target < 0) {
    if (t == 0) losses[row] = 0.0f;
    if (dr == nullptr) return;
    for (int j = t * (kVec ? 4 : 1); j < V; j += kStep) {
      if constexpr (kVec) {
        const float zero[4] = {};
        StorePack(dr + j, zero);
      } else {
        dr[j] = FromFloat<T>(0.0f);
      }
    }
    return;
  }
  float m = -FLT_MAX, s = 0.0f, xt = 0.0f;
  for (int j = t * (kVec ? 4 : 1); j < V; j += kStep) {
    if constexpr (kVec) {
      float f[4];
      LoadPack(xr + j, f);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (j + k == target) xt = f[k];
        OnlineAdd(f[k], m, s);
      }
    } else {
      const float f = ToFloat(xr[j]);
      if (j == target) xt = f;
      OnlineAdd(f, m, s);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(kFullMask, m, o);
    const float s2 = __shfl_xor_sync(kFullMask, s, o);
    MergeMaxSum(m, s, m2, s2);
    xt += __shfl_xor_sync(kFullMask, xt, o);
  }
  if constexpr (kRowThreads > 32) {
    constexpr int kWarps = kRowThreads / 32;
    __shared__ float sm[kWarps], ss[kWarps], sx[kWarps];
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
      sm[warp] = m;
      ss[warp] = s;
      sx[warp] = xt;
    }
    __syncthreads();
    m = sm[0];
    s = ss[0];
    xt = sx[0];
    for (int w = 1; w < kWarps; ++w) {
      MergeMaxSum(m, s, sm[w], ss[w]);
      xt += sx[w];
    }
  }
  if (t == 0) losses[row] = logf(s) + (m - xt);
  if (dr == nullptr) return;
  const float scale = *dloss;
  const float inv = 1.0f / s;
  for (int j = t * (kVec ? 4 : 1); j < V; j += kStep) {
    if constexpr (kVec) {
      float f[4];
      LoadPack(xr + j, f);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        f[k] = (expf(f[k] - m) * inv - (j + k == target ? 1.0f : 0.0f)) * scale;
      }
      StorePack(dr + j, f);
    } else {
      const float p = expf(ToFloat(xr[j]) - m) * inv;
      dr[j] = FromFloat<T>((p - (j == target ? 1.0f : 0.0f)) * scale);
    }
  }
}

// ---- Distillation loss --------------------------------------------------------------------

constexpr int kDistillThreads = 256;

// (m, s) of every thread merged over the block (MergeMaxSum), the same in every thread;
// sm/ss are 32 floats each of shared memory, free again when it returns.
__device__ __forceinline__ void BlockMaxSum(float& m, float& s, float* sm, float* ss) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(kFullMask, m, o);
    const float s2 = __shfl_xor_sync(kFullMask, s, o);
    MergeMaxSum(m, s, m2, s2);
  }
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  m = sm[0];
  s = ss[0];
  for (int w = 1; w < static_cast<int>(blockDim.x) / 32; ++w) MergeMaxSum(m, s, sm[w], ss[w]);
  __syncthreads();
}

// A block per row (Ops::DistillCrossEntropy). Pass 1 reads the row for the log-sum-exp at
// temperature 1 and T and the target's logit; pass 2 reads the teacher's k entries and the
// student's logits at their ids (the KL); pass 3 writes the dense part of the gradient in
// place; after a barrier, pass 4 subtracts the teacher's probabilities at its ids (distinct,
// so no two threads write one element).
template <typename T>
__global__ void __launch_bounds__(kDistillThreads)
    DistillCrossEntropyKernel(const T* logits, const int32_t* targets, const int32_t* ids,
                              const float* teacher, int k, float alpha, float temp, float* losses,
                              T* dlogits, const float* dloss, int V) {
  __shared__ float sm[32], ss[32];
  const int64_t row = blockIdx.x;
  const int t = threadIdx.x;
  const int target = targets[row];
  const T* xr = logits + row * V;
  T* dr = dlogits != nullptr ? dlogits + row * V : nullptr;
  if (target < 0) {  // the whole block leaves together
    if (t == 0) losses[row] = 0.0f;
    if (dr != nullptr) {
      for (int j = t; j < V; j += kDistillThreads) dr[j] = FromFloat<T>(0.0f);
    }
    return;
  }
  const float inv_t = 1.0f / temp;
  float m = -FLT_MAX, s = 0.0f, mt = -FLT_MAX, st = 0.0f, xt = 0.0f;
  for (int j = t; j < V; j += kDistillThreads) {
    const float f = ToFloat(xr[j]);
    if (j == target) xt = f;
    OnlineAdd(f, m, s);
    OnlineAdd(f * inv_t, mt, st);
  }
  xt = BlockSum(xt, sm);
  BlockMaxSum(m, s, sm, ss);
  BlockMaxSum(mt, st, sm, ss);
  const float lse = m + logf(s), lse_t = mt + logf(st);
  const int32_t* id = ids + row * k;
  const float* tl = teacher + row * k;
  float pm = -FLT_MAX, ps = 0.0f;
  for (int e = t; e < k; e += kDistillThreads) OnlineAdd(tl[e] * inv_t, pm, ps);
  BlockMaxSum(pm, ps, sm, ss);
  const float lse_p = pm + logf(ps);
  float kl = 0.0f;
  for (int e = t; e < k; e += kDistillThreads) {
    const float log_p = tl[e] * inv_t - lse_p;
    kl += expf(log_p) * (log_p - (ToFloat(xr[id[e]]) * inv_t - lse_t));
  }
  kl = BlockSum(kl, sm);  // its barriers also end every read of the row before pass 3
  if (t == 0) losses[row] = alpha * (lse - xt) + (1.0f - alpha) * temp * temp * kl;
  if (dr == nullptr) return;
  const float hard = alpha * *dloss, soft = (1.0f - alpha) * temp * *dloss;
  for (int j = t; j < V; j += kDistillThreads) {
    const float f = ToFloat(xr[j]);
    const float g =
        hard * (expf(f - lse) - (j == target ? 1.0f : 0.0f)) + soft * expf(f * inv_t - lse_t);
    dr[j] = FromFloat<T>(g);
  }
  __syncthreads();
  for (int e = t; e < k; e += kDistillThreads) {
    dr[id[e]] = FromFloat<T>(ToFloat(dr[id[e]]) - soft * expf(tl[e] * inv_t - lse_p));
  }
}

// ---- Sum of squares -----------------------------------------------------------------------

constexpr int kSumThreads = 256;

// dst[blockIdx.x] = the block's sum of x[i]^2 (kSquare) or x[i], grid-strided; the vector
// path reads float4 and leaves the n % 4 tail to the first threads.
template <bool kSquare>
__global__ void __launch_bounds__(kSumThreads)
    SumKernel(const float* x, int64_t n, bool vec, float* dst) {
  __shared__ float scratch[32];
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  float s = 0.0f;
  int64_t i = tid;
  if (vec) {
    const int64_t n4 = n / 4;
    for (; i < n4; i += stride) {
      float f[4];
      LoadPack(x + i * 4, f);
      s += kSquare ? (f[0] * f[0] + f[1] * f[1]) + (f[2] * f[2] + f[3] * f[3])
                   : (f[0] + f[1]) + (f[2] + f[3]);
    }
    i = n4 * 4 + tid;
  }
  for (; i < n; i += stride) s += kSquare ? x[i] * x[i] : x[i];
  s = BlockSum(s, scratch);
  if (threadIdx.x == 0) dst[blockIdx.x] = s;
}

// ---- AdamW --------------------------------------------------------------------------------

constexpr int kAdamWThreads = 256;
constexpr int kAdamWBlocksPerChunk = 16;

struct AdamWCoeffs {
  float beta1, beta2, lr, bc1, bc2, eps, decay, clip;
};

// Term for term the CPU reference's AdamWStep, on the clipped gradient.
__device__ __forceinline__ void AdamWUpdate(float& p, float& m, float& v, float g,
                                            const AdamWCoeffs& k) {
  g *= k.clip;
  m = k.beta1 * m + (1.0f - k.beta1) * g;
  v = k.beta2 * v + (1.0f - k.beta2) * g * g;
  const float m_hat = m / k.bc1;
  const float v_hat = v / k.bc2;
  p -= k.lr * (m_hat / (sqrtf(v_hat) + k.eps) + k.decay * p);
}

// kAdamWBlocksPerChunk blocks per chunk (blockIdx.x = chunk * kAdamWBlocksPerChunk + part),
// each striding over its chunk. `aligned`: every buffer is aligned for 4-element packs, so
// chunks whose offset is a multiple of 4 take the vector path.
template <typename Tcopy>
__global__ void __launch_bounds__(kAdamWThreads)
    AdamWKernel(float* param, const float* grad, float* m, float* v, Tcopy* copy,
                const AdamWChunk* chunks, const float* sumsq, const AdamWScalars* scalars,
                AdamWConfig config, bool aligned) {
  const float sum_sq = *sumsq;
  if (!isfinite(sum_sq)) return;
  const AdamWChunk chunk = chunks[blockIdx.x / kAdamWBlocksPerChunk];
  const int part = blockIdx.x % kAdamWBlocksPerChunk;
  const AdamWScalars sc = *scalars;
  AdamWCoeffs k;
  k.beta1 = config.beta1;
  k.beta2 = config.beta2;
  k.lr = sc.lr;
  k.bc1 = sc.bias_correction1;
  k.bc2 = sc.bias_correction2;
  k.eps = config.eps;
  k.decay = chunk.decay != 0 ? config.weight_decay : 0.0f;
  const float norm = sqrtf(sum_sq);
  k.clip =
      config.grad_clip > 0.0f && norm > config.grad_clip ? config.grad_clip / (norm + 1e-6f) : 1.0f;
  float* p = param + chunk.offset;
  const float* g = grad + chunk.offset;
  const int64_t moment = chunk.offset - chunk.shard_start;
  float* mm = m + moment;
  float* vv = v + moment;
  Tcopy* cp = copy != nullptr ? copy + chunk.offset : nullptr;
  const int count = chunk.count;
  if (aligned && (chunk.offset & 3) == 0 && (moment & 3) == 0) {
    const int stride = kAdamWBlocksPerChunk * kAdamWThreads * 4;
    for (int i = (part * kAdamWThreads + static_cast<int>(threadIdx.x)) * 4; i < count;
         i += stride) {
      if (i + 4 <= count) {
        float pf[4], gf[4], mf[4], vf[4];
        LoadPack(p + i, pf);
        LoadPack(g + i, gf);
        LoadPack(mm + i, mf);
        LoadPack(vv + i, vf);
#pragma unroll
        for (int j = 0; j < 4; ++j) AdamWUpdate(pf[j], mf[j], vf[j], gf[j], k);
        StorePack(p + i, pf);
        StorePack(mm + i, mf);
        StorePack(vv + i, vf);
        if (cp != nullptr) StorePack(cp + i, pf);
      } else {
        for (int j = i; j < count; ++j) {
          AdamWUpdate(p[j], mm[j], vv[j], g[j], k);
          if (cp != nullptr) cp[j] = FromFloat<Tcopy>(p[j]);
        }
      }
    }
  } else {
    for (int j = part * kAdamWThreads + static_cast<int>(threadIdx.x); j < count;
         j += kAdamWBlocksPerChunk * kAdamWThreads) {
      AdamWUpdate(p[j], mm[j], vv[j], g[j], k);
      if (cp != nullptr) cp[j] = FromFloat<Tcopy>(p[j]);
    }
  }
}

// Register-cached layer-norm path for C (0: the scalar path).
inline int LayerNormCache(int C, bool vec_ok) {
  if (!vec_ok || C % 4 != 0) return 0;
  return C <= 256 ? 2 : C <= 1024 ? 8 : C <= 2048 ? 16 : 0;
}

}  // namespace
}  // namespace detail

// ---- Plans (exposed so that tests can reach every path) ----------------------------------

struct ColumnSumPlan {
  int vec;     // columns per thread: 4 (cols % 4 == 0 and m aligned) or 1
  int tiles;   // blocks across the columns (32 * vec columns each)
  int slices;  // blocks down the rows; 1: one pass straight into out
  int rows_per_slice;
};

inline ColumnSumPlan PlanColumnSum(int rows, int cols, bool aligned) {
  ColumnSumPlan p;
  p.vec = aligned && cols % 4 == 0 ? 4 : 1;
  p.tiles = CeilDiv(cols, 32 * p.vec);
  constexpr int kMinRowsPerSlice = 64;
  int64_t slices =
      std::min<int64_t>(CeilDiv(kColumnSumTargetBlocks, p.tiles), CeilDiv(rows, kMinRowsPerSlice));
  slices = std::min<int64_t>(slices, kWorkspaceFloats / cols);
  slices = std::max<int64_t>(slices, 1);
  p.rows_per_slice = CeilDiv(rows, slices);
  p.slices = CeilDiv(rows, p.rows_per_slice);
  return p;
}

struct LayerNormBackwardPlan {
  int warps;  // rows in flight per block (threads = 32 * warps)
  int blocks;
  size_t smem;      // bytes of per-warp dw/db accumulators in shared memory
  bool global_acc;  // C too large for shared memory: per-warp accumulators in the workspace
  int slices;       // partial sums of width 2C in the workspace (0: one pass, no workspace)
};

inline LayerNormBackwardPlan PlanLayerNormBackward(int N, int C, bool want_acc) {
  constexpr int64_t kDefaultSmem = 48 * 1024, kMaxSmem = 227 * 1024;
  constexpr int kTargetWarps = 2048;  // about 16 per SM on an H100
  LayerNormBackwardPlan p{8, 0, 0, false, 0};
  const int64_t warp_bytes = int64_t{2} * C * static_cast<int64_t>(sizeof(float));
  const int64_t width = int64_t{2} * C;
  if (want_acc) {
    while (p.warps > 1 && p.warps * warp_bytes > kDefaultSmem) p.warps /= 2;
    if (warp_bytes > kMaxSmem) {
      p.global_acc = true;
      p.warps = static_cast<int>(std::clamp<int64_t>(kWorkspaceFloats / width, 1, 8));
    } else {
      p.smem = static_cast<size_t>(p.warps * warp_bytes);
    }
  }
  int64_t blocks = std::min<int64_t>(CeilDiv(N, p.warps), CeilDiv(kTargetWarps, p.warps));
  if (want_acc) {
    const int64_t slice_floats = width * (p.global_acc ? p.warps : 1);
    ISTHMUS_CHECK(slice_floats <= kWorkspaceFloats, "column-sum slices overflow the workspace");
    blocks = std::max<int64_t>(1, std::min(blocks, kWorkspaceFloats / slice_floats));
    p.slices = static_cast<int>(p.global_acc ? blocks * p.warps : (blocks > 1 ? blocks : 0));
  }
  p.blocks = static_cast<int>(blocks);
  return p;
}

inline int SumSquaresBlocks(int64_t n) {
  constexpr int64_t kPerBlock = int64_t{detail::kSumThreads} * 16;
  return static_cast<int>(std::min<int64_t>((n + kPerBlock - 1) / kPerBlock, kSumSquaresMaxBlocks));
}

// ---- Launch functions ---------------------------------------------------------------------

// Launches MapKernel over n elements, vectorised when every pointer allows it.
template <typename Op, typename Tout, typename... Tin>
void LaunchMap(Op op, Tout* out, int64_t n, cudaStream_t stream, const Tin*... in) {
  if (n <= 0) return;
  const bool vec = detail::Aligned(out, detail::kElemVec * sizeof(Tout)) &&
                   (detail::Aligned(in, detail::kElemVec * sizeof(Tin)) && ...);
  auto kernel =
      vec ? detail::MapKernel<true, Op, Tout, Tin...> : detail::MapKernel<false, Op, Tout, Tin...>;
  ISTHMUS_LAUNCH(kernel, detail::ElementwiseGrid(n), dim3(detail::kElemThreads), 0, stream, op, out,
                 n, in...);
}

template <typename Tin, typename Tout>
void LaunchCast(const Tin* src, Tout* out, int64_t n, cudaStream_t stream) {
  LaunchMap(detail::CopyOp{}, out, n, stream, src);
}

inline void LaunchSubtract(const float* a, const float* b, float* out, int64_t n,
                           cudaStream_t stream) {
  LaunchMap(detail::SubtractOp{}, out, n, stream, a, b);
}

template <typename T>
void LaunchBiasResidual(const float* bias, const float* residual, T* out, int N, int C,
                        cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(N) * C;
  if (n <= 0) return;
  const bool vec = C % 4 == 0 && detail::Aligned(bias, 16) && detail::Aligned(residual, 16) &&
                   detail::Aligned(out, 4 * sizeof(T));
  auto kernel = vec ? detail::BiasResidualKernel<T, true> : detail::BiasResidualKernel<T, false>;
  ISTHMUS_LAUNCH(kernel, detail::ElementwiseGrid(n), dim3(detail::kElemThreads), 0, stream, bias,
                 residual, out, n, C);
}

template <typename T>
void LaunchColumnSumAccumulate(const T* m, float* out, int rows, int cols, float* workspace,
                               cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const ColumnSumPlan p = PlanColumnSum(rows, cols, detail::Aligned(m, 4 * sizeof(T)));
  auto kernel = p.vec == 4 ? detail::ColumnSumKernel<T, 4> : detail::ColumnSumKernel<T, 1>;
  float* partial = p.slices > 1 ? workspace : nullptr;
  ISTHMUS_CHECK(p.slices == 1 || static_cast<int64_t>(p.slices) * cols <= kWorkspaceFloats,
                "column-sum partials overflow the workspace");
  ISTHMUS_LAUNCH(kernel, dim3(p.tiles, p.slices), dim3(32, 8), 0, stream, m, rows, cols,
                 p.rows_per_slice, partial, out);
  if (partial == nullptr) return;
  ISTHMUS_LAUNCH(detail::SumPartialsKernel, dim3(CeilDiv(cols, 32)), dim3(32, 8), 0, stream,
                 static_cast<const float*>(partial), p.slices, cols, cols, out,
                 static_cast<float*>(nullptr));
}

inline void LaunchEmbeddingForward(const int32_t* tokens, const float* wte, const float* wpe,
                                   float* out, int B, int Tn, int C, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(B) * Tn * C;
  if (n <= 0) return;
  const bool vec = C % 4 == 0 && detail::Aligned(wte, 16) && detail::Aligned(wpe, 16) &&
                   detail::Aligned(out, 16);
  auto kernel = vec ? detail::EmbeddingForwardKernel<true> : detail::EmbeddingForwardKernel<false>;
  ISTHMUS_LAUNCH(kernel, detail::ElementwiseGrid(n), dim3(detail::kElemThreads), 0, stream, tokens,
                 wte, wpe, out, n, Tn, C);
}

inline void LaunchEmbeddingBackward(const float* dout, const int32_t* order, const int32_t* starts,
                                    float* dwte, float* dwpe, int B, int Tn, int C, int V,
                                    cudaStream_t stream) {
  if (B <= 0 || Tn <= 0 || C <= 0) return;
  const int wte_rows = dwte != nullptr ? V : 0;
  const int wpe_rows = dwpe != nullptr ? Tn : 0;
  if (wte_rows + wpe_rows == 0) return;
  const bool vec = C % 4 == 0 && detail::Aligned(dout, 16) && detail::Aligned(dwte, 16) &&
                   detail::Aligned(dwpe, 16);
  auto kernel = vec ? detail::EmbeddingBackwardKernel<4> : detail::EmbeddingBackwardKernel<1>;
  const dim3 grid(wte_rows + wpe_rows, CeilDiv(C, 32 * (vec ? 4 : 1)));
  ISTHMUS_LAUNCH(kernel, grid, dim3(detail::kEmbWarps * 32), 0, stream, dout, order, starts, dwte,
                 dwpe, B, Tn, C, wte_rows);
}

template <typename Tout>
void LaunchLayerNormForward(const float* x, const float* w, const float* b, Tout* out, float* mean,
                            float* rstd, int N, int C, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  const bool vec_ok = detail::Aligned(x, 16) && detail::Aligned(w, 16) && detail::Aligned(b, 16) &&
                      detail::Aligned(out, 4 * sizeof(Tout));
  using Kernel =
      void (*)(const float*, const float*, const float*, Tout*, float*, float*, int, int);
  Kernel kernel;
  switch (detail::LayerNormCache(C, vec_ok)) {
    case 2:
      kernel = detail::LayerNormForwardKernel<Tout, 2>;
      break;
    case 8:
      kernel = detail::LayerNormForwardKernel<Tout, 8>;
      break;
    case 16:
      kernel = detail::LayerNormForwardKernel<Tout, 16>;
      break;
    default:
      kernel = detail::LayerNormForwardKernel<Tout, 0>;
      break;
  }
  ISTHMUS_LAUNCH(kernel, dim3(CeilDiv(N, detail::kLnForwardWarps)),
                 dim3(detail::kLnForwardWarps * 32), 0, stream, x, w, b, out, mean, rstd, N, C);
}

template <typename Tin>
void LaunchLayerNormBackward(const Tin* dout, const float* x, const float* w, const float* mean,
                             const float* rstd, float* dx, float* dw, float* db, int N, int C,
                             float* workspace, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  if (dx == nullptr && dw == nullptr && db == nullptr) return;
  const bool want_acc = dw != nullptr || db != nullptr;
  const LayerNormBackwardPlan p = PlanLayerNormBackward(N, C, want_acc);
  const bool vec_ok = detail::Aligned(dout, 4 * sizeof(Tin)) && detail::Aligned(x, 16) &&
                      detail::Aligned(w, 16) && detail::Aligned(dx, 16);
  using Kernel = void (*)(const Tin*, const float*, const float*, const float*, const float*,
                          float*, float*, float*, int, int, float*, bool);
  Kernel kernel;
  switch (detail::LayerNormCache(C, vec_ok)) {
    case 2:
      kernel = detail::LayerNormBackwardKernel<Tin, 2>;
      break;
    case 8:
      kernel = detail::LayerNormBackwardKernel<Tin, 8>;
      break;
    case 16:
      kernel = detail::LayerNormBackwardKernel<Tin, 16>;
      break;
    default:
      kernel = detail::LayerNormBackwardKernel<Tin, 0>;
      break;
  }
  if (p.smem > 48 * 1024) ISTHMUS_ALLOW_SMEM(kernel, static_cast<int>(p.smem));
  float* partial = p.slices > 0 ? workspace : nullptr;
  ISTHMUS_LAUNCH(kernel, dim3(p.blocks), dim3(p.warps * 32), p.smem, stream, dout, x, w, mean, rstd,
                 dx, dw, db, N, C, partial, p.global_acc);
  if (partial == nullptr) return;
  ISTHMUS_LAUNCH(detail::SumPartialsKernel, dim3(CeilDiv(int64_t{2} * C, 32)), dim3(32, 8), 0,
                 stream, static_cast<const float*>(partial), p.slices, 2 * C, C, dw, db);
}

template <typename T>
void LaunchGeluForward(const T* x, T* out, int64_t n, cudaStream_t stream) {
  LaunchMap(detail::GeluOp{}, out, n, stream, x);
}

template <typename T>
void LaunchGeluBackward(const T* dout, const T* x, T* dx, int64_t n, cudaStream_t stream) {
  LaunchMap(detail::GeluBackwardOp{}, dx, n, stream, dout, x);
}

template <typename Tout>
void LaunchRmsNormForward(const float* x, const float* w, Tout* out, float* rstd, int N, int C,
                          float eps, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  const int threads = std::min(detail::kRmsThreads, CeilDiv(C, 32) * 32);
  ISTHMUS_LAUNCH(detail::RmsNormForwardKernel<Tout>, dim3(N), dim3(threads), 0, stream, x, w, out,
                 rstd, C, eps);
}

template <typename Tin>
void LaunchRmsNormBackward(const Tin* dout, const float* x, const float* w, const float* rstd,
                           float* dx, float* dw, int N, int C, float* workspace,
                           cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  if (dx != nullptr) {
    const int threads = std::min(detail::kRmsThreads, CeilDiv(C, 32) * 32);
    ISTHMUS_LAUNCH(detail::RmsNormBackwardKernel<Tin>, dim3(N), dim3(threads), 0, stream, dout, x,
                   w, rstd, dx, C);
  }
  if (dw == nullptr) return;
  const ColumnSumPlan p = PlanColumnSum(N, C, false);
  float* partial = p.slices > 1 ? workspace : nullptr;
  ISTHMUS_LAUNCH(detail::RmsNormWeightGradKernel<Tin>, dim3(p.tiles, p.slices), dim3(32, 8), 0,
                 stream, dout, x, rstd, N, C, p.rows_per_slice, partial, dw);
  if (partial == nullptr) return;
  ISTHMUS_LAUNCH(detail::SumPartialsKernel, dim3(CeilDiv(C, 32)), dim3(32, 8), 0, stream,
                 static_cast<const float*>(partial), p.slices, C, C, dw,
                 static_cast<float*>(nullptr));
}

template <typename T>
void LaunchSwigluForward(const T* gate, const T* up, T* out, int64_t n, cudaStream_t stream) {
  LaunchMap(detail::SwigluOp{}, out, n, stream, gate, up);
}

template <typename T>
void LaunchSwigluBackward(const T* dout, const T* gate, const T* up, T* dgate, T* dup, int64_t n,
                          cudaStream_t stream) {
  if (n <= 0 || (dgate == nullptr && dup == nullptr)) return;
  const size_t pack = detail::kElemVec * sizeof(T);
  const bool vec = detail::Aligned(dout, pack) && detail::Aligned(gate, pack) &&
                   detail::Aligned(up, pack) && detail::Aligned(dgate, pack) &&
                   detail::Aligned(dup, pack);
  auto kernel =
      vec ? detail::SwigluBackwardKernel<T, true> : detail::SwigluBackwardKernel<T, false>;
  ISTHMUS_LAUNCH(kernel, detail::ElementwiseGrid(n), dim3(detail::kElemThreads), 0, stream, dout,
                 gate, up, dgate, dup, n);
}

template <typename T>
void LaunchRopeGqaForward(const T* q, const T* k, const T* v, const float* rope, T* qkv, int B,
                          int Tn, int H, int Hkv, int D, cudaStream_t stream) {
  const int64_t pairs = static_cast<int64_t>(B) * Tn * H * (D / 2);
  if (pairs <= 0) return;
  ISTHMUS_LAUNCH(detail::RopeGqaForwardKernel<T>, dim3(CeilDiv(pairs, detail::kElemThreads)),
                 dim3(detail::kElemThreads), 0, stream, q, k, v, rope, qkv, pairs, Tn, H, Hkv, D);
}

template <typename T>
void LaunchRopeGqaBackward(const T* dqkv, const float* rope, T* dq, T* dk, T* dv, int B, int Tn,
                           int H, int Hkv, int D, cudaStream_t stream) {
  const int64_t pairs = static_cast<int64_t>(B) * Tn * H * (D / 2);
  if (pairs <= 0) return;
  ISTHMUS_LAUNCH(detail::RopeGqaBackwardKernel<T>, dim3(CeilDiv(pairs, detail::kElemThreads)),
                 dim3(detail::kElemThreads), 0, stream, dqkv, rope, dq, dk, dv, pairs, Tn, H, Hkv,
                 D);
}

template <typename T>
void LaunchSoftmaxCrossEntropy(const T* logits, const int32_t* targets, float* losses, T* dlogits,
                               const float* dloss, int N, int V, cudaStream_t stream) {
  if (N <= 0 || V <= 0) return;
  const bool vec = V % 4 == 0 && detail::Aligned(logits, 4 * sizeof(T)) &&
                   detail::Aligned(dlogits, 4 * sizeof(T));
  using Kernel = void (*)(const T*, const int32_t*, float*, T*, const float*, int, int);
  Kernel kernel;
  int rows_per_block, threads;
  if (V <= detail::kCeWarpMaxV) {
    kernel = vec ? detail::SoftmaxCrossEntropyKernel<T, 32, true>
                 : detail::SoftmaxCrossEntropyKernel<T, 32, false>;
    rows_per_block = 4;
    threads = 128;
  } else {
    kernel = vec ? detail::SoftmaxCrossEntropyKernel<T, 256, true>
                 : detail::SoftmaxCrossEntropyKernel<T, 256, false>;
    rows_per_block = 1;
    threads = 256;
  }
  ISTHMUS_LAUNCH(kernel, dim3(CeilDiv(N, rows_per_block)), dim3(threads), 0, stream, logits,
                 targets, losses, dlogits, dloss, N, V);
}

template <typename T>
void LaunchDistillCrossEntropy(const T* logits, const int32_t* targets, const int32_t* ids,
                               const float* teacher, int k, float alpha, float temperature,
                               float* losses, T* dlogits, const float* dloss, int N, int V,
                               cudaStream_t stream) {
  if (N <= 0 || V <= 0) return;
  ISTHMUS_LAUNCH(detail::DistillCrossEntropyKernel<T>, dim3(N), dim3(detail::kDistillThreads), 0,
                 stream, logits, targets, ids, teacher, k, alpha, temperature, losses, dlogits,
                 dloss, V);
}

inline void LaunchSumSquares(const float* x, int64_t n, float* out, float* workspace,
                             cudaStream_t stream) {
  if (n <= 0) {
    ISTHMUS_LAUNCH(detail::SumKernel<false>, dim3(1), dim3(detail::kSumThreads), 0, stream,
                   static_cast<const float*>(nullptr), int64_t{0}, false, out);
    return;
  }
  const int blocks = SumSquaresBlocks(n);
  float* first = blocks > 1 ? workspace : out;
  ISTHMUS_LAUNCH(detail::SumKernel<true>, dim3(blocks), dim3(detail::kSumThreads), 0, stream, x, n,
                 detail::Aligned(x, 16), first);
  if (blocks == 1) return;
  ISTHMUS_LAUNCH(detail::SumKernel<false>, dim3(1), dim3(detail::kSumThreads), 0, stream,
                 static_cast<const float*>(workspace), static_cast<int64_t>(blocks),
                 detail::Aligned(workspace, 16), out);
}

template <typename Tcopy>
void LaunchAdamW(float* param, const float* grad, float* m, float* v, Tcopy* copy,
                 const AdamWChunk* chunks, int num_chunks, const float* sumsq,
                 const AdamWScalars* scalars, const AdamWConfig& config, cudaStream_t stream) {
  if (num_chunks <= 0) return;
  const bool aligned = detail::Aligned(param, 16) && detail::Aligned(grad, 16) &&
                       detail::Aligned(m, 16) && detail::Aligned(v, 16) &&
                       detail::Aligned(copy, 4 * sizeof(Tcopy));
  ISTHMUS_LAUNCH(detail::AdamWKernel<Tcopy>, dim3(num_chunks * detail::kAdamWBlocksPerChunk),
                 dim3(detail::kAdamWThreads), 0, stream, param, grad, m, v, copy, chunks, sumsq,
                 scalars, config, aligned);
}

}  // namespace isthmus::ops::ISTHMUS_CUDA_NS
