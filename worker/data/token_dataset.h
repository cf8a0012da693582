// Serves training batches from a token shard (train.bin / val.bin of shard_builder.h) to
// one rank of a site. The shard is cut into windows of seq_len + 1 tokens; each rank owns
// a disjoint contiguous slice of the windows and visits it in a seeded random order per
// epoch, so a run is reproducible and can resume exactly where it stopped.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace isthmus::data {

struct DatasetOptions {
  int64_t batch_size = 8;  // B: windows per batch
  int64_t seq_len = 256;   // T: tokens per window fed to the model
  int rank = 0;            // this rank, in [0, world_size)
  int world_size = 1;      // ranks reading the same shard
  uint64_t seed = 0;       // drives the per-epoch order; same seed, same batches
  int vocab_size = 256;    // tokens >= this are refused when the file is opened; above
                           // 65,536 the shard holds uint32 tokens, else uint16
};

// Bytes per token in a shard for a vocabulary of `vocab_size` ids: 2 (uint16) up to 65,536
// ids, 4 (uint32) above (Llama 3's 128,256, Qwen's 151,669). The shard builder and the
// reader both follow this rule, and the manifest names the width ("token_dtype").
inline int TokenBytes(int vocab_size) { return vocab_size > 65536 ? 4 : 2; }

// One batch: row b holds window b. targets[i] is the token that follows tokens[i] in the
// shard (the window shifted by one), or -1 (no loss there) where a task shard's loss mask
// says that token is not learned (the prompt and padding of isthmus-data parallel).
struct Batch {
  int64_t batch_size = 0;
  int64_t seq_len = 0;
  std::vector<int32_t> tokens;    // batch_size * seq_len, row-major
  std::vector<int32_t> targets;   // batch_size * seq_len, row-major
  std::vector<uint64_t> windows;  // batch_size: the shard window of each row
};

// Where a reader stands: the epoch and the number of batches already served in it.
struct DatasetPosition {
  uint64_t epoch = 0;
  uint64_t batch = 0;

  // "epoch:batch", for checkpoint metadata (a string map).
  std::string ToString() const;
  // Parses ToString()'s format; InvalidArgument otherwise.
  static Result<DatasetPosition> Parse(const std::string& text);
  bool operator==(const DatasetPosition&) const = default;
};

// Window w covers shard tokens [w*T, w*T + T + 1), so consecutive windows share one token
// and every token but the first is a target exactly once per epoch. With C = (N-1)/T
// windows, rank r owns windows [r*C/W, (r+1)*C/W) with C/W = floor(C / W) for every rank
// (at most W-1 trailing windows go unused) so that all ranks run the same number of
// batches. An epoch is floor((C/W) / B) batches; leftover windows of a rank are skipped
// in that epoch (they are in the next epoch's order at other places).
//
// Not thread-safe: one reader per rank thread. Owns a read-only memory map of the file,
// released on destruction. Movable, not copyable.
class TokenDataset {
 public:
  // Maps `path` and checks it: the size is a whole number of tokens of the width
  // TokenBytes(vocab_size) gives, a manifest.json beside it (if any) names that width
  // (and, for a task shard with a loss mask, examples of seq_len tokens: InvalidArgument
  // otherwise; the mask is read, Corruption when its size is not the token count),
  // every token < vocab_size, and the rank's slice holds at least one batch. NotFound /
  // IoError for the file, Corruption for a size that is no whole number of tokens or an
  // out-of-vocabulary token, InvalidArgument for bad options or a shard built for another
  // vocabulary width, FailedPrecondition when the shard is too small for B x T batches on
  // W ranks.
  static Result<TokenDataset> Open(const std::string& path, const DatasetOptions& options);

  TokenDataset(TokenDataset&& other) noexcept;
  TokenDataset& operator=(TokenDataset&& other) noexcept;
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;
  ~TokenDataset();

  // The next batch; rolls over into the next epoch (a new order) at the end of one.
  Batch Next();
  // Windows [first, first + count) of the whole shard (any rank's), in order: what a pass
  // over the shard reads (isthmus-worker teach). first + count <= num_windows().
  Batch Windows(uint64_t first, uint64_t count) const;
  // Windows of seq_len + 1 tokens in the shard: (num_tokens() - 1) / seq_len.
  uint64_t num_windows() const;

  // A task shard's: whether it has a loss mask, and its tokenizer as its manifest names it
  // ("byte" when there is no manifest).
  bool has_mask() const { return !mask_.empty(); }
  const std::string& tokenizer() const { return tokenizer_; }
  // Lower-case hex SHA-256 of the shard's tokens and its loss mask: what a teacher cache
  // computed on it records (O(shard size)).
  std::string Digest() const;

  DatasetPosition position() const { return {epoch_, batch_}; }
  // Makes Next() continue from `position` (as returned by position() of a reader opened
  // with the same file and options). InvalidArgument if position.batch is past the end of
  // an epoch.
  Status Restore(const DatasetPosition& position);

  uint64_t num_tokens() const { return num_tokens_; }
  int64_t seq_len() const { return options_.seq_len; }
  uint64_t batches_per_epoch() const { return batches_per_epoch_; }
  // This rank's windows: [first_window(), first_window() + windows_per_rank()).
  uint64_t first_window() const { return first_window_; }
  uint64_t windows_per_rank() const { return windows_per_rank_; }
  // Window indices of the current epoch's order (absolute, within this rank's slice).
  const std::vector<uint64_t>& epoch_order() const { return order_; }
  // Token i of the shard, i < num_tokens().
  uint32_t token(uint64_t i) const {
    return width_ == 4 ? reinterpret_cast<const uint32_t*>(bytes_)[i]
                       : reinterpret_cast<const uint16_t*>(bytes_)[i];
  }

 private:
  TokenDataset() = default;
  void ShuffleForEpoch();

  DatasetOptions options_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint8_t* bytes_ = nullptr;  // the mapped tokens, little-endian
  int width_ = 2;                   // bytes per token
  uint64_t num_tokens_ = 0;
  uint64_t first_window_ = 0;
  uint64_t windows_per_rank_ = 0;
  uint64_t batches_per_epoch_ = 0;
  uint64_t epoch_ = 0;
  uint64_t batch_ = 0;
  std::vector<uint64_t> order_;
  std::vector<char> mask_;  // a task shard's loss mask (1 byte per token); empty otherwise
  std::string tokenizer_ = "byte";
  // Writes window w into row b of `out`.
  void FillRow(uint64_t w, uint64_t b, Batch& out) const;
};

}  // namespace isthmus::data
