// Forward+backward timings of the kernels of ops/ops.h at the sizes of the model shapes we
// train: 4 layers x 256 wide and 6 x 384 (context 256, batch 8: N = 2048 rows, head size
// 64), on the CPU reference or, with --device=cuda, on a GPU (each iteration ends with a
// synchronize, so GPU figures are wall times of the kernels including launch). Each
// benchmark reports the wall time of one forward+backward, the split into fwd_ms /
// bwd_ms, and FLOP/s where the kernel is matmul-bound. --precision=bf16 runs the
// activation-typed kernels in bf16.
//   OMP_WAIT_POLICY=PASSIVE ops_bench --benchmark_filter=Attention
//   ops_bench --device=cuda --precision=bf16
// With Debian's pthread OpenBLAS, OpenMP's idle threads spin while sgemm's own threads
// work (and the reverse), which inflates the mixed kernels several-fold on few cores;
// PASSIVE stops the spinning. main() warns when it is not set.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ops/buffer.h"
#include "ops/device.h"
#include "ops/ops.h"

namespace isthmus::ops {
namespace {

constexpr int kBatch = 8;
constexpr int kContext = 256;
constexpr int kRows = kBatch * kContext;
constexpr int kHeadSize = 64;
constexpr int kLoraRank = 8;
constexpr int kVocab = 50257;

// The backend and activation dtype under test (main() sets them from the flags).
std::shared_ptr<Ops> g_ops;
Dtype g_dtype = Dtype::kF32;

Ops& ops() { return *g_ops; }

// n random values (or zeros) in backend memory as `d`; buffers live until the process ends.
Ref Random(size_t n, float stddev = 1.0f, Dtype d = Dtype::kF32) {
  static std::mt19937 rng(42);
  static std::vector<Buffer> keep;
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = stddev > 0 ? dist(rng) : 0.0f;
  auto b = Buffer::Allocate(ops(), n * DtypeSize(d));
  if (!b.ok()) {
    std::fprintf(stderr, "ops_bench: %s\n", b.status().ToString().c_str());
    std::exit(1);
  }
  keep.push_back(std::move(b).value());
  Ref r{keep.back().data(), d};
  if (d == Dtype::kF32) {
    ops().Upload(r.data, v.data(), n * sizeof(float));
  } else {
    std::vector<Bf16> h(n);
    for (size_t i = 0; i < n; ++i) h[i] = ToBf16(v[i]);
    ops().Upload(r.data, h.data(), n * sizeof(Bf16));
  }
  return r;
}
Ref Zeros(size_t n, Dtype d = Dtype::kF32) { return Random(n, 0.0f, d); }
Ref Act(size_t n, float stddev = 1.0f) { return Random(n, stddev, g_dtype); }
float* F(Ref r) { return static_cast<float*>(r.data); }

using Clock = std::chrono::steady_clock;

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

void Sync() {
  if (Status st = ops().Synchronize(); !st.ok()) {
    std::fprintf(stderr, "ops_bench: %s\n", st.ToString().c_str());
    std::exit(1);
  }
}

// Runs fwd then bwd each iteration and records fwd_ms / bwd_ms averages and a FLOP rate.
template <typename Fwd, typename Bwd>
void TimeFwdBwd(benchmark::State& state, double flops_per_iter, Fwd fwd, Bwd bwd) {
  double fwd_ms = 0.0, bwd_ms = 0.0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    fwd();
    Sync();
    const auto t1 = Clock::now();
    bwd();
    Sync();
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

// One matmul, x[N,in] W[in,out]: args {in, out}.
void BM_Matmul(benchmark::State& state) {
  const int in = static_cast<int>(state.range(0)), out = static_cast<int>(state.range(1));
  Ref a = Act(static_cast<size_t>(kRows) * in), b = Act(static_cast<size_t>(in) * out);
  Ref c = Act(static_cast<size_t>(kRows) * out);
  for (auto _ : state) {
    ops().Matmul(a, b, c, kRows, out, in, false, false, 1.0f, 0.0f);
    Sync();
    benchmark::ClobberMemory();
  }
  state.counters["FLOPS"] =
      benchmark::Counter(2.0 * kRows * in * out, benchmark::Counter::kIsIterationInvariantRate,
                         benchmark::Counter::kIs1000);
}

// A full linear layer: forward plus dx and dW (the three matmuls of training): args {in, out}.
void BM_LinearFwdBwd(benchmark::State& state) {
  const int in = static_cast<int>(state.range(0)), out = static_cast<int>(state.range(1));
  Ref x = Act(static_cast<size_t>(kRows) * in), w = Act(static_cast<size_t>(in) * out);
  Ref bias = Random(out), dout = Act(static_cast<size_t>(kRows) * out);
  Ref y = Act(static_cast<size_t>(kRows) * out), dx = Act(static_cast<size_t>(kRows) * in);
  Ref dw = Zeros(static_cast<size_t>(in) * out), dbias = Zeros(out);
  TimeFwdBwd(
      state, 6.0 * kRows * in * out,
      [&] { ops().LinearForward(x, w, F(bias), nullptr, y, kRows, in, out); },
      [&] { ops().LinearBackward(dout, x, w, dx, F(dw), F(dbias), kRows, in, out); });
}

// LoRA on a frozen base (dw, dbias not needed), as the workers train: args {in, out}.
void BM_LoraLinearFwdBwd(benchmark::State& state) {
  const int in = static_cast<int>(state.range(0)), out = static_cast<int>(state.range(1));
  const int r = kLoraRank;
  Ref x = Act(static_cast<size_t>(kRows) * in), w = Act(static_cast<size_t>(in) * out);
  Ref bias = Random(out), a = Act(static_cast<size_t>(r) * in, 0.02f);
  Ref b = Act(static_cast<size_t>(out) * r, 0.02f);
  Ref dout = Act(static_cast<size_t>(kRows) * out);
  Ref y = Act(static_cast<size_t>(kRows) * out), xa = Act(static_cast<size_t>(kRows) * r);
  Ref dxa = Act(static_cast<size_t>(kRows) * r), dx = Act(static_cast<size_t>(kRows) * in);
  Ref da = Zeros(static_cast<size_t>(r) * in), db = Zeros(static_cast<size_t>(out) * r);
  // Base: 2 N in out forward + 2 N in out for dx; adapters: about 4 N r (in + out) each way.
  const double flops = 4.0 * kRows * in * out + 8.0 * kRows * r * (in + out);
  TimeFwdBwd(
      state, flops,
      [&] {
        ops().LoraLinearForward(x, w, F(bias), a, b, 2.0f, nullptr, y, xa, kRows, in, out, r);
      },
      [&] {
        ops().LoraLinearBackward(dout, x, w, a, b, 2.0f, xa, dx, nullptr, nullptr, F(da), F(db),
                                 dxa, kRows, in, out, r);
      });
}

// args {C}.
void BM_LayerNormFwdBwd(benchmark::State& state) {
  const int C = static_cast<int>(state.range(0));
  const size_t n = static_cast<size_t>(kRows) * C;
  Ref x = Random(n), w = Random(C), b = Random(C), dout = Act(n), y = Act(n);
  Ref mean = Zeros(kRows), rstd = Zeros(kRows), dx = Zeros(n), dw = Zeros(C), db = Zeros(C);
  TimeFwdBwd(
      state, 0.0, [&] { ops().LayerNormForward(F(x), F(w), F(b), y, F(mean), F(rstd), kRows, C); },
      [&] {
        ops().LayerNormBackward(dout, F(x), F(w), F(mean), F(rstd), F(dx), F(dw), F(db), kRows, C);
      });
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(n) * 4 * 5);
}

// args {C}; H = C / 64.
void BM_AttentionFwdBwd(benchmark::State& state) {
  const int C = static_cast<int>(state.range(0)), H = C / kHeadSize;
  const size_t n = static_cast<size_t>(kRows) * C;
  Ref qkv = Act(3 * n), dout = Act(n), out = Act(n), dqkv = Act(3 * n);
  Ref lse = Zeros(static_cast<size_t>(kBatch) * H * kContext);
  Ref scratch = Zeros(AttentionScratchFloats(kBatch, kContext, C, H));
  // Forward: QK^T and att V, 2 B T^2 C each (half of it causal, counted whole as before);
  // backward: four such products.
  const double flops = 12.0 * kBatch * kContext * static_cast<double>(kContext) * C;
  TimeFwdBwd(
      state, flops, [&] { ops().AttentionForward(qkv, out, F(lse), kBatch, kContext, C, H); },
      [&] {
        ops().AttentionBackward(dout, qkv, out, F(lse), dqkv, F(scratch), kBatch, kContext, C, H);
      });
}

// args {C}; the MLP's activation on [N, 4C].
void BM_GeluFwdBwd(benchmark::State& state) {
  const int64_t n = static_cast<int64_t>(kRows) * 4 * state.range(0);
  Ref x = Act(n), dout = Act(n), y = Act(n), dx = Act(n);
  TimeFwdBwd(
      state, 0.0, [&] { ops().GeluForward(x, y, n); }, [&] { ops().GeluBackward(dout, x, dx, n); });
}

// The GPT-2 head for one sequence (256 rows, 50257 classes), loss and gradient in one pass
// (the logits matmul excluded); the "backward" half is empty.
void BM_CrossEntropyFwdBwd(benchmark::State& state) {
  const int N = static_cast<int>(state.range(0));
  Ref logits = Act(static_cast<size_t>(N) * kVocab), dlogits = Act(static_cast<size_t>(N) * kVocab);
  std::vector<int32_t> host_targets(N);
  for (int i = 0; i < N; ++i) host_targets[i] = (i * 7919) % kVocab;
  Ref targets = Zeros(N), losses = Zeros(N), dloss = Zeros(1);
  ops().Upload(targets.data, host_targets.data(), N * sizeof(int32_t));
  const float scale = 1.0f / N;
  ops().Upload(dloss.data, &scale, sizeof scale);
  TimeFwdBwd(
      state, 0.0,
      [&] {
        ops().SoftmaxCrossEntropy(logits, static_cast<const int32_t*>(targets.data), F(losses),
                                  dlogits, F(dloss), N, kVocab);
      },
      [] {});
}

void AdamW(benchmark::State& state) {
  const int64_t n = state.range(0);
  Ref p = Random(n), g = Random(n), m = Zeros(n), v = Zeros(n), sumsq = Zeros(1);
  const std::vector<AdamWChunk> host = MakeAdamWChunks({{0, n, true}});
  Ref chunks = Zeros(host.size() * sizeof(AdamWChunk) / sizeof(float) + 1);
  ops().Upload(chunks.data, host.data(), host.size() * sizeof(AdamWChunk));
  const AdamWScalars sc{1e-3f, 0.1f, 0.001f, 0.0f};
  Ref scalars = Zeros(sizeof(AdamWScalars) / sizeof(float));
  ops().Upload(scalars.data, &sc, sizeof sc);
  Ref copy = g_dtype == Dtype::kBF16 ? Zeros(n, Dtype::kBF16) : Ref();
  AdamWConfig cfg;
  for (auto _ : state) {
    ops().SumSquares(F(g), n, F(sumsq));
    ops().AdamW(F(p), F(g), F(m), F(v), copy, static_cast<const AdamWChunk*>(chunks.data),
                static_cast<int>(host.size()), F(sumsq),
                static_cast<const AdamWScalars*>(scalars.data), cfg);
    Sync();
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
  using namespace isthmus;
  // --device=cpu|cuda|cuda:N and --precision=fp32|bf16 are ours; the rest is Google Benchmark's.
  std::string device = "cpu", precision = "fp32";
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--device=", 0) == 0) {
      device = a.substr(9);
    } else if (a.rfind("--precision=", 0) == 0) {
      precision = a.substr(12);
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  auto choice = ops::ParseDevice(device);
  if (!choice.ok() || (precision != "fp32" && precision != "bf16")) {
    std::fprintf(stderr, "ops_bench: --device=cpu|cuda|cuda:N --precision=fp32|bf16\n");
    return 2;
  }
  auto resolved = ops::ResolveDevice(*choice, 0);
  auto backend = resolved.ok() ? ops::OpenBackend(*resolved)
                               : Result<std::shared_ptr<ops::Ops>>(resolved.status());
  if (!backend.ok()) {
    std::fprintf(stderr, "ops_bench: %s\n", backend.status().ToString().c_str());
    return 2;
  }
  ops::g_ops = std::move(backend).value();
  ops::g_dtype = precision == "bf16" ? ops::Dtype::kBF16 : ops::Dtype::kF32;
  benchmark::AddCustomContext("device", ops::g_ops->Describe());
  benchmark::AddCustomContext("precision", precision);
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
