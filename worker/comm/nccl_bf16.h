// Stream-ordered casts for the NCCL all-reduce in bf16 (built with NCCL only): `out`/`in`
// of the bf16 side are device buffers of n bf16 values.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace isthmus::comm {

cudaError_t LaunchToBf16(const float* in, void* out, size_t n, cudaStream_t stream);
// out[i] = float(in[i]) * scale.
cudaError_t LaunchFromBf16(const void* in, float* out, size_t n, float scale, cudaStream_t stream);

}  // namespace isthmus::comm
