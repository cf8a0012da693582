// The isthmus-worker binary against real isthmus-server processes on loopback with CURVE:
// two ranks and two shards complete several rounds and the shards end up holding exactly
// the worker's tensors; a worker killed mid-run resumes and finishes with no round applied
// twice (also when it dies between pushing a round and checkpointing it); a worker whose
// base differs from the job's is refused with exit code 3.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "common/safetensors.h"
#include "common/sharding.h"
#include "tests/integration/server_process.h"

namespace isthmus {
namespace {

using testing::ServerProcess;
namespace fs = std::filesystem;

const std::vector<std::string> kModelFlags = {
    "--layers", "2", "--width", "32", "--heads", "2", "--context", "16", "--lora-rank", "4"};

// A running or finished isthmus-worker process.
struct WorkerProcess {
  pid_t pid = -1;
  std::string log;

  void Start(const std::vector<std::string>& args, const std::string& log_path,
             const std::string& fault_env = "") {
    log = log_path;
    pid = ::fork();
    if (pid == 0) {
      std::freopen(log_path.c_str(), "w", stderr);
      std::freopen("/dev/null", "w", stdout);
      if (!fault_env.empty())
        ::setenv("ISTHMUS_WORKER_FAULT_CRASH_AFTER_PUSH", fault_env.c_str(), 1);
      ::setenv("OMP_NUM_THREADS", "1", 1);
      std::vector<char*> argv;
      argv.push_back(const_cast<char*>(ISTHMUS_WORKER_BIN));
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(ISTHMUS_WORKER_BIN, argv.data());
      _exit(127);
    }
  }
  // Exit code, or -signal; -1000 on timeout (then the process is killed).
  int Wait(int timeout_s = 90) {
    for (int i = 0; i < timeout_s * 20; ++i) {
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
      }
      ::usleep(50'000);
    }
    Kill();
    return -1000;
  }
  void Kill() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      pid = -1;
    }
  }
  std::string Log() const {
    std::ifstream in(log);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  ~WorkerProcess() { Kill(); }
};

// Runs `isthmus-worker init` and returns the base hash it prints.
std::string RunInit(const fs::path& dir, uint64_t seed, const std::string& base_name) {
  std::string cmd = std::string(ISTHMUS_WORKER_BIN) + " init";
  for (const auto& f : kModelFlags) cmd += " " + f;
  cmd += " --seed " + std::to_string(seed) + " --out " +
         (dir / (base_name + ".init.safetensors")).string() + " --write-base " +
         (dir / (base_name + ".safetensors")).string() + " 2>/dev/null";
  FILE* p = ::popen(cmd.c_str(), "r");
  char buf[256] = {0};
  std::string out;
  while (p && std::fgets(buf, sizeof buf, p)) out += buf;
  int rc = p ? ::pclose(p) : -1;
  EXPECT_EQ(rc, 0) << cmd;
  while (!out.empty() && (out.back() == '\n')) out.pop_back();
  return out;
}

// Random byte text as uint16 tokens.
void WriteTokens(const fs::path& path, size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint16_t> t(n);
  for (auto& x : t) x = static_cast<uint16_t>(97 + gen() % 8);  // a small alphabet: learnable
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(t.size() * 2));
}

class WorkerWithShards : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("isthmus-wpt-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "data");
    WriteTokens(dir_ / "data" / "train.bin", 20000, 1);
    WriteTokens(dir_ / "data" / "val.bin", 2000, 2);
    // One worker key on both shards' allowlists.
    ASSERT_TRUE(WriteKeyPairFiles((shards_[1].dir() / "workers" / "w-shared").string(),
                                  shards_[0].worker_keys(), true)
                    .ok());
    for (auto& s : shards_) ASSERT_TRUE(s.Start());
    base_hash_ = RunInit(dir_, 1, "base");
    ASSERT_EQ(base_hash_.size(), 64u);
    CreateJob();
  }
  void TearDown() override { fs::remove_all(dir_); }

  void CreateJob() {
    auto init = ReadSafetensorsTensors((dir_ / "base.init.safetensors").string());
    ASSERT_TRUE(init.ok()) << init.status().ToString();
    init_ = *init;
    std::vector<TensorSize> sizes;
    for (const auto& t : init_) sizes.push_back({t.name, t.data.size() * 4});
    auto placement = AssignTensorsToShards(sizes, 2);
    for (int s = 0; s < 2; ++s) {
      std::vector<TensorView> views;
      for (size_t i = 0; i < init_.size(); ++i) {
        if (placement[i] == s)
          views.push_back({init_[i].name, init_[i].shape, init_[i].data.data()});
      }
      auto admin = shards_[s].AdminClient();
      auto r = admin->CreateJob("j", base_hash_, views);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
    }
  }

  std::vector<std::string> TrainArgs(int rank, int world, int max_rounds, int h,
                                     const std::string& rendezvous = "") {
    std::vector<std::string> a = {"train"};
    a.insert(a.end(), kModelFlags.begin(), kModelFlags.end());
    std::vector<std::string> more = {"--base",
                                     (dir_ / "base.safetensors").string(),
                                     "--data",
                                     (dir_ / "data").string(),
                                     "--job",
                                     "j",
                                     "--server",
                                     ServerProcess::Endpoint(shards_[0].worker_port()),
                                     "--server",
                                     ServerProcess::Endpoint(shards_[1].worker_port()),
                                     "--server-key",
                                     (shards_[0].dir() / "server.pub").string(),
                                     "--server-key",
                                     (shards_[1].dir() / "server.pub").string(),
                                     "--key",
                                     (shards_[0].dir() / "workers" / "w0.key").string(),
                                     "--rank",
                                     std::to_string(rank),
                                     "--world-size",
                                     std::to_string(world),
                                     "--max-rounds",
                                     std::to_string(max_rounds),
                                     "--steps-per-round",
                                     std::to_string(h),
                                     "--batch-size",
                                     "2",
                                     "--lr",
                                     "0.01",
                                     "--warmup-steps",
                                     "1",
                                     "--val-batches",
                                     "2",
                                     "--log-every",
                                     "1",
                                     "--checkpoint-dir",
                                     (dir_ / "ckpt").string(),
                                     "--request-timeout-ms",
                                     "5000"};
    a.insert(a.end(), more.begin(), more.end());
    if (!rendezvous.empty()) {
      a.push_back("--rendezvous");
      a.push_back(rendezvous);
    }
    return a;
  }

  // The union of both shards' tensors, by name.
  std::map<std::string, std::vector<float>> ShardTensors() {
    std::map<std::string, std::vector<float>> out;
    for (auto& s : shards_) {
      auto w = s.WorkerClient();
      auto p = w->Pull("j");
      EXPECT_TRUE(p.ok()) << p.status().ToString();
      if (p.ok()) {
        for (auto& t : p->tensors) out[t.name] = t.data;
      }
    }
    return out;
  }

  // Checks that both shards hold exactly rank `rank`'s checkpointed tensors, that each
  // shard applied `rounds` pushes, and that training moved the tensors.
  void ExpectShardsEqualCheckpoint(int rank, uint64_t rounds) {
    auto ckpt = ReadSafetensors(
        (dir_ / "ckpt" / ("rank-" + std::to_string(rank) + ".safetensors")).string());
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    EXPECT_EQ(ckpt->metadata["round"], std::to_string(rounds));
    auto shard = ShardTensors();
    size_t compared = 0;
    double moved = 0;
    for (const auto& t : ckpt->tensors) {
      if (t.name.rfind("opt.", 0) == 0) continue;
      ASSERT_TRUE(shard.count(t.name)) << t.name;
      EXPECT_EQ(shard[t.name], t.data) << t.name << " differs between shard and worker";
      ++compared;
    }
    EXPECT_EQ(compared, init_.size());
    for (const auto& t : init_) {
      for (size_t k = 0; k < t.data.size(); ++k)
        moved = std::max(moved, double(std::abs(shard[t.name][k] - t.data[k])));
    }
    EXPECT_GT(moved, 1e-4) << "the shards' tensors never changed";
    for (auto& s : shards_) {
      auto info = s.AdminClient()->DescribeJob("j");
      ASSERT_TRUE(info.ok()) << info.status().ToString();
      EXPECT_EQ(info->pushes, rounds) << "each round must be applied exactly once per shard";
      auto hello = s.WorkerClient()->Hello("j", wire::Role::Worker, base_hash_, "check");
      ASSERT_TRUE(hello.ok());
      EXPECT_EQ(hello->rounds.local_round, rounds);
    }
  }

  fs::path dir_;
  ServerProcess shards_[2];
  std::string base_hash_;
  std::vector<Tensor> init_;
};

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

TEST_F(WorkerWithShards, KilledWorkerResumesWithoutApplyingARoundTwice) {
  WorkerProcess w;
  w.Start(TrainArgs(0, 1, 6, 2), (dir_ / "w1.log").string());
  // Kill once the shards have seen round 2.
  bool reached = false;
  for (int i = 0; i < 600 && !reached; ++i) {
    auto h = shards_[1].WorkerClient()->Hello("j", wire::Role::Worker, base_hash_, "probe");
    reached = h.ok() && h->rounds.local_round >= 2;
    if (!reached) ::usleep(50'000);
  }
  ASSERT_TRUE(reached) << w.Log();
  w.Kill();
  WorkerProcess again;
  again.Start(TrainArgs(0, 1, 6, 2), (dir_ / "w2.log").string());
  ASSERT_EQ(again.Wait(), 0) << again.Log();
  EXPECT_NE(again.Log().find("done: 6 rounds"), std::string::npos) << again.Log();
  ExpectShardsEqualCheckpoint(0, 6);
}

TEST_F(WorkerWithShards, CrashBetweenPushAndCheckpointIsRedoneAsDuplicate) {
  WorkerProcess w;
  w.Start(TrainArgs(0, 1, 4, 2), (dir_ / "w1.log").string(), "2");
  ASSERT_EQ(w.Wait(), 137) << w.Log();
  auto ckpt = ReadSafetensors((dir_ / "ckpt" / "rank-0.safetensors").string());
  ASSERT_TRUE(ckpt.ok());
  EXPECT_EQ(ckpt->metadata["round"], "1");  // round 2 was pushed but not checkpointed
  WorkerProcess again;
  again.Start(TrainArgs(0, 1, 4, 2), (dir_ / "w2.log").string());
  ASSERT_EQ(again.Wait(), 0) << again.Log();
  EXPECT_NE(again.Log().find("redoing it from the checkpoint"), std::string::npos) << again.Log();
  EXPECT_NE(again.Log().find("nothing applied twice"), std::string::npos) << again.Log();
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
// (and say so) instead of pushing more.
TEST(WorkerWanWait, WaitsPastKRoundsAheadAndSaysSo) {
  fs::path dir = fs::temp_directory_path() / ("isthmus-wan-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "data");
  WriteTokens(dir / "data" / "train.bin", 20000, 1);
  WriteTokens(dir / "data" / "val.bin", 2000, 2);
  ServerProcess shard;
  auto peer_keys = GenerateKeyPair();
  ASSERT_TRUE(peer_keys.ok());
  ASSERT_TRUE(WriteKeyPairFiles((dir / "siteB").string(), *peer_keys, true).ok());
  shard.set_extra("[sync]\nsite = \"A\"\nmax_rounds_ahead = 1\npeers = [\"B=tcp://127.0.0.1:" +
                  std::to_string(testing::FreePort()) + "=" + (dir / "siteB.pub").string() + "\"]\n");
  // listen.peer through the environment (the generated TOML already has a [listen] table).
  std::string peer_ep = ServerProcess::Endpoint(testing::FreePort());
  ::setenv("ISTHMUS_LISTEN_PEER", peer_ep.c_str(), 1);
  bool started = shard.Start();
  ::unsetenv("ISTHMUS_LISTEN_PEER");
  ASSERT_TRUE(started);
  std::string base_hash = RunInit(dir, 1, "base");
  auto init = ReadSafetensorsTensors((dir / "base.init.safetensors").string());
  ASSERT_TRUE(init.ok());
  std::vector<TensorView> views;
  for (const auto& t : *init) views.push_back({t.name, t.shape, t.data.data()});
  ASSERT_TRUE(shard.AdminClient()->CreateJob("j", base_hash, views).ok());

  std::vector<std::string> args = {"train"};
  args.insert(args.end(), kModelFlags.begin(), kModelFlags.end());
  std::vector<std::string> more = {"--base", (dir / "base.safetensors").string(),
                                   "--data", (dir / "data").string(),
                                   "--job", "j",
                                   "--server", ServerProcess::Endpoint(shard.worker_port()),
                                   "--server-key", (shard.dir() / "server.pub").string(),
                                   "--key", (shard.dir() / "workers" / "w0.key").string(),
                                   "--max-rounds", "5", "--steps-per-round", "2",
                                   "--batch-size", "2", "--log-every", "1"};
  args.insert(args.end(), more.begin(), more.end());
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
  ::usleep(1'000'000);  // it keeps waiting: no further round is pushed
  auto hello = shard.WorkerClient()->Hello("j", wire::Role::Worker, base_hash, "probe");
  ASSERT_TRUE(hello.ok()) << hello.status().ToString();
  EXPECT_EQ(hello->rounds.committed_round, 0u);
  EXPECT_EQ(hello->rounds.local_round, 2u);  // K + 1 rounds closed, then the worker waits
  EXPECT_EQ(hello->rounds.max_rounds_ahead, 1u);
  int status = 0;
  EXPECT_EQ(::waitpid(w.pid, &status, WNOHANG), 0) << "the worker should still be waiting";
  EXPECT_NE(w.Log().find("limit 1"), std::string::npos) << w.Log();
  w.Kill();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace isthmus
