// Throughput of one training step of the default-size model (4 layers x 256 wide, context
// 256, batch 8, LoRA rank 16 on all four targets, and the same in full mode). It prints
// tokens/s; it asserts only that steps run and the loss is finite, so it is labelled long.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "worker/model/gpt.h"
#include "worker/model/trainer.h"

namespace isthmus::model {
namespace {

void Measure(TrainMode mode) {
  GptConfig c;  // defaults: 4 layers, C 256, H 4, n_ctx 256, V 256
  auto made = Gpt::CreateRandom(c, mode, LoraConfig{}, 1);
  ASSERT_TRUE(made.ok());
  Gpt& gpt = **made;
  auto made_trainer = Trainer::Create(gpt, TrainerConfig{});
  ASSERT_TRUE(made_trainer.ok());
  Trainer& trainer = **made_trainer;
  const int B = 8, T = 256;
  std::mt19937 rng(1);
  std::uniform_int_distribution<int32_t> d(0, 255);
  std::vector<int32_t> tokens(B * T), targets(B * T);
  for (auto& x : tokens) x = d(rng);
  for (auto& x : targets) x = d(rng);
  ASSERT_TRUE(trainer.Step(tokens.data(), targets.data(), B, T).ok());  // warm-up
  const int steps = 5;
  const auto t0 = std::chrono::steady_clock::now();
  float loss = 0;
  for (int i = 0; i < steps; ++i) loss = trainer.Step(tokens.data(), targets.data(), B, T)->loss;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(std::isfinite(loss));
  std::printf("[speed %s] 4x256, T=256, B=8: %.1f ms/step, %.0f tokens/s (loss %.3f)\n",
              TrainModeName(mode), 1e3 * s / steps, B * T * steps / s, loss);
}

TEST(GptSpeed, LoraStep) { Measure(TrainMode::kLora); }
TEST(GptSpeed, FullStep) { Measure(TrainMode::kFull); }

}  // namespace
}  // namespace isthmus::model
