// A GoogleTest fixture with a folder of its own: `dir_`, empty at the start of each test,
// named after the process and the running test (tests of one binary may run side by side
// under ctest), and removed after it.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

namespace isthmus::testing {

class TestWithDir : public ::testing::Test {
 protected:
  explicit TestWithDir(std::string prefix = "isthmus-test") : prefix_(std::move(prefix)) {}
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           (prefix_ + "-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::filesystem::path dir_;

 private:
  std::string prefix_;
};

}  // namespace isthmus::testing
