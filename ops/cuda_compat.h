// What CUDA kernel code of ops/ may use, in one place, so that the same kernels compile
// twice: with nvcc for the GPU (ops/cuda_ops.cu), and with the host compiler against the
// CPU emulator of the CUDA execution model (tests/ops/cuda_emu.h), where the tests run
// them on machines without a GPU and compare them with the CPU reference.
//
// Kernel code written against this header uses only: __global__/__device__ functions,
// threadIdx/blockIdx/blockDim/gridDim, static __shared__ arrays and ISTHMUS_DYNAMIC_SMEM,
// __syncthreads, __syncwarp and full-warp __shfl_*_sync, __nv_bfloat16 with
// __float2bfloat16 / __bfloat162float, float2/float4, the C math functions on float
// (expf, exp2f, logf, sqrtf, rsqrtf, tanhf, fmaxf, fminf, fabsf, isfinite), the
// tensor-core primitives below (MmaBf16, LdMatrixX4Trans, PackBf16x2), and launches
// through ISTHMUS_LAUNCH. No atomics, no cooperative groups, and inline PTX only inside
// this header's primitives, each of which the emulator implements with the same per-lane
// register layout.
//
// Everything declared by the kernel headers lives in namespace isthmus::ops::ISTHMUS_CUDA_NS
// ("cuda" under nvcc, "cuda_emu" in the emulator) so that both builds can be linked into
// one test binary without clashing.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)

#include <cuda_bf16.h>
#include <cuda_runtime.h>

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

// ---- Tensor-core primitives ---------------------------------------------------------------
// Register layouts are the PTX ISA's for mma.m16n8k16 with bf16 inputs; lane l = 4g + t
// (g = l / 4, t = l % 4) holds:
//   a[4] (16x16 matrix_a, row-major): a[i] = rows g + 8 (i % 2), columns 2t + 8 (i / 2) and
//        the next column (the lower-numbered element in the low 16 bits);
//   b[2] (16x8 matrix_b, k x n):      b[i] = k rows 2t + 8i and 2t + 8i + 1 of column g;
//   d[4] (16x8 fp32 accumulator):     d[i] = row g + 8 (i / 2), column 2t + i % 2.

// d += a b, one m16n8k16 product of the calling warp (every lane calls it).
__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4],
                                        const uint32_t (&b)[2]) {
#if ISTHMUS_EMULATED
  ::isthmus::emu::MmaM16N8K16Bf16(d, a, b);
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// ldmatrix.x4.trans from shared memory: lanes 8i..8i+7 give the addresses of rows 0..7 of
// 8x8 bf16 matrix i (16 bytes each, 16-byte aligned), and r[i] receives matrix i
// transposed in matrix_b order: elements (2t, g) and (2t + 1, g). For a row-major [k][n]
// tile, matrices (k0, n0), (k0 + 8, n0), (k0, n0 + 8), (k0 + 8, n0 + 8) give the b[2]
// fragments of n-blocks n0 (r[0], r[1]) and n0 + 8 (r[2], r[3]).
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const bf16* row) {
#if ISTHMUS_EMULATED
  ::isthmus::emu::LdMatrixX4(r, row, /*trans=*/true);
#else
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
#endif
}

// Two floats rounded to bf16 (nearest, ties to even) in one register, lo in the low half.
__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
#if ISTHMUS_EMULATED
  return static_cast<uint32_t>(__float2bfloat16(lo).bits_) |
         static_cast<uint32_t>(__float2bfloat16(hi).bits_) << 16;
#else
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
#endif
}

}  // namespace isthmus::ops::ISTHMUS_CUDA_NS
