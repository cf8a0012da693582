// isthmus-worker on a GPU against real isthmus-server shards on loopback (CURVE): a GPU
// rank completes rounds and the shards hold exactly what it pushed; a GPU site and a CPU
// site train one job and commit identical rounds; a device that is not there exits 2 and
// out of memory exits 8, each with a message naming what to change; and --overlap on a GPU
// (docs/SYNC.md, "The overlapped round"), in LoRA and full mode: one site alone commits the
// same state with overlap on and off, bit for bit, and a GPU site beside a CPU site, its
// worker SIGKILLed right after a background pull, loses nothing and doubles nothing.
// Skips without a GPU.
#include <gtest/gtest.h>

#include "common/exit_codes.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/worker/overlap_harness.h"
#include "tests/worker/worker_harness.h"

namespace isthmus {
namespace {

using testing::TwoSites;
using testing::WorkerProcess;
using testing::WorkerWithShards;

class GpuWorker : public WorkerWithShards {
 protected:
  void SetUp() override {
    std::string why;
    if (testing::GpuCount(&why) == 0) GTEST_SKIP() << "no CUDA device: " << why;
    WorkerWithShards::SetUp();
  }
};

TEST_F(GpuWorker, CompletesRoundsAndTheShardsHoldWhatItPushed) {
  for (const char* precision : {"bf16", "fp32"}) {
    SCOPED_TRACE(precision);
    WorkerProcess w;
    w.Start(TrainArgs(0, 1, 3, 3, "", {"--device", "cuda", "--precision", precision}),
            (dir_ / (std::string("w-") + precision + ".log")).string());
    ASSERT_EQ(w.Wait(), 0) << w.Log();
    EXPECT_NE(w.Log().find("device cuda:0 ("), std::string::npos) << w.Log();
    EXPECT_NE(w.Log().find(std::string("precision ") + precision), std::string::npos);
    if (std::string(precision) == "bf16") {
      EXPECT_NE(w.Log().find("done: 3 rounds, 9 steps"), std::string::npos) << w.Log();
      ExpectShardsEqualCheckpoint(0, 3);
      std::filesystem::remove_all(dir_ / "ckpt");  // the fp32 run starts over from the shards
    }
  }
}

TEST_F(GpuWorker, MissingDeviceExits2AndOutOfMemoryExits8) {
  WorkerProcess w;
  w.Start(TrainArgs(0, 1, 1, 1, "", {"--device", "cuda:64"}), (dir_ / "w1.log").string());
  EXPECT_EQ(w.Wait(), 2) << w.Log();
  EXPECT_NE(w.Log().find("--device cuda:64"), std::string::npos) << w.Log();
  WorkerProcess big;
  auto args = TrainArgs(0, 1, 1, 1, "", {"--device", "cuda"});
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--batch-size") args[i + 1] = "50000000";
  }
  big.Start(args, (dir_ / "w2.log").string());
  EXPECT_EQ(big.Wait(), isthmus::kExitOutOfMemory) << big.Log();
  EXPECT_NE(big.Log().find("lower --batch-size"), std::string::npos) << big.Log();
  auto info = shards_[0].AdminClient()->DescribeJob("j");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pushes, 0u);
}

TEST(GpuTwoSites, AGpuSiteAndACpuSiteCommitIdenticalRounds) {
  ISTHMUS_REQUIRE_GPU();
  TwoSites sites("gpu-cpu");
  ASSERT_TRUE(sites.Start());
  auto [rc0, rc1] = sites.Run(3, 2, {"--device", "cuda"}, {"--device", "cpu"});
  ASSERT_EQ(rc0, 0) << sites.worker(0).Log();
  ASSERT_EQ(rc1, 0) << sites.worker(1).Log();
  EXPECT_NE(sites.worker(0).Log().find("device cuda:0"), std::string::npos);
  EXPECT_NE(sites.worker(1).Log().find("device cpu"), std::string::npos);
  sites.ExpectCommittedAlike(3);
}

class GpuOverlap : public testing::Overlap {
 protected:
  void SetUp() override {
    std::string why;
    if (testing::GpuCount(&why) == 0) GTEST_SKIP() << "no CUDA device: " << why;
    Overlap::SetUp();
  }
};

TEST_F(GpuOverlap, OneSiteCommitsTheSameStateWithOverlapOnAndOffBitForBit) {
  CreateJobNamed("on", init_, base_hash_);
  ExpectOnOffAlike(1, init_, "j", "on", {"--device", "cuda"});
}

TEST_F(GpuOverlap, FullModeOneSiteCommitsTheSameStateWithOverlapOnAndOffBitForBit) {
  ExpectFullModeOnOffAlike({"--device", "cuda"});
}

TEST(GpuOverlapTwoSites, SigkillAfterABackgroundPullOnTheGpuSiteLosesNothing) {
  ISTHMUS_REQUIRE_GPU();
  testing::ExpectOverlappedSitesSurviveAKillAfterPull("gpu-overlap", {"--device", "cuda"},
                                                      {"--device", "cpu"});
}

TEST(GpuOverlapTwoSites, FullModeSigkillAfterABackgroundPullOnTheGpuSiteLosesNothing) {
  ISTHMUS_REQUIRE_GPU();
  testing::ExpectOverlappedSitesSurviveAKillAfterPull(
      "gpu-overlap-full", {"--device", "cuda", "--mode", "full"},
      {"--device", "cpu", "--mode", "full"}, {"--mode", "full"});
}

// Multi-process NCCL: two worker processes on two GPUs of one node (--local-rank 0 and 1),
// the gradient all-reduce in buckets during the backward against one all-reduce after it:
// the same weights to rounding (NCCL may pick another algorithm for a bucket than for the
// whole buffer). Needs two GPUs; tests/worker's WorkerRanks test is its Gloo twin.
TEST(GpuRanks, TwoProcessesOnTwoGpusBucketedEqualsOneAllReduce) {
  std::string why;
  const int gpus = testing::GpuCount(&why);
  if (gpus < 2) {
    GTEST_SKIP() << "needs 2 CUDA devices, found " << gpus << (why.empty() ? "" : ": " + why);
  }
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("isthmus-gpu-ranks-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "data");
  testing::WriteTokens(dir / "data" / "train.bin", 5000, 1);
  testing::WriteTokens(dir / "data" / "val.bin", 1000, 2);
  auto with = [](int local_rank, const std::string& mb) {
    return std::vector<std::string>{
        "--device", "cuda", "--local-rank", std::to_string(local_rank), "--bucket-mb", mb};
  };
  auto after = testing::RunTwoStandaloneRanks(dir, "after", with(0, "0"), with(1, "0"));
  ASSERT_EQ(after.rc0, 0) << after.log;
  ASSERT_EQ(after.rc1, 0) << after.log;
  auto during = testing::RunTwoStandaloneRanks(dir, "during", with(0, "1"), with(1, "1"));
  ASSERT_EQ(during.rc0, 0) << during.log;
  ASSERT_EQ(during.rc1, 0) << during.log;
  EXPECT_NE(during.log.find("in buckets of 1 MiB during the backward"), std::string::npos);
  auto one = ReadSafetensorsTensors((dir / "after.safetensors").string());
  auto bucketed = ReadSafetensorsTensors((dir / "during.safetensors").string());
  ASSERT_TRUE(one.ok() && bucketed.ok());
  ASSERT_EQ(one->size(), bucketed->size());
  for (size_t i = 0; i < one->size(); ++i) {
    for (size_t k = 0; k < (*one)[i].data.size(); ++k) {
      ASSERT_NEAR((*one)[i].data[k], (*bucketed)[i].data[k], 1e-5) << (*one)[i].name;
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace isthmus
