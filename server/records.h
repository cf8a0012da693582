// The shard's stored tensor record (column kTensorMeta: "job \0 tensor" -> this record),
// with its one writer and its one reader. Used by the plain push path, job creation and
// the sync engine's commits alike.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "server/membership.h"

namespace isthmus {

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

// The sync engine's durable record of a job (column kSync: "job \0 job"), see docs/SYNC.md.
struct SyncRecord {
  uint64_t committed = 0;  // last round committed
  uint64_t local = 0;      // last round this site closed
  uint64_t version = 0;    // the served version
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

}  // namespace isthmus
