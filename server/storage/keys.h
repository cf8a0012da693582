// The shard's key layout: every key of every column, built in one place. A reader who
// wants to know what the database holds reads this file and records.h.
//
//   kJobs        JOB                          -> JobRecord
//   kTensorMeta  JOB \0 TENSOR                -> TensorRecord
//   kTensors     JOB \0 TENSOR                -> raw little-endian fp32 (committed values)
//   kDedup       JOB \0 IDEMPOTENCY-KEY       -> DedupRecord (the push's reply)
//   kDedupLog    JOB \0 BE64(seq)             -> idempotency key (bounds kDedup)
//   kSync        JOB \0 "job"                 -> SyncRecord
//                JOB \0 "held" \0 SITE \0 BE64(r) -> tokens (decimal) of a held delta
//                JOB \0 "digest" \0 BE64(r)   -> hex SHA-256 of the state committed at r
//   kDeltas      JOB \0 SITE \0 BE64(r)       -> EncodeDelta(EncodedDelta)
//   kState       JOB \0 "s" \0 TENSOR         -> staged delta of the open round (fp32)
//                JOB \0 "e" \0 TENSOR         -> error-feedback residual (fp32)
//                JOB \0 "m" \0 TENSOR         -> outer momentum (fp32)
//
// BE64 is big-endian, so a prefix scan visits rounds and sequence numbers in order.
// Job names are checked (common/names.h) and hold no NUL byte; site and tensor names
// hold none either, so every prefix below names exactly one group of keys.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace isthmus::keys {

// 8 bytes, most significant first.
std::string BigEndian64(uint64_t v);
// The inverse; `s` must hold at least 8 bytes.
uint64_t FromBigEndian64(std::string_view s);

// "job\0item": the key of a per-job item; JobPrefix(job) = JobKey(job, "").
std::string JobKey(std::string_view job, std::string_view item);
inline std::string JobPrefix(std::string_view job) { return JobKey(job, ""); }

// kTensorMeta, kTensors.
inline std::string TensorKey(std::string_view job, std::string_view tensor) {
  return JobKey(job, tensor);
}
// kDedup and kDedupLog.
inline std::string DedupKey(std::string_view job, std::string_view idempotency_key) {
  return JobKey(job, idempotency_key);
}
std::string DedupLogKey(std::string_view job, uint64_t seq);

// kSync.
std::string SyncRecordKey(std::string_view job);
std::string HeldPrefix(std::string_view job);
std::string HeldKey(std::string_view job, std::string_view site, uint64_t round);
// Splits the part of a held key after HeldPrefix(job) into site and round; nullopt for
// anything else.
struct HeldId {
  std::string site;
  uint64_t round = 0;
};
std::optional<HeldId> ParseHeldSuffix(std::string_view suffix);
std::string DigestPrefix(std::string_view job);
std::string DigestKey(std::string_view job, uint64_t round);
// The round of a key under DigestPrefix(job), given the part after the prefix.
std::optional<uint64_t> ParseRoundSuffix(std::string_view suffix);

// kDeltas.
std::string DeltaPrefix(std::string_view job, std::string_view site);
std::string DeltaKey(std::string_view job, std::string_view site, uint64_t round);

// kState: what a tensor's state row holds.
// kStaged: the staged delta of the round being pushed, as stores before per-round staged
// rows wrote it (read, never written).
enum class StateKind : char { kStaged = 's', kResidual = 'e', kMomentum = 'm' };
std::string StateKey(std::string_view job, StateKind kind, std::string_view tensor);
// A round's staged delta of one tensor (kState): JOB \0 r \0 BE(round) TENSOR. They stay
// after the round's close until the residuals are next written (sync.checkpoint_rounds).
std::string StagedKey(std::string_view job, uint64_t round, std::string_view tensor);
// The same for a delta its worker encoded (the codec's bytes): JOB \0 q \0 BE(round) TENSOR.
// A tensor of a round has one of the two rows, never both.
std::string StagedEncodedKey(std::string_view job, uint64_t round, std::string_view tensor);

}  // namespace isthmus::keys
