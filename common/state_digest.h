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

// Hex SHA-256 of BE(round), then for each tensor (`tensors` in name order) len(name) name,
// ndims, dims, theta bytes and momentum bytes, then BE(epoch) BE(first round) BE(count) and
// each member site as len(name) name. Numbers are big-endian 64-bit.
std::string StateDigestOf(uint64_t round, const std::vector<DigestTensor>& tensors, uint64_t epoch,
                          uint64_t from_round, const std::vector<std::string>& sites);

// The same digest fed one tensor at a time, so that a tensor can be hashed while the next
// is still being computed (common/pipelined.h): Add the tensors in name order, then
// Finish. StateDigestOf is this with every tensor at once.
class StateDigester {
 public:
  explicit StateDigester(uint64_t round);
  ~StateDigester();
  StateDigester(const StateDigester&) = delete;
  StateDigester& operator=(const StateDigester&) = delete;
  void Add(const DigestTensor& t);
  // The hex digest; the digester is spent.
  std::string Finish(uint64_t epoch, uint64_t from_round, const std::vector<std::string>& sites);

 private:
  void Update(const void* p, size_t n);
  ::evp_md_ctx_st* ctx_;
};

}  // namespace isthmus
