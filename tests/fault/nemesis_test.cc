// A nemesis across three sites (docs/TESTING.md, "The nemesis across sites"). Each site is
// one real shard in its own network namespace, joined to the others through a bridge by a
// veth shaped with tbf; its worker is a process of this program (NemesisWorker.Run) that
// pushes rounds as isthmus-worker does: each round under its own key, retried until
// acknowledged, the last acknowledged round kept in a file it reads again after a restart,
// never more than sync.max_rounds_ahead past the committed round.
//
// For ISTHMUS_NEMESIS_SECONDS (default 1800) the nemesis, every 0.3-2 s, does one of:
//  - cuts the link between two sites, both ways or one way (a blackhole route in the
//    sender's namespace), and mends it 1-15 s later;
//  - sets a site's link rate (1-100 Mbit/s);
//  - SIGKILLs a site's shard, its worker, or both (the whole site) and restarts them
//    0.2-5 s later;
// and every ISTHMUS_NEMESIS_MEMBERSHIP_SECONDS (default 600) removes gamma (killed first)
// with `isthmusctl sync remove`, lets the others go on without it for 10-30 s, and brings
// it back with `sync invite` and `sync join`. At the end it heals everything, and the
// workers push up to a final round.
//
// The checker is element accounting. Each push for round r carries a marker tensor "m"
// with 1 in its site's slot r mod kSlots. With the dense codec, outer lr 1 and no momentum,
// the committed "m" holds, per slot, the sum of the site's token weights over the rounds
// where it was a member: a push lost or counted twice moves a slot by its weight (at least
// 1/6). Every site's committed "m" is checked; the sites' digests must agree on every round
// they both hold; once everything heals, every site must commit again within kHealBoundS.
//
// Needs root and iproute2 (ip netns, tc); skipped without them. `long` label only.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <thread>

#include "tests/command.h"
#include "tests/sync_net/site_process.h"

namespace isthmus {
namespace {

namespace fs = std::filesystem;
using testing::SiteProcess;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr int kSites = 3;
constexpr int64_t kSlots = 64;   // marker slots per site (round r -> slot r % kSlots)
constexpr int64_t kBulk = 8192;  // a dense tensor, so rounds take time on slow links
constexpr int kHealBoundS = 30;  // every site commits again within this after the heal
const char* const kNames[kSites] = {"alpha", "beta", "gamma"};
constexpr int kGamma = 2;  // the site the nemesis removes and brings back

uint64_t Tokens(int site) { return 1000 * (site + 1); }

std::vector<float> Marker(int site, uint64_t round) {
  std::vector<float> m(kSites * kSlots, 0.0f);
  m[site * kSlots + static_cast<int64_t>(round % kSlots)] = 1.0f;
  return m;
}

std::vector<float> Bulk(int site, uint64_t round) {
  std::vector<float> v(kBulk);
  for (int64_t i = 0; i < kBulk; ++i) v[i] = 0.001f * std::sin(0.01f * i + 1.3f * round + site);
  return v;
}

uint64_t ReadNumber(const fs::path& p) {
  std::ifstream in(p);
  uint64_t v = 0;
  return (in >> v) ? v : 0;
}

void WriteNumber(const fs::path& p, uint64_t v) {
  const fs::path tmp = p.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << v << "\n";
  }
  fs::rename(tmp, p);
}

// ---------------------------------------------------------------------------------------
// The worker process. Its site's folder (ISTHMUS_NEMESIS_DIR) holds the keys, `progress`
// (the last acknowledged round), `acked` (one line per acknowledged round) and, at the
// end, `final` (the round to stop after).
TEST(NemesisWorker, Run) {
  const char* site_env = std::getenv("ISTHMUS_NEMESIS_WORKER");
  if (site_env == nullptr) GTEST_SKIP() << "started by NemesisAcrossSites as a site's worker";
  const int site = std::atoi(site_env);
  const fs::path dir = std::getenv("ISTHMUS_NEMESIS_DIR");
  auto server_key = LoadPublicKeyFile((dir / "server.pub").string());
  auto keys = LoadKeyPairFile((dir / "workers" / "w0.key").string());
  ASSERT_TRUE(server_key.ok() && keys.ok());
  ClientOptions o;
  o.endpoint = std::getenv("ISTHMUS_NEMESIS_ENDPOINT");
  o.server_public_key = *server_key;
  o.client_keys = *keys;
  o.timeout_ms = 3000;
  o.retries = 0;
  auto client = ShardClient::Connect(o);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  uint64_t progress = ReadNumber(dir / "progress");
  uint64_t computed = 0;  // the round whose compute has been done
  std::mt19937 rng(static_cast<unsigned>(::getpid()));
  for (;;) {
    const uint64_t final_round = ReadNumber(dir / "final");
    if (final_round != 0 && progress >= final_round) return;
    auto hello = (*client)->Hello("job", wire::Role::Worker, "", "nemesis");
    if (!hello.ok()) {
      std::this_thread::sleep_for(200ms);
      continue;
    }
    const RoundInfo& r = hello->rounds;
    // The next round: after the last acknowledged one, or after the committed round when
    // the site was not a member for a while (it joined again from a later round).
    const uint64_t next = std::max(progress, r.committed_round) + 1;
    if (next > r.committed_round + r.max_rounds_ahead + 1) {
      std::this_thread::sleep_for(100ms);
      continue;
    }
    if (computed != next) {  // the round's compute
      std::this_thread::sleep_for(std::chrono::milliseconds(150 + rng() % 250));
      computed = next;
    }
    auto m = Marker(site, next);
    auto w = Bulk(site, next);
    auto p = (*client)->Push("job", std::string(kNames[site]) + "-r" + std::to_string(next), next,
                             Tokens(site),
                             {{"m", {kSites * kSlots}, m.data()}, {"w", {kBulk}, w.data()}});
    if (!p.ok()) {
      std::fprintf(stderr, "round %llu: %s\n", static_cast<unsigned long long>(next),
                   p.status().ToString().c_str());
      std::this_thread::sleep_for(200ms);
      continue;
    }
    {
      std::ofstream acked(dir / "acked", std::ios::app);
      acked << next << "\n";
    }
    progress = next;
    WriteNumber(dir / "progress", progress);
  }
}

// ---------------------------------------------------------------------------------------
// The WAN: a bridge in this namespace (with an address, so the test reaches every site),
// and per site a namespace whose veth is on the bridge, both ends shaped with tbf.
class Wan {
 public:
  Wan() {
    const int pid = static_cast<int>(::getpid());
    tag_ = "isn" + std::to_string(pid % 100000);
    net_ = "10.66." + std::to_string(pid % 250) + ".";
  }
  ~Wan() { Down(); }

  // Empty on success, else why the WAN cannot be made here.
  std::string Up() {
    if (::geteuid() != 0) return "needs root (ip netns, tc)";
    if (!Sh("ip link add " + tag_ + " type bridge && ip link set " + tag_ + " up && ip addr add " +
            net_ + "254/24 dev " + tag_)) {
      return "cannot create a bridge: " + last_;
    }
    up_ = true;
    for (int s = 0; s < kSites; ++s) {
      const std::string v = Veth(s);
      if (!Sh("ip netns add " + Ns(s) + " && ip netns exec " + Ns(s) + " ip link set lo up" +
              " && ip link add " + v + " type veth peer name wan0 netns " + Ns(s) +
              " && ip link set " + v + " master " + tag_ + " up && ip netns exec " + Ns(s) +
              " ip addr add " + Ip(s) + "/24 dev wan0 && ip netns exec " + Ns(s) +
              " ip link set wan0 up")) {
        return "cannot create network namespace " + Ns(s) + ": " + last_;
      }
      if (!Rate(s, "20mbit")) return "tc cannot shape the links: " + last_;
    }
    return "";
  }
  void Down() {
    if (!up_) return;
    for (int s = 0; s < kSites; ++s) {
      Sh("ip netns pids " + Ns(s) + " 2>/dev/null | xargs -r kill -9");
      Sh("ip link del " + Veth(s));
      Sh("ip netns del " + Ns(s));
    }
    Sh("ip link del " + tag_);
    up_ = false;
  }

  std::string Ns(int s) const { return tag_ + "-" + kNames[s]; }
  std::string Ip(int s) const { return net_ + std::to_string(s + 1); }
  // Packets from site `from` to site `to` are dropped (one way), or go through again.
  bool Cut(int from, int to) {
    return Sh("ip netns exec " + Ns(from) + " ip route add blackhole " + Ip(to) + "/32");
  }
  bool Mend(int from, int to) {
    return Sh("ip netns exec " + Ns(from) + " ip route del blackhole " + Ip(to) + "/32");
  }
  // Both directions of site s's link at `rate` (a tc rate: "5mbit").
  bool Rate(int s, const std::string& rate) {
    const std::string tbf = " root tbf rate " + rate + " burst 64kbit latency 1s";
    return Sh("tc qdisc replace dev " + Veth(s) + tbf) &&
           Sh("ip netns exec " + Ns(s) + " tc qdisc replace dev wan0" + tbf);
  }
  const std::string& last_error() const { return last_; }

 private:
  std::string Veth(int s) const { return tag_ + "v" + std::to_string(s); }
  bool Sh(const std::string& cmd) {
    auto r = testing::RunCommand("(" + cmd + ") 2>&1");
    last_ = cmd + ": " + r.output;
    return r.exit_code == 0;
  }
  std::string tag_, net_, last_;
  bool up_ = false;
};

// A site's worker process (this program, NemesisWorker.Run) in the site's namespace.
class WorkerProcess {
 public:
  WorkerProcess(int site, const SiteProcess& shard, std::string netns)
      : site_(site),
        dir_(shard.dir()),
        endpoint_(shard.worker_endpoint()),
        netns_(std::move(netns)) {}
  ~WorkerProcess() { Kill(); }
  void Start() {
    pid_ = ::fork();
    if (pid_ == 0) {
      std::freopen((dir_ / "worker.log").c_str(), "a", stderr);
      std::freopen("/dev/null", "w", stdout);
      const int fd = ::open(("/run/netns/" + netns_).c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) _exit(125);
      ::setenv("ISTHMUS_NEMESIS_WORKER", std::to_string(site_).c_str(), 1);
      ::setenv("ISTHMUS_NEMESIS_DIR", dir_.c_str(), 1);
      ::setenv("ISTHMUS_NEMESIS_ENDPOINT", endpoint_.c_str(), 1);
      ::execl("/proc/self/exe", "nemesis_test", "--gtest_filter=NemesisWorker.Run",
              static_cast<char*>(nullptr));
      _exit(127);
    }
  }
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  bool running() const { return pid_ > 0; }
  // Waits up to `limit` for the process to exit by itself; its exit status, or -1.
  int WaitExit(std::chrono::seconds limit) {
    const auto end = Clock::now() + limit;
    while (pid_ > 0 && Clock::now() < end) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return status;
      }
      std::this_thread::sleep_for(100ms);
    }
    return -1;
  }

 private:
  int site_;
  fs::path dir_;
  std::string endpoint_, netns_;
  pid_t pid_ = -1;
};

std::vector<int> MembersOf(uint64_t round,
                           const std::vector<std::pair<uint64_t, uint64_t>>& gamma_out) {
  std::vector<int> m{0, 1};
  bool in = true;
  for (const auto& [from, to] : gamma_out) in = in && !(round >= from && round < to);
  if (in) m.push_back(kGamma);
  return m;
}

TEST(NemesisAcrossSites, EveryAcknowledgedPushCountsOnceOnEveryMemberAndDigestsAgree) {
  const char* env_s = std::getenv("ISTHMUS_NEMESIS_SECONDS");
  const int seconds = env_s ? std::max(20, std::atoi(env_s)) : 1800;
  const char* env_m = std::getenv("ISTHMUS_NEMESIS_MEMBERSHIP_SECONDS");
  const int membership_every = env_m ? std::max(10, std::atoi(env_m)) : 600;
  Wan wan;
  if (const std::string why = wan.Up(); !why.empty()) GTEST_SKIP() << why;

  const fs::path root =
      fs::temp_directory_path() / ("isthmus-nemesis-" + std::to_string(::getpid()));
  fs::remove_all(root);
  std::vector<std::unique_ptr<SiteProcess>> sites;
  std::vector<SiteProcess*> all;
  for (int s = 0; s < kSites; ++s) {
    sites.push_back(std::make_unique<SiteProcess>(kNames[s], root));
    sites.back()->set_netns(wan.Ns(s), wan.Ip(s));
    all.push_back(sites.back().get());
  }
  for (int s = 0; s < kSites; ++s) {
    // alpha's admin key is on every site's allowlist, for isthmusctl.
    fs::copy_file(sites[0]->dir() / "admins" / "a0.pub", sites[s]->dir() / "admins" / "shared.pub",
                  fs::copy_options::overwrite_existing);
    sites[s]->Configure(all,
                        "codec = \"dense\"\nadaptive = false\nouter_lr = 1.0\n"
                        "outer_momentum = 0.0\nmax_rounds_ahead = 2\n");
    ASSERT_TRUE(sites[s]->Start());
  }
  const std::vector<float> m0(kSites * kSlots, 0.0f), w0(kBulk, 0.0f);
  for (auto& s : sites) {
    auto r = s->AdminClient()->CreateJob(
        "job", "base", {{"m", {kSites * kSlots}, m0.data()}, {"w", {kBulk}, w0.data()}});
    ASSERT_TRUE(r.ok()) << s->site() << ": " << r.status().ToString();
  }
  auto ctl = [&](const std::string& args, int s) {
    const std::string cmd = std::string(testing::BinaryPath("ISTHMUS_CTL_BIN", ISTHMUS_CTL_BIN)) +
                            " " + args + " --server " + sites[s]->admin_endpoint() +
                            " --server-key " + (sites[s]->dir() / "server.pub").string() +
                            " --key " + (sites[0]->dir() / "admins" / "a0.key").string() + " 2>&1";
    auto r = testing::RunCommand(cmd);
    std::fprintf(stderr, "[nemesis] isthmusctl %s (at %s): exit %d\n%s", args.c_str(), kNames[s],
                 r.exit_code, r.output.c_str());
    return r;
  };
  std::vector<std::unique_ptr<WorkerProcess>> workers;
  for (int s = 0; s < kSites; ++s) {
    workers.push_back(std::make_unique<WorkerProcess>(s, *sites[s], wan.Ns(s)));
    workers.back()->Start();
  }
  auto committed = [&](int s) -> uint64_t {
    auto st = sites[s]->AdminClient(1500, 0)->SyncStatus();
    return st.ok() && !st->jobs.empty() ? st->jobs[0].committed_round : 0;
  };

  // The nemesis. Undo actions wait in `pending` until their time.
  struct Undo {
    Clock::time_point at;
    std::function<void()> run;
  };
  std::vector<Undo> pending;
  std::set<std::pair<int, int>> cut;  // (from, to)
  std::vector<bool> shard_up(kSites, true), worker_up(kSites, true);
  std::map<std::string, int> faults;
  std::vector<std::pair<uint64_t, uint64_t>> gamma_out;  // [removed from, joined again at)
  std::mt19937 rng(20261126);
  auto pick = [&](int n) { return static_cast<int>(rng() % n); };
  auto ms = [&](int lo, int hi) { return std::chrono::milliseconds(lo + pick(hi - lo)); };
  const char* const kRates[] = {"1mbit", "5mbit", "20mbit", "100mbit"};
  auto run_due = [&](bool all_now) {
    const auto now = Clock::now();
    std::vector<Undo> later;
    for (auto& u : pending) {
      if (all_now || u.at <= now) {
        u.run();
      } else {
        later.push_back(std::move(u));
      }
    }
    pending = std::move(later);
  };
  auto start_shard = [&](int s) {
    ASSERT_TRUE(sites[s]->Start()) << kNames[s] << " did not restart";
    shard_up[s] = true;
  };
  auto start_worker = [&](int s) {
    workers[s]->Start();
    worker_up[s] = true;
  };

  const auto t0 = Clock::now();
  const auto end = t0 + std::chrono::seconds(seconds);
  auto next_membership = t0 + std::chrono::seconds(membership_every / 2);
  uint64_t best = 0;
  auto last_progress = Clock::now();
  double longest_stall_s = 0;
  while (Clock::now() < end && !HasFatalFailure()) {
    std::this_thread::sleep_for(ms(300, 2000));
    run_due(false);
    if (HasFatalFailure()) break;
    // Any site's progress counts; the stall is the longest time with none.
    for (int s = 0; s < kSites; ++s) {
      if (!shard_up[s]) continue;
      ASSERT_NE(sites[s]->pid(), -1);
      const uint64_t c = committed(s);
      if (c > best) {
        best = c;
        last_progress = Clock::now();
      }
    }
    longest_stall_s = std::max(longest_stall_s,
                               std::chrono::duration<double>(Clock::now() - last_progress).count());

    if (Clock::now() >= next_membership) {
      // Remove gamma and bring it back, with every other fault healed meanwhile.
      run_due(true);
      for (auto [from, to] : cut) wan.Mend(from, to);
      cut.clear();
      for (int s = 0; s < kSites; ++s) wan.Rate(s, "20mbit");
      workers[kGamma]->Kill();
      sites[kGamma]->Kill(SIGKILL);
      uint64_t removed_from = 0;
      for (int attempt = 0; attempt < 8 && removed_from == 0; ++attempt) {
        auto r = ctl("sync remove --peer gamma -j job --wait 60", 0);
        std::smatch m;
        if (r.exit_code == 0 &&
            std::regex_search(r.output, m, std::regex("remove gamma from round ([0-9]+)"))) {
          removed_from = std::stoull(m[1]);
        } else if (r.output.find("disagree") != std::string::npos) {
          // gamma's last round reached one of them only: the one behind takes the other's.
          ctl("sync catch-up --from alpha -j job", 1);
          ctl("sync catch-up --from beta -j job", 0);
        } else {
          std::this_thread::sleep_for(2s);
        }
      }
      ASSERT_NE(removed_from, 0u) << "gamma could not be removed";
      ++faults["remove and join again"];
      std::this_thread::sleep_for(std::chrono::seconds(10 + pick(20)));
      ASSERT_TRUE(sites[kGamma]->Start());
      ASSERT_EQ(ctl("sync invite --site gamma -j job", 0).exit_code, 0);
      uint64_t joined_at = 0;
      for (int attempt = 0; attempt < 5 && joined_at == 0; ++attempt) {
        auto r = ctl("sync join --from alpha -j job --wait 120", kGamma);
        std::smatch m;
        if (r.exit_code == 0 &&
            std::regex_search(r.output, m, std::regex("add gamma from round ([0-9]+)"))) {
          joined_at = std::stoull(m[1]);
        } else {
          std::this_thread::sleep_for(2s);
          ctl("sync invite --site gamma -j job", 0);
        }
      }
      ASSERT_NE(joined_at, 0u) << "gamma could not join again: " << sites[kGamma]->Log();
      gamma_out.emplace_back(removed_from, joined_at);
      start_worker(kGamma);
      next_membership = Clock::now() + std::chrono::seconds(membership_every);
      continue;
    }

    switch (pick(6)) {
      case 0:
      case 1: {  // cut a link, both ways (case 0) or one way
        const int a = pick(kSites), b = (a + 1 + pick(kSites - 1)) % kSites;
        const bool both = pick(2) == 0;
        std::vector<std::pair<int, int>> dirs{{a, b}};
        if (both) dirs.emplace_back(b, a);
        bool any = false;
        for (auto d : dirs) {
          if (cut.count(d)) continue;
          ASSERT_TRUE(wan.Cut(d.first, d.second)) << wan.last_error();
          cut.insert(d);
          any = true;
          pending.push_back({Clock::now() + ms(1000, 15000), [&, d] {
                               if (cut.erase(d)) {
                                 EXPECT_TRUE(wan.Mend(d.first, d.second));
                               }
                             }});
        }
        if (any) ++faults[both ? "partition, both ways" : "partition, one way"];
        break;
      }
      case 2: {  // a link's rate
        const int s = pick(kSites);
        ASSERT_TRUE(wan.Rate(s, kRates[pick(4)])) << wan.last_error();
        ++faults["rate change"];
        break;
      }
      case 3: {  // SIGKILL a shard
        const int s = pick(kSites);
        if (!shard_up[s]) break;
        sites[s]->Kill(SIGKILL);
        shard_up[s] = false;
        ++faults["shard SIGKILL"];
        pending.push_back({Clock::now() + ms(200, 3000), [&, s] { start_shard(s); }});
        break;
      }
      case 4: {  // SIGKILL a worker
        const int s = pick(kSites);
        if (!worker_up[s]) break;
        workers[s]->Kill();
        worker_up[s] = false;
        ++faults["worker SIGKILL"];
        pending.push_back({Clock::now() + ms(200, 2000), [&, s] { start_worker(s); }});
        break;
      }
      case 5: {  // SIGKILL a whole site
        const int s = pick(kSites);
        if (!shard_up[s] || !worker_up[s]) break;
        workers[s]->Kill();
        sites[s]->Kill(SIGKILL);
        shard_up[s] = worker_up[s] = false;
        ++faults["site SIGKILL (shard and worker)"];
        pending.push_back({Clock::now() + ms(1000, 5000), [&, s] {
                             start_shard(s);
                             start_worker(s);
                           }});
        break;
      }
    }
  }
  ASSERT_FALSE(HasFatalFailure());

  // Heal everything; every site must commit again within kHealBoundS.
  run_due(true);
  for (auto [from, to] : cut) wan.Mend(from, to);
  cut.clear();
  for (int s = 0; s < kSites; ++s) wan.Rate(s, "20mbit");
  const auto healed = Clock::now();
  std::vector<uint64_t> at_heal(kSites);
  for (int s = 0; s < kSites; ++s) at_heal[s] = committed(s);
  double heal_to_commit_s = 0;
  for (int s = 0; s < kSites; ++s) {
    while (committed(s) <= at_heal[s]) {
      ASSERT_LT(Clock::now() - healed, std::chrono::seconds(kHealBoundS))
          << kNames[s] << " committed nothing within " << kHealBoundS
          << " s of the heal: " << sites[s]->Log();
      std::this_thread::sleep_for(100ms);
    }
    heal_to_commit_s =
        std::max(heal_to_commit_s, std::chrono::duration<double>(Clock::now() - healed).count());
  }
  // The workers stop after a final round a little ahead of everyone.
  uint64_t final_round = 0;
  for (int s = 0; s < kSites; ++s) final_round = std::max(final_round, committed(s));
  final_round += 3;
  for (int s = 0; s < kSites; ++s) WriteNumber(sites[s]->dir() / "final", final_round);
  for (int s = 0; s < kSites; ++s) {
    const int status = workers[s]->WaitExit(120s);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << kNames[s] << "'s worker did not finish round " << final_round;
  }
  for (int s = 0; s < kSites; ++s) {
    const auto limit = Clock::now() + 60s;
    while (committed(s) < final_round) {
      ASSERT_LT(Clock::now(), limit) << kNames[s] << " did not commit round " << final_round;
      std::this_thread::sleep_for(100ms);
    }
  }
  const double heal_to_final_s = std::chrono::duration<double>(Clock::now() - healed).count();

  // Digests: identical on every round two sites both hold.
  std::vector<std::map<uint64_t, std::string>> digests(kSites);
  for (int s = 0; s < kSites; ++s) {
    auto d = sites[s]->AdminClient(10000, 2)->Digests("job", 0);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    digests[s] = std::map<uint64_t, std::string>(d->digests.begin(), d->digests.end());
  }
  uint64_t compared = 0;
  for (int s = 1; s < kSites; ++s) {
    for (const auto& [round, digest] : digests[s]) {
      auto it = digests[0].find(round);
      if (it == digests[0].end()) continue;
      EXPECT_EQ(it->second, digest) << kNames[s] << " and alpha differ at round " << round;
      ++compared;
    }
  }
  EXPECT_TRUE(digests[0].count(final_round));

  // Element accounting.
  std::vector<std::set<uint64_t>> acked(kSites);
  uint64_t ack_lines = 0;
  for (int s = 0; s < kSites; ++s) {
    std::ifstream in(sites[s]->dir() / "acked");
    for (uint64_t r; in >> r;) {
      acked[s].insert(r);
      ++ack_lines;
    }
  }
  std::vector<double> want(kSites * kSlots, 0.0);
  uint64_t counted = 0, dropped_by_removal = 0;
  for (uint64_t r = 1; r <= final_round; ++r) {
    const auto members = MembersOf(r, gamma_out);
    double total = 0;
    for (int s : members) total += Tokens(s);
    for (int s : members) {
      // A committed round holds a push of every member, so each member acknowledged it.
      EXPECT_TRUE(acked[s].count(r)) << kNames[s] << " never had round " << r << " acknowledged";
      want[s * kSlots + static_cast<int64_t>(r % kSlots)] += Tokens(s) / total;
      ++counted;
    }
  }
  for (uint64_t r : acked[kGamma]) {
    if (r <= final_round && MembersOf(r, gamma_out).size() == 2) ++dropped_by_removal;
  }
  int slots_off = 0;
  for (int s = 0; s < kSites; ++s) {
    auto pulled = sites[s]->WorkerClient(10000, 2)->Pull("job", {"m"});
    ASSERT_TRUE(pulled.ok()) << pulled.status().ToString();
    const auto& got = pulled->tensors.at(0).data;
    ASSERT_EQ(got.size(), want.size());
    for (size_t k = 0; k < got.size(); ++k) {
      if (std::abs(got[k] - want[k]) > 1e-3) {
        ++slots_off;
        ADD_FAILURE() << kNames[s] << "'s state: site " << kNames[k / kSlots] << ", slot "
                      << k % kSlots << ": " << got[k] << " where every push once gives " << want[k]
                      << " (a push lost or counted twice)";
      }
    }
  }
  std::string fault_list;
  int fault_total = 0;
  for (const auto& [kind, n] : faults) {
    fault_list += "  " + kind + ": " + std::to_string(n) + "\n";
    fault_total += n;
  }
  std::printf(
      "nemesis: %d s, %d faults:\n%s%llu rounds committed by every site, %llu pushes "
      "counted (each exactly once: %s), %llu acknowledgements logged, %llu of gamma's "
      "acknowledged rounds fell after its removal (not merged, by the removal rule), digests "
      "agree on %llu round pairs, longest stall %.1f s, heal to a commit on every site %.1f s, "
      "heal to round %llu on every site %.1f s\n",
      seconds, fault_total, fault_list.c_str(), static_cast<unsigned long long>(final_round),
      static_cast<unsigned long long>(counted), slots_off == 0 ? "yes" : "NO",
      static_cast<unsigned long long>(ack_lines),
      static_cast<unsigned long long>(dropped_by_removal),
      static_cast<unsigned long long>(compared), longest_stall_s, heal_to_commit_s,
      static_cast<unsigned long long>(final_round), heal_to_final_s);
  workers.clear();
  sites.clear();
  if (!HasFailure()) fs::remove_all(root);
}

}  // namespace
}  // namespace isthmus
