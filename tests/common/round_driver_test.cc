// The round driver (common/round_driver.h) against fake shards, in one process: a slow
// pull that arrives while the next round trains is merged with the local progress kept and
// the next delta is exactly that progress; without a step since the snapshot the pulled
// state is taken as it is; without overlap the round ends in the caller; the staleness
// bound counts the round in flight (K - 1 in the background; K = 0: the caller waits for
// the commit); a refused push surfaces with the round and keeps the delta; a stop ends a
// wait; Cancel gives a wait up; the other ranks' pushes are awaited before the pull; with
// follow_limit off the K set at start-up decides whether the end of a round waits. The
// fake shards block on latches, not on timing, so the tests hold on a loaded machine and
// under ThreadSanitizer; every wait is bounded.
#include "common/round_driver.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

namespace isthmus {
namespace {

using namespace std::chrono_literals;

// A site of one shard holding one tensor "w" of 4 values. A push adds the delta to theta
// (and, to stand for the other sites' deltas, `other`) and closes the round; rounds commit
// at once unless `hold_commits`.
class FakeShards : public RoundShards {
 public:
  explicit FakeShards(std::vector<float> theta) : theta_(std::move(theta)) {}

  Result<std::vector<ShardPush>> PushRound(uint64_t round, uint64_t tokens, uint64_t compute_ms,
                                           const std::vector<TensorView>& deltas, int rank,
                                           int world) override {
    std::lock_guard lk(mu_);
    if (!push_error_.ok()) return push_error_;
    EXPECT_EQ(deltas.size(), 1u);
    std::vector<float> d(deltas[0].data, deltas[0].data + theta_.size());
    pushed_.push_back(d);
    pushed_from_.push_back(deltas[0].data);
    for (size_t i = 0; i < theta_.size(); ++i) theta_[i] += d[i] + other_;
    local_ = round;
    if (!hold_commits_) committed_ = round;
    ShardPush p;
    p.shard = rank;
    p.key = "job/site/r" + std::to_string(round) + "/s0";
    p.tensors = 1;
    p.rounds = {local_, committed_, limit_};
    (void)tokens, (void)compute_ms, (void)world;
    return std::vector<ShardPush>{p};
  }
  Result<Staleness> CheckStaleness() override {
    std::lock_guard lk(mu_);
    ++checks_;
    if (commit_at_check_ > 0 && checks_ >= commit_at_check_) committed_ = local_;
    Staleness st;
    st.shard = 0;
    st.rounds_ahead = local_ - committed_;
    st.limit = limit_;
    st.too_far_ahead = st.rounds_ahead > limit_;
    st.lowest_local_round = other_ranks_behind_ ? local_ - 1 : local_;
    cv_.notify_all();
    return st;
  }
  Result<std::vector<Tensor>> Pull() override {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [this] { return !hold_pull_; });
    ++pulls_;
    return std::vector<Tensor>{{"w", {static_cast<int64_t>(theta_.size())}, theta_}};
  }
  void Recycle(std::vector<Tensor> pulled) override {
    std::lock_guard lk(mu_);
    recycled_ += pulled.size();
  }

  // Test controls.
  void HoldPull(bool hold) {
    std::lock_guard lk(mu_);
    hold_pull_ = hold;
    cv_.notify_all();
  }
  void CommitAll() {
    std::lock_guard lk(mu_);
    committed_ = local_;
  }
  template <typename F>
  void With(F f) {
    std::lock_guard lk(mu_);
    f();
  }
  // Waits (at most 20 s) until `pred` holds under the lock.
  template <typename P>
  bool Until(P pred) {
    std::unique_lock lk(mu_);
    return cv_.wait_for(lk, 20s, [&] { return pred(); });
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<float> theta_;  // GUARDED_BY(mu_), as everything below
  std::vector<std::vector<float>> pushed_;
  std::vector<const float*> pushed_from_;  // where each pushed delta lay
  size_t recycled_ = 0;                    // pulled tensors handed back (Recycle)
  float other_ = 0;
  uint64_t local_ = 0, committed_ = 0, limit_ = 2;
  bool hold_commits_ = false, hold_pull_ = false, other_ranks_behind_ = false;
  int checks_ = 0, pulls_ = 0, commit_at_check_ = 0;
  Status push_error_;
};

// Waits (bounded) until the driver's round in flight is done.
bool UntilReady(const RoundDriver& d) {
  for (int i = 0; i < 4000; ++i) {
    if (d.Ready()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return false;
}

struct Site {
  explicit Site(std::vector<float> live, bool overlap, uint64_t limit = 2, bool push = true)
      : w(std::move(live)), shards(w), params({{"w", {static_cast<int64_t>(w.size())}, w.data()}}) {
    RoundDriverOptions o;
    o.overlap = overlap;
    o.push = push;
    o.poll = 2ms;
    o.stopping = [this] { return stopping.load(); };
    shards.limit_ = limit;
    driver = std::make_unique<RoundDriver>(shards, &params, o);
    driver->set_limit(limit);
  }
  // One "optimizer step": every value moves by `by`.
  void Step(float by) {
    for (float& x : w) x += by;
    driver->Stepped();
  }
  std::vector<float> w;
  FakeShards shards;
  HostLiveParams params;
  std::atomic<bool> stopping{false};
  std::unique_ptr<RoundDriver> driver;
};

TEST(RoundDriver, ASlowPullIsMergedWithTheLocalProgressKept) {
  Site s({1, 2, 3, 4}, /*overlap=*/true);
  s.shards.With([&] { s.shards.other_ = 10; });  // the other sites' part of each round
  s.Step(1);
  s.shards.HoldPull(true);  // round 1's pull arrives late
  auto r = s.driver->EndRound(1, 100, 5);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->round, 0u);  // nothing was completed yet
  ASSERT_TRUE(s.driver->busy());
  // Round 2 trains while round 1 is in flight; its pull cannot arrive.
  s.Step(2);
  s.Step(3);
  ASSERT_TRUE(s.shards.Until([&] { return s.shards.local_ == 1; }));
  EXPECT_FALSE(s.driver->Ready());
  EXPECT_EQ(s.w, (std::vector<float>{7, 8, 9, 10}));
  s.shards.HoldPull(false);
  ASSERT_TRUE(UntilReady(*s.driver));
  s.shards.With([&] { EXPECT_EQ(s.shards.recycled_, 0u) << "handed back before the merge"; });
  auto done = s.driver->Complete();
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ(done->round, 1u);
  EXPECT_TRUE(done->merged);
  // Merged: the pulled state goes back for the next pull's buffers.
  s.shards.With([&] { EXPECT_EQ(s.shards.recycled_, 1u); });
  // The base was {2,3,4,5} (after round 1); the site's state is {1,2,3,4} + 1 + 10: the
  // live weights are that state plus the 5 of local progress made meanwhile.
  EXPECT_EQ(s.w, (std::vector<float>{17, 18, 19, 20}));
  s.Step(4);
  ASSERT_TRUE(s.driver->EndRound(2, 100, 5).ok());
  ASSERT_TRUE(UntilReady(*s.driver));
  ASSERT_TRUE(s.driver->Complete().ok());
  s.shards.With([&] {
    ASSERT_EQ(s.shards.pushed_.size(), 2u);
    EXPECT_EQ(s.shards.pushed_[0], (std::vector<float>(4, 1.0f)));
    // Round 2's delta is exactly its local progress (2 + 3 + 4): nothing counted twice
    // (the merged state is not in it) and nothing lost (the steps before the merge are).
    EXPECT_EQ(s.shards.pushed_[1], (std::vector<float>(4, 9.0f)));
    // The shards hold the start plus both deltas plus the other sites' parts; with no step
    // since, the live weights are exactly that.
    EXPECT_EQ(s.shards.theta_, (std::vector<float>{31, 32, 33, 34}));
    EXPECT_EQ(s.w, s.shards.theta_);
  });
}

TEST(RoundDriver, WithoutAStepSinceTheSnapshotThePulledStateIsTakenExactly) {
  // live + (P - base) would round differently here: 1e8 + (3 - 1e8) is 4 in fp32.
  Site s({1e8f}, /*overlap=*/true);
  s.shards.With([&] { s.shards.theta_ = {1e8f}; });
  s.shards.HoldPull(true);
  ASSERT_TRUE(s.driver->EndRound(1, 1, 1).ok());
  ASSERT_TRUE(s.shards.Until([&] { return s.shards.local_ == 1; }));
  s.shards.With([&] { s.shards.theta_ = {3.0f}; });  // what the site committed meanwhile
  s.shards.HoldPull(false);
  auto done = s.driver->Complete();
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ(s.w[0], 3.0f);
}

TEST(RoundDriver, WithoutOverlapTheRoundEndsInTheCaller) {
  Site s({1, 2, 3, 4}, /*overlap=*/false);
  s.shards.With([&] { s.shards.other_ = 10; });
  s.Step(1);
  auto r = s.driver->EndRound(1, 100, 5);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->round, 1u);
  EXPECT_TRUE(r->merged);
  EXPECT_TRUE(r->pushed);
  EXPECT_FALSE(s.driver->busy());
  // The caller was blocked from the hand-over on: the whole push, wait and pull.
  EXPECT_GE(r->blocked_s, r->push_s + r->wait_s + r->pull_s);
  s.shards.With([&] { EXPECT_EQ(s.shards.pulls_, 1); });
  EXPECT_EQ(s.w, (std::vector<float>{12, 13, 14, 15}));
}

TEST(RoundDriver, TheBackgroundRoundComesWithinKMinusOneCountingTheRoundBeingTrained) {
  // K = 1 with overlap: round 1 in flight must commit (0 ahead) before its pull, since the
  // rank already trains round 2.
  Site s({0, 0, 0, 0}, /*overlap=*/true, /*limit=*/1);
  s.shards.With([&] { s.shards.hold_commits_ = true; });
  s.Step(1);
  ASSERT_TRUE(s.driver->EndRound(1, 1, 1).ok());
  ASSERT_TRUE(s.shards.Until([&] { return s.shards.checks_ >= 5; }));
  EXPECT_FALSE(s.driver->Ready());
  s.shards.With([&] { EXPECT_EQ(s.shards.pulls_, 0); });
  s.shards.CommitAll();
  ASSERT_TRUE(UntilReady(*s.driver));
  auto done = s.driver->Complete();
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_TRUE(done->waited);
  EXPECT_GT(done->wait_s, 0.0);

  // Without overlap the same K lets the round be 1 ahead: no wait.
  Site serial({0, 0, 0, 0}, /*overlap=*/false, /*limit=*/1);
  serial.shards.With([&] { serial.shards.hold_commits_ = true; });
  serial.Step(1);
  auto r = serial.driver->EndRound(1, 1, 1);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->waited);
  serial.shards.With([&] { EXPECT_EQ(serial.shards.committed_, 0u); });
}

TEST(RoundDriver, WithKZeroEndRoundReturnsOnlyOnceTheRoundCommitted) {
  Site s({0, 0, 0, 0}, /*overlap=*/true, /*limit=*/0);
  s.shards.With([&] {
    s.shards.hold_commits_ = true;
    s.shards.commit_at_check_ = 4;  // the WAN delivers on the fourth look
  });
  s.Step(1);
  auto r = s.driver->EndRound(1, 1, 1);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  s.shards.With([&] {
    EXPECT_EQ(s.shards.committed_, 1u);
    EXPECT_GE(s.shards.checks_, 4);
  });
  ASSERT_TRUE(UntilReady(*s.driver));
  ASSERT_TRUE(s.driver->Complete().ok());
}

TEST(RoundDriver, ARefusedPushSurfacesNamingTheRoundAndKeepsTheDelta) {
  Site s({1, 2, 3, 4}, /*overlap=*/true);
  s.shards.With(
      [&] { s.shards.push_error_ = Status::FailedPrecondition("this site is leaving job 'j'"); });
  s.Step(1);
  ASSERT_TRUE(s.driver->EndRound(1, 1, 1).ok());
  s.Step(1);
  ASSERT_TRUE(UntilReady(*s.driver));
  EXPECT_TRUE(s.driver->Failed());
  auto done = s.driver->Complete();
  ASSERT_FALSE(done.ok());
  EXPECT_EQ(done.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(done.status().message().find("leaving"), std::string::npos);
  ASSERT_TRUE(s.driver->failed().has_value());
  EXPECT_EQ(s.driver->failed()->round, 1u);
  EXPECT_EQ((*s.driver->failed()->delta)[0].data, (std::vector<float>(4, 1.0f)));
  EXPECT_EQ(s.w, (std::vector<float>{3, 4, 5, 6}));  // nothing merged

  Site serial({1, 2, 3, 4}, /*overlap=*/false);
  serial.shards.With([&] { serial.shards.push_error_ = Status::FailedPrecondition("no"); });
  serial.Step(1);
  EXPECT_EQ(serial.driver->EndRound(1, 1, 1).status().code(), Code::kFailedPrecondition);
  EXPECT_TRUE(serial.driver->failed().has_value());
}

TEST(RoundDriver, AStopEndsTheWaitForTheWanButThePullStillHappens) {
  Site s({0, 0, 0, 0}, /*overlap=*/true, /*limit=*/1);
  s.shards.With([&] { s.shards.hold_commits_ = true; });
  s.Step(1);
  ASSERT_TRUE(s.driver->EndRound(1, 1, 1).ok());
  ASSERT_TRUE(s.shards.Until([&] { return s.shards.checks_ >= 2; }));
  s.stopping = true;
  auto done = s.driver->Complete();
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_TRUE(done->merged);
  s.shards.With([&] {
    EXPECT_EQ(s.shards.pulls_, 1);
    EXPECT_EQ(s.shards.committed_, 0u);
  });
}

TEST(RoundDriver, CancelGivesTheWaitUpWithAnError) {
  Site s({0, 0, 0, 0}, /*overlap=*/true, /*limit=*/1);
  s.shards.With([&] { s.shards.hold_commits_ = true; });
  s.Step(1);
  ASSERT_TRUE(s.driver->EndRound(1, 1, 1).ok());
  ASSERT_TRUE(s.shards.Until([&] { return s.shards.checks_ >= 2; }));
  s.driver->Cancel();
  auto done = s.driver->Complete();
  EXPECT_EQ(done.status().code(), Code::kUnavailable);
  EXPECT_NE(done.status().message().find("round 1"), std::string::npos);
  EXPECT_FALSE(s.driver->failed().has_value());  // it was pushed: nothing to push again
}

TEST(RoundDriver, TheOtherRanksPushesAreAwaitedBeforeThePull) {
  Site s({0, 0, 0, 0}, /*overlap=*/true);
  s.shards.With([&] { s.shards.other_ranks_behind_ = true; });
  s.Step(1);
  ASSERT_TRUE(s.driver->EndRound(1, 1, 1).ok());
  ASSERT_TRUE(s.shards.Until([&] { return s.shards.checks_ >= 4; }));
  EXPECT_FALSE(s.driver->Ready());
  s.shards.With([&] { s.shards.other_ranks_behind_ = false; });
  ASSERT_TRUE(UntilReady(*s.driver));
  ASSERT_TRUE(s.driver->Complete().ok());
}

// RoundDriverOptions::push = false (isthmus-worker --encode-deltas on a rank other than 0,
// whose rank 0 pushes every shard): the round is taken and reported pushed, nothing is
// sent, and the rest of the round (here the wait for rank 0's push, then the pull) goes on.
TEST(RoundDriver, ARankThatDoesNotPushSendsNothing) {
  Site s({1, 2, 3, 4}, /*overlap=*/true, /*limit=*/2, /*push=*/false);
  s.Step(1);
  ASSERT_TRUE(s.driver->EndRound(1, 100, 5).ok());
  // Nothing of this rank's reaches the shards: the round waits for rank 0's push.
  ASSERT_TRUE(s.shards.Until([&] { return s.shards.checks_ >= 2; }));
  s.shards.With([&] { EXPECT_TRUE(s.shards.pushed_.empty()); });
  EXPECT_FALSE(s.driver->Ready());
  std::vector<float> d = {1, 1, 1, 1};
  ASSERT_TRUE(s.shards.PushRound(1, 100, 5, {{"w", {4}, d.data()}}, 0, 1).ok());  // rank 0's
  ASSERT_TRUE(UntilReady(*s.driver));
  auto r = s.driver->Complete();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->pushed);
  EXPECT_TRUE(r->pushes.empty());
  s.shards.With([&] {
    EXPECT_EQ(s.shards.pushed_.size(), 1u);
    EXPECT_EQ(s.shards.pulls_, 1);
  });
}

TEST(RoundDriver, TheCallersAwaitIsUsedAndOneRoundIsInFlightAtATime) {
  std::vector<float> w = {0, 0};
  FakeShards shards(w);
  HostLiveParams params({{"w", {2}, w.data()}});
  int awaited = 0;
  std::string said;
  RoundDriverOptions o;
  o.overlap = true;
  o.poll = 2ms;
  o.await = [&](const std::function<bool()>& done) {
    ++awaited;
    for (int i = 0; i < 4000 && !done(); ++i) std::this_thread::sleep_for(5ms);
    return done() ? Status::Ok() : Status::Timeout("never done");
  };
  o.on_wan_wait = [&](const std::string& reason, double) { said = reason; };
  RoundDriver d(shards, &params, o);
  d.set_limit(1);
  shards.With([&] {
    shards.limit_ = 1;
    shards.commit_at_check_ = 6;
    shards.hold_commits_ = true;
  });
  w[0] = 1;
  d.Stepped();
  ASSERT_TRUE(d.EndRound(1, 1, 1).ok());
  EXPECT_EQ(d.Start({2, 1, 1, std::make_shared<const std::vector<Tensor>>(), nullptr}).code(),
            Code::kFailedPrecondition);
  auto done = d.Complete();
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ(awaited, 1);
  EXPECT_NE(said.find("limit 1"), std::string::npos) << said;
}

// isthmus-worker's ranks wait for the commit together (K = 0 makes the end of a round a
// collective wait), so each must decide it from the same K: with follow_limit off, limit()
// stays as set at start-up even when the shards report another K, and EndRound keeps
// waiting through `await`; with it on, limit() follows the shards.
TEST(RoundDriver, WithoutFollowLimitTheKSetAtStartUpDecidesWhetherEndRoundWaits) {
  for (const bool follow : {true, false}) {
    SCOPED_TRACE(follow ? "follow_limit on" : "follow_limit off");
    std::vector<float> w = {0, 0};
    FakeShards shards(w);
    HostLiveParams params({{"w", {2}, w.data()}});
    int awaited = 0;
    RoundDriverOptions o;
    o.overlap = true;
    o.poll = 2ms;
    o.follow_limit = follow;
    o.await = [&](const std::function<bool()>& done) {
      ++awaited;
      for (int i = 0; i < 4000 && !done(); ++i) std::this_thread::sleep_for(5ms);
      return done() ? Status::Ok() : Status::Timeout("never done");
    };
    RoundDriver d(shards, &params, o);
    d.set_limit(0);                           // K as the shards said at start-up
    shards.With([&] { shards.limit_ = 2; });  // what they report from now on
    w[0] = 1;
    d.Stepped();
    ASSERT_TRUE(d.EndRound(1, 1, 1).ok());
    EXPECT_EQ(awaited, 1);  // K = 0: the end of round 1 waited for its commit
    auto done = d.Complete();
    ASSERT_TRUE(done.ok()) << done.status().ToString();
    EXPECT_EQ(done->staleness.limit, 2u);
    EXPECT_EQ(d.limit(), follow ? 2u : 0u);
    const int before = awaited;
    w[0] = 2;
    d.Stepped();
    ASSERT_TRUE(d.EndRound(2, 1, 1).ok());
    EXPECT_EQ(awaited - before, follow ? 0 : 1);
    ASSERT_TRUE(d.Complete().ok());
  }
}

// A completed round's delta goes back to the LiveParams (Recycle) when nothing else holds it,
// and the next round's delta is taken into its buffers, with the right values (what lay
// there before does not leak in); one that something still holds (a checkpoint's copy, a
// round to retry) is left alone.
TEST(RoundDriver, ACompletedRoundsDeltaBuffersAreReusedOnlyWhenNothingElseHoldsThem) {
  Site s({1, 2, 3, 4}, /*overlap=*/true);
  s.Step(1);
  ASSERT_TRUE(s.driver->EndRound(1, 100, 5).ok());
  s.Step(2);
  ASSERT_TRUE(UntilReady(*s.driver));
  ASSERT_TRUE(s.driver->EndRound(2, 100, 5).ok());  // completes round 1, then takes round 2
  std::shared_ptr<const std::vector<Tensor>> kept;
  s.Step(3);
  ASSERT_TRUE(UntilReady(*s.driver));
  ASSERT_TRUE(s.driver
                  ->EndRound(3, 100, 5,
                             [&](RoundInFlight& in) {
                               kept = in.delta;  // as a checkpoint that holds the round would
                               return Status::Ok();
                             })
                  .ok());
  s.Step(4);
  ASSERT_TRUE(UntilReady(*s.driver));
  ASSERT_TRUE(s.driver->EndRound(4, 100, 5).ok());
  ASSERT_TRUE(UntilReady(*s.driver));
  ASSERT_TRUE(s.driver->Complete().ok());
  s.shards.With([&] {
    ASSERT_EQ(s.shards.pushed_.size(), 4u);
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(s.shards.pushed_[r], std::vector<float>(4, static_cast<float>(r + 1))) << r;
    }
    // Round 2 took round 1's buffer, round 3 round 2's; round 3's was held when round 4
    // was taken, so round 4 lies elsewhere.
    EXPECT_EQ(s.shards.pushed_from_[1], s.shards.pushed_from_[0]);
    EXPECT_EQ(s.shards.pushed_from_[2], s.shards.pushed_from_[1]);
    EXPECT_NE(s.shards.pushed_from_[3], s.shards.pushed_from_[2]);
  });
  ASSERT_TRUE(kept);
  EXPECT_EQ((*kept)[0].data, std::vector<float>(4, 3.0f));  // untouched by round 4
}

TEST(HostLiveParams, TheDeltaIsWhatAShardAddingItToTheBaseHolds) {
  // 0.1 + (x - 0.1) is not always x in fp32: after TakeDelta, live is base + delta.
  std::vector<float> w = {0.1f, 1e-8f, 3.0f};
  HostLiveParams p({{"w", {3}, w.data()}});
  const std::vector<float> base = w, now = {0.3f, 1.0f, -7.25f};
  w = now;
  auto d = p.TakeDelta();
  ASSERT_TRUE(d.ok());
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ((*d)[0].data[i], now[i] - base[i]);
    EXPECT_EQ(w[i], base[i] + (*d)[0].data[i]);
  }
  // A second TakeDelta without a change is all zeros.
  auto again = p.TakeDelta();
  ASSERT_TRUE(again.ok());
  for (float x : (*again)[0].data) EXPECT_EQ(x, 0.0f);
  // A pulled state missing the tensor changes nothing.
  std::vector<Tensor> wrong = {{"v", {3}, {1, 2, 3}}};
  const auto before = w;
  EXPECT_EQ(p.Rebase(&wrong, true).code(), Code::kInvalidArgument);
  EXPECT_EQ(w, before);
}

// The passes over whole tensors (streamed four values at a time where the buffers allow)
// give the scalar loop's values bit for bit: deltas whose base + (x - base) is not x, -0 and
// +0, tensors whose length is no multiple of four, a merge with and without local progress,
// by Rebase (rounds 0-1) and by RebaseTaking, which takes the pulled buffer as its base
// (rounds 2-3: the next round's delta checks that base). The same with the values cut into
// chunks shared out among threads (HostPasses): two tensors in pieces of 256 values (each
// tensor's last piece shorter) on three threads, and pieces of 6 values, whose starts are
// not all aligned for the streamed stores, on two.
TEST(HostLiveParams, TheStreamedPassesAreTheScalarArithmeticBitForBit) {
  for (const HostPasses passes :
       {HostPasses{1, size_t{1} << 20}, HostPasses{3, 256}, HostPasses{2, 6}}) {
    SCOPED_TRACE("threads " + std::to_string(passes.threads) + ", chunk " +
                 std::to_string(passes.chunk));
    const std::vector<size_t> sizes = {1003, 517};
    std::vector<std::vector<float>> w(sizes.size());
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<LiveTensor> views;
    for (size_t t = 0; t < sizes.size(); ++t) {
      w[t].resize(sizes[t]);
      for (auto& x : w[t]) x = nd(rng);
      w[t][5] = 0.0f;
      w[t][6] = -0.0f;
      views.push_back({"w" + std::to_string(t), {static_cast<int64_t>(sizes[t])}, w[t].data()});
    }
    HostLiveParams p(views, passes);
    std::vector<std::vector<float>> base = w;
    auto bits = [](float f) {
      uint32_t u;
      std::memcpy(&u, &f, 4);
      return u;
    };
    for (int round = 0; round < 5; ++round) {
      std::vector<std::vector<float>> want_d(sizes.size());
      for (size_t t = 0; t < sizes.size(); ++t) {
        const size_t n = sizes[t];
        for (size_t i = 0; i < n; ++i) w[t][i] += nd(rng) * (i % 3 == 0 ? 1e-7f : 0.3f);
        w[t][6] = round == 1 ? 0.0f : -0.0f;  // -0 against a base of +0 and back
        // The scalar reference of TakeDelta.
        want_d[t].resize(n);
        for (size_t i = 0; i < n; ++i) {
          want_d[t][i] = w[t][i] - base[t][i];
          base[t][i] = base[t][i] + want_d[t][i];  // the live value afterwards, and the base
        }
      }
      auto d = p.TakeDelta();
      ASSERT_TRUE(d.ok());
      ASSERT_EQ(d->size(), sizes.size());
      for (size_t t = 0; t < sizes.size(); ++t) {
        for (size_t i = 0; i < sizes[t]; ++i) {
          ASSERT_EQ(bits((*d)[t].data[i]), bits(want_d[t][i]))
              << "round " << round << " tensor " << t << " delta " << i;
          ASSERT_EQ(bits(w[t][i]), bits(base[t][i]))
              << "round " << round << " tensor " << t << " live " << i;
        }
      }
      // Local progress, then a pulled state merged with it (and, every other round, without).
      const bool progressed = round % 2 == 0;
      std::vector<Tensor> pulled;
      std::vector<std::vector<float>> want(sizes.size());
      for (size_t t = 0; t < sizes.size(); ++t) {
        const size_t n = sizes[t];
        for (size_t i = 0; i < n; ++i) w[t][i] += nd(rng) * 0.01f;
        Tensor pt{"w" + std::to_string(t), {static_cast<int64_t>(n)}, std::vector<float>(n)};
        for (size_t i = 0; i < n; ++i) pt.data[i] = base[t][i] + nd(rng) * 0.05f;
        pt.data[7] = -0.0f;
        want[t].resize(n);
        for (size_t i = 0; i < n; ++i) {
          want[t][i] = progressed ? w[t][i] + (pt.data[i] - base[t][i]) : pt.data[i];
        }
        base[t] = pt.data;
        pulled.push_back(std::move(pt));
      }
      // In the other order than the live tensors: merged by name.
      std::reverse(pulled.begin(), pulled.end());
      std::vector<const float*> handed;
      for (const auto& pt : pulled) handed.push_back(pt.data.data());
      if (round < 2) {
        ASSERT_TRUE(p.Rebase(&pulled, progressed).ok());
        for (size_t k = 0; k < pulled.size(); ++k) {
          EXPECT_EQ(pulled[k].data, base[pulled.size() - 1 - k]);  // only read
        }
      } else {
        ASSERT_TRUE(p.RebaseTaking(&pulled, progressed).ok());
        // A buffer of the same size came back in exchange, not the one handed over.
        for (size_t k = 0; k < pulled.size(); ++k) {
          EXPECT_EQ(pulled[k].data.size(), sizes[pulled.size() - 1 - k]);
          EXPECT_NE(pulled[k].data.data(), handed[k]);
        }
      }
      for (size_t t = 0; t < sizes.size(); ++t) {
        for (size_t i = 0; i < sizes[t]; ++i) {
          ASSERT_EQ(bits(w[t][i]), bits(want[t][i]))
              << "round " << round << " tensor " << t << " merged " << i;
        }
      }
      p.Recycle(std::move(*d));
    }
  }
}

}  // namespace
}  // namespace isthmus
