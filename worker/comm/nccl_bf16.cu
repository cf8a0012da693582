// The casts around the NCCL all-reduce in bf16 (nccl_communicator.cc): fp32 values to a
// bf16 staging buffer, and the reduced bf16 sum back to fp32 times a scale (1 / ranks).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "worker/comm/nccl_bf16.h"

namespace isthmus::comm {
namespace {

__global__ void ToBf16Kernel(const float* in, __nv_bfloat16* out, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    out[i] = __float2bfloat16_rn(in[i]);
  }
}

__global__ void FromBf16Kernel(const __nv_bfloat16* in, float* out, size_t n, float scale) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    out[i] = __bfloat162float(in[i]) * scale;
  }
}

unsigned Blocks(size_t n) {
  const size_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks < 4096 ? (blocks == 0 ? 1 : blocks) : 4096);
}

}  // namespace

cudaError_t LaunchToBf16(const float* in, void* out, size_t n, cudaStream_t stream) {
  ToBf16Kernel<<<Blocks(n), 256, 0, stream>>>(in, static_cast<__nv_bfloat16*>(out), n);
  return cudaGetLastError();
}

cudaError_t LaunchFromBf16(const void* in, float* out, size_t n, float scale, cudaStream_t stream) {
  FromBf16Kernel<<<Blocks(n), 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(in), out, n,
                                                scale);
  return cudaGetLastError();
}

}  // namespace isthmus::comm
