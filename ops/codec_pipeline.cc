// Pipeline text (parse and print), size estimates and the adaptive ladder: everything about
// codecs that does not touch tensor data. The byte format lives in codec.cc.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <string>
#include <vector>

#include "ops/codec.h"

namespace isthmus::codec {
namespace {

constexpr uint32_t kMaxBlock = 1u << 20;
constexpr uint32_t kMaxRank = 256;

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    size_t pos = s.find(sep, start);
    parts.push_back(s.substr(start, pos == std::string_view::npos ? pos : pos - start));
    if (pos == std::string_view::npos) break;
    start = pos + 1;
  }
  return parts;
}

bool ParseUint(std::string_view s, uint32_t lo, uint32_t hi, uint32_t* out) {
  uint32_t v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || v < lo || v > hi) return false;
  *out = v;
  return true;
}

bool ParseDensity(std::string_view s, double* out) {
  double v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || !(v > 0.0) || !(v <= 1.0)) return false;
  *out = v;
  return true;
}

std::string FormatDouble(double v) {
  char buf[64];
  auto [ptr, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, ptr);
}

}  // namespace

Result<Pipeline> ParsePipeline(std::string_view text) {
  Pipeline p;
  if (text == "dense") return p;
  if (text == "defer") {
    p.defer = true;
    return p;
  }
  if (text.empty()) return Status::InvalidArgument("codec pipeline: empty text");
  // Stage order: 0 lowrank, 1 sparsifier, 2 quantiser, 3 zstd; each at most once, in order.
  int next_stage = 0;
  for (std::string_view stage : Split(text, '+')) {
    std::vector<std::string_view> f = Split(stage, ':');
    const std::string bad =
        "codec pipeline '" + std::string(text) + "': bad stage '" + std::string(stage) + "'";
    int order = -1;
    if (f[0] == "lowrank") {
      order = 0;
      if (f.size() != 2 || !ParseUint(f[1], 1, kMaxRank, &p.lowrank_rank))
        return Status::InvalidArgument(bad + " (lowrank:RANK, RANK in [1, 256])");
    } else if (f[0] == "topk") {
      order = 1;
      p.sparsifier = Sparsifier::kTopK;
      if (f.size() != 2 || !ParseDensity(f[1], &p.density))
        return Status::InvalidArgument(bad + " (topk:DENSITY, DENSITY in (0, 1])");
    } else if (f[0] == "blocktopk") {
      order = 1;
      p.sparsifier = Sparsifier::kBlockTopK;
      if (f.size() != 3 || !ParseDensity(f[1], &p.density) ||
          !ParseUint(f[2], 1, kMaxBlock, &p.sparse_block))
        return Status::InvalidArgument(bad + " (blocktopk:DENSITY:BLOCK)");
    } else if (f[0] == "int8" || f[0] == "int4" || f[0] == "int2") {
      order = 2;
      p.bits = f[0] == "int8" ? 8 : f[0] == "int4" ? 4 : 2;
      if (f.size() > 2 || (f.size() == 2 && !ParseUint(f[1], 1, kMaxBlock, &p.quant_block)))
        return Status::InvalidArgument(bad + " (intN[:BLOCK], BLOCK in [1, 2^20])");
    } else if (f[0] == "zstd") {
      order = 3;
      p.zstd = true;
      uint32_t level = 3;
      if (f.size() > 2 || (f.size() == 2 && !ParseUint(f[1], 1, 19, &level)))
        return Status::InvalidArgument(bad + " (zstd[:LEVEL], LEVEL in [1, 19])");
      p.zstd_level = static_cast<int>(level);
    } else {
      return Status::InvalidArgument(bad + " (unknown stage)");
    }
    if (order < next_stage)
      return Status::InvalidArgument(
          bad + " (repeated or out of order; order is lowrank, sparsifier, quantiser, zstd)");
    next_stage = order + 1;
  }
  return p;
}

std::string ToString(const Pipeline& p) {
  if (p.defer) return "defer";
  std::vector<std::string> parts;
  if (p.lowrank_rank > 0) parts.push_back("lowrank:" + std::to_string(p.lowrank_rank));
  if (p.sparsifier == Sparsifier::kTopK) parts.push_back("topk:" + FormatDouble(p.density));
  if (p.sparsifier == Sparsifier::kBlockTopK)
    parts.push_back("blocktopk:" + FormatDouble(p.density) + ":" + std::to_string(p.sparse_block));
  if (p.bits != 32) {
    std::string q = "int" + std::to_string(p.bits);
    if (p.quant_block != 64) q += ":" + std::to_string(p.quant_block);
    parts.push_back(q);
  }
  if (p.zstd) parts.push_back(p.zstd_level == 3 ? "zstd" : "zstd:" + std::to_string(p.zstd_level));
  if (parts.empty()) return "dense";
  std::string s = parts[0];
  for (size_t i = 1; i < parts.size(); ++i) s += "+" + parts[i];
  return s;
}

namespace {
uint64_t VarintBytes(uint64_t v) {
  uint64_t n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}
}  // namespace

uint64_t EstimateBytes(const Pipeline& p, uint64_t numel) {
  constexpr uint64_t kFixedHeader = 5;  // magic, version, kind, flags
  if (p.defer) return kFixedHeader + VarintBytes(numel);
  uint64_t nnz = numel;
  uint64_t index_bytes = 0;
  if (p.sparsifier != Sparsifier::kNone && numel > 0) {
    if (p.sparsifier == Sparsifier::kTopK) {
      nnz = static_cast<uint64_t>(std::ceil(p.density * static_cast<double>(numel)));
    } else {
      const uint64_t b = p.sparse_block;
      const uint64_t per_block = static_cast<uint64_t>(std::ceil(p.density * b));
      const uint64_t rem = numel % b;
      nnz = (numel / b) * per_block +
            (rem ? static_cast<uint64_t>(std::ceil(p.density * static_cast<double>(rem))) : 0);
    }
    nnz = std::clamp<uint64_t>(nnz, 1, numel);
    // Gaps between kept indices are roughly geometric with mean numel / nnz: a gap needs
    // one more varint byte for each power of 128 it reaches.
    const double d = static_cast<double>(nnz) / static_cast<double>(numel);
    double per_index = 1.0;
    for (double t = 128.0; t < static_cast<double>(numel); t *= 128.0)
      per_index += std::exp(-t * d);
    index_bytes = static_cast<uint64_t>(std::ceil(per_index * static_cast<double>(nnz)));
  }
  uint64_t value_bytes = 4 * nnz;
  if (p.bits != 32) {
    value_bytes = 4 * ((nnz + p.quant_block - 1) / p.quant_block) + (nnz * p.bits + 7) / 8;
  }
  // The varint header fields; zstd adds nothing because the encoder drops it unless it shrinks.
  uint64_t header = kFixedHeader + VarintBytes(numel);
  if (p.sparsifier != Sparsifier::kNone) header += VarintBytes(nnz);
  if (p.bits != 32) header += VarintBytes(p.quant_block);
  if (p.sparsifier == Sparsifier::kBlockTopK) header += VarintBytes(p.sparse_block);
  return header + index_bytes + value_bytes;
}

const std::vector<Pipeline>& AdaptiveLadder() {
  // Finest first. Sizes fall monotonically along it. The order is by relative L2 error
  // measured by bench/codec on LoRA deltas, except int2:256+zstd, placed by size: its
  // one-round error is above topk:0.1+int8's, but with error feedback it trains better
  // than any top-k rung (docs/CODECS.md).
  static const std::vector<Pipeline> ladder = [] {
    const char* kTexts[] = {
        "dense",
        "int8+zstd",
        "int4+zstd",
        "topk:0.25+int8+zstd",
        "int2:256+zstd",
        "topk:0.1+int8+zstd",
        "topk:0.1+int4+zstd",
        "topk:0.05+int4+zstd",
        "topk:0.05+int2+zstd",
        "topk:0.02+int4+zstd",
        "topk:0.01+int4+zstd",
        "topk:0.005+int4+zstd",
        "topk:0.002+int4+zstd",
        "topk:0.001+int2+zstd",
    };
    std::vector<Pipeline> v;
    for (const char* t : kTexts) v.push_back(ParsePipeline(t).value());
    return v;
  }();
  return ladder;
}

namespace {

// Index of `p` on the ladder, or of the ladder entry with the nearest estimated size.
size_t LadderIndex(const Pipeline& p) {
  const auto& ladder = AdaptiveLadder();
  for (size_t i = 0; i < ladder.size(); ++i)
    if (ladder[i] == p) return i;
  constexpr uint64_t kProbe = 1 << 20;
  const double target = static_cast<double>(EstimateBytes(p, kProbe));
  size_t best = 0;
  double best_diff = INFINITY;
  for (size_t i = 0; i < ladder.size(); ++i) {
    double d = std::fabs(static_cast<double>(EstimateBytes(ladder[i], kProbe)) - target);
    if (d < best_diff) {
      best_diff = d;
      best = i;
    }
  }
  return best;
}

}  // namespace

Pipeline ChooseAdaptive(uint64_t numel, uint64_t byte_budget, const Pipeline& floor,
                        const Pipeline& ceiling) {
  const auto& ladder = AdaptiveLadder();
  size_t finest = LadderIndex(ceiling);
  size_t coarsest = LadderIndex(floor);
  if (finest > coarsest) std::swap(finest, coarsest);
  for (size_t i = finest; i <= coarsest; ++i)
    if (EstimateBytes(ladder[i], numel) <= byte_budget) return ladder[i];
  return ladder[coarsest];
}

}  // namespace isthmus::codec
