// The shard client library: what workers, isthmusctl, tests and benchmarks use to talk to
// an isthmus-server over ZeroMQ (DEALER socket, CURVE unless told otherwise). Every call
// is a request/reply. How long a call may take (ClientOptions has the settings):
//   - a shard that cannot be reached fails fast: an attempt whose connection (TCP and the
//     ZeroMQ/CURVE handshake) is not up within connect_timeout_ms ends, as does one whose
//     connection drops before the reply; after the last attempt the call returns
//     Unavailable naming the endpoint and what to check. A dead shard (no process, wrong
//     port, host down) therefore fails within (1 + retries) x connect_timeout_ms: 15 s with
//     the defaults;
//   - a connected shard gets timeout_ms per attempt to reply (a large push or a slow disk
//     takes time); a shard that stops answering on an open connection (SIGSTOP, a hung
//     host, a cut link) costs timeout_ms, then the reconnecting attempts above: 40 s with
//     the defaults;
//   - a server that refuses this client's key fails at once with PermissionDenied (a
//     socket monitor sees the refused CURVE handshake).
// A failed attempt is retried up to `retries` times with the same request (pushes keep
// their idempotency key, so a retry is applied at most once), on a fresh socket so stale
// replies cannot be mistaken for new ones. ClientOptions::interrupted lets a caller stop a
// waiting call (the Python binding delivers Ctrl-C through it).
//
// Ownership: tensor data passed to Push/CreateJob is read in place (not copied) and must
// stay valid until the call returns; the call does not return before ZeroMQ has released
// it. Results own their data (PullView: see there). Threads: a ShardClient belongs to one
// thread at a time; the result structs are plain values.
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
#include <utility>
#include <vector>
#include <zmq.hpp>

#include "common/keys.h"
#include "common/status.h"
#include "common/tensor.h"
#include "common/wire.h"

namespace isthmus {

// How a ShardClient reaches its shard and how long it waits (see the file comment).
struct ClientOptions {
  std::string endpoint;           // ZeroMQ endpoint, e.g. "tcp://127.0.0.1:7000"
  std::string server_public_key;  // Z85 (40 chars); required unless insecure_plaintext
  // or server_key_file is given
  // A file listing the server's public keys: one, or two while the server's key is being
  // rotated (keys.h, LoadPublicKeyList). Read at Connect, and again after a failed CURVE
  // handshake, when the client tries the next key it lists (without using up a retry):
  // a running client follows a rotation once the new key is added to the file. Empty:
  // server_public_key only.
  std::string server_key_file;
  KeyPair client_keys;              // this client's pair; required unless insecure_plaintext
  bool insecure_plaintext = false;  // no CURVE: only for benchmarks and local debugging
  int timeout_ms = 30000;           // per attempt: how long a connected shard has to reply
  int connect_timeout_ms = 5000;    // per attempt: how long the connection may take to be up
  int retries = 2;                  // extra attempts after a timeout or a lost connection
  WireLimits limits;                // applied to replies (and to the socket's max message)
  // Asked every 100 ms or so while a call waits, and when a signal interrupts the wait,
  // on the calling thread; true stops the call, which returns Unavailable ("interrupted").
  // Empty: calls are not interruptible. Must not call into this client.
  std::function<bool()> interrupted;
  // Push the large fp32 tensors of a job whose last Hello offered it (HelloInfo::
  // push_part_bytes) in parts, which the shard writes to disk as they come. false: every
  // push goes whole, in one message.
  bool push_in_parts = true;
};

// A view of fp32 data to send (Push, CreateJob): not owned; the caller keeps `data` valid
// until the call returns. `shape` may be empty for a scalar; data holds NumElements(shape)
// floats, row-major.
// `encoded`, when set (a round push of a synced job only): the tensor's delta as a codec's
// bytes (ops/codec.h), sent as they are with dtype Codec; `data` is not used then.
struct TensorView {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;
  std::optional<std::string_view> encoded = std::nullopt;
};

// The pipeline each tensor's delta of one round is to be encoded with, as a synced job's
// shard said (Hello with want_pipelines; docs/SYNC.md, "Deltas encoded by the worker").
// round 0 and no pipelines: not said (the job does not sync, or an older shard).
struct RoundPipelines {
  uint64_t round = 0;
  std::map<std::string, std::string> pipelines;  // tensor -> ops/codec.h pipeline text
};

// Where a job's round protocol stands on one shard (wire::RoundStatus; docs/SYNC.md).
struct RoundInfo {
  uint64_t local_round = 0;      // the highest round of this site's deltas the shard holds
  uint64_t committed_round = 0;  // the highest round every member site has committed
  // K (sync.max_rounds_ahead): local may run this far past committed; 0: each round
  // commits before the next. A shard without cross-site sync reports local == committed.
  uint64_t max_rounds_ahead = 0;
};

// A shard's answer to Hello: who it is and where the job stands there.
struct HelloInfo {
  std::string shard_id;        // the shard's shard.id
  std::string server_version;  // isthmus-server's version string
  uint64_t job_version = 0;    // the job's served version (rises whenever pulled values change)
  std::string base_hash;       // the base model hash the job was created with
  uint64_t tensor_count = 0;   // tensors of the job on this shard (0: no such job here)
  RoundInfo rounds;
  RoundPipelines pipelines;  // of this site's next round, when asked for
  // The job takes pushes of its tensors of twice this many bytes or more in parts of this
  // size (0: whole). Push follows it for the job from this Hello on.
  uint64_t push_part_bytes = 0;
};

// The result of Pull: copies of the tensors, owned by the result.
struct PullResult {
  uint64_t job_version = 0;        // the version these values are of
  std::vector<Tensor> tensors;     // tensor.name/shape/data, in the shard's order
  std::vector<uint64_t> versions;  // per tensor, the version at which it last changed
  RoundInfo rounds;
};

// A tensor of a PullView, read in place from the received message.
struct PulledTensor {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t version = 0;         // the version at which it last changed
  std::span<const float> data;  // owned by the PullView; valid while it lives
};

// The result of PullInPlace: the reply's payload frames are kept, and each tensor's data
// points into them, so nothing is copied after ZeroMQ received the message. Move-only
// (moving keeps the spans valid: frames own heap memory that does not move).
struct PullView {
  uint64_t job_version = 0;  // the version these values are of
  std::vector<PulledTensor> tensors;
  RoundInfo rounds;

 private:
  friend class ShardClient;
  Frames frames_;                              // the memory of aligned tensors
  std::vector<std::vector<float>> realigned_;  // copies of frames not 4-byte aligned
};

// Bytes of a tensor in a ReplayReply's payload frame: fp32 values (base state) or a codec's
// encoding (a round's delta). Valid while the ReplayReply lives.
struct ReplayTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::string_view bytes;
};
struct ReplaySiteDelta {
  std::string site;
  uint64_t tokens = 0;
  std::vector<ReplayTensor> tensors;
};
struct ReplayRoundDeltas {
  uint64_t round = 0;
  std::vector<ReplaySiteDelta> deltas;  // in the merge's order
};

// The result of PullReplay (docs/SYNC.md, "Pulling by replay"; the fields are the wire's
// Replay table). replayed false: the job does not sync on that shard, and `plain` holds
// what a plain pull returns. Move-only, like PullView: the spans point into frames it owns.
struct ReplayReply {
  bool replayed = false;
  PullResult plain;
  uint64_t job_version = 0;
  RoundInfo rounds;
  uint64_t base_round = 0;
  bool whole = false;  // base (and base_momentum) hold committed round base_round
  std::vector<ReplayTensor> base, base_momentum;
  std::vector<ReplayRoundDeltas> committed, view;
  uint64_t committed_round = 0;
  std::string digest;
  std::string check;  // the state's fast check (DigestKind::kCheck); empty: not sent
  uint64_t epoch = 0, members_from = 0;
  std::vector<std::string> members;
  float outer_lr = 1.0f, outer_momentum = 0.0f;
  uint64_t payload_bytes = 0;  // bytes of the reply's payload frames

 private:
  friend class ShardClient;
  Frames frames_;
};

// A shard's answer to Push.
struct PushResult {
  uint64_t job_version = 0;  // the job's version after the push
  bool duplicate = false;    // the key had been applied before; nothing changed now
  RoundInfo rounds;          // the rounds after the push
};

// One tensor of a job as DescribeJob lists it (no values).
struct TensorInfo {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t version = 0;  // the job version at which it last changed
};

// A job on one shard. DescribeJob fills every field but duplicate_pushes; CreateJob fills
// job, base_hash, version, tensor_count and total_bytes; the summaries in ShardStats and
// SnapshotInfo fill job, version, pushes, tensor_count, total_bytes (and, in Stats,
// duplicate_pushes), leaving tensors empty.
struct JobInfo {
  std::string job;
  std::string base_hash;          // the base model hash given at creation
  uint64_t version = 0;           // the served version (rises whenever pulled values change)
  uint64_t pushes = 0;            // worker pushes applied on this shard (duplicates not counted)
  uint64_t duplicate_pushes = 0;  // Stats only: answered as duplicates since the server started
  uint64_t created_unix = 0;      // creation time, seconds since the Unix epoch
  uint64_t tensor_count = 0;      // tensors of the job on this shard
  uint64_t total_bytes = 0;       // their fp32 bytes
  std::vector<TensorInfo> tensors;
};

// A shard's counters (Stats, admin role), since the server started unless said otherwise.
struct ShardStats {
  std::string shard_id;
  std::string server_version;
  uint64_t uptime_s = 0;      // seconds since the server started
  uint64_t requests = 0;      // requests answered on the worker and admin sockets
  uint64_t errors = 0;        // of those, answered with an error
  uint64_t bytes_in = 0;      // bytes received on those sockets (headers and payload)
  uint64_t bytes_out = 0;     // bytes sent on them
  uint64_t db_bytes = 0;      // the store's size on disk now (approximate)
  std::vector<JobInfo> jobs;  // summaries: tensors left empty
  // The last request answered with an error ("Push from worker socket: ...") and how many
  // seconds ago; empty when none since the server started.
  std::string last_error;
  uint64_t last_error_age_s = 0;
};

// A snapshot of a shard (a RocksDB checkpoint taken at a committed round; docs/CLI.md).
struct SnapshotInfo {
  std::string name;
  uint64_t created_unix = 0;  // seconds since the Unix epoch
  uint64_t bytes = 0;         // its size on disk
  std::vector<JobInfo> jobs;  // summaries of the jobs it holds
};

// --- cross-site sync administration (admin role; server/sync/peer_link.h, docs/SYNC.md) -------

// One peer link of a shard, as `isthmusctl sync status` shows it (see wire::PeerLinkInfo,
// whose comments define each counter). Counters run since the shard started.
struct PeerLinkReport {
  // One job on the link.
  struct Job {
    std::string job;
    uint64_t acked_round = 0;   // the peer holds every round of ours up to this one
    uint64_t outbox_round = 0;  // our highest round
    uint64_t lag_rounds = 0;    // outbox_round - acked_round
  };
  std::string site, endpoint;              // the peer site and its shard's peer endpoint
  bool connected = false, paused = false;  // transport up and handshake answered; paused
  std::string last_error;                  // the last refusal or failure seen, if any
  std::vector<Job> jobs;
  uint64_t bytes_sent = 0, bytes_received = 0, raw_bytes_sent = 0;  // delta payload
  double compression_ratio = 0, bandwidth_bps = 0;                  // payload ratio; bytes/s
  uint64_t deltas_sent = 0, deltas_acked = 0, resends = 0, auth_failures = 0, refused = 0;
  // On the wire (messages, framing, CURVE, handshakes; TCP/IP estimated): docs/SYNC.md.
  uint64_t wire_bytes_sent = 0, wire_bytes_received = 0, tcp_bytes_estimate = 0;
  double wire_ratio = 0;  // fp32 delta bytes per wire byte sent
  uint64_t messages_sent = 0, messages_received = 0, connections = 0, keepalives = 0;
  bool dials = false;         // this side opened the pair's connection (else the peer did)
  double silent_seconds = 0;  // since the last message from the peer (or since the start)
};

// The round protocol's state of one job on one shard (wire::SyncJobState).
struct SyncJobReport {
  std::string job;
  uint64_t local_round = 0, committed_round = 0, max_rounds_ahead = 0;  // as RoundInfo
  std::string detail;                                                   // the engine's own summary
  // Membership (docs/SYNC.md): epoch, member sites (sorted) and the first round they merge.
  uint64_t epoch = 0, members_from = 0;
  std::vector<std::string> members;
  std::map<std::string, uint64_t> removed;  // site -> first round without it
  std::string change;                       // under way, or the last outcome seen here
  bool change_pending = false;
  // Codec pipeline -> tensors it encoded in the last round this site closed (adaptive
  // mode may change it every round).
  std::map<std::string, uint64_t> pipelines;
  std::map<std::string, uint64_t> held;  // site -> highest contiguous round held here
  // Round work left after a reply (close, encode, commit): whether some is pending, how often
  // it failed since the server started, and the last failure while it waits for a retry.
  bool round_work_pending = false;
  uint64_t round_work_failures = 0;
  std::string round_work_error;
};

// A shard's answer to SyncStatus.
struct SyncStatusInfo {
  std::string site;      // this shard's sync.site
  int shard_index = -1;  // its shard.index (-1: not set)
  bool enabled = false;  // the shard takes part in the round protocol
  std::vector<PeerLinkReport> links;
  std::vector<SyncJobReport> jobs;
  uint64_t refused_unknown = 0;  // peer messages refused before a site could be named
};

// A shard's answer to Digests: the digest of each committed round's state, the way sites
// (and `isthmusctl sync verify`) check that they agree.
struct DigestsInfo {
  std::string job;
  uint64_t committed_round = 0;
  std::vector<std::pair<uint64_t, std::string>> digests;  // (round, hex digest), ascending
  // The shard's membership of the job (docs/SYNC.md, "Membership"); has_members is false
  // for a server that does not send it.
  std::string site;  // the shard's sync.site
  bool has_members = false;
  uint64_t epoch = 0, members_from = 0;
  std::vector<std::string> members;
  std::map<std::string, uint64_t> removed;  // site -> first round without it
  std::map<std::string, uint64_t> joined;   // site -> first round it merged into
};

class ShardClient {
 public:
  // Creates the socket and connects (ZeroMQ connects lazily: an absent server shows up
  // as Unavailable on the first call, not here). InvalidArgument for unusable options.
  static Result<std::unique_ptr<ShardClient>> Connect(const ClientOptions& options);
  ~ShardClient();

  // want_pipelines: the reply says the pipelines of this site's next round (HelloInfo),
  // sized for a round of `compute_ms` of compute when that is not 0.
  Result<HelloInfo> Hello(const std::string& job, wire::Role role, const std::string& base_hash,
                          const std::string& client_name, bool want_pipelines = false,
                          uint64_t compute_ms = 0);
  Result<PullResult> Pull(const std::string& job, const std::vector<std::string>& names = {},
                          uint64_t newer_than = 0);
  // As Pull, without copying tensor data out of the received frames (see PullView). For
  // large tensors this saves a fresh allocation and a copy per tensor.
  Result<PullView> PullInPlace(const std::string& job, const std::vector<std::string>& names = {},
                               uint64_t newer_than = 0);
  // A pull by replay: the client holds committed round `from` of `job` with `digest` (empty:
  // none). Frames and metas are checked (each names a frame, of the length it says).
  Result<ReplayReply> PullReplay(const std::string& job, uint64_t from, const std::string& digest);
  // Adds each tensor's values to the job's tensor of that name, all or none. `compute_ms`:
  // the worker's compute time for the round, for adaptive codec sizing (0 = unknown).
  // After a Hello that offered parts for the job (HelloInfo::push_part_bytes), fp32
  // tensors of twice the part size or more go in PushPart messages after the request.
  Result<PushResult> Push(const std::string& job, const std::string& idempotency_key,
                          uint64_t round, uint64_t tokens, const std::vector<TensorView>& deltas,
                          uint64_t compute_ms = 0);
  // Admin role: needs a client key on the server's admin allowlist and the admin endpoint.
  Result<JobInfo> CreateJob(const std::string& job, const std::string& base_hash,
                            const std::vector<TensorView>& tensors);
  Result<JobInfo> DescribeJob(const std::string& job);
  Result<ShardStats> Stats();
  Result<SnapshotInfo> CreateSnapshot(const std::string& name);
  Result<std::vector<SnapshotInfo>> ListSnapshots();
  Result<SnapshotInfo> RestoreSnapshot(const std::string& name);
  // Cross-site sync (admin role). SyncStatus: the links and the round protocol's state.
  // SyncControl: "sync now" / pause / resume for the link to `peer` (empty: every link);
  // returns the sites acted on; NotFound for an unknown site. Digests: committed-round
  // digests of `job` from `from_round` (0 = the initial state) up to the last commit.
  Result<SyncStatusInfo> SyncStatus();
  Result<std::vector<std::string>> SyncControl(wire::SyncAction action, const std::string& peer);
  Result<DigestsInfo> Digests(const std::string& job, uint64_t from_round = 0);
  // Membership changes (admin role): starts removing `site` (kRemove; `revoke_key`: the
  // shard also stops admitting its key), this site's leave (kLeave), abandons the change
  // this shard coordinates or the join it makes (kAbandon), or invites `site` to join for
  // `seconds` (kInvite), for `job` or every sync job (empty). Returns job -> the epoch the
  // change creates (kAbandon, kInvite: the current).
  Result<std::map<std::string, uint64_t>> MembershipControl(wire::MembershipAction action,
                                                            const std::string& site,
                                                            const std::string& job,
                                                            uint64_t seconds = 0,
                                                            bool revoke_key = false);

  const ClientOptions& options() const { return options_; }

 private:
  explicit ShardClient(const ClientOptions& options);
  Status OpenSocket();
  // Reads every event the monitor has queued: updates ready_, tcp_connected_ and
  // handshake_failed_, sets *lost when an up connection dropped or a handshake failed
  // without the server refusing the key, and returns PermissionDenied when it refused it.
  Status ReadMonitor(bool* lost);
  // Stops the monitor and closes both sockets (a no-op when none is open).
  void CloseSocket();
  // Sends the request built in `fbb` with `payload` and waits for the matching reply,
  // retrying on timeout or a lost connection. The reply's Envelope is verified; error
  // replies become Status.
  // `parts`: more messages sent after the request, each a header and one payload frame
  // (a streamed push's PushPart messages), sent again with it on every attempt.
  struct Part {
    flatbuffers::FlatBufferBuilder header;
    const char* data = nullptr;
    size_t size = 0;
  };
  Result<Frames> Call(uint64_t request_id, const flatbuffers::FlatBufferBuilder& fbb,
                      const std::vector<TensorView>& payload,
                      const std::vector<Part>* parts = nullptr);
  uint64_t NextRequestId() { return ++request_seq_; }
  // After a failed handshake: reads options_.server_key_file again (if set) and moves to
  // the next key listed; false when there is no other key to try.
  bool NextServerKey();
  // Sends a PullRequest and returns the verified reply (tensor metas checked against the
  // payload frames) and its body.
  Result<Frames> CallPull(const std::string& job, const std::vector<std::string>& names,
                          uint64_t newer_than, const wire::PullReply** body);

  ClientOptions options_;
  zmq::context_t ctx_;
  std::unique_ptr<zmq::socket_t> socket_;
  std::unique_ptr<zmq::socket_t> monitor_;  // PAIR socket with socket_'s connection events
  uint64_t monitor_seq_ = 0;
  // What the monitor said about socket_'s connection: up (handshake done, not dropped
  // since), and whether a TCP connection was ever made since the socket opened.
  bool ready_ = false;
  bool tcp_connected_ = false;
  // A CURVE handshake failed in the current attempt without a refusal of the key: a wrong
  // server key, or a server that died or restarted during the handshake (the same events).
  bool handshake_failed_ = false;
  // The server's public keys the client knows (options_.server_key_file or
  // server_public_key) and the one it uses.
  std::vector<std::string> server_keys_;
  size_t key_index_ = 0;
  uint64_t request_seq_;
  std::map<std::string, uint64_t> push_part_bytes_;  // per job, from its last Hello
};

// InvalidArgument naming the first tensor with an empty name, a negative or huge shape
// (NumElements < 0) or no data; Push and CreateJob check their tensors with it before
// anything is sent.
Status CheckTensorViews(const std::vector<TensorView>& tensors);

// Builds the TensorMeta list for `tensors` (frame i = tensor i) into `fbb`.
flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::TensorMeta>>> BuildTensorMetas(
    flatbuffers::FlatBufferBuilder& fbb, const std::vector<TensorView>& tensors);

}  // namespace isthmus
