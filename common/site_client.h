// The site client: the stable API a worker rank of any framework uses to take part in a
// job through its site's shards. isthmus-worker and the Python package (worker/python)
// both use it, so the round protocol a rank speaks is written once.
//
// A site holds a job's tensors spread over its shards (common/sharding.h). A rank:
//   1. Connect()s to every shard (CURVE unless insecure_plaintext) and says Hello() with
//      the hash of its base model: a shard holding the job for another base refuses;
//   2. Pull()s the merged tensors (the union over shards), which also tells the client
//      which shard holds which tensor;
//   3. trains H steps, then PushRound()s the round's change of every tensor: each goes to
//      the shard that holds it, with the round number, the tokens trained and the compute
//      time; the idempotency key is "<job>/<client_name>/r<round>/s<shard>", so a retried
//      or redone round (after a crash) is applied at most once;
//   4. before the next round, WaitWithinStaleness(): while any shard's local round is more
//      than its max_rounds_ahead past its last cross-site commit, the site waits.
// Several ranks of one site split the shards: rank r pushes shard s when s % world == r
// (every rank holds the same averaged values, so any rank can push any shard).
//
// Errors are Status values: PermissionDenied (a key not allowed), FailedPrecondition (the
// job is held for another base model; a tensor on an unexpected shard), NotFound (no such
// job or tensor), InvalidArgument (bad tensors: the shard changed nothing), Unavailable (a
// shard down or unreachable: with the defaults a call gives up on a dead shard within
// 15 s, see common/client.h) and Timeout (a connected shard that did not answer in time);
// each message names the shard ("shard I (ENDPOINT)") and what to check. A call waits on
// its shards one after another, so the bounds are per shard it reaches. Threads: a
// SiteClient belongs to one thread at a time.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/client.h"
#include "common/keys.h"
#include "common/status.h"
#include "common/tensor.h"

namespace isthmus {

struct SiteOptions {
  std::string job = "default";
  std::vector<std::string> servers;             // shard worker endpoints, in shard order
  std::vector<std::string> server_public_keys;  // Z85: one per server, or one for all
  // The files those keys came from (the same count), read again after a failed handshake
  // (ClientOptions::server_key_file); empty: the keys only.
  std::vector<std::string> server_key_files;
  KeyPair client_keys;               // this rank's key pair (on the allowlist)
  bool insecure_plaintext = false;   // no CURVE: benchmarks and debugging only
  int timeout_ms = 30000;            // per attempt: time a connected shard has
  int connect_timeout_ms = 5000;     // per attempt: time to connect to a shard
  int retries = 2;                   // extra attempts after a timeout
  std::string client_name = "site";  // part of every idempotency key
  // Passed to every shard's ClientOptions::interrupted, and asked between the polls of
  // WaitWithinStaleness: true stops the call (Unavailable, "interrupted").
  std::function<bool()> interrupted;
};

// What PushRound did on one shard.
struct ShardPush {
  int shard = 0;
  std::string key;         // the idempotency key used
  bool duplicate = false;  // the shard had this round already: nothing applied twice
  uint64_t tensors = 0;    // tensors pushed to it
  RoundInfo rounds;        // the shard's rounds after the push
};

// The bounded-staleness state of the site: the shard furthest ahead of its last commit.
struct Staleness {
  bool too_far_ahead = false;  // the site must wait before its next round
  int shard = -1;              // the shard furthest ahead (-1: no shard answered)
  uint64_t rounds_ahead = 0;   // its local round minus its committed round
  uint64_t limit = 0;          // its max_rounds_ahead (0: every round must commit first)
  std::string reason;          // a sentence for logs when too_far_ahead
  // The lowest local round among the shards: every shard holds this site's rounds up to it
  // (a round pushed by several ranks is there once each rank's shards took it).
  uint64_t lowest_local_round = 0;
};

// How SiteClient::Pull gets one shard's tensors (the served state, as ShardClient::Pull
// returns it). Without one it pulls every tensor; ReplayPuller (ops/codec_replica.h)
// replays rounds from their encoded deltas instead.
class ShardPuller {
 public:
  virtual ~ShardPuller() = default;
  virtual Result<std::vector<Tensor>> Pull(size_t shard, ShardClient& client,
                                           const std::string& job) = 0;
  // Tensors a Pull returned that the caller is done with: their buffers may hold what
  // later pulls hand out, instead of fresh memory (341 MB a pull in full mode). Default:
  // dropped.
  virtual void Recycle(std::vector<Tensor> pulled) { (void)pulled; }
};

// How SiteClient::PushRound encodes a round's deltas itself when the shards said which
// pipelines to use (docs/SYNC.md, "Deltas encoded by the worker"): error feedback in this
// rank's own residual, so that a push carries the few MB the WAN will carry instead of the
// fp32 delta. codec::FeedbackEncoder (ops/codec_worker.h) is the implementation; the
// interface keeps common/ free of the codecs.
class DeltaEncoder {
 public:
  virtual ~DeltaEncoder() = default;
  // The encodings of round `round`'s `deltas` (one shard's share of the round), each with
  // the pipeline `pipelines` names for it, in the order of `deltas`; the views stay valid
  // until the next call of Encode for a later round. Encoding a tensor of a round a second
  // time (a retried push) gives the bytes of the first time, never feeding the delta into
  // the residual twice.
  virtual Result<std::vector<std::string_view>> Encode(
      uint64_t round, const std::vector<TensorView>& deltas,
      const std::map<std::string, std::string>& pipelines) = 0;
  // Every shard took round `round`: its residuals become the ones later rounds start from.
  virtual void Done(uint64_t round) = 0;
  // The pipelines an earlier attempt of round `round` encoded every one of `deltas` with,
  // when they were kept (a worker restarted in the middle of the round's push): true, with
  // them in `pipelines`. PushRound then encodes with these, without asking the shard, so
  // that a shard that took the round answers the same bytes as a duplicate and the residual
  // moves as it did. False: ask.
  virtual bool Kept(uint64_t round, const std::vector<TensorView>& deltas,
                    std::map<std::string, std::string>* pipelines) const {
    (void)round, (void)deltas, (void)pipelines;
    return false;
  }
};

class SiteClient {
 public:
  // Connects to every shard (lazily, as ShardClient does: a shard that is down shows up
  // as a Timeout on the first call). InvalidArgument for options that cannot work.
  static Result<std::unique_ptr<SiteClient>> Connect(const SiteOptions& options);

  // Hello to every shard as a worker with `base_hash` (empty: not checked). Returns one
  // HelloInfo per shard. NotFound when a shard has no such job.
  Result<std::vector<HelloInfo>> Hello(const std::string& base_hash);

  // Pulls every shard's tensors of the job and returns their union in shard order, and
  // records where each lives (placement()). FailedPrecondition when a tensor lives on
  // another shard than a placement given by SetPlacement says.
  Result<std::vector<Tensor>> Pull();
  // Tensors Pull returned, back for the puller to reuse their buffers (ShardPuller::Recycle);
  // without a puller they are dropped.
  void RecyclePulled(std::vector<Tensor> pulled) {
    if (puller_) puller_->Recycle(std::move(pulled));
  }
  // As Pull, without copying tensor data out of the received messages: one PullView per
  // shard, in shard order. (Always every tensor: the puller is for Pull.)
  Result<std::vector<PullView>> PullInPlace();
  // Pull gets each shard's tensors through `puller` from now on (null: every tensor).
  void SetPuller(std::unique_ptr<ShardPuller> puller) { puller_ = std::move(puller); }
  ShardPuller* puller() const { return puller_.get(); }
  // With an encoder, PushRound asks each shard for the round's pipelines right before it
  // encodes (a Hello; not when the encoder kept them from an earlier attempt of the round)
  // and sends the deltas as `encoder`'s bytes (as fp32 those whose pipeline is "dense", and
  // all of a round the shard answers another round for: it holds this one already). Null:
  // fp32.
  void SetEncoder(std::unique_ptr<DeltaEncoder> encoder) { encoder_ = std::move(encoder); }
  DeltaEncoder* encoder() const { return encoder_.get(); }
  // Bytes this client's pushes carried, and the fp32 bytes of the deltas they stand for.
  uint64_t pushed_bytes() const { return pushed_bytes_; }
  uint64_t pushed_raw_bytes() const { return pushed_raw_bytes_; }

  // Tensor name -> index of the shard that holds it (from the last pull, or as set).
  const std::map<std::string, int>& placement() const { return placement_; }
  // Tells the client where tensors live without pulling (a rank that does not pull can
  // compute it with PlaceTensors from the job's tensor list, as isthmusctl does).
  void SetPlacement(std::map<std::string, int> placement) {
    placement_ = std::move(placement);
    shapes_.clear();
  }
  // The placement isthmusctl gives a job of these tensors over `num_shards` shards.
  static std::map<std::string, int> PlaceTensors(const std::vector<TensorView>& tensors,
                                                 int num_shards);

  // Pushes round `round`'s change of each tensor to the shard holding it: the shards s
  // with s % world == rank, each with the deltas it holds. `tokens`: tokens the site
  // trained this round; `compute_ms`: its compute time (the shards size adaptive codecs
  // by it, 0 = unknown).
  // Everything is checked before anything is sent: every delta must be a tensor of the
  // placement (NotFound otherwise), of the job's shape when a pull told it (InvalidArgument),
  // and each shard this rank pushes must get all of its tensors (InvalidArgument naming the
  // missing ones: the change of a tensor that did not change is zeros).
  // Not atomic across shards: the shards are pushed one after another, and a refusal stops
  // the push with an error naming the shard and which shards already hold the round. Such a
  // push is completed by calling PushRound again for the same round with the same deltas:
  // each shard's idempotency key makes a shard that has the round answer "duplicate" (a
  // different content under the same key is refused, FailedPrecondition).
  Result<std::vector<ShardPush>> PushRound(uint64_t round, uint64_t tokens, uint64_t compute_ms,
                                           const std::vector<TensorView>& deltas, int rank = 0,
                                           int world = 1);

  // Asks every shard for its rounds (a Hello each, with the base hash of the last Hello).
  Result<Staleness> CheckStaleness();
  // Polls CheckStaleness every `poll` until the site may go on. Returns the last state:
  // too_far_ahead is still true when `timeout` passed or `stop` became true first;
  // Unavailable when options().interrupted said stop.
  Result<Staleness> WaitWithinStaleness(
      std::chrono::milliseconds timeout, const std::atomic<bool>* stop = nullptr,
      std::chrono::milliseconds poll = std::chrono::milliseconds(50));

  size_t num_shards() const { return shards_.size(); }
  ShardClient& shard(size_t i) { return *shards_.at(i); }
  const SiteOptions& options() const { return options_; }
  // "<job>/<client_name>/r<round>/s<shard>": the idempotency key PushRound uses.
  std::string PushKey(uint64_t round, int shard) const;

 private:
  std::unique_ptr<ShardPuller> puller_;
  std::unique_ptr<DeltaEncoder> encoder_;
  uint64_t pushed_bytes_ = 0, pushed_raw_bytes_ = 0;
  explicit SiteClient(SiteOptions options) : options_(std::move(options)) {}
  // "shard I (ENDPOINT)": how messages name a shard.
  std::string Where(size_t i) const;
  // `status` with its message prefixed by Where(i).
  Status AtShard(size_t i, const Status& status) const;
  // Sets `encoded` on the deltas for shard `shard` whose pipelines of `round` the encoder
  // kept, or else the shard gives when asked now (a Hello); none without an encoder, or when
  // the shard answers for another round (it holds this one already).
  Status EncodeFor(size_t shard, uint64_t round, uint64_t compute_ms,
                   std::vector<TensorView>& deltas);
  // Records that `name` lives on shard `i`, checking it against the placement set.
  Status Place(const std::string& name, size_t i, std::map<std::string, int>& seen) const;

  SiteOptions options_;
  std::vector<std::unique_ptr<ShardClient>> shards_;
  std::map<std::string, int> placement_;
  std::map<std::string, std::vector<int64_t>> shapes_;  // from the last pull (empty: unknown)
  std::string base_hash_;
};

}  // namespace isthmus
