// bench_codec: what each WAN codec pipeline costs and buys on LoRA round deltas — bytes,
// ratio to dense fp32, relative L2 error, encode/decode speed — and how error feedback keeps
// the sum of decoded deltas on the true sum over 50 rounds. Its output is the source of the
// figures in docs/CODECS.md and of the default pipeline and adaptive ladder order.
//
// The deltas: each adapter tensor follows a random walk whose steps are a slowly rotating
// rank-2 drift plus noise with log-normal row and column scales (heavy-tailed, as real
// gradients are); one round's delta is the walk's movement over 20 steps.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "ops/codec.h"

namespace isthmus::codec {
namespace {

struct Walk {
  std::string name;
  int64_t rows, cols;
  std::vector<float> row_scale, col_scale, u, v;  // u: rows x 2, v: cols x 2
};

Walk MakeWalk(std::string name, int64_t rows, int64_t cols, std::mt19937_64& rng) {
  std::normal_distribution<float> g;
  Walk w{std::move(name), rows, cols, {}, {}, {}, {}};
  for (int64_t i = 0; i < rows; ++i) w.row_scale.push_back(std::exp(0.7f * g(rng)));
  for (int64_t j = 0; j < cols; ++j) w.col_scale.push_back(std::exp(0.7f * g(rng)));
  for (int64_t i = 0; i < rows * 2; ++i) w.u.push_back(g(rng));
  for (int64_t j = 0; j < cols * 2; ++j) w.v.push_back(g(rng));
  return w;
}

// One round's delta: H steps of lr * (0.3 * drift + scaled noise); the Gaussian noise of H
// steps sums to sqrt(H) times one step's. The drift rotates a little every round.
std::vector<float> RoundDelta(Walk& w, std::mt19937_64& rng) {
  constexpr float kLr = 1e-3f, kSteps = 20.0f;
  std::normal_distribution<float> g;
  for (float& x : w.u) x = 0.95f * x + 0.3f * g(rng);
  for (float& x : w.v) x = 0.95f * x + 0.3f * g(rng);
  std::vector<float> d(static_cast<size_t>(w.rows * w.cols));
  for (int64_t i = 0; i < w.rows; ++i)
    for (int64_t j = 0; j < w.cols; ++j) {
      const float drift = w.u[i * 2] * w.v[j * 2] + w.u[i * 2 + 1] * w.v[j * 2 + 1];
      const float noise = w.row_scale[i] * w.col_scale[j] * g(rng);
      d[i * w.cols + j] = kLr * (kSteps * 0.3f * drift + std::sqrt(kSteps) * noise);
    }
  return d;
}

// The adapters of a 4-layer, d=256 GPT-2 with LoRA rank 16 on all four targets.
std::vector<Walk> LoraWalks(std::mt19937_64& rng) {
  std::vector<Walk> walks;
  const int64_t d = 256, r = 16;
  for (int layer = 0; layer < 4; ++layer) {
    const std::string h = "h." + std::to_string(layer) + ".";
    walks.push_back(MakeWalk(h + "attn.c_attn.lora_A", r, d, rng));
    walks.push_back(MakeWalk(h + "attn.c_attn.lora_B", 3 * d, r, rng));
    walks.push_back(MakeWalk(h + "attn.c_proj.lora_A", r, d, rng));
    walks.push_back(MakeWalk(h + "attn.c_proj.lora_B", d, r, rng));
    walks.push_back(MakeWalk(h + "mlp.c_fc.lora_A", r, d, rng));
    walks.push_back(MakeWalk(h + "mlp.c_fc.lora_B", 4 * d, r, rng));
    walks.push_back(MakeWalk(h + "mlp.c_proj.lora_A", r, 4 * d, rng));
    walks.push_back(MakeWalk(h + "mlp.c_proj.lora_B", d, r, rng));
  }
  return walks;
}

struct Tensor2 {
  std::vector<float> x;
  std::vector<int64_t> shape;
};

struct Row {
  uint64_t bytes = 0, numel = 0;
  double err2 = 0, norm2 = 0, enc_s = 0, dec_s = 0;
};

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Row Measure(const Pipeline& p, const std::vector<Tensor2>& ts) {
  Row row;
  for (const Tensor2& t : ts) {
    std::string bytes = Encode(p, t.x, t.shape);
    std::vector<float> y(t.x.size());
    if (!Decode(bytes, y).ok()) std::abort();
    row.bytes += bytes.size();
    row.numel += t.x.size();
    for (size_t i = 0; i < y.size(); ++i) {
      row.err2 += (double{t.x[i]} - y[i]) * (double{t.x[i]} - y[i]);
      row.norm2 += double{t.x[i]} * t.x[i];
    }
  }
  // Timing: repeat the whole set until at least 0.1 s has passed.
  int reps = 0;
  double t0 = Now();
  std::vector<std::string> enc(ts.size());
  do {
    for (size_t k = 0; k < ts.size(); ++k) enc[k] = Encode(p, ts[k].x, ts[k].shape);
    ++reps;
  } while (Now() - t0 < 0.1);
  row.enc_s = (Now() - t0) / reps;
  reps = 0;
  t0 = Now();
  do {
    for (size_t k = 0; k < ts.size(); ++k) {
      std::vector<float> y(ts[k].x.size());
      if (!Decode(enc[k], y).ok()) std::abort();
    }
    ++reps;
  } while (Now() - t0 < 0.1);
  row.dec_s = (Now() - t0) / reps;
  return row;
}

void PrintTable(const char* title, const std::vector<Tensor2>& ts,
                const std::vector<const char*>& pipelines) {
  uint64_t numel = 0;
  for (const auto& t : ts) numel += t.x.size();
  std::printf("\n%s: %zu tensors, %llu elements, dense fp32 %llu bytes\n", title, ts.size(),
              static_cast<unsigned long long>(numel), static_cast<unsigned long long>(numel * 4));
  std::printf("%-32s %10s %8s %9s %10s %10s\n", "pipeline", "bytes", "ratio", "rel_l2", "enc_MB/s",
              "dec_MB/s");
  for (const char* text : pipelines) {
    Pipeline p = ParsePipeline(text).value();
    Row r = Measure(p, ts);
    const double mb = static_cast<double>(r.numel) * 4 / 1e6;
    std::printf("%-32s %10llu %8.1f %9.4f %10.1f %10.1f\n", text,
                static_cast<unsigned long long>(r.bytes),
                static_cast<double>(r.numel) * 4 / static_cast<double>(r.bytes),
                std::sqrt(r.err2 / r.norm2), mb / r.enc_s, mb / r.dec_s);
  }
}

void FeedbackExperiment(const std::vector<const char*>& pipelines) {
  constexpr int kRounds = 50;
  std::printf(
      "\nerror feedback: relative L2 error of the sum of decoded deltas vs the sum of "
      "true deltas, 4x256 LoRA adapters, %d rounds\n",
      kRounds);
  std::printf("%-32s %12s %12s %12s\n", "pipeline", "with_fb", "without_fb", "avg_bytes");
  for (const char* text : pipelines) {
    Pipeline p = ParsePipeline(text).value();
    std::mt19937_64 rng(7);  // the same deltas for every pipeline
    std::vector<Walk> walks = LoraWalks(rng);
    std::vector<std::vector<float>> residual, sum_true, sum_fb, sum_nofb;
    for (const Walk& w : walks) {
      const size_t n = static_cast<size_t>(w.rows * w.cols);
      residual.emplace_back(n, 0.0f);
      sum_true.emplace_back(n, 0.0f);
      sum_fb.emplace_back(n, 0.0f);
      sum_nofb.emplace_back(n, 0.0f);
    }
    uint64_t bytes = 0;
    for (int round = 0; round < kRounds; ++round) {
      for (size_t k = 0; k < walks.size(); ++k) {
        std::vector<float> delta = RoundDelta(walks[k], rng);
        std::vector<int64_t> shape = {walks[k].rows, walks[k].cols};
        std::vector<float> decoded(delta.size()), plain(delta.size());
        bytes += EncodeWithFeedback(p, delta, shape, residual[k], decoded).size();
        if (!Decode(Encode(p, delta, shape), plain).ok()) std::abort();
        for (size_t i = 0; i < delta.size(); ++i) {
          sum_true[k][i] += delta[i];
          sum_fb[k][i] += decoded[i];
          sum_nofb[k][i] += plain[i];
        }
      }
    }
    double e_fb = 0, e_nofb = 0, norm = 0;
    for (size_t k = 0; k < walks.size(); ++k)
      for (size_t i = 0; i < sum_true[k].size(); ++i) {
        const double t = sum_true[k][i];
        e_fb += (t - sum_fb[k][i]) * (t - sum_fb[k][i]);
        e_nofb += (t - sum_nofb[k][i]) * (t - sum_nofb[k][i]);
        norm += t * t;
      }
    std::printf("%-32s %12.4f %12.4f %12llu\n", text, std::sqrt(e_fb / norm),
                std::sqrt(e_nofb / norm), static_cast<unsigned long long>(bytes / kRounds));
  }
}

int Main() {
  std::mt19937_64 rng(1);
  std::vector<Walk> walks = LoraWalks(rng);
  for (int round = 0; round < 3; ++round)
    for (Walk& w : walks) RoundDelta(w, rng);  // let the drift settle
  std::vector<Tensor2> all;
  for (Walk& w : walks) all.push_back({RoundDelta(w, rng), {w.rows, w.cols}});
  const std::vector<Tensor2> one = {all[1]};  // h.0.attn.c_attn.lora_B: 768 x 16

  const std::vector<const char*> pipelines = {"dense",
                                              "zstd",
                                              "int8",
                                              "int8+zstd",
                                              "int4+zstd",
                                              "int2+zstd",
                                              "int2:256+zstd",
                                              "topk:0.25+int8+zstd",
                                              "topk:0.1+int8+zstd",
                                              "topk:0.1+int4+zstd",
                                              "topk:0.05+int8+zstd",
                                              "topk:0.05+int4+zstd",
                                              "topk:0.05+int2+zstd",
                                              "blocktopk:0.05:256+int4+zstd",
                                              "topk:0.02+int4+zstd",
                                              "topk:0.01+int4+zstd",
                                              "topk:0.005+int4+zstd",
                                              "topk:0.002+int4+zstd",
                                              "topk:0.001+int2+zstd",
                                              "lowrank:4+zstd",
                                              "lowrank:4+int8+zstd",
                                              "lowrank:2+int8+zstd"};
  PrintTable("one LoRA delta, 768x16 (h.0.attn.c_attn.lora_B)", one, pipelines);
  PrintTable("all adapters of a 4-layer d=256 GPT-2, LoRA rank 16", all, pipelines);
  FeedbackExperiment({"int4+zstd", "int2:256+zstd", "topk:0.1+int4+zstd", "topk:0.05+int4+zstd",
                      "topk:0.05+int2+zstd", "topk:0.01+int4+zstd", "topk:0.001+int2+zstd",
                      "lowrank:4+int8+zstd"});
  return 0;
}

}  // namespace
}  // namespace isthmus::codec

int main() { return isthmus::codec::Main(); }
