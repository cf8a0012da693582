// The shard client library: what workers, isthmusctl, tests and benchmarks use to talk to
// an isthmus-server over ZeroMQ (DEALER socket, CURVE unless told otherwise). Every call
// is a request/reply with a timeout; a call that times out is retried up to `retries`
// times with the same request (pushes keep their idempotency key, so a retry is applied
// at most once), on a fresh socket so stale replies cannot be mistaken for new ones.
//
// Ownership: tensor data passed to Push/CreateJob is read in place (not copied) and must
// stay valid until the call returns; the call does not return before ZeroMQ has released
// it. Threads: a ShardClient belongs to one thread at a time.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>
#include <zmq.hpp>

#include "common/keys.h"
#include "common/status.h"
#include "common/tensor.h"
#include "common/wire.h"

namespace isthmus {

struct ClientOptions {
  std::string endpoint;             // e.g. "tcp://127.0.0.1:7000"
  std::string server_public_key;    // Z85; required unless insecure_plaintext
  KeyPair client_keys;              // required unless insecure_plaintext
  bool insecure_plaintext = false;  // no CURVE: only for benchmarks and local debugging
  int timeout_ms = 30000;           // per attempt
  int retries = 2;                  // extra attempts after a timeout
  WireLimits limits;                // applied to replies
};

// A view of fp32 data to send: not owned.
struct TensorView {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;
};

// See wire::RoundStatus.
struct RoundInfo {
  uint64_t local_round = 0;
  uint64_t committed_round = 0;
  uint64_t max_rounds_ahead = 0;  // 0: no limit
};

struct HelloInfo {
  std::string shard_id;
  std::string server_version;
  uint64_t job_version = 0;
  std::string base_hash;
  uint64_t tensor_count = 0;
  RoundInfo rounds;
};

struct PullResult {
  uint64_t job_version = 0;
  std::vector<Tensor> tensors;     // tensor.name/shape/data
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
  uint64_t job_version = 0;
  std::vector<PulledTensor> tensors;
  RoundInfo rounds;

 private:
  friend class ShardClient;
  Frames frames_;                              // the memory of aligned tensors
  std::vector<std::vector<float>> realigned_;  // copies of frames not 4-byte aligned
};

struct PushResult {
  uint64_t job_version = 0;
  bool duplicate = false;  // the key had been applied before; nothing changed now
  RoundInfo rounds;
};

struct TensorInfo {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t version = 0;
};

struct JobInfo {
  std::string job;
  std::string base_hash;
  uint64_t version = 0;
  uint64_t pushes = 0;
  uint64_t duplicate_pushes = 0;  // Stats only: answered as duplicates since the server started
  uint64_t created_unix = 0;
  uint64_t tensor_count = 0;
  uint64_t total_bytes = 0;
  std::vector<TensorInfo> tensors;
};

struct ShardStats {
  std::string shard_id;
  std::string server_version;
  uint64_t uptime_s = 0, requests = 0, errors = 0, bytes_in = 0, bytes_out = 0, db_bytes = 0;
  std::vector<JobInfo> jobs;  // summaries: tensors left empty
};

struct SnapshotInfo {
  std::string name;
  uint64_t created_unix = 0;
  uint64_t bytes = 0;
  std::vector<JobInfo> jobs;  // summaries
};

// --- cross-site sync administration (admin role; server/sync/peer_link.h, docs/SYNC.md) -------

// One peer link of a shard, as `isthmusctl sync status` shows it (see wire::PeerLinkInfo).
struct PeerLinkReport {
  struct Job {
    std::string job;
    uint64_t acked_round = 0;   // the peer holds every round of ours up to this one
    uint64_t outbox_round = 0;  // our highest round
    uint64_t lag_rounds = 0;    // outbox_round - acked_round
  };
  std::string site, endpoint;
  bool connected = false, paused = false;
  std::string last_error;
  std::vector<Job> jobs;
  uint64_t bytes_sent = 0, bytes_received = 0, raw_bytes_sent = 0;  // delta payload
  double compression_ratio = 0, bandwidth_bps = 0;                  // payload ratio
  uint64_t deltas_sent = 0, deltas_acked = 0, resends = 0, auth_failures = 0, refused = 0;
  // On the wire (messages, framing, CURVE, handshakes; TCP/IP estimated): docs/SYNC.md.
  uint64_t wire_bytes_sent = 0, wire_bytes_received = 0, tcp_bytes_estimate = 0;
  double wire_ratio = 0;  // fp32 delta bytes per wire byte sent
  uint64_t messages_sent = 0, messages_received = 0, connections = 0, keepalives = 0;
  bool dials = false;         // this side opened the pair's connection (else the peer did)
  double silent_seconds = 0;  // since the last message from the peer (or since the start)
};

struct SyncJobReport {
  std::string job;
  uint64_t local_round = 0, committed_round = 0, max_rounds_ahead = 0;
  std::string detail;  // the engine's own summary
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
};

struct SyncStatusInfo {
  std::string site;
  int shard_index = -1;
  bool enabled = false;  // the shard takes part in the round protocol
  std::vector<PeerLinkReport> links;
  std::vector<SyncJobReport> jobs;
  uint64_t refused_unknown = 0;  // peer messages refused before a site could be named
};

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
  // as a Timeout on the first call, not here).
  static Result<std::unique_ptr<ShardClient>> Connect(const ClientOptions& options);
  ~ShardClient();

  Result<HelloInfo> Hello(const std::string& job, wire::Role role, const std::string& base_hash,
                          const std::string& client_name);
  Result<PullResult> Pull(const std::string& job, const std::vector<std::string>& names = {},
                          uint64_t newer_than = 0);
  // As Pull, without copying tensor data out of the received frames (see PullView). For
  // large tensors this saves a fresh allocation and a copy per tensor.
  Result<PullView> PullInPlace(const std::string& job, const std::vector<std::string>& names = {},
                               uint64_t newer_than = 0);
  // Adds each tensor's values to the job's tensor of that name, all or none. `compute_ms`:
  // the worker's compute time for the round, for adaptive codec sizing (0 = unknown).
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
  // Membership changes (admin role): starts removing `site` (kRemove), this site's leave
  // (kLeave) or abandons the change this shard coordinates (kAbandon), for `job` or every
  // sync job (empty). Returns job -> the epoch the change creates (kAbandon: the current).
  Result<std::map<std::string, uint64_t>> MembershipControl(wire::MembershipAction action,
                                                            const std::string& site,
                                                            const std::string& job);

  const ClientOptions& options() const { return options_; }

 private:
  explicit ShardClient(const ClientOptions& options);
  Status OpenSocket();
  // Stops the monitor and closes both sockets (a no-op when none is open).
  void CloseSocket();
  // Sends the request built in `fbb` with `payload` and waits for the matching reply,
  // retrying on timeout. The reply's Envelope is verified; error replies become Status.
  Result<Frames> Call(uint64_t request_id, const flatbuffers::FlatBufferBuilder& fbb,
                      const std::vector<TensorView>& payload);
  uint64_t NextRequestId() { return ++request_seq_; }
  // Sends a PullRequest and returns the verified reply (tensor metas checked against the
  // payload frames) and its body.
  Result<Frames> CallPull(const std::string& job, const std::vector<std::string>& names,
                          uint64_t newer_than, const wire::PullReply** body);

  ClientOptions options_;
  zmq::context_t ctx_;
  std::unique_ptr<zmq::socket_t> socket_;
  std::unique_ptr<zmq::socket_t> monitor_;  // PAIR socket with socket_'s handshake failures
  uint64_t monitor_seq_ = 0;
  uint64_t request_seq_;
};

// InvalidArgument naming the first tensor with an empty name, a negative or huge shape
// (NumElements < 0) or no data; Push and CreateJob check their tensors with it before
// anything is sent.
Status CheckTensorViews(const std::vector<TensorView>& tensors);

// Builds the TensorMeta list for `tensors` (frame i = tensor i) into `fbb`.
flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::TensorMeta>>> BuildTensorMetas(
    flatbuffers::FlatBufferBuilder& fbb, const std::vector<TensorView>& tensors);

}  // namespace isthmus
