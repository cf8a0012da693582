// isthmusctl top's pure parts on made-up samples: rates between two samples (none on the
// first, none across a restart), the JSON object of a refresh, and the text view's width; a
// removed peer shown as removed (not down), how long each link has been silent, and jobs
// whose workers wait for the WAN.
#include <gtest/gtest.h>

#include "server/ctl/top.h"

namespace isthmus::ctl {
namespace {

ShardSample Up(const std::string& id, uint64_t uptime, uint64_t pushes, uint64_t sent,
               uint64_t received, double at) {
  ShardSample s;
  s.endpoint = "tcp://127.0.0.1:7101";
  s.at_s = at;
  ShardStats st;
  st.shard_id = id;
  st.uptime_s = uptime;
  JobInfo j;
  j.job = "job";
  j.pushes = pushes;
  st.jobs.push_back(j);
  s.stats = st;
  SyncStatusInfo sync;
  sync.site = "alpha";
  sync.enabled = true;
  PeerLinkReport l;
  l.site = "beta";
  l.connected = true;
  l.wire_bytes_sent = sent;
  l.wire_bytes_received = received;
  l.jobs.push_back({"job", 3, 4, 1});
  sync.links.push_back(l);
  SyncJobReport r;
  r.job = "job";
  r.local_round = 4;
  r.committed_round = 3;
  r.members = {"alpha", "beta"};
  r.pipelines = {{"int8+zstd", 6}, {"dense", 2}};
  sync.jobs.push_back(r);
  s.sync = sync;
  return s;
}

TEST(TopRates, FromTheDifferenceWithThePreviousSample) {
  const ShardSample a = Up("alpha-0", 100, 10, 1000, 500, 50.0);
  const ShardSample b = Up("alpha-0", 102, 14, 5000, 900, 52.0);
  const ShardRates first = RatesOf(a, nullptr);
  EXPECT_FALSE(first.pushes_per_s.has_value());
  ASSERT_TRUE(first.links.count("beta"));
  EXPECT_FALSE(first.links.at("beta").sent_per_s.has_value());
  const ShardRates r = RatesOf(b, &a);
  ASSERT_TRUE(r.pushes_per_s.has_value());
  EXPECT_DOUBLE_EQ(*r.pushes_per_s, 2.0);
  EXPECT_DOUBLE_EQ(*r.job_pushes.at("job"), 2.0);
  EXPECT_DOUBLE_EQ(*r.links.at("beta").sent_per_s, 2000.0);
  EXPECT_DOUBLE_EQ(*r.links.at("beta").received_per_s, 200.0);
}

TEST(TopRates, NoneAcrossARestartOrAnotherShard) {
  const ShardSample a = Up("alpha-0", 100, 10, 1000, 500, 50.0);
  // Restarted: uptime went down, the link counters began again; pushes are persistent.
  const ShardSample restarted = Up("alpha-0", 1, 12, 100, 50, 52.0);
  const ShardRates r = RatesOf(restarted, &a);
  EXPECT_FALSE(r.links.at("beta").sent_per_s.has_value());
  EXPECT_FALSE(r.links.at("beta").received_per_s.has_value());
  ASSERT_TRUE(r.pushes_per_s.has_value());
  EXPECT_DOUBLE_EQ(*r.pushes_per_s, 1.0);
  // A snapshot restore took the push counter back.
  const ShardSample restored = Up("alpha-0", 103, 3, 1100, 600, 53.0);
  EXPECT_FALSE(RatesOf(restored, &a).pushes_per_s.has_value());
  // Another shard behind the endpoint.
  const ShardSample other = Up("alpha-1", 200, 20, 2000, 900, 52.0);
  EXPECT_FALSE(RatesOf(other, &a).pushes_per_s.has_value());
}

TEST(TopJson, OneObjectPerRefreshWithTheDocumentedFields) {
  TopSample first, second;
  first.unix_time = 1000.0;
  second.unix_time = 1002.0;
  first.shards = {Up("alpha-0", 100, 10, 1000, 500, 50.0), {}};
  second.shards = {Up("alpha-0", 102, 14, 5000, 900, 52.0), {}};
  for (auto* t : {&first, &second}) {
    t->shards[1].endpoint = "tcp://127.0.0.1:7111";
    t->shards[1].status = Status::Timeout("no reply");
  }
  const auto j = TopJson(second, &first, 2.0);
  EXPECT_DOUBLE_EQ(j["time"].get<double>(), 1002.0);
  EXPECT_DOUBLE_EQ(j["interval_s"].get<double>(), 2.0);
  ASSERT_EQ(j["shards"].size(), 2u);
  const auto& up = j["shards"][0];
  EXPECT_EQ(up["shard"], 0);
  EXPECT_TRUE(up["reachable"].get<bool>());
  EXPECT_FALSE(up.contains("error"));
  EXPECT_EQ(up["stats"], StatsJson(*second.shards[0].stats));
  EXPECT_EQ(up["sync"], SyncStatusJson(*second.shards[0].sync));
  EXPECT_DOUBLE_EQ(up["rates"]["pushes_per_s"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(up["rates"]["links"]["beta"]["wire_sent_bytes_per_s"].get<double>(), 2000.0);
  EXPECT_DOUBLE_EQ(up["rates"]["links"]["beta"]["wire_received_bytes_per_s"].get<double>(), 200.0);
  const auto& down = j["shards"][1];
  EXPECT_FALSE(down["reachable"].get<bool>());
  EXPECT_NE(down["error"].get<std::string>().find("no reply"), std::string::npos);
  EXPECT_TRUE(down["stats"].is_null());
  EXPECT_TRUE(down["rates"]["pushes_per_s"].is_null());
  EXPECT_TRUE(TopJson(first, nullptr, 2.0)["shards"][0]["rates"]["pushes_per_s"].is_null());
}

TEST(TopText, ShardsJobsLinksAndDownWithin120Columns) {
  TopSample first, second;
  first.unix_time = 1000.0;
  second.unix_time = 1002.0;
  ShardSample a = Up("alpha-0", 100, 10, 1000, 500, 50.0);
  ShardSample b = Up("alpha-0", 3700, 14, 5000, 900, 52.0);
  // Long names and many pipelines must not push lines past 120 columns.
  b.sync->jobs[0].members = {"a-very-long-site-name", "another-very-long-site-name"};
  for (int i = 0; i < 20; ++i) b.sync->jobs[0].pipelines["topk:0.0" + std::to_string(i)] = i;
  b.sync->links[0].last_error = "refused a message from the peer: " + std::string(300, 'x');
  ShardSample down;
  down.endpoint = "tcp://127.0.0.1:7111";
  down.status = Status::Timeout(
      "no reply from tcp://127.0.0.1:7111 after 1 attempt(s) of 2000 ms: is isthmus-server "
      "running there, and is the server key right? (the end of a long error stays)");
  first.shards = {a, down};
  second.shards = {b, down};
  const auto lines = TopText(second, &first, 2.0);
  std::string all;
  for (const auto& l : lines) {
    EXPECT_LE(l.size(), 120u) << l;
    all += l + "\n";
  }
  EXPECT_EQ(lines[0].rfind("=== ", 0), 0u) << lines[0];
  EXPECT_NE(lines[0].find("1 of 2 shards up"), std::string::npos) << lines[0];
  EXPECT_NE(all.find("shard 0  alpha-0  up"), std::string::npos) << all;
  EXPECT_NE(all.find("uptime 1h01m"), std::string::npos) << all;
  EXPECT_NE(all.find("shard 1  DOWN  tcp://127.0.0.1:7111  Timeout"), std::string::npos) << all;
  const size_t tail = all.find("the server key right? (the end of a long error stays)\n");
  ASSERT_NE(tail, std::string::npos) << "a DOWN shard's error wraps, nothing cut\n" << all;
  EXPECT_EQ(all.substr(all.rfind('\n', tail) + 1, 4), "    ") << all;
  EXPECT_NE(all.find("2.00"), std::string::npos) << "pushes/s\n" << all;
  EXPECT_NE(all.find("2.0 KiB/s"), std::string::npos) << "wire sent/s\n" << all;
  EXPECT_NE(all.find("beta         connected"), std::string::npos) << all;
  EXPECT_NE(all.find("\n  beta last error: refused a message from the peer:\n    xxx"),
            std::string::npos)
      << "indented under its link, the long word on a line of its own\n"
      << all;
  // The first view has no rates yet.
  const auto before = TopText(first, nullptr, 2.0);
  std::string first_text;
  for (const auto& l : before) first_text += l + "\n";
  EXPECT_EQ(first_text.find("KiB/s"), std::string::npos) << first_text;
  EXPECT_NE(first_text.find("int8+zstd 6"), std::string::npos) << first_text;
}

// A refused request and round work that failed after a push show under their shard and job,
// in the text view and in the JSON object; neither shows once there is none.
TEST(TopText, TheLastRefusedRequestAndFailingRoundWorkShow) {
  TopSample now;
  now.unix_time = 1000.0;
  now.shards = {Up("alpha-0", 100, 10, 1000, 500, 50.0)};
  ShardSample& s = now.shards[0];
  s.stats->last_error = "push from worker socket: InvalidArgument: tensor 'w' has 6 values, not 4";
  s.stats->last_error_age_s = 75;
  s.sync->jobs[0].round_work_pending = true;
  s.sync->jobs[0].round_work_failures = 3;
  s.sync->jobs[0].round_work_error = "IOError: No space left on device";
  std::string all;
  for (const auto& l : TopText(now, nullptr, 2.0)) all += l + "\n";
  EXPECT_NE(all.find("\n  last refused request (1m15s ago): push from worker socket: "
                     "InvalidArgument: tensor 'w' has 6 values, not 4\n"),
            std::string::npos)
      << all;
  EXPECT_NE(all.find("\n  job: round work after a push failed 3 times, retrying: IOError: No "
                     "space left on device\n"),
            std::string::npos)
      << all;
  const auto j = TopJson(now, nullptr, 2.0)["shards"][0];
  EXPECT_EQ(j["stats"]["last_error"], s.stats->last_error);
  EXPECT_EQ(j["stats"]["last_error_age_s"], 75);
  EXPECT_EQ(j["sync"]["jobs"][0]["round_work_failures"], 3);
  EXPECT_EQ(j["sync"]["jobs"][0]["round_work_pending"], true);
  EXPECT_EQ(j["sync"]["jobs"][0]["round_work_error"], "IOError: No space left on device");

  s.stats->last_error.clear();
  s.sync->jobs[0].round_work_pending = false;
  s.sync->jobs[0].round_work_error.clear();
  all.clear();
  for (const auto& l : TopText(now, nullptr, 2.0)) all += l + "\n";
  EXPECT_EQ(all.find("last refused"), std::string::npos) << all;
  EXPECT_EQ(all.find("round work"), std::string::npos) << all;
  EXPECT_TRUE(TopJson(now, nullptr, 2.0)["shards"][0]["stats"]["last_error"].is_null());
}

// alpha-0 syncs "job" with beta; gamma was removed from round 3 but stays in sync.peers, its
// link down. The site is 3 rounds ahead of its last commit with a limit of 2.
ShardSample WithRemovedPeer() {
  ShardSample s = Up("alpha-0", 100, 10, 1000, 500, 50.0);
  s.sync->links[0].silent_seconds = 3.4;
  PeerLinkReport gamma;
  gamma.site = "gamma";
  gamma.connected = false;
  gamma.silent_seconds = 125.7;
  gamma.jobs.push_back({"job", 2, 6, 4});
  s.sync->links.push_back(gamma);
  SyncJobReport& j = s.sync->jobs[0];
  j.local_round = 6;
  j.committed_round = 3;
  j.max_rounds_ahead = 2;
  j.epoch = 1;
  j.members_from = 3;
  j.removed = {{"gamma", 3}};
  return s;
}

TEST(TopText, RemovedPeerIsNotDownLinksSayHowLongTheyWereSilentAndWaitingJobsShow) {
  TopSample now;
  now.unix_time = 1000.0;
  now.shards = {WithRemovedPeer()};
  const auto lines = TopText(now, nullptr, 2.0);
  std::string all;
  for (const auto& l : lines) {
    EXPECT_LE(l.size(), 120u) << l;
    all += l + "\n";
  }
  EXPECT_NE(all.find("\n  gamma        removed (round 3), silent 2m05s"), std::string::npos) << all;
  for (const auto& l : lines) {
    if (l.rfind("  gamma ", 0) == 0) {
      EXPECT_EQ(l.find(" down "), std::string::npos) << l;
    }
  }
  EXPECT_NE(all.find("SILENT"), std::string::npos) << all;
  EXPECT_NE(all.find("  beta         connected     3s job"), std::string::npos) << all;
  EXPECT_NE(all.find(" 3/2 WAIT "), std::string::npos) << "workers wait for the WAN\n" << all;

  // One round less ahead: within the limit, no wait.
  now.shards[0].sync->jobs[0].local_round = 5;
  std::string within;
  for (const auto& l : TopText(now, nullptr, 2.0)) within += l + "\n";
  EXPECT_NE(within.find(" 2/2 "), std::string::npos) << within;
  EXPECT_EQ(within.find("WAIT"), std::string::npos) << within;
}

TEST(TopJson, LinksCarrySilenceAndRemovalJobsWhetherWorkersWait) {
  const ShardSample s = WithRemovedPeer();
  const auto j = SyncStatusJson(*s.sync);
  ASSERT_EQ(j["links"].size(), 2u);
  EXPECT_DOUBLE_EQ(j["links"][0]["silent_s"].get<double>(), 3.4);
  EXPECT_TRUE(j["links"][0]["removed_from_round"].is_null());
  EXPECT_EQ(j["links"][1]["site"], "gamma");
  EXPECT_EQ(j["links"][1]["removed_from_round"], 3);
  EXPECT_TRUE(j["jobs"][0]["waiting_for_wan"].get<bool>());
}

TEST(PeerRemovedFrom, OnlyWhenAMemberOfNoJobHere) {
  SyncStatusInfo st = *WithRemovedPeer().sync;
  EXPECT_EQ(PeerRemovedFrom(st, "gamma"), std::optional<uint64_t>(3));
  EXPECT_EQ(PeerRemovedFrom(st, "beta"), std::nullopt);
  EXPECT_EQ(PeerRemovedFrom(st, "nosuchsite"), std::nullopt) << "named by no job";
  // Still a member of a second job: its link still carries that job.
  SyncJobReport other;
  other.job = "other";
  other.members = {"alpha", "beta", "gamma"};
  st.jobs.push_back(other);
  EXPECT_EQ(PeerRemovedFrom(st, "gamma"), std::nullopt);
  // Removed from both, at different rounds: from the later one on it carries nothing.
  st.jobs[1].members = {"alpha", "beta"};
  st.jobs[1].removed = {{"gamma", 7}};
  EXPECT_EQ(PeerRemovedFrom(st, "gamma"), std::optional<uint64_t>(7));
  // A job being joined (no membership known yet): not decided.
  SyncJobReport joining;
  joining.job = "joining";
  st.jobs.push_back(joining);
  EXPECT_EQ(PeerRemovedFrom(st, "gamma"), std::nullopt);
}

}  // namespace
}  // namespace isthmus::ctl
