// Disk full at random write sites (tests/fault/fault_preload.cc): the real isthmus-server
// runs with the fault layer preloaded; while a push storm goes on, the test fills the
// "disk" at a random moment (every write, allocation and sync on the data dir's files then
// fails with ENOSPC, whichever file it is for: RocksDB's log, tables, manifest, the slot
// files) and frees it again after a while. Checked: the shard never stops; a push it
// cannot store is refused as out of space (ResourceExhausted, naming the remedy; or
// Unavailable, to be retried, by the write that finds the space back), never acknowledged; once
// space is back it takes pushes again by itself, without a restart; and after every push is retried
// under its key until acknowledged (as a worker does), each counts exactly once, also after a
// restart at the end. The layer logs which kinds of file the failures hit, and the test prints
// them.
//
// ISTHMUS_NOSPACE_LOOPS sets the disk-full episodes per test (default 3; the `long`
// campaign runs 300). Sanitized builds skip (the layer is preloaded before the
// sanitizer's runtime, which refuses that).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "tests/fault/fault_env.h"
#include "tests/integration/server_process.h"

namespace isthmus {
namespace {

using testing::ServerProcess;

int Loops() {
  const char* v = std::getenv("ISTHMUS_NOSPACE_LOOPS");
  return v ? std::max(1, std::atoi(v)) : 3;
}

std::string Tail(const std::string& log) {
  return log.size() > 4000 ? "..." + log.substr(log.size() - 4000) : log;
}

std::vector<float> PullB(ShardClient& c) {
  auto r = c.Pull("j");
  if (r.ok()) {
    for (auto& t : r->tensors) {
      if (t.name == "b") return t.data;
    }
  }
  return {};
}

// The parameter is the tensors' size in values: 32 (RocksDB's log) or 2^19 (2 MiB: slot
// files).
class NoSpace : public ::testing::TestWithParam<int64_t> {};

TEST_P(NoSpace, RefusedCleanlyNothingAcknowledgedLostAndPushesResumeWithoutARestart) {
  if (fault::kSanitizedBuild) GTEST_SKIP() << fault::kSanitizedSkip;
  const int64_t n = GetParam();
  const int loops = Loops();
  ServerProcess server;
  const auto data = server.dir() / "data", control = server.dir() / "control";
  server.set_env(fault::DiskFullEnv(data, control));
  ASSERT_TRUE(server.Start());
  const pid_t pid = server.pid();
  const std::vector<int64_t> shape{n};
  {
    std::vector<float> a(n, 0.5f), b(n, 1.0f);
    auto r = server.AdminClient()->CreateJob("j", "base-hash-1",
                                             {{"a", shape, a.data()}, {"b", shape, b.data()}});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  const auto full = control / "full";
  std::mt19937 rng(4242);
  std::vector<float> one(n, 1.0f);
  int key = 0, acked = 0, refused = 0;
  std::map<std::string, int> refusals;  // first words of each refusal's message
  auto w = server.WorkerClient(10000, 0);
  for (int loop = 0; loop < loops; ++loop) {
    std::atomic<bool> stop{false};
    std::atomic<int> refused_now{0};
    std::string bad;  // a refusal that is not "out of space"
    std::thread storm([&] {
      // One key at a time, retried until acknowledged, as a worker does.
      while (!stop) {
        auto p = w->Push("j", "key-" + std::to_string(key), 0, 1, {{"b", shape, one.data()}});
        if (p.ok()) {
          ++acked;
          ++key;
          continue;
        }
        ++refused_now;
        const std::string msg = p.status().ToString();
        // Out of space, or (once the space is back) the store was reopened: retry.
        if (p.status().code() != Code::kResourceExhausted &&
            p.status().code() != Code::kUnavailable) {
          bad = msg;
        }
        refusals[msg.substr(0, msg.find(':', msg.find(':') + 1))] += 1;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + rng() % 200));
    std::ofstream(full).put('x');  // the disk fills
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + rng() % 250));
    std::filesystem::remove(full);  // and space comes back
    // Pushes resume by themselves: one more acknowledged within 20 s.
    const int before = acked;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (acked == before && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    stop = true;
    storm.join();
    refused += refused_now;
    ASSERT_GT(acked, before) << "no push was acknowledged within 20 s of the space coming back "
                             << "(loop " << loop << "): " << Tail(server.Log());
    ASSERT_EQ(bad, "") << "a push was refused for another reason than space (loop " << loop << ")";
    ASSERT_EQ(::kill(pid, 0), 0) << "the shard stopped (loop " << loop
                                 << "): " << Tail(server.Log());
    ASSERT_EQ(PullB(*w), std::vector<float>(n, 1.0f + acked))
        << "a push was lost or doubled in loop " << loop;
  }
  EXPECT_EQ(server.pid(), pid) << "the shard was restarted";
  // The state is durable: a restart gives it back.
  EXPECT_EQ(WEXITSTATUS(server.Kill(SIGTERM)), 0);
  server.set_env({});
  ASSERT_TRUE(server.Start());
  EXPECT_EQ(PullB(*server.WorkerClient()), std::vector<float>(n, 1.0f + acked));
  // Where the failures fell.
  std::map<std::string, int> hits;
  std::ifstream in(control / "hits");
  for (std::string call, kind; in >> call >> kind;) hits[call + " " + kind] += 1;
  std::string where;
  for (const auto& [site, count] : hits) where += " " + site + " x" + std::to_string(count) + ",";
  std::printf("%d disk-full episodes, %d pushes acknowledged, %d refusals, 0 lost, 0 doubled\n",
              loops, acked, refused);
  std::printf("failed calls by site:%s\n", where.c_str());
  for (const auto& [msg, count] : refusals) std::printf("  refused x%d: %s\n", count, msg.c_str());
  EXPECT_FALSE(hits.empty()) << "the disk never filled under a write: the layer did nothing";
}

INSTANTIATE_TEST_SUITE_P(Sizes, NoSpace, ::testing::Values(int64_t{32}, int64_t{1} << 19),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

}  // namespace
}  // namespace isthmus
