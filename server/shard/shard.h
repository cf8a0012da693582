// The shard's state machine, separate from sockets so it can be driven in one process by
// tests: it takes a verified request (role, header, payload frames) and produces a reply
// (header + zero-copy payload). It owns the job tensors (a copy in memory for fast pulls,
// the authoritative copy in the Store) and applies each change as one atomic write batch,
// updating memory only after the batch is durable.
//
// Threads: one thread (the server's event loop) calls everything.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"
#include "common/wire.h"
#include "server/storage/records.h"
#include "server/storage/store.h"
#include "server/sync/sync_engine.h"

namespace isthmus {

struct ShardOptions {
  std::string shard_id = "shard";
  // Folder for snapshots (<snapshot_dir>/<name>/). Empty disables snapshots.
  std::string snapshot_dir;
  // Closes nothing, opens the live store: used at start and after a restore.
  std::function<Result<std::unique_ptr<Store>>()> open_store;
  // Replaces the live store's files with the checkpoint in `checkpoint_dir`. Called with
  // the store closed. Null disables restore.
  std::function<Status(const std::string& checkpoint_dir)> replace_store_files;
  WireLimits limits;
  // How many idempotency keys per job are remembered (older ones are forgotten).
  uint64_t dedup_window = 65536;
  // Cross-site round protocol (docs/SYNC.md); nullopt = off (pushes add at once).
  std::optional<SyncOptions> sync;
  // With sync on: jobs without sync state (created while sync was off) are attached to
  // the round protocol, their current tensors as round 0. false: Open (and a restore)
  // refuses them with InvalidArgument naming them, before anything is written.
  bool convert_plain_jobs = false;
  // With sync on: answer a push that completes a round once its deltas are durable, and
  // leave the round's close and the commits after it to RunDeferred
  // (SyncEngine::SetDeferRoundWork). The server's loop sets it and calls RunDeferred after
  // each reply; off, Handle does all of a request's round work before it returns.
  bool defer_round_work = false;
  // A plain job's pushes of tensors of twice this or more come in PushPart messages of this
  // many bytes (HelloReply.push_part_bytes): their transfer, the encryption on both ends
  // and the sums' disk write overlap. 0: pushes come whole.
  uint64_t push_part_bytes = uint64_t{1} << 20;
  // The same for a synced job, whose parts are gathered and handed to the engine at the
  // last one (nothing of the shard's work overlaps the transfer). 0: whole.
  uint64_t synced_push_part_bytes = 0;
  // Streamed pushes waiting for parts at once; a new one past this, or past twice
  // limits.max_payload_bytes of tensors held by them all, drops the oldest (its client times
  // out and sends it again). One that got no part for streamed_push_idle_ms is dropped when
  // the next streamed push begins.
  size_t max_streamed_pushes = 8;
  int streamed_push_idle_ms = 60000;
};

// A reply ready to send.
struct Reply {
  flatbuffers::FlatBufferBuilder header;
  std::vector<PayloadRef> payload;
  bool is_error = false;
  bool send = true;  // false: nothing to send (a part of a streamed push that is not its last)
};

class Shard {
 public:
  // Opens the store and loads every job into memory. With sync on, a plain job (no sync
  // state) is refused unless convert_plain_jobs (see ShardOptions).
  static Result<std::unique_ptr<Shard>> Open(ShardOptions options);
  ~Shard();

  // Handles one request that arrived on the socket of `role`. Never throws; any problem
  // becomes an error reply, and an error reply means no state changed. `keepalive`, when
  // set, owns `request` (its payload frames included): the shard may keep it, and refer to
  // the pushed values, past the call (a push's deltas until its round's deferred close)
  // instead of reading them back from the store. `connection` names the connection the
  // request came on (the ROUTER's routing id): a push's parts are taken only from the
  // connection its request came on, so the parts of an attempt a client gave up (still
  // queued from its closed connection) cannot mix with its retry's.
  Reply Handle(wire::Role role, const Frames& request,
               std::shared_ptr<const void> keepalive = nullptr, std::string_view connection = {});

  // The round work that replies left for later (ShardOptions::defer_round_work): the
  // close of a round a push completed and the commits that became possible. Call it after
  // the reply is sent and before the next request; a failure is logged and tried again by
  // a later call (DeferredRetryMs says when), and reported here.
  Status RunDeferred();
  // Milliseconds until RunDeferred has work to retry; -1 when none waits.
  int DeferredRetryMs() const;

  uint64_t requests() const { return requests_; }
  uint64_t errors() const { return errors_; }
  // Bytes of one request and its reply on the socket of `role` (headers and payload).
  void CountBytes(wire::Role role, uint64_t in, uint64_t out);
  // Counts one request answered on the socket of `role`: its operation (a short name such
  // as "push", see OpName), its outcome and how long handling it took. Handle() records
  // its own; the server records the sync admin requests it answers beside the shard.
  void RecordRequest(wire::Role role, std::string_view op, Code outcome, double seconds);
  // The metrics of the shard itself (docs/METRICS.md): requests by socket, operation and
  // outcome, their handling time, each job's pushes, version and size, and the store's
  // sizes and write stalls.
  void WriteMetrics(metrics::TextWriter& w);
  // Per socket role name ("worker", "admin"): {bytes received, bytes sent}.
  const std::map<std::string, std::pair<uint64_t, uint64_t>>& socket_bytes() const {
    return socket_bytes_;
  }

  // The round protocol engine (every job of this shard takes part), or nullptr when sync
  // is off. Owned by the shard; valid until the shard dies. The peer links use it as their
  // DeltaSource and DeltaSink. Event-loop thread only, like everything here.
  SyncEngine* sync() { return sync_.get(); }

 private:
  struct TensorState {
    std::vector<int64_t> shape;
    uint64_t version = 0;
    std::shared_ptr<const std::vector<float>> data;  // replaced, never mutated
    // A buffer of the same size no one else references, reused by the next push.
    std::shared_ptr<std::vector<float>> spare = nullptr;
  };
  // A job in memory: its durable record (storage/records.h) and what is derived from it.
  struct JobState : JobRecord {
    std::string name;
    uint64_t duplicate_pushes = 0;  // answered as duplicates since start (not stored)
    // Names, shapes, versions; the data only for plain jobs (the sync engine holds a
    // synced job's tensors: ReleaseSyncedData).
    std::map<std::string, TensorState> tensors;
  };

  explicit Shard(ShardOptions options);
  Status Load();
  // With sync on: InvalidArgument naming the jobs without sync state, unless
  // options_.convert_plain_jobs (then a warning). Reads only.
  // Without sync: FailedPrecondition when a job that syncs has committed rounds its stored
  // tensors do not hold yet (sync.checkpoint_rounds), which only the engine can replay.
  Status CheckSyncJobsWritten() const;
  Status CheckPlainJobs();
  static void ReleaseSyncedData(JobState& job);
  // A job a joining site builds from a member's state (SyncEngine::JobHooks::install).
  Status InstallJoinedJob(const std::string& name, const std::string& base_hash,
                          const std::map<std::string, SyncTensor>& tensors, uint64_t version,
                          WriteBatch& batch);
  // fp32 bytes of the job's tensors, from their shapes.
  static uint64_t JobBytes(const JobState& job);

  Status DoHello(wire::Role role, const wire::Hello* req, uint64_t id, Reply& reply);
  Status DoPull(const wire::PullRequest* req, uint64_t id, Reply& reply);
  // A pull by replay (PullRequest.replay) of a synced job: the engine's ReplayPlan, its
  // encoded deltas (and, when the client's state cannot be used, the whole committed
  // state) in zero-copy payload frames.
  Status DoReplayPull(const wire::PullRequest* req, JobState& job, uint64_t id, Reply& reply);
  Status DoPush(const wire::PushRequest* req, const Frames& frames, uint64_t id, Reply& reply,
                std::shared_ptr<const void> keepalive);
  // A push to a job of the round protocol: staged by the engine (round >= 1) or added at
  // once (round 0, only without peers). Validated by DoPush up to the tensor list.
  // `keepalive` as for Handle.
  // `bytes`: each tensor's payload, in the request's order.
  Status DoSyncPush(JobState* job, const wire::PushRequest* req,
                    const std::vector<std::span<const uint8_t>>& bytes, uint64_t id,
                    const std::string& content, Reply& reply,
                    std::shared_ptr<const void> keepalive);
  // A push whose large tensors come in parts (PushRequest.streamed). To a plain job each
  // part's sums are computed as it arrives and handed to the store's staged write
  // (StagedWrite::FillPrefix), so most of the disk write is done when the last part comes;
  // to a synced job the parts are gathered and the last hands the push to DoSyncPush.
  // Begin answers nothing (Reply::send false); DoPushPart answers the push (its request id
  // in `id`) when the last part has come, or when a part is refused (the push is dropped).
  struct StreamedPush;
  Status BeginStreamedPush(JobState* job, const wire::PushRequest* req, const Frames& frames,
                           uint64_t id, const std::string& content, Reply& reply,
                           std::shared_ptr<const void> keepalive);
  Status DoPushPart(const wire::PushPart* req, const Frames& frames, uint64_t& id, Reply& reply,
                    std::shared_ptr<const void> keepalive);
  Status FinishStreamedPush(std::shared_ptr<StreamedPush> push, Reply& reply);
  // Sums a + delta over one range into out; InvalidArgument naming the tensor if one is not
  // finite.
  static Status AddRange(const std::string& name, const float* a, const void* delta, float* out,
                         size_t n);
  // Publishes a push's durable sums (the old buffers become spares where no reply holds
  // them) and the job's new record.
  static void PublishSums(
      std::vector<std::pair<TensorState*, std::shared_ptr<std::vector<float>>>>& sums,
      uint64_t version);
  // A push whose key was applied before: answers it as a duplicate (true), or refuses a
  // different push under that key. False: the key is new.
  Result<bool> AnsweredBefore(JobState* job, const std::string& key, const std::string& content,
                              uint64_t id, Reply& reply);
  // Drops every streamed push waiting for parts (their clients send them again), before the
  // store they stage into is closed or reloaded.
  void DropStreamedPushes(const char* why);
  // Adds the idempotency record of `key` (and forgets the oldest) to `batch`; counts it
  // in `next`.
  Status AddDedup(const std::string& job_name, const std::string& key, uint64_t version,
                  const std::string& content, JobRecord& next, WriteBatch& batch);
  // Served version of a job: the engine's for synced jobs.
  uint64_t VersionOf(const JobState& job) const;
  Status DoJobCreate(const wire::JobCreate* req, const Frames& frames, uint64_t id, Reply& reply);
  Status DoJobDescribe(const wire::JobDescribe* req, uint64_t id, Reply& reply);
  Status DoStats(uint64_t id, Reply& reply);
  Status DoSnapshotCreate(const wire::SnapshotCreate* req, uint64_t id, Reply& reply);
  Status DoSnapshotList(uint64_t id, Reply& reply);
  Status DoSnapshotRestore(const wire::SnapshotRestore* req, uint64_t id, Reply& reply);

  Result<JobState*> FindJob(const flatbuffers::String* job);
  // The job's round position for replies. Without cross-site sync every round this site
  // pushes is committed at once.
  flatbuffers::Offset<wire::RoundStatus> RoundStatusOf(flatbuffers::FlatBufferBuilder& fbb,
                                                       const JobState& job);

  ShardOptions options_;
  std::unique_ptr<Store> store_;
  uint64_t store_reopens_ = 0;        // store_->reopens() when the jobs were last read (Load)
  std::unique_ptr<SyncEngine> sync_;  // after store_: destroyed first
  std::map<std::string, JobState> jobs_;
  // Streamed pushes waiting for parts, oldest first; after store_: destroyed first.
  std::vector<std::unique_ptr<StreamedPush>> streamed_;
  std::string connection_;  // Handle's `connection`, while it runs
  std::chrono::steady_clock::time_point started_;
  uint64_t requests_ = 0, errors_ = 0, bytes_in_ = 0, bytes_out_ = 0;
  // The last request answered with an error, and when (Stats reports it; memory only).
  std::string last_error_;
  std::chrono::steady_clock::time_point last_error_at_;
  // Metrics: (socket, op, outcome) -> requests; (socket, op) -> handling seconds.
  std::map<std::tuple<std::string, std::string, std::string>, uint64_t> request_counts_;
  std::map<std::pair<std::string, std::string>, metrics::Histogram> request_seconds_;
  std::map<std::string, std::pair<uint64_t, uint64_t>> socket_bytes_;
};

// The operation label of a message type: "PushRequest" -> "push", "JobCreate" ->
// "job_create", "SyncStatusRequest" -> "sync_status".
std::string OpName(wire::Body body);
// "worker", "admin" or "peer".
std::string RoleName(wire::Role role);

}  // namespace isthmus
