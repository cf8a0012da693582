// Power loss, simulated (tests/fault/powerloss.h): the real isthmus-server runs with the
// recorder preloaded, is killed at a random moment, and its data dir is replaced by what a
// disk would hold had the power failed then: every file and directory as of its last
// fsync, half the time with a torn page. The shard must restart on that, every push it
// acknowledged must be there exactly once (retries of the one in flight included), and a
// snapshot it acknowledged must restore. The model itself is checked first, on a small
// program whose expected losses are known, so a campaign that passes is not a layer that
// drops nothing.
//
// ISTHMUS_POWERLOSS_LOOPS sets the power losses per test (default 3; the `long` campaign
// runs 1000 under a push storm and 100 during snapshots). Sanitized builds skip: the
// recorder is preloaded before the sanitizer's runtime, which refuses that.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <thread>

#include "tests/fault/powerloss.h"
#include "tests/integration/server_process.h"

namespace isthmus {
namespace {

using testing::ServerProcess;

#define SKIP_IF_SANITIZED() \
  if (fault::kSanitizedBuild) GTEST_SKIP() << fault::kSanitizedSkip

int Loops(int fallback) {
  const char* v = std::getenv("ISTHMUS_POWERLOSS_LOOPS");
  return v ? std::max(1, std::atoi(v)) : fallback;
}

std::string Slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The model on a program with known losses: python3 with the recorder preloaded.
TEST(PowerLossModel, KeepsWhatWasSyncedAndLosesTheRest) {
  SKIP_IF_SANITIZED();
  const auto dir = std::filesystem::temp_directory_path() /
                   ("isthmus-powerloss-model-" + std::to_string(::getpid()));
  const auto root = dir / "root", shadow = dir / "shadow";
  std::filesystem::remove_all(dir);
  for (int torn = 0; torn < 2; ++torn) {
    const auto env = powerloss::PowerLossEnv(root, shadow);
    std::ofstream(root / "replaced") << "v1";
    std::ofstream(root / "renamed") << "v1";
    std::ofstream(root / "log") << "AAAA";
    const std::string script = R"(
import os, sys
r = sys.argv[1]
def write(p, data, sync, mode='wb'):
    with open(p, mode) as f:
        f.write(data); f.flush()
        if sync: os.fsync(f.fileno())
def dirsync(d):
    fd = os.open(d, os.O_RDONLY); os.fsync(fd); os.close(fd)
write(r + '/kept', b'kept', True); dirsync(r)
write(r + '/emptied', b'lost', False); dirsync(r)
write(r + '/replaced.tmp', b'v2', False); os.rename(r + '/replaced.tmp', r + '/replaced'); dirsync(r)
write(r + '/unnamed', b'x', True)
write(r + '/renamed.tmp', b'v2', True); os.rename(r + '/renamed.tmp', r + '/renamed')
write(r + '/log', b'BBBB', False, 'ab')
os.mkdir(r + '/sub'); write(r + '/sub/f', b'f', True); dirsync(r + '/sub')
)";
    std::ofstream(dir / "prog.py") << script;
    std::string cmd;
    for (const auto& [k, v] : env) cmd += k + "='" + v + "' ";
    cmd += "/usr/bin/python3 " + (dir / "prog.py").string() + " " + root.string();
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    ASSERT_EQ(Slurp(root / "log"), "AAAABBBB");  // the program saw its writes
    std::mt19937 rng(7);
    powerloss::LossStats stats;
    ASSERT_EQ(powerloss::SimulatePowerLoss(root, shadow, torn ? &rng : nullptr, &stats), "");
    EXPECT_EQ(Slurp(root / "kept"), "kept");                  // bytes and name synced
    EXPECT_FALSE(std::filesystem::exists(root / "unnamed"));  // its name never was
    EXPECT_TRUE(std::filesystem::exists(root / "emptied"));   // its name was, its bytes not
    // Renamed over the old file without syncing the new one first: the classic bug, both
    // versions gone (below).
    const std::string replaced = Slurp(root / "replaced");
    // Synced, renamed, directory not synced: the old version.
    EXPECT_EQ(Slurp(root / "renamed"), "v1");
    EXPECT_FALSE(std::filesystem::exists(root / "renamed.tmp"));
    EXPECT_FALSE(std::filesystem::exists(root / "sub"));  // its parent was never synced
    const std::string log = Slurp(root / "log");
    const std::string emptied = Slurp(root / "emptied");
    if (torn) {  // the three files that grew keep part of their unsynced page
      EXPECT_EQ(stats.torn, 3);
      EXPECT_FALSE(replaced.empty());
      EXPECT_EQ(replaced, std::string("v2").substr(0, replaced.size()));
      EXPECT_GT(log.size(), 4u);
      EXPECT_EQ(log, std::string("AAAABBBB").substr(0, log.size()));
      EXPECT_FALSE(emptied.empty());
      EXPECT_EQ(emptied, std::string("lost").substr(0, emptied.size()));
    } else {
      EXPECT_EQ(log, "AAAA");
      EXPECT_EQ(emptied, "");
      EXPECT_EQ(replaced, "");
      EXPECT_EQ(stats.torn, 0);
    }
    EXPECT_GE(stats.lost_bytes, 4u);
    std::filesystem::remove_all(dir);
  }
}

// Creates job "j" with tensors "a" = 0, 1, ... and "b" = all ones, of n values each.
void CreateJob(const ServerProcess& server, int64_t n) {
  std::vector<float> a(n), b(n, 1.0f);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i);
  const std::vector<int64_t> shape{n};
  auto r = server.AdminClient()->CreateJob("j", "base-hash-1",
                                           {{"a", shape, a.data()}, {"b", shape, b.data()}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
}

std::vector<float> PullB(ShardClient& c) {
  auto r = c.Pull("j");
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  if (r.ok()) {
    for (auto& t : r->tensors) {
      if (t.name == "b") return t.data;
    }
  }
  return {};
}

// The parameter is the tensors' size in values: 32 (RocksDB's log) or 2^19 (2 MiB: slot
// files, synced before the batch that names them).
class PowerLoss : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override {
    SKIP_IF_SANITIZED();
    n_ = GetParam();
    data_ = server_.dir() / "data";
    shadow_ = server_.dir() / "shadow";
  }
  // Starts the shard with the recorder (the shadow starts empty: the tree is its baseline).
  ::testing::AssertionResult StartRecorded() {
    server_.set_env(powerloss::PowerLossEnv(data_, shadow_));
    return server_.Start();
  }
  // SIGKILL, then the disk as a power loss would leave it.
  void LosePower(std::mt19937& rng, int loop) {
    const int status = server_.Kill(SIGKILL);
    ASSERT_TRUE(WIFSIGNALED(status)) << "loop " << loop;
    std::mt19937* tear = rng() % 2 == 0 ? &rng : nullptr;
    powerloss::LossStats stats;
    ASSERT_EQ(powerloss::SimulatePowerLoss(data_, shadow_, tear, &stats), "") << "loop " << loop;
    lost_bytes_ += stats.lost_bytes;
    torn_ += stats.torn;
  }
  void TearDown() override {
    if (!fault::kSanitizedBuild) {
      std::printf("power losses: lost %llu unsynced bytes in all, tore %d pages\n",
                  static_cast<unsigned long long>(lost_bytes_), torn_);
    }
  }
  ServerProcess server_;
  std::filesystem::path data_, shadow_;
  int64_t n_ = 0;
  uint64_t lost_bytes_ = 0;
  int torn_ = 0;
};

// Pushes with fresh keys, one at a time, until told to stop or a push fails; counts the
// acknowledged ones and remembers the one in flight.
struct Storm {
  std::atomic<bool> stop{false};
  std::atomic<int> acked{0};
  std::atomic<int> in_flight{-1};
  std::thread thread;
  void Run(const ServerProcess& server, int& next_key, int64_t n) {
    thread = std::thread([this, &server, &next_key, n] {
      auto w = server.WorkerClient(5000, 0);
      std::vector<float> one(n, 1.0f);
      const std::vector<int64_t> kShape{n};
      while (!stop) {
        const int k = next_key;
        in_flight = k;
        auto p = w->Push("j", "key-" + std::to_string(k), 0, 1, {{"b", kShape, one.data()}});
        if (!p.ok()) break;
        ++next_key;
        in_flight = -1;
        ++acked;
      }
    });
  }
  void Wait(std::mt19937& rng) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (acked == 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 300));
  }
  void Join() {
    stop = true;
    thread.join();
  }
};

TEST_P(PowerLoss, APushStormLosesNothingAcknowledgedAndDoublesNothing) {
  const int loops = Loops(3);
  ASSERT_TRUE(StartRecorded());
  CreateJob(server_, n_);
  std::mt19937 rng(20261126);
  int next_key = 0, acked_total = 0;
  std::vector<float> one(n_, 1.0f);
  const std::vector<int64_t> kShape{n_};
  for (int loop = 0; loop < loops; ++loop) {
    Storm storm;
    storm.Run(server_, next_key, n_);
    storm.Wait(rng);
    LosePower(rng, loop);
    storm.Join();
    acked_total += storm.acked;
    ASSERT_GT(storm.acked.load(), 0) << "no push was acknowledged before loss " << loop;

    ASSERT_TRUE(StartRecorded()) << "the shard did not restart after power loss " << loop;
    auto w = server_.WorkerClient();
    const auto b = PullB(*w);
    ASSERT_FALSE(b.empty()) << "loop " << loop;
    // Every acknowledged push is there; the one in flight may or may not be.
    ASSERT_GE(b[0], 1.0f + acked_total) << "an acknowledged push was lost in loop " << loop;
    ASSERT_LE(b[0], 1.0f + acked_total + 1) << "loop " << loop;
    if (storm.in_flight >= 0) {  // the worker's retry of the push in flight: at most once
      auto p = w->Push("j", "key-" + std::to_string(storm.in_flight.load()), 0, 1,
                       {{"b", kShape, one.data()}});
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      ++next_key;
      ++acked_total;
    }
    ASSERT_EQ(PullB(*w), std::vector<float>(n_, 1.0f + acked_total))
        << "a push was doubled or lost in loop " << loop;
  }
  std::printf("%d power losses, %d pushes acknowledged, 0 lost, 0 doubled\n", loops, acked_total);
}

// A snapshot cut by the power: one the shard acknowledged is listed after the restart and
// restores to a state between the pushes acknowledged before the request and after its
// reply; one it did not acknowledge is whole or absent, never a broken entry.
TEST_P(PowerLoss, AnAcknowledgedSnapshotSurvivesAndRestores) {
  const int loops = std::max(1, Loops(3) / 10);
  ASSERT_TRUE(StartRecorded());
  CreateJob(server_, n_);
  std::mt19937 rng(11);
  int next_key = 0, acked_total = 0, snapshots_checked = 0;
  for (int loop = 0; loop < loops; ++loop) {
    struct Taken {
      std::string name;
      int acked_before, acked_after;
    };
    std::vector<Taken> taken;
    Storm storm;
    storm.Run(server_, next_key, n_);
    std::atomic<bool> stop_snapshots{false};
    std::thread snapshots([&] {
      auto admin = server_.AdminClient(2000, 0);
      // A few per loss, spread over the time the loss may fall in (every snapshot stays,
      // and each start records the whole tree).
      std::mt19937 pace(loop);
      for (int i = 0; i < 3 && !stop_snapshots; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(pace() % 150));
        const std::string name = "s" + std::to_string(loop) + "-" + std::to_string(i);
        const int before = acked_total + storm.acked;
        if (!admin->CreateSnapshot(name).ok()) break;
        taken.push_back({name, before, acked_total + storm.acked});
      }
    });
    storm.Wait(rng);
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 200));
    LosePower(rng, loop);
    stop_snapshots = true;
    snapshots.join();
    storm.Join();
    acked_total += storm.acked;
    // Keys are never used twice here: the one in flight may or may not have been applied
    // (the state's count says which, below), and a restore forgets the keys after it.
    next_key += 1000;

    ASSERT_TRUE(StartRecorded()) << "the shard did not restart after power loss " << loop;
    auto admin = server_.AdminClient();
    auto list = admin->ListSnapshots();
    ASSERT_TRUE(list.ok()) << list.status().ToString();
    std::set<std::string> listed;
    for (const auto& s : *list) listed.insert(s.name);
    for (const auto& t : taken) {
      EXPECT_TRUE(listed.count(t.name)) << "acknowledged snapshot " << t.name << " is gone";
    }
    if (std::filesystem::exists(data_ / "snapshots")) {
      for (const auto& e : std::filesystem::directory_iterator(data_ / "snapshots")) {
        EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u)
            << "an unfinished snapshot was kept: " << e.path() << " (loop " << loop << ")";
      }
    }
    const auto now = PullB(*server_.WorkerClient());
    ASSERT_FALSE(now.empty());
    ASSERT_GE(now[0], 1.0f + acked_total) << "an acknowledged push was lost in loop " << loop;
    ASSERT_LE(now[0], 1.0f + acked_total + 1) << "loop " << loop;
    // Restore the last acknowledged one and check its state; then the storm's count starts
    // again from the restored state (a restore forgets later pushes and their keys).
    if (!taken.empty()) {
      const Taken& t = taken.back();
      auto r = admin->RestoreSnapshot(t.name);
      ASSERT_TRUE(r.ok()) << t.name << ": " << r.status().ToString();
      const auto b = PullB(*server_.WorkerClient());
      ASSERT_FALSE(b.empty());
      EXPECT_GE(b[0], 1.0f + t.acked_before) << t.name;
      EXPECT_LE(b[0], 1.0f + t.acked_after + 1) << t.name;
      acked_total = static_cast<int>(b[0]) - 1;
      ++snapshots_checked;
    } else {
      acked_total = static_cast<int>(PullB(*server_.WorkerClient()).at(0)) - 1;
    }
  }
  std::printf("%d power losses during snapshots, %d acknowledged snapshots restored\n", loops,
              snapshots_checked);
}

INSTANTIATE_TEST_SUITE_P(Sizes, PowerLoss, ::testing::Values(int64_t{32}, int64_t{1} << 19),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

}  // namespace
}  // namespace isthmus
