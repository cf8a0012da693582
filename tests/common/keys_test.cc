// Key files: generation, strict permissions on secret keys, allowlist folders.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "common/keys.h"
#include "tests/test_dir.h"

namespace isthmus {
namespace {

namespace fs = std::filesystem;

class KeysTest : public testing::TestWithDir {
 protected:
  KeysTest() : TestWithDir("isthmus-keys") {}
};

TEST_F(KeysTest, GeneratedPairRoundTripsThroughFiles) {
  auto pair = GenerateKeyPair();
  ASSERT_TRUE(pair.ok()) << pair.status().ToString();
  EXPECT_TRUE(IsValidZ85Key(pair->public_key));
  std::string prefix = (dir_ / "a").string();
  ASSERT_TRUE(WriteKeyPairFiles(prefix, *pair, false).ok());
  struct stat st {};
  ASSERT_EQ(::stat((prefix + ".key").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto loaded = LoadKeyPairFile(prefix + ".key");
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->public_key, pair->public_key);
  EXPECT_EQ(loaded->secret_key, pair->secret_key);
  auto pub = LoadPublicKeyFile(prefix + ".pub");
  ASSERT_TRUE(pub.ok());
  EXPECT_EQ(*pub, pair->public_key);
  // A public key file is not a key pair.
  EXPECT_FALSE(LoadKeyPairFile(prefix + ".pub").ok());
}

TEST_F(KeysTest, RefusesToOverwriteWithoutForce) {
  auto pair = GenerateKeyPair();
  std::string prefix = (dir_ / "b").string();
  ASSERT_TRUE(WriteKeyPairFiles(prefix, *pair, false).ok());
  Status again = WriteKeyPairFiles(prefix, *GenerateKeyPair(), false);
  EXPECT_EQ(again.code(), Code::kAlreadyExists);
  EXPECT_EQ(LoadKeyPairFile(prefix + ".key")->public_key, pair->public_key);
  EXPECT_TRUE(WriteKeyPairFiles(prefix, *GenerateKeyPair(), true).ok());
}

TEST_F(KeysTest, SecretKeyWithLooseModeIsRefused) {
  std::string prefix = (dir_ / "c").string();
  ASSERT_TRUE(WriteKeyPairFiles(prefix, *GenerateKeyPair(), false).ok());
  for (mode_t mode : {0640, 0604, 0660, 0644}) {
    ASSERT_EQ(::chmod((prefix + ".key").c_str(), mode), 0);
    auto r = LoadKeyPairFile(prefix + ".key");
    EXPECT_EQ(r.status().code(), Code::kPermissionDenied) << std::oct << mode;
    EXPECT_NE(r.status().message().find("chmod 600"), std::string::npos);
  }
  ASSERT_EQ(::chmod((prefix + ".key").c_str(), 0400), 0);
  EXPECT_TRUE(LoadKeyPairFile(prefix + ".key").ok());
}

TEST_F(KeysTest, MismatchedOrGarbageKeysAreRefused) {
  auto a = *GenerateKeyPair(), b = *GenerateKeyPair();
  std::string path = (dir_ / "mixed.key").string();
  {
    std::ofstream out(path);
    out << "curve\n  public-key = \"" << a.public_key << "\"\n  secret-key = \"" << b.secret_key
        << "\"\n";
  }
  ::chmod(path.c_str(), 0600);
  EXPECT_EQ(LoadKeyPairFile(path).status().code(), Code::kInvalidArgument);
  {
    std::ofstream out(path);
    out << "curve\n  public-key = \"short\"\n";
  }
  EXPECT_FALSE(LoadKeyPairFile(path).ok());
  EXPECT_FALSE(IsValidZ85Key("not a key"));
}

TEST_F(KeysTest, AllowlistReadsFilesAndFolders) {
  fs::create_directories(dir_ / "workers");
  std::vector<std::string> expect;
  for (int i = 0; i < 3; ++i) {
    auto p = *GenerateKeyPair();
    ASSERT_TRUE(
        WriteKeyPairFiles((dir_ / "workers" / ("w" + std::to_string(i))).string(), p, false).ok());
    expect.push_back(p.public_key);
  }
  auto admin = *GenerateKeyPair();
  ASSERT_TRUE(WriteKeyPairFiles((dir_ / "admin").string(), admin, false).ok());
  expect.push_back(admin.public_key);
  auto keys = LoadPublicKeys({(dir_ / "workers").string(), (dir_ / "admin.pub").string()});
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  std::sort(expect.begin(), expect.end());
  std::sort(keys->begin(), keys->end());
  EXPECT_EQ(*keys, expect);  // .key files in the folder are not read as allowlist entries
  EXPECT_EQ(LoadPublicKeys({(dir_ / "missing").string()}).status().code(), Code::kNotFound);
}

// A server's key rotation: its .pub file lists the old key and, appended, the new one.
// Clients read both (in order, repeats once); an allowlist admits both; a key pair file
// gives its one key; a bad line refuses the file.
TEST_F(KeysTest, APublicKeyFileMayListSeveralKeys) {
  auto old_pair = *GenerateKeyPair(), new_pair = *GenerateKeyPair();
  const std::string prefix = (dir_ / "server").string();
  ASSERT_TRUE(WriteKeyPairFiles(prefix, old_pair, false).ok());
  ASSERT_TRUE(WriteKeyPairFiles((dir_ / "next").string(), new_pair, false).ok());
  {
    std::ifstream in(dir_ / "next.pub");
    std::ofstream out(prefix + ".pub", std::ios::app);
    out << in.rdbuf();
    std::ifstream again(dir_ / "next.pub");
    out << again.rdbuf();  // appended twice by mistake: read once
  }
  auto listed = LoadPublicKeyList(prefix + ".pub");
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  EXPECT_EQ(*listed, (std::vector<std::string>{old_pair.public_key, new_pair.public_key}));
  EXPECT_EQ(*LoadPublicKeyFile(prefix + ".pub"), old_pair.public_key);
  auto allowed = LoadPublicKeys({prefix + ".pub"});
  ASSERT_TRUE(allowed.ok());
  EXPECT_EQ(*allowed, *listed);
  EXPECT_EQ(*LoadPublicKeyList(prefix + ".key"), std::vector<std::string>{old_pair.public_key});
  {
    std::ofstream out(prefix + ".pub", std::ios::app);
    out << "    public-key = \"too short\"\n";
  }
  EXPECT_EQ(LoadPublicKeyList(prefix + ".pub").status().code(), Code::kInvalidArgument);
}

// Issue 27 item 6: `keygen -o ''` wrote the hidden files .key and .pub.
TEST_F(KeysTest, PrefixesThatWouldWriteHiddenFilesOrIntoAFolderAreRefused) {
  fs::create_directories(dir_ / "keys");
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"", "is empty"},
      {(dir_ / "keys").string() + "/", "ends in '/'"},
      {(dir_ / "keys").string(), "is a folder"},
  };
  for (const auto& [prefix, says] : refused) {
    Status s = WriteKeyPairFiles(prefix, *GenerateKeyPair(), true);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << "'" << prefix << "'";
    EXPECT_NE(s.message().find(says), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("keys/worker.key"), std::string::npos) << s.ToString();
  }
  EXPECT_TRUE(fs::is_empty(dir_ / "keys"));
  EXPECT_FALSE(fs::exists(dir_ / ".key"));
  EXPECT_FALSE(fs::exists(".key"));
  EXPECT_TRUE(WriteKeyPairFiles((dir_ / "keys" / "w").string(), *GenerateKeyPair(), false).ok());
}

// Issue 27 item 11: a key file this user may not read is a permission problem (exit 3),
// not a missing file (exit 4). Root reads any file: then the process test covers it
// (tests/integration/shard_process_test.cc runs the server as an unprivileged user).
TEST_F(KeysTest, AnUnreadableKeyFileIsPermissionDeniedNamingTheUser) {
  if (::geteuid() == 0) GTEST_SKIP() << "root may read any file";
  const std::string prefix = (dir_ / "u").string();
  ASSERT_TRUE(WriteKeyPairFiles(prefix, *GenerateKeyPair(), false).ok());
  ASSERT_EQ(::chmod((prefix + ".key").c_str(), 0), 0);
  auto r = LoadKeyPairFile(prefix + ".key");
  EXPECT_EQ(r.status().code(), Code::kPermissionDenied) << r.status().ToString();
  EXPECT_NE(r.status().message().find("chown"), std::string::npos) << r.status().ToString();
  EXPECT_EQ(LoadKeyPairFile(prefix + ".missing").status().code(), Code::kNotFound);
}

// Issue 27 item 6: an allowlist every user of the host may write lets anyone add a key.
TEST_F(KeysTest, WorldWritableAllowlistsAreRefusedGroupWritableAccepted) {
  fs::create_directories(dir_ / "workers");
  ASSERT_TRUE(WriteKeyPairFiles((dir_ / "workers" / "w").string(), *GenerateKeyPair(), false).ok());
  ASSERT_TRUE(WriteKeyPairFiles((dir_ / "admin").string(), *GenerateKeyPair(), false).ok());
  const std::string folder = (dir_ / "workers").string(), file = (dir_ / "admin.pub").string();
  const std::string in_folder = (dir_ / "workers" / "w.pub").string();
  const AllowlistCheck check{"security.worker_keys", "workers", true};

  ASSERT_EQ(::chmod(folder.c_str(), 0777), 0);
  auto r = LoadPublicKeys({folder}, check);
  EXPECT_EQ(r.status().code(), Code::kPermissionDenied);
  EXPECT_NE(r.status().message().find("allowlist folder '" + folder +
                                      "' (security.worker_keys) has mode 0777"),
            std::string::npos)
      << r.status().ToString();
  EXPECT_NE(r.status().message().find("chmod o-w " + folder), std::string::npos);
  ASSERT_EQ(::chmod(folder.c_str(), 01777), 0);  // sticky: still anyone may add a file
  EXPECT_EQ(LoadPublicKeys({folder}, check).status().code(), Code::kPermissionDenied);
  ASSERT_EQ(::chmod(folder.c_str(), 0775), 0);
  EXPECT_TRUE(LoadPublicKeys({folder}, check).ok());

  ASSERT_EQ(::chmod(in_folder.c_str(), 0646), 0);
  r = LoadPublicKeys({folder}, check);
  EXPECT_EQ(r.status().code(), Code::kPermissionDenied);
  EXPECT_NE(r.status().message().find("chmod o-w " + in_folder), std::string::npos)
      << r.status().ToString();
  ASSERT_EQ(::chmod(in_folder.c_str(), 0664), 0);
  EXPECT_TRUE(LoadPublicKeys({folder}, check).ok());

  ASSERT_EQ(::chmod(file.c_str(), 0666), 0);
  EXPECT_EQ(LoadPublicKeys({file}).status().code(), Code::kPermissionDenied);
  ASSERT_EQ(::chmod(file.c_str(), 0644), 0);
  EXPECT_TRUE(LoadPublicKeys({file}).ok());
}

TEST_F(KeysTest, AnEmptyAllowlistFolderIsRefusedWhenTheServerNeedsIt) {
  fs::create_directories(dir_ / "admins");
  fs::create_directories(dir_ / "peers");
  std::ofstream(dir_ / "admins" / "README") << "not a key\n";
  auto r = LoadPublicKeys({(dir_ / "admins").string()},
                          {"security.admin_keys", "operators", /*refuse_empty_folders=*/true});
  EXPECT_EQ(r.status().code(), Code::kPermissionDenied);
  EXPECT_NE(r.status().message().find("(security.admin_keys) holds no *.pub file"),
            std::string::npos)
      << r.status().ToString();
  EXPECT_NE(r.status().message().find("of the operators there"), std::string::npos);
  // A peer folder of a site without peers yet may be empty.
  auto peers = LoadPublicKeys({(dir_ / "peers").string()}, {"security.peer_keys", "peers", false});
  ASSERT_TRUE(peers.ok()) << peers.status().ToString();
  EXPECT_TRUE(peers->empty());
}

}  // namespace
}  // namespace isthmus
