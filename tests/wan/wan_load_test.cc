// The WAN benchmark's synthetic site (bench/wan/wan_load.h): recorded deltas are read
// back exactly, the summary adds up, and against a real isthmus-server (a site with the
// round protocol on and no peers, so every round commits as soon as it closes) the replayed
// rounds land through the round driver, with overlap and without, pulling every tensor or by
// replay: the committed state is the
// start plus every replayed delta, in order, and the synthetic site's weights end equal to it.
#include <gtest/gtest.h>

#include <filesystem>

#include "bench/wan/wan_load.h"
#include "common/keys.h"
#include "common/safetensors.h"
#include "tests/integration/server_process.h"

namespace isthmus::wanload {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path =
      fs::temp_directory_path() / ("isthmus-wanload-" + std::to_string(::getpid()) + "-" +
                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
};

// Round r of a tiny "recording": two tensors whose values depend on r.
std::vector<Tensor> RecordedRound(int r) {
  Tensor w{"h.0.w", {2, 3}, {}}, b{"h.0.b", {4}, {}};
  for (int i = 0; i < 6; ++i) w.data.push_back(0.5f * static_cast<float>(r * r) + 0.25f * i);
  for (int i = 0; i < 4; ++i) b.data.push_back(-1.0f * static_cast<float>(r) + 0.125f * i);
  return {w, b};
}

void WriteRounds(const fs::path& dir, int rounds) {
  for (int r = 0; r <= rounds; ++r) {
    ASSERT_TRUE(WriteSafetensors((dir / ("round-" + std::to_string(r) + ".safetensors")).string(),
                                 RecordedRound(r))
                    .ok());
  }
}

// A recording of `rounds` rounds, written and read back.
RecordedDeltas Recording(const TempDir& d, int rounds) {
  WriteRounds(d.path, rounds);
  auto deltas = LoadRecordedDeltas(d.path.string());
  EXPECT_TRUE(deltas.ok()) << deltas.status().ToString();
  return deltas.ok() ? std::move(*deltas) : RecordedDeltas{};
}

// A synthetic site of one shard, the given server's worker endpoint.
std::unique_ptr<SyntheticSite> SiteOn(testing::ServerProcess& server, SiteOptions o) {
  isthmus::SiteOptions so;
  so.job = o.job;
  so.client_name = o.client_name.empty() ? "site" : o.client_name;
  so.servers = {testing::ServerProcess::Endpoint(server.worker_port())};
  auto pub = LoadPublicKeyFile((server.dir() / "server.pub").string());
  EXPECT_TRUE(pub.ok()) << pub.status().ToString();
  so.server_public_keys = {pub.ok() ? *pub : ""};
  so.client_keys = server.worker_keys();
  return std::make_unique<SyntheticSite>(
      1,
      [&server](size_t) -> Result<std::unique_ptr<ShardClient>> { return server.WorkerClient(); },
      [so] { return SiteClient::Connect(so); }, std::move(o));
}

TEST(WanLoad, RecordedDeltasAreConsecutiveDifferences) {
  TempDir d;
  WriteRounds(d.path, 3);
  auto deltas = LoadRecordedDeltas(d.path.string());
  ASSERT_TRUE(deltas.ok()) << deltas.status().ToString();
  ASSERT_EQ(deltas->rounds.size(), 3u);
  EXPECT_EQ(deltas->numel, 10u);
  for (int r = 1; r <= 3; ++r) {
    const auto now = RecordedRound(r), before = RecordedRound(r - 1);
    const auto& got = deltas->rounds[static_cast<size_t>(r - 1)];
    ASSERT_EQ(got.size(), 2u);
    for (size_t t = 0; t < 2; ++t) {
      EXPECT_EQ(got[t].name, now[t].name);
      EXPECT_EQ(got[t].shape, now[t].shape);
      for (size_t i = 0; i < got[t].data.size(); ++i) {
        EXPECT_EQ(got[t].data[i], now[t].data[i] - before[t].data[i]);
      }
    }
  }
  auto two = LoadRecordedDeltas(d.path.string(), 2);
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->rounds.size(), 2u);
}

TEST(WanLoad, MissingOrMismatchedRecordingsAreRefusedByName) {
  TempDir d;
  auto none = LoadRecordedDeltas(d.path.string());
  EXPECT_EQ(none.status().code(), Code::kNotFound);
  EXPECT_NE(none.status().message().find("record.sh"), std::string::npos);
  WriteRounds(d.path, 1);
  auto bad = RecordedRound(2);
  bad[1].shape = {2, 2};
  ASSERT_TRUE(WriteSafetensors((d.path / "round-2.safetensors").string(), bad).ok());
  auto r = LoadRecordedDeltas(d.path.string());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find("round-2.safetensors"), std::string::npos)
      << r.status().ToString();
}

TEST(WanLoad, SummaryAddsUpAndSkipsStartUp) {
  // round, compute, push, wait, pull, commit latency, wall, boundary, blocked, blocked on
  // the WAN.
  std::vector<RoundTiming> rounds = {
      {1, 3.0, 0.1, 2.0, 0.1, 5.0, 5.2, 2.2, 2.2, 2.0},  // start-up: left out
      {2, 3.0, 0.1, 0.0, 0.1, 1.5, 3.2, 0.2, 0.2, 0.0},
      {3, 3.0, 0.2, 0.5, 0.1, 2.5, 3.8, 0.8, 0.8, 0.5},
      {4, 3.0, 0.1, 0.0, 0.1, -1, 3.2, 0.2, 0.2, 0.0},  // never committed
  };
  auto s = Summarize(rounds, 1);
  EXPECT_EQ(s.rounds, 3u);
  EXPECT_DOUBLE_EQ(s.compute_s, 9.0);
  EXPECT_NEAR(s.wall_s, 10.2, 1e-12);
  EXPECT_NEAR(s.boundary_s, 1.2, 1e-12);
  EXPECT_NEAR(s.push_s, 0.4, 1e-12);
  EXPECT_NEAR(s.utilisation, 1.0 - 0.5 / 10.2, 1e-12);
  EXPECT_NEAR(s.compute_fraction, 9.0 / 10.2, 1e-12);
  EXPECT_NEAR(s.wait_fraction, 0.5 / 10.2, 1e-12);
  EXPECT_EQ(s.rounds_waited, 1u);
  EXPECT_DOUBLE_EQ(s.mean_commit_latency_s, 2.0);
  EXPECT_DOUBLE_EQ(s.max_commit_latency_s, 2.5);
  EXPECT_EQ(Summarize({}, 0).utilisation, 0.0);
}

// Param: bit 0 overlap, bit 1 pull by replay.
class WanLoadReplay : public ::testing::TestWithParam<int> {};

TEST_P(WanLoadReplay, ReplaysIntoARealShardAndEveryRoundCommits) {
  TempDir d;
  auto deltas = Recording(d, 2);
  // A site with the round protocol on and no peers: each round commits once it closes.
  // Plain averaging, so that the committed state is the start plus the deltas.
  testing::ServerProcess server("[sync]\nsite = \"solo\"\nouter_lr = 1.0\nouter_momentum = 0.0\n");
  ASSERT_TRUE(server.Start());
  auto start = RecordedRound(0);
  std::vector<TensorView> views;
  for (const auto& t : start) views.push_back({t.name, t.shape, t.data.data()});
  ASSERT_TRUE(server.AdminClient()->CreateJob("j", "", views).ok());

  SiteOptions o;
  o.job = "j";
  o.client_name = "solo";
  o.round_seconds = 0.05;
  o.rounds = 5;  // more than recorded: the replay cycles 1, 2, 1, 2, 1
  o.overlap = (GetParam() & 1) != 0;
  o.pull_by_replay = (GetParam() & 2) != 0;
  o.steps_per_round = 5;
  auto site = SiteOn(server, o);
  Status prepared = site->Prepare(deltas);
  ASSERT_TRUE(prepared.ok()) << prepared.ToString();
  if (o.pull_by_replay) {
    // The start-up pull seeds the copy the rounds replay onto (the whole state, once).
    ASSERT_NE(site->replay_stats(), nullptr);
    EXPECT_EQ(site->replay_stats()->pulls, 1u);
    EXPECT_EQ(site->replay_stats()->whole_pulls, 1u);
  }
  auto timings = site->Run(deltas);
  ASSERT_TRUE(timings.ok()) << timings.status().ToString();
  ASSERT_EQ(timings->size(), 5u);
  if (o.pull_by_replay) {
    // Every round's pull replayed, round 1's too: no whole state inside a round.
    EXPECT_EQ(site->replay_stats()->whole_pulls, 1u);
    EXPECT_EQ(site->replay_stats()->rounds_replayed, 5u);
    EXPECT_EQ(site->replay_stats()->digest_mismatches, 0u);
    // Checked with the shard's fast check, not hashed again with SHA-256.
    EXPECT_GE(site->replay_stats()->fast_checks, 1u);
    EXPECT_EQ(site->replay_stats()->digest_checks, 0u);
  }
  for (const auto& t : *timings) {
    EXPECT_GE(t.compute_s, 0.05);
    EXPECT_GE(t.wall_s, t.compute_s);
    EXPECT_GT(t.push_s, 0.0) << "round " << t.round;
    EXPECT_GT(t.pull_s, 0.0) << "round " << t.round;
    EXPECT_GE(t.commit_latency_s, 0.0) << "round " << t.round << " never committed";
  }
  auto sum = Summarize(*timings, 0);
  EXPECT_GT(sum.utilisation, 0.0);
  EXPECT_LE(sum.utilisation, 1.0);
  EXPECT_GT(sum.compute_fraction, 0.0);
  EXPECT_LE(sum.compute_fraction, 1.0);
  if (!o.overlap) {
    // Without overlap the round boundary holds the loop for the whole push and pull.
    EXPECT_GE(sum.blocked_s, sum.push_s + sum.pull_s);
  }

  // The committed state: the start plus the replayed deltas (dense alone, lr 1, no momentum).
  auto pulled = server.WorkerClient()->Pull("j");
  ASSERT_TRUE(pulled.ok());
  EXPECT_EQ(pulled->rounds.committed_round, 5u);
  for (const auto& t : pulled->tensors) {
    size_t k = t.name == "h.0.w" ? 0 : 1;
    std::vector<float> want = start[k].data;
    for (int r = 1; r <= 5; ++r) {
      const auto& dt = deltas.rounds[static_cast<size_t>(r - 1) % 2][k].data;
      for (size_t i = 0; i < want.size(); ++i) want[i] += dt[i];
    }
    ASSERT_EQ(t.data.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_FLOAT_EQ(t.data[i], want[i]) << t.name << i;
    // The synthetic site merged the last round: its weights are the committed state.
    for (const auto& l : site->live()) {
      if (l.name == t.name) {
        EXPECT_EQ(l.data, t.data) << t.name;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Overlap, WanLoadReplay, ::testing::Range(0, 4), [](const auto& info) {
  return std::string(info.param & 1 ? "on" : "off") + (info.param & 2 ? "_replayed" : "");
});

TEST(WanLoad, DeltasThatDoNotMatchTheJobAreRefusedBeforeAnyPush) {
  TempDir d;
  auto deltas = Recording(d, 1);
  testing::ServerProcess server("[sync]\nsite = \"solo\"\n");
  ASSERT_TRUE(server.Start());
  std::vector<float> other(6, 0.0f);
  ASSERT_TRUE(server.AdminClient()->CreateJob("j", "", {{"h.0.w", {3, 2}, other.data()}}).ok());
  SiteOptions o;
  o.job = "j";
  auto site = SiteOn(server, o);
  Status s = site->Prepare(deltas);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("h.0.w"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace isthmus::wanload
