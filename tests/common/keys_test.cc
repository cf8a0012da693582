// Key files: generation, strict permissions on secret keys, allowlist folders.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "common/keys.h"

namespace isthmus {
namespace {

namespace fs = std::filesystem;

class KeysTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("isthmus-keys-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
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

}  // namespace
}  // namespace isthmus
