// isthmusctl fleet init, fleet add-site and top against real isthmus-server processes on
// loopback (CURVE, RocksDB). Fleet: a two-site, two-shard fleet written by fleet init starts
// from its files unchanged, the job is created with nothing but the generated env files,
// rounds pushed with the generated worker settings commit on every shard, and sync verify
// finds the sites agreeing; a third site added with fleet add-site (every existing key file
// unchanged) joins once the others restarted with the new configs, and the three agree from
// the round it holds; and isthmus-worker ranks train with `--config worker.toml` as fleet
// init wrote it. Top: JSON lines with rates from pushes made between two samples, plain
// snapshots off a terminal, a shard that does not answer, and a clean stop by signal (on a
// pseudo-terminal too).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <toml.hpp>
#include <vector>

#include "common/client.h"
#include "common/keys.h"
#include "common/safetensors.h"
#include "tests/loopback.h"
#include "tests/metrics/scrape.h"
#include "tests/sync_net/site_process.h"
#include "tests/worker/worker_harness.h"

namespace isthmus {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing::BinaryPath;
using testing::SiteProcess;
using namespace std::chrono_literals;

const char* Ctl() { return BinaryPath("ISTHMUS_CTL_BIN", ISTHMUS_CTL_BIN); }
const char* Server() { return BinaryPath("ISTHMUS_SERVER_BIN", ISTHMUS_SERVER_BIN); }

// Runs `command` in sh; returns its exit code and standard output (stderr too when
// `with_stderr`).
std::pair<int, std::string> Shell(const std::string& command, bool with_stderr = true) {
  FILE* f = ::popen((command + (with_stderr ? " 2>&1" : "")).c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, f)) out.append(buf, n);
  const int status = ::pclose(f);
  if (std::getenv("ISTHMUS_TEST_SHOW_CTL") != nullptr) {
    std::fprintf(stderr, "$ %s\n%s", command.c_str(), out.c_str());
  }
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::string Quote(const std::string& s) { return "'" + s + "'"; }

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t nl = text.find('\n', start);
    if (nl == std::string::npos) nl = text.size();
    out.push_back(text.substr(start, nl - start));
    start = nl + 1;
  }
  return out;
}

// A process started from argv, its stderr (and stdout unless given) into `log`.
class Process {
 public:
  void Start(const std::vector<std::string>& argv, const std::string& log,
             const std::string& out = "") {
    log_ = log;
    pid_ = ::fork();
    if (pid_ == 0) {
      std::freopen(log.c_str(), "w", stderr);
      std::freopen(out.empty() ? log.c_str() : out.c_str(), out.empty() ? "a" : "w", stdout);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      _exit(127);
    }
  }
  // Exit code, -signal, or -1000 when still running after `limit` (then killed).
  int Wait(std::chrono::seconds limit = 60s) {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (pid_ > 0) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
      }
      if (std::chrono::steady_clock::now() > end) {
        Stop(SIGKILL);
        return -1000;
      }
      std::this_thread::sleep_for(20ms);
    }
    return -1;
  }
  void Stop(int sig) {
    if (pid_ <= 0) return;
    ::kill(pid_, sig);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  void Signal(int sig) const {
    if (pid_ > 0) ::kill(pid_, sig);
  }
  std::string Log() const {
    std::ifstream in(log_);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  ~Process() { Stop(SIGKILL); }

 private:
  pid_t pid_ = -1;
  std::string log_;
};

fs::path TestRoot(const char* what) {
  return fs::temp_directory_path() /
         (std::string("isthmus-") + what + "-" +
          ::testing::UnitTest::GetInstance()->current_test_info()->name() + "-" +
          std::to_string(::getpid()));
}

// --- fleet init ---------------------------------------------------------------------------

class FleetProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = TestRoot("fleet");
    out_ = root_ / "fleet";
    fs::remove_all(root_);
    fs::create_directories(root_ / "logs");
  }
  void TearDown() override {
    for (auto& s : servers_) s->Stop(SIGTERM);
    servers_.clear();
    if (!HasFailure()) fs::remove_all(root_);
  }

  // fleet init for sites A and B, two shards each, on loopback: each site's folder at
  // OUT/SITE as its configs say, data under OUT/data, bases from free ports.
  void InitFleet() {
    // Two bases whose 14 ports (shards 0 and 1: base..base+3, base+10..base+13) are free.
    base_a_ = testing::FreePortRange(14);
    base_b_ = testing::FreePortRange(14);
    for (int tries = 0; std::abs(base_b_ - base_a_) < 14 && tries < 100; ++tries) {
      base_b_ = testing::FreePortRange(14);
    }
    ASSERT_GT(base_a_, 0);
    ASSERT_GE(std::abs(base_b_ - base_a_), 14);
    auto [code, summary] = Shell(
        std::string(Ctl()) + " fleet init --sites A,B --shards 2 --out " + Quote(out_.string()) +
        " --host A=127.0.0.1 --host B=127.0.0.1 --base-port A=" + std::to_string(base_a_) +
        " --base-port B=" + std::to_string(base_b_) + " --etc " +
        Quote((out_ / "{site}").string()) + " --data " +
        Quote((out_ / "data" / "{site}").string()) + " --operator-key " +
        Quote((out_ / "admin" / "admin.key").string()) +
        " --job j --metrics --set sync.codec=int8+zstd --set sync.resend_ms=300 --set "
        "sync.backoff_max_ms=1500");
    ASSERT_EQ(code, 0) << summary;
    EXPECT_NE(summary.find("isthmus fleet: sites A, B; 2 shards per site"), std::string::npos)
        << summary;
    std::ifstream fleet_file(out_ / "fleet.json");
    fleet_ = json::parse(fleet_file);
    ASSERT_EQ(fleet_["sites"].size(), 2u);
  }

  // The four shards, each from its generated TOML as it is; returns once each site's shards
  // answer `isthmusctl status` run with nothing but the site's env file.
  void StartShards() {
    for (const std::string site : {"A", "B"}) {
      for (int i = 0; i < 2; ++i) {
        const std::string name = site + "-" + std::to_string(i);
        names_.push_back(name);
        servers_.push_back(std::make_unique<Process>());
        servers_.back()->Start({Server(), "--config", (out_ / site / (name + ".toml")).string()},
                               (root_ / "logs" / (name + ".log")).string());
      }
    }
    for (const std::string site : {"A", "B"}) {
      const auto [rc, text] = StatusOnceUp(site);
      ASSERT_EQ(rc, 0) << text << servers_[0]->Log();
      EXPECT_NE(text.find(site + "-0"), std::string::npos) << text;
      EXPECT_NE(text.find(site + "-1"), std::string::npos) << text;
    }
  }

  // isthmusctl ARGS with nothing but the site's env file (sourced, as an operator would).
  // `isthmusctl status` of `site`, asked until it succeeds (shards starting) for up to 60 s.
  std::pair<int, std::string> StatusOnceUp(const std::string& site) {
    int rc = -1;
    std::string text;
    const auto end = std::chrono::steady_clock::now() + 60s;
    while (rc != 0 && std::chrono::steady_clock::now() < end) {
      std::tie(rc, text) = WithEnv(site, "status --timeout-ms 2000");
      if (rc != 0) std::this_thread::sleep_for(200ms);
    }
    return {rc, text};
  }
  std::pair<int, std::string> WithEnv(const std::string& site, const std::string& args) {
    return Shell(
        "env -u ISTHMUS_CTL_SERVERS -u ISTHMUS_CTL_SERVER_KEYS -u ISTHMUS_CTL_KEY sh -c " +
        Quote(". " + (out_ / site / "isthmusctl.env").string() + " && exec " + Ctl() + " " + args));
  }

  // The job on both sites from `init` (the same file and base hash), with the env files.
  void CreateJob(const fs::path& init, const std::string& base_hash = "") {
    for (const std::string site : {"A", "B"}) {
      auto [rc, text] = WithEnv(site, "job create -j j -f " + init.string() +
                                          (base_hash.empty() ? "" : " --base-hash " + base_hash));
      ASSERT_EQ(rc, 0) << text;
      EXPECT_NE(text.find("shard 0: job 'j' created"), std::string::npos) << text;
      EXPECT_NE(text.find("shard 1: job 'j' created"), std::string::npos) << text;
    }
  }

  // An admin client of shard `i` of fleet.json's site `s`, from the fleet's own files.
  std::unique_ptr<ShardClient> Admin(size_t s, int i) {
    const json& shard = fleet_["sites"][s]["shards"][i];
    ClientOptions o;
    o.endpoint = shard["admin_endpoint"].get<std::string>();
    o.server_public_key =
        LoadPublicKeyFile((out_ / shard["public_key"].get<std::string>()).string()).value();
    o.client_keys = LoadKeyPairFile((out_ / "admin" / "admin.key").string()).value();
    o.timeout_ms = 2000;
    o.retries = 0;
    return ShardClient::Connect(o).value();
  }

  // Every shard of every site in fleet.json commits `rounds`; then sync verify, with the
  // endpoints and keys fleet.json names, finds the sites agreeing on every round from `from`
  // (the round a joined site holds first).
  void ExpectCommittedAndAgreeing(uint64_t rounds, uint64_t from = 0) {
    for (size_t s = 0; s < fleet_["sites"].size(); ++s) {
      for (int i = 0; i < 2; ++i) {
        auto admin = Admin(s, i);
        const auto end = std::chrono::steady_clock::now() + 60s;
        uint64_t committed = 0;
        while (committed < rounds && std::chrono::steady_clock::now() < end) {
          auto d = admin->Digests("j", 0);
          if (d.ok()) committed = d->committed_round;
          if (committed < rounds) std::this_thread::sleep_for(100ms);
        }
        EXPECT_EQ(committed, rounds) << fleet_["sites"][s]["site"] << " shard " << i << " log:\n"
                                     << servers_[s * 2 + i]->Log();
      }
    }
    std::string verify =
        std::string(Ctl()) + " sync verify -k " + Quote((out_ / "admin" / "admin.key").string());
    for (const auto& site : fleet_["sites"]) {
      std::string eps, keys;
      for (const auto& shard : site["shards"]) {
        eps += (eps.empty() ? "" : ",") + shard["admin_endpoint"].get<std::string>();
        keys +=
            (keys.empty() ? "" : ",") + (out_ / shard["public_key"].get<std::string>()).string();
      }
      const std::string name = site["site"].get<std::string>();
      verify += " --site " + name + "=" + eps + " --site-key " + name + "=" + keys;
    }
    auto [vcode, vout] = Shell(verify);
    EXPECT_EQ(vcode, 0) << vout;
    for (int i = 0; i < 2; ++i) {
      EXPECT_NE(vout.find("shard " + std::to_string(i) + " job j: " +
                          std::to_string(fleet_["sites"].size()) + " sites agree on rounds " +
                          std::to_string(from) + ".." + std::to_string(rounds)),
                std::string::npos)
          << vout;
    }
  }

  // Site s's delta of `round` pushed to each of its shards as its workers would, with the
  // worker settings fleet init (or add-site) wrote: shards in order, their keys, the site's
  // worker key.
  void PushRound(size_t s, uint64_t round) {
    const std::string site = fleet_["sites"][s]["site"].get<std::string>();
    const auto cfg = toml::parse((out_ / site / "worker.toml").string());
    const auto servers = toml::find<std::vector<std::string>>(cfg, "server");
    const auto keys = toml::find<std::vector<std::string>>(cfg, "server-key");
    ASSERT_EQ(toml::find<std::string>(cfg, "job"), "j");
    ASSERT_EQ(servers.size(), 2u);
    for (size_t i = 0; i < servers.size(); ++i) {
      ClientOptions o;
      o.endpoint = servers[i];
      o.server_public_key = LoadPublicKeyFile(keys[i]).value();
      o.client_keys = LoadKeyPairFile(toml::find<std::string>(cfg, "key")).value();
      o.timeout_ms = 5000;
      auto client = ShardClient::Connect(o).value();
      auto describe = Admin(s, static_cast<int>(i))->DescribeJob("j");
      ASSERT_TRUE(describe.ok()) << describe.status().ToString();
      std::vector<std::vector<float>> deltas;
      std::vector<TensorView> views;
      for (const auto& t : describe->tensors) {
        size_t n = 1;
        for (auto dim : t.shape) n *= static_cast<size_t>(dim);
        deltas.emplace_back(n);
        for (size_t k = 0; k < n; ++k) {
          deltas.back()[k] = 0.001f * std::cos(0.7f * k + round + 2.f * s);
        }
      }
      for (size_t t = 0; t < describe->tensors.size(); ++t) {
        views.push_back({describe->tensors[t].name, describe->tensors[t].shape, deltas[t].data()});
      }
      auto r = client->Push("j", site + "/r" + std::to_string(round) + "/s" + std::to_string(i),
                            round, 1000, views);
      ASSERT_TRUE(r.ok()) << site << " shard " << i << " round " << round << ": "
                          << r.status().ToString();
    }
  }

  // The shards of `site` from their TOMLs as they are now (appended to servers_, or replacing
  // its earlier processes, one at a time); returns once they answer status from the site's env
  // file.
  void StartSite(const std::string& site) {
    for (int i = 0; i < 2; ++i) {
      const std::string name = site + "-" + std::to_string(i);
      auto it = std::find(names_.begin(), names_.end(), name);
      if (it == names_.end()) {
        names_.push_back(name);
        servers_.push_back(std::make_unique<Process>());
        it = names_.end() - 1;
      }
      Process& p = *servers_[static_cast<size_t>(it - names_.begin())];
      p.Stop(SIGTERM);
      p.Start({Server(), "--config", (out_ / site / (name + ".toml")).string()},
              (root_ / "logs" / (name + ".log")).string());
    }
    const auto [rc, text] = StatusOnceUp(site);
    ASSERT_EQ(rc, 0) << text;
  }

  fs::path root_, out_;
  int base_a_ = 0, base_b_ = 0;
  json fleet_;
  std::vector<std::unique_ptr<Process>> servers_;
  std::vector<std::string> names_;  // servers_[k] runs shard names_[k]
};

TEST_F(FleetProcessTest, TwoSitesStartFromTheGeneratedFilesCommitRoundsAndAgree) {
  ASSERT_NO_FATAL_FAILURE(InitFleet());
  ASSERT_NO_FATAL_FAILURE(StartShards());
  std::vector<float> w(16 * 8), b(8), c(4 * 4), d(32);
  for (auto* v : {&w, &b, &c, &d}) {
    for (size_t k = 0; k < v->size(); ++k) (*v)[k] = 0.01f * std::sin(0.3f * k + v->size());
  }
  const fs::path init = root_ / "init.safetensors";
  ASSERT_TRUE(WriteSafetensors(init.string(),
                               {{"w", {16, 8}, w}, {"b", {8}, b}, {"c", {4, 4}, c}, {"d", {32}, d}},
                               {})
                  .ok());
  ASSERT_NO_FATAL_FAILURE(CreateJob(init));

  // Rounds pushed as a site's workers would, with the generated worker settings.
  constexpr uint64_t kRounds = 3;
  for (uint64_t round = 1; round <= kRounds; ++round) {
    for (size_t s = 0; s < 2; ++s) ASSERT_NO_FATAL_FAILURE(PushRound(s, round));
  }
  ExpectCommittedAndAgreeing(kRounds);
  // Each shard serves its metrics where fleet init put them.
  for (int base : {base_a_, base_b_}) {
    for (int i = 0; i < 2; ++i) {
      auto text = testing::Scrape(base + 10 * i + 3);
      ASSERT_TRUE(text.has_value()) << "no metrics on port " << base + 10 * i + 3;
      EXPECT_NE(text->find("isthmus_job_pushes_total"), std::string::npos);
    }
  }
  // And the site's view, from the env file alone.
  auto [tcode, tout] = WithEnv("B", "top --count 1");
  EXPECT_EQ(tcode, 0) << tout;
  EXPECT_NE(tout.find("2 of 2 shards up"), std::string::npos) << tout;
  EXPECT_NE(tout.find("int8+zstd"), std::string::npos) << "the codec of the last round\n" << tout;
}

TEST_F(FleetProcessTest, ASiteAddedWithAddSiteJoinsOnceTheOthersRestartedAndAgrees) {
  ASSERT_NO_FATAL_FAILURE(InitFleet());
  ASSERT_NO_FATAL_FAILURE(StartShards());
  std::vector<float> w(16 * 8), b(8);
  for (auto* v : {&w, &b}) {
    for (size_t k = 0; k < v->size(); ++k) (*v)[k] = 0.01f * std::sin(0.3f * k + v->size());
  }
  const fs::path init = root_ / "init.safetensors";
  ASSERT_TRUE(WriteSafetensors(init.string(), {{"w", {16, 8}, w}, {"b", {8}, b}}, {}).ok());
  ASSERT_NO_FATAL_FAILURE(CreateJob(init));
  for (uint64_t round = 1; round <= 2; ++round) {
    for (size_t s = 0; s < 2; ++s) ASSERT_NO_FATAL_FAILURE(PushRound(s, round));
  }
  ExpectCommittedAndAgreeing(2);

  // Site C, on this host at ports of its own; the existing keys stay as they were.
  int base_c = 0;
  for (int tries = 0; tries < 100; ++tries) {
    base_c = testing::FreePortRange(14);
    if (std::abs(base_c - base_a_) >= 14 && std::abs(base_c - base_b_) >= 14) break;
  }
  std::map<std::string, std::string> keys_before;
  for (const auto& e : fs::recursive_directory_iterator(out_)) {
    const auto ext = e.path().extension();
    if (ext == ".key" || ext == ".pub") {
      std::ifstream in(e.path());
      keys_before[e.path().string()] = std::string(std::istreambuf_iterator<char>(in), {});
    }
  }
  auto [code, steps] = Shell(std::string(Ctl()) + " fleet add-site --out " + Quote(out_.string()) +
                             " --site C --host 127.0.0.1 --base-port " + std::to_string(base_c));
  ASSERT_EQ(code, 0) << steps;
  EXPECT_NE(steps.find("systemctl restart isthmus-server@A-0 isthmus-server@A-1"),
            std::string::npos)
      << steps;
  EXPECT_NE(steps.find("isthmusctl sync join --from A -j j"), std::string::npos) << steps;
  EXPECT_NE(steps.find("isthmusctl sync invite --site C -j j"), std::string::npos) << steps;
  for (const auto& [path, text] : keys_before) {
    std::ifstream in(path);
    EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), text) << path << " changed";
  }
  auto [again, again_out] =
      Shell(std::string(Ctl()) + " fleet add-site --out " + Quote(out_.string()) + " --site C");
  EXPECT_EQ(again, 1) << again_out;
  EXPECT_NE(again_out.find("already in the fleet"), std::string::npos) << again_out;
  std::ifstream fleet_file(out_ / "fleet.json");
  fleet_ = json::parse(fleet_file);
  ASSERT_EQ(fleet_["sites"].size(), 3u);

  // As the steps say: each existing site restarts its shards with their new configs, then C
  // starts and joins from A.
  ASSERT_NO_FATAL_FAILURE(StartSite("A"));
  ASSERT_NO_FATAL_FAILURE(StartSite("B"));
  ASSERT_NO_FATAL_FAILURE(StartSite("C"));
  auto [icode, iout] = WithEnv("A", "sync invite --site C -j j");
  ASSERT_EQ(icode, 0) << iout;
  auto [jcode, jout] = WithEnv("C", "sync join --from A -j j --wait 90");
  ASSERT_EQ(jcode, 0) << jout;
  for (int i = 0; i < 2; ++i) {
    EXPECT_NE(jout.find("shard " + std::to_string(i) +
                        ": job j: applied: add C from round 3 (epoch 1), coordinated by A"),
              std::string::npos)
        << jout;
  }
  // Round 3 merges all three; the sites agree from the round C holds first (2).
  for (size_t s = 0; s < 3; ++s) ASSERT_NO_FATAL_FAILURE(PushRound(s, 3));
  ExpectCommittedAndAgreeing(3, 2);
}

TEST_F(FleetProcessTest, WorkersTrainFromTheGeneratedWorkerToml) {
  ASSERT_NO_FATAL_FAILURE(InitFleet());
  ASSERT_NO_FATAL_FAILURE(StartShards());
  const std::string base_hash = testing::RunInit(root_, 1, "base");
  ASSERT_EQ(base_hash.size(), 64u);
  ASSERT_NO_FATAL_FAILURE(CreateJob(root_ / "base.init.safetensors", base_hash));
  // One rank per site, each on its own data, with worker.toml for the job, the shards,
  // their keys and the worker key; the rest on the command line.
  constexpr int kRounds = 2;
  testing::WorkerProcess workers[2];
  for (int s = 0; s < 2; ++s) {
    const std::string site = s == 0 ? "A" : "B";
    const fs::path data = root_ / ("data-" + site);
    fs::create_directories(data);
    testing::WriteTokens(data / "train.bin", 20000, 1 + s);
    testing::WriteTokens(data / "val.bin", 2000, 11 + s);
    std::vector<std::string> args = {"train", "--config", (out_ / site / "worker.toml").string()};
    args.insert(args.end(), testing::kModelFlags.begin(), testing::kModelFlags.end());
    args.insert(args.end(), testing::kTrainFlags.begin(), testing::kTrainFlags.end());
    for (const std::string& a :
         {std::string("--base"), (root_ / "base.safetensors").string(), std::string("--data"),
          data.string(), std::string("--max-rounds"), std::to_string(kRounds),
          std::string("--steps-per-round"), std::string("2"), std::string("--checkpoint-dir"),
          (root_ / ("ckpt-" + site)).string()}) {
      args.push_back(a);
    }
    workers[s].Start(args, (root_ / "logs" / ("worker-" + site + ".log")).string());
  }
  for (auto& w : workers) EXPECT_EQ(w.Wait(100), 0) << w.Log();
  ExpectCommittedAndAgreeing(kRounds);
}

// --- top ----------------------------------------------------------------------------------

constexpr int64_t kRows = 16, kCols = 8;

class TopProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = TestRoot("top");
    fs::remove_all(root_);
    sites_.push_back(std::make_unique<SiteProcess>("alpha", root_));
    sites_.push_back(std::make_unique<SiteProcess>("beta", root_));
    std::vector<SiteProcess*> all = {sites_[0].get(), sites_[1].get()};
    std::vector<float> w(kRows * kCols, 0.01f), b(kCols, 0.02f);
    for (auto& s : sites_) {
      s->Configure(all, "codec = \"int8+zstd\"\n");
      ASSERT_TRUE(s->Start());
    }
    for (auto& s : sites_) {
      auto r = s->AdminClient()->CreateJob(
          "job", "base", {{"w", {kRows, kCols}, w.data()}, {"b", {kCols}, b.data()}});
      ASSERT_TRUE(r.ok()) << r.status().ToString();
    }
  }
  void TearDown() override {
    sites_.clear();
    if (!HasFailure()) fs::remove_all(root_);
  }

  // Connection flags for alpha's shard (plus `more`).
  std::string Flags(const std::string& more = "") {
    return " --server " + sites_[0]->admin_endpoint() + more + " --server-key " +
           (sites_[0]->dir() / "server.pub").string() + " --key " +
           (sites_[0]->dir() / "admins" / "a0.key").string();
  }
  void Push(int site, uint64_t round) {
    std::vector<float> w(kRows * kCols, 0.001f * (site + 1)), b(kCols, 0.002f);
    auto r = sites_[site]->WorkerClient()->Push(
        "job", sites_[site]->site() + "-r" + std::to_string(round), round, 1000,
        {{"w", {kRows, kCols}, w.data()}, {"b", {kCols}, b.data()}});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
  }
  std::vector<std::string> Keys(const json& j) {
    std::vector<std::string> out;
    for (const auto& [k, v] : j.items()) out.push_back(k);
    return out;
  }

  fs::path root_;
  std::vector<std::unique_ptr<SiteProcess>> sites_;
};

TEST_F(TopProcessTest, JsonLinesCarryTheStatusObjectsAndRatesOfPushesBetweenSamples) {
  // Two samples 2 s apart; the push goes in right after the first line arrives (the
  // interval leaves it time to land even under sanitizers).
  FILE* top = ::popen((std::string(Ctl()) + " top --json --count 2 --interval 2" + Flags() + " 2>" +
                       (root_ / "top.err").string())
                          .c_str(),
                      "r");
  ASSERT_NE(top, nullptr);
  char* line = nullptr;
  size_t cap = 0;
  ASSERT_GT(::getline(&line, &cap, top), 0);
  const json first = json::parse(line);
  Push(0, 1);
  ASSERT_GT(::getline(&line, &cap, top), 0);
  const json second = json::parse(line);
  EXPECT_EQ(::getline(&line, &cap, top), -1) << "exactly two lines for --count 2";
  std::free(line);
  const int status = ::pclose(top);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);

  for (const json* j : {&first, &second}) {
    EXPECT_TRUE((*j)["time"].is_number_float());
    EXPECT_DOUBLE_EQ((*j)["interval_s"].get<double>(), 2.0);
    ASSERT_EQ((*j)["shards"].size(), 1u);
    const json& s = (*j)["shards"][0];
    EXPECT_EQ(s["shard"], 0);
    EXPECT_EQ(s["endpoint"], sites_[0]->admin_endpoint());
    EXPECT_TRUE(s["reachable"].get<bool>());
    EXPECT_FALSE(s.contains("error"));
    EXPECT_EQ(s["stats"]["shard_id"], "alpha-0");
    EXPECT_EQ(s["sync"]["site"], "alpha");
    ASSERT_EQ(s["sync"]["links"].size(), 1u);
    EXPECT_EQ(s["sync"]["links"][0]["site"], "beta");
    EXPECT_TRUE(s["rates"]["links"].contains("beta"));
  }
  const json& a = first["shards"][0];
  const json& b = second["shards"][0];
  EXPECT_GT(second["time"].get<double>(), first["time"].get<double>() + 1.5);
  EXPECT_TRUE(a["rates"]["pushes_per_s"].is_null()) << "no rate on the first sample";
  EXPECT_TRUE(a["rates"]["links"]["beta"]["wire_sent_bytes_per_s"].is_null());
  EXPECT_EQ(a["stats"]["jobs"][0]["pushes"], 0);
  EXPECT_EQ(b["stats"]["jobs"][0]["pushes"], 1);
  const double pushes_per_s = b["rates"]["pushes_per_s"].get<double>();
  EXPECT_GT(pushes_per_s, 0.0);
  EXPECT_LT(pushes_per_s, 1.0) << "one push over about 2 s";
  EXPECT_GT(b["rates"]["links"]["beta"]["wire_sent_bytes_per_s"].get<double>(), 0.0)
      << "the round's delta went to beta";
  EXPECT_GE(b["rates"]["links"]["beta"]["wire_received_bytes_per_s"].get<double>(), 0.0);
  EXPECT_EQ(b["sync"]["jobs"][0]["local_round"], 1);
  EXPECT_EQ(b["sync"]["jobs"][0]["pipelines"]["int8+zstd"], 2);

  // "stats" and "sync" are the objects status --json and sync status --json print.
  auto [scode, sout] = Shell(std::string(Ctl()) + " status --json" + Flags(), false);
  ASSERT_EQ(scode, 0) << sout;
  json shard_status = json::parse(sout)[0];
  for (const char* k : {"endpoint", "shard_index", "reachable"}) shard_status.erase(k);
  EXPECT_EQ(Keys(b["stats"]), Keys(shard_status));
  EXPECT_EQ(Keys(b["stats"]["jobs"][0]), Keys(shard_status["jobs"][0]));
  auto [ycode, yout] = Shell(std::string(Ctl()) + " sync status --json" + Flags(), false);
  ASSERT_EQ(ycode, 0) << yout;
  json sync = json::parse(yout)[0];
  for (const char* k : {"endpoint", "reachable"}) sync.erase(k);
  EXPECT_EQ(Keys(b["sync"]), Keys(sync));
  EXPECT_EQ(Keys(b["sync"]["links"][0]), Keys(sync["links"][0]));
  EXPECT_EQ(Keys(b["sync"]["jobs"][0]), Keys(sync["jobs"][0]));
  EXPECT_EQ(b["sync"]["jobs"][0]["pipelines"], sync["jobs"][0]["pipelines"]);
}

TEST_F(TopProcessTest, PlainSnapshotsOffATerminal) {
  Push(0, 1);
  auto [code, text] = Shell(std::string(Ctl()) + " top --count 2 --interval 0.5" + Flags());
  EXPECT_EQ(code, 0) << text;
  EXPECT_EQ(text.find('\x1b'), std::string::npos) << "no terminal control off a terminal";
  int stamps = 0;
  for (const auto& l : Lines(text)) {
    EXPECT_LE(l.size(), 120u) << l;
    if (l.rfind("=== ", 0) == 0) {
      ++stamps;
      EXPECT_NE(l.find(" UTC  site alpha  1 of 1 shards up"), std::string::npos) << l;
    }
  }
  EXPECT_EQ(stamps, 2) << text;
  EXPECT_NE(text.find("shard 0  alpha-0  up  " + sites_[0]->admin_endpoint()), std::string::npos)
      << text;
  EXPECT_NE(text.find("PEER"), std::string::npos) << text;
  // The link's row (its state depends on timing: a slow, sanitized peer may be down).
  bool beta_row = false;
  for (const auto& l : Lines(text)) {
    beta_row =
        beta_row || (l.rfind("  beta ", 0) == 0 && (l.find(" connected ") != std::string::npos ||
                                                    l.find(" down ") != std::string::npos));
  }
  EXPECT_TRUE(beta_row) << text;
  EXPECT_NE(text.find("int8+zstd 2"), std::string::npos) << text;
}

TEST_F(TopProcessTest, AShardThatDoesNotAnswerIsDownAndSetsTheExitCode) {
  // 3 s per request: the live shard's first answer (a fresh CURVE connection) can take more
  // than half a second under TSan on a loaded machine.
  const std::string gone = testing::LoopbackEndpoint(testing::FreePort());
  auto [code, text] =
      Shell(std::string(Ctl()) + " top --count 1 --timeout-ms 3000" + Flags(" --server " + gone));
  EXPECT_EQ(code, 5) << "a shard that did not answer: exit 5\n" << text;
  EXPECT_NE(text.find("1 of 2 shards up"), std::string::npos) << text;
  EXPECT_NE(text.find("shard 0  alpha-0  up"), std::string::npos) << text;
  EXPECT_NE(text.find("shard 1  DOWN  " + gone), std::string::npos) << text;

  auto [jcode, jtext] = Shell(
      std::string(Ctl()) + " top --json --count 1 --timeout-ms 3000" + Flags(" --server " + gone),
      false);
  EXPECT_EQ(jcode, 5) << jtext;
  const json j = json::parse(jtext);
  ASSERT_EQ(j["shards"].size(), 2u);
  EXPECT_TRUE(j["shards"][0]["reachable"].get<bool>());
  EXPECT_FALSE(j["shards"][1]["reachable"].get<bool>());
  EXPECT_EQ(j["shards"][1]["endpoint"], gone);
  EXPECT_FALSE(j["shards"][1]["error"].get<std::string>().empty());
  EXPECT_TRUE(j["shards"][1]["stats"].is_null());
}

TEST_F(TopProcessTest, SigtermEndsAnOpenEndedViewWithExitZero) {
  Process top;
  const fs::path out = root_ / "top.out";
  top.Start({Ctl(), "top", "--interval", "0.2", "--server", sites_[0]->admin_endpoint(),
             "--server-key", (sites_[0]->dir() / "server.pub").string(), "--key",
             (sites_[0]->dir() / "admins" / "a0.key").string()},
            (root_ / "top.err").string(), out.string());
  const auto end = std::chrono::steady_clock::now() + 30s;
  auto stamps = [&] {
    std::ifstream in(out);
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    int n = 0;
    for (const auto& l : Lines(text)) n += l.rfind("=== ", 0) == 0;
    return n;
  };
  while (stamps() < 2 && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(50ms);
  ASSERT_GE(stamps(), 2) << top.Log();
  top.Signal(SIGTERM);
  EXPECT_EQ(top.Wait(20s), 0) << top.Log();
}

TEST_F(TopProcessTest, OnATerminalItRedrawsInPlaceAndRestoresTheCursorOnCtrlC) {
  const std::string server_key = (sites_[0]->dir() / "server.pub").string();
  const std::string admin_key = (sites_[0]->dir() / "admins" / "a0.key").string();
  const std::string endpoint = sites_[0]->admin_endpoint();
  int master = -1;
  winsize ws{};
  ws.ws_col = 120;
  ws.ws_row = 40;
  const pid_t pid = ::forkpty(&master, nullptr, nullptr, &ws);
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const char* ctl = Ctl();
    ::execl(ctl, ctl, "top", "--interval", "0.2", "--server", endpoint.c_str(), "--server-key",
            server_key.c_str(), "--key", admin_key.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  std::string screen;
  auto read_for = [&](std::chrono::milliseconds limit, const std::function<bool()>& done) {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (!done() && std::chrono::steady_clock::now() < end) {
      pollfd p{master, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      char buf[4096];
      const ssize_t n = ::read(master, buf, sizeof buf);
      if (n <= 0) return;  // EIO: the child closed the terminal
      screen.append(buf, static_cast<size_t>(n));
    }
  };
  auto count = [&](const std::string& what) {
    size_t n = 0;
    for (size_t at = screen.find(what); at != std::string::npos; at = screen.find(what, at + 1))
      ++n;
    return n;
  };
  read_for(30s, [&] { return count("\x1b[H") >= 2 && count("alpha-0") >= 2; });
  EXPECT_GE(count("\x1b[H"), 2u) << "each refresh starts at the top left";
  EXPECT_EQ(count("\x1b[2J"), 1u) << "the screen is cleared once, then redrawn in place";
  EXPECT_NE(screen.find("\x1b[?25l"), std::string::npos) << "cursor hidden while drawing";
  EXPECT_NE(screen.find("(Ctrl-C quits)"), std::string::npos);
  ::kill(pid, SIGINT);
  read_for(20s, [] { return false; });
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ::close(master);
  ASSERT_TRUE(WIFEXITED(status)) << "ended by a signal: " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
  ASSERT_GE(screen.size(), 6u);
  EXPECT_EQ(screen.substr(screen.rfind("\x1b[?25h")), "\x1b[?25h") << "the cursor is shown last";
}

}  // namespace
}  // namespace isthmus
