// isthmusctl fleet init, in process: the files it writes (key modes, allowlist folders of
// public keys only, shard configs the server's loader accepts, consistent shard.index and
// sync.peers across sites, worker TOML and env file), and what it refuses (a non-empty
// folder, unknown or fleet-managed settings, bad values, bad site names, port clashes). And
// fleet add-site: a third site with keys of its own while every existing key file stays
// byte for byte, configs the server's loader accepts with consistent peers everywhere, an
// operator's edits kept, and a site that exists (or bad options) refused with nothing changed.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <toml.hpp>

#include "common/keys.h"
#include "common/names.h"
#include "server/config/config.h"
#include "server/ctl/fleet.h"
#include "tests/server/test_util.h"

namespace isthmus::ctl {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

std::string Read(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The options of a two-site, two-shard fleet written into `out`, its sites' folders at
// OUT/SITE as the configs say (so the key paths in them are real).
FleetOptions TwoSites(const fs::path& out) {
  FleetOptions o;
  o.sites = {"alpha", "beta"};
  o.shards = 2;
  o.out_dir = out.string();
  o.hosts = {"alpha=10.0.0.1", "beta=10.1.0.1"};
  o.etc_dir = (out / "{site}").string();
  o.data_dir = (out / "data" / "{site}").string();
  return o;
}

// One site, "solo", with one shard: a fleet with no peers.
FleetOptions OneSite(const fs::path& out) {
  FleetOptions o = TwoSites(out);
  o.sites = {"solo"};
  o.hosts = {};
  o.shards = 1;
  return o;
}

Result<std::string> Init(const FleetOptions& o) {
  ISTHMUS_ASSIGN_OR_RETURN(FleetPlan plan, PlanFleet(o));
  return WriteFleet(plan);
}

std::set<std::string> Names(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

ServerConfig LoadShard(const fs::path& out, const std::string& site, int shard) {
  auto cfg =
      LoadServerConfig((out / site / (site + "-" + std::to_string(shard) + ".toml")).string(), {});
  EXPECT_TRUE(cfg.ok()) << cfg.status().ToString();
  if (!cfg.ok()) return {};
  auto valid = ValidateServerConfig(*cfg);
  EXPECT_TRUE(valid.ok()) << valid.ToString();
  return *cfg;
}

// Each setting given to fleet init with --set is refused (InvalidArgument saying what is
// wrong) and nothing is written to `out`.
void ExpectSettingsRefused(const fs::path& out,
                           const std::vector<std::pair<std::string, std::string>>& refused) {
  for (const auto& [setting, says] : refused) {
    FleetOptions bad = TwoSites(out);
    bad.settings = {setting};
    auto r = Init(bad);
    ASSERT_FALSE(r.ok()) << setting;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << setting;
    EXPECT_NE(r.status().message().find(says), std::string::npos)
        << setting << ": " << r.status().ToString();
    EXPECT_FALSE(fs::exists(out)) << setting;
  }
}

TEST(FleetInit, WritesKeysWithSecretsOwnerOnlyAndAllowlistsOfPublicKeysOnly) {
  TempDir tmp;
  const fs::path out = tmp.path() / "fleet";
  auto summary = Init(TwoSites(out));
  ASSERT_TRUE(summary.ok()) << summary.status().ToString();
  EXPECT_EQ(Read(out / "README.txt"), *summary);
  EXPECT_EQ(Names(out),
            (std::set<std::string>{"README.txt", "fleet.json", "admin", "alpha", "beta"}));
  for (const std::string site : {"alpha", "beta"}) {
    EXPECT_EQ(Names(out / site), (std::set<std::string>{site + "-0.toml", site + "-1.toml",
                                                        "worker.toml", "isthmusctl.env", "keys"}));
    EXPECT_EQ(Names(out / site / "keys"),
              (std::set<std::string>{site + "-0.key", site + "-0.pub", site + "-1.key",
                                     site + "-1.pub", "worker.key", "worker.pub", "workers",
                                     "admins", "peers-0", "peers-1"}));
  }
  size_t secrets = 0;
  for (const auto& e : fs::recursive_directory_iterator(out)) {
    if (e.path().extension() != ".key") continue;
    ++secrets;
    struct stat st {};
    ASSERT_EQ(::stat(e.path().c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << e.path();
    EXPECT_TRUE(LoadKeyPairFile(e.path().string()).ok()) << e.path();
    const std::string folder = e.path().parent_path().filename().string();
    EXPECT_TRUE(folder == "keys" || folder == "admin") << e.path() << " is in an allowlist folder";
  }
  EXPECT_EQ(secrets, 1u + 2 * (2 + 1));  // admin, per site 2 shards + the worker key
  // Allowlist folders: public keys only, and the right ones.
  auto admin = LoadKeyPairFile((out / "admin" / "admin.key").string());
  ASSERT_TRUE(admin.ok());
  for (const std::string site : {"alpha", "beta"}) {
    const fs::path keys = out / site / "keys";
    for (const char* role : {"workers", "admins", "peers-0", "peers-1"}) {
      for (const auto& e : fs::directory_iterator(keys / role)) {
        EXPECT_EQ(e.path().extension(), ".pub") << e.path();
      }
    }
    auto worker = LoadKeyPairFile((keys / "worker.key").string());
    ASSERT_TRUE(worker.ok());
    auto workers = LoadPublicKeys({(keys / "workers").string()});
    ASSERT_TRUE(workers.ok());
    EXPECT_EQ(*workers, std::vector<std::string>{worker->public_key});
    auto admins = LoadPublicKeys({(keys / "admins").string()});
    ASSERT_TRUE(admins.ok());
    EXPECT_EQ(*admins, std::vector<std::string>{admin->public_key});
  }
  // Every site's worker key and every shard key differ.
  std::set<std::string> publics;
  for (const auto& e : fs::recursive_directory_iterator(out)) {
    if (e.path().extension() == ".key") {
      publics.insert(LoadKeyPairFile(e.path().string())->public_key);
    }
  }
  EXPECT_EQ(publics.size(), secrets);
}

TEST(FleetInit, ShardConfigsAreAcceptedAndTheirPeersConsistent) {
  TempDir tmp;
  const fs::path out = tmp.path() / "fleet";
  FleetOptions o = TwoSites(out);
  o.sites = {"alpha", "beta", "gamma"};
  o.hosts.push_back("gamma=10.2.0.1");
  o.base_ports = {"7300", "beta=9000"};
  auto summary = Init(o);
  ASSERT_TRUE(summary.ok()) << summary.status().ToString();
  const std::map<std::string, std::string> host = {
      {"alpha", "10.0.0.1"}, {"beta", "10.1.0.1"}, {"gamma", "10.2.0.1"}};
  const std::map<std::string, int> base = {{"alpha", 7300}, {"beta", 9000}, {"gamma", 7300}};
  for (int i = 0; i < 2; ++i) {
    std::map<std::string, ServerConfig> cfg;
    for (const std::string site : {"alpha", "beta", "gamma"}) cfg[site] = LoadShard(out, site, i);
    for (const auto& [site, c] : cfg) {
      const std::string id = site + "-" + std::to_string(i);
      EXPECT_EQ(c.shard_id, id);
      EXPECT_EQ(c.shard_index, i);
      EXPECT_EQ(c.sync.site, site);
      EXPECT_EQ(c.data_dir, (out / "data" / site / id).string());
      const int port = base.at(site) + 10 * i;
      EXPECT_EQ(c.listen_worker, "tcp://" + host.at(site) + ":" + std::to_string(port));
      EXPECT_EQ(c.listen_admin, "tcp://127.0.0.1:" + std::to_string(port + 1));
      EXPECT_EQ(c.listen_peer, "tcp://" + host.at(site) + ":" + std::to_string(port + 2));
      auto own = LoadKeyPairFile(c.secret_key);
      ASSERT_TRUE(own.ok()) << own.status().ToString();
      // sync.peers: exactly the same-numbered shard of every other site, at its peer
      // endpoint, with the public key of its secret key; the peer allowlist holds those keys.
      auto peers = ParsePeerSpecs(c.sync_peers);
      ASSERT_TRUE(peers.ok()) << peers.status().ToString();
      std::set<std::string> listed, allowed_want;
      for (const auto& p : *peers) {
        listed.insert(p.site);
        ASSERT_TRUE(cfg.count(p.site)) << p.site;
        const ServerConfig& other = cfg.at(p.site);
        EXPECT_EQ(p.endpoint, other.listen_peer) << site << " -> " << p.site;
        auto key = LoadPublicKeyFile(p.public_key_file);
        ASSERT_TRUE(key.ok()) << key.status().ToString();
        EXPECT_EQ(*key, LoadKeyPairFile(other.secret_key)->public_key);
        allowed_want.insert(*key);
      }
      std::set<std::string> others;
      for (const auto& [s, unused] : cfg) {
        if (s != site) others.insert(s);
      }
      EXPECT_EQ(listed, others);
      auto allowed = LoadPublicKeys(c.peer_keys);
      ASSERT_TRUE(allowed.ok());
      EXPECT_EQ(std::set<std::string>(allowed->begin(), allowed->end()), allowed_want);
      auto workers = LoadPublicKeys(c.worker_keys);
      ASSERT_TRUE(workers.ok());
      EXPECT_EQ(workers->size(), 1u);
    }
  }
  // auto dialling: the site whose name sorts first dials; gamma's peer ports take alpha and
  // beta, alpha's none.
  EXPECT_NE(summary->find("7302,7312  peers: no inbound connections (alpha dials"),
            std::string::npos)
      << *summary;
  EXPECT_NE(summary->find("7302,7312  peers: open to 10.0.0.1 (alpha), 10.1.0.1 (beta)"),
            std::string::npos)
      << *summary;
}

TEST(FleetInit, WorkerTomlAndEnvFileNameTheShardsInOrder) {
  TempDir tmp;
  const fs::path out = tmp.path() / "fleet";
  FleetOptions o = TwoSites(out);
  o.shards = 3;
  o.job = "demo";
  o.operator_key = "/home/op/admin.key";
  o.metrics = true;
  ASSERT_TRUE(Init(o).ok());
  for (const std::string site : {"alpha", "beta"}) {
    const auto w = toml::parse((out / site / "worker.toml").string());
    EXPECT_EQ(toml::find<std::string>(w, "job"), "demo");
    EXPECT_EQ(toml::find<std::string>(w, "client-name"), site);
    const auto servers = toml::find<std::vector<std::string>>(w, "server");
    const auto keys = toml::find<std::vector<std::string>>(w, "server-key");
    ASSERT_EQ(servers.size(), 3u);
    ASSERT_EQ(keys.size(), 3u);
    auto worker_key = LoadKeyPairFile(toml::find<std::string>(w, "key"));
    ASSERT_TRUE(worker_key.ok()) << worker_key.status().ToString();
    EXPECT_EQ(worker_key->public_key,
              LoadPublicKeyFile((out / site / "keys" / "workers" / "worker.pub").string()).value());
    std::string admins;
    for (int i = 0; i < 3; ++i) {
      const ServerConfig c = LoadShard(out, site, i);
      EXPECT_EQ(servers[i], c.listen_worker);
      EXPECT_EQ(c.listen_metrics, "127.0.0.1:" + std::to_string(7100 + 10 * i + 3));
      EXPECT_EQ(LoadPublicKeyFile(keys[i]).value(), LoadKeyPairFile(c.secret_key)->public_key);
      admins += (i ? "," : "") + c.listen_admin;
    }
    const std::string env = Read(out / site / "isthmusctl.env");
    EXPECT_NE(env.find("export ISTHMUS_CTL_SERVERS=\"" + admins + "\"\n"), std::string::npos)
        << env;
    const std::string k = (out / site / "keys").string();
    EXPECT_NE(env.find("export ISTHMUS_CTL_SERVER_KEYS=\"" + k + "/" + site + "-0.pub," + k + "/" +
                       site + "-1.pub," + k + "/" + site + "-2.pub\"\n"),
              std::string::npos)
        << env;
    EXPECT_NE(env.find("export ISTHMUS_CTL_KEY=\"/home/op/admin.key\"\n"), std::string::npos)
        << env;
  }
}

TEST(FleetInit, SettingsGoIntoEveryShardAndTyposAreRefused) {
  TempDir tmp;
  const fs::path out = tmp.path() / "fleet";
  FleetOptions o = TwoSites(out);
  o.settings = {"sync.codec=int8+zstd", "storage.sync_writes=false", "sync.outer_lr=0.7",
                "sync.max_rounds_ahead=4", "sync.codec_overrides=*.bias=dense,wte.*=int4+zstd"};
  ASSERT_TRUE(Init(o).ok());
  for (const std::string site : {"alpha", "beta"}) {
    for (int i = 0; i < 2; ++i) {
      const ServerConfig c = LoadShard(out, site, i);
      EXPECT_EQ(c.sync.codec, "int8+zstd");
      EXPECT_FALSE(c.sync_writes);
      EXPECT_DOUBLE_EQ(c.sync.outer_lr, 0.7);
      EXPECT_EQ(c.sync.max_rounds_ahead, 4);
      EXPECT_EQ(c.sync.codec_overrides,
                (std::vector<std::string>{"*.bias=dense", "wte.*=int4+zstd"}));
    }
  }
  // Nothing is written for a refused setting: each case below gets a fresh folder.
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"sync.codek=int8", "unknown setting 'sync.codek'"},
      {"sync.codec=int9+zstd", "int9"},
      {"sync.outer_momentum=1.5", "outer_momentum"},
      {"storage.dedup_window=many", "integer"},
      {"storage.sync_writes=maybe", "true or false"},
      {"listen.admin=tcp://0.0.0.0:1", "fleet init writes listen.admin"},
      {"sync.peers=x=y=z", "fleet init writes sync.peers"},
      {"security.insecure_plaintext=true", "CURVE"},
      {"novalue", "NAME=VALUE"},
  };
  ExpectSettingsRefused(tmp.path() / "refused", refused);
}

TEST(FleetInit, RefusesANonEmptyFolderUnlessForcedAndForceLeavesNoStaleKey) {
  TempDir tmp;
  const fs::path out = tmp.path() / "fleet";
  fs::create_directories(out);
  std::ofstream(out / "notes.txt") << "mine\n";
  auto r = Init(TwoSites(out));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kAlreadyExists);
  EXPECT_NE(r.status().message().find("not empty"), std::string::npos) << r.status().ToString();
  EXPECT_NE(r.status().message().find("--force"), std::string::npos) << r.status().ToString();
  EXPECT_EQ(Names(out), std::set<std::string>{"notes.txt"});

  FleetOptions o = TwoSites(out);
  o.force = true;
  o.shards = 3;
  ASSERT_TRUE(Init(o).ok());
  const std::string first = Read(out / "alpha" / "keys" / "alpha-0.pub");
  // A key someone added to an allowlist, and a shard config from a larger fleet.
  fs::copy_file(out / "beta" / "keys" / "beta-0.pub", out / "alpha" / "keys" / "peers-1" / "x.pub");
  o.shards = 2;
  ASSERT_TRUE(Init(o).ok());
  EXPECT_EQ(Read(out / "notes.txt"), "mine\n");
  EXPECT_NE(Read(out / "alpha" / "keys" / "alpha-0.pub"), first) << "--force makes new keys";
  EXPECT_EQ(Names(out / "alpha" / "keys" / "peers-1"), std::set<std::string>{"beta-1.pub"});
  EXPECT_FALSE(fs::exists(out / "alpha" / "alpha-2.toml"));
  EXPECT_FALSE(fs::exists(out / "alpha" / "keys" / "peers-2"));
}

TEST(FleetInit, ChecksSitesShardsHostsAndPorts) {
  TempDir tmp;
  auto refused = [&](FleetOptions o, const std::string& says) {
    auto r = PlanFleet(o);
    ASSERT_FALSE(r.ok()) << says;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().ToString();
  };
  const fs::path out = tmp.path() / "fleet";
  FleetOptions o = TwoSites(out);
  o.sites = {"alpha", "alpha"};
  refused(o, "listed twice");
  o.sites = {"alpha", "be/ta"};
  refused(o, "is not valid");
  o.sites = {".hidden"};
  refused(o, "is not valid");
  o.sites = {"admin"};
  refused(o, "taken");
  o = TwoSites(out);
  o.shards = 0;
  refused(o, "--shards");
  o = TwoSites(out);
  o.hosts.push_back("gamma=10.9.9.9");
  refused(o, "which --sites does not list");
  o = TwoSites(out);
  o.hosts = {"alpha=10.0.0.1 ; rm"};
  refused(o, "IP address or host name");
  o = TwoSites(out);
  o.base_ports = {"beta=70000"};
  refused(o, "not a port");
  o = TwoSites(out);
  o.shards = 10;
  o.base_ports = {"65500"};
  refused(o, "need ports up to");
  o = TwoSites(out);
  o.etc_dir = "relative/{site}";
  refused(o, "absolute");
  o = TwoSites(out);
  o.hosts = {};  // both on 127.0.0.1
  o.base_ports = {"alpha=7100", "beta=7110"};
  refused(o, "would share port 7110");
  o.base_ports = {"alpha=7100", "beta=7105"};  // interleaved, no port shared
  EXPECT_TRUE(PlanFleet(o).ok());
  o.settings = {"sync.dial=never"};
  refused(o, "no site would dial");

  // Without their own base port, sites on one host move apart by hundreds.
  o = TwoSites(out);
  o.sites = {"alpha", "beta", "gamma"};
  o.hosts = {};
  o.shards = 12;  // alpha uses 7100..7212
  auto plan = PlanFleet(o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->sites[0].base_port, 7100);
  EXPECT_EQ(plan->sites[1].base_port, 7300);
  EXPECT_EQ(plan->sites[2].base_port, 7500);
  // With metrics a shard uses base+10i+3 too: interleaved bases 5 apart still fit, 3 do not.
  o = TwoSites(out);
  o.hosts = {};
  o.metrics = true;
  o.base_ports = {"alpha=7100", "beta=7105"};
  EXPECT_TRUE(PlanFleet(o).ok());
  o.base_ports = {"alpha=7100", "beta=7103"};
  refused(o, "would share port 7103");
}

// Issue 27 item 6: values the server used to take, and fleet init with it: out of their
// ranges now, refused by the server's loader before anything is written.
TEST(FleetInit, SettingsOutsideTheServersRangesAreRefused) {
  TempDir tmp;
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"runtime.io_threads=1000000", "runtime.io_threads must be in [1, 64], not '1000000'"},
      {"limits.max_message_bytes=100000000000000000000", "[1024, 1099511627776]"},
      {"storage.dedup_window=4611686018427387904", "[1, 4294967296]"},
      {"sync.max_rounds_ahead=4611686018427387904", "[0, 256]"},
      {"sync.outer_lr=-1", "sync.outer_lr must be in (0, 100]"},
  };
  ExpectSettingsRefused(tmp.path() / "refused", refused);
}

// The site name rule fleet init cites is the one the server applies to sync.site.
TEST(FleetInit, SiteNamesAreRefusedByTheServersRule) {
  TempDir tmp;
  for (const std::string& bad :
       std::vector<std::string>{"../../etc", "a\nb", "x/y", std::string(65, 's')}) {
    FleetOptions o = TwoSites(tmp.path() / "fleet");
    o.sites = {"alpha", bad};
    o.hosts = {};
    auto r = PlanFleet(o);
    ASSERT_FALSE(r.ok()) << PrintableName(bad);
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_NE(r.status().message().find(std::string(SiteNameRule()) +
                                        " (the server's rule for sync.site)"),
              std::string::npos)
        << r.status().ToString();
    EXPECT_EQ(r.status().message().find('\n'), std::string::npos) << r.status().ToString();
    // The server refuses the same name.
    ServerConfig c;
    c.data_dir = "/d";
    c.insecure_plaintext = true;
    c.sync.site = bad;
    EXPECT_NE(ValidateServerConfig(c).message().find(SiteNameRule()), std::string::npos);
  }
}

TEST(FleetInit, OneSiteHasNoPeers) {
  TempDir tmp;
  const fs::path out = tmp.path() / "fleet";
  const FleetOptions o = OneSite(out);
  auto summary = Init(o);
  ASSERT_TRUE(summary.ok()) << summary.status().ToString();
  const ServerConfig c = LoadShard(out, "solo", 0);
  EXPECT_EQ(c.sync.site, "solo");
  EXPECT_TRUE(c.sync_peers.empty());
  EXPECT_TRUE(fs::is_empty(out / "solo" / "keys" / "peers-0"));
  EXPECT_EQ(summary->find("sync verify"), std::string::npos) << "nothing to compare with";
}

// --- fleet add-site -----------------------------------------------------------------------

// Every file under `dir`: path relative to it -> contents.
std::map<std::string, std::string> Files(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) out[fs::relative(e.path(), dir).string()] = Read(e.path());
  }
  return out;
}

Result<std::string> AddSite(const fs::path& out, const std::string& site,
                            const std::string& host = "") {
  FleetAddOptions o;
  o.out_dir = out.string();
  o.site = site;
  o.host = host;
  ISTHMUS_ASSIGN_OR_RETURN(FleetPlan plan, PlanAddSite(o));
  return WriteAddedSite(plan);
}

TEST(FleetAddSite, ANewSiteGetsItsOwnKeysAndEveryExistingKeyStaysAsItWas) {
  TempDir tmp;
  const fs::path out = tmp.path() / "fleet";
  FleetOptions o = TwoSites(out);
  o.job = "demo";
  o.settings = {"sync.codec=int8+zstd", "sync.max_rounds_ahead=3"};
  ASSERT_TRUE(Init(o).ok());
  // An operator's edit of a shard config: it must survive.
  { std::ofstream(out / "alpha" / "alpha-1.toml", std::ios::app) << "# tuned by hand\n"; }
  const auto before = Files(out);

  auto steps = AddSite(out, "gamma", "10.2.0.1");
  ASSERT_TRUE(steps.ok()) << steps.status().ToString();
  const auto after = Files(out);
  // Every file that was there is unchanged, but for the shard configs (one entry more in
  // sync.peers), README.txt and fleet.json: no key, allowlist or other file changed.
  for (const auto& [path, text] : before) {
    ASSERT_TRUE(after.count(path)) << path << " was removed";
    const bool config = path.size() > 5 && path.substr(path.size() - 5) == ".toml" &&
                        path.find("worker.toml") == std::string::npos;
    if (config || path == "README.txt" || path == "fleet.json") continue;
    EXPECT_EQ(after.at(path), text) << path << " changed";
  }
  // What is new outside gamma's folder: only gamma's shard keys on the peer allowlists.
  std::set<std::string> added_elsewhere;
  for (const auto& [path, text] : after) {
    if (!before.count(path) && path.rfind("gamma/", 0) != 0) added_elsewhere.insert(path);
  }
  EXPECT_EQ(
      added_elsewhere,
      (std::set<std::string>{"alpha/keys/peers-0/gamma-0.pub", "alpha/keys/peers-1/gamma-1.pub",
                             "beta/keys/peers-0/gamma-0.pub", "beta/keys/peers-1/gamma-1.pub"}));
  EXPECT_NE(after.at("alpha/alpha-1.toml").find("# tuned by hand\n"), std::string::npos);
  // gamma's folder is laid out as fleet init lays out a site's.
  EXPECT_EQ(Names(out / "gamma"), (std::set<std::string>{"gamma-0.toml", "gamma-1.toml",
                                                         "worker.toml", "isthmusctl.env", "keys"}));
  EXPECT_EQ(Names(out / "gamma" / "keys"),
            (std::set<std::string>{"gamma-0.key", "gamma-0.pub", "gamma-1.key", "gamma-1.pub",
                                   "worker.key", "worker.pub", "workers", "admins", "peers-0",
                                   "peers-1"}));
  struct stat st {};
  ASSERT_EQ(::stat((out / "gamma" / "keys" / "gamma-0.key").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // The fleet's admin key administers gamma too; gamma's workers have their own key.
  EXPECT_EQ(LoadPublicKeys({(out / "gamma" / "keys" / "admins").string()}).value(),
            std::vector<std::string>{
                LoadKeyPairFile((out / "admin" / "admin.key").string())->public_key});
  EXPECT_EQ(LoadPublicKeys({(out / "gamma" / "keys" / "workers").string()}).value(),
            std::vector<std::string>{
                LoadKeyPairFile((out / "gamma" / "keys" / "worker.key").string())->public_key});
  EXPECT_NE(LoadKeyPairFile((out / "gamma" / "keys" / "worker.key").string())->public_key,
            LoadKeyPairFile((out / "alpha" / "keys" / "worker.key").string())->public_key);

  // Every shard of the three sites: loaded and checked as isthmus-server does, its peers
  // exactly the same-numbered shard of the other two, at their peer endpoints, with the keys
  // of their secret keys, and those keys on its peer allowlist.
  for (int i = 0; i < 2; ++i) {
    std::map<std::string, ServerConfig> cfg;
    for (const std::string site : {"alpha", "beta", "gamma"}) cfg[site] = LoadShard(out, site, i);
    for (const auto& [site, c] : cfg) {
      EXPECT_EQ(c.sync.codec, "int8+zstd") << site;
      EXPECT_EQ(c.sync.max_rounds_ahead, 3) << site;
      auto peers = ParsePeerSpecs(c.sync_peers);
      ASSERT_TRUE(peers.ok()) << peers.status().ToString();
      std::set<std::string> listed, keys;
      for (const auto& p : *peers) {
        listed.insert(p.site);
        ASSERT_TRUE(cfg.count(p.site)) << p.site;
        EXPECT_EQ(p.endpoint, cfg.at(p.site).listen_peer) << site << " -> " << p.site;
        auto key = LoadPublicKeyFile(p.public_key_file);
        ASSERT_TRUE(key.ok()) << key.status().ToString();
        EXPECT_EQ(*key, LoadKeyPairFile(cfg.at(p.site).secret_key)->public_key);
        keys.insert(*key);
      }
      std::set<std::string> others;
      for (const auto& [other, unused] : cfg) {
        if (other != site) others.insert(other);
      }
      EXPECT_EQ(listed, others) << site << "-" << i;
      auto allowed = LoadPublicKeys(c.peer_keys);
      ASSERT_TRUE(allowed.ok());
      EXPECT_EQ(std::set<std::string>(allowed->begin(), allowed->end()), keys) << site;
    }
    EXPECT_EQ(cfg.at("gamma").listen_peer, "tcp://10.2.0.1:" + std::to_string(7102 + 10 * i));
    EXPECT_EQ(cfg.at("gamma").data_dir,
              (out / "data" / "gamma" / ("gamma-" + std::to_string(i))).string());
  }
  EXPECT_NE(Read(out / "gamma" / "worker.toml").find("job = \"demo\""), std::string::npos);
  // fleet.json and README.txt describe three sites; the steps say what each site does.
  std::ifstream fleet_file(out / "fleet.json");
  const auto fleet = nlohmann::json::parse(fleet_file);
  ASSERT_EQ(fleet["sites"].size(), 3u);
  EXPECT_EQ(fleet["sites"][2]["site"], "gamma");
  EXPECT_EQ(fleet["sites"][2]["peer_dialled_by"], (nlohmann::json{"alpha", "beta"}));
  EXPECT_EQ(fleet["sites"][2]["added"], true);
  EXPECT_FALSE(fleet["sites"][0].contains("added"));
  EXPECT_EQ(fleet["job"], "demo");
  const std::string readme = Read(out / "README.txt");
  EXPECT_NE(readme.find("sites alpha, beta, gamma"), std::string::npos) << readme;
  EXPECT_NE(readme.find("except on the sites added later (gamma)"), std::string::npos) << readme;
  EXPECT_NE(readme.find("isthmusctl sync join --from alpha -j demo"), std::string::npos) << readme;
  for (const std::string want :
       {"systemctl restart isthmus-server@alpha-0 isthmus-server@alpha-1",
        "systemctl restart isthmus-server@beta-0 isthmus-server@beta-1",
        "systemctl start isthmus-server@gamma-0 isthmus-server@gamma-1",
        "isthmusctl sync join --from alpha -j demo", "isthmusctl sync invite --site gamma -j demo",
        "no key of alpha changed", "7102,7112 peers: open to 10.0.0.1 (alpha), 10.1.0.1 (beta)"}) {
    EXPECT_NE(steps->find(want), std::string::npos) << want << "\n" << *steps;
  }

  // Again: refused, and nothing changes.
  const auto done = Files(out);
  auto again = AddSite(out, "gamma", "10.2.0.1");
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), Code::kAlreadyExists);
  EXPECT_NE(again.status().message().find("site 'gamma' is already in the fleet"),
            std::string::npos)
      << again.status().ToString();
  EXPECT_NE(again.status().message().find("nothing was changed"), std::string::npos);
  EXPECT_EQ(Files(out), done);
}

TEST(FleetAddSite, RefusesBadOptionsAndConfigsItCannotEditWithNothingChanged) {
  TempDir tmp;
  const fs::path out = tmp.path() / "fleet";
  FleetOptions o = TwoSites(out);
  o.hosts = {};  // both on 127.0.0.1: 7100 and 7200
  ASSERT_TRUE(Init(o).ok());
  const auto before = Files(out);
  auto refused = [&](FleetAddOptions a, Code code, const std::string& says) {
    auto plan = PlanAddSite(a);
    Status s = plan.status();
    if (plan.ok()) s = WriteAddedSite(*plan).status();
    ASSERT_FALSE(s.ok()) << says;
    EXPECT_EQ(s.code(), code) << s.ToString();
    EXPECT_NE(s.message().find(says), std::string::npos) << s.ToString();
    EXPECT_EQ(Files(out), before) << says;
  };
  FleetAddOptions a;
  a.out_dir = out.string();
  a.site = "be/ta";
  refused(a, Code::kInvalidArgument, "is not valid");
  a.site = "admin";
  refused(a, Code::kInvalidArgument, "taken");
  a.site = "beta";
  refused(a, Code::kAlreadyExists, "already in the fleet");
  a.site = "gamma";
  a.base_port = "7210";
  refused(a, Code::kInvalidArgument, "would share port 7210 with site beta");
  a.base_port = "";
  a.etc_dir = "relative";
  refused(a, Code::kInvalidArgument, "absolute");
  a.etc_dir = "";
  FleetAddOptions nowhere = a;
  nowhere.out_dir = (tmp.path() / "nofleet").string();
  refused(nowhere, Code::kNotFound, "no fleet.json");
  // A config whose sync.peers names the site already (an operator's entry).
  {
    std::ofstream(out / "beta" / "beta-1.toml", std::ios::app)
        << "# the list below is an operator's\n";
  }
  const std::string beta1 = Read(out / "beta" / "beta-1.toml");
  const std::string named = beta1.substr(0, beta1.find("peers = [") + 9) +
                            "\n  \"gamma=tcp://10.9.9.9:7102=/x/gamma.pub\"," +
                            beta1.substr(beta1.find("peers = [") + 9);
  { std::ofstream(out / "beta" / "beta-1.toml") << named; }
  const auto edited = Files(out);
  auto plan = PlanAddSite(a);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->sites[2].base_port, 7300) << "the next free hundred on the shared host";
  auto r = WriteAddedSite(*plan);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("beta-1.toml already names site gamma"), std::string::npos)
      << r.status().ToString();
  EXPECT_EQ(Files(out), edited) << "nothing changed";
}

TEST(FleetAddSite, AddsToAListOnOneLineAndToAOneSiteFleet) {
  TempDir tmp;
  const fs::path out = tmp.path() / "fleet";
  const FleetOptions o = OneSite(out);
  ASSERT_TRUE(Init(o).ok());
  ASSERT_TRUE(LoadShard(out, "solo", 0).sync_peers.empty());
  auto steps = AddSite(out, "second");
  ASSERT_TRUE(steps.ok()) << steps.status().ToString();
  const ServerConfig solo = LoadShard(out, "solo", 0);
  const ServerConfig second = LoadShard(out, "second", 0);
  ASSERT_EQ(solo.sync_peers.size(), 1u);
  EXPECT_EQ(solo.sync_peers[0].rfind("second=" + second.listen_peer + "=", 0), 0u)
      << solo.sync_peers[0];
  ASSERT_EQ(second.sync_peers.size(), 1u);
  EXPECT_EQ(second.sync_peers[0].rfind("solo=" + solo.listen_peer + "=", 0), 0u);
  EXPECT_EQ(second.listen_worker, "tcp://127.0.0.1:7200") << "solo holds 7100 on the same host";
  // solo's list was "peers = []": it stays on one line, and a third site goes onto it.
  const std::string text = Read(out / "solo" / "solo-0.toml");
  EXPECT_NE(text.find("peers = [\"second=" + second.listen_peer + "="), std::string::npos) << text;
  ASSERT_TRUE(AddSite(out, "third").ok());
  EXPECT_EQ(LoadShard(out, "solo", 0).sync_peers.size(), 2u);
  EXPECT_EQ(LoadShard(out, "second", 0).sync_peers.size(), 2u);
  EXPECT_EQ(LoadShard(out, "third", 0).sync_peers.size(), 2u);
}

}  // namespace
}  // namespace isthmus::ctl
