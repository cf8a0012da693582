// Tests of the CUDA emulator itself (tests/ops/cuda_emu.h): kernels whose results are
// known, barriers and shuffles, the tensor-core primitives, and the failures it must report rather
// than hide.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "ops/cuda_compat.h"

namespace isthmus::ops::ISTHMUS_CUDA_NS {
namespace {

// Block sum: warp shuffles, then one value per warp through shared memory.
__global__ void BlockSumKernel(const float* x, float* out, int n) {
  __shared__ float partial[32];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = i < n ? x[i] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x / 32;
    float s = lane < warps ? partial[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
    if (lane == 0) out[blockIdx.x] = s;
  }
}

TEST(CudaEmuTest, BlockReductionWithShufflesAndSharedMemory) {
  const int n = 1000, threads = 256, blocks = CeilDiv(n, threads);
  std::vector<float> x(n);
  std::iota(x.begin(), x.end(), 1.0f);
  std::vector<float> out(blocks, -1.0f);
  ISTHMUS_LAUNCH(BlockSumKernel, dim3(blocks), dim3(threads), 0, nullptr, x.data(), out.data(), n);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  double total = 0;
  for (float v : out) total += v;
  EXPECT_EQ(total, n * (n + 1) / 2.0);
  EXPECT_EQ(out[0], 256.0f * 257.0f / 2.0f);
}

// Reverses each block's slice through dynamic shared memory: needs the barrier.
__global__ void ReverseKernel(const int* in, int* out) {
  ISTHMUS_DYNAMIC_SMEM(int, s);
  const int t = threadIdx.x, base = blockIdx.x * blockDim.x;
  s[t] = in[base + t];
  __syncthreads();
  out[base + t] = s[blockDim.x - 1 - t];
}

TEST(CudaEmuTest, DynamicSharedMemoryAndBarrier) {
  std::vector<int> in(128), out(128, 0);
  std::iota(in.begin(), in.end(), 0);
  ISTHMUS_LAUNCH(ReverseKernel, dim3(2), dim3(64), 64 * sizeof(int), nullptr, in.data(),
                 out.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(out[i], 63 - i);
    EXPECT_EQ(out[64 + i], 127 - i);
  }
}

// One warp: C[16,16] = 2 A[16,16] B[16,16] with bf16 inputs, through the tensor-core
// primitives: A's fragments by 32-bit loads in the documented layout, B ([k][n] row-major
// in shared memory) by ldmatrix.trans, two m16n8k16 products, and C written from the
// accumulator layout.
__global__ void MmaKernel(const bf16* a, const bf16* b, float* c) {
  ISTHMUS_DYNAMIC_SMEM(bf16, bs);  // [16][24]: rows padded to 48 bytes
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  for (int i = lane; i < 256; i += 32) bs[(i / 16) * 24 + i % 16] = b[i];
  __syncwarp();
  uint32_t af[4];
  for (int i = 0; i < 4; ++i) {
    const bf16* p = a + (g + 8 * (i % 2)) * 16 + 2 * t + 8 * (i / 2);
    af[i] = PackBf16x2(__bfloat162float(p[0]), __bfloat162float(p[1]));
  }
  uint32_t bf[4];
  const int mat = lane / 8;
  LdMatrixX4Trans(bf, bs + ((mat % 2) * 8 + lane % 8) * 24 + (mat / 2) * 8);
  float acc[2][4] = {};
  const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
  MmaBf16(acc[0], af, b0);
  MmaBf16(acc[1], af, b1);
  for (int n = 0; n < 2; ++n) {
    for (int i = 0; i < 4; ++i) c[(g + 8 * (i / 2)) * 16 + 8 * n + 2 * t + i % 2] = 2 * acc[n][i];
  }
}

TEST(CudaEmuTest, MmaAndLdMatrixMatchNaiveProduct) {
  bf16 a[256], b[256];
  float c[256];
  for (int i = 0; i < 256; ++i) {
    a[i] = __float2bfloat16(static_cast<float>(i % 7) - 3.0f);
    b[i] = __float2bfloat16(static_cast<float>(i % 5) * 0.5f + static_cast<float>(i / 16));
    c[i] = NAN;
  }
  ISTHMUS_LAUNCH(MmaKernel, dim3(1), dim3(32), 16 * 24 * sizeof(bf16), nullptr, a, b, c);
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 16; ++j) {
      float s = 0;
      for (int k = 0; k < 16; ++k) {
        s += __bfloat162float(a[i * 16 + k]) * __bfloat162float(b[k * 16 + j]);
      }
      EXPECT_EQ(c[i * 16 + j], 2 * s) << i << "," << j;
    }
  }
}

// ldmatrix takes 16-byte-aligned rows of shared memory only.
__global__ void MisalignedLdMatrixKernel(int offset) {
  ISTHMUS_DYNAMIC_SMEM(bf16, s);
  uint32_t r[4];
  LdMatrixX4Trans(r, s + offset + threadIdx.x % 8 * 8);
}

TEST(CudaEmuDeathTest, MisalignedLdMatrixAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(ISTHMUS_LAUNCH(MisalignedLdMatrixKernel, dim3(1), dim3(32), 256, nullptr, 1),
               "not 16-byte aligned");
}

TEST(CudaEmuTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(__bfloat162float(__float2bfloat16(1.0f)), 1.0f);
  // 1 + 2^-8 lies exactly between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(__bfloat162float(__float2bfloat16(1.0f + 0.00390625f)), 1.0f);
  EXPECT_EQ(__bfloat162float(__float2bfloat16(1.0f + 0.005f)), 1.0078125f);
  EXPECT_TRUE(std::isnan(__bfloat162float(__float2bfloat16(NAN))));
}

TEST(CudaEmuTest, BadConfigurationIsReportedLikeCuda) {
  std::vector<int> in(2048), out(2048);
  ISTHMUS_LAUNCH(ReverseKernel, dim3(1), dim3(2048), 0, nullptr, in.data(), out.data());
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // cleared by the read
  ISTHMUS_LAUNCH(ReverseKernel, dim3(1), dim3(64), 64 * 1024, nullptr, in.data(), out.data());
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);  // > 48 KiB without opting in
  ISTHMUS_ALLOW_SMEM(ReverseKernel, 64 * 1024);
  ISTHMUS_LAUNCH(ReverseKernel, dim3(1), dim3(64), 64 * 1024, nullptr, in.data(), out.data());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

__global__ void DivergentBarrierKernel(int* out) {
  if (threadIdx.x >= 16) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void PartialWarpShuffleKernel(float* out) {
  if (threadIdx.x % 32 >= 8) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

TEST(CudaEmuDeathTest, DivergentBarrierAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::vector<int> out(64);
  EXPECT_DEATH(ISTHMUS_LAUNCH(DivergentBarrierKernel, dim3(1), dim3(64), 0, nullptr, out.data()),
               "divergent barrier");
  std::vector<float> f(64);
  EXPECT_DEATH(ISTHMUS_LAUNCH(PartialWarpShuffleKernel, dim3(1), dim3(64), 0, nullptr, f.data()),
               "deadlock");
}

}  // namespace
}  // namespace isthmus::ops::ISTHMUS_CUDA_NS
