// Power losses during commits with a peer: two sites (one real shard each, CURVE peer
// links on loopback, the fault layer preloaded into both) run rounds while the test cuts
// the power of one site or the other at random moments (SIGKILL, then the data dir as a
// power loss leaves it: tests/fault/powerloss.h) and restarts it. Each site's pusher
// retries its round under the same key until the shard acknowledges it, as a worker does.
// Checked at the end: both sites committed every round, their digests agree round by
// round, and the committed tensors are the initial ones plus every round's token-weighted
// mean of both sites' deltas, each counted exactly once (dense codec, outer lr 1, no
// momentum: the element accounting is exact to float rounding).
//
// ISTHMUS_POWERLOSS_ROUNDS sets the rounds (default 12; the `long` campaign runs 300).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <thread>

#include "tests/fault/powerloss.h"
#include "tests/sync_net/site_process.h"

namespace isthmus {
namespace {

using testing::SiteProcess;
using namespace std::chrono_literals;

// ISTHMUS_POWERLOSS_ROWS=65536 makes "w" 1 MiB, so that its state, deltas and the
// checkpoint's state write (filled off the shard's event loop) go through slot files.
const int64_t kRows = [] {
  const char* rows = std::getenv("ISTHMUS_POWERLOSS_ROWS");
  return rows != nullptr ? std::max<int64_t>(8, std::atoll(rows)) : int64_t{8};
}();
constexpr int64_t kCols = 4;

std::vector<float> InitialValues(const std::string& name, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = 0.1f * std::cos(0.7f * i + (name == "w" ? 0.f : 2.f));
  return v;
}

// Site s's delta for round r, different per site, round and tensor.
std::vector<float> RoundDelta(int site, uint64_t round, const std::string& name, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = 0.02f * std::sin(0.3f * i + 1.1f * round + 5.0f * site + (name == "w" ? 0.f : 2.f));
  }
  return v;
}

uint64_t SiteTokens(int site) { return 500 * (site + 2); }

uint64_t CommittedRound(const SiteProcess& s) {
  auto d = s.AdminClient(1000, 0)->Digests("job", 0);
  return d.ok() ? d->committed_round : 0;
}

TEST(PowerLossTwoSites, CommitsSurvivePowerLossesWithIdenticalDigestsAndEveryRoundOnce) {
  if (fault::kSanitizedBuild) GTEST_SKIP() << fault::kSanitizedSkip;
  const char* env_rounds = std::getenv("ISTHMUS_POWERLOSS_ROUNDS");
  const uint64_t rounds = env_rounds ? std::max(3, std::atoi(env_rounds)) : 12;
  const auto root = std::filesystem::temp_directory_path() /
                    ("isthmus-powerloss-sites-" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  std::vector<std::unique_ptr<SiteProcess>> sites;
  sites.push_back(std::make_unique<SiteProcess>("alpha", root));
  sites.push_back(std::make_unique<SiteProcess>("beta", root));
  std::vector<SiteProcess*> all{sites[0].get(), sites[1].get()};
  auto data = [&](int i) { return sites[i]->dir() / "data"; };
  auto shadow = [&](int i) { return sites[i]->dir() / "shadow"; };
  for (int i = 0; i < 2; ++i) {
    sites[i]->Configure(all,
                        "codec = \"dense\"\nadaptive = false\nouter_lr = 1.0\n"
                        "outer_momentum = 0.0\nmax_rounds_ahead = 2\n");
    sites[i]->set_env(powerloss::PowerLossEnv(data(i), shadow(i)));
    ASSERT_TRUE(sites[i]->Start());
  }
  const auto w0 = InitialValues("w", kRows * kCols), b0 = InitialValues("b", kCols);
  for (auto& s : sites) {
    auto r = s->AdminClient()->CreateJob(
        "job", "base", {{"w", {kRows, kCols}, w0.data()}, {"b", {kCols}, b0.data()}});
    ASSERT_TRUE(r.ok()) << s->site() << ": " << r.status().ToString();
  }

  // One pusher per site: each round under its own key, retried until acknowledged.
  std::atomic<bool> abort{false};
  std::atomic<int> pushers_done{0};
  std::atomic<uint64_t> attempts{0};
  auto pusher = [&](int i) {
    std::mt19937 compute(17 + i);
    for (uint64_t r = 1; r <= rounds && !abort; ++r) {
      // The round's compute, so that power losses fall in the middle of the rounds.
      std::this_thread::sleep_for(std::chrono::milliseconds(100 + compute() % 100));
      auto w = RoundDelta(i, r, "w", kRows * kCols), b = RoundDelta(i, r, "b", kCols);
      const std::string key = sites[i]->site() + "-r" + std::to_string(r);
      for (;;) {
        if (abort) return;
        ++attempts;
        auto c = sites[i]->WorkerClient(2000, 0);
        if (c) {
          auto p = c->Push("job", key, r, SiteTokens(i),
                           {{"w", {kRows, kCols}, w.data()}, {"b", {kCols}, b.data()}});
          if (p.ok()) break;
        }
        std::this_thread::sleep_for(50ms);
      }
    }
    ++pushers_done;
  };
  std::thread pa(pusher, 0), pb(pusher, 1);

  // The nemesis: power losses at random moments until both pushers are through.
  std::mt19937 rng(99);
  int losses = 0, torn = 0;
  uint64_t lost_bytes = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60 + rounds * 3);
  while (pushers_done < 2) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100 + rng() % 300));
    if (pushers_done == 2) break;
    if (std::chrono::steady_clock::now() > deadline) {
      abort = true;
      break;
    }
    const int i = static_cast<int>(rng() % 2);
    const int status = sites[i]->Kill(SIGKILL);
    ASSERT_TRUE(WIFSIGNALED(status)) << sites[i]->site() << " had stopped: " << sites[i]->Log();
    std::mt19937* tear = rng() % 2 == 0 ? &rng : nullptr;
    powerloss::LossStats stats;
    ASSERT_EQ(powerloss::SimulatePowerLoss(data(i), shadow(i), tear, &stats), "");
    ++losses;
    torn += stats.torn;
    lost_bytes += stats.lost_bytes;
    ASSERT_TRUE(sites[i]->Start())
        << sites[i]->site() << " did not restart after power loss " << losses;
  }
  pa.join();
  pb.join();
  ASSERT_FALSE(abort) << "the rounds did not get through within the time limit; alpha:\n"
                      << sites[0]->Log() << "\nbeta:\n"
                      << sites[1]->Log();

  // Both sites commit every round...
  const auto end = std::chrono::steady_clock::now() + 60s * testing::TimeScale();
  for (auto& s : sites) {
    while (CommittedRound(*s) < rounds) {
      ASSERT_LT(std::chrono::steady_clock::now(), end)
          << s->site() << " did not commit round " << rounds << ": " << s->Log();
      std::this_thread::sleep_for(50ms);
    }
  }
  // ...with the same digest for every round both still hold...
  auto da = sites[0]->AdminClient()->Digests("job", 0);
  auto db = sites[1]->AdminClient()->Digests("job", 0);
  ASSERT_TRUE(da.ok() && db.ok());
  std::map<uint64_t, std::string> alpha_digests(da->digests.begin(), da->digests.end());
  int compared = 0;
  for (const auto& [round, digest] : db->digests) {
    if (auto it = alpha_digests.find(round); it != alpha_digests.end()) {
      EXPECT_EQ(it->second, digest) << "round " << round;
      ++compared;
    }
  }
  EXPECT_GT(compared, 0);
  EXPECT_TRUE(alpha_digests.count(rounds)) << "alpha holds no digest of the last round";
  // ...and the state counts every round's deltas exactly once.
  for (const std::string name : {"w", "b"}) {
    const size_t n = name == "w" ? kRows * kCols : kCols;
    const auto init = InitialValues(name, n);
    std::vector<double> want(init.begin(), init.end());
    const double total = static_cast<double>(SiteTokens(0) + SiteTokens(1));
    for (uint64_t r = 1; r <= rounds; ++r) {
      for (int s = 0; s < 2; ++s) {
        const auto d = RoundDelta(s, r, name, n);
        for (size_t k = 0; k < n; ++k) want[k] += SiteTokens(s) / total * d[k];
      }
    }
    for (auto& s : sites) {
      auto pulled = s->WorkerClient()->Pull("job", {name});
      ASSERT_TRUE(pulled.ok()) << pulled.status().ToString();
      const auto& got = pulled->tensors.at(0).data;
      ASSERT_EQ(got.size(), n);
      double worst = 0;
      for (size_t k = 0; k < n; ++k) worst = std::max(worst, std::abs(got[k] - want[k]));
      EXPECT_LT(worst, 1e-5) << s->site() << " tensor " << name << ": a round lost or doubled";
    }
  }
  std::printf(
      "%llu rounds, %d power losses (%d torn pages, %llu unsynced bytes lost), %llu push "
      "attempts, digests agree on %d rounds\n",
      static_cast<unsigned long long>(rounds), losses, torn,
      static_cast<unsigned long long>(lost_bytes), static_cast<unsigned long long>(attempts.load()),
      compared);
  if (!HasFailure()) std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace isthmus
