// The stored tensor record (see records.h).
#include "server/records.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "common/tensor.h"

namespace isthmus {

std::string EncodeTensorRecord(const TensorRecord& record) {
  return nlohmann::json{{"shape", record.shape}, {"version", record.version}}.dump();
}

Result<TensorRecord> DecodeTensorRecord(std::string_view text, const std::string& what) {
  const auto rec = nlohmann::json::parse(text, nullptr, false);
  TensorRecord out;
  bool ok = rec.is_object() && rec.contains("shape") && rec["shape"].is_array() &&
            (!rec.contains("version") || rec["version"].is_number_unsigned());
  for (const auto& d : ok ? rec["shape"] : nlohmann::json::array()) {
    ok = ok && d.is_number_integer();
    if (ok) out.shape.push_back(d.get<int64_t>());
  }
  if (!ok || NumElements(out.shape) < 0) return Status::Corruption(what + " is bad");
  if (rec.contains("version")) out.version = rec["version"].get<uint64_t>();
  return out;
}

namespace {

nlohmann::json MembershipJson(const Membership& m) {
  return {{"epoch", m.epoch}, {"sites", m.sites}, {"from_round", m.from_round}};
}

Membership MembershipFromJson(const nlohmann::json& j) {  // throws like at() and get()
  Membership m;
  m.epoch = j.at("epoch").get<uint64_t>();
  m.sites = j.at("sites").get<std::vector<std::string>>();
  m.from_round = j.at("from_round").get<uint64_t>();
  std::vector<std::string> sorted = m.sites;
  std::sort(sorted.begin(), sorted.end());
  if (sorted != m.sites || std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    throw std::invalid_argument("membership sites are not sorted and distinct");
  }
  return m;
}

}  // namespace

std::string EncodeSyncRecord(const SyncRecord& r) {
  nlohmann::json out{{"committed", r.committed},
                     {"local", r.local},
                     {"version", r.version},
                     {"staged_round", r.staged_round},
                     {"staged_tokens", r.staged_tokens},
                     {"staged", r.staged},
                     {"acked", r.acked},
                     {"bytes_encoded", r.bytes_encoded},
                     {"raw_bytes", r.raw_bytes},
                     {"pipelines", r.pipelines},
                     {"members", MembershipJson(r.members)},
                     {"removed", r.removed},
                     {"joined", r.joined}};
  if (r.pending) {
    out["pending"] = {{"next", MembershipJson(r.pending->next)},
                      {"coordinator", r.pending->coordinator}};
  }
  return out.dump();
}

Result<SyncRecord> DecodeSyncRecord(std::string_view text, const std::string& job) {
  const auto rec = nlohmann::json::parse(text, nullptr, false);
  if (rec.is_discarded()) return Status::Corruption("sync record of job '" + job + "' is not JSON");
  SyncRecord r;
  try {  // at() and get() throw on a missing field or one of the wrong type
    r.committed = rec.at("committed").get<uint64_t>();
    r.local = rec.at("local").get<uint64_t>();
    r.version = rec.at("version").get<uint64_t>();
    r.staged_round = rec.at("staged_round").get<uint64_t>();
    r.staged_tokens = rec.at("staged_tokens").get<uint64_t>();
    r.staged = rec.at("staged").get<std::set<std::string>>();
    r.acked = rec.at("acked").get<std::map<std::string, uint64_t>>();
    r.bytes_encoded = rec.at("bytes_encoded").get<uint64_t>();
    r.raw_bytes = rec.at("raw_bytes").get<uint64_t>();
    r.pipelines = rec.at("pipelines").get<std::map<std::string, uint64_t>>();
    // Records written before memberships existed have none of these.
    if (rec.contains("members")) r.members = MembershipFromJson(rec.at("members"));
    if (rec.contains("removed")) {
      r.removed = rec.at("removed").get<std::map<std::string, uint64_t>>();
    }
    if (rec.contains("joined")) r.joined = rec.at("joined").get<std::map<std::string, uint64_t>>();
    if (rec.contains("pending")) {
      const auto& p = rec.at("pending");
      r.pending = MembershipChange{MembershipFromJson(p.at("next")),
                                   p.at("coordinator").get<std::string>()};
    }
  } catch (const std::exception& e) {
    return Status::Corruption("sync record of job '" + job + "' is bad: " + e.what());
  }
  return r;
}

}  // namespace isthmus
