// The round driver: the end of a round (push the round's delta to the site's shards, wait
// while the site is too far ahead of the last cross-site commit, pull the merged state) as
// one piece of code for every kind of site rank: isthmus-worker (CPU and CUDA), the Python
// package's SiteRank and bench/wan's synthetic site. With overlap on, that work runs on a
// background thread while the caller trains the next round, and the pulled state is merged
// into the live weights at a step boundary with a correction for the local progress made
// meanwhile (docs/SYNC.md, "The overlapped round"):
//
//   end of round r:  delta_r = live - base          pushed in the background as round r
//                    live := base + delta_r ; base := live
//   pulled P arrives (at a step boundary during round r + 1):
//                    live := live + (P - base) ; base := P     (no step since: live := P)
//   end of round r + 1: delta_{r+1} = live - base = exactly the local progress of r + 1
//
// so the shards' copy of the model and the worker's live weights stay one delta apart, and
// nothing the worker trained is counted twice or lost. Bounded staleness stays: while a
// rank trains, at most K = sync.max_rounds_ahead of the rounds it finished are uncommitted,
// counting the one in flight (K = 0: the round in flight must commit before the next round
// trains, and only the pull overlaps).
//
// Pieces: RoundShards is the driver's view of the site's shards (SiteClient through
// SiteRounds; tests use fakes). LiveParams is the caller's weights: where they live and how
// the snapshot and the merge are computed (HostLiveParams for host memory; isthmus-worker
// has one over its compute backend, so that on a GPU the snapshot and the merge stay in
// device memory). RoundDriver runs one round at a time in the background ("depth 1").
//
// Threads: every RoundDriver method is for one caller thread (the training loop). The
// driver adds one thread of its own, "round-driver", which alone uses the RoundShards while a
// round is in flight (a SiteClient belongs to one thread at a time: the caller must not use
// it until busy() is false). LiveParams is only ever called from the caller's thread.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/site_client.h"
#include "common/status.h"
#include "common/tensor.h"

namespace isthmus {

// The site's shards, as the driver uses them (the calls of SiteClient of the same names).
// Called from the driver's thread only while a round is in flight.
class RoundShards {
 public:
  virtual ~RoundShards() = default;
  // Pushes round `round` to the shards s with s % world == rank, each with its idempotency
  // key for the round (a shard that has it answers duplicate).
  virtual Result<std::vector<ShardPush>> PushRound(uint64_t round, uint64_t tokens,
                                                   uint64_t compute_ms,
                                                   const std::vector<TensorView>& deltas, int rank,
                                                   int world) = 0;
  virtual Result<Staleness> CheckStaleness() = 0;
  virtual Result<std::vector<Tensor>> Pull() = 0;
  // A pulled state merged into the live weights (caller's thread, no round in flight): its
  // buffers may serve the next Pull. Default: dropped.
  virtual void Recycle(std::vector<Tensor> pulled) { (void)pulled; }
};

// RoundShards over a SiteClient (borrowed; its placement must be known: pulled or set).
class SiteRounds : public RoundShards {
 public:
  explicit SiteRounds(SiteClient& site) : site_(site) {}
  Result<std::vector<ShardPush>> PushRound(uint64_t round, uint64_t tokens, uint64_t compute_ms,
                                           const std::vector<TensorView>& deltas, int rank,
                                           int world) override {
    return site_.PushRound(round, tokens, compute_ms, deltas, rank, world);
  }
  Result<Staleness> CheckStaleness() override { return site_.CheckStaleness(); }
  Result<std::vector<Tensor>> Pull() override { return site_.Pull(); }
  void Recycle(std::vector<Tensor> pulled) override { site_.RecyclePulled(std::move(pulled)); }

 private:
  SiteClient& site_;
};

// The caller's live weights and the base of the round being trained. Every method runs on
// the caller's thread; tensors are host fp32, named as the job's.
class LiveParams {
 public:
  virtual ~LiveParams() = default;
  // The live tensors become the base (start-up, and after loading a state from elsewhere).
  virtual Status Reset() = 0;
  // The round's delta: live - base, as host tensors in a fixed order. Then live := base +
  // delta (the value a shard that adds the delta to base computes, bit for bit) and
  // base := live.
  virtual Result<std::vector<Tensor>> TakeDelta() = 0;
  // Merges the site's state: `pulled` holds every tensor (by name; null on a rank that gets
  // it from another, see isthmus-worker). progressed false (no step since the base was
  // taken): live := pulled exactly; true: live := live + (pulled - base), the local progress
  // kept on top of the new base. Then base := pulled. InvalidArgument (nothing changed) for
  // a missing or misshapen tensor.
  virtual Status Rebase(const std::vector<Tensor>* pulled, bool progressed) = 0;
  // Rebase, free to take the pulled tensors' buffers as its base in exchange for its own
  // buffers of the same sizes (whose values are then stale): what `pulled` holds afterwards
  // is only for recycling. Saves copying the pulled state into the base (341 MB a round in
  // full mode). Default: Rebase.
  virtual Status RebaseTaking(std::vector<Tensor>* pulled, bool progressed) {
    return Rebase(pulled, progressed);
  }
  // A delta TakeDelta returned that nothing needs any more (its round completed and no one
  // else holds it): its buffers may be reused by a later TakeDelta instead of fresh memory
  // that the kernel must zero (341 MB a round in full mode). Default: dropped.
  virtual void Recycle(std::vector<Tensor> delta) { (void)delta; }
};

// The host buffers of deltas handed back to a LiveParams (Recycle), by tensor index, for
// its next TakeDelta.
class DeltaBuffers {
 public:
  // A buffer of n floats for tensor i: a recycled one when there is one (no new memory; its
  // values are stale), else a fresh one.
  std::vector<float> Take(size_t i, size_t n);
  // Keeps the buffers of `delta`, its tensors in TakeDelta's order.
  void Keep(std::vector<Tensor> delta);
  // Takes the memory of a delta of tensors of these sizes (TakeDelta's order) now, zeroed,
  // where no buffer is kept: the first round's snapshot then writes into memory the kernel
  // has already handed over (341 MB in full mode) instead of taking it page by page.
  void Reserve(const std::vector<size_t>& sizes);

 private:
  std::vector<std::vector<float>> spare_;
};

// A live tensor in host memory, written in place by HostLiveParams.
struct LiveTensor {
  std::string name;
  std::vector<int64_t> shape;
  float* data = nullptr;  // NumElements(shape) floats, borrowed
};

// How HostLiveParams runs its passes: element-wise, so the values cannot depend on these.
// The tensors' values are cut into chunks of `chunk` values (a multiple of four keeps the
// streamed stores aligned) shared out among `threads` threads, the caller's among them
// (0: one per core, at most 8); less than two chunks of work run on the caller's alone. On
// a host whose cores are all busy (bench/wan's three sites and shards on two cores) a pass
// the caller shares with a helper gets about twice the CPU the scheduler gives one thread.
struct HostPasses {
  int threads = 0;
  size_t chunk = size_t{1} << 20;
};

// LiveParams over host memory: the caller's buffers (borrowed; they must outlive it), a
// base copy of its own and the buffers of a delta, taken at construction. The passes'
// helper threads live only while a pass runs.
class HostLiveParams : public LiveParams {
 public:
  explicit HostLiveParams(std::vector<LiveTensor> live, HostPasses passes = {});
  Status Reset() override;
  Result<std::vector<Tensor>> TakeDelta() override;
  Status Rebase(const std::vector<Tensor>* pulled, bool progressed) override;
  Status RebaseTaking(std::vector<Tensor>* pulled, bool progressed) override;
  void Recycle(std::vector<Tensor> delta) override { spare_.Keep(std::move(delta)); }

 private:
  // For each live tensor, the index of the pulled tensor of its name and shape.
  Result<std::vector<size_t>> Match(const std::vector<Tensor>* pulled) const;
  // pass(t, begin, end) over the values [begin, end) of every tensor t, as HostPasses says.
  void ForChunks(const std::function<void(size_t t, size_t begin, size_t end)>& pass) const;

  HostPasses passes_;
  std::vector<LiveTensor> live_;
  std::vector<std::vector<float>> base_;
  DeltaBuffers spare_;
};

struct RoundDriverOptions {
  // false: the round ends in the caller (push, wait, pull, merge), as synchronous code
  // would. true: EndRound returns once the round is handed to the background.
  bool overlap = false;
  // The site's rank: rank r pushes the shards s with s % world == r.
  int rank = 0, world = 1;
  // false: this rank pushes nothing (another pushes every shard: isthmus-worker
  // --encode-deltas pushes from rank 0 alone, which holds the residual).
  bool push = true;
  // This rank waits for the staleness bound and pulls (rank 0 of a site; the others only
  // push and get the pulled state from it, see LiveParams::Rebase).
  bool pull = true;
  // How often a waiting round asks the shards again; how long it may wait (0: for ever)
  // before the round fails with Timeout ("the WAN did not catch up").
  std::chrono::milliseconds poll{50};
  std::chrono::milliseconds wait_timeout{0};
  // Asked by the background thread: true ends a wait for the WAN at once (a stop: the push
  // and the pull still happen). Called from the driver's thread: must be thread-safe.
  std::function<bool()> stopping;
  // How the caller's thread waits for the round in flight: called (caller's thread) with a
  // predicate that is true once the wait may end; returns when it is, or an error. The
  // default sleeps on the driver. isthmus-worker's ranks poll it together (rank 0's answer
  // counts), so that no in-site collective waits minutes for rank 0.
  std::function<Status(const std::function<bool()>& done)> await;
  // Called on the caller's thread (once per round) when it waits on a round that waits
  // for the WAN, with the reason ("waiting for the WAN: 3 rounds ahead ...") and how long
  // the round's push took (it is done by then).
  std::function<void(const std::string& reason, double push_s)> on_wan_wait;
  // Called on the caller's thread with this rank's outcome of the round in flight before
  // its state is merged: all ranks of a site must agree (isthmus-worker shares every rank's
  // outcome here); a non-OK return fails the round. Default: the outcome itself.
  std::function<Status(const Status& mine)> agree;
  // true: limit() follows K as each round's shards report it; false: it stays as set
  // (set_limit). limit() decides whether EndRound waits for the commit (K = 0); where that
  // wait is collective (isthmus-worker's ranks, through `await`), every rank must decide it
  // from the same K, and a rank that only pushes hears K from other replies than rank 0.
  bool follow_limit = true;
  // A test hook: called on the background thread at "pushing" (before the push),
  // "pushed" (every shard of this rank took the round) and "pulled" (the state is pulled,
  // not yet handed over).
  std::function<void(const char* stage, uint64_t round)> fault;
};

// When an overlapped round's pulled state goes into the live weights: at a step boundary
// of the next round, no earlier than `after_steps` steps into it (so whenever the commit
// arrives before then, the merge step, and so the trajectory, does not depend on the WAN),
// and then as soon as it is done; with `wait`, at exactly that step, waiting for it there
// (every run reproducible, at the price of a stall when the WAN is slower). after_steps
// < 0: a tenth of the round's steps, at least 1 (the default); 0: on arrival.
// isthmus-worker --merge-after-steps / --merge-wait and bench/wan's sites use this.
struct MergePolicy {
  int after_steps = -1;
  bool wait = false;
  // The step of a round of `round_steps` steps at which the merge may happen (0: any).
  int64_t Step(int64_t round_steps) const {
    if (after_steps >= 0) return after_steps;
    return std::max<int64_t>(1, round_steps / 10);
  }
  // After `steps` steps of a round of `round_steps`: merge the round in flight now?
  // `busy`: a round is in flight; `ready`: it is done (for every rank alike).
  bool Now(int64_t steps, int64_t round_steps, bool busy, bool ready) const {
    const int64_t at = Step(round_steps);
    if (at == 0) return ready;
    if (wait) return busy && steps == at;
    return ready && steps >= at;
  }
};

// What the background part of a round did (push, wait, pull: seconds on the driver's
// thread) and what it cost the caller (blocked: seconds its thread waited for it).
struct RoundReport {
  uint64_t round = 0;             // 0: no round was completed
  std::vector<ShardPush> pushes;  // this rank's shards, in order
  bool pushed = false;            // every shard this rank pushes holds the round
  Staleness staleness;            // the last check of the wait (limit: K)
  double first_s = 0;             // its first stage (RoundInFlight::first: the worker's checkpoint)
  double push_s = 0, wait_s = 0, pull_s = 0;
  double blocked_s = 0;      // the caller waited for the round (any stage; without overlap
                             // from the hand-over: push_s + wait_s + pull_s at least)
  double blocked_wan_s = 0;  // of which while the round waited for the WAN (had to wait)
  bool waited = false;       // the round was too far ahead at least once: it waited
  bool merged = false;       // the pulled state went into the live weights
  std::chrono::steady_clock::time_point waited_from{}, waited_to{};  // the wait, if any
  std::chrono::steady_clock::time_point pushed_at{};                 // when the push was answered
};

// The round in flight as a checkpoint records it: restarting from it pushes the same round
// with the same idempotency keys.
struct RoundInFlight {
  uint64_t round = 0, tokens = 0, compute_ms = 0;
  std::shared_ptr<const std::vector<Tensor>> delta;  // immutable; shared with the thread
  // Run on the driver's thread before a byte of the round is pushed (isthmus-worker
  // --overlap writes the checkpoint that holds the round here, off the training thread);
  // an error fails the round with nothing pushed. Empty: nothing to run.
  std::function<Status()> first;
};

class RoundDriver {
 public:
  // `shards` and `params` are borrowed and must outlive the driver. `params` may be null for
  // callers that merge themselves (they use Start, Ready, AwaitBound and Wait only).
  RoundDriver(RoundShards& shards, LiveParams* params, RoundDriverOptions options);
  // Gives up the round in flight (a wait ends at once; a push or pull in progress finishes
  // within the shard client's bounds) and joins the thread.
  ~RoundDriver();
  RoundDriver(const RoundDriver&) = delete;
  RoundDriver& operator=(const RoundDriver&) = delete;

  // --- The round, with LiveParams -----------------------------------------------------
  // The end of round `round` at a step boundary: the round in flight (if any) is completed
  // first (Complete: waiting for it if need be), the delta is taken (LiveParams::TakeDelta),
  // `before_push` sees it (it may set the round's `first`, run in the background before the
  // push: isthmus-worker --overlap writes its checkpoint so; an error stops here and nothing
  // is pushed), and the round starts. Without overlap it is completed before
  // EndRound returns; with overlap and K = 0, EndRound returns once it has committed.
  // Returns the report of the round completed here (round 0: none), its blocked_s
  // including the wait for K = 0; errors: that round's failure (see failed()).
  Result<RoundReport> EndRound(uint64_t round, uint64_t tokens, uint64_t compute_ms,
                               const std::function<Status(RoundInFlight&)>& before_push = {});
  // After every optimizer step: the live weights moved since the base was taken.
  void Stepped() { progressed_ = true; }
  // Waits for the round in flight, has `agree` see its outcome, and merges its pulled state
  // (LiveParams::Rebase; progressed as Stepped said). Returns its report (round 0 when
  // nothing was in flight) or its failure, naming the round and the shard.
  Result<RoundReport> Complete();

  // --- The background round alone ------------------------------------------------------
  // Starts pushing `in` (its delta must not change) and then, on a pulling rank, waiting
  // within the bound and pulling. FailedPrecondition while a round is in flight.
  Status Start(RoundInFlight in);
  // Where the round in flight is: idle (none), pushing, waiting (for the WAN, or for the
  // other ranks' pushes), pulling, done.
  enum class Stage { kIdle, kPushing, kWaiting, kPulling, kDone };
  Stage stage() const;
  // True when a round is in flight and done (Wait will not block); Failed: and it failed.
  bool Ready() const;
  bool Failed() const;
  bool busy() const { return inflight_.has_value(); }
  // Blocks until the round in flight is past its wait for the WAN (pulling or done): with
  // K = 0, until it has committed. Returns the seconds it blocked (or the await error).
  Result<double> AwaitBound();
  // Blocks until the round in flight is done and returns its status, report and pulled
  // state (pulling ranks); the driver is then idle. Nothing in flight: OK, round 0.
  struct Outcome {
    Status status;
    RoundReport report;
    std::vector<Tensor> pulled;
  };
  Outcome Wait();
  // Gives up the wait for the WAN of the round in flight at once: the round fails
  // (Unavailable, "given up"), e.g. because another rank of the site failed.
  void Cancel();

  // The round in flight (nullopt when none), and the last round that failed before every
  // shard this rank pushes held it (nullopt when none): a checkpoint keeps it.
  const std::optional<RoundInFlight>& inflight() const { return inflight_; }
  const std::optional<RoundInFlight>& failed() const { return failed_; }
  void clear_failed() { failed_.reset(); }
  // K as last reported by the shards (set it from Hello before the first round), or as set
  // (options().follow_limit false).
  uint64_t limit() const { return limit_; }
  void set_limit(uint64_t limit) { limit_ = limit; }
  const RoundDriverOptions& options() const { return o_; }

 private:
  void Loop();                       // the driver's thread
  void RunRound(RoundInFlight& in);  // one round, on the driver's thread
  Status WaitForBound(const RoundInFlight& in, RoundReport& report);
  // Runs o_.await (or sleeps on cv_) until `done` (checked under mu_) holds; says once
  // why when the round waits for the WAN meanwhile.
  Status Block(const std::function<bool()>& done_locked);

  RoundShards& shards_;
  LiveParams* const params_;
  const RoundDriverOptions o_;

  // The caller's thread only.
  std::optional<RoundInFlight> inflight_;
  std::optional<RoundInFlight> failed_;
  const std::vector<Tensor>* taken_ = nullptr;  // the last delta EndRound took (Recycle)
  uint64_t limit_ = 0;
  bool progressed_ = false;
  bool said_wait_ = false;  // on_wan_wait was called for the round in flight
  // Without overlap: when EndRound handed the round over (Wait counts blocked_s from it).
  std::optional<std::chrono::steady_clock::time_point> blocked_from_;

  mutable std::mutex mu_;
  std::condition_variable cv_;         // signals every change of what mu_ guards
  std::optional<RoundInFlight> next_;  // GUARDED_BY(mu_): handed to the thread by Start
  Stage stage_ = Stage::kIdle;         // GUARDED_BY(mu_)
  std::string wait_reason_;            // GUARDED_BY(mu_): why the round waits (kWaiting)
  double push_s_ = 0;                  // GUARDED_BY(mu_): its push's seconds (kWaiting)
  Outcome outcome_;                    // GUARDED_BY(mu_): the round's outcome (kDone)
  bool cancel_ = false;                // GUARDED_BY(mu_): Cancel() for the round in flight
  bool quit_ = false;                  // GUARDED_BY(mu_): the destructor
  std::thread thread_;                 // last: started once the rest exists
};

}  // namespace isthmus
