// A synthetic site for the WAN benchmark (bench/wan/run.sh): it plays one site's workers at
// a GPU's pace without a GPU. Each round it "computes" for a fixed time (sleeps, in
// steps_per_round emulated steps, standing for the H inner steps a GPU site runs in that
// time), then ends the round through the product's round driver (common/round_driver.h),
// as isthmus-worker does: push the round's delta to every shard, wait while the site is too
// far ahead of the last commit, pull the merged state, merge it into its weights (host
// memory: HostLiveParams). With overlap that runs in the background while the next round's
// steps go on, and a finished round is merged at the next emulated step boundary. The
// deltas are not made up: they are recorded from real training (bench/wan/record.sh) and
// replayed in order, cycling, so the codecs see real structure.
//
// Threads: Run() uses the site client on the calling thread and the round driver's, plus
// one watcher thread with its own connections that timestamps each round's commit.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/client.h"
#include "common/round_driver.h"
#include "common/site_client.h"
#include "common/status.h"
#include "common/tensor.h"
#include "ops/codec_replica.h"

namespace isthmus::wanload {

// R round deltas read from DIR/round-0.safetensors .. DIR/round-R.safetensors: delta r is
// round-r minus round-(r-1), tensor by tensor (every file must hold the same names and
// shapes as round-0).
struct RecordedDeltas {
  std::vector<std::vector<Tensor>> rounds;
  uint64_t numel = 0;  // values per round
};
// NotFound without round-0 or round-1; InvalidArgument (naming the file and tensor) when a
// file's tensors differ from round-0's. `max_rounds` > 0 reads at most that many deltas.
Result<RecordedDeltas> LoadRecordedDeltas(const std::string& dir, int max_rounds = 0);

// One round as the synthetic site lived it (seconds). Foreground: what the training loop
// did (compute, or the round boundary: blocked on the round in flight, taking the delta,
// merging). Background (the round driver's thread; without overlap the caller waits for
// it, so it is also blocked time): the round's own push, WAN wait and pull.
struct RoundTiming {
  uint64_t round = 0;
  double compute_s = 0;  // the emulated inner steps
  double push_s = 0;     // this round's push to every shard (LAN)
  double wait_s = 0;     // this round's wait for the WAN (too far ahead of the last commit)
  double pull_s = 0;     // this round's pull of the merged state (LAN)
  // From the end of this round's push to the moment every shard had committed it (the
  // round's exchange with every peer site, end to end); < 0 when it never committed
  // while the run lasted.
  double commit_latency_s = -1;
  double wall_s = 0;         // wall time of the round in the training loop
  double boundary_s = 0;     // of which not computing: the round boundary and the merges
  double blocked_s = 0;      // of which waiting for a round in flight (push, wait, pull)
  double blocked_wan_s = 0;  // of which while that round waited for the WAN
};

struct LoadSummary {
  size_t rounds = 0;
  double wall_s = 0, compute_s = 0, push_s = 0, wait_s = 0, pull_s = 0;
  double boundary_s = 0, blocked_s = 0, blocked_wan_s = 0;
  // 1 - (time blocked on a round waiting for the WAN) / wall: the fraction of wall time not
  // waiting for the WAN (the round boundary's LAN work counts as not waiting: a site with
  // no peers does it too).
  double utilisation = 0;
  double compute_fraction = 0;  // compute / wall: the headline; LAN and merges count against it
  double wait_fraction = 0;     // blocked_wan / wall
  size_t rounds_waited = 0;     // rounds whose own wait for the WAN took > 1 ms
  double mean_commit_latency_s = -1, max_commit_latency_s = -1;  // over committed rounds
};
// Sums the rounds after the first `skip` (start-up: the first rounds fill the pipeline).
LoadSummary Summarize(const std::vector<RoundTiming>& rounds, size_t skip);

struct SiteOptions {
  std::string job;
  std::string client_name;     // the idempotency keys' site part
  double round_seconds = 3.0;  // emulated compute per round
  int rounds = 10;
  uint64_t tokens_per_round = 1;  // the merge weight (equal sites: equal tokens)
  int poll_ms = 50;      // how often a waiting round asks the shards again (as isthmus-worker)
  bool overlap = false;  // end rounds in the background (isthmus-worker --overlap)
  // Pull by replay (isthmus-worker --pull-by-replay, its default): the rounds committed
  // since the last pull as encoded deltas, replayed here (ops/codec_replica.h).
  bool pull_by_replay = false;
  // Encode the deltas here, with error feedback, and push the encoded bytes
  // (codec::FeedbackEncoder, docs/SYNC.md "Deltas encoded by the worker"), on this many
  // threads; 0: push fp32 deltas for the shards to encode.
  int encode_threads = 0;
  // Threads of the host boundary's passes (HostPasses::threads; 0: one per core).
  int pass_threads = 0;
  int steps_per_round = 30;  // emulated step boundaries per round (where merges happen)
  // With overlap: when a round's pulled state is merged (isthmus-worker
  // --merge-after-steps, --merge-wait; by default no earlier than a tenth of the round).
  MergePolicy merge;
};

// Opens a fresh connection to shard i (the watcher thread needs its own).
using ConnectFn = std::function<Result<std::unique_ptr<ShardClient>>(size_t shard)>;
// Opens the site client the rounds go through.
using ConnectSiteFn = std::function<Result<std::unique_ptr<SiteClient>>()>;

class SyntheticSite {
 public:
  SyntheticSite(size_t shards, ConnectFn connect, ConnectSiteFn connect_site, SiteOptions options);
  ~SyntheticSite();

  // Connects, pulls the job once (the live weights start from it, and the site learns which
  // shard holds which tensor), and checks the recorded deltas name exactly the job's
  // tensors with the same shapes.
  Status Prepare(const RecordedDeltas& deltas);
  // Runs options.rounds rounds, replaying deltas.rounds[(r - 1) % size] (added to the live
  // weights at the end of the round's steps), then completes the last round in flight
  // (drain_s). Fails on the first shard error (named).
  Result<std::vector<RoundTiming>> Run(const RecordedDeltas& deltas);
  double drain_s() const { return drain_s_; }
  // The pulls by replay so far (null without SiteOptions::pull_by_replay).
  const codec::ReplayStats* replay_stats() const;
  // The site client (after Prepare): its pushed byte counters.
  const SiteClient* site() const { return site_.get(); }
  // The live weights (after Run: the merged state of the last round).
  const std::vector<Tensor>& live() const { return live_; }

 private:
  size_t shards_;
  ConnectFn connect_;
  ConnectSiteFn connect_site_;
  SiteOptions o_;
  std::unique_ptr<SiteClient> site_;
  std::vector<Tensor> live_;  // in the recorded deltas' tensor order
  std::unique_ptr<SiteRounds> rounds_;
  std::unique_ptr<HostLiveParams> params_;
  std::unique_ptr<RoundDriver> driver_;
  double drain_s_ = 0;
};

}  // namespace isthmus::wanload
