// Pulling by replay (docs/SYNC.md, "Pulling by replay"): a worker keeps a copy of each shard's
// committed state (theta and the outer momentum) and, at each pull, gets the rounds committed
// since as the sites' encoded deltas, a few MB where the state is hundreds, and replays their
// commits with the shard's own arithmetic (codec_outer.h), then proves it reached the shard's
// state by the round's digest (common/state_digest.h). The served tensors are that state
// moved by the optimistic view's uncommitted rounds, as the shard computes them. The shard
// also sends the state's fast check (XXH3-128 of the same bytes), and the copy is checked
// with that instead when it is there: the shard computed the SHA-256 already. A shard that
// cannot replay from the copy (the worker's first pull, deltas older than
// sync.replay_rounds, a change of membership) sends its whole committed state once; a digest
// that does not match drops the copy and pulls the whole state again, logged as a warning.
//
// Threads: a ReplayPuller is used by one thread at a time (as its SiteClient).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/client.h"
#include "common/site_client.h"
#include "common/status.h"
#include "common/tensor.h"

namespace isthmus::codec {

// Counters of a ReplayPuller (for logs and benchmarks).
struct ReplayStats {
  uint64_t pulls = 0;
  uint64_t whole_pulls = 0;        // pulls that brought a whole committed state
  uint64_t rounds_replayed = 0;    // committed rounds replayed from deltas
  uint64_t digest_mismatches = 0;  // replays whose state did not match the shard's check
                                   // (or digest, from a shard that sends no check)
  // Replays checked with the shard's fast check (DigestKind::kCheck), and with the SHA-256
  // digest (a shard that sends no check).
  uint64_t fast_checks = 0, digest_checks = 0;
  uint64_t view_pulls = 0;     // pulls served with the view's rounds on a copy
  uint64_t payload_bytes = 0;  // bytes of the replies' payload frames
  // Where the pulls' time went: the requests (shard's work and transfer), replaying the
  // commits (decode, merge, outer step) with the digest of the last one (hashed on another
  // thread as it is replayed), and the served tensors (the view's rounds and the copies
  // handed out).
  double request_s = 0, replay_s = 0, serve_s = 0;
};

// One shard's committed state, as replayed here.
class ShardReplica {
 public:
  // The served tensors of `job` on `client`'s shard, by replay; each handed out in the
  // buffer `spare` holds for its name when there is one (taken from it), else in fresh
  // memory. A pull that brought the whole state also puts a buffer of each served tensor's
  // size into `spare` (for the next pull) where it holds none.
  Result<std::vector<Tensor>> Pull(ShardClient& client, const std::string& job, ReplayStats& stats,
                                   std::map<std::string, std::vector<float>>& spare);
  uint64_t round() const { return round_; }
  const std::string& digest() const { return digest_; }
  // The copy of committed theta of `name` (tests); null when none.
  std::vector<float>* theta(const std::string& name);

 private:
  struct Entry {
    std::vector<int64_t> shape;
    std::vector<float> theta, momentum;  // momentum empty when the outer step keeps none
  };
  // Takes the reply's whole state as the copy.
  Status Load(const ReplayReply& reply);
  // tensor -> (site's weight, its encoded bytes), in site order.
  using RoundParts = std::map<std::string, std::vector<std::pair<float, std::string_view>>>;
  // The parts of `round`, checked against the tensors of `state`.
  static Result<RoundParts> PartsOf(const std::map<std::string, Entry>& state,
                                    const ReplayRoundDeltas& round);
  // Commits one tensor's parts into `e` (merge in site order, then the outer step).
  Status ApplyTensor(const std::string& name, Entry& e, const RoundParts& parts, float lr,
                     float mu);
  // Commits `round` into `state`.
  Status ApplyRound(std::map<std::string, Entry>& state, const ReplayRoundDeltas& round, float lr,
                    float mu);
  // Commits `round` (reply's last) into the copy and returns the state's fast check after it
  // when the reply has one, else its digest, each tensor hashed while the next is replayed
  // (common/pipelined.h).
  Result<std::string> ApplyRoundAndDigest(const ReplayRoundDeltas& round, const ReplayReply& reply,
                                          float lr, float mu);

  bool have_ = false;
  // The shard's whole state does not fit one message (a replay pull was refused with
  // ResourceExhausted): pull every tensor instead, as without replay.
  bool plain_only_ = false;
  uint64_t round_ = 0;
  std::string digest_;
  std::map<std::string, Entry> state_;
  // The merge of a tensor's deltas, reused from tensor to tensor and pull to pull (fresh
  // memory would be zeroed by the kernel first: the largest tensor is 154 MB in full mode).
  std::vector<float> merged_;
};

// SiteClient's puller by replay: one ShardReplica per shard.
class ReplayPuller : public ShardPuller {
 public:
  Result<std::vector<Tensor>> Pull(size_t shard, ShardClient& client,
                                   const std::string& job) override;
  // The buffers of `pulled` hand out the same tensors' values at later pulls.
  void Recycle(std::vector<Tensor> pulled) override;
  const ReplayStats& stats() const { return stats_; }
  ShardReplica* replica(size_t shard) {
    return shard < replicas_.size() ? &replicas_[shard] : nullptr;
  }

 private:
  std::vector<ShardReplica> replicas_;
  ReplayStats stats_;
  std::map<std::string, std::vector<float>> spare_;  // by tensor name (Recycle)
};

}  // namespace isthmus::codec
