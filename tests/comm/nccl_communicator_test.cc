// Tests of the NCCL communicator. They need a GPU: on a machine without one (or a build
// without NCCL) each test skips with the reason. With G visible GPUs the group has
// min(G, 4) ranks, one thread and one device each; results are checked against the same
// exact integer references as the Gloo tests.
#include "worker/comm/nccl_communicator.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/comm/comm_test_util.h"

#if ISTHMUS_HAVE_NCCL
#include <cuda_runtime.h>
#endif

namespace isthmus::comm {
namespace {

using testing::FirstBitMismatch;
using testing::RunRanks;
using testing::TempDir;

// Number of ranks to run, or 0 with *why set when the test must skip.
int UsableDevices(std::string* why) {
#if ISTHMUS_HAVE_NCCL
  int devices = 0;
  cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    cudaGetLastError();
    *why = err != cudaSuccess ? cudaGetErrorString(err) : "zero devices visible";
    return 0;
  }
  return devices < 4 ? devices : 4;
#else
  *why = "this build has no NCCL";
  return 0;
#endif
}

TEST(NcclCommunicatorTest, FactoryReportsMissingSupport) {
  std::string why;
  if (UsableDevices(&why) > 0) GTEST_SKIP() << "a CUDA device is present";
  NcclOptions o;
  TempDir dir;
  o.rendezvous = "file:" + dir.path();
  auto comm = CreateNcclCommunicator(o);
  EXPECT_EQ(comm.status().code(), Code::kFailedPrecondition) << comm.status().ToString();
}

#if ISTHMUS_HAVE_NCCL
// Two ranks on one GPU are refused by the rendezvous, naming both, before NCCL is asked
// (which would stop with "Duplicate GPU detected" or hang). Runs on a single GPU.
TEST(NcclCommunicatorTest, TwoRanksOnOneGpuAreRefusedNamingBoth) {
  std::string why;
  if (UsableDevices(&why) == 0) GTEST_SKIP() << "no CUDA device: " << why;
  TempDir dir;
  Status result[2];
  RunRanks(2, [&](int rank) {
    NcclOptions o;
    o.rank = rank;
    o.world_size = 2;
    o.device = 0;
    o.rendezvous = "file:" + dir.path();
    o.timeout = std::chrono::milliseconds(20'000);
    result[rank] = CreateNcclCommunicator(o).status();
  });
  for (const Status& st : result) {
    EXPECT_EQ(st.code(), Code::kFailedPrecondition) << st.ToString();
    EXPECT_NE(st.message().find("ranks 0 and 1 both use"), std::string::npos) << st.ToString();
  }
}

TEST(NcclCommunicatorTest, CollectivesMatchExactReference) {
  std::string why;
  const int n = UsableDevices(&why);
  if (n == 0) GTEST_SKIP() << "no CUDA device: " << why;
  TempDir dir;
  const size_t count = size_t{1} << 20;
  std::vector<std::vector<float>> results(n);
  RunRanks(n, [&](int rank) {
    NcclOptions o;
    o.rank = rank;
    o.world_size = n;
    o.device = rank;
    o.rendezvous = "file:" + dir.path();
    o.timeout = std::chrono::milliseconds(60'000);
    auto comm = CreateNcclCommunicator(o);
    ASSERT_TRUE(comm.ok()) << comm.status().ToString();
    std::vector<float> host(count);
    for (size_t i = 0; i < count; ++i) host[i] = static_cast<float>((rank + 1) * (i % 7 + 1));
    float* dev = nullptr;
    ASSERT_EQ(cudaMalloc(&dev, count * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dev, host.data(), count * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_TRUE((*comm)->AllReduceAverage(dev, count).ok());
    ASSERT_EQ(cudaMemcpy(host.data(), dev, count * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (size_t i = 0; i < count; i += 997) {
      const float expected = static_cast<float>((i % 7 + 1) * n * (n + 1) / 2) / n;
      ASSERT_NEAR(host[i], expected, 1e-6f * expected) << "rank " << rank << " i " << i;
    }
    results[rank] = host;
    // Several buffers in one average: rank r holds (r + 1) * (i % 5 + 1) at position i of
    // the 1003 values; the mean, (n + 1) / 2 * (i % 5 + 1), is exact in fp32 for n <= 4.
    std::vector<float> parts(1003);
    for (size_t i = 0; i < parts.size(); ++i) {
      parts[i] = static_cast<float>((rank + 1) * (i % 5 + 1));
    }
    ASSERT_EQ(cudaMemcpy(dev, parts.data(), parts.size() * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    std::vector<std::pair<float*, size_t>> list = {{dev, 1000}, {dev + 1000, 3}};
    ASSERT_TRUE((*comm)->AllReduceAverage(list).ok());
    ASSERT_EQ(cudaMemcpy(parts.data(), dev, parts.size() * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (size_t i = 0; i < parts.size(); ++i) {
      ASSERT_EQ(parts[i], static_cast<float>(n + 1) / 2 * static_cast<float>(i % 5 + 1))
          << "rank " << rank << " multi-buffer average at " << i;
    }
    // Broadcast from the last rank: every rank ends with its values, 1000 * n + i % 997.
    for (size_t i = 0; i < count; ++i) host[i] = static_cast<float>(1000 * (rank + 1) + i % 997);
    ASSERT_EQ(cudaMemcpy(dev, host.data(), count * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_TRUE((*comm)->Broadcast(dev, count, n - 1).ok());
    ASSERT_EQ(cudaMemcpy(host.data(), dev, count * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (size_t i = 0; i < count; i += 991) {
      ASSERT_EQ(host[i], static_cast<float>(1000 * n + i % 997)) << "rank " << rank << " i " << i;
    }
    ASSERT_TRUE((*comm)->Barrier().ok());
    cudaFree(dev);
  });
  for (int r = 1; r < n; ++r) {
    EXPECT_EQ(FirstBitMismatch(results[0].data(), results[r].data(), count), -1) << "rank " << r;
  }
}
#else
TEST(NcclCommunicatorTest, CollectivesMatchExactReference) {
  GTEST_SKIP() << "no CUDA device: this build has no NCCL";
}
#endif

}  // namespace
}  // namespace isthmus::comm
