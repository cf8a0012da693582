// The isthmus-worker binary against real isthmus-server processes on loopback with CURVE:
// two ranks and two shards complete several rounds and the shards end up holding exactly
// the worker's tensors; a worker killed mid-run resumes and finishes with no round applied
// twice (also when it dies between pushing a round and checkpointing it); the number of
// ranks changes between runs with no round lost or doubled; SIGTERM with the site's shards
// down stops every rank within seconds (exit 7), keeping the unpushed round in the
// checkpoint for the restart to push; a worker whose base differs from the job's is refused
// with exit code 3; --device mistakes are usage errors that say what to do; two sites of
// different precision train one job and commit identical rounds; a third site joins and
// its worker starts from the members' state.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <tuple>

#include "ops/device.h"
#include "tests/worker/worker_harness.h"

namespace isthmus {
namespace {

using testing::kModelFlags;
using testing::RunInit;
using testing::ServerProcess;
using testing::TwoSites;
using testing::WorkerProcess;
using testing::WorkerWithShards;
using testing::WriteTokens;
namespace fs = std::filesystem;

TEST_F(WorkerWithShards, TwoRanksTwoShardsCompleteRoundsAndShardsEqualWorker) {
  std::string rdv = "tcp:127.0.0.1:" + std::to_string(testing::FreePort());
  WorkerProcess r0, r1;
  r0.Start(TrainArgs(0, 2, 3, 3, rdv), (dir_ / "r0.log").string());
  r1.Start(TrainArgs(1, 2, 3, 3, rdv), (dir_ / "r1.log").string());
  int rc0 = r0.Wait(), rc1 = r1.Wait();
  ASSERT_EQ(rc0, 0) << r0.Log();
  ASSERT_EQ(rc1, 0) << r1.Log();
  EXPECT_NE(r0.Log().find("done: 3 rounds, 9 steps"), std::string::npos) << r0.Log();
  ExpectShardsEqualCheckpoint(0, 3);
  // Both ranks hold the same tensors (rank 1 pushed shard 1, rank 0 shard 0).
  auto c0 = ReadSafetensorsTensors((dir_ / "ckpt" / "rank-0.safetensors").string());
  auto c1 = ReadSafetensorsTensors((dir_ / "ckpt" / "rank-1.safetensors").string());
  ASSERT_TRUE(c0.ok() && c1.ok());
  ASSERT_EQ(c0->size(), c1->size());
  for (size_t i = 0; i < c0->size(); ++i) EXPECT_EQ((*c0)[i].data, (*c1)[i].data) << (*c0)[i].name;
}

// Whether process `pid`'s main thread is seen sleeping (state S in /proc) in 20 samples in
// a row, 5 ms apart; gives up after 30 s.
bool MainThreadAsleep(pid_t pid) {
  int in_a_row = 0;
  for (int i = 0; i < 6000; ++i) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    const auto close = line.rfind(')');
    const char state =
        close != std::string::npos && close + 2 < line.size() ? line[close + 2] : '?';
    in_a_row = state == 'S' ? in_a_row + 1 : 0;
    if (in_a_row >= 20) return true;
    ::usleep(5'000);
  }
  return false;
}

// SIGTERM asks a worker to checkpoint and stop. One that lands while the worker waits for a
// shard's reply interrupts that wait (EINTR): the worker must wait on, not abort (it did:
// cppzmq throws on EINTR). Here shard 1 is stopped (SIGSTOP) while the worker trains, so
// the worker is inside a push or pull to it when SIGTERM arrives; then the shard resumes.
TEST_F(WorkerWithShards, SigtermWhileAShardIsSlowToAnswerStopsCleanly) {
  WorkerProcess w;
  w.Start(TrainArgs(0, 1, 100000, 2), (dir_ / "w.log").string());
  ASSERT_TRUE(ShardReachedRound(1, 2)) << w.Log();
  shards_[1].Signal(SIGSTOP);
  // The worker trains on its main thread and waits for the shards there: once that thread
  // has been asleep for 100 ms straight (a step takes milliseconds of CPU), it is in its
  // wait for shard 1.
  ASSERT_TRUE(MainThreadAsleep(w.pid)) << w.Log();
  ::kill(w.pid, SIGTERM);
  ::usleep(300'000);  // not a proof of anything: the signal lands while shard 1 stays stopped
  shards_[1].Signal(SIGCONT);
  const int rc = w.Wait(60);
  EXPECT_EQ(rc, 7) << "exit code 7: interrupted and checkpointed\n" << w.Log();
  EXPECT_NE(w.Log().find("checkpointed"), std::string::npos) << w.Log();
  // No final validation ran: the summary says so instead of printing "nan".
  EXPECT_EQ(w.Log().find("nan"), std::string::npos) << w.Log();
  EXPECT_NE(w.Log().find("val loss not evaluated (interrupted)"), std::string::npos) << w.Log();
}

// SIGTERM while the site's shards are down: every wait on them gives up a few seconds
// after the signal (a request to a hung shard would otherwise take 30 s and two
// reconnecting attempts), the round that could not be pushed is kept in the checkpoint,
// and every rank exits 7. Started again once the shards are back, rank 0 pushes that round
// first, and every shard applies every round exactly once. With one rank and with two
// (systemd signals every rank). The shards are frozen (SIGSTOP) while the ranks run and
// killed only after they exited: a shard killed while a rank reconnects to it fails that
// ZeroMQ handshake, which the shard client reports as a refused key (exit 3).
class WorkerStopsWithShardsDown : public WorkerWithShards,
                                  public ::testing::WithParamInterface<int> {};

TEST_P(WorkerStopsWithShardsDown, SigtermCheckpointsAndExits7Promptly) {
  const int world = GetParam();
  auto args = [&](int rank, int max_rounds, const std::string& rdv) {
    auto a = TrainArgs(rank, world, max_rounds, 2, world > 1 ? rdv : "");
    for (size_t i = 0; i + 1 < a.size(); ++i) {
      if (a[i] == "--request-timeout-ms") a[i + 1] = "30000";  // the default
    }
    return a;
  };
  std::string rdv = "tcp:127.0.0.1:" + std::to_string(testing::FreePort());
  std::vector<WorkerProcess> ranks(world);
  for (int r = 0; r < world; ++r) {
    ranks[r].Start(args(r, 100000, rdv), (dir_ / ("a-r" + std::to_string(r) + ".log")).string());
  }
  ASSERT_TRUE(ShardReachedRound(1, 2)) << ranks[0].Log();
  for (auto& s : shards_) s.Signal(SIGSTOP);
  ::usleep(1'000'000);  // rounds take milliseconds: the ranks now wait for a shard
  const auto t0 = std::chrono::steady_clock::now();
  for (auto& w : ranks) ::kill(w.pid, SIGTERM);
  for (auto& w : ranks) {
    const int rc = w.Wait(120);
    ASSERT_EQ(rc, 7) << "exit code 7: interrupted and checkpointed\n" << w.Log();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(took, 30.0) << "the worker went on waiting for the dead shards\n" << ranks[0].Log();
  std::printf("%d rank(s) stopped %.1f s after SIGTERM with the shards down\n", world, took);
  std::fflush(stdout);  // before the forks below
  EXPECT_NE(ranks[0].Log().find("checkpointed"), std::string::npos) << ranks[0].Log();
  EXPECT_EQ(ranks[0].Log().find("nan"), std::string::npos) << ranks[0].Log();
  auto ckpt = ReadSafetensors((dir_ / "ckpt" / "rank-0.safetensors").string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  const int64_t rounds = std::stoll(ckpt->metadata["round"]);
  ASSERT_GE(rounds, 2);
  for (int r = 1; r < world; ++r) {
    auto c =
        ReadSafetensors((dir_ / "ckpt" / ("rank-" + std::to_string(r) + ".safetensors")).string());
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->metadata["round"], ckpt->metadata["round"]) << "the ranks stopped apart";
  }

  for (auto& s : shards_) s.Kill(SIGKILL);
  for (auto& s : shards_) ASSERT_TRUE(s.Start());
  std::string rdv2 = "tcp:127.0.0.1:" + std::to_string(testing::FreePort());
  std::vector<WorkerProcess> again(world);
  for (int r = 0; r < world; ++r) {
    again[r].Start(args(r, static_cast<int>(rounds + 1), rdv2),
                   (dir_ / ("b-r" + std::to_string(r) + ".log")).string());
  }
  for (auto& w : again) ASSERT_EQ(w.Wait(120), 0) << w.Log();
  EXPECT_NE(again[0].Log().find("done: " + std::to_string(rounds + 1) + " rounds"),
            std::string::npos)
      << again[0].Log();
  ExpectShardsEqualCheckpoint(0, static_cast<uint64_t>(rounds + 1));
}

INSTANTIATE_TEST_SUITE_P(Ranks, WorkerStopsWithShardsDown, ::testing::Values(1, 2));

// Without a stop, shards that stay down end the run once the requests ran out (exit 5);
// a round that could not be pushed is kept in the checkpoint as after a stop, and the
// restart loses and doubles no round. (Frozen shards, killed after the worker exited: see
// above.)
TEST_F(WorkerWithShards, ShardsDownEndTheRunWithExit5AndTheRestartLosesNoRound) {
  WorkerProcess w;  // a request of 5 s (TrainArgs) and two reconnecting attempts
  w.Start(TrainArgs(0, 1, 100000, 2), (dir_ / "w1.log").string());
  ASSERT_TRUE(ShardReachedRound(1, 2)) << w.Log();
  for (auto& s : shards_) s.Signal(SIGSTOP);
  ASSERT_EQ(w.Wait(120), 5) << w.Log();
  for (auto& s : shards_) s.Kill(SIGKILL);
  auto ckpt = ReadSafetensors((dir_ / "ckpt" / "rank-0.safetensors").string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  const int64_t rounds = std::stoll(ckpt->metadata["round"]);
  for (auto& s : shards_) ASSERT_TRUE(s.Start());
  WorkerProcess again;
  again.Start(TrainArgs(0, 1, static_cast<int>(rounds + 2), 2), (dir_ / "w2.log").string());
  ASSERT_EQ(again.Wait(120), 0) << again.Log();
  ExpectShardsEqualCheckpoint(0, static_cast<uint64_t>(rounds + 2));
}

TEST_F(WorkerWithShards, KilledWorkerResumesWithoutApplyingARoundTwice) {
  WorkerProcess w;
  w.Start(TrainArgs(0, 1, 6, 2), (dir_ / "w1.log").string());
  // Kill once the shards have seen round 2.
  ASSERT_TRUE(ShardReachedRound(1, 2)) << w.Log();
  w.Kill();
  WorkerProcess again;
  again.Start(TrainArgs(0, 1, 6, 2), (dir_ / "w2.log").string());
  ASSERT_EQ(again.Wait(), 0) << again.Log();
  EXPECT_NE(again.Log().find("done: 6 rounds"), std::string::npos) << again.Log();
  ExpectShardsEqualCheckpoint(0, 6);
}

// The serial round (--no-overlap): the checkpoint follows the push. (With --overlap it
// precedes it: worker_overlap_test.cc.)
TEST_F(WorkerWithShards, CrashBetweenPushAndCheckpointIsRedoneAsDuplicate) {
  WorkerProcess w;
  w.Start(TrainArgs(0, 1, 4, 2, "", {"--no-overlap"}), (dir_ / "w1.log").string(), "2");
  ASSERT_EQ(w.Wait(), 137) << w.Log();
  auto ckpt = ReadSafetensors((dir_ / "ckpt" / "rank-0.safetensors").string());
  ASSERT_TRUE(ckpt.ok());
  EXPECT_EQ(ckpt->metadata["round"], "1");  // round 2 was pushed but not checkpointed
  WorkerProcess again;
  again.Start(TrainArgs(0, 1, 4, 2, "", {"--no-overlap"}), (dir_ / "w2.log").string());
  ASSERT_EQ(again.Wait(), 0) << again.Log();
  EXPECT_NE(again.Log().find("redoing it from the checkpoint"), std::string::npos) << again.Log();
  EXPECT_NE(again.Log().find("nothing applied twice"), std::string::npos) << again.Log();
  ExpectShardsEqualCheckpoint(0, 4);
}

// Ranks come and go between rounds: 2 ranks for rounds 1-2, one (a rank lost) for 3-4,
// three (a node added: rank 1's checkpoint is from round 2, rank 2 has none) for 5-6.
// Rank 0 decides where training continues; no round is lost or applied twice. `extra`:
// more flags for every rank.
class WorkerRankCounts : public WorkerWithShards {
 protected:
  void ExpectRankCountChangesLoseNothing(const std::vector<std::string>& extra);
};

void WorkerRankCounts::ExpectRankCountChangesLoseNothing(const std::vector<std::string>& extra) {
  auto run = [&](int world, int max_rounds, const std::string& tag) {
    std::string rdv = "tcp:127.0.0.1:" + std::to_string(testing::FreePort());
    std::vector<WorkerProcess> ranks(world);
    for (int r = 0; r < world; ++r) {
      ranks[r].Start(TrainArgs(r, world, max_rounds, 2, world > 1 ? rdv : "", extra),
                     (dir_ / (tag + "-r" + std::to_string(r) + ".log")).string());
    }
    for (int r = 0; r < world; ++r) ASSERT_EQ(ranks[r].Wait(), 0) << ranks[r].Log();
    EXPECT_NE(ranks[0].Log().find("done: " + std::to_string(max_rounds) + " rounds"),
              std::string::npos)
        << ranks[0].Log();
    if (world > 1 && !extra.empty()) {
      EXPECT_NE(ranks[0].Log().find("AdamW moments sharded across " + std::to_string(world)),
                std::string::npos)
          << ranks[0].Log();
    }
  };
  run(2, 2, "two");
  ExpectShardsEqualCheckpoint(0, 2);
  run(1, 4, "one");
  ExpectShardsEqualCheckpoint(0, 4);
  run(3, 6, "three");
  ExpectShardsEqualCheckpoint(0, 6);
  auto c0 = ReadSafetensorsTensors((dir_ / "ckpt" / "rank-0.safetensors").string());
  ASSERT_TRUE(c0.ok());
  for (int r : {1, 2}) {
    auto c = ReadSafetensorsTensors(
        (dir_ / "ckpt" / ("rank-" + std::to_string(r) + ".safetensors")).string());
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_EQ(c->size(), c0->size());
    for (size_t i = 0; i < c0->size(); ++i) EXPECT_EQ((*c)[i].data, (*c0)[i].data) << r;
  }
}

TEST_F(WorkerRankCounts, ChangeBetweenRoundsWithNoRoundLostOrDoubled) {
  ExpectRankCountChangesLoseNothing({});
}

// The same with the AdamW moments split across the ranks (--shard-optimizer, ZeRO-1): the
// checkpoints hold the whole moments, so 2, 1 and 3 ranks carry them on, the rank with an
// older checkpoint and the rank with none taking their parts from rank 0's.
TEST_F(WorkerRankCounts, ChangeWithTheOptimizerStateShardedAndItCarriesOver) {
  ExpectRankCountChangesLoseNothing({"--shard-optimizer"});
}

// A rank lost in the middle of a round leaves the round on some shards only. Redoing it
// with another rank count would push a different delta to the rest, so that is refused
// (exit 3, saying what to do); the old rank count finishes the round, then the new one
// carries on, and every shard applied every round once.
TEST_F(WorkerWithShards, ARoundSplitByALostRankIsFinishedBeforeTheRankCountChanges) {
  std::string rdv = "tcp:127.0.0.1:" + std::to_string(testing::FreePort());
  WorkerProcess r0, r1;
  r0.Start(TrainArgs(0, 2, 4, 2, rdv, {"--no-overlap"}), (dir_ / "a-r0.log").string());
  r1.Start(TrainArgs(1, 2, 4, 2, rdv, {"--no-overlap"}), (dir_ / "a-r1.log").string(), "3",
           "ISTHMUS_WORKER_FAULT_CRASH_BEFORE_PUSH");
  ASSERT_EQ(r1.Wait(), 137) << r1.Log();
  // Rank 0 pushed round 3 to its shard, then waits for rank 1 forever: the operator
  // stops it.
  bool pushed = false;
  for (int i = 0; i < 600 && !pushed; ++i) {
    auto h = shards_[0].WorkerClient()->Hello("j", wire::Role::Worker, base_hash_, "probe");
    pushed = h.ok() && h->rounds.local_round == 3;
    if (!pushed) ::usleep(50'000);
  }
  ASSERT_TRUE(pushed) << r0.Log();
  r0.Kill();
  auto h1 = shards_[1].WorkerClient()->Hello("j", wire::Role::Worker, base_hash_, "probe");
  ASSERT_TRUE(h1.ok());
  EXPECT_EQ(h1->rounds.local_round, 2u);

  WorkerProcess alone;
  alone.Start(TrainArgs(0, 1, 4, 2, "", {"--no-overlap"}), (dir_ / "b.log").string());
  EXPECT_EQ(alone.Wait(), 3) << alone.Log();
  EXPECT_NE(alone.Log().find("restart with --world-size 2"), std::string::npos) << alone.Log();

  std::string rdv2 = "tcp:127.0.0.1:" + std::to_string(testing::FreePort());
  WorkerProcess f0, f1;
  f0.Start(TrainArgs(0, 2, 3, 2, rdv2, {"--no-overlap"}), (dir_ / "c-r0.log").string());
  f1.Start(TrainArgs(1, 2, 3, 2, rdv2, {"--no-overlap"}), (dir_ / "c-r1.log").string());
  ASSERT_EQ(f0.Wait(), 0) << f0.Log();
  ASSERT_EQ(f1.Wait(), 0) << f1.Log();
  ExpectShardsEqualCheckpoint(0, 3);

  WorkerProcess last;
  last.Start(TrainArgs(0, 1, 4, 2, "", {"--no-overlap"}), (dir_ / "d.log").string());
  ASSERT_EQ(last.Wait(), 0) << last.Log();
  ExpectShardsEqualCheckpoint(0, 4);
}

TEST_F(WorkerWithShards, BaseHashMismatchIsRefusedWithExitCode3) {
  std::string other = RunInit(dir_, 99, "other");
  ASSERT_NE(other, base_hash_);
  auto args = TrainArgs(0, 1, 2, 2);
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--base") args[i + 1] = (dir_ / "other.safetensors").string();
  }
  WorkerProcess w;
  w.Start(args, (dir_ / "w.log").string());
  EXPECT_EQ(w.Wait(), 3) << w.Log();
  EXPECT_NE(w.Log().find("another base model"), std::string::npos) << w.Log();
  auto info = shards_[0].AdminClient()->DescribeJob("j");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->pushes, 0u);
}

// Bounded staleness: a synced shard whose only peer site never answers can commit
// nothing, so a worker may run K = sync.max_rounds_ahead rounds ahead and must then wait
// (and say so) instead of pushing more. K = 0: synchronous rounds, a wait after each.
class WorkerWanWait : public ::testing::TestWithParam<int> {};

TEST_P(WorkerWanWait, WaitsPastKRoundsAheadAndSaysSo) {
  const int k = GetParam();
  fs::path dir = fs::temp_directory_path() /
                 ("isthmus-wan-" + std::to_string(::getpid()) + "-" + std::to_string(k));
  fs::remove_all(dir);
  fs::create_directories(dir / "data");
  WriteTokens(dir / "data" / "train.bin", 20000, 1);
  WriteTokens(dir / "data" / "val.bin", 2000, 2);
  ServerProcess shard;
  ASSERT_TRUE(StartSiteWithSilentPeer(shard, dir, k));
  const std::string base_hash = CreateJobFromInit(shard, dir);
  const auto args = SingleShardTrainArgs(
      shard, dir, {"--max-rounds", "5", "--steps-per-round", "2", "--no-overlap"});
  WorkerProcess w;
  w.Start(args, (dir / "w.log").string());
  bool waiting = false;
  for (int i = 0; i < 1200 && !waiting; ++i) {
    waiting = w.Log().find("waiting for the WAN") != std::string::npos;
    int st = 0;
    if (!waiting && ::waitpid(w.pid, &st, WNOHANG) == w.pid) {
      w.pid = -1;
      break;  // exited: fails below with the log
    }
    if (!waiting) ::usleep(50'000);
  }
  ASSERT_TRUE(waiting) << w.Log();
  // It keeps waiting: it polls the shard (a Hello every 50 ms) and pushes no further
  // round. Wait until the shard answered ten requests besides this test's own.
  {
    auto admin = shard.AdminClient();
    auto first = admin->Stats();
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    uint64_t calls = 1, others = 0;
    for (int i = 0; i < 400 && others < 10; ++i) {
      ::usleep(20'000);
      auto st = admin->Stats();
      ASSERT_TRUE(st.ok()) << st.status().ToString();
      ++calls;
      others = st->requests - first->requests - (calls - 1);
    }
    ASSERT_GE(others, 10u) << "the waiting worker stopped asking the shard";
  }
  auto hello = shard.WorkerClient()->Hello("j", wire::Role::Worker, base_hash, "probe");
  ASSERT_TRUE(hello.ok()) << hello.status().ToString();
  EXPECT_EQ(hello->rounds.committed_round, 0u);
  // K + 1 rounds closed, then the worker waits.
  EXPECT_EQ(hello->rounds.local_round, static_cast<uint64_t>(k + 1));
  EXPECT_EQ(hello->rounds.max_rounds_ahead, static_cast<uint64_t>(k));
  int status = 0;
  EXPECT_EQ(::waitpid(w.pid, &status, WNOHANG), 0) << "the worker should still be waiting";
  EXPECT_NE(w.Log().find("limit " + std::to_string(k) + ")"), std::string::npos) << w.Log();
  w.Kill();
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(K, WorkerWanWait, ::testing::Values(0, 1));

// --device and --precision mistakes are usage errors (exit code 2) whose message says what
// to do; on a machine without a GPU, asking for one is such a mistake.
TEST(WorkerDevice, DeviceMistakesExitWithTheUsageCodeAndSayWhatToDo) {
  const fs::path dir = testing::StandaloneDir("dev");
  auto run = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> a = {"train"};
    a.insert(a.end(), kModelFlags.begin(), kModelFlags.end());
    for (const char* f : {"--standalone", "--max-steps", "2", "--batch-size", "2", "--val-batches",
                          "1", "--log-every", "1"}) {
      a.push_back(f);
    }
    a.push_back("--data");
    a.push_back((dir / "data").string());
    a.insert(a.end(), extra.begin(), extra.end());
    WorkerProcess w;
    w.Start(a, (dir / "w.log").string());
    const int rc = w.Wait();
    return std::make_pair(rc, w.Log());
  };
  auto [rc, log] = run({"--device", "tpu"});
  EXPECT_EQ(rc, 2) << log;
  EXPECT_NE(log.find("not one of auto, cpu, cuda, cuda:N"), std::string::npos) << log;
  std::tie(rc, log) = run({"--precision", "fp16"});
  EXPECT_EQ(rc, 2) << log;
  if (ops::CudaDeviceCount() == 0) {
    std::tie(rc, log) = run({"--device", "cuda"});
    EXPECT_EQ(rc, 2) << log;
    EXPECT_NE(log.find("no CUDA device is usable"), std::string::npos) << log;
    EXPECT_NE(log.find("use --device cpu"), std::string::npos) << log;
    std::tie(rc, log) = run({"--device", "cuda:3"});
    EXPECT_EQ(rc, 2) << log;
    // auto falls back to the CPU and says so.
    std::tie(rc, log) = run({});
    EXPECT_EQ(rc, 0) << log;
    EXPECT_NE(log.find("device cpu ("), std::string::npos) << log;
  }
  // bf16 on the CPU is the emulated reference: slow, but it trains.
  std::tie(rc, log) = run({"--device", "cpu", "--precision", "bf16"});
  EXPECT_EQ(rc, 0) << log;
  EXPECT_NE(log.find("precision bf16"), std::string::npos) << log;
  EXPECT_NE(log.find("done: 1 rounds, 2 steps"), std::string::npos) << log;
  fs::remove_all(dir);
}

// Two rank processes over Gloo: with the all-reduce in buckets during the backward (the
// default --bucket-mb) they train to the same weights, bit for bit, as with one
// all-reduce after it (--bucket-mb 0); ranks launched with different values stop before
// any collective, naming both values; the all-reduce in bf16 runs too. The CPU twin of a
// multi-process NCCL run.
TEST(WorkerRanks, BucketedAllReduceInProcessesEqualsOneAllReduceAndMismatchesAreRefused) {
  const fs::path dir = testing::StandaloneDir("buckets");
  const std::vector<std::string> cpu = {"--device", "cpu"};
  auto with = [&](const std::string& mb) {
    std::vector<std::string> a = cpu;
    a.push_back("--bucket-mb");
    a.push_back(mb);
    return a;
  };
  auto after = testing::RunTwoStandaloneRanks(dir, "after", with("0"), with("0"));
  ASSERT_EQ(after.rc0, 0) << after.log;
  ASSERT_EQ(after.rc1, 0) << after.log;
  EXPECT_NE(after.log.find("one all-reduce after the backward"), std::string::npos) << after.log;
  auto during = testing::RunTwoStandaloneRanks(dir, "during", with("1"), with("1"));
  ASSERT_EQ(during.rc0, 0) << during.log;
  ASSERT_EQ(during.rc1, 0) << during.log;
  EXPECT_NE(during.log.find("in buckets of 1 MiB during the backward"), std::string::npos)
      << during.log;
  auto one = ReadSafetensorsTensors((dir / "after.safetensors").string());
  auto bucketed = ReadSafetensorsTensors((dir / "during.safetensors").string());
  ASSERT_TRUE(one.ok() && bucketed.ok());
  ASSERT_EQ(one->size(), bucketed->size());
  for (size_t i = 0; i < one->size(); ++i) {
    EXPECT_EQ((*one)[i].data, (*bucketed)[i].data) << (*one)[i].name;
  }
  auto mixed = testing::RunTwoStandaloneRanks(dir, "mixed", with("25"), with("5"));
  EXPECT_EQ(mixed.rc0, 2) << mixed.log;
  EXPECT_EQ(mixed.rc1, 2) << mixed.log;
  EXPECT_NE(mixed.log.find("rank 1 was launched with --bucket-mb 5 --reduce-precision fp32 "
                           "but rank 0 with --bucket-mb 25 --reduce-precision fp32"),
            std::string::npos)
      << mixed.log;
  // The all-reduce in bf16 runs end to end in processes too.
  std::vector<std::string> bf16 = with("1");
  bf16.push_back("--reduce-precision");
  bf16.push_back("bf16");
  auto half = testing::RunTwoStandaloneRanks(dir, "bf16", bf16, bf16);
  ASSERT_EQ(half.rc0, 0) << half.log;
  ASSERT_EQ(half.rc1, 0) << half.log;
  EXPECT_NE(half.log.find("gradient all-reduce (bf16) in buckets of 1 MiB"), std::string::npos)
      << half.log;
  // The AdamW moments split across the ranks (ZeRO-1): the same weights, bit for bit.
  std::vector<std::string> sharded = with("1");
  sharded.push_back("--shard-optimizer");
  auto zero = testing::RunTwoStandaloneRanks(dir, "zero1", sharded, sharded);
  ASSERT_EQ(zero.rc0, 0) << zero.log;
  ASSERT_EQ(zero.rc1, 0) << zero.log;
  EXPECT_NE(zero.log.find("AdamW moments sharded across 2 ranks"), std::string::npos) << zero.log;
  auto split = ReadSafetensorsTensors((dir / "zero1.safetensors").string());
  ASSERT_TRUE(split.ok());
  ASSERT_EQ(split->size(), one->size());
  for (size_t i = 0; i < one->size(); ++i) {
    EXPECT_EQ((*one)[i].data, (*split)[i].data) << (*one)[i].name;
  }
  auto half_split = testing::RunTwoStandaloneRanks(dir, "zero1-mixed", sharded, with("1"));
  EXPECT_EQ(half_split.rc0, 2) << half_split.log;
  EXPECT_EQ(half_split.rc1, 2) << half_split.log;
  EXPECT_NE(half_split.log.find("--reduce-precision fp32 --shard-optimizer"), std::string::npos)
      << half_split.log;
  fs::remove_all(dir);
}

// A standalone site of `world` rank processes training to `max_steps`, resuming from and
// checkpointing to `ckpt`, the weights saved to `save`; every rank's log on failure.
void RunStandaloneSite(const fs::path& dir, const std::string& tag, int world, int max_steps,
                       const fs::path& ckpt, const fs::path& save,
                       const std::vector<std::string>& extra) {
  const std::string rdv = "tcp:127.0.0.1:" + std::to_string(testing::FreePort());
  std::vector<std::string> more = {"--device", "cpu", "--checkpoint-dir", ckpt.string()};
  more.insert(more.end(), extra.begin(), extra.end());
  std::vector<WorkerProcess> ranks(world);
  for (int r = 0; r < world; ++r) {
    ranks[r].Start(testing::StandaloneRankArgs(dir, r, world, rdv, max_steps, save, more),
                   (dir / (tag + "-" + std::to_string(r) + ".log")).string());
  }
  for (int r = 0; r < world; ++r) ASSERT_EQ(ranks[r].Wait(), 0) << ranks[r].Log();
}

// Sharded moments (--shard-optimizer) are checkpointed whole, and a site that resumes on
// another rank count (here 2 ranks, then 3: rank 2 has no checkpoint and takes its part
// of the moments from rank 0's) trains on bit for bit as the unsharded site does. The
// sharded site also writes its checkpoints with --checkpoint-direct: the same files.
TEST(WorkerRanks, ShardedMomentsResumeOnMoreRanksBitForBitLikeWholeOnes) {
  const fs::path dir = testing::StandaloneDir("zero1");
  std::map<std::string, std::vector<Tensor>> ckpt, saved;
  for (const std::string tag : {"whole", "sharded"}) {
    const std::vector<std::string> extra =
        tag == "sharded" ? std::vector<std::string>{"--shard-optimizer", "--checkpoint-direct"}
                         : std::vector<std::string>{};
    const fs::path c = dir / ("ckpt-" + tag), save = dir / (tag + ".safetensors");
    ASSERT_NO_FATAL_FAILURE(RunStandaloneSite(dir, tag + "-two", 2, 3, c, save, extra));
    ASSERT_NO_FATAL_FAILURE(RunStandaloneSite(dir, tag + "-three", 3, 6, c, save, extra));
    auto file = ReadSafetensors((c / "rank-0.safetensors").string());
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    EXPECT_EQ(file->metadata["step"], "6");
    ckpt[tag] = file->tensors;
    auto weights = ReadSafetensorsTensors(save.string());
    ASSERT_TRUE(weights.ok());
    saved[tag] = *weights;
  }
  std::ifstream log(dir / "sharded-three-0.log");
  std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("AdamW moments sharded across 3 ranks"), std::string::npos) << text;
  for (auto* m : {&ckpt, &saved}) {
    const auto& whole = (*m)["whole"];
    const auto& sharded = (*m)["sharded"];
    ASSERT_EQ(whole.size(), sharded.size());
    size_t moments = 0;
    for (size_t i = 0; i < whole.size(); ++i) {
      EXPECT_EQ(whole[i].name, sharded[i].name);
      EXPECT_EQ(whole[i].data, sharded[i].data) << whole[i].name;
      moments += whole[i].name.rfind("opt.m.", 0) == 0;
    }
    if (m == &ckpt) {
      EXPECT_GT(moments, 0u);
    }
  }
  fs::remove_all(dir);
}

// Sites may differ (here in precision; tests/gpu pairs a GPU site with a CPU site): the
// shards see the same named fp32 tensors, so both sites commit every round identically.
TEST(WorkerTwoSites, Fp32SiteAndBf16SiteCommitIdenticalRounds) {
  TwoSites sites("precision");
  ASSERT_TRUE(sites.Start());
  auto [rc0, rc1] = sites.Run(3, 2, {"--device", "cpu", "--precision", "fp32"},
                              {"--device", "cpu", "--precision", "bf16"});
  ASSERT_EQ(rc0, 0) << sites.worker(0).Log();
  ASSERT_EQ(rc1, 0) << sites.worker(1).Log();
  EXPECT_NE(sites.worker(1).Log().find("precision bf16"), std::string::npos);
  sites.ExpectCommittedAlike(3);
}

// A site that joins a running job (docs/SYNC.md, "Joining"): its worker starts from the
// members' committed state, and its rounds commit on every site with identical digests.
TEST(WorkerTwoSites, ThirdSiteJoinsAndItsWorkerStartsFromTheMembersState) {
  TwoSites sites("join");
  ASSERT_TRUE(sites.Start());
  auto rc = sites.RunOn({0, 1}, 2, 2);
  ASSERT_EQ(rc[0], 0) << sites.worker(0).Log();
  ASSERT_EQ(rc[1], 0) << sites.worker(1).Log();
  sites.ExpectCommittedAlike(2);
  ASSERT_TRUE(sites.Join("gamma"));
  // alpha and beta resume from their checkpoints at round 2; gamma has none and takes the
  // shards' round 2. Each trains round 3.
  rc = sites.RunOn({0, 1, 2}, 3, 2);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(rc[i], 0) << sites.worker(i).Log();
  EXPECT_NE(sites.worker(2).Log().find("starting at round 2, step 4 from the shards' tensors"),
            std::string::npos)
      << sites.worker(2).Log();
  sites.ExpectCommittedAlike(3);
  auto gamma = sites.Digests(2);
  ASSERT_EQ(gamma.size(), 2u);  // rounds 2 (taken at the join) and 3
  EXPECT_EQ(gamma[0].first, 2u);
  EXPECT_EQ(gamma[1].first, 3u);
}

}  // namespace
}  // namespace isthmus
