// The in-site gradient all-reduce, measured on the worker's real training step: R ranks of
// one site (threads of this process, each with its own model, Gloo over loopback on the
// CPU; or, with --device cuda, one rank alone) train the same configuration, first with one
// all-reduce after the backward (--bucket-mb 0, the baseline) and then with the all-reduce
// in buckets during the backward, in the same run. For each rank count and setting it
// prints the median step time, the all-reduce's own time per step and the part of it the
// step waited for ("exposed"), hence the share of the all-reduce hidden behind the
// backward, and the step-time ratio against the baseline of the same rank count.
//
//   bench_ranks --ranks 1,2 --buckets 0,25,4 --layers 12 --width 768 --heads 12 --ctx 128
//
// With --shard-optimizer each setting also runs with the AdamW moments split across the
// ranks (ZeRO-1: each rank updates its part and the ranks all-gather the parameters after
// the step), printing the moments each rank holds and the step-time ratio.
//
// Each rank gets --threads OpenMP threads (default 1); on a machine with fewer cores than
// ranks x (threads + 1) the ranks and their reducing threads share cores, which is part of
// what the figures show.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "ops/device.h"
#include "worker/comm/bucketed_all_reduce.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/model/trainer.h"

namespace {

using namespace isthmus;
using Clock = std::chrono::steady_clock;

struct Options {
  model::GptConfig config;
  model::TrainMode mode = model::TrainMode::kFull;
  int batch = 2, steps = 5, warmup = 2, threads = 1;
  std::string device = "cpu";
  bool bf16 = false;  // the all-reduce's values in bf16 (--reduce-precision bf16)
};

// Per rank and timed step: the step's wall time, the all-reduce's time, the part exposed,
// and the bytes of AdamW moments the rank holds.
struct Sample {
  double step = 0, reduce = 0, exposed = 0;
  double moment_bytes = 0;
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Runs `ranks` ranks for o.warmup + o.steps steps with --bucket-mb `bucket_mb`, the moments
// sharded across the ranks or not; returns the timed samples of every rank, or the first
// error.
Result<std::vector<Sample>> Run(const Options& o, int ranks, int bucket_mb, bool shard,
                                int run_id) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      ("isthmus-bench-ranks-" + std::to_string(::getpid()) + "-" + std::to_string(run_id));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::vector<Sample> samples;
  std::mutex mu;
  Status first = Status::Ok();
  auto rank_main = [&](int rank) {
    auto failed = [&](const Status& st) {
      std::lock_guard<std::mutex> lock(mu);
      if (first.ok()) first = st;
    };
    omp_set_num_threads(o.threads);
    auto choice = ops::ParseDevice(o.device);
    if (!choice.ok()) return failed(choice.status());
    auto resolved = ops::ResolveDevice(*choice, rank);
    if (!resolved.ok()) return failed(resolved.status());
    auto backend = ops::OpenBackend(*resolved);
    if (!backend.ok()) return failed(backend.status());
    std::unique_ptr<comm::Communicator> comm;
    if (ranks > 1) {
      comm::GlooOptions g;
      g.rank = rank;
      g.world_size = ranks;
      g.rendezvous = "file:" + dir.string();
      g.timeout = std::chrono::seconds(120);
      auto c = comm::CreateGlooCommunicator(g);
      if (!c.ok()) return failed(c.status());
      comm = std::move(c).value();
    }
    model::LoraConfig lora;
    lora.rank = 16;
    lora.alpha = 32;
    const model::Compute compute{backend->get(), ops::Dtype::kF32};
    auto gpt = model::Gpt::CreateRandom(o.config, o.mode, lora, 0, compute);
    if (!gpt.ok()) return failed(gpt.status());
    model::TrainerConfig tc;
    tc.max_lr = 1e-4f;
    tc.warmup_steps = 0;
    auto trainer = model::Trainer::Create(**gpt, tc);
    if (!trainer.ok()) return failed(trainer.status());
    if (comm && shard) {
      model::OptimizerShards shards;
      shards.rank = rank;
      shards.world_size = ranks;
      shards.all_gather = [c = comm.get()](float* data, const std::vector<size_t>& counts) {
        return c->AllGather(data, counts);
      };
      if (Status st = (*trainer)->ShardOptimizerState(shards); !st.ok()) return failed(st);
    }
    const double moment_bytes =
        2.0 * sizeof(float) *
        static_cast<double>((*trainer)->shard_end() - (*trainer)->shard_begin());
    double hook_seconds = 0;
    std::unique_ptr<comm::BucketedAllReduce> buckets;
    if (comm && bucket_mb > 0) {
      buckets = std::make_unique<comm::BucketedAllReduce>(*comm, size_t(bucket_mb) << 20, o.bf16);
      (*trainer)->SetGradientSink(buckets.get());
    } else if (comm) {
      (*trainer)->SetGradHook([&](float* g, size_t n) {
        const auto t0 = Clock::now();
        Status st = comm::ReduceGradient(*comm, g, 0, n, n, o.bf16);
        hook_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
        return st;
      });
    }
    std::mt19937 gen(1 + rank);
    const int T = o.config.n_ctx;
    std::vector<int32_t> tok(static_cast<size_t>(o.batch) * T), tgt(tok.size());
    std::vector<Sample> mine;
    for (int s = 0; s < o.warmup + o.steps; ++s) {
      for (size_t i = 0; i < tok.size(); ++i) {
        tok[i] = static_cast<int32_t>(gen() % 256);
        tgt[i] = static_cast<int32_t>(gen() % 256);
      }
      const auto t0 = Clock::now();
      auto st = (*trainer)->Step(tok.data(), tgt.data(), o.batch, T);
      const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
      if (!st.ok()) return failed(st.status());
      if (s < o.warmup) continue;
      Sample x;
      x.step = wall;
      x.moment_bytes = moment_bytes;
      if (buckets) {
        x.reduce = buckets->last().reduce_seconds;
        x.exposed = buckets->last().exposed_seconds;
      } else {
        x.reduce = x.exposed = hook_seconds;
      }
      mine.push_back(x);
    }
    std::lock_guard<std::mutex> lock(mu);
    samples.insert(samples.end(), mine.begin(), mine.end());
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) threads.emplace_back(rank_main, r);
  for (auto& t : threads) t.join();
  std::filesystem::remove_all(dir);
  if (!first.ok()) return first;
  return samples;
}

std::vector<int> ParseList(const std::string& text) {
  std::vector<int> out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = text.find(',', at);
    const std::string item =
        text.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    if (!item.empty()) out.push_back(std::stoi(item));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "bench_ranks: the in-site gradient all-reduce, after the backward and in "
      "buckets during it, for several rank counts"};
  Options o;
  int layers = 12, width = 768, heads = 12, ctx = 128;
  std::string ranks_text = "1,2", buckets_text = "0,25", mode = "full";
  app.add_option("--ranks", ranks_text, "rank counts, comma-separated")->capture_default_str();
  app.add_option("--buckets", buckets_text,
                 "--bucket-mb values, comma-separated; the first is the baseline (0: one "
                 "all-reduce after the backward)")
      ->capture_default_str();
  app.add_option("--layers", layers)->capture_default_str();
  app.add_option("--width", width)->capture_default_str();
  app.add_option("--heads", heads)->capture_default_str();
  app.add_option("--ctx", ctx, "sequence length T")->capture_default_str();
  app.add_option("--batch", o.batch, "sequences per rank and step")->capture_default_str();
  app.add_option("--steps", o.steps, "timed steps")->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed steps first")->capture_default_str();
  app.add_option("--threads", o.threads, "OpenMP threads per rank")->capture_default_str();
  app.add_option("--mode", mode)->check(CLI::IsMember({"full", "lora"}))->capture_default_str();
  std::string reduce = "fp32";
  app.add_option("--reduce-precision", reduce, "the all-reduce's values on the wire")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  app.add_option("--device", o.device, "cpu (Gloo ranks); cuda or cuda:N: --ranks 1 only")
      ->capture_default_str();
  bool shard = false;
  app.add_flag("--shard-optimizer", shard,
               "run every setting of more than one rank a second time with the AdamW moments "
               "split across the ranks (ZeRO-1)");
  CLI11_PARSE(app, argc, argv);
  o.config.n_layer = layers;
  o.config.n_embd = width;
  o.config.n_head = heads;
  o.config.n_ctx = ctx;
  o.mode = *model::ParseTrainMode(mode);
  o.bf16 = reduce == "bf16";
  if (Status st = o.config.Validate(); !st.ok()) {
    std::fprintf(stderr, "bench_ranks: %s\n", st.ToString().c_str());
    return 2;
  }
  const std::vector<int> rank_counts = ParseList(ranks_text), settings = ParseList(buckets_text);
  if (rank_counts.empty() || settings.empty()) {
    std::fprintf(stderr, "bench_ranks: --ranks and --buckets need at least one value\n");
    return 2;
  }
  // The ranks here meet over Gloo, which reduces host memory; and the exposed time is the
  // host's wait, which on a GPU also covers the backward's kernels still queued.
  if (o.device != "cpu" && *std::max_element(rank_counts.begin(), rank_counts.end()) > 1) {
    std::fprintf(stderr,
                 "bench_ranks: --device %s runs one rank only (the ranks here use Gloo, which "
                 "reduces host memory); several GPU ranks need worker processes with NCCL\n",
                 o.device.c_str());
    return 2;
  }
  std::printf(
      "| ranks | --bucket-mb | moments | step, median | all-reduce per step | exposed | hidden | "
      "step vs --bucket-mb %d |\n|---:|---:|---|---:|---:|---:|---:|---:|\n",
      settings.front());
  int run_id = 0;
  for (int ranks : rank_counts) {
    double baseline = 0;
    for (int mb : settings) {
      for (bool sharded : {false, true}) {
        if (sharded && (!shard || ranks == 1)) continue;
        auto samples = Run(o, ranks, mb, sharded, run_id++);
        if (!samples.ok()) {
          std::fprintf(stderr, "bench_ranks: %d ranks, --bucket-mb %d%s: %s\n", ranks, mb,
                       sharded ? ", sharded moments" : "", samples.status().ToString().c_str());
          return 1;
        }
        std::vector<double> step, reduce, exposed;
        for (const Sample& s : *samples) {
          step.push_back(s.step);
          reduce.push_back(s.reduce);
          exposed.push_back(s.exposed);
        }
        const double st = Median(step), re = Median(reduce), ex = Median(exposed);
        if (mb == settings.front() && !sharded) baseline = st;
        const double hidden = re > 0 ? std::max(0.0, 1.0 - ex / re) : 0.0;
        const double moments_mib = samples->empty() ? 0 : samples->front().moment_bytes / (1 << 20);
        std::printf("| %d | %d | %.1f MiB%s | %.3f s | %.3f s | %.3f s | %.0f%% | %.3fx |\n", ranks,
                    mb, moments_mib, sharded ? " (sharded)" : "", st, re, ex, 100 * hidden,
                    baseline > 0 ? st / baseline : 1.0);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
