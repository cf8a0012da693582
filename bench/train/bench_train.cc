// Training throughput of the worker's inner step: Trainer::Step (forward, backward,
// clipping, AdamW) of the real model on random tokens, on the CPU or a GPU, timed over
// --steps steps after --warmup untimed ones. Prints one JSON line with the same keys as
// torch_gpt.py so run.sh can put the two side by side, including model FLOP utilisation
// (FLOPs per token by the formula below, over --peak-tflops) and peak device memory (the
// most the backend ever held allocated, as torch reports its allocator's peak). Either
// family: GPT-2 (the default) or a Llama-shaped model (--family llama, with --kv-heads,
// --inner and an untied head unless --tied), LoRA then on every linear of the block.
//
// --checkpoint-images N: after the steps, the worker's per-round checkpoint image (the
// trainable tensors and the optimizer state) is copied out of the backend N times into
// fresh memory and N times into the last image's buffers (as the round loop does), in turn;
// with --checkpoint-dir it is then written N times through the page cache and N times past
// it (O_DIRECT), in turn, with the worker's own writer (WriteSafetensors: temporary file,
// fsync, rename). A second JSON line gives each way's times and the ratios in the same run.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "ops/device.h"
#include "worker/model/trainer.h"

namespace {

// One linear of a block: its LoRA target name and its fan-in and fan-out.
struct BlockLinear {
  const char* target;
  double in, out;
};

// The block's linears of `config`'s family, in LoraTargetNames order.
std::vector<BlockLinear> BlockLinears(const isthmus::model::GptConfig& config) {
  const double C = config.n_embd, I = config.inner();
  if (config.family == isthmus::model::ModelFamily::kGpt2) {
    return {
        {"attn.c_attn", C, 3 * C}, {"attn.c_proj", C, C}, {"mlp.c_fc", C, I}, {"mlp.c_proj", I, C}};
  }
  const double kv = static_cast<double>(config.kv_heads()) * config.head_size();
  return {{"self_attn.q_proj", C, C}, {"self_attn.k_proj", C, kv}, {"self_attn.v_proj", C, kv},
          {"self_attn.o_proj", C, C}, {"mlp.gate_proj", C, I},     {"mlp.up_proj", C, I},
          {"mlp.down_proj", I, C}};
}

// Model FLOPs per trained token, the same definition as torch_gpt.py's: P = L * (the
// block's linear weights: 12*C^2 for GPT-2) + V*C (the head, tied or not); attention
// forward per token = 2*L*C*T (QK^T and PV over the causal half of T, C = H*D whatever the
// number of kv heads); forward F = 2*P + 2*L*C*T. Full mode trains everything: 3*F. LoRA:
// the frozen base needs forward and input-gradient matmuls but no weight gradients, so
// 2*(2*P) + 3*(2*L*C*T) + 6*A, with A the LoRA parameters per token (r*(in+out) summed over
// the adapted linears). Norms, biases, activations, rotary, softmax and the optimizer are
// not counted.
double FlopsPerToken(const isthmus::model::GptConfig& config, int T, bool lora, int rank,
                     const std::vector<std::string>& targets) {
  const double L = config.n_layer, C = config.n_embd, V = config.vocab_size;
  double block = 0, adapted = 0;
  for (const BlockLinear& m : BlockLinears(config)) {
    block += m.in * m.out;
    for (const std::string& t : targets) {
      if (t == m.target) adapted += m.in + m.out;
    }
  }
  const double P = L * block + V * C;
  const double attn = 2.0 * L * C * T;
  if (!lora) return 3.0 * (2.0 * P + attn);
  const double A = L * rank * adapted;
  return 4.0 * P + 3.0 * attn + 6.0 * A;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::string JsonList(const std::vector<double>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%s%.4f", i ? ", " : "", v[i]);
    s += buf;
  }
  return s + "]";
}

// Seconds of CPU all cores spent busy since boot (/proc/stat: everything but idle and
// iowait), so that the kernel's writeback threads count too; 0 where unreadable.
double BusyCpuSeconds() {
  std::FILE* f = std::fopen("/proc/stat", "r");
  if (f == nullptr) return 0;
  unsigned long long v[10] = {};
  const int got = std::fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0],
                              &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7], &v[8], &v[9]);
  std::fclose(f);
  if (got < 8) return 0;
  const unsigned long long busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7];
  return static_cast<double>(busy) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Copies the trainer's checkpoint image out `times` times each way (fresh, refilled), in
// turn, then, with a `dir`, writes it `times` times each way (buffered, direct) in turn
// there; prints one JSON line.
isthmus::Status TimeCheckpointImage(isthmus::model::Gpt& gpt, isthmus::model::Trainer& trainer,
                                    int times, const std::string& dir) {
  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  std::vector<isthmus::Tensor> image;
  auto export_into = [&](std::vector<isthmus::Tensor>* into) -> isthmus::Status {
    ISTHMUS_ASSIGN_OR_RETURN(size_t n, trainer.ExportState(into, gpt.ExportTrainable(into, 0)));
    into->resize(n);
    return gpt.ops().status();
  };
  std::vector<double> fresh, refilled;
  for (int i = 0; i < times; ++i) {
    for (const bool reuse : {false, true}) {
      if (!reuse) image = {};  // frees the last image: the next copy faults in new pages
      auto t0 = Clock::now();
      ISTHMUS_RETURN_IF_ERROR(export_into(&image));
      (reuse ? refilled : fresh).push_back(seconds_since(t0));
    }
  }
  uint64_t bytes = 0;
  for (const auto& t : image) bytes += t.data.size() * 4;
  std::vector<double> buffered, direct, buffered_cpu, direct_cpu;
  if (!dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    const std::string path = dir + "/bench-checkpoint.safetensors";
    const std::map<std::string, std::string> meta = {{"format", "isthmus-checkpoint"}};
    for (int i = 0; i < times; ++i) {
      for (const bool d : {false, true}) {
        const double c0 = BusyCpuSeconds();
        auto t0 = Clock::now();
        ISTHMUS_RETURN_IF_ERROR(
            isthmus::WriteSafetensors(path, image, meta, isthmus::FileDtype::kF32, d));
        (d ? direct : buffered).push_back(seconds_since(t0));
        (d ? direct_cpu : buffered_cpu).push_back(BusyCpuSeconds() - c0);
      }
    }
    std::filesystem::remove(path, ec);
  }
  const double f = Median(fresh), r = Median(refilled);
  std::printf(
      "{\"checkpoint_bytes\": %llu, \"times\": %d, \"export_fresh_s\": %s, "
      "\"export_refilled_s\": %s, \"export_fresh_median_s\": %.3f, "
      "\"export_refilled_median_s\": %.3f, \"refill_speedup\": %.2f",
      static_cast<unsigned long long>(bytes), times, JsonList(fresh).c_str(),
      JsonList(refilled).c_str(), f, r, f / r);
  if (!dir.empty()) {
    const double b = Median(buffered), d = Median(direct);
    std::printf(
        ", \"buffered_s\": %s, \"direct_s\": %s, \"buffered_median_s\": %.3f, "
        "\"direct_median_s\": %.3f, \"buffered_mb_per_s\": %.1f, \"direct_mb_per_s\": %.1f, "
        "\"direct_speedup\": %.2f, \"buffered_busy_cpu_s\": %s, \"direct_busy_cpu_s\": %s",
        JsonList(buffered).c_str(), JsonList(direct).c_str(), b, d, bytes / b / 1e6,
        bytes / d / 1e6, b / d, JsonList(buffered_cpu).c_str(), JsonList(direct_cpu).c_str());
  }
  std::printf("}\n");
  return isthmus::Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace isthmus;
  CLI::App app{"bench_train: tokens/s of the worker's training step (CPU or GPU)"};
  int layers = 4, width = 256, heads = 4, ctx = 256, batch = 8, rank = 16, steps = 10, warmup = 2;
  int threads = 0, kv_heads = 0, inner = 0;
  bool tied = false;
  float alpha = 32.0f;
  double peak_tflops = 989.0;
  std::string family_name = "gpt2", mode_name = "lora", device = "cpu", precision = "fp32";
  bool graphs = true;
  app.add_option("--family", family_name, "gpt2, or llama (RMS norm, rotary, SwiGLU, GQA)")
      ->check(CLI::IsMember({"gpt2", "llama"}))
      ->capture_default_str();
  app.add_option("--kv-heads", kv_heads, "llama: key/value heads (0: --heads)");
  app.add_option("--inner", inner, "llama: the MLP's hidden width (0: 4 * --width)");
  app.add_flag("--tied", tied, "llama: the head is the token embedding (default: untied)");
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
  app.add_option("--device", device, "cpu, cuda or cuda:N")->capture_default_str();
  app.add_option("--precision", precision)
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  app.add_option("--peak-tflops", peak_tflops,
                 "the device's dense bf16 peak for MFU (989: H100 SXM)")
      ->capture_default_str();
  app.add_flag("!--no-cuda-graphs", graphs, "launch kernels one by one");
  int checkpoint_images = 0;
  std::string checkpoint_dir;
  app.add_option("--checkpoint-images", checkpoint_images,
                 "after the steps, copy the checkpoint image out of the backend this many "
                 "times into fresh memory and as many into the last image's buffers, in turn, "
                 "and print the times")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--checkpoint-dir", checkpoint_dir,
                 "with --checkpoint-images: also write the image there (on the disk to "
                 "measure) as many times buffered and as many direct (O_DIRECT), in turn");
  CLI11_PARSE(app, argc, argv);
  if (!checkpoint_dir.empty() && checkpoint_images == 0) {
    std::fprintf(stderr, "bench_train: --checkpoint-dir needs --checkpoint-images N\n");
    return 2;
  }
  const bool llama = family_name == "llama";
  if (!llama && (kv_heads != 0 || inner != 0 || tied)) {
    std::fprintf(stderr, "bench_train: --kv-heads, --inner and --tied are for --family llama\n");
    return 2;
  }
  if (threads > 0) omp_set_num_threads(threads);

  auto fail = [](const Status& st) {
    std::fprintf(stderr, "bench_train: %s\n", st.ToString().c_str());
    return 1;
  };
  auto choice = ops::ParseDevice(device);
  if (!choice.ok()) return fail(choice.status());
  auto resolved = ops::ResolveDevice(*choice, 0);
  if (!resolved.ok()) return fail(resolved.status());
  auto backend = ops::OpenBackend(*resolved);
  if (!backend.ok()) return fail(backend.status());
  ops::Ops& ops = **backend;

  model::GptConfig config;
  config.n_layer = layers;
  config.n_embd = width;
  config.n_head = heads;
  config.n_ctx = ctx;
  if (llama) {
    config.family = model::ModelFamily::kLlama;
    config.n_kv_head = kv_heads;
    config.n_inner = inner;
    config.tied_embeddings = tied;
  }
  if (Status st = config.Validate(); !st.ok()) return fail(st);
  model::LoraConfig lora;
  lora.rank = rank;
  lora.alpha = alpha;
  lora.targets = model::LoraTargetNames(config.family);  // every linear of the block
  auto mode = *model::ParseTrainMode(mode_name);
  const model::Compute compute{&ops, *model::ParsePrecision(precision)};
  auto gpt = model::Gpt::CreateRandom(config, mode, lora, 0, compute);
  if (!gpt.ok()) return fail(gpt.status());
  model::TrainerConfig tc;
  tc.max_lr = 1e-3f;
  tc.warmup_steps = 0;
  tc.weight_decay = mode == model::TrainMode::kLora ? 0.0f : 0.1f;
  tc.graphs = graphs;
  auto trainer = model::Trainer::Create(**gpt, tc);
  if (!trainer.ok()) return fail(trainer.status());

  // Every batch is made before timing, so the host's random generator is not measured.
  std::mt19937 gen(0);
  const size_t per_batch = static_cast<size_t>(batch) * ctx;
  std::vector<std::vector<int32_t>> tokens(warmup + steps), targets(warmup + steps);
  for (int s = 0; s < warmup + steps; ++s) {
    std::vector<int32_t> data(static_cast<size_t>(batch) * (ctx + 1));
    for (auto& t : data) t = static_cast<int32_t>(gen() % 256);
    tokens[s].resize(per_batch);
    targets[s].resize(per_batch);
    for (int b = 0; b < batch; ++b) {
      for (int t = 0; t < ctx; ++t) {
        tokens[s][b * ctx + t] = data[b * (ctx + 1) + t];
        targets[s][b * ctx + t] = data[b * (ctx + 1) + t + 1];
      }
    }
  }
  float loss = 0;
  auto step = [&](int s) -> Status {
    auto st = (*trainer)->Step(tokens[s].data(), targets[s].data(), batch, ctx);
    if (!st.ok()) return st.status();
    loss = st->loss;
    return Status::Ok();
  };
  for (int i = 0; i < warmup; ++i) {
    if (Status st = step(i); !st.ok()) return fail(st);
  }
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    if (Status st = step(warmup + i); !st.ok()) return fail(st);
  }
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  int64_t trainable = 0;
  for (const auto& p : (*gpt)->Trainable()) trainable += p.numel;
  int64_t total = (*gpt)->BaseElements();
  if (mode == model::TrainMode::kLora) total += trainable;
  const double tokens_done = static_cast<double>(steps) * batch * ctx;
  const double tokens_per_s = tokens_done / elapsed;
  const double flops =
      FlopsPerToken(config, ctx, mode == model::TrainMode::kLora, rank, lora.targets);
  const ops::MemoryInfo mem = ops.Memory();
  std::printf(
      "{\"tokens_per_s\": %.1f, \"ms_per_step\": %.2f, \"mode\": \"%s\", \"family\": \"%s\", "
      "\"layers\": %d, \"width\": %d, \"heads\": %d, \"kv_heads\": %d, \"inner\": %d, "
      "\"tied\": %s, \"ctx\": %d, \"batch\": %d, \"rank\": %d, \"steps\": %d, "
      "\"warmup\": %d, \"threads\": %d, \"trainable_params\": %lld, \"total_params\": %lld, "
      "\"final_loss\": %.4f, \"device\": \"%s\", \"precision\": \"%s\", \"cuda_graphs\": %s, "
      "\"peak_mem_bytes\": %s, \"flops_per_token\": %.0f, \"mfu\": %.4g, \"peak_tflops\": %.1f, "
      "\"gpu\": %s, \"impl\": \"isthmus\"}\n",
      tokens_per_s, 1000 * elapsed / steps, mode_name.c_str(),
      model::ModelFamilyName(config.family), layers, width, heads, config.kv_heads(),
      config.inner(), config.tied_embeddings ? "true" : "false", ctx, batch,
      mode == model::TrainMode::kLora ? rank : 0, steps, warmup, omp_get_max_threads(),
      static_cast<long long>(trainable), static_cast<long long>(total), loss, ops.Name(),
      precision.c_str(), (*trainer)->used_graph() ? "true" : "false",
      ops.HostMemory() ? "null" : std::to_string(mem.peak_allocated).c_str(), flops,
      flops * tokens_per_s / (peak_tflops * 1e12), peak_tflops,
      ops.HostMemory() ? "null" : ("\"" + ops.Describe() + "\"").c_str());
  if (checkpoint_images > 0) {
    std::fflush(stdout);
    if (Status st = TimeCheckpointImage(**gpt, **trainer, checkpoint_images, checkpoint_dir);
        !st.ok()) {
      return fail(st);
    }
  }
  return 0;
}
