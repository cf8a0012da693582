// A backend for tests that runs the CUDA backend's kernel code (ops/cuda_backend.h, with
// the kernels of ops/cuda_kernels.cuh and ops/cuda_attention.cuh) on the CPU emulator of
// tests/ops/cuda_emu.h, with host memory and the CPU reference's matmul. What it checks
// on a machine without a GPU: the CUDA kernels' indexing, tiling and reductions and the
// way the backend composes them. What it cannot: cuBLASLt, device memory, streams, graphs.
#pragma once

#include <memory>

#include "ops/ops.h"

namespace isthmus::ops {

std::unique_ptr<Ops> CreateEmulatedCudaOps();

}  // namespace isthmus::ops
