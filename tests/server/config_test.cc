// Settings: precedence default < file < environment < flag, refusal of unknown keys and
// wrong types, and docs/CONFIG.md generated from the one table.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "server/config/config.h"
#include "server/sync/peer_link.h"
#include "server/sync/sync_engine.h"
#include "tests/server/test_util.h"

namespace isthmus {
namespace {

TEST(ConfigTest, Precedence) {
  testing::TempDir dir;
  std::string file = dir.str() + "/s.toml";
  std::ofstream(file) << "[shard]\nid = \"from-file\"\ndata_dir = \"/d\"\n"
                         "[security]\nworker_keys = [\"a.pub\", \"b\"]\n"
                         "[storage]\nsync_writes = false\ndedup_window = 7\n";
  auto c = LoadServerConfig(file, {});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->shard_id, "from-file");
  EXPECT_EQ(c->worker_keys, (std::vector<std::string>{"a.pub", "b"}));
  EXPECT_FALSE(c->sync_writes);
  EXPECT_EQ(c->dedup_window, 7);
  EXPECT_EQ(c->listen_worker, "tcp://127.0.0.1:7100");  // default kept
  ::setenv("ISTHMUS_SHARD_ID", "from-env", 1);
  ::setenv("ISTHMUS_STORAGE_DEDUP_WINDOW", "9", 1);
  c = LoadServerConfig(file, {{"storage.dedup_window", "11"}});
  ::unsetenv("ISTHMUS_SHARD_ID");
  ::unsetenv("ISTHMUS_STORAGE_DEDUP_WINDOW");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->shard_id, "from-env");
  EXPECT_EQ(c->dedup_window, 11);
}

TEST(ConfigTest, UnknownKeysAndBadValuesAreErrors) {
  testing::TempDir dir;
  std::string file = dir.str() + "/bad.toml";
  std::ofstream(file) << "[shard]\ndata_dri = \"/d\"\n";
  auto c = LoadServerConfig(file, {});
  EXPECT_EQ(c.status().code(), Code::kInvalidArgument);
  EXPECT_NE(c.status().message().find("shard.data_dri"), std::string::npos);
  std::ofstream(file) << "[storage]\nsync_writes = \"maybe\"\n";
  EXPECT_FALSE(LoadServerConfig(file, {}).ok());
  EXPECT_FALSE(LoadServerConfig("", {{"storage.sync_writes", "maybe"}}).ok());
  EXPECT_FALSE(LoadServerConfig("", {{"limits.max_tensors", "12x"}}).ok());
  EXPECT_FALSE(LoadServerConfig("", {{"no.such", "1"}}).ok());
}

// Found by fuzz_config: toml11 read past the end of a literal string holding invalid
// UTF-8. Such files are refused before they reach it.
TEST(ConfigTest, AFileThatIsNotUtf8IsRefusedNamingTheByte) {
  testing::TempDir dir;
  const std::string file = dir.str() + "/bad.toml";
  std::ofstream(file, std::ios::binary) << "[shard]\nid = 'sh\xff\xff'\n";
  auto c = LoadServerConfig(file, {});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Code::kInvalidArgument);
  EXPECT_NE(c.status().message().find("not valid UTF-8 (byte 16)"), std::string::npos)
      << c.status().ToString();
  std::ofstream(file, std::ios::binary) << "[shard]\nid = 'Zürich ✓'\n";  // valid UTF-8
  EXPECT_TRUE(LoadServerConfig(file, {}).ok());
}

// Found by fuzz_config: toml11 recursed once per "[" of "id = [[[[...", off the stack.
TEST(ConfigTest, DeeplyNestedValuesAreRefusedBeforeParsing) {
  testing::TempDir dir;
  const std::string file = dir.str() + "/deep.toml";
  std::ofstream(file) << "[shard]\nid = " << std::string(1000, '[') << "\n";
  auto c = LoadServerConfig(file, {});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("deeper than 32 levels"), std::string::npos)
      << c.status().ToString();
  // Brackets inside strings and comments do not count.
  std::ofstream(file) << "[shard]\nid = '" << std::string(100, '[') << "' # "
                      << std::string(100, '{') << "\n";
  EXPECT_TRUE(LoadServerConfig(file, {}).ok());
}

// Found by fuzz_config: toml11 overflows a signed place value on binary integers of 63
// or more digits (undefined behaviour). They are refused before parsing; 62 digits parse.
TEST(ConfigTest, BinaryIntegersTooLongForToml11AreRefusedBeforeParsing) {
  testing::TempDir dir;
  const std::string file = dir.str() + "/bin.toml";
  std::ofstream(file) << "[x]\nq = 0b" << std::string(40, '1') << "_" << std::string(23, '0')
                      << "\n";
  auto c = LoadServerConfig(file, {});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("binary integer of more than 62 digits"), std::string::npos)
      << c.status().ToString();
  // 62 digits, and long ones inside strings, comments and bare keys, are not refused here.
  std::ofstream(file) << "[x]\nq = 0b" << std::string(62, '1') << "\nr = '0b"
                      << std::string(80, '1') << "' # 0b" << std::string(80, '1') << "\nk0b"
                      << std::string(80, '1') << " = 1\n";
  auto ok = LoadServerConfig(file, {});
  if (!ok.ok()) {
    EXPECT_EQ(ok.status().message().find("binary integer"), std::string::npos)
        << ok.status().ToString();
  }
}

TEST(ConfigTest, ValidationSaysWhatToSet) {
  auto c = *LoadServerConfig("", {});
  Status s = ValidateServerConfig(c);
  EXPECT_NE(s.message().find("shard.data_dir"), std::string::npos);
  c.data_dir = "/d";
  s = ValidateServerConfig(c);
  EXPECT_NE(s.message().find("isthmusctl keygen"), std::string::npos);
  c.insecure_plaintext = true;
  EXPECT_TRUE(ValidateServerConfig(c).ok());
}

// A tunable has one default: the peer links' own defaults (used where no config is
// loaded, as in tests and benchmarks) equal the config table's.
TEST(ConfigTest, PeerLinkDefaultsAreTheConfigDefaults) {
  const auto c = *LoadServerConfig("", {});
  const PeerLinkOptions o;
  EXPECT_EQ(o.resend_ms, c.sync_resend_ms);
  EXPECT_EQ(o.backoff_max_ms, c.sync_backoff_max_ms);
  EXPECT_EQ(o.ack_delay_ms, c.sync_ack_delay_ms);
  // The same for the round protocol's own defaults.
  const SyncOptions so;
  EXPECT_EQ(so.outer_lr, c.sync.outer_lr);
  EXPECT_EQ(so.outer_momentum, c.sync.outer_momentum);
  EXPECT_EQ(so.fragments, c.sync.fragments);
  EXPECT_EQ(so.max_rounds_ahead, c.sync.max_rounds_ahead);
  EXPECT_EQ(so.adaptive, c.sync.adaptive);
}

TEST(ConfigTest, SyncSettings) {
  testing::TempDir dir;
  std::string file = dir.str() + "/s.toml";
  std::ofstream(file) << "[sync]\nsite = \"siteA\"\nouter_lr = 0.7\nouter_momentum = 0\n"
                         "peers = [\"siteB=tcp://b:7102=b.pub\", \"siteC=tcp://c:7102=c.pub\"]\n";
  auto c = LoadServerConfig(file, {{"sync.max_rounds_ahead", "3"}});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->sync.site, "siteA");
  EXPECT_DOUBLE_EQ(c->sync.outer_lr, 0.7);
  EXPECT_DOUBLE_EQ(c->sync.outer_momentum, 0.0);  // a TOML integer is accepted
  EXPECT_EQ(c->sync.max_rounds_ahead, 3);
  EXPECT_EQ(c->sync_resend_ms, 2000);
  auto peers = ParsePeerSpecs(c->sync_peers);
  ASSERT_TRUE(peers.ok());
  ASSERT_EQ(peers->size(), 2u);
  EXPECT_EQ((*peers)[1].site, "siteC");
  EXPECT_EQ((*peers)[1].endpoint, "tcp://c:7102");
  EXPECT_EQ((*peers)[1].public_key_file, "c.pub");
  c->data_dir = "/d";
  c->insecure_plaintext = true;
  EXPECT_TRUE(ValidateServerConfig(*c).ok());
  c->sync.site = "";
  EXPECT_NE(ValidateServerConfig(*c).message().find("sync.site"), std::string::npos);
  c->sync.site = "siteB";  // names itself as a peer
  EXPECT_FALSE(ValidateServerConfig(*c).ok());
  c->sync.site = "siteA";
  c->sync_peers.push_back("siteD=tcp://d:1");
  EXPECT_FALSE(ValidateServerConfig(*c).ok());
  EXPECT_FALSE(LoadServerConfig("", {{"sync.outer_lr", "fast"}}).ok());
  EXPECT_FALSE(LoadServerConfig("", {{"sync.outer_lr", "inf"}}).ok());
}

TEST(ConfigTest, DocsMatchTheTable) {
  std::ifstream in(std::string(ISTHMUS_SOURCE_DIR) + "/docs/CONFIG.md");
  ASSERT_TRUE(in) << "docs/CONFIG.md is missing";
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_NE(ss.str().find(ServerConfigDoc()), std::string::npos)
      << "docs/CONFIG.md is out of date: regenerate the table with isthmus-server "
         "--print-config-doc";
  EXPECT_EQ(SettingEnv("storage.sync_writes"), "ISTHMUS_STORAGE_SYNC_WRITES");
  EXPECT_EQ(SettingFlag("storage.sync_writes"), "--storage.sync_writes");
}

}  // namespace
}  // namespace isthmus
