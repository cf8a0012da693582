// What CUDA kernel code of ops/ may use, in one place, so that the same kernels compile
// twice: with nvcc for the GPU (ops/cuda_ops.cu), and with the host compiler against the
// CPU emulator of the CUDA execution model (tests/ops/cuda_emu.h), where the tests run
// them on machines without a GPU and compare them with the CPU reference.
//
// Kernel code written against this header uses only: __global__/__device__ functions,
// threadIdx/blockIdx/blockDim/gridDim, static __shared__ arrays and ISTHMUS_DYNAMIC_SMEM,
// __syncthreads, __syncwarp and full-warp __shfl_*_sync, __nv_bfloat16 with
// __float2bfloat16 / __bfloat162float, float2/float4, the C math functions on float
// (expf, logf, sqrtf, rsqrtf, tanhf, fmaxf, fminf, fabsf, isfinite), nvcuda::wmma with
// 16x16x16 bf16 fragments and fp32 accumulators, and launches through ISTHMUS_LAUNCH. No
// atomics, no cooperative groups, no inline PTX.
//
// Everything declared by the kernel headers lives in namespace isthmus::ops::ISTHMUS_CUDA_NS
// ("cuda" under nvcc, "cuda_emu" in the emulator) so that both builds can be linked into
// one test binary without clashing.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#define ISTHMUS_CUDA_NS cuda
#define ISTHMUS_EMULATED 0
// Enqueues kernel<<<grid, block, smem, stream>>>(args...).
#define ISTHMUS_LAUNCH(kernel, grid, block, smem, stream, ...) \
  kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
// Declares `name`, a `type*` to the block's dynamic shared memory (16-byte aligned).
#define ISTHMUS_DYNAMIC_SMEM(type, name)                         \
  extern __shared__ __align__(16) unsigned char isthmus_smem_[]; \
  type* name = reinterpret_cast<type*>(isthmus_smem_)
// Allows `kernel` more than 48 KiB of dynamic shared memory (needed before such a launch).
#define ISTHMUS_ALLOW_SMEM(kernel, bytes) \
  cudaFuncSetAttribute((kernel), cudaFuncAttributeMaxDynamicSharedMemorySize, (bytes))

#else

#include "tests/ops/cuda_emu.h"

#define ISTHMUS_CUDA_NS cuda_emu
#define ISTHMUS_EMULATED 1
#define ISTHMUS_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::isthmus::emu::Launch((kernel), (grid), (block), (smem), (stream), __VA_ARGS__)
#define ISTHMUS_DYNAMIC_SMEM(type, name) \
  type* name = reinterpret_cast<type*>(::isthmus::emu::DynamicShared())
#define ISTHMUS_ALLOW_SMEM(kernel, bytes) \
  ::isthmus::emu::AllowSmem(reinterpret_cast<const void*>(kernel), (bytes))

#endif

namespace isthmus::ops::ISTHMUS_CUDA_NS {

using bf16 = __nv_bfloat16;

// Loads and stores that convert between fp32 (what kernels compute in) and the element
// type of a tensor (float or bf16).
__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(bf16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ bf16 FromFloat<bf16>(float x) {
  return __float2bfloat16(x);
}

inline int CeilDiv(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Warp-wide sum and max. Butterfly reductions leave the same bits in every lane (each step
// combines the same two values, only commuted).
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

}  // namespace isthmus::ops::ISTHMUS_CUDA_NS
