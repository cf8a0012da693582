// The round protocol of one shard (DESIGN.md "The round protocol", docs/SYNC.md): stages a
// site's round delta as its workers push it, closes the round by encoding it with error
// feedback into the outbox, holds peers' deltas in the inbox, commits a round once every
// site's delta for it is held (token-weighted merge in site-name order, then Nesterov
// momentum), and serves committed state plus the known uncommitted deltas to workers.
// Every state change is one Store write batch; memory follows only after it succeeded.
// Who takes part, and how that changes, is the MembershipProtocol's (membership.h), which
// the engine owns and serves as its MembershipHost.
//
// Threads: one thread (the shard's event loop) calls everything; nothing is locked.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/status.h"
#include "ops/codec.h"
#include "server/config/sync_options.h"
#include "server/storage/records.h"
#include "server/storage/store.h"
#include "server/sync/digest.h"
#include "server/sync/membership.h"
#include "server/sync/peer_io.h"
#include "server/sync/tensor_pool.h"

namespace isthmus {

// One tensor of a worker's round push: the values to add, and the shape the worker gave
// them (the engine checks it against the job's: the one check of a synced push's tensors).
// A worker that encodes its delta itself (error feedback in its own residual; docs/SYNC.md,
// "Deltas encoded by the worker") sets `encoded` to the codec's bytes (ops/codec.h) and
// leaves `delta` empty: the close sends those bytes as they are and leaves the shard's
// residual of the tensor as it was.
struct SyncPushTensor {
  std::string name;
  std::span<const float> delta;
  std::vector<int64_t> shape;
  std::optional<std::string_view> encoded = std::nullopt;
};

// A staged delta of one tensor in memory: fp32 values, or the bytes a worker encoded.
struct StagedDelta {
  std::span<const float> delta;
  std::optional<std::string_view> encoded = std::nullopt;
};
using StagedDeltas = std::map<std::string, StagedDelta>;

// What a worker needs to reach a shard's served state by replaying rounds from their
// encoded deltas (SyncEngine::Replay; docs/SYNC.md, "Pulling by replay").
struct ReplayPlan {
  struct Delta {
    std::string site;
    uint64_t tokens = 0;  // the merge weight's input, as the commit (or view) uses it
    std::shared_ptr<const EncodedDelta> delta;
  };
  struct Round {
    uint64_t round = 0;
    std::vector<Delta> deltas;  // in site-name order: the merge's order
  };
  uint64_t base_round = 0;  // the committed round the replay starts from
  // The whole committed state of base_round, when the worker's could not be used (it has
  // none, or its round's deltas are gone, or the membership changed since): theta, and the
  // momentum when the outer optimiser keeps one. Empty otherwise.
  bool whole = false;
  std::map<std::string, SyncTensor> theta;
  std::map<std::string, std::shared_ptr<const std::vector<float>>> momentum;
  std::vector<Round> committed;  // base_round + 1 .. the committed round, in order
  std::vector<Round> view;       // the optimistic view's uncommitted rounds, in order
  uint64_t committed_round = 0;
  std::string digest;  // of committed_round
  std::string check;   // the same state's fast check (StateCheck)
  Membership members;  // the committed rounds' (and the digest's) membership
  float outer_lr = 1.0f;
  float outer_momentum = 0.0f;
};

struct SyncPushResult {
  bool duplicate = false;  // the round was already closed: nothing changed
  bool closed = false;     // this push completed the round, and it was closed
  // This push completed the round and the round is durable, but its close (and the commits
  // after it) was left to SyncEngine::RunDeferred (SetDeferRoundWork).
  bool close_pending = false;
  uint64_t version = 0;  // the job's served version after the push
};

// Where a job stands (isthmusctl sync status).
struct SyncJobStatus {
  std::string job;
  std::string site;
  uint64_t local_round = 0;      // last round this site closed
  uint64_t committed_round = 0;  // last round committed on this shard
  uint64_t staged_round = 0;     // round being pushed now (0: none)
  uint64_t staged_tensors = 0;   // tensors of staged_round pushed so far
  uint64_t tensor_count = 0;
  std::map<std::string, uint64_t> held;   // site -> highest contiguous round held/committed
  std::map<std::string, uint64_t> acked;  // peer -> highest round of ours it acknowledged
  uint64_t bytes_encoded = 0;             // total encoded bytes of this site's deltas
  uint64_t raw_bytes = 0;                 // the same deltas as fp32
  double compression_ratio = 0;           // raw / encoded (0 before any round)
  // Pipeline text -> number of tensors that used it in the last closed round.
  std::map<std::string, uint64_t> pipelines;
  uint64_t version = 0;  // served version (increases whenever pulled values change)
  Membership members;    // who merges into the rounds from members.from_round on
  std::map<std::string, uint64_t> removed;  // site -> first round without it
  std::map<std::string, uint64_t> joined;   // site -> first round it merged into, if it joined
  std::optional<MembershipChange> pending;  // a change agreed to or coordinated here
  std::string change_note;                  // outcome of the last change seen here (memory only)
  bool catching_up = false;                 // asking a member for its committed state
  bool draining = false;                    // leaving once this site's last round commits
  // Round work left after a reply (SetDeferRoundWork) that has not run yet or failed and
  // waits for its retry; how often it failed since the start and the last failure (cleared
  // once it succeeds). Memory only.
  bool round_work_pending = false;
  uint64_t round_work_failures = 0;
  std::string round_work_error;
};

class SyncEngine : public DeltaSource, public DeltaSink, private MembershipHost {
 public:
  // Checks options (NormalizeSyncOptions) and makes an engine with no jobs. `store` is not owned
  // and must outlive the engine (or be replaced with SetStore).
  static Result<std::unique_ptr<SyncEngine>> Create(Store* store, SyncOptions options);

  // Forgets every job and uses `store` from now on (after a snapshot restore).
  void Reset(Store* store);
  // Waits for the state writes under way (SyncOptions::background_state_writes) and drops
  // them unapplied; call it before the store is closed under the engine.
  void DropStateWrites();
  // Waits for the state writes under way and applies them (tests; a commit that is due to
  // write the state while one is still under way does this itself).
  Status FinishStateWrites();

  // Whether `job` has durable sync state in the store (it was created, joined or converted
  // while sync was on). A job without it is a plain job: AttachJob would start its rounds
  // from its current tensors, which the shard does only when told to
  // (sync.convert_plain_jobs; docs/SYNC.md, "Jobs created without sync").
  Result<bool> HasSyncState(const std::string& job) const;

  // Takes part in sync for `job`, whose committed tensors (as in the store's kTensors
  // column) are `tensors`. Loads the job's durable sync state (none for a plain job; then
  // its round 0 is `tensors` and `base_version` the served version, written at once) and
  // commits any round that became committable before a crash. Digest of round 0 = the
  // initial state.
  Status AttachJob(const std::string& job, std::map<std::string, SyncTensor> tensors,
                   uint64_t base_version);
  // A job being created, in two steps so that creating it is one write: AddNewJob puts its
  // initial sync record and round-0 digest into `batch` (the caller's batch that creates
  // the job) and changes nothing else; after that batch is durable, AdoptNewJob takes the
  // job into memory (it cannot fail).
  void AddNewJob(const std::string& job, const std::map<std::string, SyncTensor>& tensors,
                 uint64_t version, WriteBatch* batch) const;
  void AdoptNewJob(const std::string& job, std::map<std::string, SyncTensor> tensors,
                   uint64_t version);
  bool HasJob(const std::string& job) const { return jobs_.count(job) > 0; }
  // How the commits' buffers were served (fresh or recycled; TensorPool).
  TensorPool::Stats pool_stats() const { return pool_->stats(); }
  bool has_peers() const { return !options_.peer_sites.empty(); }
  const SyncOptions& options() const { return options_; }

  // Round work off the request path. With it on (the shard server turns it on), a push that
  // completes its round is answered once the round's deltas are durable (staged, in one
  // batch with the caller's records), and a received delta once it is held: the round's
  // close (encode with error feedback, residual, outbox) and the commits that become
  // possible are left to RunDeferred, which the server's loop calls right after it has sent
  // the reply and before it reads the next request. Off (the default), PushRound and
  // ReceiveDelta do that work before they return. The arithmetic and its order are the same
  // either way, so digests do not depend on it, and a crash between the reply and the
  // deferred work loses nothing: AttachJob closes a complete stage and commits what is
  // committable.
  void SetDeferRoundWork(bool on) { defer_ = on; }
  // Whether deferred work waits for RunDeferred.
  bool HasDeferred() const { return !deferred_.empty(); }
  // Closes every complete staged round and commits what can be committed, for the jobs whose
  // work was deferred. A job whose work fails stays pending and is retried by a later call
  // (at once when new work was deferred since, otherwise after a backoff of 1 s doubling up
  // to 30 s); returns the first failure. A push for the next round runs a job's pending
  // close first.
  Status RunDeferred();
  // Milliseconds until RunDeferred retries failed work (for the caller's poll timeout); -1
  // when nothing waits.
  int DeferredRetryMs() const;

  // A worker's push for round `round` (>= 1) of `job`, `tokens` = the site's tokens of the
  // round. Rounds <= the last closed round are answered as duplicates. Refuses
  // (FailedPrecondition, saying why) a round past local + 1, a round that would put the site
  // more than the hard cap ahead of the last commit, and a tensor pushed twice for a round;
  // NotFound for an unknown tensor, InvalidArgument for a wrong shape or size or a delta
  // that is not finite. `batch` may hold the
  // caller's own ops (its idempotency record): they are written in the same batch, and
  // only if everything succeeded. The push that completes the round closes it (encode,
  // residual, outbox), and the commits that become possible follow, each its own batch.
  // `compute_ms`: the pushing worker's compute time for the round (0 = unknown); the
  // largest of a round's pushes sizes adaptive codecs at its close. `keepalive`, when set,
  // keeps the memory of `tensors`' deltas valid while it lives: the engine may hold it until
  // the round's close and encode from that memory instead of reading the staged deltas back
  // from the store.
  Result<SyncPushResult> PushRound(const std::string& job, uint64_t round, uint64_t tokens,
                                   const std::vector<SyncPushTensor>& tensors, WriteBatch& batch,
                                   uint64_t compute_ms = 0,
                                   std::shared_ptr<const void> keepalive = nullptr);

  // The pipeline each tensor's delta of round `round` would be encoded with if that round
  // closed now: adaptive sizing from what the engine knows now, "defer" for a streamed
  // fragment that is not due. What a worker that encodes its own deltas uses (docs/SYNC.md,
  // "Deltas encoded by the worker"); the close of a round the worker encoded takes the
  // worker's bytes as they are, whatever this says by then. `compute_ms` (not 0): the
  // round's compute time, as its push will report it, sizes it.
  Result<std::map<std::string, std::string>> RoundPipelines(const std::string& job, uint64_t round,
                                                            uint64_t compute_ms = 0) const;

  // Round-less add (push with round 0) for a job that syncs with no peers: theta += delta
  // at once. FailedPrecondition when peers are configured.
  Result<uint64_t> AddNow(const std::string& job, const std::vector<SyncPushTensor>& tensors,
                          WriteBatch& batch);

  // What a worker pulls: the committed tensors moved, for every known uncommitted round in
  // order, by the outer step its commit will take, with the token-weighted merge of the
  // deltas held so far (over the sites held) in place of the full merge and the outer
  // momentum carried along (docs/SYNC.md, "Optimistic view"). Shared buffers, valid as
  // long as the caller keeps them. Recomputed only after a change.
  Result<std::map<std::string, SyncTensor>> View(const std::string& job);
  // The committed tensors alone.
  Result<std::map<std::string, SyncTensor>> Committed(const std::string& job) const;
  // What a worker that holds committed round `from` with digest `digest` (empty: it holds
  // none) needs to reach View(job) by replay: the deltas of the rounds committed since and
  // those the view adds, or the whole committed state to start from when `from`'s cannot be
  // used (ReplayPlan::whole). Deltas are read from the store (sync.replay_rounds keeps
  // committed rounds' deltas).
  Result<ReplayPlan> Replay(const std::string& job, uint64_t from, const std::string& digest);

  uint64_t Version(const std::string& job) const;
  // The last round this site closed (its outbox's highest round).
  uint64_t LocalRound(const std::string& job) const;
  // What worker replies report as the local round (RoundStatus::local_round): LocalRound,
  // or the staged round once all its tensors are durable and only its close is pending
  // (the close is certain: RunDeferred, or AttachJob after a crash, does it).
  uint64_t PushedRound(const std::string& job) const;
  uint64_t CommittedRound(const std::string& job) const;
  uint64_t max_rounds_ahead() const { return options_.max_rounds_ahead; }
  uint64_t hard_cap() const { return hard_cap_; }

  Result<SyncJobStatus> JobStatus(const std::string& job) const;
  // Committed-round digests (hex SHA-256) of rounds from_round.. (at most `max`), in order.
  Result<std::vector<std::pair<uint64_t, std::string>>> Digests(const std::string& job,
                                                                uint64_t from_round,
                                                                uint64_t max) const;

  // Who takes part and how that changes: removal, leave, join, catch-up (membership.h).
  MembershipProtocol& membership() { return membership_; }
  const MembershipProtocol& membership() const { return membership_; }
  Result<Membership> Members(const std::string& job) const;
  // What the engine needs of the shard for joins: a job's base hash (for the image a
  // member hands out), and the creation of a job from an image: the shard adds its own
  // records (job, tensors) to `batch`, writes it, and takes the job into its registry.
  struct JobHooks {
    std::function<std::string(const std::string& job)> base_hash;
    std::function<Status(const std::string& job, const std::string& base_hash,
                         const std::map<std::string, SyncTensor>& tensors, uint64_t version,
                         WriteBatch& batch)>
        install;
  };
  void SetJobHooks(JobHooks hooks) { hooks_ = std::move(hooks); }

  // Closes whose encode ran while their stage was written (StartEarlyEncode), since start.
  uint64_t EarlyEncodes() const { return early_encodes_; }

  // SyncJobs() and the jobs whose join failed (their status says why).
  std::vector<std::string> StatusJobs() const;

  // DeltaSource.
  std::vector<std::string> SyncJobs() const override;
  uint64_t OutboxHighRound(const std::string& job) const override;
  Result<std::shared_ptr<const EncodedDelta>> OutboxDelta(const std::string& job,
                                                          uint64_t round) override;
  void OnPeerAck(const std::string& peer_site, const std::string& job,
                 uint64_t held_round) override;
  void OnLinkBandwidth(const std::string& peer_site, double bytes_per_second) override;
  uint64_t FirstRoundTo(const std::string& peer_site, const std::string& job) const override;
  std::vector<MembershipRequest> MembershipRequests(const std::string& peer_site) override;
  void OnMembershipAnswer(const std::string& peer_site, const MembershipRequest& request,
                          const MembershipAnswer& answer) override;
  void OnRemovedNotice(const std::string& peer_site, const std::string& job,
                       uint64_t removed_from) override;

  // DeltaSink.
  Result<uint64_t> ReceiveDelta(const std::string& from_site, const EncodedDelta& delta) override;
  uint64_t HeldFrom(const std::string& site, const std::string& job) const override;
  Result<std::vector<std::pair<std::string, std::vector<int64_t>>>> JobTensors(
      const std::string& job) const override;
  MembershipAnswer OnMembershipRequest(const std::string& from_site,
                                       const MembershipRequest& request) override;
  std::string RefusesPeer(const std::string& site, const std::string& job) const override;
  uint64_t RemovedFrom(const std::string& site, const std::string& job) const override;

  // Reads a job's committed tensors as the shard stores them (TensorRecord, raw fp32 in
  // kTensors). Corruption when a record or size is bad.
  static Result<std::map<std::string, SyncTensor>> ReadTensors(Store* store,
                                                               const std::string& job);

 private:
  // The durable fields are the SyncRecord (storage/records.h): a batch writes a copy of
  // them with its changes, and memory takes them once the batch is durable.
  // A round close's inputs and outputs: one error-feedback task per tensor (in theta's
  // order), with what the close writes besides the encoded bytes. `encoder`, when started,
  // runs the tasks (StartEarlyEncode) and is joined before they are read or freed.
  struct CloseWork {
    uint64_t round = 0;
    bool write_residuals = false;
    std::vector<std::optional<std::vector<float>>> reads;  // staged deltas read back
    // Per tensor in theta's order: the bytes its worker encoded, or none when the close
    // encodes it (the next of `tasks`, which hold those tensors only, in the same order).
    std::vector<std::optional<std::string>> given;
    std::vector<codec::FeedbackTask> tasks;
    std::map<std::string, uint64_t> pipelines;
    uint64_t raw = 0;
    std::thread encoder;
    CloseWork() = default;
    CloseWork(const CloseWork&) = delete;
    CloseWork& operator=(const CloseWork&) = delete;
    ~CloseWork();
  };
  // A checkpoint commit's state written away from the event loop
  // (SyncOptions::background_state_writes): the rows of `tensors` at round `round` are
  // filled on `filler`, then applied with the record that names round `round` the stored
  // state. Until then the record names the earlier state and the rounds' deltas stay.
  struct StateWrite {
    uint64_t round = 0;
    std::set<std::string> tensors;
    std::map<std::string, SyncTensor> theta;  // round `round`'s, held while the rows are
    std::map<std::string, std::shared_ptr<const std::vector<float>>> momentum;
    WriteBatch rows;
    std::unique_ptr<StagedWrite> staged;
    std::thread filler;
    std::atomic<bool> filled{false};
    StateWrite() = default;
    StateWrite(const StateWrite&) = delete;
    StateWrite& operator=(const StateWrite&) = delete;
    ~StateWrite();
  };
  struct Job : SyncRecord {
    std::map<std::string, SyncTensor> theta;  // committed
    // Tensors whose theta or momentum changed since the store last took them (rounds after
    // state_round): the next checkpoint writes them.
    std::set<std::string> unsaved;
    std::map<std::string, std::shared_ptr<const std::vector<float>>> momentum;
    // site -> uncommitted round held -> its tokens (own site: rounds closed, uncommitted).
    std::map<std::string, std::map<uint64_t, uint64_t>> inbox;
    // Round timing for adaptive sizing (memory only: a restart starts from the config).
    // staged_compute_ms: largest compute time reported by the staged round's pushes.
    std::optional<std::chrono::steady_clock::time_point> last_close;
    // Close time of each uncommitted round of this site (for SyncOptions::on_commit).
    std::map<uint64_t, std::chrono::steady_clock::time_point> closed_at;
    double last_round_seconds = 0;
    uint64_t staged_compute_ms = 0;
    // Staged deltas of the open round that are still in memory (pushes that came with a
    // keepalive, which staged_keep holds): the close encodes from them instead of reading
    // the staged copies back from the store. Cleared at the close.
    StagedDeltas staged_mem;
    std::vector<std::shared_ptr<const void>> staged_keep;
    // Error-feedback residuals (the durable copies are kState rows), read from the store at
    // the first close after a start and kept since; residual_next holds buffers of the same
    // sizes that a close writes the new residuals into, swapped in once the close is durable.
    std::map<std::string, std::vector<float>> residual, residual_next;
    // Tensors whose residual here may differ from its stored row: those the shard encoded
    // since the rows were written (a close, or the recomputation after a start). A close
    // that writes the residuals writes these and leaves the rows of tensors that only their
    // workers encoded, which have not changed (341 MB a round in full mode otherwise).
    std::set<std::string> residual_changed;
    // The close of the round just staged, encoding since its last push (StartEarlyEncode).
    std::unique_ptr<CloseWork> early;
    // The state being written (background_state_writes); its tensors are not in `unsaved`.
    std::unique_ptr<StateWrite> state_write;
    // Deferred round work that failed (RunDeferred): how often, and the last failure while
    // it is still to retry (memory only, for metrics and JobStatus).
    uint64_t round_work_failures = 0;
    std::string round_work_error;
    // Cached optimistic view; empty when stale.
    std::optional<std::map<std::string, SyncTensor>> view;
    // The fast check (StateCheck) of the committed state whose digest is check_of: made at
    // the first pull by replay that needs it, kept until the state changes.
    std::string check, check_of;
  };

  SyncEngine(Store* store, SyncOptions options);
  Result<Job*> FindJob(const std::string& job);
  Result<const Job*> FindJob(const std::string& job) const;
  // The state of a job that has just been created: `tensors` committed at round 0 as
  // version `version`, zero outer momentum when the outer optimiser has one.
  Job NewJob(std::map<std::string, SyncTensor> tensors, uint64_t version) const;
  // Sizes the commit's buffer pool for the jobs with `added` (as job `name`) among them;
  // with peers, moves `added`'s state into the pool's buffers and fills the pool for its
  // first commit.
  void SizePool(const std::string& name, Job& added);
  // The sizes of the buffers one commit of `j` takes from the pool.
  std::vector<size_t> CommitBuffers(const Job& j) const;
  // LoadResiduals at a job's start, with peers; a failure is logged and left to the close.
  void LoadResidualsAtStart(const std::string& name, Job& j);
  // Checks a push's tensors against the job's: each known, of the job's shape and size,
  // named once. Returns their names.
  Result<std::set<std::string>> CheckPushed(const std::string& name, const Job& j,
                                            const std::vector<SyncPushTensor>& tensors) const;
  std::vector<std::string> AllSites() const;  // the configured sites (sync.peers + own), sorted
  // Member sites other than this one.
  std::vector<std::string> MemberPeers(const Job& j) const;
  bool keeps_momentum() const { return static_cast<float>(options_.outer_momentum) != 0.0f; }

  // MembershipHost.
  std::vector<std::string> Jobs() const override;
  const SyncRecord* Record(const std::string& job) const override;
  Status WritePending(const std::string& job,
                      const std::optional<MembershipChange>& pending) override;
  Status ApplyMembership(const std::string& job, const SyncRecord& next,
                         const std::vector<std::string>& gone) override;
  Status CommitReady(const std::string& job) override;
  Result<std::shared_ptr<const JobImage>> Image(const std::string& job) const override;
  Result<std::optional<std::string>> Digest(const std::string& job, uint64_t round) const override;
  Status InstallImage(const std::string& job, const JobImage& image,
                      const MembershipChange& change) override;
  Status AdoptImage(const std::string& job, const JobImage& image) override;

  uint64_t HeldContiguous(const Job& j, const std::string& site) const;
  // Whether the staged round holds every tensor (durably): only its close is missing.
  static bool StageComplete(const Job& j) {
    return j.staged_round != 0 && j.staged.size() == j.theta.size();
  }
  // j.residual from the store once after a start: the residual rows (of round
  // j.residual_round) and the closes since, recomputed from their staged deltas and this
  // site's encoded deltas. Corruption naming the round when one of them is missing.
  Status LoadResiduals(const std::string& name, Job& j);
  // The tasks of round `round`'s close (pipelines chosen, residual buffers sized), the
  // staged deltas taken from `staged` when given, else from j.staged_mem, else the store.
  Result<std::unique_ptr<CloseWork>> PrepareClose(const std::string& name, Job& j, uint64_t round,
                                                  uint64_t compute_ms, const StagedDeltas* staged);
  // Called by the push that completes round `round` with every staged delta in memory,
  // before its stage is written: starts the close's encode on its own threads (j.early),
  // which CloseRound then waits for instead of encoding.
  void StartEarlyEncode(const std::string& name, Job& j, uint64_t round, uint64_t compute_ms,
                        const std::vector<SyncPushTensor>& tensors);
  // Encodes the staged round and writes it to the outbox. `pushed`: the round's deltas in
  // memory when one push brings them all (nothing was staged on disk); they are then
  // written with `batch` (the push's own records) in the close's single write batch.
  // Without it the staged deltas are taken from j.staged_mem where they are still in
  // memory and read from the store otherwise, and their staged copies are deleted.
  Status CloseRound(const std::string& name, Job& j, const StagedDeltas* pushed = nullptr,
                    WriteBatch* batch = nullptr);
  // CommitReady now, or (SetDeferRoundWork) at the next RunDeferred.
  Status CommitReadyOrDefer(const std::string& name, Job& j);
  // A complete stage's close, then the commits: the work RunDeferred does for a job.
  Status FinishRoundWork(const std::string& name, Job& j);
  // Commits what can be committed (CommitRounds), then lets the membership protocol start
  // a draining leave that has become possible.
  Status CommitReady(const std::string& name, Job& j);
  Status CommitRounds(const std::string& name, Job& j);
  // Commits round committed + 1 in three steps: the merge, the outer optimiser's step and
  // the digest (CommitStep), one write batch with the round's digest, the removal of the
  // round's inputs and, every sync.checkpoint_rounds rounds, the new state (CommitBatch),
  // and, once that is durable, the new state in memory (PublishCommit).
  Status CommitOne(const std::string& name, Job& j);
  // theta and momentum after a round; tensors no site sent (deferred by every site) are
  // carried over unchanged.
  struct OuterState {
    std::map<std::string, SyncTensor> theta;
    std::map<std::string, std::shared_ptr<const std::vector<float>>> momentum;
  };
  struct Stepped {
    OuterState next;
    std::string digest;  // StateDigest of `next` after the round, under the membership given
  };
  // Round `round`'s commit over the deltas of `members`' sites: each tensor merged and
  // stepped here while a helper thread hashes the tensors before it, in name order
  // (common/pipelined.h). The same bits and digest as Merge, the outer step and StateDigest
  // one after the other. `sent` receives the tensors some site did not defer. On failure,
  // `in_merge` (when given) says whether it was the merge (a delta missing or damaged:
  // Corruption and the codec's errors) rather than the step (FailedPrecondition: a
  // non-finite value).
  Result<Stepped> CommitStep(const std::string& name, const Job& j, uint64_t round,
                             const Membership& members, std::set<std::string>* sent,
                             bool* in_merge = nullptr);
  // The outer step of one tensor from its merge `g`: new theta and momentum (null when
  // there is no outer momentum), or the old ones when no site sent it.
  // FailedPrecondition when a value becomes non-finite.
  Result<std::pair<SyncTensor, std::shared_ptr<const std::vector<float>>>> StepTensor(
      const std::string& name, const Job& j, uint64_t round, const std::string& tname,
      const std::vector<float>& g, bool sent) const;
  // `write`: the tensors whose state the batch writes (none between checkpoints).
  void CommitBatch(const std::string& name, const Job& j, uint64_t round, const OuterState& next,
                   const std::set<std::string>& write, const std::vector<std::string>& sites,
                   const std::string& digest, const SyncRecord& rec, WriteBatch& batch) const;
  // The tensor rows (data, record of `version`) and momentum rows of the tensors in `write`.
  // A checkpoint's state rows staged and filled on a thread (background_state_writes), the
  // job's unsaved tensors handed to it; on failure to stage they stay unsaved.
  void StartStateWrite(const std::string& name, Job& j, uint64_t round, uint64_t version);
  // Applies the job's state write once filled (at once if `wait`): the record then names
  // its round. On failure its tensors are unsaved again. Ok when there is none (or, without
  // `wait`, while it is still being filled).
  Status FinishStateWrite(const std::string& name, Job& j, bool wait);
  void WriteStateRows(
      const std::string& name, const std::map<std::string, SyncTensor>& theta,
      const std::map<std::string, std::shared_ptr<const std::vector<float>>>& momentum,
      const std::set<std::string>& write, uint64_t version, WriteBatch& batch) const;
  void PublishCommit(Job& j, uint64_t round, OuterState next, const std::vector<std::string>& sites,
                     uint64_t version);
  // Deletes (into `batch`) the deltas no longer needed once round `committed` is committed:
  // every site's up to committed - sync.replay_rounds, this site's only once every member
  // peer holds them too.
  // Deltas of rounds after `state_round` (the stored state's) stay whatever their age.
  void DropOldDeltas(const std::string& name, const Job& j, uint64_t committed,
                     uint64_t state_round, WriteBatch& batch) const;
  // After a start: the committed state from the stored state of round j.state_round and
  // the deltas of the rounds since, each round's digest checked against the stored one
  // (Corruption naming the round when one differs or a delta is missing).
  Status RebuildState(const std::string& name, Job& j);
  // The rounds this site closed and has not committed, each with the sites whose deltas
  // for it are held (sorted): the optimistic view's rounds.
  std::map<uint64_t, std::vector<std::string>> ViewRounds(const Job& j) const;
  // The stored deltas of round `round` of `sites`, in that order, checked to hold the job's
  // tensors; `total`: the sum of their token counts.
  Result<std::vector<EncodedDelta>> RoundDeltas(const std::string& name, const Job& j,
                                                uint64_t round,
                                                const std::vector<std::string>& sites,
                                                uint64_t* total);
  // Adds tensor `tname`'s token-weighted merge over `deltas` (in their order) into `out`;
  // `sent` becomes true when some delta did not defer it. Thread-safe (touches only its
  // arguments).
  static Status MergeTensor(const std::vector<EncodedDelta>& deltas, uint64_t total,
                            const std::string& tname, std::vector<float>& out, bool* sent);
  // Token-weighted merge of round `round` over `sites` (in the given order), decoded. When
  // `sent` is not null it receives the tensors some site did not defer.
  Result<std::map<std::string, std::vector<float>>> Merge(const std::string& name, const Job& j,
                                                          uint64_t round,
                                                          const std::vector<std::string>& sites,
                                                          std::set<std::string>* sent = nullptr);
  // The pipeline of every tensor for round `round`'s close (PipelineFor, streamed fragments
  // not due deferred), for a round of `round_seconds` of compute (0: not known).
  std::map<std::string, codec::Pipeline> ChoosePipelines(const Job& j, uint64_t round,
                                                         double round_seconds) const;
  // The slowest member peer link's bandwidth (bytes/s) a round is sized for, a link not
  // measured yet at sync.adaptive_start_mbit; -1 when one counts as 0 (no sizing).
  double RoundBytesPerSecond(const Job& j, uint64_t round) const;
  // Pipeline for a tensor of the round being closed, sized for `bytes_per_second` over
  // `round_seconds` (either not positive: the configured pipeline); `total_numel`: the values
  // this round sends (its fragment's). The configured pipelines were parsed once.
  codec::Pipeline PipelineFor(const std::string& tensor, double bytes_per_second,
                              double round_seconds, uint64_t numel, uint64_t total_numel) const;
  // sync.codec, or the first of sync.codec_overrides whose glob matches `tensor`.
  const codec::Pipeline& ConfiguredPipeline(const std::string& tensor) const;
  void CollectGarbage(const std::string& name, const Job& j, WriteBatch& batch) const;

  Store* store_;
  SyncOptions options_;
  uint64_t early_encodes_ = 0;
  // options_'s pipelines, parsed once (Create has checked that every one parses);
  // ceiling_pipe_ only when sync.adaptive_ceiling is set.
  codec::Pipeline codec_pipe_, floor_pipe_, ceiling_pipe_, dense_pipe_, defer_pipe_;
  std::vector<std::pair<std::string, codec::Pipeline>> override_pipes_;  // glob, pipeline
  uint64_t hard_cap_;
  std::map<std::string, Job> jobs_;
  // The commit's buffers (theta, momentum, the merge's sum), recycled from older states.
  std::shared_ptr<TensorPool> pool_ = TensorPool::Create(0);
  std::map<std::string, double> bandwidth_;  // peer -> bytes/s
  JobHooks hooks_;
  // Deferred round work (SetDeferRoundWork): the jobs that have some, whether any was added
  // since the last RunDeferred, and when failed work is tried again.
  bool defer_ = false;
  std::set<std::string> deferred_;
  bool deferred_fresh_ = false;
  std::chrono::steady_clock::time_point deferred_retry_at_{};
  std::chrono::milliseconds deferred_backoff_{0};
  MembershipProtocol membership_;  // after jobs_: it reads them through MembershipHost
};

// Splits tensors (name -> element count) into `fragments` groups of about equal size:
// largest first, each to the group holding the fewest values so far (ties: lower group,
// then name order). Deterministic, so every site that streams computes the same groups.
std::map<std::string, uint32_t> AssignFragments(const std::map<std::string, uint64_t>& numel,
                                                uint32_t fragments);

}  // namespace isthmus
