// What the --overlap tests share (tests/worker/worker_overlap_test.cc on the CPU and
// tests/gpu/gpu_worker_test.cc with --device cuda): a fixture of one synced site without
// peers that runs jobs with overlap on and off and compares their committed state, the
// check that committed tensors are the start plus every recorded delta once, and a
// two-site run whose worker is SIGKILLed right after a background pull.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tests/worker/worker_harness.h"

namespace isthmus::testing {

// A synced site without peers: each shard commits a round as soon as its tensors are
// pushed, exactly (dense, outer lr 1, no momentum), and K = 2 lets the push run behind the
// next round. Tensors of 512 bytes or more are pushed in parts of 256 (most of these small
// models' tensors; storage.synced_push_part_bytes, off by default), so the kills below
// also fall between a push's parts.
constexpr char kSoloSite[] =
    "[sync]\nsite = \"solo\"\nouter_lr = 1.0\nouter_momentum = 0.0\nmax_rounds_ahead = 2\n"
    "[storage]\npush_part_bytes = 256\nsynced_push_part_bytes = 256\n";

class Overlap : public WorkerWithShards {
 protected:
  void SetUp() override {
    for (auto& s : shards_) s.set_extra(kSoloSite);
    WorkerWithShards::SetUp();
  }

  // TrainArgs for job `job` with its own checkpoint folder.
  std::vector<std::string> Args(const std::string& job, int rank, int world, int rounds, int h,
                                const std::string& rdv, const std::vector<std::string>& extra) {
    auto a = TrainArgs(rank, world, rounds, h, rdv, extra);
    for (size_t i = 0; i + 1 < a.size(); ++i) {
      if (a[i] == "--job") a[i + 1] = job;
      if (a[i] == "--checkpoint-dir") a[i + 1] = (dir_ / ("ckpt-" + job)).string();
    }
    return a;
  }

  // Creates `job` on both shards from `tensors` (placed as isthmusctl places them).
  void CreateJobNamed(const std::string& job, const std::vector<Tensor>& tensors,
                      const std::string& base_hash) {
    std::vector<TensorSize> sizes;
    for (const auto& t : tensors) sizes.push_back({t.name, t.data.size() * 4});
    auto placement = AssignTensorsToShards(sizes, 2);
    for (int s = 0; s < 2; ++s) {
      std::vector<TensorView> views;
      for (size_t i = 0; i < tensors.size(); ++i) {
        if (placement[i] == s)
          views.push_back({tensors[i].name, tensors[i].shape, tensors[i].data.data()});
      }
      auto r = shards_[s].AdminClient()->CreateJob(job, base_hash, views);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
    }
  }

  // Runs `world` ranks on `job` to `rounds` rounds; returns rank 0's log.
  std::string RunSite(const std::string& job, int world, int rounds, int h,
                      const std::vector<std::string>& extra) {
    std::string rdv = "tcp:127.0.0.1:" + std::to_string(testing::FreePort());
    std::vector<WorkerProcess> ranks(world);
    for (int r = 0; r < world; ++r) {
      ranks[r].Start(Args(job, r, world, rounds, h, world > 1 ? rdv : "", extra),
                     (dir_ / (job + "-r" + std::to_string(r) + ".log")).string());
    }
    for (auto& w : ranks) EXPECT_EQ(w.Wait(240 * testing::TimeScale()), 0) << w.Log();
    return ranks[0].Log();
  }

  std::map<std::string, std::vector<float>> Tensors(const std::string& job) {
    std::map<std::string, std::vector<float>> out;
    for (auto& s : shards_) {
      auto p = s.WorkerClient()->Pull(job);
      EXPECT_TRUE(p.ok()) << p.status().ToString();
      if (p.ok()) {
        for (auto& t : p->tensors) out[t.name] = t.data;
      }
    }
    return out;
  }

  std::vector<std::pair<uint64_t, std::string>> DigestsOf(int shard, const std::string& job) {
    auto d = shards_[shard].AdminClient()->Digests(job, 0);
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    return d.ok() ? d->digests : std::vector<std::pair<uint64_t, std::string>>{};
  }

  // ExpectOnOffAlike in full mode (every tensor trains; the pre-training phase), one rank:
  // jobs "full-off" and "full-on" hold every tensor of the model. `extra`: more flags.
  void ExpectFullModeOnOffAlike(const std::vector<std::string>& extra) {
    // Every tensor of the model as the job's; the base (same seed) is the workers'.
    const std::string hash = RunInit(dir_, 1, "full", {"--mode", "full"});
    ASSERT_EQ(hash, base_hash_);
    auto init = ReadSafetensorsTensors((dir_ / "full.init.safetensors").string());
    ASSERT_TRUE(init.ok()) << init.status().ToString();
    ASSERT_GT(init->size(), init_.size());
    CreateJobNamed("full-off", *init, hash);
    CreateJobNamed("full-on", *init, hash);
    std::vector<std::string> flags = {"--mode", "full"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    ExpectOnOffAlike(1, *init, "full-off", "full-on", flags);
  }

  // Runs jobs `off` and `on` (both created from `init`) with `world` ranks, without and with
  // --overlap, and expects the same committed state, digests and checkpoint.
  void ExpectOnOffAlike(int world, const std::vector<Tensor>& init, const std::string& off,
                        const std::string& on, const std::vector<std::string>& extra) {
    constexpr int kRounds = 4, kH = 3;
    auto with = [&](const char* flag) {
      std::vector<std::string> a = extra;
      a.push_back(flag);
      return a;
    };
    RunSite(off, world, kRounds, kH, with("--no-overlap"));
    const std::string log = RunSite(on, world, kRounds, kH, with("--overlap"));
    // The overlapped run did merge pulled states into rounds already training.
    EXPECT_NE(log.find("the pulled state merged after"), std::string::npos) << log;
    auto off_t = Tensors(off), on_t = Tensors(on);
    ASSERT_EQ(off_t.size(), init.size());
    double moved = 0;
    for (const auto& t : init) {
      ASSERT_EQ(on_t[t.name], off_t[t.name]) << t.name << " differs between overlap on and off";
      for (size_t k = 0; k < t.data.size(); ++k)
        moved = std::max(moved, double(std::abs(off_t[t.name][k] - t.data[k])));
    }
    EXPECT_GT(moved, 1e-4) << "training did not move the tensors";
    for (int s = 0; s < 2; ++s) {
      auto a = DigestsOf(s, off), b = DigestsOf(s, on);
      ASSERT_EQ(a.size(), kRounds + 1u);
      EXPECT_EQ(a, b) << "shard " << s;
      for (const std::string& job : {off, on}) {
        auto info = shards_[s].AdminClient()->DescribeJob(job);
        ASSERT_TRUE(info.ok());
        EXPECT_EQ(info->pushes, static_cast<uint64_t>(kRounds)) << job;
      }
    }
    // The overlapped run's checkpoint holds the shards' state, nothing in flight.
    auto ckpt = ReadSafetensors((dir_ / ("ckpt-" + on) / "rank-0.safetensors").string());
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    EXPECT_EQ(ckpt->metadata.count("unpushed_tokens"), 0u);
    for (const auto& t : ckpt->tensors) {
      if (t.name.rfind("opt.", 0) != 0) {
        EXPECT_EQ(t.data, on_t[t.name]) << t.name;
      }
    }
  }
};

// The committed tensors must be the start plus every round's delta once (a synced site
// alone adds each round's delta exactly): `deltas` holds round-R.safetensors as the worker
// recorded them before pushing.
inline void ExpectStartPlusEveryDeltaOnce(const std::vector<Tensor>& start,
                                          const std::map<std::string, std::vector<float>>& shards,
                                          const fs::path& deltas, int rounds) {
  std::map<std::string, std::vector<float>> want;
  for (const auto& t : start) want[t.name] = t.data;
  for (int r = 1; r <= rounds; ++r) {
    auto d =
        ReadSafetensorsTensors((deltas / ("round-" + std::to_string(r) + ".safetensors")).string());
    ASSERT_TRUE(d.ok()) << "round " << r << ": " << d.status().ToString();
    for (const auto& t : *d) {
      auto& w = want[t.name];
      ASSERT_EQ(w.size(), t.data.size()) << t.name;
      for (size_t k = 0; k < w.size(); ++k) w[k] = w[k] + t.data[k];
    }
  }
  for (const auto& [name, w] : want) {
    auto it = shards.find(name);
    ASSERT_NE(it, shards.end()) << name;
    ASSERT_EQ(it->second, w) << name << ": not the start plus each round's delta once";
  }
}

// Two sites; site alpha's worker dies in the background right after pulling round 3's
// merged state (before merging it) while it trains round 4. Restarted, it pushes round 3
// again (duplicate), pulls and trains on; both sites commit every round with identical
// digests, and the committed state is the start plus, per round, the token-weighted merge of
// both sites' recorded deltas (dense codec, outer lr 1, no momentum: the engine's own
// arithmetic, in site-name order).
// `alpha` and `beta`: more flags of each site's worker (device, mode); `init`: more flags
// of isthmus-worker init (--mode full).
inline void ExpectOverlappedSitesSurviveAKillAfterPull(const std::string& name,
                                                       const std::vector<std::string>& alpha,
                                                       const std::vector<std::string>& beta,
                                                       const std::vector<std::string>& init = {}) {
  constexpr int kRounds = 6, kH = 2;
  TwoSites sites(name);
  ASSERT_TRUE(sites.Start(
      2, "codec = \"dense\"\nadaptive = false\nouter_lr = 1.0\nouter_momentum = 0.0", init));
  const fs::path da = sites.root() / "deltas-alpha", db = sites.root() / "deltas-beta";
  fs::create_directories(da);
  fs::create_directories(db);
  auto with_overlap = [](std::vector<std::string> flags) {
    flags.push_back("--overlap");
    return flags;
  };
  sites.StartOn(0, kRounds, kH, with_overlap(alpha),
                {{"ISTHMUS_WORKER_RECORD_DELTAS", da.string()},
                 {"ISTHMUS_WORKER_FAULT_CRASH_AFTER_PULL", "3"}});
  sites.StartOn(1, kRounds, kH, with_overlap(beta),
                {{"ISTHMUS_WORKER_RECORD_DELTAS", db.string()}});
  ASSERT_EQ(sites.WaitOn(0), 137) << sites.worker(0).Log();
  EXPECT_NE(sites.worker(0).Log().find("after pulling round 3"), std::string::npos)
      << sites.worker(0).Log();
  sites.StartOn(0, kRounds, kH, with_overlap(alpha),
                {{"ISTHMUS_WORKER_RECORD_DELTAS", da.string()}});
  ASSERT_EQ(sites.WaitOn(0), 0) << sites.worker(0).Log();
  ASSERT_EQ(sites.WaitOn(1), 0) << sites.worker(1).Log();
  EXPECT_NE(sites.worker(0).Log().find("pushing it from the checkpoint"), std::string::npos)
      << sites.worker(0).Log();
  sites.ExpectCommittedAlike(kRounds);

  auto start = ReadSafetensorsTensors((sites.root() / "base.init.safetensors").string());
  ASSERT_TRUE(start.ok());
  std::map<std::string, std::vector<float>> want;
  for (const auto& t : *start) want[t.name] = t.data;
  for (int r = 1; r <= kRounds; ++r) {
    const std::string f = "round-" + std::to_string(r) + ".safetensors";
    auto a = ReadSafetensors((da / f).string()), b = ReadSafetensors((db / f).string());
    ASSERT_TRUE(a.ok() && b.ok()) << "round " << r;
    // Equal tokens: each site's weight is 0.5.
    ASSERT_EQ(a->metadata["tokens"], b->metadata["tokens"]);
    std::map<std::string, const Tensor*> bt;
    for (const auto& t : b->tensors) bt[t.name] = &t;
    for (const auto& t : a->tensors) {
      auto& w = want[t.name];
      const auto& u = bt.at(t.name)->data;
      for (size_t k = 0; k < w.size(); ++k) {
        float merged = 0.0f;
        const float wa = 0.5f * t.data[k];
        merged = merged + wa;
        const float wb = 0.5f * u[k];
        merged = merged + wb;
        w[k] = w[k] + merged;
      }
    }
  }
  auto pulled = sites.site(0).WorkerClient()->Pull("j");
  ASSERT_TRUE(pulled.ok()) << pulled.status().ToString();
  EXPECT_EQ(pulled->rounds.committed_round, static_cast<uint64_t>(kRounds));
  ASSERT_EQ(pulled->tensors.size(), want.size());
  for (const auto& t : pulled->tensors) {
    ASSERT_EQ(t.data, want[t.name]) << t.name << ": not the start plus each round once";
  }
}

}  // namespace isthmus::testing
