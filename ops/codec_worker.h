// Deltas encoded by the worker (docs/SYNC.md, "Deltas encoded by the worker"): a rank encodes
// its round's deltas itself with the pipelines its shards give, with error feedback in a
// residual of its own, and pushes the encoded bytes: the few MB the WAN will carry instead
// of the fp32 delta (341 MB a round for GPT-2 small in full mode). The bytes are those the
// shard would have made from the same delta and residual, so the shard sends them as they
// are; its own residual of the tensor stays as it was.
//
// Threads: a FeedbackEncoder is used by one thread at a time (as its SiteClient); it encodes
// on up to `threads` threads of its own during a call.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/site_client.h"
#include "common/status.h"

namespace isthmus::codec {

class FeedbackEncoder : public DeltaEncoder {
 public:
  explicit FeedbackEncoder(int threads = 1) : threads_(threads) {}

  // DeltaEncoder. A round's first Encode drops what an earlier round that was never Done
  // encoded (its residuals were not taken). InvalidArgument for a tensor without a
  // pipeline in `pipelines` or one that does not parse, or a delta whose size changed.
  Result<std::vector<std::string_view>> Encode(
      uint64_t round, const std::vector<TensorView>& deltas,
      const std::map<std::string, std::string>& pipelines) override;
  void Done(uint64_t round) override;
  bool Kept(uint64_t round, const std::vector<TensorView>& deltas,
            std::map<std::string, std::string>* pipelines) const override;

  // From now on, the pipelines of the round being encoded are written to `path` (whole,
  // fsynced: common/durable.h) before any bytes encoded with them are returned, and what
  // `path` holds now is kept: a worker that restarts in the middle of a round's push then
  // encodes that round again with the same pipelines (Kept), so its bytes and the residual
  // after it are those of the first attempt. Corruption naming the file when it is not one
  // this wrote.
  Status KeepPipelinesIn(std::string path);
  // The round `path` holds pipelines of (0: none).
  uint64_t kept_round() const { return kept_round_; }

  // The residuals later rounds start from (after the last round Done), by tensor: what a
  // checkpoint keeps. Tensors never encoded have none (zeros).
  const std::map<std::string, std::vector<float>>& residuals() const { return residual_; }
  // Starts from `residuals` (a checkpoint's), forgetting any round in progress.
  void SetResiduals(std::map<std::string, std::vector<float>> residuals);
  // Takes the memory the first round's encode needs now, for tensors of these sizes (by
  // name): a zero residual where there is none yet and the buffer the next residual is
  // written into. Without it round 1's encode takes it (in full mode 683 MB that the
  // kernel zeroes page by page, most of that round's encode on the development machine),
  // at the end of the first round instead of at start-up.
  void Reserve(const std::map<std::string, size_t>& sizes);
  uint64_t done_round() const { return done_; }

 private:
  struct Encoded {
    std::string bytes;
    std::vector<float> residual;  // the residual after this round (taken at Done)
  };
  int threads_;
  std::map<std::string, std::vector<float>> residual_;
  uint64_t done_ = 0;   // the last round Done
  uint64_t round_ = 0;  // the round `encoded_` holds
  std::map<std::string, Encoded> encoded_;
  std::map<std::string, std::vector<float>> spare_;  // buffers for the next residuals
  std::string kept_path_;                            // empty: pipelines are not kept
  uint64_t kept_round_ = 0;
  std::map<std::string, std::string> kept_;  // of kept_round_, by tensor
};

}  // namespace isthmus::codec
