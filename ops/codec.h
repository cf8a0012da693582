// The WAN compression codecs: how a round delta is shrunk before it crosses a slow link
// between sites, and how a receiver turns the bytes back into floats. A codec is a pipeline
// chosen per tensor (sparsify, quantise, zstd, or low-rank); encodings are self-describing,
// deterministic byte for byte, and their decoder is safe on hostile input. docs/CODECS.md
// describes the byte format.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace isthmus::codec {

enum class Sparsifier : uint8_t {
  kNone = 0,
  kTopK = 1,       // keep the ceil(density * n) largest |x| of the whole tensor
  kBlockTopK = 2,  // keep the ceil(density * block) largest |x| of each block
};

// One codec pipeline. Stages run in this order: low-rank (2-D tensors only), sparsifier,
// quantiser, zstd. Default-constructed = "dense" (raw fp32, no zstd). Plain value type.
struct Pipeline {
  uint32_t lowrank_rank = 0;  // 0: no low-rank stage
  Sparsifier sparsifier = Sparsifier::kNone;
  double density = 1.0;       // in (0, 1]; used by the sparsifiers
  uint32_t sparse_block = 0;  // block length of kBlockTopK, else 0
  uint32_t bits = 32;         // 32 (fp32), 8, 4 or 2 (symmetric, per-block fp32 scales)
  uint32_t quant_block = 64;  // elements per quantisation scale
  bool zstd = false;          // try zstd on the body; kept only where it shrinks it
  int zstd_level = 3;
  // "defer": send nothing this round. The encoding is a header that decodes to zeros, so
  // with error feedback the whole delta waits in the residual for a later round (how a
  // streamed fragment that is not due skips a round). Excludes every other stage.
  bool defer = false;

  bool operator==(const Pipeline&) const = default;
};

// The pipeline used when a configuration names none: 2-bit values, one scale per 256. Chosen
// by what it does to training (the loss-versus-bytes study, docs/BENCHMARKS.md section 8;
// figures in docs/CODECS.md): about 19x smaller than dense fp32 on LoRA deltas, and with
// error feedback the sum of decoded deltas over 50 rounds is within 0.09 of the true sum.
inline constexpr std::string_view kDefaultPipeline = "int2:256+zstd";

// Parses pipeline text: "dense", "defer", or '+'-joined stages in order
//   [lowrank:RANK] [topk:DENSITY | blocktopk:DENSITY:BLOCK] [int8|int4|int2[:BLOCK]]
//   [zstd[:LEVEL]]
// e.g. "int8+zstd", "topk:0.01+int4+zstd", "blocktopk:0.05:256+int2:32+zstd",
// "lowrank:4+zstd". InvalidArgument (naming the bad stage) on anything else: unknown or
// repeated stages, wrong order, density outside (0, 1], zero/oversized blocks or rank,
// zstd level outside [1, 19].
Result<Pipeline> ParsePipeline(std::string_view text);

// Canonical text of `p`; ParsePipeline(ToString(p)) == p for every parsed pipeline.
std::string ToString(const Pipeline& p);

// Encodes x into a self-describing byte string. `shape` is the tensor's shape (its product
// must equal x.size()); only the low-rank stage looks at it, and it applies only to 2-D
// tensors where rank * (rows + cols) * 2 <= rows * cols; otherwise the rest of the
// pipeline is used. Deterministic: the same input and pipeline give identical bytes on
// every machine (for pipelines with zstd: with the same libzstd major version).
// Non-finite inputs are encoded as 0 and magnitudes are clamped to 1e30.
// Thread-safe (no shared state).
std::string Encode(const Pipeline& p, std::span<const float> x, std::span<const int64_t> shape);

// Decodes `bytes` (from Encode, or hostile input from the network) into `out`, whose size
// must equal the encoded element count. Every field is validated (header, sizes, sparse
// indices, scales and values finite, zstd frames sized from out.size(), no trailing bytes);
// any problem gives InvalidArgument and leaves `out` untouched. On success every output is
// finite. Deterministic: the same bytes give bitwise identical floats everywhere.
// Thread-safe.
Status Decode(std::string_view bytes, std::span<float> out);

// Decode's validation alone, for an encoding of `numel` values: whether Decode into a tensor
// of that size would succeed (and so yield finite values only), without the tensor to
// decode into. For a receiver that checks bytes it stores and decodes later. Thread-safe.
Status Check(std::string_view bytes, uint64_t numel);

// Decode's validation, then out[i] += w * decoded[i] for the values the encoding holds: every
// element of a dense or low-rank one, the stored ones of a sparse one (the others are zeros:
// nothing to add), none of a deferred one. For a merge that sums sites' deltas into one
// tensor without decoding each into a zeroed buffer first (docs/SYNC.md, "Commit rule").
// Bit for bit what Decode into a buffer followed by AddWeighted (codec_outer.h) gives when
// w > 0 and `out` holds no -0.0 (x + 0.0 is x for every other x), which a sum that starts
// from +0.0 never does. On an error `out` is untouched. Thread-safe.
Status DecodeAddWeighted(std::string_view bytes, float w, std::span<float> out);

// Whether `bytes` is a deferred encoding (pipeline "defer": zeros, nothing sent). Looks at
// the header only; Decode still validates the rest.
bool IsDeferred(std::string_view bytes);

// Error feedback in one call: v = delta + residual; q = Encode(p, v, shape);
// decoded = Decode(q); residual = v - decoded. Returns q. `residual` (in/out, persisted by
// the caller between rounds, zero at the start) and `decoded` (out) have delta.size()
// elements. The sender merges `decoded`: exactly what its peers will receive.
std::string EncodeWithFeedback(const Pipeline& p, std::span<const float> delta,
                               std::span<const int64_t> shape, std::span<float> residual,
                               std::span<float> decoded);
// The residual EncodeWithFeedback leaves, from the one it was given, the delta, and the
// decoded bytes it sent: residual = (residual + delta) - decoded, the same operations in
// the same order, so bit for bit. For a restart that recomputes residuals it did not store.
void RecomputeResidual(std::span<float> residual, std::span<const float> delta,
                       std::span<const float> decoded);
// The same with the residual read from `residual_in` and the new one written to
// `residual_out` (which may be the same memory): the caller keeps the old residual until it
// chooses to take the new one. Bitwise the same results. `decoded` may be empty when the
// caller wants no decoded values: the residual is then computed from the encoding's stored
// values alone (DecodeAddWeighted with -1), bit for bit the same, without a decoded tensor
// to zero and subtract (a sparse encoding's unstored values leave v as it is).
std::string EncodeWithFeedback(const Pipeline& p, std::span<const float> delta,
                               std::span<const int64_t> shape, std::span<const float> residual_in,
                               std::span<float> residual_out, std::span<float> decoded);

// One tensor of EncodeWithFeedbackMany: the arguments of EncodeWithFeedback (decoded may be
// left empty: no decoded values are wanted then) and, out, its encoding.
struct FeedbackTask {
  Pipeline pipeline;
  std::span<const float> delta;
  std::span<const int64_t> shape;
  std::span<const float> residual_in;
  std::span<float> residual_out;
  std::span<float> decoded;
  std::string bytes;  // out
};

// EncodeWithFeedback for every task, on up to `threads` threads: the calling thread and
// threads - 1 helpers (named "codec-encode", started for the call and joined before it
// returns). Each task runs whole on one thread, largest first, taken in turn by whichever
// thread is free. The tasks share nothing and every encoding is deterministic, so the bytes
// and floats are bitwise those of calling EncodeWithFeedback on each task in turn; threads
// <= 1 does exactly that on the calling thread. Tasks must not overlap in memory they
// write.
void EncodeWithFeedbackMany(std::span<FeedbackTask> tasks, int threads);

// The ladder of adaptive mode, finest (most accurate) first: dense, int8+zstd, int4+zstd,
// topk:0.25+int8+zstd, int2:256+zstd, ..., topk:0.001+int2+zstd (14 rungs; docs/CODECS.md lists
// them). Sizes fall along it; the order is by measured error on LoRA deltas (bench/codec),
// except int2:256+zstd, placed by size (it trains better than its one-round error says).
const std::vector<Pipeline>& AdaptiveLadder();

// Estimated size of Encode(p, x) for x of `numel` elements (an upper-leaning estimate: it
// assumes zstd saves nothing; low-rank is estimated as the fallback since shape is unknown).
uint64_t EstimateBytes(const Pipeline& p, uint64_t numel);

// Adaptive mode: the finest ladder pipeline whose EstimateBytes(numel) <= byte_budget,
// never finer than `ceiling` nor coarser than `floor`; `floor` when none fits. floor and
// ceiling should be ladder pipelines; one that is not is replaced by the ladder entry of the
// nearest estimated size. If floor is finer than ceiling the two are swapped.
Pipeline ChooseAdaptive(uint64_t numel, uint64_t byte_budget, const Pipeline& floor,
                        const Pipeline& ceiling);

}  // namespace isthmus::codec
