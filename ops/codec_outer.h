// The outer step's arithmetic, shared by a shard's round engine (commit and optimistic view,
// server/sync/sync_engine.cc) and a worker that replays committed rounds from their encoded
// deltas (ops/codec_replica.h): the same functions, compiled without fused multiply-adds
// (this library's -ffp-contract=off), so both get the same bits (docs/SYNC.md, "Commit rule").
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace isthmus::codec {

// A site's merge weight: float(tokens / total), computed in double; 1 / sites when every
// site reported 0 tokens (total == 0).
float MergeWeight(uint64_t tokens, uint64_t total, size_t sites);

// out[i] += w * decoded[i], in element order. Sizes must be equal. The reference that
// codec::DecodeAddWeighted, which the merges use, matches bit for bit (tests, bench_commit).
void AddWeighted(std::span<float> out, float w, std::span<const float> decoded);

// The outer optimiser on one tensor, g = the merged delta ("values to add"): theta += lr * g
// when mu == 0 (m unused, may be null), else Nesterov: m = mu * m + g; theta += lr * (g + mu * m).
void ApplyOuterStep(float* theta, float* m, const float* g, size_t n, float lr, float mu);

// ApplyOuterStep's arithmetic leaving its inputs as they are: the stepped theta goes to
// `theta_out` and the new momentum to `m_out` (both unused, may be null, when mu == 0), bit
// for bit what ApplyOuterStep on copies gives, in one pass instead of a copy and a step.
// Returns whether every value of theta_out is finite. For a commit, which must keep the
// committed state until its batch is written.
bool ApplyOuterStepTo(const float* theta, const float* m, const float* g, float* theta_out,
                      float* m_out, size_t n, float lr, float mu);

}  // namespace isthmus::codec
