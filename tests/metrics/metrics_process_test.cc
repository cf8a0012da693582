// Live metrics (docs/METRICS.md): real isthmus-server shards (RocksDB, CURVE) and
// isthmus-worker ranks serve /metrics; each scrape must pass `promtool check metrics`, and
// the counters must move as pushes, rounds, commits and WAN waits happen.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "tests/loopback.h"
#include "tests/metrics/hostile.h"
#include "tests/metrics/scrape.h"
#include "tests/worker/worker_harness.h"

namespace isthmus::testing {
namespace {

// Starts `p` with listen.metrics on a free port (through the environment: the generated
// TOML already has its [listen] table) and returns the port.
int StartWithMetrics(ServerProcess& p) {
  const int port = FreePort();
  const std::string addr = "127.0.0.1:" + std::to_string(port);
  ::setenv("ISTHMUS_LISTEN_METRICS", addr.c_str(), 1);
  const bool started = p.Start();
  ::unsetenv("ISTHMUS_LISTEN_METRICS");
  EXPECT_TRUE(started);
  return started ? port : -1;
}

// Scrapes and checks the text with promtool (skipping the test when it is not installed).
std::string ScrapeChecked(int port) {
  auto text = Scrape(port);
  EXPECT_TRUE(text.has_value()) << "no answer from the metrics endpoint on port " << port;
  if (!text) return "";
  auto check = PromtoolCheck(*text);
  if (check.available) {
    EXPECT_EQ(check.exit_code, 0) << check.output << "\n" << *text;
  }
  return *text;
}

double Or(const std::optional<double>& v, double fallback = -1) { return v.value_or(fallback); }

// Every family a live process serves is documented in docs/METRICS.md.
void ExpectDocumented(const std::string& text) {
  std::ifstream in(std::string(ISTHMUS_SOURCE_DIR) + "/docs/METRICS.md");
  ASSERT_TRUE(in) << "docs/METRICS.md is missing";
  const std::string doc((std::istreambuf_iterator<char>(in)), {});
  for (const auto& f : Families(text)) {
    EXPECT_NE(doc.find("`" + f + "`"), std::string::npos) << f << " is not in docs/METRICS.md";
  }
}

bool HasSeriesStarting(const std::string& text, const std::string& prefix) {
  return text.find("\n" + prefix) != std::string::npos;
}

void RequirePromtool() {
  if (!PromtoolCheck("").available) {
    GTEST_SKIP() << "promtool is not installed: these tests check every scrape with "
                    "`promtool check metrics` (Debian package prometheus; deploy/install-deps.sh "
                    "installs it)";
  }
}

TEST(ShardMetrics, ScrapesPassPromtoolAndCountersFollowPushesAndPulls) {
  RequirePromtool();
  ServerProcess shard;
  const int port = StartWithMetrics(shard);
  ASSERT_GT(port, 0) << shard.Log();
  const std::string before = ScrapeChecked(port);
  // Start() waited for the admin socket with Stats requests.
  EXPECT_GE(
      Or(Value(before, "isthmus_requests_total{socket=\"admin\",op=\"stats\",outcome=\"OK\"}")), 1);
  EXPECT_FALSE(
      Value(before, "isthmus_requests_total{socket=\"worker\",op=\"push\",outcome=\"OK\"}"));
  EXPECT_GT(Or(Value(before, "isthmus_store_disk_bytes")), 0);
  EXPECT_TRUE(Value(before, "isthmus_rocksdb_write_stall_seconds_total"));

  const std::vector<float> a(1000, 0.5f), b(24, 1.0f);
  ASSERT_TRUE(shard.AdminClient()
                  ->CreateJob("j", "base", {{"a", {1000}, a.data()}, {"b", {4, 6}, b.data()}})
                  .ok());
  auto w = shard.WorkerClient();
  ASSERT_TRUE(w->Push("j", "k1", 0, 10, {{"a", {1000}, a.data()}}).ok());
  ASSERT_TRUE(w->Push("j", "k2", 0, 10, {{"a", {1000}, a.data()}, {"b", {4, 6}, b.data()}}).ok());
  ASSERT_TRUE(w->Push("j", "k2", 0, 10, {{"a", {1000}, a.data()}, {"b", {4, 6}, b.data()}}).ok());
  EXPECT_FALSE(w->Push("nope", "k3", 0, 10, {{"a", {1000}, a.data()}}).ok());
  ASSERT_TRUE(w->Pull("j").ok());

  const std::string after = ScrapeChecked(port);
  EXPECT_EQ(Value(after, "isthmus_requests_total{socket=\"worker\",op=\"push\",outcome=\"OK\"}"), 3)
      << after;
  EXPECT_EQ(
      Value(after, "isthmus_requests_total{socket=\"worker\",op=\"push\",outcome=\"NotFound\"}"),
      1);
  EXPECT_EQ(Value(after, "isthmus_requests_total{socket=\"worker\",op=\"pull\",outcome=\"OK\"}"),
            1);
  EXPECT_EQ(
      Value(after, "isthmus_requests_total{socket=\"admin\",op=\"job_create\",outcome=\"OK\"}"), 1);
  EXPECT_EQ(Value(after, "isthmus_request_duration_seconds_count{socket=\"worker\",op=\"push\"}"),
            4);
  EXPECT_GT(Or(Value(after, "isthmus_request_duration_seconds_sum{socket=\"worker\",op=\"push\"}")),
            0);
  EXPECT_EQ(Value(after, "isthmus_job_pushes_total{job=\"j\"}"), 2);
  EXPECT_EQ(Value(after, "isthmus_job_duplicate_pushes_total{job=\"j\"}"), 1);
  EXPECT_EQ(Value(after, "isthmus_job_tensors{job=\"j\"}"), 2);
  EXPECT_EQ(Value(after, "isthmus_job_size_bytes{job=\"j\"}"), 1024 * 4);
  EXPECT_GE(Or(Value(after, "isthmus_job_version{job=\"j\"}")), 2);
  // Three pushes carried at least 3 x 4000 payload bytes; the pull sent 4096 back.
  EXPECT_GE(Or(Value(after, "isthmus_socket_received_bytes_total{socket=\"worker\"}")), 12000);
  EXPECT_GE(Or(Value(after, "isthmus_socket_sent_bytes_total{socket=\"worker\"}")), 4096);
  EXPECT_GT(Or(Value(after, "isthmus_socket_received_bytes_total{socket=\"admin\"}")),
            Or(Value(before, "isthmus_socket_received_bytes_total{socket=\"admin\"}")));
  ExpectDocumented(after);
}

// The pid of the shard `p` runs: the process whose command line names its config.
std::string PidOf(const ServerProcess& p) {
  const std::string config = (p.dir() / "server.toml").string();
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.empty() || !std::all_of(name.begin(), name.end(), ::isdigit)) continue;
    std::ifstream in(e.path() / "cmdline");
    const std::string cmd((std::istreambuf_iterator<char>(in)), {});
    if (cmd.find(config) != std::string::npos) return name;
  }
  return "";
}

// Issue 27 item 7 on a live shard: a 256 MiB POST took a shard from 40 to 326 MB, and one
// slowloris or 500 idle connections blocked every scrape. Now the POST is refused unread
// (the shard's resident memory grows by a few MB at most), a scrape answers within a few
// seconds while a slowloris and 500 idle connections are open, and pushes and pulls go on
// as before.
TEST(ShardMetrics, HostileHttpClientsCostNeitherMemoryNorScrapesNorPushes) {
  RaiseFileLimit();
  ServerProcess shard;
  const int port = StartWithMetrics(shard);
  ASSERT_GT(port, 0) << shard.Log();
  const std::string pid = PidOf(shard);
  ASSERT_FALSE(pid.empty()) << "cannot find the shard's process";
  const std::vector<float> a(1000, 0.5f);
  ASSERT_TRUE(shard.AdminClient()->CreateJob("j", "base", {{"a", {1000}, a.data()}}).ok());
  auto w = shard.WorkerClient();
  ASSERT_TRUE(w->Push("j", "k0", 0, 10, {{"a", {1000}, a.data()}}).ok());
  ASSERT_TRUE(Scrape(port).has_value());

  const long rss_before = VmRssKb(pid);
  const uint64_t kOffered = uint64_t{256} << 20;
  auto big = StreamBody(port,
                        "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                            std::to_string(kOffered) + "\r\n\r\n",
                        kOffered);
  const long rss_after_post = VmRssKb(pid);
  EXPECT_EQ(big.answer.rfind("HTTP/1.1 413", 0), 0u) << big.answer;
  EXPECT_LT(rss_after_post - rss_before, 16 * 1024)
      << "the shard went from " << rss_before << " to " << rss_after_post << " KiB";

  Slowloris slow(port, 30);
  ASSERT_TRUE(slow.connected());
  IdleConnections idle(port, 500);
  EXPECT_GE(idle.size(), 400u);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 1; i <= 5; ++i) {
    ASSERT_TRUE(w->Push("j", "k" + std::to_string(i), 0, 10, {{"a", {1000}, a.data()}}).ok());
  }
  ASSERT_TRUE(w->Pull("j").ok());
  const double push_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  t0 = std::chrono::steady_clock::now();
  auto text = Scrape(port);
  const double scrape_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const long rss_end = VmRssKb(pid);
  ASSERT_TRUE(text.has_value()) << "no scrape with a slowloris and " << idle.size()
                                << " idle connections open";
  EXPECT_EQ(Value(*text, "isthmus_requests_total{socket=\"worker\",op=\"push\",outcome=\"OK\"}"), 6)
      << *text;
  EXPECT_LT(scrape_s, 5.0);
  EXPECT_LT(push_s, 5.0) << "5 pushes and a pull took " << push_s << " s";
  EXPECT_LT(rss_end - rss_before, 16 * 1024 * isthmus::testing::MemoryScale())
      << "the shard went from " << rss_before << " to " << rss_end << " KiB";
  std::printf(
      "shard VmRSS %ld KiB before, %ld after a 256 MiB POST (%llu body bytes sent before the "
      "413), %ld with %zu idle connections and a slowloris; scrape %.3f s, 5 pushes + pull "
      "%.3f s\n",
      rss_before, rss_after_post, static_cast<unsigned long long>(big.body_sent), rss_end,
      idle.size(), scrape_s, push_s);
}

TEST(ShardMetrics, TwoSitesShowCommitsLinksAndTheirWireBytes) {
  RequirePromtool();
  fs::path root = fs::temp_directory_path() / ("isthmus-msync-" + std::to_string(::getpid()));
  fs::remove_all(root);
  SiteProcess alpha("alpha", root), beta("beta", root);
  std::vector<SiteProcess*> all = {&alpha, &beta};
  for (auto* s : all) s->Configure(all, "ack_delay_ms = 0");
  const int pa = StartWithMetrics(alpha);
  const int pb = StartWithMetrics(beta);
  ASSERT_GT(pa, 0) << alpha.Log();
  ASSERT_GT(pb, 0) << beta.Log();
  const std::vector<float> init(512, 0.0f);
  for (auto* s : all) {
    ASSERT_TRUE(s->AdminClient()->CreateJob("job", "base", {{"w", {512}, init.data()}}).ok());
  }
  const std::string before = ScrapeChecked(pa);
  EXPECT_EQ(Value(before, "isthmus_sync_committed_round{job=\"job\"}"), 0) << before;
  EXPECT_EQ(Value(before, "isthmus_sync_members{job=\"job\"}"), 2);

  std::vector<float> d(512);
  for (uint64_t r = 1; r <= 3; ++r) {
    for (int i = 0; i < 2; ++i) {
      for (size_t k = 0; k < d.size(); ++k) d[k] = 0.01f * static_cast<float>((k * 7 + r + i) % 13);
      auto p = all[i]->WorkerClient()->Push("job", "r" + std::to_string(r), r, 100,
                                            {{"w", {512}, d.data()}});
      ASSERT_TRUE(p.ok()) << p.status().ToString();
    }
  }
  // Every round committed and acknowledged on both sides.
  std::string a_text, b_text;
  for (int i = 0; i < 300; ++i) {
    a_text = ScrapeChecked(pa);
    b_text = ScrapeChecked(pb);
    if (Or(Value(a_text, "isthmus_sync_committed_round{job=\"job\"}")) == 3 &&
        Or(Value(b_text, "isthmus_sync_committed_round{job=\"job\"}")) == 3 &&
        Or(Value(a_text, "isthmus_peer_lag_rounds{peer=\"beta\",job=\"job\"}")) == 0 &&
        Or(Value(b_text, "isthmus_peer_lag_rounds{peer=\"alpha\",job=\"job\"}")) == 0) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (const auto& [text, peer] :
       {std::make_pair(a_text, "beta"), std::make_pair(b_text, "alpha")}) {
    const std::string p = std::string("{peer=\"") + peer + "\"}";
    EXPECT_EQ(Value(text, "isthmus_sync_committed_round{job=\"job\"}"), 3) << text;
    EXPECT_EQ(Value(text, "isthmus_sync_local_round{job=\"job\"}"), 3);
    EXPECT_EQ(Value(text, "isthmus_sync_commit_duration_seconds_count{job=\"job\"}"), 3);
    EXPECT_EQ(
        Value(text, "isthmus_peer_acked_round{peer=\"" + std::string(peer) + "\",job=\"job\"}"), 3);
    EXPECT_EQ(Value(text, "isthmus_peer_connected" + p), 1);
    // Each delta sent (3, plus resends) is acknowledged at most once by its own reply; a
    // reply lost to a reconnect (a slow sanitized peer) is made good by the handshake,
    // which moves acked_round (above) but not this counter.
    const double acked = Or(Value(text, "isthmus_peer_deltas_acked_total" + p));
    EXPECT_GE(acked, 1) << text;
    EXPECT_LE(acked, Or(Value(text, "isthmus_peer_deltas_sent_total" + p))) << text;
    EXPECT_GE(Or(Value(text, "isthmus_peer_deltas_sent_total" + p)), 3) << text;
    const double payload = Or(Value(text, "isthmus_peer_payload_sent_bytes_total" + p));
    const double wire = Or(Value(text, "isthmus_peer_wire_sent_bytes_total" + p));
    EXPECT_GT(payload, 0);
    EXPECT_GT(wire, payload) << "wire bytes include framing, encryption and handshakes";
    EXPECT_GE(Or(Value(text, "isthmus_peer_payload_raw_bytes_total" + p)), 3 * 512 * 4);
    EXPECT_EQ(Value(text, "isthmus_socket_sent_bytes_total{socket=\"peer\"}"), wire);
    EXPECT_TRUE(HasSeriesStarting(text, "isthmus_sync_codec_tensors{job=\"job\",pipeline=\""))
        << text;
    EXPECT_TRUE(Value(text, "isthmus_peer_bandwidth_bytes_per_second" + p));
  }
  EXPECT_EQ(Value(a_text, "isthmus_sync_held_round{job=\"job\",site=\"beta\"}"), 3);
  // The closes and commits ran after the replies, and none failed.
  EXPECT_EQ(Value(a_text, "isthmus_sync_round_work_pending{job=\"job\"}"), 0);
  EXPECT_EQ(Value(a_text, "isthmus_sync_round_work_failures_total{job=\"job\"}"), 0);
  ExpectDocumented(a_text);
  fs::remove_all(root);
}

// Rank 0 of a two-rank site reports its gradient all-reduce: time spent and the part the
// steps waited for, all of it with one all-reduce after the backward (--bucket-mb 0), at
// most all of it with buckets during the backward (the default); promtool reads the text.
TEST(WorkerMetrics, ATwoRankSiteReportsItsAllReduceAndThePartTheStepsWaitedFor) {
  RequirePromtool();
  fs::path dir = fs::temp_directory_path() / ("isthmus-wmar-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "data");
  WriteTokens(dir / "data" / "train.bin", 20000, 1);
  WriteTokens(dir / "data" / "val.bin", 2000, 2);
  for (const std::string bucket_mb : {"0", "1"}) {
    SCOPED_TRACE("--bucket-mb " + bucket_mb);
    const int port = FreePort();
    const std::string rdv = "tcp:127.0.0.1:" + std::to_string(FreePort());
    std::vector<WorkerProcess> ranks(2);
    for (int r = 0; r < 2; ++r) {
      std::vector<std::string> a = {"train"};
      a.insert(a.end(), kModelFlags.begin(), kModelFlags.end());
      a.insert(a.end(), kTrainFlags.begin(), kTrainFlags.end());
      const std::vector<std::string> more = {"--standalone",
                                             "--max-steps",
                                             "100000",
                                             "--mode",
                                             "full",
                                             "--device",
                                             "cpu",
                                             "--world-size",
                                             "2",
                                             "--rank",
                                             std::to_string(r),
                                             "--rendezvous",
                                             rdv,
                                             "--bucket-mb",
                                             bucket_mb,
                                             "--data",
                                             (dir / "data").string()};
      a.insert(a.end(), more.begin(), more.end());
      if (r == 0) {
        a.push_back("--metrics-listen");
        a.push_back("127.0.0.1:" + std::to_string(port));
      }
      ranks[r].Start(a, (dir / ("r" + std::to_string(r) + "-" + bucket_mb + ".log")).string());
    }
    std::string text;
    for (int i = 0; i < 1200 && text.empty(); ++i) {
      auto t = Scrape(port);
      if (t && Or(Value(*t, "isthmus_worker_steps_total")) >= 5) text = *t;
      if (text.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    for (auto& r : ranks) r.Kill();
    ASSERT_FALSE(text.empty()) << ranks[0].Log();
    auto check = PromtoolCheck(text);
    EXPECT_EQ(check.exit_code, 0) << check.output << text;
    const double total = Or(Value(text, "isthmus_worker_allreduce_seconds_total"), -1);
    const double exposed = Or(Value(text, "isthmus_worker_allreduce_exposed_seconds_total"), -1);
    EXPECT_GT(total, 0) << text;
    EXPECT_GE(exposed, 0) << text;
    if (bucket_mb == "0") {
      EXPECT_EQ(exposed, total) << "one all-reduce after the backward hides nothing";
    }
    ExpectDocumented(text);
  }
  fs::remove_all(dir);
}

// A worker rank 0 with --metrics-listen and --events against a real shard: scrapes while it
// trains show steps, rounds, pushes and validations moving; the events file holds the run.
TEST(WorkerMetrics, ALiveWorkerIsScrapedAndItsEventsRecordTheRun) {
  RequirePromtool();
  fs::path dir = fs::temp_directory_path() / ("isthmus-wmet-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "data");
  fs::create_directories(dir / "other");
  WriteTokens(dir / "data" / "train.bin", 20000, 1);
  WriteTokens(dir / "data" / "val.bin", 2000, 2);
  WriteTokens(dir / "other" / "val.bin", 2000, 3);
  ServerProcess shard;
  ASSERT_TRUE(shard.Start());
  CreateJobFromInit(shard, dir);
  const int port = FreePort();
  const auto args = SingleShardTrainArgs(
      shard, dir,
      {"--max-rounds", "100000", "--steps-per-round", "2", "--metrics-listen",
       "127.0.0.1:" + std::to_string(port), "--events", (dir / "events.jsonl").string(),
       "--eval-set", "other=" + (dir / "other").string(), "--eval-every-rounds", "2"});
  WorkerProcess w;
  w.Start(args, (dir / "w.log").string());
  // Scrape until it has finished a few rounds, then until it has finished more.
  auto scrape_until = [&](double rounds) {
    std::string text;
    for (int i = 0; i < 1200; ++i) {
      auto t = Scrape(port);
      if (t && Or(Value(*t, "isthmus_worker_rounds_total")) >= rounds) return *t;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return text;
  };
  const std::string first = scrape_until(3);
  ASSERT_FALSE(first.empty()) << w.Log();
  const std::string second = scrape_until(Or(Value(first, "isthmus_worker_rounds_total")) + 2);
  ASSERT_FALSE(second.empty()) << w.Log();
  for (const auto* text : {&first, &second}) {
    auto check = PromtoolCheck(*text);
    EXPECT_EQ(check.exit_code, 0) << check.output << *text;
    const double steps = Or(Value(*text, "isthmus_worker_steps_total"));
    EXPECT_GE(steps, 2 * Or(Value(*text, "isthmus_worker_rounds_total")));
    EXPECT_EQ(Value(*text, "isthmus_worker_step_duration_seconds_count"), steps);
    // Overlapped rounds (the default): the last round counted may still be pushing.
    EXPECT_GE(Or(Value(*text, "isthmus_worker_push_duration_seconds_count")) + 1,
              Or(Value(*text, "isthmus_worker_rounds_total")));
    EXPECT_TRUE(std::isfinite(Or(Value(*text, "isthmus_worker_loss"), NAN)));
    EXPECT_GT(Or(Value(*text, "isthmus_worker_tokens_per_second")), 0);
    EXPECT_EQ(Value(*text, "isthmus_worker_waiting_for_wan"), 0);
    // One rank: no in-site all-reduce.
    EXPECT_EQ(Value(*text, "isthmus_worker_allreduce_seconds_total"), 0);
    EXPECT_TRUE(Value(*text, "isthmus_worker_validation_loss{set=\"other\"}")) << *text;
    EXPECT_TRUE(Value(*text, "isthmus_worker_validation_loss{set=\"site\"}")) << *text;
  }
  EXPECT_GT(Or(Value(second, "isthmus_worker_steps_total")),
            Or(Value(first, "isthmus_worker_steps_total")));
  EXPECT_GT(Or(Value(second, "isthmus_worker_tokens_total")),
            Or(Value(first, "isthmus_worker_tokens_total")));
  EXPECT_GT(Or(Value(second, "isthmus_worker_round")), Or(Value(first, "isthmus_worker_round")));
  ExpectDocumented(second);
  // The shard saw the pushes the worker counted.
  auto stats = shard.AdminClient()->Stats();
  ASSERT_TRUE(stats.ok());
  ASSERT_EQ(stats->jobs.size(), 1u);
  EXPECT_GE(static_cast<double>(stats->jobs[0].pushes),
            Or(Value(second, "isthmus_worker_push_duration_seconds_count")));

  // SIGTERM: the worker checkpoints and ends; the events file tells the run.
  ::kill(w.pid, SIGTERM);
  const int rc = w.Wait(60);
  EXPECT_EQ(rc, 7) << "interrupted is exit code 7\n" << w.Log();
  std::ifstream in(dir / "events.jsonl");
  std::vector<nlohmann::json> events;
  for (std::string line; std::getline(in, line);) events.push_back(nlohmann::json::parse(line));
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.front()["event"], "start");
  EXPECT_EQ(events.front()["job"], "j");
  EXPECT_EQ(events.front()["steps_per_round"], 2);
  EXPECT_EQ(events.back()["event"], "end");
  EXPECT_EQ(events.back()["interrupted"], true);
  int64_t last_round = 0;
  int rounds = 0;
  std::set<std::string> sets;
  double last_time = 0;
  for (const auto& e : events) {
    EXPECT_GE(e["time"].get<double>(), last_time);
    last_time = e["time"].get<double>();
    if (e["event"] == "round") {
      EXPECT_EQ(e["round"].get<int64_t>(), last_round + 1) << e.dump();
      last_round = e["round"].get<int64_t>();
      ++rounds;
      // Two steps a round; the round SIGTERM interrupted may have stopped after one.
      EXPECT_LE(e["step"].get<int64_t>(), 2 * last_round);
      EXPECT_GE(e["step"].get<int64_t>(), 2 * last_round - 1);
      EXPECT_GE(e["push_s"].get<double>(), 0);
      EXPECT_GT(e["compute_s"].get<double>(), 0);
    } else if (e["event"] == "validation") {
      sets.insert(e["set"].get<std::string>());
      EXPECT_TRUE(e["loss"].is_number()) << e.dump();
    }
  }
  EXPECT_GE(rounds, Or(Value(second, "isthmus_worker_rounds_total")));
  EXPECT_EQ(sets, (std::set<std::string>{"other", "site"}));
  fs::remove_all(dir);
}

// While the site is too far ahead of its last commit (the peer site never answers), the
// worker's metrics say it waits and the shard's say how far ahead it is.
TEST(WorkerMetrics, AWaitForTheWanIsVisibleOnBothSides) {
  RequirePromtool();
  fs::path dir = fs::temp_directory_path() / ("isthmus-mwan-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "data");
  WriteTokens(dir / "data" / "train.bin", 20000, 1);
  WriteTokens(dir / "data" / "val.bin", 2000, 2);
  ServerProcess shard;
  const int shard_port = FreePort();
  ASSERT_TRUE(StartSiteWithSilentPeer(shard, dir, 1, shard_port));
  CreateJobFromInit(shard, dir);
  const int port = FreePort();
  const auto args =
      SingleShardTrainArgs(shard, dir,
                           {"--max-rounds", "5", "--steps-per-round", "2", "--no-overlap",
                            "--metrics-listen", "127.0.0.1:" + std::to_string(port)});
  WorkerProcess w;
  w.Start(args, (dir / "w.log").string());
  std::string text;
  for (int i = 0; i < 1200; ++i) {
    auto t = Scrape(port);
    if (t && Or(Value(*t, "isthmus_worker_waiting_for_wan")) == 1) {
      text = *t;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_FALSE(text.empty()) << "the worker never reported waiting for the WAN\n" << w.Log();
  auto check = PromtoolCheck(text);
  EXPECT_EQ(check.exit_code, 0) << check.output;
  // Round 1 finished; round 2 pushed (two pushes), and then the site is 2 ahead of commit 0.
  EXPECT_EQ(Value(text, "isthmus_worker_rounds_total"), 1) << text;
  EXPECT_EQ(Value(text, "isthmus_worker_steps_total"), 4);
  EXPECT_EQ(Value(text, "isthmus_worker_push_duration_seconds_count"), 2);
  EXPECT_EQ(Value(text, "isthmus_worker_wan_waits_total"), 0);  // counted once a wait ends
  const std::string s = ScrapeChecked(shard_port);
  ASSERT_FALSE(s.empty()) << shard.Log();
  EXPECT_EQ(Value(s, "isthmus_sync_local_round{job=\"j\"}"), 2) << s;
  EXPECT_EQ(Value(s, "isthmus_sync_committed_round{job=\"j\"}"), 0);
  EXPECT_EQ(Value(s, "isthmus_sync_rounds_ahead{job=\"j\"}"), 2);
  EXPECT_EQ(Value(s, "isthmus_peer_connected{peer=\"B\"}"), 0);
  EXPECT_EQ(Value(s, "isthmus_peer_lag_rounds{peer=\"B\",job=\"j\"}"), 2);
  EXPECT_EQ(Value(s, "isthmus_sync_commit_duration_seconds_count{job=\"j\"}"), std::nullopt)
      << "nothing committed, nothing timed";
  w.Kill();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace isthmus::testing
