// Training throughput of the worker's inner step on the CPU: Trainer::Step (forward,
// backward, clipping, AdamW) of the real model on random tokens, timed over --steps steps
// after --warmup untimed ones. Prints one JSON line with the same keys as torch_gpt.py so
// run.sh can put the two side by side.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "worker/model/trainer.h"

int main(int argc, char** argv) {
  using namespace isthmus;
  CLI::App app{"bench_train: tokens/s of the worker's training step (CPU)"};
  int layers = 4, width = 256, heads = 4, ctx = 256, batch = 8, rank = 16, steps = 10, warmup = 2;
  int threads = 0;
  float alpha = 32.0f;
  std::string mode_name = "lora";
  app.add_option("--layers", layers)->capture_default_str();
  app.add_option("--width", width)->capture_default_str();
  app.add_option("--heads", heads)->capture_default_str();
  app.add_option("--ctx", ctx, "sequence length T (and n_ctx)")->capture_default_str();
  app.add_option("--batch", batch, "sequences per step B")->capture_default_str();
  app.add_option("--rank", rank, "LoRA rank r")->capture_default_str();
  app.add_option("--alpha", alpha, "LoRA alpha")->capture_default_str();
  app.add_option("--steps", steps, "timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps first")->capture_default_str();
  app.add_option("--threads", threads, "OpenMP threads (0: OMP_NUM_THREADS or all)");
  app.add_option("--mode", mode_name)
      ->check(CLI::IsMember({"lora", "full"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (threads > 0) omp_set_num_threads(threads);

  model::GptConfig config;
  config.n_layer = layers;
  config.n_embd = width;
  config.n_head = heads;
  config.n_ctx = ctx;
  model::LoraConfig lora;
  lora.rank = rank;
  lora.alpha = alpha;
  auto mode = *model::ParseTrainMode(mode_name);
  auto gpt = model::Gpt::CreateRandom(config, mode, lora, 0);
  if (!gpt.ok()) {
    std::fprintf(stderr, "bench_train: %s\n", gpt.status().ToString().c_str());
    return 2;
  }
  model::TrainerConfig tc;
  tc.max_lr = 1e-3f;
  tc.warmup_steps = 0;
  tc.weight_decay = mode == model::TrainMode::kLora ? 0.0f : 0.1f;
  model::Trainer trainer(**gpt, tc);

  std::mt19937 gen(0);
  std::vector<int32_t> data(static_cast<size_t>(batch) * (ctx + 1));
  std::vector<int32_t> tokens(static_cast<size_t>(batch) * ctx), targets(tokens.size());
  auto step = [&] {
    for (auto& t : data) t = static_cast<int32_t>(gen() % 256);
    for (int b = 0; b < batch; ++b) {
      for (int t = 0; t < ctx; ++t) {
        tokens[b * ctx + t] = data[b * (ctx + 1) + t];
        targets[b * ctx + t] = data[b * (ctx + 1) + t + 1];
      }
    }
    return trainer.Step(tokens.data(), targets.data(), batch, ctx).loss;
  };
  for (int i = 0; i < warmup; ++i) step();
  auto t0 = std::chrono::steady_clock::now();
  float loss = 0;
  for (int i = 0; i < steps; ++i) loss = step();
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  int64_t trainable = 0;
  for (const auto& p : (*gpt)->Trainable()) trainable += p.numel;
  int64_t total = 0;
  for (const auto& t : (*gpt)->BaseTensors()) total += static_cast<int64_t>(t.data.size());
  if (mode == model::TrainMode::kLora) total += trainable;
  double tokens_done = static_cast<double>(steps) * batch * ctx;
  std::printf(
      "{\"tokens_per_s\": %.1f, \"ms_per_step\": %.2f, \"mode\": \"%s\", \"layers\": %d, "
      "\"width\": %d, \"heads\": %d, \"ctx\": %d, \"batch\": %d, \"rank\": %d, \"steps\": %d, "
      "\"warmup\": %d, \"threads\": %d, \"trainable_params\": %lld, \"total_params\": %lld, "
      "\"final_loss\": %.4f, \"device\": \"cpu\", \"impl\": \"isthmus\"}\n",
      tokens_done / elapsed, 1000 * elapsed / steps, mode_name.c_str(), layers, width, heads, ctx,
      batch, mode == model::TrainMode::kLora ? rank : 0, steps, warmup, omp_get_max_threads(),
      static_cast<long long>(trainable), static_cast<long long>(total), loss);
  return 0;
}
