// isthmus-worker --overlap (docs/SYNC.md, "The overlapped round") against real
// isthmus-server processes on loopback with CURVE:
//  - overlap on and off commit bit-identical state where they must: one site (a synced site
//    without peers: rounds commit exactly), one, two and three ranks (three on two shards:
//    a rank that pushes no shard still decides the K = 0 wait as the others do), and in
//    full mode;
//  - a worker SIGKILLed while its background push hangs on a frozen shard, and one that
//    dies in the background right after pulling, restart and lose nothing and double
//    nothing: every round applied once per shard, the committed state equal to the start
//    plus every recorded delta (element by element), two sites' digests equal;
//  - the staleness bound counts the round in flight: with K the worker trains round
//    max(K, 1) + 1 at most while nothing commits, having pushed max(K, 1) rounds;
//  - shards SIGKILLed while the worker's rounds run in the background (one of two, or
//    both): the worker stops with exit 5, and after the restarts nothing is lost or doubled;
//  - a background push refused by a shard stops the worker with exit 3, saying so in its
//    log and its events (and isthmusctl top on the shard's side), with the round kept in
//    the checkpoint.
// Deadlines are generous (scaled by testing::TimeScale() under sanitizers) and every wait
// is a bounded poll of real state.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "tests/command.h"
#include "tests/fault/fault_env.h"
#include "tests/worker/overlap_harness.h"
#include "tests/worker/worker_harness.h"

namespace isthmus {
namespace {

using testing::ExpectStartPlusEveryDeltaOnce;
using testing::Overlap;
using testing::ServerProcess;
using testing::TwoSites;
using testing::WorkerProcess;
using testing::WorkerWithShards;
namespace fs = std::filesystem;

// Where they must, overlap on and off give the same committed state: a site alone commits
// each round exactly (the shards hold base + delta, which the worker's normalised live
// weights equal bit for bit), so the pulled state never differs from the base and merging
// it at a later step changes nothing. The trajectories, every committed round's digest and
// the final tensors are then identical.
class OverlapOnOff : public Overlap, public ::testing::WithParamInterface<int> {};

TEST_P(OverlapOnOff, OneSiteCommitsTheSameStateBitForBit) {
  CreateJobNamed("on", init_, base_hash_);
  ExpectOnOffAlike(GetParam(), init_, "j", "on", {});
}

// The same in full mode (every tensor trains; the pre-training phase), one rank.
TEST_F(Overlap, FullModeOneSiteCommitsTheSameStateBitForBit) { ExpectFullModeOnOffAlike({}); }

INSTANTIATE_TEST_SUITE_P(Ranks, OverlapOnOff, ::testing::Values(1, 2, 3));

// --merge-after-steps with --merge-wait: every rank merges each round in flight after
// exactly that many steps of the next round (waiting for it there if need be), whenever the
// pull arrived, and the committed state is still the serial run's.
TEST_F(Overlap, MergeAfterStepsMergesEveryRoundAtThatStep) {
  CreateJobNamed("merge", init_, base_hash_);
  ExpectOnOffAlike(2, init_, "j", "merge", {"--merge-after-steps", "2", "--merge-wait"});
  std::ifstream in(dir_ / "merge-r0.log");
  const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (int r = 1; r <= 3; ++r) {
    const std::string line = "round " + std::to_string(r) + ": the pulled state merged after 2 " +
                             "steps of round " + std::to_string(r + 1);
    EXPECT_NE(log.find(line), std::string::npos) << line << "\n" << log;
  }
  EXPECT_EQ(log.find("merged after 1 steps"), std::string::npos) << log;
}

// --merge-after-steps without --merge-wait (the default policy, with its step given): no
// round is merged before that step, each is merged (at it or after, as it arrives), and the
// committed state is still the serial run's.
TEST_F(Overlap, MergeAfterStepsWithoutWaitMergesNoEarlier) {
  CreateJobNamed("after", init_, base_hash_);
  ExpectOnOffAlike(2, init_, "j", "after", {"--merge-after-steps", "2"});
  std::ifstream in(dir_ / "after-r0.log");
  const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (int r = 1; r <= 3; ++r) {
    const std::string prefix = "round " + std::to_string(r) + ": the pulled state merged after ";
    const size_t at = log.find(prefix);
    ASSERT_NE(at, std::string::npos) << prefix << "\n" << log;
    const int steps = std::atoi(log.c_str() + at + prefix.size());
    EXPECT_GE(steps, 2) << "round " << r << " merged before its step\n" << log;
  }
}

// SIGKILL of a site's workers during a background push that reached only some shards: of
// two ranks, rank 0 pushed round 3 to shard 0 and rank 1's push to shard 1 hangs (a fault
// hook makes its background push wait for ever). Both are SIGKILLed there. Every rank's
// checkpoint holds round 3 with its delta (written before the push); the restart pushes it
// again with the same keys (shard 0 answers duplicate, shard 1 applies it) and goes on.
// Every shard applied every round once, and the committed tensors are the start plus each
// recorded delta once. Restarted with one rank and with two; and with
// --checkpoint-state-every 3, where round 3 is kept in a round checkpoint beside the full
// one of round 1, and the restart takes the trainable tensors from the shards.
class OverlapKill : public Overlap, public ::testing::WithParamInterface<std::tuple<int, int>> {};

TEST_P(OverlapKill, SigkillDuringABackgroundPushLosesNothingAndDoublesNothing) {
  const auto [restart_world, state_every] = GetParam();
  const std::vector<std::string> flags = {"--overlap", "--checkpoint-state-every",
                                          std::to_string(state_every)};
  const fs::path deltas = dir_ / "deltas";
  fs::create_directories(deltas);
  std::string rdv = "tcp:127.0.0.1:" + std::to_string(testing::FreePort());
  WorkerProcess r0, r1;
  r0.env = {{"ISTHMUS_WORKER_RECORD_DELTAS", deltas.string()}};
  r1.env = {{"ISTHMUS_WORKER_FAULT_HANG_BEFORE_PUSH", "3"}};
  r0.Start(TrainArgs(0, 2, 100000, 2, rdv, flags), (dir_ / "a-r0.log").string());
  r1.Start(TrainArgs(1, 2, 100000, 2, rdv, flags), (dir_ / "a-r1.log").string());
  auto round_of = [&](int s) -> uint64_t {
    auto h = shards_[s].WorkerClient()->Hello("j", wire::Role::Worker, base_hash_, "probe");
    EXPECT_TRUE(h.ok()) << h.status().ToString();
    return h.ok() ? h->rounds.local_round : 0;
  };
  bool split = false;
  for (int i = 0; i < 1200 * testing::TimeScale() && !split; ++i) {
    split = round_of(0) == 3 && r1.Log().find("push of round 3 hangs") != std::string::npos;
    if (!split) ::usleep(50'000);
  }
  ASSERT_TRUE(split) << r0.Log() << r1.Log();
  r0.Kill();
  r1.Kill();
  EXPECT_EQ(round_of(0), 3u);
  EXPECT_EQ(round_of(1), 2u);
  for (int r = 0; r < 2; ++r) {
    const std::string rank = "rank-" + std::to_string(r);
    auto c = ReadSafetensors((dir_ / "ckpt" / (rank + ".safetensors")).string());
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    if (state_every == 3) {
      EXPECT_EQ(c->metadata["round"], "1") << "rank " << r;
      c = ReadSafetensors((dir_ / "ckpt" / (rank + ".round.safetensors")).string());
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      for (const auto& t : c->tensors) {
        EXPECT_EQ(t.name.rfind("unpushed.", 0), 0u) << t.name << " in a round checkpoint";
      }
    }
    EXPECT_EQ(c->metadata["round"], "3") << "rank " << r;
    EXPECT_EQ(c->metadata.count("unpushed_tokens"), 1u) << "rank " << r;
  }
  constexpr int kTotal = 6;
  std::string rdv2 = "tcp:127.0.0.1:" + std::to_string(testing::FreePort());
  std::vector<WorkerProcess> again(restart_world);
  for (int r = 0; r < restart_world; ++r) {
    again[r].env = {{"ISTHMUS_WORKER_RECORD_DELTAS", deltas.string()}};
    again[r].Start(TrainArgs(r, restart_world, kTotal, 2, restart_world > 1 ? rdv2 : "", flags),
                   (dir_ / ("b-r" + std::to_string(r) + ".log")).string());
  }
  for (auto& w : again) ASSERT_EQ(w.Wait(240 * testing::TimeScale()), 0) << w.Log();
  EXPECT_NE(again[0].Log().find("pushing it from the checkpoint"), std::string::npos)
      << again[0].Log();
  EXPECT_NE(again[0].Log().find("shard 0 already had round 3"), std::string::npos)
      << again[0].Log();
  if (state_every == 3) {
    EXPECT_NE(again[0].Log().find("holds round 3; the trainable tensors come from the shards"),
              std::string::npos)
        << again[0].Log();
    // The last full checkpoint (round 6) made the round checkpoint stale: it is gone.
    EXPECT_FALSE(fs::exists(dir_ / "ckpt" / "rank-0.round.safetensors"));
  }
  ExpectShardsEqualCheckpoint(0, kTotal);
  ExpectStartPlusEveryDeltaOnce(init_, ShardTensors(), deltas, kTotal);
}

INSTANTIATE_TEST_SUITE_P(RestartRanks, OverlapKill,
                         ::testing::Values(std::tuple{1, 1}, std::tuple{2, 1}, std::tuple{2, 3}));

// SIGKILL of the site's shards while a worker overlaps its rounds (2 inner steps a round:
// a background push or pull is nearly always in flight): shard 1 alone, or both. Shard 1
// may die with a round acknowledged to the worker but its close and commit still to run
// (they run after the reply), or holding half a push. The worker's background round fails
// (the shards do not answer: exit 5) with the round kept in its checkpoint; the shards
// restart from their stores and the worker from its checkpoint. Every shard applied every
// round once, and the committed tensors are the start plus each recorded delta once.
class OverlapShardKill : public Overlap, public ::testing::WithParamInterface<int> {};

TEST_P(OverlapShardKill, SigkillOfShardsDuringBackgroundRoundsLosesNothingAndDoublesNothing) {
  const int killed = GetParam();  // shards 2 - killed .. 1 die
  const fs::path deltas = dir_ / "deltas";
  fs::create_directories(deltas);
  WorkerProcess w;
  w.env = {{"ISTHMUS_WORKER_RECORD_DELTAS", deltas.string()}};
  w.Start(TrainArgs(0, 1, 100000, 2, "", {"--overlap"}), (dir_ / "w1.log").string());
  ASSERT_TRUE(ShardReachedRound(1, 3)) << w.Log();
  for (int s = 2 - killed; s < 2; ++s) shards_[s].Kill(SIGKILL);
  ASSERT_EQ(w.Wait(120 * testing::TimeScale()), 5) << w.Log();
  EXPECT_NE(w.Log().find("did not complete"), std::string::npos) << w.Log();
  auto ckpt = ReadSafetensors((dir_ / "ckpt" / "rank-0.safetensors").string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  const int rounds = std::stoi(ckpt->metadata["round"]);
  for (int s = 2 - killed; s < 2; ++s) ASSERT_TRUE(shards_[s].Start());
  WorkerProcess again;
  again.env = {{"ISTHMUS_WORKER_RECORD_DELTAS", deltas.string()}};
  again.Start(TrainArgs(0, 1, rounds + 2, 2, "", {"--overlap"}), (dir_ / "w2.log").string());
  ASSERT_EQ(again.Wait(120 * testing::TimeScale()), 0) << again.Log();
  ExpectShardsEqualCheckpoint(0, static_cast<uint64_t>(rounds + 2));
  ExpectStartPlusEveryDeltaOnce(init_, ShardTensors(), deltas, rounds + 2);
}

INSTANTIATE_TEST_SUITE_P(Killed, OverlapShardKill, ::testing::Values(1, 2));

// The checkpoint that holds the round in flight is written on the driver's thread before
// the round's push. On a full disk it cannot be: the worker waits, saying so and retrying
// every second, and nothing of that round reaches the shards meanwhile; once space is
// freed it writes the checkpoint, pushes and trains on without a restart, and the shards
// hold what the checkpoint holds. `fill` makes the checkpoint folder's disk full, `free`
// frees it; `env` is the worker's environment.
class OverlapFullDisk : public Overlap {
 protected:
  void CheckpointWaitsForSpace(const std::function<void()>& fill, const std::function<void()>& free,
                               const std::vector<std::pair<std::string, std::string>>& env);
};

void OverlapFullDisk::CheckpointWaitsForSpace(
    const std::function<void()>& fill, const std::function<void()>& free,
    const std::vector<std::pair<std::string, std::string>>& env) {
  const fs::path ckpt = dir_ / "ckpt";
  WorkerProcess first;
  first.env = env;
  first.Start(TrainArgs(0, 1, 2, 2, "", {"--overlap"}), (dir_ / "w1.log").string());
  ASSERT_EQ(first.Wait(120 * testing::TimeScale()), 0) << first.Log();
  fill();
  WorkerProcess full;
  full.env = env;
  full.Start(TrainArgs(0, 1, 4, 2, "", {"--overlap"}), (dir_ / "w2.log").string());
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(60 * testing::TimeScale());
  while (full.Log().find("waiting for space") == std::string::npos) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline)
        << "the worker never waited: " << full.Log();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_NE(full.Log().find("round 3: cannot write the checkpoint that holds it before its push"),
            std::string::npos)
      << full.Log();
  EXPECT_NE(full.Log().find("the disk is full (No space left on device)"), std::string::npos)
      << full.Log();
  for (auto& shard : shards_) {
    auto h = shard.WorkerClient()->Hello("j", wire::Role::Worker, base_hash_, "probe");
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    EXPECT_EQ(h->rounds.local_round, 2u) << "round 3 reached a shard before its checkpoint";
  }
  free();
  ASSERT_EQ(full.Wait(120 * testing::TimeScale()), 0) << full.Log();
  EXPECT_NE(full.Log().find("round 3: checkpoint written, space is back"), std::string::npos)
      << full.Log();
  ExpectShardsEqualCheckpoint(0, 4);
}

// A real full disk: a small tmpfs (root only, skipped elsewhere) filled with a file.
TEST_F(OverlapFullDisk, ACheckpointThatCannotBeWrittenWaitsForSpaceBeforeThePush) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to mount a small tmpfs for the checkpoints";
  const fs::path ckpt = dir_ / "ckpt";
  fs::create_directories(ckpt);
  if (::mount("tmpfs", ckpt.c_str(), "tmpfs", 0, "size=4m") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs here: " << std::strerror(errno);
  }
  struct Unmount {
    fs::path at;
    ~Unmount() { ::umount2(at.c_str(), MNT_DETACH); }
  } unmount{ckpt};
  CheckpointWaitsForSpace(
      [&] {
        std::ofstream filler(ckpt / "filler", std::ios::binary);
        const std::vector<char> block(4096, 1);
        for (int i = 0; i < 4096 && filler.write(block.data(), block.size()); ++i) {
        }
      },
      [&] { fs::remove(ckpt / "filler"); }, {});
}

// The same through the fault layer of tests/fault (any user): every write, allocation and
// sync in the checkpoint folder fails with ENOSPC while the disk is "full", and the layer's
// log says which of the checkpoint's write sites it reached.
TEST_F(OverlapFullDisk, ACheckpointWhoseEveryWriteFailsWithNoSpaceWaitsForSpaceBeforeThePush) {
  if (fault::kSanitizedBuild) GTEST_SKIP() << fault::kSanitizedSkip;
  const fs::path control = dir_ / "fault-control";
  std::vector<std::pair<std::string, std::string>> env;
  for (const auto& kv : fault::DiskFullEnv(dir_ / "ckpt", control)) env.push_back(kv);
  CheckpointWaitsForSpace([&] { std::ofstream(control / "full").put('1'); },
                          [&] { fs::remove(control / "full"); }, env);
  std::ifstream in(control / "hits");
  std::map<std::string, int> hits;
  std::string where;
  for (std::string call, kind; in >> call >> kind;) {
    hits[call] += 1;
    where += " " + call + " " + kind;
  }
  EXPECT_FALSE(hits.empty()) << "no write of the checkpoint failed: the layer did nothing";
  EXPECT_GT(hits["write"] + hits["pwrite"] + hits["writev"], 0) << where;
  std::printf("failed calls in the checkpoint folder:%s\n", where.c_str());
}

// Two sites, alpha's worker SIGKILLed right after a background pull, in LoRA and full mode
// (tests/worker/overlap_harness.h says what is checked; the GPU tests run the same check
// with a CUDA site).
TEST(OverlapTwoSites, SigkillDuringABackgroundPullLosesNothingAndDoublesNothing) {
  testing::ExpectOverlappedSitesSurviveAKillAfterPull("overlap-pull", {}, {});
}

TEST(OverlapTwoSites, FullModeSigkillDuringABackgroundPullLosesNothingAndDoublesNothing) {
  testing::ExpectOverlappedSitesSurviveAKillAfterPull("overlap-pull-full", {"--mode", "full"},
                                                      {"--mode", "full"}, {"--mode", "full"});
}

// --encode-deltas (docs/SYNC.md, "Deltas encoded by the worker"): both sites' rank 0 encode
// their rounds with top-k and error feedback and push the bytes; alpha has `world` ranks.
// Alpha's rank 0 dies in the background right after its shard took round 3, before it wrote
// the residual after it. Its checkpoint holds round 3 with the residual before it, and the
// pipelines it used are kept beside it. The restart encodes round 3 again with those
// pipelines from that residual, so the shard answers duplicate for the same bytes, and goes
// on. Error feedback loses nothing and doubles nothing when the committed tensors plus the
// sites' final residuals, merged as the deltas are (each site's share of the tokens, outer
// lr 1, no momentum), are the start plus every recorded delta merged once, float rounding
// aside, while those
// residuals are far from zero: encoding round 3 again from another residual, or sending it
// as fp32 because the shard has moved on, leaves a round's unsent part out or in twice.
class EncodedTwoSites : public ::testing::TestWithParam<int> {};

TEST_P(EncodedTwoSites, ADeathAfterAnEncodedPushLosesNothingAndDoublesNothing) {
  const int world = GetParam();
  constexpr int kRounds = 6, kH = 2;
  TwoSites sites("encoded-" + std::to_string(world));
  ASSERT_TRUE(sites.Start(2,
                          "codec = \"topk:0.1+int4+zstd\"\nadaptive = false\nouter_lr = "
                          "1.0\nouter_momentum = 0.0"));
  const fs::path da = sites.root() / "deltas-alpha", db = sites.root() / "deltas-beta";
  fs::create_directories(da);
  fs::create_directories(db);
  const std::vector<std::string> flags = {"--overlap", "--encode-deltas", "--encode-threads", "2"};
  // Alpha's ranks: rank 0 is the site's worker (TwoSites), the others run beside it.
  std::vector<WorkerProcess> more(world - 1);
  auto start_alpha = [&](const std::vector<std::pair<std::string, std::string>>& env) {
    std::vector<std::string> f = flags;
    const std::string rdv = "tcp:127.0.0.1:" + std::to_string(testing::FreePort());
    if (world > 1) f.insert(f.end(), {"--world-size", std::to_string(world), "--rendezvous", rdv});
    sites.StartOn(0, kRounds, kH, f, env);
    for (int r = 1; r < world; ++r) {
      auto a = sites.Args(0, kRounds, kH, f);
      a.insert(a.end(), {"--rank", std::to_string(r)});
      more[r - 1].Start(a, (sites.root() / ("alpha-r" + std::to_string(r) + ".log")).string());
    }
  };
  start_alpha({{"ISTHMUS_WORKER_RECORD_DELTAS", da.string()},
               {"ISTHMUS_WORKER_FAULT_CRASH_AFTER_PUSH", "3"}});
  sites.StartOn(1, kRounds, kH, flags, {{"ISTHMUS_WORKER_RECORD_DELTAS", db.string()}});
  ASSERT_EQ(sites.WaitOn(0), 137) << sites.worker(0).Log();
  for (auto& w : more) w.Kill();
  EXPECT_NE(sites.worker(0).Log().find("after pushing round 3"), std::string::npos)
      << sites.worker(0).Log();
  auto ckpt = ReadSafetensors((sites.root() / "ckpt-alpha" / "rank-0.safetensors").string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  EXPECT_EQ(ckpt->metadata["round"], "3");
  EXPECT_EQ(ckpt->metadata.count("unpushed_tokens"), 1u);
  std::ifstream kept(sites.root() / "ckpt-alpha" / "rank-0.pipelines.json");
  const std::string kept_text((std::istreambuf_iterator<char>(kept)), {});
  EXPECT_NE(kept_text.find("\"round\":3"), std::string::npos) << kept_text;
  for (int r = 1; r < world; ++r) {
    auto c = ReadSafetensors(
        (sites.root() / "ckpt-alpha" / ("rank-" + std::to_string(r) + ".safetensors")).string());
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    for (const auto& t : c->tensors) {
      EXPECT_NE(t.name.rfind("residual.", 0), 0u) << "rank " << r << " holds " << t.name;
    }
  }
  start_alpha({{"ISTHMUS_WORKER_RECORD_DELTAS", da.string()}});
  ASSERT_EQ(sites.WaitOn(0), 0) << sites.worker(0).Log();
  for (auto& w : more) ASSERT_EQ(w.Wait(240), 0) << w.Log();
  ASSERT_EQ(sites.WaitOn(1), 0) << sites.worker(1).Log();
  const std::string log = sites.worker(0).Log();
  EXPECT_NE(log.find("the pipelines of round 3 kept"), std::string::npos) << log;
  EXPECT_NE(log.find("pushing it from the checkpoint"), std::string::npos) << log;
  EXPECT_NE(log.find("already had round 3"), std::string::npos) << log;
  EXPECT_NE(log.find("round 5: pushed "), std::string::npos) << log;  // what encoding saved
  sites.ExpectCommittedAlike(kRounds);

  auto pulled = sites.site(0).WorkerClient()->Pull("j");
  ASSERT_TRUE(pulled.ok()) << pulled.status().ToString();
  EXPECT_EQ(pulled->rounds.committed_round, static_cast<uint64_t>(kRounds));
  std::map<std::string, std::vector<double>> got, want;
  for (const auto& t : pulled->tensors) got[t.name].assign(t.data.begin(), t.data.end());
  auto start = ReadSafetensorsTensors((sites.root() / "base.init.safetensors").string());
  ASSERT_TRUE(start.ok());
  for (const auto& t : *start) want[t.name].assign(t.data.begin(), t.data.end());
  // Each site's merge weight: its share of a round's tokens (alpha's ranks train twice the
  // tokens of beta's one with two), the same every round.
  std::map<std::string, double> weight, tokens;
  for (const char* site : {"alpha", "beta"}) {
    auto d = ReadSafetensors(
        (sites.root() / (std::string("deltas-") + site) / "round-1.safetensors").string());
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    tokens[site] = std::stod(d->metadata["tokens"]);
  }
  for (auto& [site, t] : tokens) weight[site] = t / (tokens["alpha"] + tokens["beta"]);
  double residual = 0;
  size_t residuals = 0;
  for (const char* site : {"alpha", "beta"}) {
    const double w = weight[site];
    auto c = ReadSafetensors(
        (sites.root() / (std::string("ckpt-") + site) / "rank-0.safetensors").string());
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->metadata["round"], std::to_string(kRounds)) << site;
    for (const auto& t : c->tensors) {
      if (t.name.rfind("residual.", 0) != 0) continue;
      ++residuals;
      auto& g = got.at(t.name.substr(std::strlen("residual.")));
      ASSERT_EQ(g.size(), t.data.size()) << t.name;
      for (size_t k = 0; k < g.size(); ++k) {
        g[k] += w * t.data[k];
        residual = std::max(residual, double(std::abs(t.data[k])));
      }
    }
    const fs::path& deltas = std::string(site) == "alpha" ? da : db;
    for (int r = 1; r <= kRounds; ++r) {
      auto d = ReadSafetensors((deltas / ("round-" + std::to_string(r) + ".safetensors")).string());
      ASSERT_TRUE(d.ok()) << site << " round " << r << ": " << d.status().ToString();
      ASSERT_EQ(std::stod(d->metadata["tokens"]), tokens[site]) << site << " round " << r;
      for (const auto& t : d->tensors) {
        for (size_t k = 0; k < t.data.size(); ++k) want.at(t.name)[k] += w * t.data[k];
      }
    }
  }
  EXPECT_EQ(residuals, 2 * want.size()) << "a tensor was not encoded by its site";
  double worst = 0;
  for (const auto& [name, w] : want) {
    for (size_t k = 0; k < w.size(); ++k) worst = std::max(worst, std::abs(w[k] - got.at(name)[k]));
  }
  std::printf(
      "largest residual value %.3g; largest |committed + merged residuals - start - merged "
      "deltas| %.3g\n",
      residual, worst);
  EXPECT_GT(residual, 1e-3) << "error feedback left nothing unsent: the check below is empty";
  EXPECT_LT(worst, 1e-5) << "an update was lost or applied twice";
}

INSTANTIATE_TEST_SUITE_P(Ranks, EncodedTwoSites, ::testing::Values(1, 2));

// Bounded staleness under overlap: a site whose only peer never answers commits nothing.
// Counting the round in flight, the worker is at most K rounds ahead of the last commit
// while it trains: it pushes max(K, 1) rounds, trains one more (K >= 1; K = 0 waits for the
// commit before training on) and then waits, saying so, and keeps asking the shard.
class OverlapWanWait : public ::testing::TestWithParam<int> {};

TEST_P(OverlapWanWait, TheBoundCountsTheRoundInFlight) {
  const int k = GetParam();
  fs::path dir = fs::temp_directory_path() /
                 ("isthmus-owan-" + std::to_string(::getpid()) + "-" + std::to_string(k));
  fs::remove_all(dir);
  fs::create_directories(dir / "data");
  testing::WriteTokens(dir / "data" / "train.bin", 20000, 1);
  testing::WriteTokens(dir / "data" / "val.bin", 2000, 2);
  ServerProcess shard;
  ASSERT_TRUE(testing::StartSiteWithSilentPeer(shard, dir, k));
  const std::string base_hash = testing::CreateJobFromInit(shard, dir);
  WorkerProcess w;
  w.Start(testing::SingleShardTrainArgs(
              shard, dir, {"--max-rounds", "8", "--steps-per-round", "2", "--overlap"}),
          (dir / "w.log").string());
  bool waiting = false;
  for (int i = 0; i < 1200 * testing::TimeScale() && !waiting; ++i) {
    waiting = w.Log().find("waiting for the WAN") != std::string::npos;
    if (!waiting) ::usleep(50'000);
  }
  ASSERT_TRUE(waiting) << w.Log();
  // It keeps asking the shard and pushes nothing more.
  auto admin = shard.AdminClient();
  auto first = admin->Stats();
  ASSERT_TRUE(first.ok());
  uint64_t calls = 1, others = 0;
  for (int i = 0; i < 400 * testing::TimeScale() && others < 10; ++i) {
    ::usleep(20'000);
    auto st = admin->Stats();
    ASSERT_TRUE(st.ok());
    ++calls;
    others = st->requests - first->requests - (calls - 1);
  }
  ASSERT_GE(others, 10u) << "the waiting worker stopped asking the shard";
  auto hello = shard.WorkerClient()->Hello("j", wire::Role::Worker, base_hash, "probe");
  ASSERT_TRUE(hello.ok());
  const uint64_t pushed = static_cast<uint64_t>(std::max(k, 1));
  EXPECT_EQ(hello->rounds.committed_round, 0u);
  EXPECT_EQ(hello->rounds.local_round, pushed);
  // Trained: the pushed rounds, plus the round in training for K >= 1.
  const int trained = 2 * static_cast<int>(pushed) + (k >= 1 ? 2 : 0);
  const std::string log = w.Log();
  EXPECT_NE(log.find("step " + std::to_string(trained) + "/"), std::string::npos) << log;
  EXPECT_EQ(log.find("step " + std::to_string(trained + 1) + "/"), std::string::npos) << log;
  EXPECT_NE(log.find("limit " + std::to_string(k)), std::string::npos) << log;
  int status = 0;
  EXPECT_EQ(::waitpid(w.pid, &status, WNOHANG), 0) << "the worker should still be waiting";
  w.Kill();
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(K, OverlapWanWait, ::testing::Values(0, 1, 2));

// A background push refused by a shard is not dropped: here the site is leaving the job
// (isthmusctl sync leave), so its shard refuses new rounds. The worker stops with exit 3
// (a shard refused it), its log says which round and why, its events file records the
// failure, and the round stays in its checkpoint for the next start.
TEST(OverlapRefusal, ARefusedBackgroundPushStopsTheWorkerSayingSo) {
  fs::path dir = fs::temp_directory_path() / ("isthmus-orefused-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "data");
  testing::WriteTokens(dir / "data" / "train.bin", 20000, 1);
  testing::WriteTokens(dir / "data" / "val.bin", 2000, 2);
  ServerProcess shard;
  ASSERT_TRUE(testing::StartSiteWithSilentPeer(shard, dir, 256));
  const std::string base_hash = testing::CreateJobFromInit(shard, dir);
  WorkerProcess w;
  const fs::path events = dir / "events.jsonl";
  w.Start(testing::SingleShardTrainArgs(
              shard, dir,
              {"--max-rounds", "100000", "--steps-per-round", "2", "--overlap", "--events",
               events.string(), "--checkpoint-dir", (dir / "ckpt").string()}),
          (dir / "w.log").string());
  bool pushed = false;
  for (int i = 0; i < 600 * testing::TimeScale() && !pushed; ++i) {
    auto h = shard.WorkerClient()->Hello("j", wire::Role::Worker, base_hash, "probe");
    pushed = h.ok() && h->rounds.local_round >= 2;
    if (!pushed) ::usleep(50'000);
  }
  ASSERT_TRUE(pushed) << w.Log();
  auto left = shard.AdminClient()->MembershipControl(wire::MembershipAction::Leave, "", "j");
  ASSERT_TRUE(left.ok()) << left.status().ToString();
  const int rc = w.Wait(120 * testing::TimeScale());
  EXPECT_EQ(rc, 3) << w.Log();
  const std::string log = w.Log();
  EXPECT_NE(log.find("did not complete"), std::string::npos) << log;
  EXPECT_NE(log.find("is leaving job"), std::string::npos) << log;
  EXPECT_NE(log.find("kept in the checkpoint"), std::string::npos) << log;
  std::ifstream in(events);
  std::string line, failure;
  double checkpoint_s = 0;
  while (std::getline(in, line)) {
    if (line.find("\"round_failure\"") != std::string::npos) failure = line;
    const size_t at = line.find("\"checkpoint_s\":");
    if (line.find("\"event\":\"round\"") != std::string::npos && at != std::string::npos) {
      checkpoint_s += std::strtod(line.c_str() + at + std::strlen("\"checkpoint_s\":"), nullptr);
    }
  }
  EXPECT_NE(failure.find("is leaving job"), std::string::npos) << failure;
  // The rounds' events say how long their checkpoints took to write (a real file each).
  EXPECT_GT(checkpoint_s, 0.0) << "no round event gave its checkpoint's time";
  auto ckpt = ReadSafetensors((dir / "ckpt" / "rank-0.safetensors").string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  EXPECT_EQ(ckpt->metadata.count("unpushed_tokens"), 1u);
  auto hello = shard.WorkerClient()->Hello("j", wire::Role::Worker, base_hash, "probe");
  ASSERT_TRUE(hello.ok());
  // The refused round is the one after the last the shard took; the checkpoint holds it.
  EXPECT_EQ(ckpt->metadata["round"], std::to_string(hello->rounds.local_round + 1));
  // The operator sees the refusal too: isthmusctl top names the refused push and why.
  const std::string cmd = std::string(testing::BinaryPath("ISTHMUS_CTL_BIN", ISTHMUS_CTL_BIN)) +
                          " top --count 1 --server " + ServerProcess::Endpoint(shard.admin_port()) +
                          " --server-key " + (shard.dir() / "server.pub").string() + " --key " +
                          (shard.dir() / "admins" / "a0.key").string() + " 2>&1";
  const auto ctl = testing::RunCommand(cmd);
  const std::string& top = ctl.output;
  EXPECT_EQ(ctl.exit_code, 0) << top;
  const size_t refused = top.find("last refused request (");
  ASSERT_NE(refused, std::string::npos) << top;
  EXPECT_NE(top.find("push from worker socket", refused), std::string::npos) << top;
  EXPECT_NE(top.find("is leaving job", refused), std::string::npos) << top;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace isthmus
