// A CPU emulator of the CUDA execution model, for tests only: it lets the kernels of ops/
// (written against ops/cuda_compat.h) run on a machine without a GPU, so that their index
// arithmetic, tiling, barriers and reductions are checked against the CPU reference here
// and not first on a GPU.
//
// How it runs a launch: the blocks of the grid one after another; inside a block, every
// CUDA thread is a fiber (ucontext) with its own stack, run in turn until it reaches a
// barrier (__syncthreads, __syncwarp, a shuffle) or returns. A barrier opens when every
// thread it concerns waits at it; a barrier that can never open (some threads returned or
// wait elsewhere: divergent __syncthreads, a shuffle in a partial warp) aborts the test
// with a description, as does a launch configuration CUDA would refuse (more than 1024
// threads, an empty grid, dynamic shared memory above 48 KiB without
// ISTHMUS_ALLOW_SMEM or above 227 KiB) -- that one is reported through cudaGetLastError()
// like CUDA does. Dynamic shared memory starts filled with NaN bytes, so reading it
// before writing shows. Odd-numbered blocks run their threads in reverse order, so a
// missing barrier tends to give different numbers in different blocks.
//
// Tensor cores (mma.sync m16n8k16 bf16, ldmatrix.x4): warp-collective, with the PTX ISA's
// per-lane register layouts, so fragment bookkeeping is checked here as on the GPU.
//
// Not emulated: atomics, cooperative groups, warp-level votes, inline PTX, timing and
// memory spaces (everything is host memory). Not thread-safe: one launch at a time.
#pragma once

#include <math.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
};

struct CUstream_emu;
using cudaStream_t = CUstream_emu*;

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
};
const char* cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();

constexpr int warpSize = 32;

struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

// bfloat16 with only the explicit conversions (the real type has more; kernels use these).
struct __nv_bfloat16 {
  uint16_t bits_;
};
inline __nv_bfloat16 __float2bfloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu) != 0) {
    return {static_cast<uint16_t>((u >> 16) | 0x40u)};  // quiet NaN
  }
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return {static_cast<uint16_t>(u >> 16)};
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t u = static_cast<uint32_t>(h.bits_) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, sizeof i);
  return i;
}
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

namespace isthmus::emu {

// The state of the CUDA thread that is running now.
struct ThreadState {
  dim3 idx;
  int linear = 0;  // x + y*bx + z*bx*by
  int lane = 0;
  int warp = 0;
};

ThreadState& Current();
const dim3& BlockIdx();
const dim3& BlockDim();
const dim3& GridDim();

// Barriers. SyncWarp requires every existing lane of the calling warp (mask must be full).
void SyncThreads();
void SyncWarp(unsigned mask);
// The calling warp's exchange slot of `lane` (32 bytes), for shuffles and tensor cores.
void* WarpSlot(int lane);
// Dynamic shared memory of the current block.
void* DynamicShared();
// Records the dynamic shared memory a kernel was allowed (ISTHMUS_ALLOW_SMEM).
void AllowSmem(const void* kernel, size_t bytes);

// Runs `body` as every thread of every block of the grid. Bad configurations are recorded
// for cudaGetLastError() and nothing runs.
void RunGrid(const void* kernel, dim3 grid, dim3 block, size_t smem,
             const std::function<void()>& body);

template <typename... Params, typename... Args>
void Launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t,
            Args&&... args) {
  std::tuple<std::decay_t<Params>...> bound(static_cast<std::decay_t<Params>>(args)...);
  RunGrid(reinterpret_cast<const void*>(kernel), grid, block, smem,
          [&] { std::apply(kernel, bound); });
}

// The recorded launch error (cudaGetLastError clears it, cudaPeekAtLastError does not).
cudaError_t TakeLastError(bool clear);

// Counters for tests of the emulator itself.
struct Stats {
  int64_t launches = 0;
  int64_t blocks = 0;
  int64_t threads = 0;
};
Stats& GetStats();

}  // namespace isthmus::emu

#define threadIdx (::isthmus::emu::Current().idx)
#define blockIdx (::isthmus::emu::BlockIdx())
#define blockDim (::isthmus::emu::BlockDim())
#define gridDim (::isthmus::emu::GridDim())

inline void __syncthreads() { ::isthmus::emu::SyncThreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::isthmus::emu::SyncWarp(mask); }

namespace isthmus::emu {
template <typename T>
T Shuffle(unsigned mask, T v, int src_lane_of_me) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  const int lane = Current().lane;
  std::memcpy(WarpSlot(lane), &v, sizeof(T));
  SyncWarp(mask);
  T out;
  std::memcpy(&out, WarpSlot(src_lane_of_me), sizeof(T));
  SyncWarp(mask);
  return out;
}
}  // namespace isthmus::emu

template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int lane = ::isthmus::emu::Current().lane;
  const int base = lane - lane % width;
  const int src = base + ((lane % width) ^ lane_mask) % width;
  return ::isthmus::emu::Shuffle(mask, v, src);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = ::isthmus::emu::Current().lane;
  const int in = lane % width + static_cast<int>(delta);
  return ::isthmus::emu::Shuffle(mask, v, in < width ? lane + static_cast<int>(delta) : lane);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = ::isthmus::emu::Current().lane;
  const int in = lane % width - static_cast<int>(delta);
  return ::isthmus::emu::Shuffle(mask, v, in >= 0 ? lane - static_cast<int>(delta) : lane);
}
template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int lane = ::isthmus::emu::Current().lane;
  return ::isthmus::emu::Shuffle(mask, v, lane - lane % width + src % width);
}

// ---- Tensor-core primitives of ops/cuda_compat.h ------------------------------------------
// Warp-collective, like the hardware's: every lane deposits its registers, the warp meets
// at a barrier, and each lane computes its own share with the PTX ISA's register layouts,
// so a kernel that misplaces a fragment element gets wrong numbers here too.
namespace isthmus::emu {
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 with d as accumulator (fp32 sums).
void MmaM16N8K16Bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16; aborts on a row that is not 16-byte
// aligned or not in the block's shared memory.
void LdMatrixX4(uint32_t (&r)[4], const void* row, bool trans);
}  // namespace isthmus::emu
