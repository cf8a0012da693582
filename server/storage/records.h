// Every record the shard persists, one type each, with its one encoder and its one
// decoder (where each lives is keys.h). The shard and the sync engine read and write their
// state only through these, so a format is defined once.
//
// Decoders never throw: anything that is not such a record is Corruption naming what was
// read. Records are JSON where they are small and read rarely, and binary where they are
// large (round deltas).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace isthmus {

// ---- the shard's records -----------------------------------------------------------------

// A job (column kJobs).
struct JobRecord {
  std::string base_hash;  // hash of the frozen base the workers must load ("" = any)
  uint64_t version = 0;   // served version of a plain job; for a synced job the version
                          // at which the sync engine took it over (it keeps its own)
  uint64_t pushes = 0;    // pushes applied
  uint64_t created_unix = 0;
  uint64_t last_round = 0;  // highest round pushed
  uint64_t tokens = 0;      // tokens of every push applied
  uint64_t dedup_seq = 0;   // idempotency keys recorded so far (kDedupLog sequence)
  std::string create_hash;  // identifies the create request (a retry is answered again)
};
std::string EncodeJobRecord(const JobRecord& record);
// Fields written by older versions may be missing (they read as zero or empty); a field of
// the wrong type is Corruption naming job `job`.
Result<JobRecord> DecodeJobRecord(std::string_view text, const std::string& job);

// A tensor's name-independent metadata (column kTensorMeta).
struct TensorRecord {
  std::vector<int64_t> shape;
  uint64_t version = 0;  // the job version at which the tensor last changed
};
// JSON: {"shape": [...], "version": N}.
std::string EncodeTensorRecord(const TensorRecord& record);
// Corruption naming `what` for anything but that: not JSON, a shape that is not an array
// of integers or whose element count is negative or huge, a version that is not an
// unsigned integer (a record without a version reads as version 0).
Result<TensorRecord> DecodeTensorRecord(std::string_view text, const std::string& what);

// What a push was answered with, kept for its idempotency key (column kDedup).
struct DedupRecord {
  uint64_t version = 0;  // the job's version after the push
  // What the push was (its round and a checksum of its tensor names and shapes, not their
  // values: a round redone after a crash is the same push), so that a key reused for
  // another push is told apart from a retry; empty in records written before it was kept.
  std::string content;
};
std::string EncodeDedupRecord(const DedupRecord& record);
// nullopt when `text` is not such a record (the caller answers with the current version).
std::optional<DedupRecord> DecodeDedupRecord(std::string_view text);

// ---- the round protocol's records --------------------------------------------------------

// "From round `from_round` on, rounds commit with the deltas of exactly `sites`." A sync
// job's membership (docs/SYNC.md, "Membership"): committed state, versioned by an epoch,
// changed only at a round boundary by a change every site of the new set agreed to.
struct Membership {
  uint64_t epoch = 0;              // 0: the sites the job started with
  std::vector<std::string> sites;  // sorted, distinct
  uint64_t from_round = 0;         // first round merged over `sites` (0: from the start)
  bool operator==(const Membership&) const = default;
  bool Has(const std::string& site) const;
  std::string SiteList() const;  // "a,b,c"
};

// A membership change under way: the membership it makes, and the site coordinating it.
struct MembershipChange {
  Membership next;
  std::string coordinator;
  bool operator==(const MembershipChange&) const = default;
  // "remove gamma from round 4 (epoch 1), coordinated by alpha", against `current`.
  std::string Describe(const Membership& current) const;
};

// The sync engine's durable record of a job (column kSync, SyncRecordKey), see docs/SYNC.md.
struct SyncRecord {
  uint64_t committed = 0;  // last round committed
  // The committed round whose state (theta, momentum) the store's tensor rows hold: a
  // start replays rounds state_round + 1 .. committed from their deltas (records written
  // before it existed: committed, whose state they always held).
  uint64_t state_round = 0;
  uint64_t local = 0;  // last round this site closed
  // The closed round whose error-feedback residuals the store's rows hold: the staged deltas
  // and this site's encoded deltas of rounds residual_round + 1 .. local stay, and a start
  // recomputes the residuals from them (records written before it existed: local).
  uint64_t residual_round = 0;
  uint64_t version = 0;  // the served version
  uint64_t staged_round = 0;
  uint64_t staged_tokens = 0;
  std::set<std::string> staged;           // tensors pushed for staged_round
  std::map<std::string, uint64_t> acked;  // peer -> acked round
  uint64_t bytes_encoded = 0, raw_bytes = 0;
  std::map<std::string, uint64_t> pipelines;  // of the last closed round
  // Who merges into which rounds (empty `sites`: a record written before memberships
  // existed; the engine fills in the configured sites).
  Membership members;
  std::map<std::string, uint64_t> removed;  // site -> first round it was no longer merged in
  std::map<std::string, uint64_t> joined;   // site -> first round it merged into, if it joined
  std::optional<MembershipChange> pending;  // a change this site agreed to or coordinates
};
std::string EncodeSyncRecord(const SyncRecord& record);
// Corruption naming job `job` unless `text` is such a record with every field present and
// of its type.
Result<SyncRecord> DecodeSyncRecord(std::string_view text, const std::string& job);

// The tokens of a held, uncommitted delta (column kSync, HeldKey): decimal text.
std::string EncodeHeldTokens(uint64_t tokens);
Result<uint64_t> DecodeHeldTokens(std::string_view text, const std::string& job);

// One tensor of a round delta as it crosses the WAN and sits in an outbox or inbox: the
// codec's self-describing bytes (ops/codec.h), decoded into a tensor of `shape`.
struct EncodedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::string bytes;
};

// A site's whole round delta for the tensors of one shard of one job (column kDeltas).
struct EncodedDelta {
  std::string job;
  std::string site;     // the site that produced it
  uint64_t round = 0;   // >= 1
  uint64_t tokens = 0;  // tokens the site trained on in this round (merge weight)
  std::vector<EncodedTensor> tensors;
  uint64_t WireBytes() const {
    uint64_t n = 0;
    for (const auto& t : tensors) n += t.bytes.size();
    return n;
  }
};
// Binary: "ISD1", then length-prefixed fields (big-endian 64-bit lengths and numbers).
std::string EncodeDelta(const EncodedDelta& delta);
// Corruption for anything that is not exactly such an encoding.
Result<EncodedDelta> DecodeDelta(std::string_view bytes);

}  // namespace isthmus
