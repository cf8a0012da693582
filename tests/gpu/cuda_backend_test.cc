// The CUDA backend on a GPU against the CPU reference: the conformance suite (every kernel,
// forward and backward, fp32 and bf16, and a whole training step) at the training shapes
// of the benchmarks (4 x 256 at context 256, 12 x 768 at context 1024; head size 64, so the
// tensor-core attention runs in bf16) and at a shape with an odd head size and length (the
// generic paths). Skips without a GPU.
#include "ops/device.h"
#include "tests/ops/backend_conformance.h"

namespace isthmus::ops::conformance {
namespace {

std::unique_ptr<Ops> MakeCuda(std::string* why) {
  if (CudaDeviceCount(why) == 0) return nullptr;
  auto ops = CreateCudaOps(0);
  if (!ops.ok()) {
    *why = ops.status().ToString();
    return nullptr;
  }
  return std::move(ops).value();
}

INSTANTIATE_TEST_SUITE_P(Gpu, BackendTest,
                         ::testing::Values(BackendCase{"cuda", MakeCuda, {8, 256, 256, 4, 256, 16}},
                                           BackendCase{
                                               "cuda", MakeCuda, {2, 1024, 768, 12, 256, 16}},
                                           BackendCase{"cuda", MakeCuda, {3, 77, 120, 5, 256, 8}}),
                         CaseName);

}  // namespace
}  // namespace isthmus::ops::conformance
