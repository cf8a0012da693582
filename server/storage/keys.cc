// The key layout (see keys.h).
#include "server/storage/keys.h"

namespace isthmus::keys {
namespace {

const std::string kNul(1, '\0');

}  // namespace

std::string BigEndian64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 7; i >= 0; --i, v >>= 8) s[i] = static_cast<char>(v & 0xff);
  return s;
}

uint64_t FromBigEndian64(std::string_view s) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<uint8_t>(s[i]);
  return v;
}

std::string JobKey(std::string_view job, std::string_view item) {
  std::string k;
  k.reserve(job.size() + 1 + item.size());
  k.append(job);
  k.push_back('\0');
  k.append(item);
  return k;
}

std::string DedupLogKey(std::string_view job, uint64_t seq) {
  return JobKey(job, BigEndian64(seq));
}

std::string SyncRecordKey(std::string_view job) { return JobKey(job, "job"); }

std::string HeldPrefix(std::string_view job) { return JobKey(job, "held" + kNul); }

std::string HeldKey(std::string_view job, std::string_view site, uint64_t round) {
  return HeldPrefix(job) + std::string(site) + kNul + BigEndian64(round);
}

std::optional<HeldId> ParseHeldSuffix(std::string_view suffix) {
  const auto zero = suffix.find('\0');
  if (zero == std::string_view::npos || suffix.size() != zero + 9) return std::nullopt;
  return HeldId{std::string(suffix.substr(0, zero)), FromBigEndian64(suffix.substr(zero + 1))};
}

std::string DigestPrefix(std::string_view job) { return JobKey(job, "digest" + kNul); }

std::string DigestKey(std::string_view job, uint64_t round) {
  return DigestPrefix(job) + BigEndian64(round);
}

std::optional<uint64_t> ParseRoundSuffix(std::string_view suffix) {
  if (suffix.size() != 8) return std::nullopt;
  return FromBigEndian64(suffix);
}

std::string DeltaPrefix(std::string_view job, std::string_view site) {
  return JobKey(job, std::string(site) + kNul);
}

std::string DeltaKey(std::string_view job, std::string_view site, uint64_t round) {
  return DeltaPrefix(job, site) + BigEndian64(round);
}

std::string StateKey(std::string_view job, StateKind kind, std::string_view tensor) {
  return JobKey(job, std::string(1, static_cast<char>(kind)) + kNul + std::string(tensor));
}

std::string StagedKey(std::string_view job, uint64_t round, std::string_view tensor) {
  return JobKey(job, std::string("r") + kNul + BigEndian64(round) + std::string(tensor));
}

std::string StagedEncodedKey(std::string_view job, uint64_t round, std::string_view tensor) {
  return JobKey(job, std::string("q") + kNul + BigEndian64(round) + std::string(tensor));
}

}  // namespace isthmus::keys
