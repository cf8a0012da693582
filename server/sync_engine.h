// The round protocol of one shard (DESIGN.md "The round protocol", docs/SYNC.md): stages a
// site's round delta as its workers push it, closes the round by encoding it with error
// feedback into the outbox, holds peers' deltas in the inbox, commits a round once every
// site's delta for it is held (token-weighted merge in site-name order, then Nesterov
// momentum), and serves committed state plus the known uncommitted deltas to workers.
// Every state change is one Store write batch; memory follows only after it succeeded.
//
// Threads: one thread (the shard's event loop) calls everything; nothing is locked.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "ops/codec.h"
#include "server/peer_io.h"
#include "server/records.h"
#include "server/store.h"

namespace isthmus {

struct SyncOptions {
  std::string site;                     // this site's name; required
  std::vector<std::string> peer_sites;  // the other sites; empty = commit on close
  // Codec pipeline text for every tensor (empty: the codec's default pipeline).
  std::string codec;
  // "glob=pipeline" entries (fnmatch globs on tensor names); the first match wins.
  std::vector<std::string> codec_overrides;
  // Adaptive mode: size each round's encoding to the slowest link, within floor/ceiling.
  bool adaptive = false;
  std::string adaptive_floor;    // coarsest pipeline allowed (empty: codec default ladder end)
  std::string adaptive_ceiling;  // finest pipeline allowed (empty: dense)
  double outer_lr = 1.0;
  double outer_momentum = 0.5;
  // Streaming: the job's tensors fall into this many fragments of about equal size
  // (AssignFragments); round r sends fragment (r - 1) % fragments and defers the others
  // (codec "defer": their deltas wait in the error-feedback residual), so each fragment
  // crosses the WAN every `fragments` rounds and a round carries 1/fragments of the model.
  // 1 = every tensor every round.
  uint32_t fragments = 1;
  // K: workers wait while local - committed > K (0: synchronous rounds, each commits first)
  uint64_t max_rounds_ahead = 2;
  // Hard cap on local - committed (bounds disk and memory); 0 = 4 * K + 8.
  uint64_t hard_cap_rounds = 0;
  // Clock for round durations (adaptive sizing); tests replace it.
  std::function<std::chrono::steady_clock::time_point()> now = &std::chrono::steady_clock::now;
  // Called (event-loop thread) after a round this site closed has committed, with the
  // seconds from its close to its commit: the wait for every member's delta plus the merge
  // (the commit latency of docs/METRICS.md). Rounds closed before a restart are not timed.
  std::function<void(const std::string& job, uint64_t round, double seconds)> on_commit;
};

// A tensor of a job as the shard holds it. `data` is shared, never mutated.
struct SyncTensor {
  std::vector<int64_t> shape;
  std::shared_ptr<const std::vector<float>> data;
};

// One tensor of a worker's round push: the values to add.
struct SyncPushTensor {
  std::string name;
  std::span<const float> delta;
};

struct SyncPushResult {
  bool duplicate = false;  // the round was already closed: nothing changed
  bool closed = false;     // this push completed the round
  uint64_t version = 0;    // the job's served version after the push
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
  std::optional<MembershipChange> pending;  // a change agreed to or coordinated here
  std::string change_note;                  // outcome of the last change seen here (memory only)
  bool catching_up = false;                 // asking a member for its committed state
  bool draining = false;                    // leaving once this site's last round commits
};

class SyncEngine : public DeltaSource, public DeltaSink {
 public:
  // Checks options (site set, peers distinct from it, pipelines parse, lr/momentum finite)
  // and makes an engine with no jobs. `store` is not owned and must outlive the engine (or
  // be replaced with SetStore).
  static Result<std::unique_ptr<SyncEngine>> Create(Store* store, SyncOptions options);

  // Forgets every job and uses `store` from now on (after a snapshot restore).
  void Reset(Store* store);

  // Takes part in sync for `job`, whose committed tensors (as in the store's kTensors
  // column) are `tensors`. Loads the job's durable sync state (none for a new job; then
  // `base_version` is the served version) and commits any round that became committable
  // before a crash. Digest of round 0 = the initial state.
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
  bool has_peers() const { return !options_.peer_sites.empty(); }
  const SyncOptions& options() const { return options_; }

  // A worker's push for round `round` (>= 1) of `job`, `tokens` = the site's tokens of the
  // round. Rounds <= the last closed round are answered as duplicates. Refuses
  // (FailedPrecondition, saying why) a round past local + 1, a round that would put the site
  // more than the hard cap ahead of the last commit, and a tensor pushed twice for a round;
  // NotFound / InvalidArgument for unknown tensors or wrong sizes. `batch` may hold the
  // caller's own ops (its idempotency record): they are written in the same batch, and
  // only if everything succeeded. The push that completes the round closes it (encode,
  // residual, outbox), and the commits that become possible follow, each its own batch.
  // `compute_ms`: the pushing worker's compute time for the round (0 = unknown); the
  // largest of a round's pushes sizes adaptive codecs at its close.
  Result<SyncPushResult> PushRound(const std::string& job, uint64_t round, uint64_t tokens,
                                   const std::vector<SyncPushTensor>& tensors, WriteBatch& batch,
                                   uint64_t compute_ms = 0);

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

  uint64_t Version(const std::string& job) const;
  uint64_t LocalRound(const std::string& job) const;
  uint64_t CommittedRound(const std::string& job) const;
  uint64_t max_rounds_ahead() const { return options_.max_rounds_ahead; }
  uint64_t hard_cap() const { return hard_cap_; }

  Result<SyncJobStatus> JobStatus(const std::string& job) const;
  // Committed-round digests (hex SHA-256) of rounds from_round.. (at most `max`), in order.
  Result<std::vector<std::pair<uint64_t, std::string>>> Digests(const std::string& job,
                                                                uint64_t from_round,
                                                                uint64_t max) const;

  // Membership (docs/SYNC.md, "Membership"). Starts the removal of `site` from `job`, this
  // site coordinating it; `site` = this site is a planned leave. The change takes effect
  // from round committed + 1 once every site of the new membership has agreed over the
  // peer links (at once when no other site is left). A leave while this site's own rounds
  // are not all committed drains first: no new rounds are taken (the one being pushed may
  // finish), and the leave is proposed once they have committed (the returned change's
  // from_round is then 0). FailedPrecondition, saying what to do, when it cannot start:
  // not a member, another change under way, a remaining site with no sync.peers entry.
  Result<MembershipChange> ProposeRemoval(const std::string& job, const std::string& site);
  // Gives up the change this site coordinates (the sites that agreed learn it when they
  // ask). FailedPrecondition when there is none, or another site coordinates it.
  Status AbandonChange(const std::string& job);
  // The automatic removal policy (sync.remove_silent_after_s): `silent` are the peers that
  // have sent nothing for the configured time. With three or more members, when the other
  // members are a majority and this site is the first-named of them, starts removing the
  // silent members (as ProposeRemoval; one at a time per job). Returns whether it did; why
  // not shows in the job's status.
  Result<bool> ProposeSilentRemoval(const std::string& job, const std::set<std::string>& silent);
  Result<Membership> Members(const std::string& job) const;
  // Joining (this site does not hold `job` yet): asks member `from` to coordinate this
  // site's addition, fetches the committed state the addition starts from, checks it against
  // the digests every member reports, creates the job from it (JobHooks::install) and then
  // agrees to the addition like any other site. Progress shows in JobStatus. NotFound when
  // `from` has no sync.peers entry, FailedPrecondition when the job is held here already.
  Status StartJoin(const std::string& job, const std::string& from);
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
  // Catching up (a member that has committed fewer rounds than another, typically because a
  // site died after delivering its last delta to some members only): asks member `from` for
  // its committed state and, if it is further on, under the same membership and hashes to
  // its digest, takes it as this site's committed state (the rounds it covers are
  // committed; their held deltas go). Progress and outcome show in JobStatus.
  Status StartCatchUp(const std::string& job, const std::string& from);

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

  // DeltaSink.
  Result<uint64_t> ReceiveDelta(const std::string& from_site, const EncodedDelta& delta) override;
  uint64_t HeldFrom(const std::string& site, const std::string& job) const override;
  Result<std::vector<std::pair<std::string, std::vector<int64_t>>>> JobTensors(
      const std::string& job) const override;
  MembershipAnswer OnMembershipRequest(const std::string& from_site,
                                       const MembershipRequest& request) override;
  std::string RefusesPeer(const std::string& site, const std::string& job) const override;

  // Reads a job's committed tensors as the shard stores them (kTensorMeta JSON with a
  // "shape", kTensors raw fp32). Corruption when a record or size is bad.
  static Result<std::map<std::string, SyncTensor>> ReadTensors(Store* store,
                                                               const std::string& job);

  // Serialised form of an EncodedDelta in the kDeltas column (exposed for tests).
  static std::string SerializeDelta(const EncodedDelta& d);
  static Result<EncodedDelta> ParseDelta(std::string_view bytes);

 private:
  // The durable fields are the SyncRecord (server/records.h): a batch writes a copy of
  // them with its changes, and memory takes them once the batch is durable.
  struct Job : SyncRecord {
    std::map<std::string, SyncTensor> theta;  // committed
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
    // Cached optimistic view; empty when stale.
    std::optional<std::map<std::string, SyncTensor>> view;
    // The change this site coordinates: sites of the new membership that agreed to it.
    std::set<std::string> votes;
    std::string change_note;  // the last change's outcome, for status
    // Sites whose addition was given up here, and why (told at their next join request).
    std::map<std::string, std::string> join_refusals;
  };

  SyncEngine(Store* store, SyncOptions options);
  Result<Job*> FindJob(const std::string& job);
  Result<const Job*> FindJob(const std::string& job) const;
  static std::string JobRecord(const SyncRecord& r) { return EncodeSyncRecord(r); }
  // The state of a job that has just been created: `tensors` committed at round 0 as
  // version `version`, zero outer momentum when the outer optimiser has one.
  Job NewJob(std::map<std::string, SyncTensor> tensors, uint64_t version) const;
  std::vector<std::string> AllSites() const;  // the configured sites (sync.peers + own), sorted
  // Member sites other than this one.
  std::vector<std::string> MemberPeers(const Job& j) const;
  // The membership change of `j` takes effect: one batch with the new membership and the
  // deletion of removed sites' uncommitted deltas, then the commits it allows.
  Status ApplyChange(const std::string& name, Job& j);
  // Records `change` as `j`'s pending change (one write), and applies it at once when this
  // site coordinates it and is its only site.
  Status StartChange(const std::string& name, Job& j, const MembershipChange& change);
  // Forgets `j`'s pending change (durably), noting `why`.
  Status DropChange(const std::string& name, Job& j, const std::string& why);
  // Why a prepare of `change` from `from` is refused here (empty: it can be agreed to).
  std::string PrepareRefusal(const Job& j, const std::string& from,
                             const MembershipChange& change) const;
  // Starts adding `site` to `j`, this site coordinating (a joining site asked for it).
  Result<MembershipChange> ProposeAddition(const std::string& name, Job& j,
                                           const std::string& site);
  // A member's committed state for a joining site.
  Result<std::shared_ptr<const JobImage>> Image(const std::string& name, const Job& j) const;
  // A joining site's progress (memory only: an interrupted join is started again).
  struct Joining {
    std::string from;
    std::optional<MembershipChange> change;      // the addition `from` proposed
    std::shared_ptr<const JobImage> image;       // the state that addition starts from
    std::map<std::string, std::string> digests;  // member -> its digest of image->round
    std::string note;
    bool failed = false;
  };
  MembershipAnswer OnJoiningRequest(const std::string& from, const MembershipRequest& req);
  void OnCatchUpAnswer(const std::string& name, Job& j, const std::string& peer,
                       const MembershipAnswer& answer);
  void OnJoiningAnswer(const std::string& peer, const MembershipRequest& req,
                       const MembershipAnswer& answer);
  // Checks an image against its own digest and the change; empty when it fits.
  std::string ImageProblem(const Joining& jn, const JobImage& image) const;
  // Creates the job from a verified image, with the addition pending.
  Status InstallJoined(const std::string& name, Joining& jn);
  bool Configured(const std::string& site) const;
  // Why `site` may not take part in `j` (removed or never a member; empty if it may).
  std::string NonMemberReason(const std::string& name, const Job& j, const std::string& site) const;
  uint64_t HeldContiguous(const Job& j, const std::string& site) const;
  // Encodes the staged round and writes it to the outbox. `pushed`: the round's deltas in
  // memory when one push brings them all (nothing was staged on disk); they are then
  // written with `batch` (the push's own records) in the close's single write batch.
  Status CloseRound(const std::string& name, Job& j,
                    const std::map<std::string, std::span<const float>>* pushed = nullptr,
                    WriteBatch* batch = nullptr);
  // Commits what can be committed (CommitRounds), then starts a draining leave that has
  // become possible.
  Status CommitReady(const std::string& name, Job& j);
  Status CommitRounds(const std::string& name, Job& j);
  // Commits round committed + 1 in three steps: the outer optimiser's step from the merged
  // deltas (OuterStep), one write batch with the new state, the round's digest and the
  // removal of the round's inputs (CommitBatch), and, once that is durable, the new state
  // in memory (PublishCommit).
  Status CommitOne(const std::string& name, Job& j);
  // theta and momentum after round `round`; tensors not in `sent` (deferred by every site)
  // are carried over unchanged. FailedPrecondition when a value becomes non-finite.
  struct OuterState {
    std::map<std::string, SyncTensor> theta;
    std::map<std::string, std::shared_ptr<const std::vector<float>>> momentum;
  };
  Result<OuterState> OuterStep(const std::string& name, const Job& j, uint64_t round,
                               const std::map<std::string, std::vector<float>>& merged,
                               const std::set<std::string>& sent) const;
  void CommitBatch(const std::string& name, const Job& j, uint64_t round, const OuterState& next,
                   const std::set<std::string>& sent, const std::vector<std::string>& sites,
                   const std::string& digest, const SyncRecord& rec, WriteBatch& batch) const;
  void PublishCommit(Job& j, uint64_t round, OuterState next, const std::vector<std::string>& sites,
                     uint64_t version);
  // Token-weighted merge of round `round` over `sites` (in the given order), decoded. When
  // `sent` is not null it receives the tensors some site did not defer.
  Result<std::map<std::string, std::vector<float>>> Merge(const std::string& name, const Job& j,
                                                          uint64_t round,
                                                          const std::vector<std::string>& sites,
                                                          std::set<std::string>* sent = nullptr);
  // Pipeline for a tensor of the round being closed; `total_numel`: the values this round
  // sends (its fragment's). The configured pipelines were parsed once, at construction.
  codec::Pipeline PipelineFor(const Job& j, const std::string& tensor, uint64_t numel,
                              uint64_t total_numel) const;
  void CollectGarbage(const std::string& name, const Job& j, WriteBatch& batch) const;

  Store* store_;
  SyncOptions options_;
  // options_'s pipelines, parsed once (Create has checked that every one parses).
  codec::Pipeline codec_pipe_, floor_pipe_, ceiling_pipe_, dense_pipe_, defer_pipe_;
  std::vector<std::pair<std::string, codec::Pipeline>> override_pipes_;  // glob, pipeline
  uint64_t hard_cap_;
  std::map<std::string, Job> jobs_;
  std::map<std::string, double> bandwidth_;  // peer -> bytes/s
  std::map<std::string, Joining> joining_;
  std::map<std::string, std::string> catching_up_;  // job -> the member asked
  std::set<std::string> draining_;                  // jobs this site leaves once drained
  JobHooks hooks_;
};

// Splits tensors (name -> element count) into `fragments` groups of about equal size:
// largest first, each to the group holding the fewest values so far (ties: lower group,
// then name order). Deterministic, so every site that streams computes the same groups.
std::map<std::string, uint32_t> AssignFragments(const std::map<std::string, uint64_t>& numel,
                                                uint32_t fragments);

// SHA-256 (hex) of a committed state: round, then for each tensor in name order its name,
// shape, theta bytes and momentum bytes (momentum omitted when null), then the membership
// the round was committed under (epoch, first round, sites).
std::string StateDigest(uint64_t round, const std::map<std::string, SyncTensor>& theta,
                        const std::map<std::string, std::shared_ptr<const std::vector<float>>>& m,
                        const Membership& members);

}  // namespace isthmus
