// isthmus-worker's settings against real shards: export's argument rules name the missing
// flag and write nothing else.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/worker/worker_harness.h"

namespace isthmus {
namespace {

using testing::kModelFlags;
using testing::WorkerProcess;
using testing::WorkerWithShards;
namespace fs = std::filesystem;

// One finished isthmus-worker command: its exit code, stdout and stderr.
struct Ran {
  int rc = -1;
  std::string out, err;
};

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Runs isthmus-worker with `args` to the end (killed after `timeout_s`: rc -1000).
Ran RunWorker(const fs::path& dir, const std::string& tag, const std::vector<std::string>& args,
              int timeout_s = 120) {
  const fs::path out = dir / (tag + ".out"), err = dir / (tag + ".err");
  pid_t pid = ::fork();
  if (pid == 0) {
    std::freopen(out.c_str(), "w", stdout);
    std::freopen(err.c_str(), "w", stderr);
    ::setenv("OMP_NUM_THREADS", "1", 1);
    const char* bin = testing::BinaryPath("ISTHMUS_WORKER_BIN", ISTHMUS_WORKER_BIN);
    std::vector<char*> argv = {const_cast<char*>(bin)};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(bin, argv.data());
    _exit(127);
  }
  Ran r;
  for (int i = 0; i < timeout_s * 20 && r.rc == -1; ++i) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    } else {
      ::usleep(50'000);
    }
  }
  if (r.rc == -1) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    r.rc = -1000;
  }
  r.out = ReadFile(out);
  r.err = ReadFile(err);
  return r;
}

std::vector<std::string> Cat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class WorkerSettings : public WorkerWithShards {
 protected:
  std::string Base() const { return (dir_ / "base.safetensors").string(); }
  std::string Ckpt(int rank = 0) const {
    return (dir_ / "ckpt" / ("rank-" + std::to_string(rank) + ".safetensors")).string();
  }
  // `isthmus-worker SUBCOMMAND` with the model shape of the job (no LoRA alpha) and `extra`.
  Ran Run(const std::string& tag, const std::string& sub, const std::vector<std::string>& extra) {
    return RunWorker(dir_, tag, Cat(Cat({sub}, kModelFlags), extra));
  }
  // eval's loss of `trainable` (a file), with the training's validation batches.
  double EvalLoss(const std::string& tag, const std::string& trainable,
                  const std::vector<std::string>& extra = {}) {
    Ran r = Run(tag, "eval",
                Cat({"--base", Base(), "--trainable", trainable, "--data", (dir_ / "data").string(),
                     "--batch-size", "2", "--batches", "2", "--json"},
                    extra));
    EXPECT_EQ(r.rc, 0) << r.err;
    auto j = nlohmann::json::parse(r.out, nullptr, false);
    if (j.is_discarded() || !j.contains("val_loss") || !j["val_loss"].is_number()) {
      ADD_FAILURE() << "eval printed no loss: " << r.out << r.err;
      return -1;
    }
    return j["val_loss"].get<double>();
  }
  std::vector<std::string> ServerFlags() {
    return {"--job",        "j",
            "--server",     testing::ServerProcess::Endpoint(shards_[0].worker_port()),
            "--server",     testing::ServerProcess::Endpoint(shards_[1].worker_port()),
            "--server-key", (shards_[0].dir() / "server.pub").string(),
            "--server-key", (shards_[1].dir() / "server.pub").string(),
            "--key",        (shards_[0].dir() / "workers" / "w0.key").string()};
  }
  // Trains job j for `rounds` rounds of 2 steps with LoRA alpha 16; returns the final
  // validation loss of the run (its --json-summary).
  double TrainWithAlpha16(int rounds) {
    const std::string summary = (dir_ / "summary.json").string();
    WorkerProcess w;
    w.Start(TrainArgs(0, 1, rounds, 2, "", {"--lora-alpha", "16", "--json-summary", summary}),
            (dir_ / "train.log").string());
    EXPECT_EQ(w.Wait(), 0) << w.Log();
    auto j = nlohmann::json::parse(ReadFile(summary), nullptr, false);
    if (j.is_discarded() || !j["val_loss"].is_number()) {
      ADD_FAILURE() << "no val_loss in " << summary << ": " << w.Log();
      return -1;
    }
    return j["val_loss"].get<double>();
  }
};

TEST_F(WorkerSettings, ExportArgumentRulesNameTheMissingFlag) {
  const std::string init = (dir_ / "base.init.safetensors").string();
  Ran r = Run("none", "export", {"--trainable", init});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("--out"), std::string::npos) << r.err;
  r = Run("hf-no-base", "export", {"--trainable", init, "--hf-dir", (dir_ / "hf").string()});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("--hf-dir needs --base"), std::string::npos) << r.err;
  r = Run("peft-no-base", "export", {"--trainable", init, "--peft-dir", (dir_ / "p").string()});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("--peft-dir needs --base"), std::string::npos) << r.err;
  r = Run("no-source", "export", {"--out", (dir_ / "x.safetensors").string()});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("--trainable"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "hf"));
  EXPECT_FALSE(fs::exists(dir_ / "p"));
  EXPECT_FALSE(fs::exists(dir_ / "x.safetensors"));
  // --base with --out alone checks the tensors against the base and writes only the file
  // (it wrote a Hugging Face folder to "/base").
  r = Run("out-only", "export",
          {"--base", Base(), "--trainable", init, "--out", (dir_ / "x.safetensors").string()});
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.err.find("Hugging Face"), std::string::npos) << r.err;
  EXPECT_TRUE(fs::exists(dir_ / "x.safetensors"));
}

}  // namespace
}  // namespace isthmus
