// Forward+backward timings of the CPU kernels (ops/ops.h) at the sizes of the two model
// shapes we train: 4 layers x 256 wide and 6 x 384, context 256, batch 8 (N = 2048 rows,
// head size 64). Each benchmark reports the wall time of one forward+backward, the split
// into fwd_ms / bwd_ms, and FLOP/s where the kernel is matmul-bound.
//   OMP_WAIT_POLICY=PASSIVE ops_bench --benchmark_filter=Attention
// With Debian's pthread OpenBLAS, OpenMP's idle threads spin while sgemm's own threads
// work (and the reverse), which inflates the mixed kernels several-fold on few cores;
// PASSIVE stops the spinning. main() warns when it is not set.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "ops/ops.h"

namespace isthmus::ops {
namespace {

constexpr int kBatch = 8;
constexpr int kContext = 256;
constexpr int kRows = kBatch * kContext;
constexpr int kHeadSize = 64;
constexpr int kLoraRank = 8;
constexpr int kVocab = 50257;

std::vector<float> Random(size_t n, float stddev = 1.0f) {
  static std::mt19937 rng(42);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

using Clock = std::chrono::steady_clock;

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Runs fwd then bwd each iteration and records fwd_ms / bwd_ms averages and a FLOP rate.
template <typename Fwd, typename Bwd>
void TimeFwdBwd(benchmark::State& state, double flops_per_iter, Fwd fwd, Bwd bwd) {
  double fwd_ms = 0.0, bwd_ms = 0.0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    fwd();
    const auto t1 = Clock::now();
    bwd();
    const auto t2 = Clock::now();
    fwd_ms += Ms(t0, t1);
    bwd_ms += Ms(t1, t2);
    benchmark::ClobberMemory();
  }
  state.counters["fwd_ms"] = benchmark::Counter(fwd_ms, benchmark::Counter::kAvgIterations);
  state.counters["bwd_ms"] = benchmark::Counter(bwd_ms, benchmark::Counter::kAvgIterations);
  if (flops_per_iter > 0) {
    state.counters["FLOPS"] = benchmark::Counter(
        flops_per_iter, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
  }
}

// One sgemm, x[N,in] W[in,out]: args {in, out}.
void BM_Matmul(benchmark::State& state) {
  const int in = static_cast<int>(state.range(0)), out = static_cast<int>(state.range(1));
  auto a = Random(static_cast<size_t>(kRows) * in), b = Random(static_cast<size_t>(in) * out);
  std::vector<float> c(static_cast<size_t>(kRows) * out);
  for (auto _ : state) {
    CpuOps().Matmul(a.data(), b.data(), c.data(), kRows, out, in, false, false, 1.0f, 0.0f);
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] =
      benchmark::Counter(2.0 * kRows * in * out, benchmark::Counter::kIsIterationInvariantRate,
                         benchmark::Counter::kIs1000);
}

// A full linear layer: forward plus dx and dW (the three matmuls of training): args {in, out}.
void BM_LinearFwdBwd(benchmark::State& state) {
  const int in = static_cast<int>(state.range(0)), out = static_cast<int>(state.range(1));
  auto x = Random(static_cast<size_t>(kRows) * in), w = Random(static_cast<size_t>(in) * out);
  auto bias = Random(out), dout = Random(static_cast<size_t>(kRows) * out);
  std::vector<float> y(dout.size()), dx(x.size()), dw(w.size()), dbias(out);
  Ops& ops = CpuOps();
  TimeFwdBwd(
      state, 6.0 * kRows * in * out,
      [&] { ops.LinearForward(x.data(), w.data(), bias.data(), y.data(), kRows, in, out); },
      [&] {
        ops.LinearBackward(dout.data(), x.data(), w.data(), dx.data(), dw.data(), dbias.data(),
                           kRows, in, out);
      });
}

// LoRA on a frozen base (dw, dbias not needed), as the workers train: args {in, out}.
void BM_LoraLinearFwdBwd(benchmark::State& state) {
  const int in = static_cast<int>(state.range(0)), out = static_cast<int>(state.range(1));
  const int r = kLoraRank;
  auto x = Random(static_cast<size_t>(kRows) * in), w = Random(static_cast<size_t>(in) * out);
  auto bias = Random(out), a = Random(static_cast<size_t>(r) * in, 0.02f);
  auto b = Random(static_cast<size_t>(out) * r, 0.02f);
  auto dout = Random(static_cast<size_t>(kRows) * out);
  std::vector<float> y(dout.size()), xa(static_cast<size_t>(kRows) * r), dxa(xa.size());
  std::vector<float> dx(x.size()), da(a.size()), db(b.size());
  Ops& ops = CpuOps();
  // Base: 2 N in out forward + 2 N in out for dx; adapters: about 4 N r (in + out) each way.
  const double flops = 4.0 * kRows * in * out + 8.0 * kRows * r * (in + out);
  TimeFwdBwd(
      state, flops,
      [&] {
        ops.LoraLinearForward(x.data(), w.data(), bias.data(), a.data(), b.data(), 2.0f, y.data(),
                              xa.data(), kRows, in, out, r);
      },
      [&] {
        ops.LoraLinearBackward(dout.data(), x.data(), w.data(), a.data(), b.data(), 2.0f, xa.data(),
                               dx.data(), nullptr, nullptr, da.data(), db.data(), dxa.data(), kRows,
                               in, out, r);
      });
}

// args {C}.
void BM_LayerNormFwdBwd(benchmark::State& state) {
  const int C = static_cast<int>(state.range(0));
  auto x = Random(static_cast<size_t>(kRows) * C), w = Random(C), b = Random(C);
  auto dout = Random(x.size());
  std::vector<float> y(x.size()), mean(kRows), rstd(kRows), dx(x.size()), dw(C), db(C);
  Ops& ops = CpuOps();
  TimeFwdBwd(
      state, 0.0,
      [&] {
        ops.LayerNormForward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(),
                             kRows, C);
      },
      [&] {
        ops.LayerNormBackward(dout.data(), x.data(), w.data(), mean.data(), rstd.data(), dx.data(),
                              dw.data(), db.data(), kRows, C);
      });
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(x.size()) * 4 * 5);
}

// args {C}; H = C / 64.
void BM_AttentionFwdBwd(benchmark::State& state) {
  const int C = static_cast<int>(state.range(0)), H = C / kHeadSize;
  auto qkv = Random(static_cast<size_t>(kRows) * 3 * C),
       dout = Random(static_cast<size_t>(kRows) * C);
  std::vector<float> out(dout.size()), dqkv(qkv.size());
  std::vector<float> att(static_cast<size_t>(kBatch) * H * kContext * kContext), datt(att.size());
  Ops& ops = CpuOps();
  // Forward: QK^T and att V, 2 B T^2 C each; backward: four such products.
  const double flops = 12.0 * kBatch * kContext * static_cast<double>(kContext) * C;
  TimeFwdBwd(
      state, flops,
      [&] { ops.AttentionForward(qkv.data(), out.data(), att.data(), kBatch, kContext, C, H); },
      [&] {
        ops.AttentionBackward(dout.data(), qkv.data(), att.data(), dqkv.data(), datt.data(), kBatch,
                              kContext, C, H);
      });
}

// args {C}; the MLP's activation on [N, 4C].
void BM_GeluFwdBwd(benchmark::State& state) {
  const int64_t n = static_cast<int64_t>(kRows) * 4 * state.range(0);
  auto x = Random(n), dout = Random(n);
  std::vector<float> y(n), dx(n);
  Ops& ops = CpuOps();
  TimeFwdBwd(
      state, 0.0, [&] { ops.GeluForward(x.data(), y.data(), n); },
      [&] { ops.GeluBackward(dout.data(), x.data(), dx.data(), n); });
}

// The GPT-2 head for one sequence (256 rows, 50257 classes): logits matmul excluded.
void BM_CrossEntropyFwdBwd(benchmark::State& state) {
  const int N = static_cast<int>(state.range(0));
  auto logits = Random(static_cast<size_t>(N) * kVocab);
  std::vector<int32_t> targets(N);
  for (int i = 0; i < N; ++i) targets[i] = (i * 7919) % kVocab;
  std::vector<float> probs(logits.size()), losses(N), dlogits(logits.size());
  Ops& ops = CpuOps();
  TimeFwdBwd(
      state, 0.0,
      [&] {
        benchmark::DoNotOptimize(ops.CrossEntropyForward(logits.data(), targets.data(),
                                                         probs.data(), losses.data(), N, kVocab));
      },
      [&] { ops.CrossEntropyBackward(probs.data(), targets.data(), dlogits.data(), N, kVocab); });
}

void AdamW(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto p = Random(n), g = Random(n);
  std::vector<float> m(n), v(n);
  int64_t step = 0;
  for (auto _ : state) {
    CpuOps().AdamWStep(p.data(), g.data(), m.data(), v.data(), n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f,
                       ++step);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * n * 4 * 7);
}

// The two model widths: 256 (4 heads) and 384 (6 heads).
void LinearShapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"in", "out"});
  for (int c : {256, 384}) {
    b->Args({c, 3 * c});  // qkv
    b->Args({c, c});      // attention projection
    b->Args({c, 4 * c});  // MLP up
    b->Args({4 * c, c});  // MLP down
  }
}

BENCHMARK(BM_Matmul)->Apply(LinearShapes)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Matmul)
    ->Name("BM_Matmul/lm_head")
    ->Args({256, kVocab})
    ->Args({384, kVocab})
    ->ArgNames({"in", "out"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LinearFwdBwd)->Apply(LinearShapes)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LoraLinearFwdBwd)->Apply(LinearShapes)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LayerNormFwdBwd)
    ->ArgName("C")
    ->Arg(256)
    ->Arg(384)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AttentionFwdBwd)
    ->ArgName("C")
    ->Arg(256)
    ->Arg(384)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_GeluFwdBwd)
    ->ArgName("C")
    ->Arg(256)
    ->Arg(384)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CrossEntropyFwdBwd)
    ->ArgName("N")
    ->Arg(kContext)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(AdamW)
    ->Name("BM_AdamW")
    ->ArgName("n")
    ->Arg(1 << 20)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace isthmus::ops

int main(int argc, char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) {
    std::fprintf(stderr,
                 "note: OMP_WAIT_POLICY is not set; OpenMP and OpenBLAS threads may spin "
                 "against each other (set OMP_WAIT_POLICY=PASSIVE for steadier figures)\n");
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
