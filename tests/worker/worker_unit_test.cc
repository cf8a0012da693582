// Unit tests of the worker's pieces: two ranks averaging gradients over Gloo must train to
// the same parameters as one rank on the combined batch; the stop vote travels with the
// gradients; settings (a file's record of the LoRA settings) and progress formatting; the
// site client ends a wait when the worker is stopping.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "ops/device.h"
#include "tests/comm/comm_test_util.h"
#include "worker/comm/bucketed_all_reduce.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/live_params.h"
#include "worker/progress.h"
#include "worker/round_loop.h"

namespace isthmus::worker {
namespace {

constexpr int kT = 16;

model::GptConfig TinyConfig() {
  model::GptConfig c;
  c.n_layer = 2;
  c.n_embd = 32;
  c.n_head = 2;
  c.n_ctx = kT;
  return c;
}

model::LoraConfig TinyLora() {
  model::LoraConfig l;
  l.rank = 4;
  return l;
}

model::TrainerConfig TrainerCfg() {
  model::TrainerConfig t;
  t.max_lr = 1e-2f;
  t.min_lr = 1e-3f;
  t.warmup_steps = 1;
  t.total_steps = 10;
  t.grad_clip = 1.0f;
  return t;
}

// Batches of `rows` rows for step s, deterministic.
void MakeBatch(int step, int rows, std::vector<int32_t>* tokens, std::vector<int32_t>* targets) {
  std::mt19937 gen(1234 + step);
  tokens->resize(rows * kT);
  targets->resize(rows * kT);
  for (auto& t : *tokens) t = static_cast<int32_t>(gen() % 256);
  for (auto& t : *targets) t = static_cast<int32_t>(gen() % 256);
}

std::filesystem::path TempDir(const std::string& name) {
  auto d = std::filesystem::temp_directory_path() /
           ("isthmus-worker-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

// Gloo options for rank `rank` of `world` ranks meeting in the folder `dir`.
comm::GlooOptions GlooRank(int rank, int world, const std::filesystem::path& dir, int timeout_s) {
  comm::GlooOptions o;
  o.rank = rank;
  o.world_size = world;
  o.rendezvous = "file:" + dir.string();
  o.timeout = std::chrono::seconds(timeout_s);
  return o;
}

class TwoRanks : public ::testing::TestWithParam<model::TrainMode> {};

TEST_P(TwoRanks, MatchOneRankOnTheCombinedBatch) {
  const auto mode = GetParam();
  constexpr int kSteps = 4, kRowsPerRank = 2;

  // One rank, four rows per step.
  auto single = model::Gpt::CreateRandom(TinyConfig(), mode, TinyLora(), 7);
  ASSERT_TRUE(single.ok());
  auto single_trainer = model::Trainer::Create(**single, TrainerCfg());
  ASSERT_TRUE(single_trainer.ok());
  for (int s = 0; s < kSteps; ++s) {
    std::vector<int32_t> tok, tgt;
    MakeBatch(s, 2 * kRowsPerRank, &tok, &tgt);
    ASSERT_TRUE((*single_trainer)->Step(tok.data(), tgt.data(), 2 * kRowsPerRank, kT).ok());
  }
  auto want = (*single)->ExportTrainable();

  // Two ranks as threads, each with its half of every batch, gradients averaged by the
  // same hook the worker installs.
  auto dir = TempDir(std::string("tworanks-") + model::TrainModeName(mode));
  std::vector<std::vector<Tensor>> got(2);
  std::vector<Status> errors(2);
  std::vector<float> stop_seen(2, -1);
  auto rank_main = [&](int rank) {
    comm::GlooOptions o = GlooRank(rank, 2, dir, 20);
    auto comm = comm::CreateGlooCommunicator(o);
    if (!comm.ok()) {
      errors[rank] = comm.status();
      return;
    }
    auto gpt = model::Gpt::CreateRandom(TinyConfig(), mode, TinyLora(), 7);
    auto trainer = model::Trainer::Create(**gpt, TrainerCfg());
    if (!trainer.ok()) {
      errors[rank] = trainer.status();
      return;
    }
    (*trainer)->SetGradHook(MakeAllReduceHook(comm->get()));
    for (int s = 0; s < kSteps; ++s) {
      std::vector<int32_t> tok, tgt;
      MakeBatch(s, 2 * kRowsPerRank, &tok, &tgt);
      const float local_stop = (rank == 1 && s == kSteps - 1) ? 1.0f : 0.0f;
      auto st =
          (*trainer)->Step(tok.data() + rank * kRowsPerRank * kT,
                           tgt.data() + rank * kRowsPerRank * kT, kRowsPerRank, kT, local_stop);
      if (!st.ok()) {
        errors[rank] = st.status();
        break;
      }
      stop_seen[rank] = st->control;
    }
    got[rank] = (*gpt)->ExportTrainable();
  };
  std::thread r0(rank_main, 0), r1(rank_main, 1);
  r0.join();
  r1.join();
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(errors[0].ok()) << errors[0].ToString();
  ASSERT_TRUE(errors[1].ok()) << errors[1].ToString();
  // Rank 1 voted to stop on the last step: both ranks learn it from the same all-reduce.
  EXPECT_GT(stop_seen[0], 0.0f);
  EXPECT_GT(stop_seen[1], 0.0f);

  ASSERT_EQ(got[0].size(), want.size());
  double max_diff = 0, max_change = 0;
  auto init = model::Gpt::CreateRandom(TinyConfig(), mode, TinyLora(), 7);
  auto start = (*init)->ExportTrainable();
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[0][i].name, want[i].name);
    // Ranks stay bitwise identical.
    ASSERT_EQ(got[0][i].data, got[1][i].data) << want[i].name;
    for (size_t k = 0; k < want[i].data.size(); ++k) {
      max_diff = std::max(max_diff, std::abs(double(got[0][i].data[k]) - want[i].data[k]));
      max_change = std::max(max_change, std::abs(double(want[i].data[k]) - start[i].data[k]));
    }
  }
  EXPECT_GT(max_change, 1e-3) << "training did not move the parameters";
  EXPECT_LT(max_diff, 1e-4) << "two ranks differ from one rank on the combined batch";
}

INSTANTIATE_TEST_SUITE_P(Modes, TwoRanks,
                         ::testing::Values(model::TrainMode::kLora, model::TrainMode::kFull),
                         [](const auto& info) {
                           return std::string(model::TrainModeName(info.param));
                         });

// A sink that keeps, for every piece the backward hands over, the piece as it was then,
// and the whole gradient at End: a piece that changed after it was handed over was not
// final, and an all-reduce started on it would have sent wrong numbers.
class RecordingSink final : public GradientSink {
 public:
  void Begin(float* grads, size_t count) override {
    grads_ = grads;
    count_ = count;
    pieces_.clear();
  }
  void Final(size_t from, std::function<Status()> wait) override {
    ASSERT_TRUE(wait().ok());
    pieces_.push_back({from, std::vector<float>(grads_ + from, grads_ + count_)});
  }
  Status End() override {
    at_end_.assign(grads_, grads_ + count_);
    return Status::Ok();
  }
  std::vector<std::pair<size_t, std::vector<float>>> pieces_;
  std::vector<float> at_end_;

 private:
  float* grads_ = nullptr;
  size_t count_ = 0;
};

struct ShapeCase {
  std::string name;
  model::GptConfig config;
  model::TrainMode mode;
};

std::vector<ShapeCase> ShapeCases() {
  model::GptConfig llama;
  llama.family = model::ModelFamily::kLlama;
  llama.n_layer = 3;
  llama.n_embd = 32;
  llama.n_head = 4;
  llama.n_kv_head = 2;
  llama.n_inner = 48;
  llama.n_ctx = kT;
  llama.tied_embeddings = false;
  model::GptConfig gpt2 = TinyConfig();
  gpt2.n_layer = 3;
  return {{"gpt2_full", gpt2, model::TrainMode::kFull},
          {"gpt2_lora", gpt2, model::TrainMode::kLora},
          {"llama_full", llama, model::TrainMode::kFull},
          {"llama_lora", llama, model::TrainMode::kLora}};
}

class GradientPieces : public ::testing::TestWithParam<ShapeCase> {};

// The backward hands the gradient over from the end down, one piece per block and the rest
// last, and nothing of a piece changes after it was handed over (the tied head's gradient
// in wte, the embeddings and the final norm included).
TEST_P(GradientPieces, AreFinalWhenHandedOver) {
  const ShapeCase& c = GetParam();
  model::LoraConfig lora = TinyLora();
  lora.targets = model::LoraTargetNames(c.config.family);  // every linear of the family
  auto gpt = model::Gpt::CreateRandom(c.config, c.mode, lora, 3);
  ASSERT_TRUE(gpt.ok()) << gpt.status().ToString();
  auto trainer = model::Trainer::Create(**gpt, TrainerCfg());
  ASSERT_TRUE(trainer.ok());
  RecordingSink sink;
  (*trainer)->SetGradientSink(&sink);
  for (int micro : {1, 2}) {
    std::vector<int32_t> tok, tgt;
    MakeBatch(micro, 2 * micro, &tok, &tgt);
    auto st = (*trainer)->Step(tok.data(), tgt.data(), 2, kT, 0.0f, micro);
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    ASSERT_EQ(sink.pieces_.size(), static_cast<size_t>(c.config.n_layer)) << "micro " << micro;
    EXPECT_EQ(sink.pieces_.back().first, 0u);
    EXPECT_EQ(sink.at_end_.size(), static_cast<size_t>((*gpt)->GradElements()));
    size_t previous = sink.at_end_.size();
    for (const auto& [from, piece] : sink.pieces_) {
      EXPECT_LT(from, previous) << "pieces must come from the end down";
      previous = from;
      const long bad =
          comm::testing::FirstBitMismatch(piece.data(), sink.at_end_.data() + from, piece.size());
      EXPECT_EQ(bad, -1) << "element " << (bad + from) << " changed after the piece from " << from
                         << " was handed over (micro-batches " << micro << ")";
    }
    double norm = 0;
    for (float g : sink.at_end_) norm += double(g) * g;
    EXPECT_GT(norm, 0.0);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GradientPieces, ::testing::ValuesIn(ShapeCases()),
                         [](const auto& info) { return info.param.name; });

struct BucketCase {
  std::string name;
  model::TrainMode mode;
  int world;
  size_t bucket_bytes;
};

class BucketedAllReduceTest : public ::testing::TestWithParam<BucketCase> {};

// Ranks that average their gradients in buckets during the backward train to the same
// parameters as ranks that average the whole gradient after it: bit for bit with two ranks
// (each element is one sum of two numbers either way), to rounding with three (Gloo's ring
// may add a bucket's elements in another order than the whole buffer's; AdamW then turns a
// last-bit difference of a near-zero gradient into a difference of up to ~1e-6).
TEST_P(BucketedAllReduceTest, TrainsAsOneAllReduceAfterTheBackward) {
  const BucketCase& c = GetParam();
  constexpr int kSteps = 3, kRows = 2;
  model::GptConfig config = TinyConfig();
  config.n_layer = 4;
  auto run = [&](bool bucketed, std::vector<std::vector<Tensor>>* got,
                 std::vector<comm::BucketStats>* stats) {
    auto dir = TempDir("buckets-" + c.name + (bucketed ? "-on" : "-off"));
    std::vector<Status> errors(c.world);
    got->assign(c.world, {});
    stats->assign(c.world, {});
    comm::testing::RunRanks(c.world, [&](int rank) {
      comm::GlooOptions o = GlooRank(rank, c.world, dir, 30);
      auto comm = comm::CreateGlooCommunicator(o);
      if (!comm.ok()) {
        errors[rank] = comm.status();
        return;
      }
      auto gpt = model::Gpt::CreateRandom(config, c.mode, TinyLora(), 11);
      auto trainer = model::Trainer::Create(**gpt, TrainerCfg());
      std::unique_ptr<comm::BucketedAllReduce> buckets;
      if (bucketed) {
        buckets = std::make_unique<comm::BucketedAllReduce>(**comm, c.bucket_bytes);
        (*trainer)->SetGradientSink(buckets.get());
      } else {
        (*trainer)->SetGradHook(MakeAllReduceHook(comm->get()));
      }
      for (int s = 0; s < kSteps && errors[rank].ok(); ++s) {
        std::vector<int32_t> tok, tgt;
        MakeBatch(s, c.world * kRows, &tok, &tgt);
        auto st = (*trainer)->Step(tok.data() + rank * kRows * kT, tgt.data() + rank * kRows * kT,
                                   kRows, kT);
        if (!st.ok()) errors[rank] = st.status();
      }
      if (buckets) (*stats)[rank] = buckets->last();
      (*got)[rank] = (*gpt)->ExportTrainable();
    });
    std::filesystem::remove_all(dir);
    for (const Status& e : errors) ASSERT_TRUE(e.ok()) << e.ToString();
  };
  std::vector<std::vector<Tensor>> plain, bucketed;
  std::vector<comm::BucketStats> unused, stats;
  ASSERT_NO_FATAL_FAILURE(run(false, &plain, &unused));
  ASSERT_NO_FATAL_FAILURE(run(true, &bucketed, &stats));
  // One bucket per block and the rest when the bucket is one byte; one in all when it is
  // larger than the whole gradient.
  const int want_buckets = c.bucket_bytes == 1 ? config.n_layer : 1;
  double max_diff = 0;
  for (int r = 0; r < c.world; ++r) {
    EXPECT_EQ(stats[r].buckets, want_buckets) << "rank " << r;
    ASSERT_EQ(bucketed[r].size(), plain[r].size());
    for (size_t i = 0; i < plain[r].size(); ++i) {
      ASSERT_EQ(bucketed[r][i].data, bucketed[0][i].data) << "ranks differ: " << plain[r][i].name;
      for (size_t k = 0; k < plain[r][i].data.size(); ++k) {
        max_diff =
            std::max(max_diff, std::abs(double(bucketed[r][i].data[k]) - plain[r][i].data[k]));
      }
      if (c.world == 2) {
        EXPECT_EQ(bucketed[r][i].data, plain[r][i].data) << plain[r][i].name;
      }
    }
  }
  EXPECT_LT(max_diff, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BucketedAllReduceTest,
    ::testing::Values(BucketCase{"lora_2_per_block", model::TrainMode::kLora, 2, 1},
                      BucketCase{"full_2_per_block", model::TrainMode::kFull, 2, 1},
                      BucketCase{"full_2_one", model::TrainMode::kFull, 2, size_t{1} << 30},
                      BucketCase{"full_3_per_block", model::TrainMode::kFull, 3, 1}),
    [](const auto& info) { return info.param.name; });

// A site of `world` ranks as threads training `steps` steps (batches from `first_batch` on)
// from `start` (weights and optimizer state; empty: the seed's weights), the AdamW moments
// split across the ranks (ZeRO-1) or not. Per rank: the weights, the exported state, and
// how many elements of moments the rank held.
struct SiteRun {
  std::vector<std::vector<Tensor>> weights, state;
  std::vector<int64_t> moment_elements;
};
void RunSite(int world, bool sharded, model::TrainMode mode, size_t bucket_bytes,
             const std::vector<Tensor>& start, int first_batch, int steps, SiteRun* out) {
  constexpr int kRows = 2;
  model::GptConfig config = TinyConfig();
  config.n_layer = 3;
  auto dir = TempDir("zero1-" + std::to_string(world) + (sharded ? "-on" : "-off"));
  std::vector<Status> errors(world);
  out->weights.assign(world, {});
  out->state.assign(world, {});
  out->moment_elements.assign(world, 0);
  comm::testing::RunRanks(world, [&](int rank) {
    auto fail = [&](const Status& st) { errors[rank] = st; };
    auto comm = comm::CreateGlooCommunicator(GlooRank(rank, world, dir, 30));
    if (!comm.ok()) return fail(comm.status());
    auto gpt = model::Gpt::CreateRandom(config, mode, TinyLora(), 11);
    auto trainer = model::Trainer::Create(**gpt, TrainerCfg());
    if (sharded) {
      model::OptimizerShards shards;
      shards.rank = rank;
      shards.world_size = world;
      shards.all_gather = [c = comm->get()](float* data, const std::vector<size_t>& counts) {
        return c->AllGather(data, counts);
      };
      if (Status st = (*trainer)->ShardOptimizerState(shards); !st.ok()) return fail(st);
    }
    if (!start.empty()) {
      std::vector<Tensor> weights;
      for (const Tensor& t : start) {
        if (t.name.rfind("opt.", 0) != 0) weights.push_back(t);
      }
      if (Status st = (*gpt)->LoadTrainable(weights); !st.ok()) return fail(st);
      if (Status st = (*trainer)->LoadState(start); !st.ok()) return fail(st);
    }
    std::unique_ptr<comm::BucketedAllReduce> buckets;
    if (bucket_bytes > 0) {
      buckets = std::make_unique<comm::BucketedAllReduce>(**comm, bucket_bytes);
      (*trainer)->SetGradientSink(buckets.get());
    } else {
      (*trainer)->SetGradHook(MakeAllReduceHook(comm->get()));
    }
    for (int s = first_batch; s < first_batch + steps; ++s) {
      std::vector<int32_t> tok, tgt;
      MakeBatch(s, world * kRows, &tok, &tgt);
      auto st = (*trainer)->Step(tok.data() + rank * kRows * kT, tgt.data() + rank * kRows * kT,
                                 kRows, kT);
      if (!st.ok()) return fail(st.status());
    }
    auto state = (*trainer)->ExportState();  // collective when sharded
    if (!state.ok()) return fail(state.status());
    out->state[rank] = std::move(state).value();
    out->weights[rank] = (*gpt)->ExportTrainable();
    out->moment_elements[rank] = (*trainer)->shard_end() - (*trainer)->shard_begin();
  });
  std::filesystem::remove_all(dir);
  for (int r = 0; r < world; ++r)
    ASSERT_TRUE(errors[r].ok()) << "rank " << r << ": " << errors[r].ToString();
}

void ExpectSameBits(const std::vector<Tensor>& got, const std::vector<Tensor>& want,
                    const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].name, want[i].name) << what;
    ASSERT_EQ(got[i].data.size(), want[i].data.size()) << what << ": " << want[i].name;
    const long bad = comm::testing::FirstBitMismatch(got[i].data.data(), want[i].data.data(),
                                                     want[i].data.size());
    EXPECT_EQ(bad, -1) << what << ": " << want[i].name << " element " << bad;
  }
}

struct ShardCase {
  std::string name;
  model::TrainMode mode;
  int world;
  size_t bucket_bytes;  // 0: one all-reduce after the backward
};

class OptimizerShardsTest : public ::testing::TestWithParam<ShardCase> {};

// Ranks that split the AdamW moments (ZeRO-1) train bit for bit like ranks that each hold
// all of them, while holding only their part, and export the same whole state (the
// checkpoint format does not change). That state continues on another rank count, sharded,
// exactly as it does unsharded.
TEST_P(OptimizerShardsTest, TrainBitForBitLikeWholeMomentsAndCarryOverToAnotherRankCount) {
  const ShardCase& c = GetParam();
  SiteRun whole, split;
  ASSERT_NO_FATAL_FAILURE(RunSite(c.world, false, c.mode, c.bucket_bytes, {}, 0, 3, &whole));
  ASSERT_NO_FATAL_FAILURE(RunSite(c.world, true, c.mode, c.bucket_bytes, {}, 0, 3, &split));
  const int64_t n = whole.moment_elements[0];
  int64_t held = 0;
  for (int r = 0; r < c.world; ++r) {
    const std::string rank = "rank " + std::to_string(r);
    ExpectSameBits(split.weights[r], whole.weights[r], rank + " weights");
    ExpectSameBits(split.state[r], whole.state[r], rank + " optimizer state");
    EXPECT_EQ(whole.moment_elements[r], n);
    EXPECT_LE(split.moment_elements[r], (n + c.world - 1) / c.world + 15) << rank;
    held += split.moment_elements[r];
  }
  EXPECT_EQ(held, n) << "the parts must cover every trainable element once";
  // Training moved the weights (else equality proves nothing).
  model::GptConfig config = TinyConfig();
  config.n_layer = 3;
  auto init = model::Gpt::CreateRandom(config, c.mode, TinyLora(), 11);
  ASSERT_TRUE(init.ok());
  EXPECT_NE(whole.weights[0].back().data, (*init)->ExportTrainable().back().data);

  // The sharded site's checkpoint (weights and whole state) on one rank more.
  std::vector<Tensor> start = split.weights[0];
  start.insert(start.end(), split.state[0].begin(), split.state[0].end());
  SiteRun more_whole, more_split;
  ASSERT_NO_FATAL_FAILURE(
      RunSite(c.world + 1, false, c.mode, c.bucket_bytes, start, 3, 2, &more_whole));
  ASSERT_NO_FATAL_FAILURE(
      RunSite(c.world + 1, true, c.mode, c.bucket_bytes, start, 3, 2, &more_split));
  for (int r = 0; r <= c.world; ++r) {
    ExpectSameBits(more_split.weights[r], more_whole.weights[r], "after the change, weights");
    ExpectSameBits(more_split.state[r], more_whole.state[r], "after the change, state");
  }
  EXPECT_NE(more_whole.weights[0].back().data, split.weights[0].back().data);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, OptimizerShardsTest,
    ::testing::Values(ShardCase{"full_2_hook", model::TrainMode::kFull, 2, 0},
                      ShardCase{"full_2_buckets", model::TrainMode::kFull, 2, 1},
                      ShardCase{"full_3_buckets", model::TrainMode::kFull, 3, 1},
                      ShardCase{"lora_2_hook", model::TrainMode::kLora, 2, 0}),
    [](const auto& info) { return info.param.name; });

TEST(OptimizerShards, BadShardsAreRefused) {
  auto gpt = model::Gpt::CreateRandom(TinyConfig(), model::TrainMode::kFull, TinyLora(), 1);
  auto trainer = model::Trainer::Create(**gpt, TrainerCfg());
  ASSERT_TRUE(trainer.ok());
  model::OptimizerShards bad;
  bad.rank = 2;
  bad.world_size = 2;
  bad.all_gather = [](float*, const std::vector<size_t>&) { return Status::Ok(); };
  Status st = (*trainer)->ShardOptimizerState(bad);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("rank 2 outside [0, 2)"), std::string::npos) << st.ToString();
  bad.rank = 0;
  bad.all_gather = nullptr;
  EXPECT_EQ((*trainer)->ShardOptimizerState(bad).code(), Code::kInvalidArgument);
  EXPECT_FALSE((*trainer)->sharded());
}

// In bf16 the buckets carry half the bytes and the weights stay within bf16 rounding of the
// fp32 run's, while the gradient's last float (the trainer's control value, a code up to
// (ranks + 1)^3) is averaged exactly: 729 is not a bf16 value.
TEST(BucketedAllReduce, Bf16BucketsTrainCloseToFp32AndKeepTheControlValueExact) {
  model::GptConfig config = TinyConfig();
  config.n_layer = 3;
  auto dir = TempDir("buckets-bf16");
  std::vector<std::vector<Tensor>> got(4);
  std::vector<float> control(2, 0.0f);
  std::vector<Status> errors(2);
  comm::testing::RunRanks(2, [&](int rank) {
    comm::GlooOptions o = GlooRank(rank, 2, dir, 30);
    auto comm = comm::CreateGlooCommunicator(o);
    if (!comm.ok()) {
      errors[rank] = comm.status();
      return;
    }
    std::vector<float> code = {0.5f, 1.0f, 729.0f};
    errors[rank] = comm::ReduceGradient(**comm, code.data(), 0, 3, 3, /*bf16=*/true);
    control[rank] = code[2];
    for (bool bf16 : {false, true}) {
      auto gpt = model::Gpt::CreateRandom(config, model::TrainMode::kFull, TinyLora(), 11);
      auto trainer = model::Trainer::Create(**gpt, TrainerCfg());
      comm::BucketedAllReduce buckets(**comm, 1, bf16);
      (*trainer)->SetGradientSink(&buckets);
      for (int s = 0; s < 3 && errors[rank].ok(); ++s) {
        std::vector<int32_t> tok, tgt;
        MakeBatch(s, 4, &tok, &tgt);
        auto st = (*trainer)->Step(tok.data() + rank * 2 * kT, tgt.data() + rank * 2 * kT, 2, kT);
        if (!st.ok()) errors[rank] = st.status();
      }
      got[2 * rank + bf16] = (*gpt)->ExportTrainable();
    }
  });
  std::filesystem::remove_all(dir);
  for (const Status& e : errors) ASSERT_TRUE(e.ok()) << e.ToString();
  EXPECT_EQ(control[0], 729.0f);
  EXPECT_EQ(control[1], 729.0f);
  double max_diff = 0, max_step = 0;
  auto init = model::Gpt::CreateRandom(config, model::TrainMode::kFull, TinyLora(), 11);
  auto start = (*init)->ExportTrainable();
  for (size_t i = 0; i < got[0].size(); ++i) {
    EXPECT_EQ(got[1][i].data, got[3][i].data) << "ranks differ in bf16: " << got[1][i].name;
    for (size_t k = 0; k < got[0][i].data.size(); ++k) {
      max_diff = std::max(max_diff, std::abs(double(got[1][i].data[k]) - got[0][i].data[k]));
      max_step = std::max(max_step, std::abs(double(got[0][i].data[k]) - start[i].data[k]));
    }
  }
  EXPECT_GT(max_diff, 0.0) << "bf16 changed nothing: were the buckets reduced in fp32?";
  EXPECT_LT(max_diff, 0.1 * max_step) << "bf16 moved the weights too far from fp32";
}

// A rank that is gone before the step: the others' bucketed step fails within the
// communicator's timeout, with Gloo's error, and the optimizer never runs on a half-reduced
// gradient (their parameters stay as they were).
TEST(BucketedAllReduce, APeerThatIsGoneFailsTheStepWithoutApplyingIt) {
  auto dir = TempDir("buckets-gone");
  Status rank0;
  std::vector<Tensor> before, after;
  comm::testing::RunRanks(2, [&](int rank) {
    comm::GlooOptions o = GlooRank(rank, 2, dir, 3);
    auto comm = comm::CreateGlooCommunicator(o);
    ASSERT_TRUE(comm.ok()) << comm.status().ToString();
    if (rank == 1) return;  // leaves the group: its sockets close with it
    auto gpt = model::Gpt::CreateRandom(TinyConfig(), model::TrainMode::kFull, TinyLora(), 5);
    auto trainer = model::Trainer::Create(**gpt, TrainerCfg());
    comm::BucketedAllReduce buckets(**comm, 1);
    (*trainer)->SetGradientSink(&buckets);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    before = (*gpt)->ExportTrainable();
    std::vector<int32_t> tok, tgt;
    MakeBatch(0, 2, &tok, &tgt);
    const auto t0 = std::chrono::steady_clock::now();
    auto st = (*trainer)->Step(tok.data(), tgt.data(), 2, kT);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
    rank0 = st.ok() ? Status::Ok() : st.status();
    EXPECT_EQ((*trainer)->step(), 0);
    after = (*gpt)->ExportTrainable();
  });
  std::filesystem::remove_all(dir);
  ASSERT_FALSE(rank0.ok());
  EXPECT_NE(rank0.message().find("rank 0 of 2"), std::string::npos) << rank0.ToString();
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) EXPECT_EQ(before[i].data, after[i].data);
}

// Sharded moments: a peer that is gone after the gradient's all-reduce, before the
// all-gather of the parameters, fails the step within the timeout (naming the rank), the
// step counter does not move, and the broken group exports no state, so no checkpoint is
// written from parameters only this rank's part of which was updated.
TEST(OptimizerShards, APeerGoneBeforeTheAllGatherFailsTheStepAndNoStateIsExported) {
  auto dir = TempDir("zero1-gone");
  Status step0, export0;
  int64_t steps0 = -1;
  comm::testing::RunRanks(2, [&](int rank) {
    auto comm = comm::CreateGlooCommunicator(GlooRank(rank, 2, dir, 3));
    ASSERT_TRUE(comm.ok()) << comm.status().ToString();
    auto gpt = model::Gpt::CreateRandom(TinyConfig(), model::TrainMode::kFull, TinyLora(), 5);
    auto trainer = model::Trainer::Create(**gpt, TrainerCfg());
    model::OptimizerShards shards;
    shards.rank = rank;
    shards.world_size = 2;
    shards.all_gather = [c = comm->get(), rank](float* data, const std::vector<size_t>& counts) {
      // Rank 1 dies here: it returns, and its sockets close with its communicator.
      return rank == 1 ? Status::Unavailable("rank 1 is gone") : c->AllGather(data, counts);
    };
    ASSERT_TRUE((*trainer)->ShardOptimizerState(shards).ok());
    (*trainer)->SetGradHook(MakeAllReduceHook(comm->get()));
    std::vector<int32_t> tok, tgt;
    MakeBatch(0, 4, &tok, &tgt);
    const auto t0 = std::chrono::steady_clock::now();
    auto st = (*trainer)->Step(tok.data() + rank * 2 * kT, tgt.data() + rank * 2 * kT, 2, kT);
    if (rank == 1) return;
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
    step0 = st.ok() ? Status::Ok() : st.status();
    steps0 = (*trainer)->step();
    auto state = (*trainer)->ExportState();
    export0 = state.ok() ? Status::Ok() : state.status();
  });
  std::filesystem::remove_all(dir);
  ASSERT_FALSE(step0.ok());
  EXPECT_NE(step0.message().find("rank 0 of 2"), std::string::npos) << step0.ToString();
  EXPECT_EQ(steps0, 0);
  EXPECT_EQ(export0.code(), Code::kFailedPrecondition) << export0.ToString();
}

// Ranks launched with different --bucket-mb would run different collectives: they are
// refused at the rendezvous, before any collective, naming both ranks and both values.
TEST(BucketedAllReduce, RanksWithDifferentBucketSettingsAreRefusedAtTheRendezvous) {
  auto dir = TempDir("buckets-settings");
  std::vector<Status> got(2);
  comm::testing::RunRanks(2, [&](int rank) {
    comm::GlooOptions o = GlooRank(rank, 2, dir, 10);
    o.settings = rank == 0 ? "--bucket-mb 25" : "--bucket-mb 5";
    auto comm = comm::CreateGlooCommunicator(o);
    got[rank] = comm.ok() ? Status::Ok() : comm.status();
  });
  std::filesystem::remove_all(dir);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(got[r].code(), Code::kFailedPrecondition) << got[r].ToString();
    EXPECT_NE(got[r].message().find("--bucket-mb 25"), std::string::npos) << got[r].message();
    EXPECT_NE(got[r].message().find("--bucket-mb 5"), std::string::npos) << got[r].message();
    EXPECT_NE(got[r].message().find("rank " + std::to_string(1 - r)), std::string::npos);
  }
}

// The round driver's LiveParams on the model's backend: the delta is "now minus the
// round's start" and the live weights become start + delta (what a shard adding it holds);
// the merge of a pulled state P keeps the progress made since (live + (P - base)) or, with
// none, takes P as it is; bit for bit the host arithmetic of HostLiveParams. In LoRA mode
// (the adapters) and full mode (every tensor).
class ModelLiveParamsTest : public ::testing::TestWithParam<model::TrainMode> {};

TEST_P(ModelLiveParamsTest, SnapshotAndMergeAreTheHostArithmeticBitForBit) {
  auto gpt = model::Gpt::CreateRandom(TinyConfig(), GetParam(), TinyLora(), 4);
  ASSERT_TRUE(gpt.ok());
  auto trainer = model::Trainer::Create(**gpt, TrainerCfg());
  ASSERT_TRUE(trainer.ok());
  auto live = ModelLiveParams::Create(**gpt, nullptr);
  ASSERT_TRUE(live.ok()) << live.status().ToString();
  auto train = [&](int steps, int from) {
    for (int s = 0; s < steps; ++s) {
      std::vector<int32_t> tok, tgt;
      MakeBatch(from + s, 2, &tok, &tgt);
      ASSERT_TRUE((*trainer)->Step(tok.data(), tgt.data(), 2, kT).ok());
    }
  };
  const std::vector<Tensor> start = (*gpt)->ExportTrainable();
  train(3, 0);
  const std::vector<Tensor> now = (*gpt)->ExportTrainable();
  auto delta = (*live)->TakeDelta();
  ASSERT_TRUE(delta.ok()) << delta.status().ToString();
  const std::vector<Tensor> after = (*gpt)->ExportTrainable();
  ASSERT_EQ(delta->size(), now.size());
  double moved = 0;
  for (size_t i = 0; i < now.size(); ++i) {
    ASSERT_EQ((*delta)[i].name, now[i].name);
    for (size_t k = 0; k < now[i].data.size(); ++k) {
      ASSERT_EQ((*delta)[i].data[k], now[i].data[k] - start[i].data[k]) << now[i].name;
      ASSERT_EQ(after[i].data[k], start[i].data[k] + (*delta)[i].data[k]) << now[i].name;
      moved += std::fabs((*delta)[i].data[k]);
    }
  }
  EXPECT_GT(moved, 0.0);

  // A pulled state: the base moved by a pattern of its own.
  std::vector<Tensor> pulled = after;
  for (auto& t : pulled) {
    for (size_t k = 0; k < t.data.size(); ++k) t.data[k] += 0.001f * static_cast<float>(k % 7);
  }
  train(2, 3);
  const std::vector<Tensor> progressed = (*gpt)->ExportTrainable();
  ASSERT_TRUE((*live)->Rebase(&pulled, /*progressed=*/true).ok());
  const std::vector<Tensor> merged = (*gpt)->ExportTrainable();
  for (size_t i = 0; i < merged.size(); ++i) {
    for (size_t k = 0; k < merged[i].data.size(); ++k) {
      const float want = progressed[i].data[k] + (pulled[i].data[k] - after[i].data[k]);
      ASSERT_EQ(merged[i].data[k], want) << merged[i].name;
    }
  }
  // The base is now the pulled state: the next delta is the progress since the merge. It is
  // taken into the first delta's buffers, handed back (Recycle), and what they held is gone.
  std::vector<const float*> buffers;
  for (const auto& t : *delta) buffers.push_back(t.data.data());
  (*live)->Recycle(std::move(*delta));
  auto zero = (*live)->TakeDelta();
  ASSERT_TRUE(zero.ok());
  for (size_t i = 0; i < zero->size(); ++i) EXPECT_EQ((*zero)[i].data.data(), buffers[i]);
  for (size_t i = 0; i < zero->size(); ++i) {
    for (size_t k = 0; k < (*zero)[i].data.size(); ++k) {
      ASSERT_EQ((*zero)[i].data[k], merged[i].data[k] - pulled[i].data[k]);
    }
  }
  // No progress since the base: the pulled state exactly.
  ASSERT_TRUE((*live)->Rebase(&pulled, /*progressed=*/false).ok());
  const std::vector<Tensor> taken = (*gpt)->ExportTrainable();
  for (size_t i = 0; i < taken.size(); ++i) EXPECT_EQ(taken[i].data, pulled[i].data);
  // A state missing a tensor changes nothing.
  std::vector<Tensor> partial(pulled.begin() + 1, pulled.end());
  EXPECT_EQ((*live)->Rebase(&partial, true).code(), Code::kInvalidArgument);
  EXPECT_EQ((*gpt)->ExportTrainable()[0].data, taken[0].data);
}

INSTANTIATE_TEST_SUITE_P(Modes, ModelLiveParamsTest,
                         ::testing::Values(model::TrainMode::kLora, model::TrainMode::kFull),
                         [](const auto& info) {
                           return std::string(model::TrainModeName(info.param));
                         });

// The validation loss does not depend on how many ranks evaluate it: two Gloo ranks with
// 3 batches each measure what one process measures over 6 (isthmus-worker eval --batches 6),
// so a site's per-round curve and an evaluation by one process are one measure.
TEST(ValidationLoss, TwoRanksMeasureWhatOneProcessMeasuresOverTheirBatchesTogether) {
  auto dir = TempDir("valloss");
  {
    std::mt19937 gen(5);
    std::vector<uint16_t> t(40 * kT);
    for (auto& x : t) x = static_cast<uint16_t>(gen() % 256);
    std::ofstream out(dir / "val.bin", std::ios::binary);
    out.write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(t.size() * 2));
  }
  const std::string val = (dir / "val.bin").string();
  auto one = model::Gpt::CreateRandom(TinyConfig(), model::TrainMode::kLora, TinyLora(), 3);
  ASSERT_TRUE(one.ok());
  auto want = ValidationLoss(**one, val, 2, 0, 1, 6, nullptr);
  ASSERT_TRUE(want.ok()) << want.status().ToString();
  auto fewer = ValidationLoss(**one, val, 2, 0, 1, 3, nullptr);
  ASSERT_TRUE(fewer.ok());
  EXPECT_NE(*fewer, *want) << "the set is too uniform to tell batches apart";
  std::vector<Result<double>> got(2, Status::Internal("not run"));
  auto rank_main = [&](int rank) {
    comm::GlooOptions o = GlooRank(rank, 2, dir / "rdv", 20);
    auto comm = comm::CreateGlooCommunicator(o);
    if (!comm.ok()) {
      got[rank] = comm.status();
      return;
    }
    auto gpt = model::Gpt::CreateRandom(TinyConfig(), model::TrainMode::kLora, TinyLora(), 3);
    got[rank] = ValidationLoss(**gpt, val, 2, rank, 2, 3, comm->get());
  };
  std::filesystem::create_directories(dir / "rdv");
  std::thread r0(rank_main, 0), r1(rank_main, 1);
  r0.join();
  r1.join();
  std::filesystem::remove_all(dir);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(got[r].ok()) << got[r].status().ToString();
    EXPECT_NEAR(*got[r], *want, 1e-5 * std::fabs(*want)) << "rank " << r;
  }
}

TEST(TrainSettings, ValidateNamesTheProblem) {
  TrainSettings t;
  t.data_dir = "d";
  t.max_rounds = 2;
  t.shards.servers = {"tcp://127.0.0.1:1"};
  auto st = t.Validate();
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("--key"), std::string::npos) << st.message();
  t.shards.insecure_plaintext = true;
  EXPECT_TRUE(t.Validate().ok());
  t.world_size = 2;
  EXPECT_NE(t.Validate().message().find("--rendezvous"), std::string::npos);
  t.world_size = 1;
  t.bucket_mb = kMaxBucketMb + 1;
  EXPECT_NE(t.Validate().message().find("--bucket-mb must be in [0, 1024]"), std::string::npos)
      << t.Validate().message();
  t.bucket_mb = -1;
  EXPECT_FALSE(t.Validate().ok());
  t.bucket_mb = 0;
  EXPECT_TRUE(t.Validate().ok());
  t.reduce_precision = "fp16";
  EXPECT_NE(t.Validate().message().find("--reduce-precision must be fp32 or bf16"),
            std::string::npos);
  t.reduce_precision = "bf16";
  EXPECT_TRUE(t.Validate().ok());
  t.checkpoint_state_every = -1;
  EXPECT_NE(t.Validate().message().find("--checkpoint-state-every must be in [1, 1000000]"),
            std::string::npos)
      << t.Validate().message();
  t.checkpoint_state_every = 0;  // the default: 4 in full mode, overlapped and synced, else 1
  EXPECT_EQ(t.CheckpointStateEvery(), 1);
  t.model.mode = "full";
  EXPECT_EQ(t.CheckpointStateEvery(), 4);
  t.overlap = false;
  EXPECT_EQ(t.CheckpointStateEvery(), 1);
  EXPECT_TRUE(t.Validate().ok()) << t.Validate().message();
  t.checkpoint_state_every = 4;
  EXPECT_NE(t.Validate().message().find("is for synced runs with --overlap"), std::string::npos)
      << t.Validate().message();
  t.overlap = true;
  EXPECT_TRUE(t.Validate().ok()) << t.Validate().message();  // synced, --overlap (the default)
  t.model.mode = "lora";
  t.checkpoint_state_every = 0;
  t.max_rounds = 0;
  EXPECT_FALSE(t.Validate().ok());
}

TEST(TrainSettings, TomlConfigIsReadAndFlagsWin) {
  auto dir = TempDir("toml");
  auto path = dir / "w.toml";
  {
    std::ofstream out(path);
    out << "layers = 6\nwidth = 384\nserver = [\"tcp://a:1\", \"tcp://b:2\"]\nlr = 0.01\n";
  }
  CLI::App app;
  TrainSettings t;
  app.set_config("--config");
  AddTrainFlags(app, t);
  std::vector<std::string> args = {"prog", "--config", path.string(), "--width", "128"};
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  ASSERT_NO_THROW(app.parse(static_cast<int>(argv.size()), const_cast<char**>(argv.data())));
  EXPECT_EQ(t.model.layers, 6);
  EXPECT_EQ(t.model.width, 128);  // the flag overrides the file
  EXPECT_FLOAT_EQ(t.lr, 0.01f);
  EXPECT_EQ(t.shards.servers, (std::vector<std::string>{"tcp://a:1", "tcp://b:2"}));
  std::filesystem::remove_all(dir);
}

// The GPU a rank uses: --device cuda:N as given; else its local rank (--local-rank, or
// LOCAL_RANK as torchrun sets it), so nodes with unequal GPU counts work; else the site
// rank modulo the visible GPUs. A local rank beyond the node's GPUs is refused naming the
// rank and the setting.
TEST(ComputeSettings, LocalRankPicksTheGpuAndComesFromLocalRankToo) {
  using ops::DeviceChoice;
  const DeviceChoice cuda{DeviceChoice::Kind::kCuda, -1};
  EXPECT_EQ(ops::PickDevice(cuda, 11, -1, 8).value(), 3);  // rank % GPUs
  EXPECT_EQ(ops::PickDevice(cuda, 11, 1, 4).value(), 1);   // a node of 4 after one of 8+2
  EXPECT_EQ(ops::PickDevice({DeviceChoice::Kind::kCuda, 2}, 11, 1, 4).value(), 2);
  auto far = ops::PickDevice(cuda, 11, 4, 4);
  EXPECT_EQ(far.status().code(), Code::kInvalidArgument);
  EXPECT_NE(far.status().message().find("--local-rank 4 (rank 11): only 4 CUDA devices"),
            std::string::npos)
      << far.status().ToString();
  EXPECT_EQ(ops::PickDevice({DeviceChoice::Kind::kCuda, 9}, 0, -1, 8).status().code(),
            Code::kInvalidArgument);

  for (const char* env : {"", "5"}) {
    if (*env) {
      ::setenv("LOCAL_RANK", env, 1);
    } else {
      ::unsetenv("LOCAL_RANK");
    }
    CLI::App app;
    TrainSettings t;
    AddTrainFlags(app, t);
    std::vector<const char*> argv = {"prog", "--data", "d"};
    ASSERT_NO_THROW(app.parse(static_cast<int>(argv.size()), const_cast<char**>(argv.data())));
    EXPECT_EQ(t.compute.local_rank, *env ? 5 : -1);
    CLI::App flagged;
    TrainSettings f;
    AddTrainFlags(flagged, f);
    std::vector<const char*> with = {"prog", "--local-rank", "2"};
    ASSERT_NO_THROW(flagged.parse(static_cast<int>(with.size()), const_cast<char**>(with.data())));
    EXPECT_EQ(f.compute.local_rank, 2);  // the flag wins over the environment
  }
  ::unsetenv("LOCAL_RANK");
}

// A file's record of the LoRA settings: taken when the flag is not given, refused (naming
// both values) when it contradicts a given flag, and an assumption that says so when absent.
TEST(ModelSettings, ResolveTrainableTakesChecksOrSaysItAssumesTheLoraRecord) {
  std::vector<Tensor> lora = {{"h.0.attn.c_attn.lora_A.weight", {8, 32}, {}},
                              {"h.0.attn.c_attn.lora_B.weight", {96, 8}, {}},
                              {"h.0.mlp.c_fc.lora_A.weight", {8, 32}, {}},
                              {"h.0.mlp.c_fc.lora_B.weight", {128, 8}, {}}};
  ModelSettings m;
  std::string note;
  ASSERT_TRUE(m.ResolveTrainable(lora, {{"lora_alpha", "16"}}, "F", &note).ok());
  EXPECT_EQ(m.lora_rank, 8);
  EXPECT_EQ(m.lora_alpha, 16.0f);
  EXPECT_EQ(m.lora_targets, (std::vector<std::string>{"attn.c_attn", "mlp.c_fc"}));
  EXPECT_FALSE(m.lora_alpha_assumed);
  EXPECT_TRUE(note.empty());
  EXPECT_EQ(m.TrainableMetadata()["lora_alpha"], "16");
  EXPECT_EQ(m.TrainableMetadata()["lora_targets"], "attn.c_attn,mlp.c_fc");
  EXPECT_EQ(ModelSettings::LoraTargetsFromBits(m.LoraTargetBits()), m.lora_targets);

  ModelSettings given;
  given.lora_alpha = 32;
  given.given.insert("--lora-alpha");
  Status st = given.ResolveTrainable(lora, {{"lora_alpha", "16"}}, "F");
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("--lora-alpha 32 contradicts F, which say 16"), std::string::npos)
      << st.message();
  ModelSettings targets;
  targets.given.insert("--lora-targets");
  st = targets.ResolveTrainable(lora, {{"lora_alpha", "16"}}, "F");
  EXPECT_NE(st.message().find("--lora-targets"), std::string::npos) << st.message();
  ModelSettings bad;
  st = bad.ResolveTrainable(lora, {{"lora_alpha", "sixteen"}}, "F");
  EXPECT_NE(st.message().find("lora_alpha \"sixteen\""), std::string::npos) << st.message();

  ModelSettings old;
  ASSERT_TRUE(old.ResolveTrainable(lora, {}, "F", &note).ok());
  EXPECT_TRUE(old.lora_alpha_assumed);
  EXPECT_EQ(old.lora_alpha, 32.0f);
  EXPECT_NE(note.find("F carry no record of the LoRA alpha: assuming --lora-alpha 32"),
            std::string::npos)
      << note;
  // A given flag is no assumption.
  ModelSettings flagged;
  flagged.lora_alpha = 8;
  flagged.given.insert("--lora-alpha");
  note.clear();
  ASSERT_TRUE(flagged.ResolveTrainable(lora, {}, "F", &note).ok());
  EXPECT_FALSE(flagged.lora_alpha_assumed);
  EXPECT_TRUE(note.empty());
}

// The worker's stop path: a wait on a shard that does not answer ends once the site
// client's `interrupted` says so, long before the attempts give up by themselves (3 x 5 s
// to connect to a dead shard).
TEST(SiteClientInterrupted, EndsAWaitOnAShardThatDoesNotAnswer) {
  SiteOptions o;
  o.job = "j";
  o.servers = {"tcp://127.0.0.1:1"};  // nothing listens there
  o.insecure_plaintext = true;
  o.timeout_ms = 30000;
  const auto t0 = std::chrono::steady_clock::now();
  o.interrupted = [t0] {
    return std::chrono::steady_clock::now() - t0 > std::chrono::milliseconds(300);
  };
  auto site = SiteClient::Connect(o);
  ASSERT_TRUE(site.ok()) << site.status().ToString();
  auto h = (*site)->Hello("");
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("interrupted"), std::string::npos) << h.status().message();
  EXPECT_LT(took, 10.0);
  // What the worker makes of it while stopping: exit code 7.
  EXPECT_EQ(ExitCodeFor(Interrupted(h.status().message())), kExitInterrupted);
}

TEST(Progress, FormatsDurations) {
  EXPECT_EQ(Progress::FormatDuration(12.2), "12s");
  EXPECT_EQ(Progress::FormatDuration(245), "4m05s");
  EXPECT_EQ(Progress::FormatDuration(3720), "1h02m");
  EXPECT_EQ(Progress::FormatDuration(-1), "?");
}

TEST(Progress, PlainModeWritesEveryNthStep) {
  FILE* f = std::tmpfile();
  {
    ProgressOptions o;
    o.out = f;
    o.log_every = 2;
    o.total_steps = 4;
    Progress p(o);
    for (int s = 1; s <= 4; ++s) p.OnStep(s, 1, 3.0f, 100);
    p.Message("hello");
  }
  std::rewind(f);
  char buf[4096] = {0};
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  std::string text(buf, n);
  EXPECT_NE(text.find("step 2/4"), std::string::npos) << text;
  EXPECT_NE(text.find("step 4/4"), std::string::npos) << text;
  EXPECT_EQ(text.find("step 3/4"), std::string::npos) << text;
  EXPECT_EQ(text.find('\r'), std::string::npos) << "no carriage returns off a terminal";
  EXPECT_NE(text.find("hello\n"), std::string::npos);
}

TEST(ExitCodes, RefusalsMapToThree) {
  EXPECT_EQ(ExitCodeFor(Refused("base hash")), kExitRefused);
  // Everything else follows the shared table (common/exit_codes.h).
  EXPECT_EQ(ExitCodeFor(Status::PermissionDenied("key file too open")), kExitRefused);
  EXPECT_EQ(ExitCodeFor(Status::Timeout("x")), kExitUnreachable);
  EXPECT_EQ(ExitCodeFor(Status::Corruption("checkpoint")), kExitDamaged);
  EXPECT_EQ(ExitCodeFor(Status::Internal("bug")), kExitFailure);
  EXPECT_EQ(ExitCodeFor(UsageError("--layers 3")), kExitUsage);
  EXPECT_EQ(ExitCodeFor(Status::Ok()), kExitOk);
  // Another rank's outcome, shared as its exit code, maps back to that code.
  for (int code = kExitOk; code <= kExitOutOfMemory; ++code) {
    EXPECT_EQ(ExitCodeFor(StatusForExitCode(code, "rank 0 failed")), code) << code;
  }
  EXPECT_EQ(ExitCodeFor(Interrupted("shard 0 did not answer")), kExitInterrupted);
  EXPECT_TRUE(IsInterrupted(Interrupted("x")));
  EXPECT_FALSE(IsInterrupted(Status::Unavailable("x")));
}

}  // namespace
}  // namespace isthmus::worker
