// The CUDA backend's kernels, run on the CPU emulator (tests/ops/emu_ops.h), checked against
// the CPU reference by the conformance suite, at small shapes (every CUDA thread is a fiber
// here, so the training shapes would take minutes). Runs on every machine: the emulator
// needs no GPU and no CUDA toolkit. tests/gpu/cuda_backend_test.cc runs the same suite on a
// GPU at the training shapes.
#include "tests/ops/backend_conformance.h"
#include "tests/ops/emu_ops.h"

namespace isthmus::ops::conformance {
namespace {

std::unique_ptr<Ops> MakeEmulated(std::string*) { return CreateEmulatedCudaOps(); }

INSTANTIATE_TEST_SUITE_P(Emulated, BackendTest,
                         ::testing::Values(
                             // hs 64: the tensor-core attention path for bf16.
                             BackendCase{"emulated", MakeEmulated, {2, 40, 128, 2, 61, 4}},
                             // hs 24, T not a multiple of any tile: the generic paths.
                             BackendCase{"emulated", MakeEmulated, {1, 19, 48, 2, 256, 3}}),
                         CaseName);

}  // namespace
}  // namespace isthmus::ops::conformance
