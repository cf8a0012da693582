// isthmusctl's argument checks, run as the program: what it refuses before it writes a
// file or opens a socket (exit 2, bad usage), with a message that names the flag.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>

namespace isthmus {
namespace {

namespace fs = std::filesystem;

const char* Ctl() {
  const char* p = std::getenv("ISTHMUS_CTL_BIN");
  return p != nullptr && *p != '\0' ? p : ISTHMUS_CTL_BIN;
}

// Runs `command` in sh (stderr with stdout), at most 30 s; its exit code and output.
std::pair<int, std::string> Shell(const std::string& command) {
  FILE* f = ::popen(("timeout 30 " + command + " 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, f)) out.append(buf, n);
  const int status = ::pclose(f);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

class CtlCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("isthmus-ctlcli-" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "-" +
            std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "keys");
  }
  void TearDown() override { fs::remove_all(dir_); }
  // isthmusctl ARGS run in the test's folder.
  std::pair<int, std::string> Run(const std::string& args) {
    return Shell("sh -c 'cd " + dir_.string() + " && exec \"$0\" \"$@\"' " + Ctl() + " " + args);
  }
  fs::path dir_;
};

// Issue 27 item 6: `keygen -o ''` wrote the hidden files .key and .pub.
TEST_F(CtlCli, KeygenRefusesPrefixesThatWouldWriteHiddenFilesOrIntoAFolder) {
  for (const auto& [prefix, says] :
       std::vector<std::pair<std::string, std::string>>{{"''", "the key file prefix is empty"},
                                                        {"keys/", "ends in '/'"},
                                                        {"keys", "is a folder"}}) {
    auto [code, out] = Run("keygen -o " + prefix);
    EXPECT_EQ(code, 2) << prefix << ": " << out;
    EXPECT_NE(out.find(says), std::string::npos) << prefix << ": " << out;
  }
  EXPECT_FALSE(fs::exists(dir_ / ".key"));
  EXPECT_FALSE(fs::exists(dir_ / ".pub"));
  EXPECT_TRUE(fs::is_empty(dir_ / "keys"));
  auto [code, out] = Run("keygen -o keys/admin");
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(fs::exists(dir_ / "keys" / "admin.key"));
}

// Issue 27 item 6: `--timeout-ms -1` was accepted (and a request then waited for ever).
TEST_F(CtlCli, TimeoutMustBePositive) {
  for (const std::string value : {"-1", "0", "-5000"}) {
    for (const std::string cmd : {"status", "top --count 1", "sync status"}) {
      auto [code, out] =
          Run(cmd + " --insecure-plaintext --server tcp://127.0.0.1:9 --timeout-ms=" + value);
      EXPECT_EQ(code, 2) << cmd << " --timeout-ms=" << value << ": " << out;
      EXPECT_NE(out.find("--timeout-ms"), std::string::npos) << out;
    }
  }
}

}  // namespace
}  // namespace isthmus
