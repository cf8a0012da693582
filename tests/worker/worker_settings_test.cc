// What the trainable tensors mean travels with them: a job trained with LoRA alpha 16 is
// checkpointed with its LoRA settings, and eval, export (safetensors and PEFT adapter) of
// that checkpoint use 16 without being told (the eval equals the one made in training); a
// flag that contradicts them is refused, by every rank of a site alike, before anything
// trains; export's argument rules name the missing flag and write nothing else.
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
  std::fflush(nullptr);  // the child's freopen would write our buffered output again
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

TEST_F(WorkerSettings, CheckpointRecordsLoraAlphaAndEvalAndExportUseIt) {
  const double trained = TrainWithAlpha16(3);
  auto ckpt = ReadSafetensors(Ckpt());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  EXPECT_EQ(ckpt->metadata["lora_alpha"], "16");
  EXPECT_EQ(ckpt->metadata["lora_rank"], "4");
  EXPECT_EQ(ckpt->metadata["lora_targets"], "attn.c_attn,attn.c_proj,mlp.c_fc,mlp.c_proj");
  EXPECT_EQ(ckpt->metadata["train_mode"], "lora");

  // No --lora-alpha: the checkpoint's 16, so the loss is the one training measured.
  const double evaluated = EvalLoss("eval-ckpt", Ckpt());
  std::printf("alpha 16: in-training final val loss %.7f, eval of the checkpoint %.7f\n", trained,
              evaluated);
  std::fflush(stdout);
  EXPECT_NEAR(evaluated, trained, 1e-6 * trained);
  // The same tensors read with alpha 32 give another loss: the alpha matters here.
  const std::string copy32 = (dir_ / "as32.safetensors").string();
  {
    auto meta = ckpt->metadata;
    meta["lora_alpha"] = "32";
    std::vector<Tensor> weights;
    for (const auto& t : ckpt->tensors) {
      if (t.name.rfind("opt.", 0) != 0) weights.push_back(t);
    }
    ASSERT_TRUE(WriteSafetensors(copy32, weights, meta).ok());
  }
  EXPECT_GT(std::abs(EvalLoss("eval-32", copy32) - trained), 1e-4 * trained);

  // A PEFT adapter of the checkpoint says 16; its base folder is written beside it.
  const fs::path peft = dir_ / "peft";
  Ran r = Run("export-peft", "export",
              {"--base", Base(), "--trainable", Ckpt(), "--peft-dir", peft.string()});
  ASSERT_EQ(r.rc, 0) << r.err;
  auto adapter = nlohmann::json::parse(ReadFile(peft / "adapter_config.json"), nullptr, false);
  ASSERT_FALSE(adapter.is_discarded());
  EXPECT_EQ(adapter["lora_alpha"].get<double>(), 16.0);
  EXPECT_EQ(adapter["r"].get<int>(), 4);
  EXPECT_TRUE(fs::exists(peft / "base" / "config.json"));

  // --out alone writes that file and nothing else (it wrote a Hugging Face folder to
  // "/base"), and the file carries the settings on.
  const std::string exported = (dir_ / "exported.safetensors").string();
  r = Run("export-out", "export", {"--base", Base(), "--trainable", Ckpt(), "--out", exported});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.err.find("Hugging Face"), std::string::npos) << r.err;
  auto out = ReadSafetensors(exported);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->metadata["lora_alpha"], "16");
  EXPECT_NEAR(EvalLoss("eval-exported", exported), trained, 1e-6 * trained);

  // A flag that contradicts the file is refused, naming both values.
  r = Run("eval-contradicts", "eval",
          {"--base", Base(), "--trainable", Ckpt(), "--data", (dir_ / "data").string(),
           "--lora-alpha", "32"});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("--lora-alpha 32 contradicts"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("16"), std::string::npos) << r.err;

  // The shards hold tensors only: an adapter pulled from them needs the alpha given ...
  r = Run("export-server", "export",
          Cat({"--base", Base(), "--peft-dir", (dir_ / "peft2").string()}, ServerFlags()));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("give --lora-alpha"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "peft2"));
  // ... and with it, the adapter is the checkpoint's (the shards hold its tensors).
  r = Run("export-server-16", "export",
          Cat({"--base", Base(), "--peft-dir", (dir_ / "peft2").string(), "--lora-alpha", "16"},
              ServerFlags()));
  ASSERT_EQ(r.rc, 0) << r.err;
  adapter = nlohmann::json::parse(ReadFile(dir_ / "peft2" / "adapter_config.json"), nullptr, false);
  ASSERT_FALSE(adapter.is_discarded());
  EXPECT_EQ(adapter["lora_alpha"].get<double>(), 16.0);
  // eval of the shards' tensors without --lora-alpha says what it assumes.
  r = Run("eval-server", "eval",
          Cat({"--base", Base(), "--data", (dir_ / "data").string(), "--batch-size", "2",
               "--batches", "2"},
              ServerFlags()));
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("assuming --lora-alpha 32"), std::string::npos) << r.err;
}

TEST_F(WorkerSettings, OldFileWithoutLoraAlphaSaysWhatItAssumes) {
  TrainWithAlpha16(1);
  auto ckpt = ReadSafetensors(Ckpt());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  auto meta = ckpt->metadata;
  meta.erase("lora_alpha");
  const std::string old = (dir_ / "old.safetensors").string();
  ASSERT_TRUE(WriteSafetensors(old, ckpt->tensors, meta).ok());
  Ran r = Run("eval-old", "eval",
              {"--base", Base(), "--trainable", old, "--data", (dir_ / "data").string(),
               "--batch-size", "2", "--batches", "2"});
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("no record of the LoRA alpha"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("assuming --lora-alpha 32"), std::string::npos) << r.err;
  // A PEFT adapter from it is not written on an assumption.
  r = Run("export-old", "export",
          {"--base", Base(), "--trainable", old, "--peft-dir", (dir_ / "peft").string()});
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("give --lora-alpha"), std::string::npos) << r.err;
  r = Run("export-old-16", "export",
          {"--base", Base(), "--trainable", old, "--peft-dir", (dir_ / "peft").string(),
           "--lora-alpha", "16"});
  EXPECT_EQ(r.rc, 0) << r.err;
}

// Every rank of a site gives the same answer: ranks resuming a checkpoint of alpha 16
// with --lora-alpha 32 both exit 2 before training, naming both values; without the flag
// they take 16 from rank 0's checkpoint and go on. Ranks started with different alphas
// are refused alike.
TEST_F(WorkerSettings, ContradictingLoraAlphaIsRefusedByEveryRank) {
  TrainWithAlpha16(2);
  auto before = shards_[0].AdminClient()->DescribeJob("j");
  ASSERT_TRUE(before.ok()) << before.status().ToString();
  auto two_ranks = [&](const std::string& tag, const std::vector<std::string>& flags0,
                       const std::vector<std::string>& flags1, int rounds) {
    std::string rdv = "tcp:127.0.0.1:" + std::to_string(testing::FreePort());
    WorkerProcess r0, r1;
    r0.Start(TrainArgs(0, 2, rounds, 2, rdv, flags0), (dir_ / (tag + "-r0.log")).string());
    r1.Start(TrainArgs(1, 2, rounds, 2, rdv, flags1), (dir_ / (tag + "-r1.log")).string());
    const int rc0 = r0.Wait(), rc1 = r1.Wait();
    return std::make_tuple(rc0, rc1, r0.Log(), r1.Log());
  };
  auto [rc0, rc1, log0, log1] = two_ranks("a32", {"--lora-alpha", "32"}, {"--lora-alpha", "32"}, 4);
  EXPECT_EQ(rc0, 2) << log0;
  EXPECT_EQ(rc1, 2) << log1;
  for (const auto& log : {log0, log1}) {
    EXPECT_NE(log.find("--lora-alpha 32 contradicts"), std::string::npos) << log;
    EXPECT_NE(log.find("alpha 16"), std::string::npos) << log;
    EXPECT_EQ(log.find("round 3"), std::string::npos) << "nothing may train: " << log;
  }
  auto after = shards_[0].AdminClient()->DescribeJob("j");
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->pushes, before->pushes);

  // One rank alone contradicting: both refuse.
  std::tie(rc0, rc1, log0, log1) = two_ranks("a8", {}, {"--lora-alpha", "8"}, 4);
  EXPECT_EQ(rc0, 2) << log0;
  EXPECT_EQ(rc1, 2) << log1;
  EXPECT_NE(log1.find("--lora-alpha 8 contradicts"), std::string::npos) << log1;

  // No flag: rank 0's checkpoint decides, for both ranks.
  std::tie(rc0, rc1, log0, log1) = two_ranks("none", {}, {}, 3);
  ASSERT_EQ(rc0, 0) << log0;
  ASSERT_EQ(rc1, 0) << log1;
  for (int rank : {0, 1}) {
    auto c = ReadSafetensors(Ckpt(rank));
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->metadata["lora_alpha"], "16") << rank;
    EXPECT_EQ(c->metadata["round"], "3") << rank;
  }
  ExpectShardsEqualCheckpoint(0, 3);
}

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
