// What the GPU tests (label `gpu`) share: whether a GPU is usable here, and the skip that
// says why not. Every test of tests/gpu calls ISTHMUS_REQUIRE_GPU() first, so that on a
// machine without a GPU (or a build without CUDA) the whole label skips with the reason.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "ops/device.h"

namespace isthmus::testing {

// Visible CUDA devices; 0 with the reason in *why.
inline int GpuCount(std::string* why) { return ops::CudaDeviceCount(why); }

}  // namespace isthmus::testing

#define ISTHMUS_REQUIRE_GPU()                                                           \
  do {                                                                                  \
    std::string isthmus_why_;                                                           \
    if (::isthmus::testing::GpuCount(&isthmus_why_) == 0) {                             \
      GTEST_SKIP() << "no CUDA device: " << isthmus_why_ << " (this test needs a GPU)"; \
    }                                                                                   \
  } while (0)
