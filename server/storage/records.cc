// The persisted records' encoders and decoders (see records.h).
#include "server/storage/records.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "common/check.h"
#include "common/tensor.h"
#include "server/storage/keys.h"

namespace isthmus {
namespace {

using json = nlohmann::json;

json MembershipJson(const Membership& m) {
  return {{"epoch", m.epoch}, {"sites", m.sites}, {"from_round", m.from_round}};
}

Membership MembershipFromJson(const json& j) {  // throws like at() and get()
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

void PutU64(std::string& out, uint64_t v) { out += keys::BigEndian64(v); }
void PutStr(std::string& out, std::string_view s) {
  PutU64(out, s.size());
  out.append(s);
}

class Reader {
 public:
  explicit Reader(std::string_view s) : s_(s) {}
  bool U64(uint64_t& v) {
    if (s_.size() < 8) return false;
    v = keys::FromBigEndian64(s_);
    s_.remove_prefix(8);
    return true;
  }
  bool Str(std::string& out) {
    uint64_t n;
    if (!U64(n) || n > s_.size()) return false;
    out.assign(s_.substr(0, n));
    s_.remove_prefix(n);
    return true;
  }
  bool done() const { return s_.empty(); }

 private:
  std::string_view s_;
};

}  // namespace

// ---- the shard's records -----------------------------------------------------------------

std::string EncodeJobRecord(const JobRecord& r) {
  return json{{"base_hash", r.base_hash},       {"version", r.version},        {"pushes", r.pushes},
              {"created_unix", r.created_unix}, {"last_round", r.last_round},  {"tokens", r.tokens},
              {"dedup_seq", r.dedup_seq},       {"create_hash", r.create_hash}}
      .dump();
}

Result<JobRecord> DecodeJobRecord(std::string_view text, const std::string& job) {
  const json rec = json::parse(text, nullptr, false);
  if (!rec.is_object()) {
    return Status::Corruption("job record '" + job + "' is not a JSON object");
  }
  JobRecord r;
  try {  // value() throws on a field of the wrong type
    r.base_hash = rec.value("base_hash", "");
    r.version = rec.value("version", uint64_t{0});
    r.pushes = rec.value("pushes", uint64_t{0});
    r.created_unix = rec.value("created_unix", uint64_t{0});
    r.last_round = rec.value("last_round", uint64_t{0});
    r.tokens = rec.value("tokens", uint64_t{0});
    r.dedup_seq = rec.value("dedup_seq", uint64_t{0});
    r.create_hash = rec.value("create_hash", "");
  } catch (const json::exception& e) {
    return Status::Corruption("job record '" + job + "' is bad: " + e.what());
  }
  return r;
}

std::string EncodeTensorRecord(const TensorRecord& record) {
  return json{{"shape", record.shape}, {"version", record.version}}.dump();
}

Result<TensorRecord> DecodeTensorRecord(std::string_view text, const std::string& what) {
  const auto rec = json::parse(text, nullptr, false);
  TensorRecord out;
  bool ok = rec.is_object() && rec.contains("shape") && rec["shape"].is_array() &&
            (!rec.contains("version") || rec["version"].is_number_unsigned());
  for (const auto& d : ok ? rec["shape"] : json::array()) {
    ok = ok && d.is_number_integer();
    if (ok) out.shape.push_back(d.get<int64_t>());
  }
  if (!ok || NumElements(out.shape) < 0) return Status::Corruption(what + " is bad");
  if (rec.contains("version")) out.version = rec["version"].get<uint64_t>();
  return out;
}

std::string EncodeDedupRecord(const DedupRecord& record) {
  json out{{"version", record.version}};
  if (!record.content.empty()) out["content"] = record.content;
  return out.dump();
}

std::optional<DedupRecord> DecodeDedupRecord(std::string_view text) {
  const json rec = json::parse(text, nullptr, false);
  if (!rec.is_object() || !rec.contains("version") || !rec["version"].is_number_unsigned()) {
    return std::nullopt;
  }
  DedupRecord r{rec["version"].get<uint64_t>(), ""};
  if (rec.contains("content") && rec["content"].is_string()) {
    r.content = rec["content"].get<std::string>();
  }
  return r;
}

// ---- the round protocol's records --------------------------------------------------------

bool Membership::Has(const std::string& site) const {
  return std::binary_search(sites.begin(), sites.end(), site);
}

std::string Membership::SiteList() const {
  std::string out;
  for (const auto& s : sites) out += (out.empty() ? "" : ",") + s;
  return out;
}

std::string MembershipChange::Describe(const Membership& current) const {
  std::string what;
  for (const auto& s : current.sites) {
    if (!next.Has(s)) what += (what.empty() ? "remove " : ", remove ") + s;
  }
  for (const auto& s : next.sites) {
    if (!current.Has(s)) what += (what.empty() ? "add " : ", add ") + s;
  }
  if (what.empty()) what = "keep " + next.SiteList();
  return what + " from round " + std::to_string(next.from_round) + " (epoch " +
         std::to_string(next.epoch) + "), coordinated by " + coordinator;
}

std::string EncodeSyncRecord(const SyncRecord& r) {
  json out{{"committed", r.committed},
           {"state_round", r.state_round},
           {"local", r.local},
           {"residual_round", r.residual_round},
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
  const auto rec = json::parse(text, nullptr, false);
  if (rec.is_discarded()) return Status::Corruption("sync record of job '" + job + "' is not JSON");
  SyncRecord r;
  try {  // at() and get() throw on a missing field or one of the wrong type
    r.committed = rec.at("committed").get<uint64_t>();
    r.state_round =
        rec.contains("state_round") ? rec.at("state_round").get<uint64_t>() : r.committed;
    if (r.state_round > r.committed) {
      return Status::Corruption("sync record of job '" + job + "' says its state is of round " +
                                std::to_string(r.state_round) + ", after its committed round " +
                                std::to_string(r.committed));
    }
    r.local = rec.at("local").get<uint64_t>();
    r.residual_round =
        rec.contains("residual_round") ? rec.at("residual_round").get<uint64_t>() : r.local;
    if (r.residual_round > r.local) {
      return Status::Corruption("sync record of job '" + job +
                                "' says its residuals are of round " +
                                std::to_string(r.residual_round) +
                                ", after its last closed round " + std::to_string(r.local));
    }
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

std::string EncodeHeldTokens(uint64_t tokens) { return std::to_string(tokens); }

Result<uint64_t> DecodeHeldTokens(std::string_view text, const std::string& job) {
  auto held = ParseUint64(text, "held delta of job '" + job + "'");
  if (!held.ok()) return Status::Corruption(held.status().message());
  return *held;
}

std::string EncodeDelta(const EncodedDelta& d) {
  std::string out = "ISD1";
  PutStr(out, d.job);
  PutStr(out, d.site);
  PutU64(out, d.round);
  PutU64(out, d.tokens);
  PutU64(out, d.tensors.size());
  for (const auto& t : d.tensors) {
    PutStr(out, t.name);
    PutU64(out, t.shape.size());
    for (int64_t s : t.shape) PutU64(out, static_cast<uint64_t>(s));
    PutStr(out, t.bytes);
  }
  return out;
}

Result<EncodedDelta> DecodeDelta(std::string_view bytes) {
  auto bad = [] { return Status::Corruption("stored round delta is malformed"); };
  if (bytes.substr(0, 4) != "ISD1") return bad();
  Reader r(bytes.substr(4));
  EncodedDelta d;
  uint64_t count = 0;
  if (!r.Str(d.job) || !r.Str(d.site) || !r.U64(d.round) || !r.U64(d.tokens) || !r.U64(count)) {
    return bad();
  }
  if (count > bytes.size()) return bad();
  d.tensors.resize(count);
  for (auto& t : d.tensors) {
    uint64_t dims = 0;
    if (!r.Str(t.name) || !r.U64(dims) || dims > 64) return bad();
    t.shape.resize(dims);
    for (auto& s : t.shape) {
      uint64_t v;
      if (!r.U64(v)) return bad();
      s = static_cast<int64_t>(v);
    }
    if (!r.Str(t.bytes)) return bad();
  }
  if (!r.done()) return bad();
  return d;
}

}  // namespace isthmus
