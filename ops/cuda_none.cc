// The CUDA half of ops/device.h in builds without CUDA: no devices, and a message that
// says how to get a build with them.
#include "ops/device.h"

namespace isthmus::ops {

bool CudaBuilt() { return false; }

int CudaDeviceCount(std::string* why) {
  if (why != nullptr) {
    *why = "this build has no CUDA backend (nvcc was not found when it was configured)";
  }
  return 0;
}

Result<std::unique_ptr<Ops>> CreateCudaOps(int) {
  return Status::FailedPrecondition(
      "this build has no CUDA backend: install the CUDA toolkit and reconfigure "
      "(cmake -DISTHMUS_CUDA=ON), or use --device cpu");
}

}  // namespace isthmus::ops
