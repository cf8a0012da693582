// Test harness for isthmus-worker processes against real isthmus-server shards on loopback
// (CURVE on): a worker process handle, `isthmus-worker init`, token files, and a fixture
// with two shards holding a job created from the worker's initial tensors. Shared by
// tests/worker/worker_process_test.cc (CPU) and tests/gpu/gpu_worker_test.cc (--device
// cuda). Users define ISTHMUS_SERVER_BIN and ISTHMUS_WORKER_BIN (environment variables of
// the same names override them at run time).
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "common/sharding.h"
#include "tests/integration/server_process.h"
#include "tests/sync_net/site_process.h"
#include "tests/test_dir.h"

namespace isthmus::testing {

namespace fs = std::filesystem;

inline const std::vector<std::string> kModelFlags = {
    "--layers", "2", "--width", "32", "--heads", "2", "--context", "16", "--lora-rank", "4"};
// The training settings every worker of these tests uses.
inline const std::vector<std::string> kTrainFlags = {"--batch-size",   "2", "--lr",          "0.01",
                                                     "--warmup-steps", "1", "--val-batches", "2",
                                                     "--log-every",    "1"};

// A running or finished isthmus-worker process.
struct WorkerProcess {
  pid_t pid = -1;
  std::string log;
  // Environment variables the next Start sets in the child (test hooks).
  std::vector<std::pair<std::string, std::string>> env;

  // fault_env: the round at which the worker exits with 137 after pushing it (or, with
  // fault_name ISTHMUS_WORKER_FAULT_CRASH_BEFORE_PUSH, before pushing it).
  void Start(const std::vector<std::string>& args, const std::string& log_path,
             const std::string& fault_env = "",
             const char* fault_name = "ISTHMUS_WORKER_FAULT_CRASH_AFTER_PUSH") {
    log = log_path;
    pid = ::fork();
    if (pid == 0) {
      std::freopen(log_path.c_str(), "w", stderr);
      std::freopen("/dev/null", "w", stdout);
      if (!fault_env.empty()) ::setenv(fault_name, fault_env.c_str(), 1);
      for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      ::setenv("OMP_NUM_THREADS", "1", 1);
      std::vector<char*> argv;
      const char* bin = BinaryPath("ISTHMUS_WORKER_BIN", ISTHMUS_WORKER_BIN);
      argv.push_back(const_cast<char*>(bin));
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(bin, argv.data());
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
inline std::string RunInit(const fs::path& dir, uint64_t seed, const std::string& base_name,
                           const std::vector<std::string>& extra = {}) {
  std::string cmd = std::string(BinaryPath("ISTHMUS_WORKER_BIN", ISTHMUS_WORKER_BIN)) + " init";
  for (const auto& f : kModelFlags) cmd += " " + f;
  for (const auto& f : extra) cmd += " " + f;
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
inline void WriteTokens(const fs::path& path, size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint16_t> t(n);
  for (auto& x : t) x = static_cast<uint16_t>(97 + gen() % 8);  // a small alphabet: learnable
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(t.size() * 2));
}

// Creates job "j" on one shard from the initial tensors `isthmus-worker init` wrote into
// `dir` (base name "base") and returns the base hash.
// A fresh folder "isthmus-<tag>-<pid>" under the temporary directory with a small token
// shard in data/ (train.bin and val.bin), for standalone ranks.
inline fs::path StandaloneDir(const std::string& tag) {
  fs::path dir = fs::temp_directory_path() / ("isthmus-" + tag + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "data");
  WriteTokens(dir / "data" / "train.bin", 5000, 1);
  WriteTokens(dir / "data" / "val.bin", 1000, 2);
  return dir;
}

// The arguments of standalone rank `rank` of `world` (full mode, tokens in dir/data,
// meeting at `rdv`), training to `max_steps` and saving the weights to `save` (rank 0),
// with `extra` appended.
inline std::vector<std::string> StandaloneRankArgs(const fs::path& dir, int rank, int world,
                                                   const std::string& rdv, int max_steps,
                                                   const fs::path& save,
                                                   const std::vector<std::string>& extra) {
  std::vector<std::string> a = {"train"};
  a.insert(a.end(), kModelFlags.begin(), kModelFlags.end());
  a.insert(a.end(), kTrainFlags.begin(), kTrainFlags.end());
  const std::vector<std::string> more = {"--standalone",
                                         "--max-steps",
                                         std::to_string(max_steps),
                                         "--mode",
                                         "full",
                                         "--world-size",
                                         std::to_string(world),
                                         "--rank",
                                         std::to_string(rank),
                                         "--rendezvous",
                                         rdv,
                                         "--comm-timeout",
                                         "30",
                                         "--data",
                                         (dir / "data").string(),
                                         "--save",
                                         save.string()};
  a.insert(a.end(), more.begin(), more.end());
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// Two standalone rank processes of one site (full mode, 4 steps on tokens in dir/data),
// rank r with extra[r] appended; rank 0 saves the weights to dir/<name>.safetensors.
// Returns both exit codes and both logs.
struct TwoRanksRun {
  int rc0 = -1, rc1 = -1;
  std::string log;
};
inline TwoRanksRun RunTwoStandaloneRanks(const fs::path& dir, const std::string& name,
                                         const std::vector<std::string>& extra0,
                                         const std::vector<std::string>& extra1) {
  const std::string rdv = "tcp:127.0.0.1:" + std::to_string(FreePort());
  const fs::path save = dir / (name + ".safetensors");
  WorkerProcess r0, r1;
  r0.Start(StandaloneRankArgs(dir, 0, 2, rdv, 4, save, extra0), (dir / (name + "-0.log")).string());
  r1.Start(StandaloneRankArgs(dir, 1, 2, rdv, 4, save, extra1), (dir / (name + "-1.log")).string());
  TwoRanksRun run;
  run.rc0 = r0.Wait();
  run.rc1 = r1.Wait();
  run.log = r0.Log() + r1.Log();
  return run;
}

inline std::string CreateJobFromInit(ServerProcess& shard, const fs::path& dir) {
  const std::string base_hash = RunInit(dir, 1, "base");
  auto init = ReadSafetensorsTensors((dir / "base.init.safetensors").string());
  EXPECT_TRUE(init.ok());
  if (!init.ok()) return base_hash;
  std::vector<TensorView> views;
  for (const auto& t : *init) views.push_back({t.name, t.shape, t.data.data()});
  auto r = shard.AdminClient()->CreateJob("j", base_hash, views);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return base_hash;
}

// The `isthmus-worker train` command line of one rank training job j on a single shard,
// with the model of kModelFlags, the base and data in `dir`, and `extra` flags.
inline std::vector<std::string> SingleShardTrainArgs(const ServerProcess& shard,
                                                     const fs::path& dir,
                                                     const std::vector<std::string>& extra) {
  std::vector<std::string> a = {"train"};
  a.insert(a.end(), kModelFlags.begin(), kModelFlags.end());
  a.insert(a.end(), kTrainFlags.begin(), kTrainFlags.end());
  for (const std::string& f :
       {std::string("--base"), (dir / "base.safetensors").string(), std::string("--data"),
        (dir / "data").string(), std::string("--job"), std::string("j"), std::string("--server"),
        ServerProcess::Endpoint(shard.worker_port()), std::string("--server-key"),
        (shard.dir() / "server.pub").string(), std::string("--key"),
        (shard.dir() / "workers" / "w0.key").string()}) {
    a.push_back(f);
  }
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// Starts `shard` as the only shard of site A whose one peer, site B, never runs (its key
// pair is written into `dir`): nothing ever commits, so a worker runs K =
// sync.max_rounds_ahead rounds ahead and then waits. listen.peer, and listen.metrics on
// `metrics_port` when positive, go through the environment (the config already has its
// [listen] table).
inline ::testing::AssertionResult StartSiteWithSilentPeer(ServerProcess& shard, const fs::path& dir,
                                                          int k, int metrics_port = 0) {
  auto peer_keys = GenerateKeyPair();
  if (!peer_keys.ok() || !WriteKeyPairFiles((dir / "siteB").string(), *peer_keys, true).ok()) {
    return ::testing::AssertionFailure() << "cannot write site B's keys";
  }
  shard.set_extra("[sync]\nsite = \"A\"\nmax_rounds_ahead = " + std::to_string(k) +
                  "\npeers = [\"B=tcp://127.0.0.1:" + std::to_string(FreePort()) + "=" +
                  (dir / "siteB.pub").string() + "\"]\n");
  const std::string peer_ep = ServerProcess::Endpoint(FreePort());
  const std::string metrics = "127.0.0.1:" + std::to_string(metrics_port);
  ::setenv("ISTHMUS_LISTEN_PEER", peer_ep.c_str(), 1);
  if (metrics_port > 0) ::setenv("ISTHMUS_LISTEN_METRICS", metrics.c_str(), 1);
  auto started = shard.Start();
  ::unsetenv("ISTHMUS_LISTEN_PEER");
  ::unsetenv("ISTHMUS_LISTEN_METRICS");
  return started;
}

class WorkerWithShards : public testing::TestWithDir {
 protected:
  WorkerWithShards() : TestWithDir("isthmus-wpt") {}
  void SetUp() override {
    TestWithDir::SetUp();
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
  // Waits (up to 30 s) until shard `s` has closed round `round` of job j.
  bool ShardReachedRound(int s, uint64_t round) {
    for (int i = 0; i < 600; ++i) {
      auto h = shards_[s].WorkerClient()->Hello("j", wire::Role::Worker, base_hash_, "probe");
      if (h.ok() && h->rounds.local_round >= round) return true;
      ::usleep(50'000);
    }
    return false;
  }

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
                                     const std::string& rendezvous = "",
                                     const std::vector<std::string>& extra = {}) {
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
                                     "--checkpoint-dir",
                                     (dir_ / "ckpt").string(),
                                     "--request-timeout-ms",
                                     "5000"};
    a.insert(a.end(), more.begin(), more.end());
    a.insert(a.end(), kTrainFlags.begin(), kTrainFlags.end());
    if (!rendezvous.empty()) {
      a.push_back("--rendezvous");
      a.push_back(rendezvous);
    }
    a.insert(a.end(), extra.begin(), extra.end());
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
      // Not optimizer state, nor --encode-deltas' residual.
      if (t.name.rfind("opt.", 0) == 0 || t.name.rfind("residual.", 0) == 0) continue;
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

  ServerProcess shards_[2];
  std::string base_hash_;
  std::vector<Tensor> init_;
};

// Two sites (one shard each, peered over CURVE, sync on) train one job with one worker
// process each; each site's worker gets its own extra flags (--device, --precision), so
// the sites may differ in hardware and precision. Run() returns once both workers exited;
// the test then checks their exit codes and the sites' commits.
class TwoSites {
 public:
  explicit TwoSites(const std::string& name)
      : root_(fs::temp_directory_path() /
              ("isthmus-2site-" + name + "-" + std::to_string(::getpid()))) {
    fs::remove_all(root_);
    fs::create_directories(root_ / "data");
    WriteTokens(root_ / "data" / "train.bin", 20000, 1);
    WriteTokens(root_ / "data" / "val.bin", 2000, 2);
    sites_.push_back(std::make_unique<SiteProcess>("alpha", root_));
    sites_.push_back(std::make_unique<SiteProcess>("beta", root_));
  }
  ~TwoSites() {
    sites_.clear();
    if (!::testing::Test::HasFailure()) fs::remove_all(root_);
  }

  // Starts both sites and creates the job from `isthmus-worker init`. `extra_sync`: more
  // lines of the sites' [sync] tables; `init`: more flags of init (--mode full).
  ::testing::AssertionResult Start(int rounds_ahead = 2, const std::string& extra_sync = "",
                                   const std::vector<std::string>& init = {}) {
    std::vector<SiteProcess*> all = {sites_[0].get(), sites_[1].get()};
    for (auto& s : sites_) {
      s->Configure(all, "max_rounds_ahead = " + std::to_string(rounds_ahead) + "\n" + extra_sync);
      if (auto r = s->Start(); !r) return r;
    }
    base_hash_ = RunInit(root_, 1, "base", init);
    auto start = ReadSafetensorsTensors((root_ / "base.init.safetensors").string());
    if (!start.ok()) return ::testing::AssertionFailure() << start.status().ToString();
    std::vector<TensorView> views;
    for (const auto& t : *start) views.push_back({t.name, t.shape, t.data.data()});
    for (auto& s : sites_) {
      auto r = s->AdminClient()->CreateJob("j", base_hash_, views);
      if (!r.ok())
        return ::testing::AssertionFailure() << s->site() << ": " << r.status().ToString();
    }
    return ::testing::AssertionSuccess();
  }

  // Runs one worker per site for `rounds` rounds of `h` steps; returns their exit codes.
  std::pair<int, int> Run(int rounds, int h, const std::vector<std::string>& alpha_flags,
                          const std::vector<std::string>& beta_flags) {
    auto rc = RunOn({0, 1}, rounds, h, {alpha_flags, beta_flags});
    return {rc[0], rc[1]};
  }

  // A third site joins the running job (docs/SYNC.md, "Joining"): the members add it to
  // their peers and restart, it starts without the job, and asks alpha to add it. Returns
  // once the addition applied on every site.
  ::testing::AssertionResult Join(const std::string& name) {
    sites_.push_back(std::make_unique<SiteProcess>(name, root_));
    workers_.resize(sites_.size());
    std::vector<SiteProcess*> all;
    for (auto& s : sites_) all.push_back(s.get());
    for (auto& s : sites_) {
      s->Kill(SIGTERM);
      s->Configure(all, "max_rounds_ahead = 2");
      if (auto r = s->Start(); !r) return r;
    }
    // alpha's operator invites it (a join nobody invited is refused), then it asks alpha.
    auto invited = sites_.front()->AdminClient()->MembershipControl(wire::MembershipAction::Invite,
                                                                    name, "j", 600);
    if (!invited.ok()) return ::testing::AssertionFailure() << invited.status().ToString();
    auto started =
        sites_.back()->AdminClient()->MembershipControl(wire::MembershipAction::Join, "alpha", "j");
    if (!started.ok()) return ::testing::AssertionFailure() << started.status().ToString();
    for (int t = 0; t < 600; ++t) {
      bool all_in = true;
      for (auto& s : sites_) {
        auto st = s->AdminClient(2000, 0)->SyncStatus();
        bool in = st.ok() && !st->jobs.empty() && !st->jobs[0].change_pending &&
                  std::find(st->jobs[0].members.begin(), st->jobs[0].members.end(), name) !=
                      st->jobs[0].members.end();
        all_in = all_in && in;
      }
      if (all_in) return ::testing::AssertionSuccess();
      ::usleep(50'000);
    }
    auto st = sites_.back()->AdminClient()->SyncStatus();
    return ::testing::AssertionFailure()
           << name << " did not join: " << (st.ok() && !st->jobs.empty() ? st->jobs[0].change : "")
           << "\n"
           << sites_.back()->Log();
  }

  // Runs one worker on each site of `which` (indexes) for `rounds` rounds (the total a
  // worker stops after) of `h` steps, with per-site extra flags; returns the exit codes.
  std::vector<int> RunOn(const std::vector<int>& which, int rounds, int h,
                         const std::vector<std::vector<std::string>>& extra = {}) {
    for (size_t k = 0; k < which.size(); ++k) {
      StartOn(which[k], rounds, h, k < extra.size() ? extra[k] : std::vector<std::string>{});
    }
    std::vector<int> rc;
    for (int i : which) rc.push_back(workers_[i].Wait(240));
    return rc;
  }

  // Starts the worker of site `i` (as RunOn does) without waiting for it; `env`: variables
  // set in its environment.
  void StartOn(int i, int rounds, int h, const std::vector<std::string>& extra,
               const std::vector<std::pair<std::string, std::string>>& env = {}) {
    workers_[i].env = env;
    workers_[i].Start(
        Args(i, rounds, h, extra),
        (root_ / (sites_[i]->site() + "-" + std::to_string(runs_++) + ".log")).string());
  }
  // The arguments of StartOn's worker (another rank of the site adds --rank).
  std::vector<std::string> Args(int i, int rounds, int h, const std::vector<std::string>& extra) {
    {
      SiteProcess& s = *sites_[i];
      std::vector<std::string> a = {"train"};
      a.insert(a.end(), kModelFlags.begin(), kModelFlags.end());
      std::vector<std::string> more = {"--base",
                                       (root_ / "base.safetensors").string(),
                                       "--data",
                                       (root_ / "data").string(),
                                       "--job",
                                       "j",
                                       "--server",
                                       ServerProcess::Endpoint(s.worker_port()),
                                       "--server-key",
                                       (s.dir() / "server.pub").string(),
                                       "--key",
                                       (s.dir() / "workers" / "w0.key").string(),
                                       "--client-name",
                                       s.site(),
                                       "--max-rounds",
                                       std::to_string(rounds),
                                       "--steps-per-round",
                                       std::to_string(h)};
      a.insert(a.end(), more.begin(), more.end());
      a.insert(a.end(), kTrainFlags.begin(), kTrainFlags.end());
      a.insert(a.end(), extra.begin(), extra.end());
      // Each site's checkpoints in its own folder, so a later run resumes from them.
      a.push_back("--checkpoint-dir");
      a.push_back((root_ / ("ckpt-" + s.site())).string());
      return a;
    }
  }
  // Waits for the worker of site `i` (StartOn); its exit code.
  int WaitOn(int i, int timeout_s = 240) { return workers_[i].Wait(timeout_s); }
  const fs::path& root() const { return root_; }
  SiteProcess& site(int i) { return *sites_[i]; }

  // Waits until both sites committed `round`; then their digests of every round so far
  // must be identical.
  void ExpectCommittedAlike(uint64_t round) {
    for (int t = 0; t < 600; ++t) {
      bool all = true;
      for (auto& s : sites_) {
        auto d = s->AdminClient(2000, 0)->Digests("j", 0);
        all = all && d.ok() && d->committed_round >= round;
      }
      if (all) break;
      ::usleep(50'000);
    }
    std::vector<std::vector<std::pair<uint64_t, std::string>>> digests;
    for (auto& s : sites_) {
      auto d = s->AdminClient()->Digests("j", 0);
      ASSERT_TRUE(d.ok()) << d.status().ToString();
      ASSERT_GE(d->committed_round, round) << s->site() << " did not commit; log:\n" << s->Log();
      digests.push_back(d->digests);
    }
    ASSERT_GE(digests[0].size(), round + 1);
    for (size_t i = 1; i < digests.size(); ++i) {
      // A site that joined holds digests from the round it joined at on.
      for (const auto& [r, d] : digests[i]) {
        if (r > round) continue;
        ASSERT_GT(digests[0].size(), r);
        EXPECT_EQ(digests[0][r], std::make_pair(r, d))
            << "round " << r << " differs between alpha and " << sites_[i]->site();
      }
    }
  }
  // The digests site `i` holds (round, digest).
  std::vector<std::pair<uint64_t, std::string>> Digests(int i) {
    auto d = sites_[i]->AdminClient()->Digests("j", 0);
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    return d.ok() ? d->digests : std::vector<std::pair<uint64_t, std::string>>{};
  }

  const WorkerProcess& worker(int i) const { return workers_[i]; }

 private:
  fs::path root_;
  std::vector<std::unique_ptr<SiteProcess>> sites_;
  std::vector<WorkerProcess> workers_ = std::vector<WorkerProcess>(2);
  std::string base_hash_;
  int runs_ = 0;
};

}  // namespace isthmus::testing
