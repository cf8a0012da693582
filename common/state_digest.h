// The digest of a synced job's committed state on one shard (docs/SYNC.md, "Digest"): how
// sites check that they committed bitwise the same thing, and how a worker that replays
// committed rounds from their encoded deltas (ops/codec_replica.h) proves it reached the
// shard's state. The shard's side (server/sync/digest.h) and the worker's call this one
// function.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

struct evp_md_ctx_st;  // OpenSSL's EVP_MD_CTX

namespace isthmus {

struct DigestTensor {
  std::string_view name;
  std::span<const int64_t> shape;
  std::span<const float> theta;
  std::span<const float> momentum;  // empty: none kept (outer momentum 0)
};

// What a digest is made with.
// - kSha256: the state digest sites compare (cryptographic).
// - kCheck: XXH3-128 of the same bytes, about ten times faster here and not cryptographic.
//   A worker that replays committed rounds (ops/codec_replica.h) checks its copy against
//   its own site's shard with it, which computed the SHA-256 digest already: it catches a
//   copy that drifted (a bug, a fault), not a forger, and the shard, which serves the
//   state anyway, is the site's own behind an authenticated link (docs/SYNC.md, "Pulling
//   by replay").
enum class DigestKind { kSha256, kCheck };

// Hex SHA-256 (kCheck: XXH3-128) of BE(round), then for each tensor (`tensors` in name order)
// len(name) name, ndims, dims, theta bytes and momentum bytes, then BE(epoch) BE(first round)
// BE(count) and each member site as len(name) name. Numbers are big-endian 64-bit.
std::string StateDigestOf(uint64_t round, const std::vector<DigestTensor>& tensors, uint64_t epoch,
                          uint64_t from_round, const std::vector<std::string>& sites,
                          DigestKind kind = DigestKind::kSha256);

// The same digest fed one tensor at a time, so that a tensor can be hashed while the next
// is still being computed (common/pipelined.h): Add the tensors in name order, then
// Finish. StateDigestOf is this with every tensor at once.
class StateDigester {
 public:
  explicit StateDigester(uint64_t round, DigestKind kind = DigestKind::kSha256);
  ~StateDigester();
  StateDigester(const StateDigester&) = delete;
  StateDigester& operator=(const StateDigester&) = delete;
  void Add(const DigestTensor& t);
  // The hex digest; the digester is spent.
  std::string Finish(uint64_t epoch, uint64_t from_round, const std::vector<std::string>& sites);

 private:
  void Update(const void* p, size_t n);
  struct Xxh3;                      // xxHash's XXH3 state (state_digest.cc)
  ::evp_md_ctx_st* ctx_ = nullptr;  // kSha256
  Xxh3* xxh_ = nullptr;             // kCheck
};

}  // namespace isthmus
