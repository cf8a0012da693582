// A synthetic site for the WAN benchmark (bench/wan/run.sh): it plays one site's workers at
// a GPU's pace without a GPU. Each round it "computes" for a fixed time (a sleep standing
// for the H inner steps a GPU site runs in that time), then does what isthmus-worker does
// at a round boundary, against real shards: pushes the round's delta to every shard, waits
// while the site is more than K rounds ahead of the last commit, and pulls the merged
// state. The deltas are not made up: they are recorded from real training
// (bench/wan/record.sh) and replayed in order, cycling, so the codecs see real structure.
//
// Threads: Run() uses the clients it was given on the calling thread, plus one watcher
// thread with its own connections that timestamps each round's commit.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/client.h"
#include "common/status.h"
#include "common/tensor.h"

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

// One round as the synthetic site lived it (seconds).
struct RoundTiming {
  uint64_t round = 0;
  double compute_s = 0;  // the emulated inner steps
  double push_s = 0;     // pushing the delta to every shard (LAN)
  double wait_s = 0;     // waiting for the WAN: the site was too far ahead of the last commit
  double pull_s = 0;     // pulling the merged state (LAN)
  // From the end of this round's push to the moment every shard had committed it (the
  // round's exchange with every peer site, end to end); < 0 when it never committed
  // while the run lasted.
  double commit_latency_s = -1;
};

struct LoadSummary {
  size_t rounds = 0;
  double wall_s = 0, compute_s = 0, push_s = 0, wait_s = 0, pull_s = 0;
  // 1 - wait / wall: the fraction of wall time not spent waiting for the WAN (the round
  // boundary's LAN work, pushing and pulling, counts as not waiting: a site with no peers
  // does it too).
  double utilisation = 0;
  double compute_fraction = 0;  // compute / wall: stricter, the LAN work counts against it
  double wait_fraction = 0;     // wait / wall
  size_t rounds_waited = 0;     // rounds with any WAN wait (> 1 ms)
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
  int poll_ms = 50;  // how often a waiting site asks the shards again (as isthmus-worker)
};

// Opens a fresh connection to shard i (the watcher thread needs its own).
using ConnectFn = std::function<Result<std::unique_ptr<ShardClient>>(size_t shard)>;

class SyntheticSite {
 public:
  SyntheticSite(size_t shards, ConnectFn connect, SiteOptions options);

  // Connects, pulls the job once from every shard to learn which shard holds which tensor,
  // and checks the recorded deltas name exactly the job's tensors with the same shapes.
  Status Prepare(const RecordedDeltas& deltas);
  // Runs options.rounds rounds, replaying deltas.rounds[(r - 1) % size]. Fails on the
  // first shard error (named).
  Result<std::vector<RoundTiming>> Run(const RecordedDeltas& deltas);

 private:
  Status Push(uint64_t round, const std::vector<Tensor>& delta, uint64_t compute_ms);
  // Blocks while local - committed > max_rounds_ahead on any shard.
  Status WaitForWan();
  Status PullAll();

  size_t shards_;
  ConnectFn connect_;
  SiteOptions o_;
  std::vector<std::unique_ptr<ShardClient>> clients_;
  std::vector<std::vector<size_t>> placement_;  // per shard, indices into a delta's tensors
};

}  // namespace isthmus::wanload
