// The round protocol engine: staging, round close with error feedback, inbox, commit with
// Nesterov momentum, digests and the optimistic view. Layout of its durable state (every
// key is JobKey(job, ...)):
//   kSync   "job"                      -> JSON record (rounds, staging, acks, counters)
//           "held\0" SITE "\0" BE(r)   -> tokens (decimal) of a held, uncommitted delta
//           "digest\0" BE(r)           -> hex SHA-256 of the state committed at round r
//   kDeltas SITE "\0" BE(r)            -> SerializeDelta(EncodedDelta)
//   kState  "s\0" NAME                 -> staged delta of the open round (fp32)
//           "e\0" NAME                 -> error-feedback residual (fp32)
//           "m\0" NAME                 -> outer momentum (fp32; only when momentum != 0)
// Floating-point order is fixed (site-name order, element order) and the file is built
// without FMA contraction, so every site computes bitwise the same committed state.
#include "server/sync_engine.h"

#include <fnmatch.h>
#include <openssl/evp.h>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "common/check.h"
#include "common/tensor.h"
#include "server/records.h"

#include "ops/codec.h"

namespace isthmus {
namespace {

using json = nlohmann::json;

// ---- codec ---------------------------------------------------------------------------
using Pipe = codec::Pipeline;
Result<Pipe> ParsePipe(std::string_view text) { return codec::ParsePipeline(text); }
std::string PipeText(const Pipe& p) { return codec::ToString(p); }
std::string DefaultPipeText() { return std::string(codec::kDefaultPipeline); }

// ---- keys and bytes ------------------------------------------------------------------
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
std::string DeltaKey(const std::string& job, const std::string& site, uint64_t round) {
  return JobKey(job, site + std::string(1, '\0') + BigEndian64(round));
}
std::string HeldKey(const std::string& job, const std::string& site, uint64_t round) {
  return JobKey(job,
                "held" + std::string(1, '\0') + site + std::string(1, '\0') + BigEndian64(round));
}
std::string DigestPrefix(const std::string& job) {
  return JobKey(job, "digest" + std::string(1, '\0'));
}
std::string StateKey(const std::string& job, char kind, const std::string& name) {
  return JobKey(job, std::string(1, kind) + std::string(1, '\0') + name);
}
std::string_view FloatBytes(const std::vector<float>& v) {
  return {reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float)};
}
std::string_view FloatBytes(std::span<const float> v) {
  return {reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float)};
}

// Reads an fp32 array of exactly n elements; nullopt if absent.
Result<std::optional<std::vector<float>>> GetFloats(Store* store, Column c, const std::string& key,
                                                    size_t n) {
  ISTHMUS_ASSIGN_OR_RETURN(auto bytes, store->Get(c, key));
  if (!bytes) return std::optional<std::vector<float>>();
  if (bytes->size() != n * sizeof(float)) {
    return Status::Corruption("stored array '" + key + "' has " + std::to_string(bytes->size()) +
                              " bytes, expected " + std::to_string(n * sizeof(float)));
  }
  std::vector<float> v(n);
  std::memcpy(v.data(), bytes->data(), bytes->size());
  return std::optional<std::vector<float>>(std::move(v));
}

void PutU64(std::string& out, uint64_t v) { out += BigEndian64(v); }
void PutStr(std::string& out, std::string_view s) {
  PutU64(out, s.size());
  out.append(s);
}

class Reader {
 public:
  explicit Reader(std::string_view s) : s_(s) {}
  bool U64(uint64_t& v) {
    if (s_.size() < 8) return false;
    v = FromBigEndian64(s_);
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

float MergeWeight(uint64_t tokens, uint64_t total, size_t sites) {
  if (total == 0) return static_cast<float>(1.0 / static_cast<double>(sites));
  return static_cast<float>(static_cast<double>(tokens) / static_cast<double>(total));
}

}  // namespace

// ---- digest ----------------------------------------------------------------------------
std::string StateDigest(uint64_t round, const std::map<std::string, SyncTensor>& theta,
                        const std::map<std::string, std::shared_ptr<const std::vector<float>>>& m,
                        const Membership& members) {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  auto update = [&](std::string_view s) { EVP_DigestUpdate(ctx, s.data(), s.size()); };
  update(BigEndian64(round));
  for (const auto& [name, t] : theta) {
    std::string head;
    PutStr(head, name);
    PutU64(head, t.shape.size());
    for (int64_t d : t.shape) PutU64(head, static_cast<uint64_t>(d));
    update(head);
    update(FloatBytes(*t.data));
    auto it = m.find(name);
    if (it != m.end() && it->second) update(FloatBytes(*it->second));
  }
  std::string tail;
  PutU64(tail, members.epoch);
  PutU64(tail, members.from_round);
  PutU64(tail, members.sites.size());
  for (const auto& s : members.sites) PutStr(tail, s);
  update(tail);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx, md, &len);
  EVP_MD_CTX_free(ctx);
  static const char* kHex = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) {
    hex.push_back(kHex[md[i] >> 4]);
    hex.push_back(kHex[md[i] & 15]);
  }
  return hex;
}

// ---- serialisation -----------------------------------------------------------------------
std::string SyncEngine::SerializeDelta(const EncodedDelta& d) {
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

Result<EncodedDelta> SyncEngine::ParseDelta(std::string_view bytes) {
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

Result<std::map<std::string, SyncTensor>> SyncEngine::ReadTensors(Store* store,
                                                                  const std::string& job) {
  std::map<std::string, SyncTensor> out;
  const std::string prefix = JobKey(job, "");
  Status status;
  ISTHMUS_RETURN_IF_ERROR(
      store->Scan(Column::kTensorMeta, prefix, [&](std::string_view k, std::string_view v) {
        auto rec = DecodeTensorRecord(
            v, "tensor record '" + std::string(k.substr(prefix.size())) + "' of job '" + job + "'");
        if (!rec.ok()) {
          status = rec.status();
          return false;
        }
        out[std::string(k.substr(prefix.size()))].shape = std::move(rec->shape);
        return true;
      }));
  ISTHMUS_RETURN_IF_ERROR(status);
  for (auto& [name, t] : out) {
    ISTHMUS_ASSIGN_OR_RETURN(auto v, GetFloats(store, Column::kTensors, JobKey(job, name),
                                               static_cast<size_t>(NumElements(t.shape))));
    if (!v) return Status::Corruption("tensor '" + name + "' of job '" + job + "' is missing");
    t.data = std::make_shared<const std::vector<float>>(std::move(*v));
  }
  return out;
}

// ---- engine --------------------------------------------------------------------------
SyncEngine::SyncEngine(Store* store, SyncOptions options)
    : store_(store), options_(std::move(options)) {
  hard_cap_ =
      options_.hard_cap_rounds ? options_.hard_cap_rounds : 4 * options_.max_rounds_ahead + 8;
  auto parsed = [](const std::string& text) {
    auto p = ParsePipe(text);
    ISTHMUS_CHECK(p.ok(),
                  "pipeline '" + text + "' was checked by Create: " + p.status().ToString());
    return *p;
  };
  codec_pipe_ = parsed(options_.codec);
  floor_pipe_ = parsed(options_.adaptive_floor);
  ceiling_pipe_ = parsed(options_.adaptive_ceiling);
  dense_pipe_ = parsed("dense");
  defer_pipe_ = parsed("defer");
  for (const auto& o : options_.codec_overrides) {
    const auto eq = o.find('=');
    override_pipes_.emplace_back(o.substr(0, eq), parsed(o.substr(eq + 1)));
  }
}

Result<std::unique_ptr<SyncEngine>> SyncEngine::Create(Store* store, SyncOptions options) {
  if (options.site.empty()) return Status::InvalidArgument("sync.site is not set");
  std::set<std::string> seen{options.site};
  for (const auto& p : options.peer_sites) {
    if (p.empty() || p.find('\0') != std::string::npos) {
      return Status::InvalidArgument("a peer site name is empty");
    }
    if (!seen.insert(p).second) {
      return Status::InvalidArgument("site '" + p +
                                     "' is listed twice (or is this site) in sync.peers");
    }
  }
  if (!std::isfinite(options.outer_lr) || !std::isfinite(options.outer_momentum) ||
      options.outer_momentum < 0 || options.outer_momentum >= 1) {
    return Status::InvalidArgument(
        "sync.outer_lr must be finite and sync.outer_momentum in [0, 1)");
  }
  if (options.codec.empty()) options.codec = DefaultPipeText();
  std::vector<std::string> texts{options.codec};
  for (const auto& o : options.codec_overrides) {
    auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0) {
      return Status::InvalidArgument("sync.codec_overrides entry '" + o + "' is not GLOB=PIPELINE");
    }
    texts.push_back(o.substr(eq + 1));
  }
  if (options.adaptive_floor.empty()) options.adaptive_floor = options.codec;
  if (options.adaptive_ceiling.empty()) options.adaptive_ceiling = "dense";
  texts.push_back(options.adaptive_floor);
  texts.push_back(options.adaptive_ceiling);
  for (const auto& t : texts) {
    auto p = ParsePipe(t);
    if (!p.ok())
      return Status::InvalidArgument("codec pipeline '" + t + "': " + p.status().message());
  }
  return std::unique_ptr<SyncEngine>(new SyncEngine(store, std::move(options)));
}

void SyncEngine::Reset(Store* store) {
  store_ = store;
  jobs_.clear();
  joining_.clear();
  catching_up_.clear();
  draining_.clear();
}

std::vector<std::string> SyncEngine::MemberPeers(const Job& j) const {
  std::vector<std::string> out;
  for (const auto& s : j.members.sites) {
    if (s != options_.site) out.push_back(s);
  }
  return out;
}

std::vector<std::string> SyncEngine::AllSites() const {
  std::vector<std::string> sites = options_.peer_sites;
  sites.push_back(options_.site);
  std::sort(sites.begin(), sites.end());
  return sites;
}

Result<SyncEngine::Job*> SyncEngine::FindJob(const std::string& job) {
  auto it = jobs_.find(job);
  if (it == jobs_.end()) return Status::NotFound("job '" + job + "' does not sync on this shard");
  return &it->second;
}

Result<const SyncEngine::Job*> SyncEngine::FindJob(const std::string& job) const {
  auto it = jobs_.find(job);
  if (it == jobs_.end()) return Status::NotFound("job '" + job + "' does not sync on this shard");
  return &it->second;
}

SyncEngine::Job SyncEngine::NewJob(std::map<std::string, SyncTensor> tensors,
                                   uint64_t version) const {
  Job j;
  j.theta = std::move(tensors);
  j.version = version;
  j.members.sites = AllSites();
  if (options_.outer_momentum != 0) {
    for (const auto& [tname, t] : j.theta) {
      j.momentum[tname] = std::make_shared<const std::vector<float>>(t.data->size(), 0.0f);
    }
  }
  return j;
}

void SyncEngine::AddNewJob(const std::string& name,
                           const std::map<std::string, SyncTensor>& tensors, uint64_t version,
                           WriteBatch* batch) const {
  const Job j = NewJob(tensors, version);
  batch->PutOwned(Column::kSync, JobKey(name, "job"), JobRecord(j));
  batch->PutOwned(Column::kSync, DigestPrefix(name) + BigEndian64(0),
                  StateDigest(0, j.theta, j.momentum, j.members));
}

void SyncEngine::AdoptNewJob(const std::string& name, std::map<std::string, SyncTensor> tensors,
                             uint64_t version) {
  jobs_[name] = NewJob(std::move(tensors), version);
}

Status SyncEngine::AttachJob(const std::string& name, std::map<std::string, SyncTensor> tensors,
                             uint64_t base_version) {
  Job j;
  j.theta = std::move(tensors);
  if (options_.outer_momentum != 0) {
    for (const auto& [tname, t] : j.theta) {
      ISTHMUS_ASSIGN_OR_RETURN(
          auto m, GetFloats(store_, Column::kState, StateKey(name, 'm', tname), t.data->size()));
      j.momentum[tname] = std::make_shared<const std::vector<float>>(
          m ? std::move(*m) : std::vector<float>(t.data->size(), 0.0f));
    }
  }
  ISTHMUS_ASSIGN_OR_RETURN(auto rec_text, store_->Get(Column::kSync, JobKey(name, "job")));
  if (!rec_text) {
    // A job created before it could be attached: its sync state starts now.
    WriteBatch batch;
    AddNewJob(name, j.theta, base_version, &batch);
    ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
    AdoptNewJob(name, std::move(j.theta), base_version);
    return Status::Ok();
  }
  ISTHMUS_ASSIGN_OR_RETURN(static_cast<SyncRecord&>(j), DecodeSyncRecord(*rec_text, name));
  if (j.members.sites.empty()) j.members.sites = AllSites();  // written before memberships
  for (const auto& m : j.members.sites) {
    if (m != options_.site && std::find(options_.peer_sites.begin(), options_.peer_sites.end(),
                                        m) == options_.peer_sites.end()) {
      spdlog::warn(
          "job '{}': member site {} has no sync.peers entry; rounds cannot commit "
          "until it has one or it is removed (isthmusctl sync remove)",
          name, m);
    }
  }
  const std::string held_prefix = JobKey(name, "held" + std::string(1, '\0'));
  Status status;
  ISTHMUS_RETURN_IF_ERROR(
      store_->Scan(Column::kSync, held_prefix, [&](std::string_view k, std::string_view v) {
        std::string_view rest = k.substr(held_prefix.size());
        auto zero = rest.find('\0');
        if (zero == std::string_view::npos || rest.size() != zero + 9) {
          status = Status::Corruption("bad held-delta key in job '" + name + "'");
          return false;
        }
        auto held = ParseUint64(v, "held delta of job '" + name + "'");
        if (!held.ok()) {
          status = Status::Corruption(held.status().message());
          return false;
        }
        j.inbox[std::string(rest.substr(0, zero))][FromBigEndian64(rest.substr(zero + 1))] = *held;
        return true;
      }));
  ISTHMUS_RETURN_IF_ERROR(status);
  Job& placed = jobs_[name] = std::move(j);
  // A crash may have come between the batch that completed a round and its close or
  // commit; finish them now.
  if (placed.staged_round != 0 && placed.staged.size() == placed.theta.size()) {
    ISTHMUS_RETURN_IF_ERROR(CloseRound(name, placed));
  }
  return CommitReady(name, placed);
}

uint64_t SyncEngine::HeldContiguous(const Job& j, const std::string& site) const {
  if (site == options_.site) return j.local;
  // A site no longer merged holds nothing here from its cut on.
  if (auto it = j.removed.find(site); it != j.removed.end() && !j.members.Has(site)) {
    return std::min(j.committed, it->second - 1);
  }
  uint64_t h = j.committed;
  auto it = j.inbox.find(site);
  if (it == j.inbox.end()) return h;
  while (it->second.count(h + 1)) ++h;
  return h;
}

Result<SyncPushResult> SyncEngine::PushRound(const std::string& name, uint64_t round,
                                             uint64_t tokens,
                                             const std::vector<SyncPushTensor>& tensors,
                                             WriteBatch& batch, uint64_t compute_ms) {
  ISTHMUS_ASSIGN_OR_RETURN(Job * j, FindJob(name));
  SyncPushResult result;
  if (round == 0) return Status::InvalidArgument("round pushes start at round 1");
  if (std::string why = NonMemberReason(name, *j, options_.site); !why.empty()) {
    return Status::FailedPrecondition(why + "; this site's workers have nothing to push to");
  }
  if (draining_.count(name) && round > j->local && round != j->staged_round) {
    return Status::FailedPrecondition("this site is leaving job '" + name +
                                      "' (isthmusctl sync leave): it takes no new rounds");
  }
  if (round <= j->local) {
    result.duplicate = true;
    result.version = j->version;
    return result;
  }
  if (round > j->local + 1) {
    return Status::FailedPrecondition("push for round " + std::to_string(round) +
                                      " skips ahead: this site's last closed round is " +
                                      std::to_string(j->local));
  }
  if (round - j->committed > hard_cap_) {
    return Status::FailedPrecondition("round " + std::to_string(round) + " would put this site " +
                                      std::to_string(round - j->committed) +
                                      " rounds ahead of the last committed round " +
                                      std::to_string(j->committed) + " (hard cap " +
                                      std::to_string(hard_cap_) + "): wait for peers' deltas");
  }
  if (tensors.empty()) return Status::InvalidArgument("push carries no tensors");
  std::set<std::string> names;
  for (const auto& t : tensors) {
    auto it = j->theta.find(t.name);
    if (it == j->theta.end()) {
      return Status::NotFound("tensor '" + t.name + "' is not in job '" + name + "'");
    }
    if (t.delta.size() != it->second.data->size()) {
      return Status::InvalidArgument("tensor '" + t.name + "': pushed size differs from the job's");
    }
    if (!std::all_of(t.delta.begin(), t.delta.end(), [](float f) { return std::isfinite(f); })) {
      return Status::InvalidArgument("tensor '" + t.name + "': the delta is not finite");
    }
    if (!names.insert(t.name).second || (j->staged_round == round && j->staged.count(t.name))) {
      return Status::FailedPrecondition("tensor '" + t.name + "' was already pushed for round " +
                                        std::to_string(round));
    }
  }
  SyncRecord next_rec = *j;
  next_rec.staged_round = round;
  next_rec.staged_tokens = std::max(j->staged_round == round ? j->staged_tokens : 0, tokens);
  next_rec.staged = j->staged_round == round ? j->staged : std::set<std::string>{};
  next_rec.staged.insert(names.begin(), names.end());
  if (j->staged_round != round && names.size() == j->theta.size()) {
    // One push brings the whole round: close it from memory, in one write batch with the
    // push's records (no staged copy written, then read back).
    std::map<std::string, std::span<const float>> pushed;
    for (const auto& t : tensors) pushed[t.name] = t.delta;
    j->staged_compute_ms = compute_ms;
    j->staged_round = round;
    j->staged_tokens = tokens;
    j->staged = names;
    Status closed = CloseRound(name, *j, &pushed, &batch);
    if (!closed.ok()) {
      j->staged_round = 0;  // nothing was written: the push failed as a whole
      j->staged_tokens = 0;
      j->staged.clear();
      j->staged_compute_ms = 0;
      return closed;
    }
    result.closed = true;
    ISTHMUS_RETURN_IF_ERROR(CommitReady(name, *j));
    result.version = j->version;
    return result;
  }
  for (const auto& t : tensors)
    batch.Put(Column::kState, StateKey(name, 's', t.name), FloatBytes(t.delta));
  batch.PutOwned(Column::kSync, JobKey(name, "job"), JobRecord(next_rec));
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  j->staged_compute_ms =
      std::max(j->staged_round == round ? j->staged_compute_ms : uint64_t{0}, compute_ms);
  j->staged_round = round;
  j->staged_tokens = next_rec.staged_tokens;
  j->staged = std::move(next_rec.staged);
  if (j->staged.size() == j->theta.size()) {
    // The stage is durable; a failed close is retried at the next attach.
    ISTHMUS_RETURN_IF_ERROR(CloseRound(name, *j));
    result.closed = true;
    ISTHMUS_RETURN_IF_ERROR(CommitReady(name, *j));
  }
  result.version = j->version;
  return result;
}

codec::Pipeline SyncEngine::PipelineFor(const Job& j, const std::string& tensor, uint64_t numel,
                                        uint64_t total_numel) const {
  // Alone, the delta never crosses a link: keep it exact.
  if (options_.peer_sites.empty()) return dense_pipe_;
  if (options_.adaptive && j.last_round_seconds > 0) {
    double min_bw = -1;
    for (const auto& p : MemberPeers(j)) {
      auto it = bandwidth_.find(p);
      if (it == bandwidth_.end()) {
        min_bw = -1;
        break;
      }
      min_bw = min_bw < 0 ? it->second : std::min(min_bw, it->second);
    }
    if (min_bw > 0) {
      double budget = min_bw * j.last_round_seconds * 0.8 * static_cast<double>(numel) /
                      static_cast<double>(std::max<uint64_t>(total_numel, 1));
      return codec::ChooseAdaptive(numel, static_cast<uint64_t>(std::max(budget, 0.0)), floor_pipe_,
                                   ceiling_pipe_);
    }
  }
  for (const auto& [glob, pipe] : override_pipes_) {
    if (fnmatch(glob.c_str(), tensor.c_str(), 0) == 0) return pipe;
  }
  return codec_pipe_;
}

std::map<std::string, uint32_t> AssignFragments(const std::map<std::string, uint64_t>& numel,
                                                uint32_t fragments) {
  std::vector<std::pair<std::string, uint64_t>> order(numel.begin(), numel.end());
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  std::vector<uint64_t> load(std::max<uint32_t>(fragments, 1), 0);
  std::map<std::string, uint32_t> out;
  for (const auto& [tname, n] : order) {
    auto least = static_cast<uint32_t>(std::min_element(load.begin(), load.end()) - load.begin());
    out[tname] = least;
    load[least] += n;
  }
  return out;
}

Status SyncEngine::CloseRound(const std::string& name, Job& j,
                              const std::map<std::string, std::span<const float>>* pushed,
                              WriteBatch* batch_in) {
  const uint64_t round = j.staged_round;
  // The workers' compute time for this round, when they reported it, is the time its
  // transfer should fit in; otherwise the time since the previous close stands in.
  const auto now = options_.now();
  if (j.staged_compute_ms > 0) {
    j.last_round_seconds = static_cast<double>(j.staged_compute_ms) / 1e3;
  } else if (j.last_close) {
    j.last_round_seconds = std::chrono::duration<double>(now - *j.last_close).count();
  }
  // Streaming: only this round's fragment crosses the WAN; the rest waits in the residual.
  std::map<std::string, uint32_t> fragment;
  const uint32_t due =
      static_cast<uint32_t>((round - 1) % std::max<uint32_t>(options_.fragments, 1));
  if (options_.fragments > 1) {
    std::map<std::string, uint64_t> sizes;
    for (const auto& [tname, t] : j.theta) sizes[tname] = t.data->size();
    fragment = AssignFragments(sizes, options_.fragments);
  }
  auto deferred = [&](const std::string& tname) {
    return !fragment.empty() && fragment.at(tname) != due;
  };
  uint64_t total_numel = 0;
  for (const auto& [tname, t] : j.theta) {
    if (!deferred(tname)) total_numel += t.data->size();
  }
  EncodedDelta delta;
  delta.job = name;
  delta.site = options_.site;
  delta.round = round;
  delta.tokens = j.staged_tokens;
  std::vector<std::vector<float>> residuals;
  residuals.reserve(j.theta.size());
  std::map<std::string, uint64_t> pipelines;
  uint64_t raw = 0;
  for (const auto& [tname, t] : j.theta) {
    const size_t n = t.data->size();
    std::optional<std::vector<float>> read;
    std::span<const float> staged;
    if (pushed != nullptr) {
      staged = pushed->at(tname);
    } else {
      ISTHMUS_ASSIGN_OR_RETURN(read,
                               GetFloats(store_, Column::kState, StateKey(name, 's', tname), n));
      if (!read) {
        return Status::Corruption("staged delta of tensor '" + tname + "' of job '" + name +
                                  "' is missing");
      }
      staged = *read;
    }
    ISTHMUS_ASSIGN_OR_RETURN(auto residual,
                             GetFloats(store_, Column::kState, StateKey(name, 'e', tname), n));
    residuals.push_back(residual ? std::move(*residual) : std::vector<float>(n, 0.0f));
    const Pipe& pipe = deferred(tname) ? defer_pipe_ : PipelineFor(j, tname, n, total_numel);
    std::vector<float> decoded(n);
    EncodedTensor et;
    et.name = tname;
    et.shape = t.shape;
    et.bytes = codec::EncodeWithFeedback(pipe, staged, t.shape, residuals.back(), decoded);
    delta.tensors.push_back(std::move(et));
    pipelines[PipeText(pipe)] += 1;
    raw += n * sizeof(float);
  }
  const std::string serialized = SerializeDelta(delta);
  SyncRecord rec = j;  // the round is closed: nothing is staged any more
  rec.local = round;
  rec.version = j.version + 1;
  rec.staged_round = 0;
  rec.staged_tokens = 0;
  rec.staged.clear();
  rec.bytes_encoded += delta.WireBytes();
  rec.raw_bytes += raw;
  rec.pipelines = pipelines;
  WriteBatch local;
  WriteBatch& batch = batch_in != nullptr ? *batch_in : local;
  batch.Put(Column::kDeltas, DeltaKey(name, options_.site, round), serialized);
  batch.PutOwned(Column::kSync, HeldKey(name, options_.site, round), std::to_string(delta.tokens));
  size_t i = 0;
  for (const auto& [tname, _] : j.theta) {
    batch.Put(Column::kState, StateKey(name, 'e', tname), FloatBytes(residuals[i++]));
    if (pushed == nullptr) batch.Delete(Column::kState, StateKey(name, 's', tname));
  }
  batch.PutOwned(Column::kSync, JobKey(name, "job"), JobRecord(rec));
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  j.local = round;
  j.version = rec.version;
  j.staged_round = 0;
  j.staged_tokens = 0;
  j.staged.clear();
  j.bytes_encoded = rec.bytes_encoded;
  j.raw_bytes = rec.raw_bytes;
  j.pipelines = std::move(pipelines);
  j.inbox[options_.site][round] = delta.tokens;
  j.view.reset();
  j.last_close = now;
  j.closed_at[round] = now;
  j.staged_compute_ms = 0;
  spdlog::debug("job '{}': site {} closed round {} ({} -> {} bytes)", name, options_.site, round,
                raw, delta.WireBytes());
  return Status::Ok();
}

Result<std::map<std::string, std::vector<float>>> SyncEngine::Merge(
    const std::string& name, const Job& j, uint64_t round, const std::vector<std::string>& sites,
    std::set<std::string>* sent) {
  uint64_t total = 0;
  for (const auto& s : sites) total += j.inbox.at(s).at(round);
  std::map<std::string, std::vector<float>> merged;
  for (const auto& [tname, t] : j.theta) merged[tname].assign(t.data->size(), 0.0f);
  for (const auto& s : sites) {
    ISTHMUS_ASSIGN_OR_RETURN(auto bytes, store_->Get(Column::kDeltas, DeltaKey(name, s, round)));
    if (!bytes) {
      return Status::Corruption("delta of site " + s + " round " + std::to_string(round) +
                                " of job '" + name + "' is missing");
    }
    ISTHMUS_ASSIGN_OR_RETURN(EncodedDelta d, ParseDelta(*bytes));
    if (d.tensors.size() != merged.size()) {
      return Status::Corruption("stored delta of site " + s + " has the wrong tensor set");
    }
    const float w = MergeWeight(j.inbox.at(s).at(round), total, sites.size());
    std::vector<float> decoded;
    for (const auto& et : d.tensors) {
      auto it = merged.find(et.name);
      if (it == merged.end())
        return Status::Corruption("stored delta has unknown tensor " + et.name);
      // A deferred tensor decodes to zeros (checked when it arrived): nothing to add.
      if (codec::IsDeferred(et.bytes)) continue;
      if (sent != nullptr) sent->insert(et.name);
      decoded.assign(it->second.size(), 0.0f);
      ISTHMUS_RETURN_IF_ERROR(codec::Decode(et.bytes, decoded));
      float* out = it->second.data();
      for (size_t i = 0; i < decoded.size(); ++i) out[i] += w * decoded[i];
    }
  }
  return merged;
}

Status SyncEngine::CommitReady(const std::string& name, Job& j) {
  ISTHMUS_RETURN_IF_ERROR(CommitRounds(name, j));
  // A draining leave goes ahead once this site's last round has committed.
  if (draining_.count(name) && !j.pending && j.staged_round == 0 && j.local == j.committed &&
      j.members.Has(options_.site)) {
    draining_.erase(name);
    auto r = ProposeRemoval(name, options_.site);
    if (!r.ok()) j.change_note = "leave not started: " + r.status().message();
  }
  return Status::Ok();
}

Status SyncEngine::CommitRounds(const std::string& name, Job& j) {
  const auto& sites = j.members.sites;
  if (!j.members.Has(options_.site)) return Status::Ok();  // left or removed: no more rounds
  for (;;) {
    const uint64_t next = j.committed + 1;
    // A membership change agreed to here decides who merges into `next`: wait for it.
    if (j.pending && next >= j.pending->next.from_round) return Status::Ok();
    for (const auto& s : sites) {
      auto it = j.inbox.find(s);
      if (it == j.inbox.end() || !it->second.count(next)) return Status::Ok();
    }
    ISTHMUS_RETURN_IF_ERROR(CommitOne(name, j));
  }
}

Status SyncEngine::CommitOne(const std::string& name, Job& j) {
  const uint64_t round = j.committed + 1;
  const auto sites = j.members.sites;
  std::set<std::string> sent;
  ISTHMUS_ASSIGN_OR_RETURN(auto merged, Merge(name, j, round, sites, &sent));
  ISTHMUS_ASSIGN_OR_RETURN(OuterState next, OuterStep(name, j, round, merged, sent));
  const std::string digest = StateDigest(round, next.theta, next.momentum, j.members);
  SyncRecord rec = j;
  rec.committed = round;
  rec.version = j.version + 1;
  WriteBatch batch;
  CommitBatch(name, j, round, next, sent, sites, digest, rec, batch);
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  PublishCommit(j, round, std::move(next), sites, rec.version);
  spdlog::info("job '{}': committed round {} (digest {})", name, round, digest.substr(0, 16));
  if (auto it = j.closed_at.find(round); it != j.closed_at.end()) {
    const double seconds = std::chrono::duration<double>(options_.now() - it->second).count();
    if (options_.on_commit) options_.on_commit(name, round, seconds);
  }
  j.closed_at.erase(j.closed_at.begin(), j.closed_at.upper_bound(round));
  return Status::Ok();
}

// The outer optimiser on one tensor: theta += lr * g (mu == 0; m unused), or Nesterov:
// m = mu * m + g, theta += lr * (g + mu * m). The commit's arithmetic (this file has no
// fused multiply-adds, so every site gets the same bits), also the optimistic view's.
namespace {

void ApplyOuterStep(float* theta, float* m, const float* g, size_t n, float lr, float mu) {
  if (mu == 0.0f) {
    for (size_t i = 0; i < n; ++i) theta[i] += lr * g[i];
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    m[i] = mu * m[i] + g[i];
    theta[i] += lr * (g[i] + mu * m[i]);
  }
}

}  // namespace

Result<SyncEngine::OuterState> SyncEngine::OuterStep(
    const std::string& name, const Job& j, uint64_t round,
    const std::map<std::string, std::vector<float>>& merged,
    const std::set<std::string>& sent) const {
  const float lr = static_cast<float>(options_.outer_lr);
  const float mu = static_cast<float>(options_.outer_momentum);
  OuterState out;
  for (const auto& [tname, g] : merged) {
    const SyncTensor& old = j.theta.at(tname);
    if (sent.count(tname) == 0) {
      // Every site deferred it (a streamed fragment not due): no outer step, momentum kept.
      out.theta[tname] = old;
      if (mu != 0.0f) out.momentum[tname] = j.momentum.at(tname);
      continue;
    }
    auto next = std::make_shared<std::vector<float>>(*old.data);
    float* th = next->data();
    const size_t n = g.size();
    std::shared_ptr<std::vector<float>> m;
    if (mu != 0.0f) m = std::make_shared<std::vector<float>>(*j.momentum.at(tname));
    ApplyOuterStep(th, m ? m->data() : nullptr, g.data(), n, lr, mu);
    if (m) out.momentum[tname] = std::move(m);
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(th[i])) {
        return Status::FailedPrecondition("committing round " + std::to_string(round) +
                                          " of job '" + name + "' makes tensor '" + tname +
                                          "' non-finite; not committed");
      }
    }
    out.theta[tname] = SyncTensor{old.shape, std::move(next)};
  }
  return out;
}

void SyncEngine::CommitBatch(const std::string& name, const Job& j, uint64_t round,
                             const OuterState& next, const std::set<std::string>& sent,
                             const std::vector<std::string>& sites, const std::string& digest,
                             const SyncRecord& rec, WriteBatch& batch) const {
  const bool momentum = static_cast<float>(options_.outer_momentum) != 0.0f;  // as OuterStep
  for (const auto& [tname, t] : next.theta) {
    if (sent.count(tname) == 0) continue;  // unchanged: neither rewritten nor re-versioned
    batch.Put(Column::kTensors, JobKey(name, tname), FloatBytes(*t.data));
    batch.PutOwned(Column::kTensorMeta, JobKey(name, tname),
                   EncodeTensorRecord({t.shape, rec.version}));
    if (momentum) {
      batch.Put(Column::kState, StateKey(name, 'm', tname), FloatBytes(*next.momentum.at(tname)));
    }
  }
  batch.PutOwned(Column::kSync, DigestPrefix(name) + BigEndian64(round), digest);
  // The round's inputs go: held markers and the peers' deltas.
  for (const auto& s : sites) {
    batch.Delete(Column::kSync, HeldKey(name, s, round));
    if (s != options_.site) batch.Delete(Column::kDeltas, DeltaKey(name, s, round));
  }
  // This site's own delta stays in the outbox until every peer holds it.
  uint64_t min_acked = round;
  for (const auto& p : MemberPeers(j)) {
    auto it = j.acked.find(p);
    min_acked = std::min(min_acked, it == j.acked.end() ? 0 : it->second);
  }
  if (min_acked >= round) batch.Delete(Column::kDeltas, DeltaKey(name, options_.site, round));
  batch.PutOwned(Column::kSync, JobKey(name, "job"), JobRecord(rec));
}

void SyncEngine::PublishCommit(Job& j, uint64_t round, OuterState next,
                               const std::vector<std::string>& sites, uint64_t version) {
  j.theta = std::move(next.theta);
  if (static_cast<float>(options_.outer_momentum) != 0.0f) j.momentum = std::move(next.momentum);
  j.committed = round;
  j.version = version;
  for (const auto& s : sites) {
    auto it = j.inbox.find(s);
    if (it != j.inbox.end()) it->second.erase(round);
  }
  j.view.reset();
}

Result<uint64_t> SyncEngine::AddNow(const std::string& name,
                                    const std::vector<SyncPushTensor>& tensors, WriteBatch& batch) {
  ISTHMUS_ASSIGN_OR_RETURN(Job * j, FindJob(name));
  if (has_peers()) {
    return Status::FailedPrecondition("job '" + name +
                                      "' syncs with other sites: push deltas with a round (>= 1)");
  }
  if (j->staged_round != 0) {
    return Status::FailedPrecondition("round " + std::to_string(j->staged_round) +
                                      " is being pushed; a round-less push would mix into it");
  }
  std::map<std::string, SyncTensor> theta = j->theta;
  std::set<std::string> names;
  for (const auto& t : tensors) {
    auto it = theta.find(t.name);
    if (it == theta.end())
      return Status::NotFound("tensor '" + t.name + "' is not in job '" + name + "'");
    if (t.delta.size() != it->second.data->size() || !names.insert(t.name).second) {
      return Status::InvalidArgument("tensor '" + t.name + "': wrong size or pushed twice");
    }
    auto next = std::make_shared<std::vector<float>>(*it->second.data);
    for (size_t i = 0; i < next->size(); ++i) (*next)[i] += t.delta[i];
    if (!std::all_of(next->begin(), next->end(), [](float f) { return std::isfinite(f); })) {
      return Status::InvalidArgument("adding the delta to tensor '" + t.name +
                                     "' overflows to a non-finite value");
    }
    it->second.data = std::move(next);
  }
  const uint64_t version = j->version + 1;
  SyncRecord rec = *j;
  rec.version = version;
  rec.staged_round = 0;  // as this record has always been written: nothing staged
  rec.staged_tokens = 0;
  rec.staged.clear();
  for (const auto& n : names) {
    const auto& t = theta.at(n);
    batch.Put(Column::kTensors, JobKey(name, n), FloatBytes(*t.data));
    batch.PutOwned(Column::kTensorMeta, JobKey(name, n), EncodeTensorRecord({t.shape, version}));
  }
  batch.PutOwned(Column::kSync, JobKey(name, "job"), JobRecord(rec));
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  j->theta = std::move(theta);
  j->version = version;
  j->view.reset();
  return version;
}

Result<std::map<std::string, SyncTensor>> SyncEngine::View(const std::string& name) {
  ISTHMUS_ASSIGN_OR_RETURN(Job * j, FindJob(name));
  if (j->view) return *j->view;
  std::map<uint64_t, std::vector<std::string>> rounds;  // round -> sites holding it (sorted)
  for (const auto& s : j->members.sites) {
    auto it = j->inbox.find(s);
    if (it == j->inbox.end()) continue;
    for (const auto& [r, _] : it->second) {
      if (r > j->committed) rounds[r].push_back(s);
    }
  }
  if (rounds.empty()) {
    j->view = j->theta;
    return *j->view;
  }
  // Each uncommitted round takes the outer step its commit will take (OuterStep's
  // arithmetic, momentum carried from round to round), with the merge of the deltas known
  // so far standing in for the full merge. A worker thus starts where the commit will most
  // likely put it; raw deltas would be off by the outer learning rate and the momentum
  // (with DiLoCo's Nesterov, far off: the commit moves several times the merged delta).
  const float lr = static_cast<float>(options_.outer_lr);
  const float mu = static_cast<float>(options_.outer_momentum);
  std::map<std::string, std::vector<float>> acc, mom;
  for (const auto& [tname, t] : j->theta) {
    acc[tname] = *t.data;
    if (mu != 0.0f) mom[tname] = *j->momentum.at(tname);
  }
  for (const auto& [r, sites] : rounds) {
    std::set<std::string> sent;
    ISTHMUS_ASSIGN_OR_RETURN(auto merged, Merge(name, *j, r, sites, &sent));
    for (auto& [tname, g] : merged) {
      if (sent.count(tname) == 0) continue;  // deferred by every site: no outer step
      ApplyOuterStep(acc[tname].data(), mu != 0.0f ? mom[tname].data() : nullptr, g.data(),
                     g.size(), lr, mu);
    }
  }
  std::map<std::string, SyncTensor> view;
  for (auto& [tname, v] : acc) {
    view[tname] = SyncTensor{j->theta.at(tname).shape,
                             std::make_shared<const std::vector<float>>(std::move(v))};
  }
  j->view = std::move(view);
  return *j->view;
}

Result<std::map<std::string, SyncTensor>> SyncEngine::Committed(const std::string& name) const {
  ISTHMUS_ASSIGN_OR_RETURN(const Job* j, FindJob(name));
  return j->theta;
}

uint64_t SyncEngine::Version(const std::string& job) const {
  auto it = jobs_.find(job);
  return it == jobs_.end() ? 0 : it->second.version;
}
uint64_t SyncEngine::LocalRound(const std::string& job) const {
  auto it = jobs_.find(job);
  return it == jobs_.end() ? 0 : it->second.local;
}
uint64_t SyncEngine::CommittedRound(const std::string& job) const {
  auto it = jobs_.find(job);
  return it == jobs_.end() ? 0 : it->second.committed;
}

Result<SyncJobStatus> SyncEngine::JobStatus(const std::string& name) const {
  if (auto jt = joining_.find(name); jt != joining_.end() && !jobs_.count(name)) {
    SyncJobStatus s;
    s.job = name;
    s.site = options_.site;
    s.change_note = jt->second.note;
    if (!jt->second.failed) {
      s.pending = jt->second.change.value_or(MembershipChange{{}, jt->second.from});
    }
    return s;
  }
  ISTHMUS_ASSIGN_OR_RETURN(const Job* j, FindJob(name));
  SyncJobStatus s;
  s.job = name;
  s.site = options_.site;
  s.catching_up = catching_up_.count(name) > 0;
  s.draining = draining_.count(name) > 0;
  s.local_round = j->local;
  s.committed_round = j->committed;
  s.staged_round = j->staged_round;
  s.staged_tensors = j->staged.size();
  s.tensor_count = j->theta.size();
  for (const auto& site : j->members.sites) s.held[site] = HeldContiguous(*j, site);
  for (const auto& p : MemberPeers(*j)) {
    auto it = j->acked.find(p);
    s.acked[p] = it == j->acked.end() ? 0 : it->second;
  }
  s.bytes_encoded = j->bytes_encoded;
  s.raw_bytes = j->raw_bytes;
  s.compression_ratio =
      j->bytes_encoded ? static_cast<double>(j->raw_bytes) / static_cast<double>(j->bytes_encoded)
                       : 0.0;
  s.pipelines = j->pipelines;
  s.version = j->version;
  s.members = j->members;
  s.removed = j->removed;
  s.pending = j->pending;
  s.change_note = j->change_note;
  if (j->pending && j->pending->coordinator == options_.site) {
    std::string waiting;
    for (const auto& p : j->pending->next.sites) {
      if (p != options_.site && !j->votes.count(p)) waiting += (waiting.empty() ? "" : ",") + p;
    }
    s.change_note = "waiting for " + (waiting.empty() ? std::string("nobody") : waiting) +
                    " to agree: " + j->pending->Describe(j->members);
  } else if (j->pending) {
    s.change_note = "agreed, waiting for the outcome from " + j->pending->coordinator + ": " +
                    j->pending->Describe(j->members);
  }
  return s;
}

Result<std::vector<std::pair<uint64_t, std::string>>> SyncEngine::Digests(const std::string& name,
                                                                          uint64_t from_round,
                                                                          uint64_t max) const {
  ISTHMUS_ASSIGN_OR_RETURN(const Job* j, FindJob(name));
  (void)j;
  std::vector<std::pair<uint64_t, std::string>> out;
  const std::string prefix = DigestPrefix(name);
  ISTHMUS_RETURN_IF_ERROR(
      store_->Scan(Column::kSync, prefix, [&](std::string_view k, std::string_view v) {
        if (k.size() != prefix.size() + 8) return true;
        uint64_t r = FromBigEndian64(k.substr(prefix.size()));
        if (r < from_round) return true;
        if (out.size() >= max) return false;
        out.emplace_back(r, std::string(v));
        return true;
      }));
  return out;
}

std::vector<std::string> SyncEngine::SyncJobs() const {
  std::vector<std::string> out;
  for (const auto& [name, _] : jobs_) out.push_back(name);
  // A job being joined is named in handshakes too, so that links to members get ready.
  for (const auto& [name, jn] : joining_) {
    if (!jn.failed && !jobs_.count(name)) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

uint64_t SyncEngine::OutboxHighRound(const std::string& job) const { return LocalRound(job); }

Result<std::shared_ptr<const EncodedDelta>> SyncEngine::OutboxDelta(const std::string& name,
                                                                    uint64_t round) {
  ISTHMUS_ASSIGN_OR_RETURN(Job * j, FindJob(name));
  if (round == 0 || round > j->local) {
    return Status::NotFound("round " + std::to_string(round) + " of job '" + name +
                            "' has not been closed on this site");
  }
  ISTHMUS_ASSIGN_OR_RETURN(auto bytes,
                           store_->Get(Column::kDeltas, DeltaKey(name, options_.site, round)));
  if (!bytes) {
    return Status::NotFound("round " + std::to_string(round) + " of job '" + name +
                            "' was acknowledged by every peer and dropped");
  }
  ISTHMUS_ASSIGN_OR_RETURN(EncodedDelta d, ParseDelta(*bytes));
  return std::shared_ptr<const EncodedDelta>(std::make_shared<EncodedDelta>(std::move(d)));
}

void SyncEngine::CollectGarbage(const std::string& name, const Job& j, WriteBatch& batch) const {
  uint64_t limit = j.committed;
  for (const auto& p : MemberPeers(j)) {
    auto it = j.acked.find(p);
    limit = std::min(limit, it == j.acked.end() ? 0 : it->second);
  }
  if (limit == 0) return;
  const std::string prefix = JobKey(name, options_.site + std::string(1, '\0'));
  (void)store_->Scan(Column::kDeltas, prefix, [&](std::string_view k, std::string_view) {
    if (k.size() != prefix.size() + 8) return true;
    if (FromBigEndian64(k.substr(prefix.size())) > limit) return false;
    batch.Delete(Column::kDeltas, std::string(k));
    return true;
  });
}

void SyncEngine::OnPeerAck(const std::string& peer_site, const std::string& name,
                           uint64_t held_round) {
  auto it = jobs_.find(name);
  if (it == jobs_.end() || peer_site == options_.site || !it->second.members.Has(peer_site)) {
    return;
  }
  Job& j = it->second;
  held_round = std::min(held_round, j.local);  // a peer cannot hold more than we produced
  uint64_t& acked = j.acked[peer_site];
  if (held_round <= acked) return;
  const uint64_t before = acked;
  acked = held_round;
  WriteBatch batch;
  CollectGarbage(name, j, batch);
  batch.PutOwned(Column::kSync, JobKey(name, "job"), JobRecord(j));
  Status s = store_->Write(batch);
  if (!s.ok()) {
    acked = before;  // memory follows the store only
    spdlog::warn("job '{}': cannot record ack of {} for round {}: {}", name, peer_site, held_round,
                 s.ToString());
  }
}

void SyncEngine::OnLinkBandwidth(const std::string& peer_site, double bytes_per_second) {
  if (std::isfinite(bytes_per_second) && bytes_per_second > 0)
    bandwidth_[peer_site] = bytes_per_second;
}

Result<std::vector<std::pair<std::string, std::vector<int64_t>>>> SyncEngine::JobTensors(
    const std::string& job) const {
  auto it = jobs_.find(job);
  if (it == jobs_.end()) return Status::NotFound("job '" + job + "' is not synced on this shard");
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const auto& [name, t] : it->second.theta) out.emplace_back(name, t.shape);  // name order
  return out;
}

uint64_t SyncEngine::HeldFrom(const std::string& site, const std::string& job) const {
  auto it = jobs_.find(job);
  return it == jobs_.end() ? 0 : HeldContiguous(it->second, site);
}

Result<uint64_t> SyncEngine::ReceiveDelta(const std::string& from_site, const EncodedDelta& delta) {
  if (delta.site != from_site) {
    return Status::PermissionDenied("peer " + from_site + " sent a delta labelled as site '" +
                                    delta.site + "'");
  }
  if (std::find(options_.peer_sites.begin(), options_.peer_sites.end(), from_site) ==
      options_.peer_sites.end()) {
    return Status::PermissionDenied("site '" + from_site + "' is not a configured peer");
  }
  ISTHMUS_ASSIGN_OR_RETURN(Job * j, FindJob(delta.job));
  const std::string& name = delta.job;
  if (std::string why = NonMemberReason(name, *j, from_site); !why.empty()) {
    return Status::PermissionDenied(why);
  }
  if (delta.round == 0) return Status::InvalidArgument("delta for round 0");
  auto& held = j->inbox[from_site];
  if (delta.round <= j->committed || held.count(delta.round)) {
    return HeldContiguous(*j, from_site);  // duplicate: already held or committed
  }
  if (delta.round > j->committed + 2 * hard_cap_ + 1) {
    return Status::FailedPrecondition("delta for round " + std::to_string(delta.round) +
                                      " is too far ahead of committed round " +
                                      std::to_string(j->committed));
  }
  if (delta.tensors.size() != j->theta.size()) {
    return Status::InvalidArgument("delta of site " + from_site + " round " +
                                   std::to_string(delta.round) + " has " +
                                   std::to_string(delta.tensors.size()) + " tensors, the job " +
                                   std::to_string(j->theta.size()));
  }
  std::set<std::string> seen;
  std::vector<float> scratch;
  for (const auto& et : delta.tensors) {
    auto it = j->theta.find(et.name);
    if (it == j->theta.end() || !seen.insert(et.name).second) {
      return Status::InvalidArgument("delta tensor '" + et.name + "' is unknown or repeated");
    }
    if (et.shape != it->second.shape) {
      return Status::InvalidArgument("delta tensor '" + et.name + "' has the wrong shape");
    }
    scratch.assign(it->second.data->size(), 0.0f);
    Status s = codec::Decode(et.bytes, scratch);
    if (!s.ok()) return Status::InvalidArgument("delta tensor '" + et.name + "': " + s.message());
    for (float f : scratch) {
      if (!std::isfinite(f))
        return Status::InvalidArgument("delta tensor '" + et.name + "' is not finite");
    }
  }
  const std::string serialized = SerializeDelta(delta);
  SyncRecord rec_view = *j;
  rec_view.version = j->version + 1;
  WriteBatch batch;
  batch.Put(Column::kDeltas, DeltaKey(name, from_site, delta.round), serialized);
  batch.PutOwned(Column::kSync, HeldKey(name, from_site, delta.round),
                 std::to_string(delta.tokens));
  batch.PutOwned(Column::kSync, JobKey(name, "job"), JobRecord(rec_view));
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  held[delta.round] = delta.tokens;
  j->version = rec_view.version;
  j->view.reset();
  ISTHMUS_RETURN_IF_ERROR(CommitReady(name, *j));
  return HeldContiguous(*j, from_site);
}

// ---- membership ---------------------------------------------------------------------------

std::string SyncEngine::NonMemberReason(const std::string& name, const Job& j,
                                        const std::string& site) const {
  if (j.members.Has(site)) return "";
  const std::string who = site == options_.site ? "this site (" + site + ")" : "site " + site;
  auto it = j.removed.find(site);
  if (it != j.removed.end()) {
    return who + " is no longer a member of job '" + name +
           "': it left or was removed from round " + std::to_string(it->second) + " (epoch " +
           std::to_string(j.members.epoch) + ", members " + j.members.SiteList() +
           "); it must join again";
  }
  return who + " is not a member of job '" + name + "' (members " + j.members.SiteList() +
         ", epoch " + std::to_string(j.members.epoch) + ")";
}

Result<Membership> SyncEngine::Members(const std::string& name) const {
  ISTHMUS_ASSIGN_OR_RETURN(const Job* j, FindJob(name));
  return j->members;
}

Result<MembershipChange> SyncEngine::ProposeRemoval(const std::string& name,
                                                    const std::string& site) {
  ISTHMUS_ASSIGN_OR_RETURN(Job * j, FindJob(name));
  if (std::string why = NonMemberReason(name, *j, options_.site); !why.empty()) {
    return Status::FailedPrecondition(why);
  }
  if (!j->members.Has(site)) {
    return Status::FailedPrecondition("site " + site + " is not a member of job '" + name +
                                      "' (members " + j->members.SiteList() + ")");
  }
  if (j->pending) {
    if (j->pending->coordinator == options_.site && !j->pending->next.Has(site)) {
      return *j->pending;  // the same change, still under way: asking again is harmless
    }
    return Status::FailedPrecondition("job '" + name + "': a membership change is under way (" +
                                      j->pending->Describe(j->members) +
                                      "); wait for its outcome or abandon it where it started");
  }
  MembershipChange change;
  change.coordinator = options_.site;
  change.next.epoch = j->members.epoch + 1;
  change.next.from_round = j->committed + 1;
  for (const auto& s : j->members.sites) {
    if (s != site) change.next.sites.push_back(s);
  }
  if (change.next.sites.empty()) {
    return Status::FailedPrecondition("job '" + name + "' has no other member");
  }
  for (const auto& s : change.next.sites) {
    if (s != options_.site && std::find(options_.peer_sites.begin(), options_.peer_sites.end(),
                                        s) == options_.peer_sites.end()) {
      return Status::FailedPrecondition("site " + s +
                                        " stays a member but has no sync.peers entry here: "
                                        "it cannot be asked to agree");
    }
  }
  if (site == options_.site && (j->staged_round != 0 || j->local != j->committed)) {
    // A planned leave drains first: no new rounds; the one being pushed may finish; the
    // leave is proposed once every round of this site has committed (MaybeLeave).
    draining_.insert(name);
    j->change_note = "leaving: taking no new rounds, waiting until round " +
                     std::to_string(j->staged_round ? j->staged_round : j->local) +
                     " has committed (committed " + std::to_string(j->committed) + ")";
    spdlog::info("job '{}': {}", name, j->change_note);
    change.next.from_round = 0;  // decided when the leave is proposed
    return change;
  }
  spdlog::info("job '{}': proposing to {}", name, change.Describe(j->members));
  ISTHMUS_RETURN_IF_ERROR(StartChange(name, *j, change));
  return change;
}

Status SyncEngine::StartChange(const std::string& name, Job& j, const MembershipChange& change) {
  SyncRecord rec = j;
  rec.pending = change;
  WriteBatch batch;
  batch.PutOwned(Column::kSync, JobKey(name, "job"), JobRecord(rec));
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  j.pending = change;
  j.votes.clear();
  j.change_note.clear();
  if (change.coordinator == options_.site &&
      change.next.sites == std::vector<std::string>{options_.site}) {
    return ApplyChange(name, j);  // nobody else to ask
  }
  return Status::Ok();
}

Result<bool> SyncEngine::ProposeSilentRemoval(const std::string& name,
                                              const std::set<std::string>& silent) {
  ISTHMUS_ASSIGN_OR_RETURN(Job * j, FindJob(name));
  if (!j->members.Has(options_.site) || j->pending) return false;
  std::vector<std::string> gone, remaining;
  for (const auto& s : j->members.sites) {
    (s != options_.site && silent.count(s) ? gone : remaining).push_back(s);
  }
  if (gone.empty()) return false;
  std::string who;
  for (const auto& s : gone) who += (who.empty() ? "" : ",") + s;
  if (j->members.sites.size() < 3) {
    j->change_note = "silent: " + who + "; with two sites nothing is removed automatically";
    return false;
  }
  if (2 * remaining.size() <= j->members.sites.size()) {
    j->change_note = "silent: " + who + "; the others are no majority of " + j->members.SiteList() +
                     ", so nothing is removed automatically";
    return false;
  }
  if (remaining.front() != options_.site) return false;  // the first-named remaining proposes
  MembershipChange change;
  change.coordinator = options_.site;
  change.next.epoch = j->members.epoch + 1;
  change.next.from_round = j->committed + 1;
  change.next.sites = remaining;
  for (const auto& s : remaining) {
    if (!Configured(s)) return false;
  }
  spdlog::warn("job '{}': {} silent past sync.remove_silent_after_s: proposing to {}", name, who,
               change.Describe(j->members));
  ISTHMUS_RETURN_IF_ERROR(StartChange(name, *j, change));
  return true;
}

Status SyncEngine::AbandonChange(const std::string& name) {
  ISTHMUS_ASSIGN_OR_RETURN(Job * j, FindJob(name));
  if (draining_.erase(name) > 0 && !j->pending) {
    j->change_note = "leave abandoned by the operator: this site takes rounds again";
    return Status::Ok();
  }
  if (!j->pending) {
    return Status::FailedPrecondition("job '" + name + "': no membership change is under way");
  }
  if (j->pending->coordinator != options_.site) {
    return Status::FailedPrecondition("job '" + name + "': the change is coordinated by site " +
                                      j->pending->coordinator +
                                      "; abandon it there (this site learns the outcome from it)");
  }
  return DropChange(name, *j, "abandoned by the operator: " + j->pending->Describe(j->members));
}

Status SyncEngine::DropChange(const std::string& name, Job& j, const std::string& why) {
  SyncRecord rec = j;
  rec.pending.reset();
  WriteBatch batch;
  batch.PutOwned(Column::kSync, JobKey(name, "job"), JobRecord(rec));
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  // A site whose addition was given up is told why at its next join request, however the
  // messages interleaved (it may never have seen this proposal).
  for (const auto& s : j.pending->next.sites) {
    if (!j.members.Has(s)) j.join_refusals[s] = why;
  }
  j.pending.reset();
  j.votes.clear();
  j.change_note = why;
  spdlog::warn("job '{}': membership change {}", name, why);
  return CommitReady(name, j);  // commits held for the change may go ahead
}

Status SyncEngine::ApplyChange(const std::string& name, Job& j) {
  ISTHMUS_CHECK(j.pending.has_value(), "ApplyChange without a pending change");
  const MembershipChange change = *j.pending;
  SyncRecord rec = j;
  rec.members = change.next;
  rec.pending.reset();
  rec.version = j.version + 1;
  WriteBatch batch;
  std::vector<std::string> gone;
  for (const auto& s : j.members.sites) {
    if (change.next.Has(s)) continue;
    gone.push_back(s);
    rec.removed[s] = change.next.from_round;
    rec.acked.erase(s);
    // Its deltas for rounds from the cut on are dropped; every earlier round has been
    // committed with its delta by every site of the new membership.
    if (s == options_.site) continue;
    auto it = j.inbox.find(s);
    if (it == j.inbox.end()) continue;
    for (const auto& [r, _] : it->second) {
      batch.Delete(Column::kSync, HeldKey(name, s, r));
      batch.Delete(Column::kDeltas, DeltaKey(name, s, r));
    }
  }
  for (const auto& s : change.next.sites) {
    if (j.members.Has(s)) continue;
    // An added site holds the state of every round before its first: it needs none of them.
    rec.removed.erase(s);
    rec.joined[s] = change.next.from_round;
    if (s != options_.site) rec.acked[s] = std::max(rec.acked[s], change.next.from_round - 1);
  }
  batch.PutOwned(Column::kSync, JobKey(name, "job"), JobRecord(rec));
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  const std::string what = change.Describe(j.members);
  static_cast<SyncRecord&>(j) = rec;
  for (const auto& s : gone) {
    if (s != options_.site) j.inbox.erase(s);
  }
  j.votes.clear();
  j.change_note = "applied: " + what;
  j.view.reset();
  spdlog::info("job '{}': membership changed: {}", name, what);
  return CommitReady(name, j);
}

std::string SyncEngine::PrepareRefusal(const Job& j, const std::string& from,
                                       const MembershipChange& c) const {
  const std::string here = "site " + options_.site;
  if (c.coordinator != from) {
    return "site " + from + " sent a change coordinated by " + c.coordinator;
  }
  if (!j.members.Has(from)) return "site " + from + " is not a member here";
  if (!c.next.Has(options_.site)) return here + " is not in the proposed membership";
  if (c.next.epoch != j.members.epoch + 1) {
    return here + " is at membership epoch " + std::to_string(j.members.epoch) + " (members " +
           j.members.SiteList() + "), the change needs epoch " + std::to_string(c.next.epoch - 1) +
           ": the sites disagree on the membership";
  }
  if (c.next.from_round != j.committed + 1) {
    return here + " has committed round " + std::to_string(j.committed) + ", site " +
           c.coordinator + " round " + std::to_string(c.next.from_round - 1) +
           ": the sites disagree on rounds, so they would not merge the same deltas (run "
           "isthmusctl sync catch-up --from " +
           (j.committed < c.next.from_round - 1 ? c.coordinator + " on site " + options_.site
                                                : options_.site + " on site " + c.coordinator) +
           ", then try again)";
  }
  std::vector<std::string> gone, added;
  for (const auto& s : j.members.sites) {
    if (!c.next.Has(s)) gone.push_back(s);
  }
  for (const auto& s : c.next.sites) {
    if (!j.members.Has(s)) added.push_back(s);
  }
  if (gone.empty() == added.empty() || added.size() > 1) {
    return "the change is neither a removal nor the addition of one site to " +
           j.members.SiteList();
  }
  if (!added.empty() && !Configured(added[0])) {
    return "site " + added[0] + " has no sync.peers entry at " + here +
           ": add it (sync.peers and security.peer_keys) and restart this shard before it joins";
  }
  return "";
}

MembershipAnswer SyncEngine::OnMembershipRequest(const std::string& from,
                                                 const MembershipRequest& req) {
  auto it = jobs_.find(req.job);
  if (it == jobs_.end()) {
    if (joining_.count(req.job)) return OnJoiningRequest(from, req);
    return {MembershipVote::kRefused, "job '" + req.job + "' does not sync on this shard"};
  }
  Job& j = it->second;
  const MembershipChange& c = req.change;
  if (req.step == MembershipStep::kJoin) {
    if (std::string why = NonMemberReason(req.job, j, options_.site); !why.empty()) {
      return {MembershipVote::kRefused, why};
    }
    if (auto r = j.join_refusals.find(from); r != j.join_refusals.end() && !j.pending) {
      std::string why = "its addition was given up: " + r->second;
      j.join_refusals.erase(r);  // a later join is proposed afresh
      return {MembershipVote::kRefused, why};
    }
    if (j.members.Has(from)) {
      return {MembershipVote::kRefused, "site " + from + " is already a member of job '" + req.job +
                                            "' (epoch " + std::to_string(j.members.epoch) + ")"};
    }
    if (j.pending) {
      if (j.pending->coordinator == options_.site && j.pending->next.Has(from)) {
        return {MembershipVote::kPending, j.pending->Describe(j.members)};
      }
      return {MembershipVote::kRefused, "another change is under way at site " + options_.site +
                                            ": " + j.pending->Describe(j.members)};
    }
    auto added = ProposeAddition(req.job, j, from);
    if (!added.ok()) return {MembershipVote::kRefused, added.status().message()};
    return {MembershipVote::kPending, added->Describe(j.members)};
  }
  if (req.step == MembershipStep::kFetch && j.members.Has(from) && j.members.Has(options_.site) &&
      c.coordinator == options_.site && c.next == j.members) {
    // A member catching up: this site's committed state as it stands.
    auto image = Image(req.job, j);
    if (!image.ok()) return {MembershipVote::kRefused, image.status().ToString()};
    return {MembershipVote::kPrepared, "", (*image)->digest, *image};
  }
  if (req.step == MembershipStep::kFetch) {
    if (!j.pending || !(*j.pending == c) || c.coordinator != options_.site || !c.next.Has(from)) {
      return {MembershipVote::kRefused,
              "no addition of site " + from + " is under way at site " + options_.site +
                  (j.change_note.empty() ? std::string() : " (" + j.change_note + ")")};
    }
    auto image = Image(req.job, j);
    if (!image.ok()) return {MembershipVote::kRefused, image.status().ToString()};
    MembershipAnswer a{MembershipVote::kPrepared, "", (*image)->digest, *image};
    return a;
  }
  if (req.step == MembershipStep::kDigest) {
    const uint64_t round = c.next.from_round == 0 ? 0 : c.next.from_round - 1;
    if (j.committed < round) {
      return {MembershipVote::kPending,
              "round " + std::to_string(round) + " is not committed here"};
    }
    auto d = Digests(req.job, round, 1);
    if (!d.ok() || d->empty() || d->front().first != round) {
      return {MembershipVote::kRefused, "no digest of round " + std::to_string(round) + " here"};
    }
    return {MembershipVote::kPrepared, "", d->front().second, nullptr};
  }
  if (req.step == MembershipStep::kQuery) {
    if (c.coordinator != options_.site) {
      return {MembershipVote::kRefused, "site " + options_.site + " does not coordinate it"};
    }
    if (j.pending && *j.pending == c) return {MembershipVote::kPending, ""};
    if (j.members == c.next || j.members.epoch > c.next.epoch)
      return {MembershipVote::kApplied, ""};
    return {MembershipVote::kAbandoned, j.change_note};
  }
  if (j.members == c.next) return {MembershipVote::kApplied, ""};  // a retry: already in effect
  if (j.pending) {
    if (*j.pending == c) return {MembershipVote::kPrepared, ""};
    return {MembershipVote::kRefused, "another change is under way at site " + options_.site +
                                          ": " + j.pending->Describe(j.members)};
  }
  if (std::string why = PrepareRefusal(j, from, c); !why.empty()) {
    spdlog::warn("job '{}': refused {}: {}", req.job, c.Describe(j.members), why);
    return {MembershipVote::kRefused, why};
  }
  if (Status s = StartChange(req.job, j, c); !s.ok()) {
    return {MembershipVote::kRefused, "cannot record the change here: " + s.ToString()};
  }
  spdlog::info("job '{}': agreed to {}", req.job, c.Describe(j.members));
  return {MembershipVote::kPrepared, ""};
}

std::vector<MembershipRequest> SyncEngine::MembershipRequests(const std::string& peer) {
  std::vector<MembershipRequest> out;
  for (const auto& [name, from] : catching_up_) {
    auto it = jobs_.find(name);
    if (peer == from && it != jobs_.end()) {
      out.push_back({name, MembershipStep::kFetch, {it->second.members, from}});
    }
  }
  for (const auto& [name, jn] : joining_) {
    if (jn.failed || jobs_.count(name)) continue;
    if (!jn.change) {
      if (peer == jn.from) {
        out.push_back({name, MembershipStep::kJoin, {{0, {options_.site}, 0}, jn.from}});
      }
    } else if (!jn.image) {
      if (peer == jn.from) out.push_back({name, MembershipStep::kFetch, *jn.change});
    } else if (peer == jn.from) {
      // The state is here and the members' digests are being asked for. The coordinator may
      // have given the addition up since it sent the state (a member refused it), and such a
      // member never answers this site: ask the coordinator how the change stands meanwhile.
      out.push_back({name, MembershipStep::kQuery, *jn.change});
    } else if (jn.image->members.Has(peer) && !jn.digests.count(peer)) {
      out.push_back({name, MembershipStep::kDigest, *jn.change});
    }
  }
  for (const auto& [name, j] : jobs_) {
    if (!j.pending) continue;
    const MembershipChange& c = *j.pending;
    if (c.coordinator == options_.site) {
      if (peer != options_.site && c.next.Has(peer) && !j.votes.count(peer)) {
        out.push_back({name, MembershipStep::kPrepare, c});
      }
    } else if (peer == c.coordinator) {
      out.push_back({name, MembershipStep::kQuery, c});
    }
  }
  return out;
}

void SyncEngine::OnMembershipAnswer(const std::string& peer, const MembershipRequest& req,
                                    const MembershipAnswer& answer) {
  auto it = jobs_.find(req.job);
  if (it == jobs_.end()) {
    OnJoiningAnswer(peer, req, answer);
    return;
  }
  Job& j = it->second;
  if (req.step == MembershipStep::kFetch) {
    OnCatchUpAnswer(req.job, j, peer, answer);
    return;
  }
  if (!j.pending || !(*j.pending == req.change)) return;  // an answer about an older change
  Status s;
  if (req.step == MembershipStep::kPrepare) {
    if (answer.vote == MembershipVote::kPrepared || answer.vote == MembershipVote::kApplied) {
      j.votes.insert(peer);
      bool all = true;
      for (const auto& p : j.pending->next.sites) all &= p == options_.site || j.votes.count(p);
      if (all && std::getenv("ISTHMUS_SERVER_FAULT_CRASH_BEFORE_APPLY") != nullptr) {
        // Fault injection for tests (docs/TESTING.md): every site agreed, nothing applied yet.
        spdlog::error("ISTHMUS_SERVER_FAULT_CRASH_BEFORE_APPLY: exiting before the change applies");
        std::_Exit(137);
      }
      if (all) s = ApplyChange(req.job, j);
    } else if (answer.vote == MembershipVote::kRefused) {
      s = DropChange(req.job, j, "refused by site " + peer + ": " + answer.reason);
    }
  } else if (answer.vote == MembershipVote::kApplied) {
    s = ApplyChange(req.job, j);
  } else if (answer.vote == MembershipVote::kAbandoned || answer.vote == MembershipVote::kRefused) {
    s = DropChange(req.job, j,
                   "abandoned by its coordinator " + peer +
                       (answer.reason.empty() ? std::string() : " (" + answer.reason + ")"));
  }
  if (!s.ok()) spdlog::warn("job '{}': membership change: {}", req.job, s.ToString());
}

uint64_t SyncEngine::FirstRoundTo(const std::string& peer, const std::string& job) const {
  auto it = jobs_.find(job);
  if (it == jobs_.end() || !it->second.members.Has(options_.site) ||
      !it->second.members.Has(peer)) {
    return 0;
  }
  auto joined = it->second.joined.find(peer);
  return joined == it->second.joined.end() ? 1 : joined->second;
}

std::vector<std::string> SyncEngine::StatusJobs() const {
  std::vector<std::string> out = SyncJobs();
  for (const auto& [name, jn] : joining_) {
    if (jn.failed && !jobs_.count(name)) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string SyncEngine::RefusesPeer(const std::string& site, const std::string& job) const {
  auto it = jobs_.find(job);
  if (it == jobs_.end()) return "";
  const Job& j = it->second;
  if (!j.members.Has(options_.site)) {
    // Joined and agreed, waiting for the addition to apply: the links must work.
    if (j.pending && j.pending->next.Has(options_.site)) return "";
    return NonMemberReason(job, j, options_.site);
  }
  return j.removed.count(site) ? NonMemberReason(job, j, site) : "";
}

// ---- joining ------------------------------------------------------------------------------

bool SyncEngine::Configured(const std::string& site) const {
  return site == options_.site || std::find(options_.peer_sites.begin(), options_.peer_sites.end(),
                                            site) != options_.peer_sites.end();
}

Result<MembershipChange> SyncEngine::ProposeAddition(const std::string& name, Job& j,
                                                     const std::string& site) {
  MembershipChange change;
  change.coordinator = options_.site;
  change.next = j.members;
  change.next.sites.push_back(site);
  std::sort(change.next.sites.begin(), change.next.sites.end());
  change.next.epoch = j.members.epoch + 1;
  change.next.from_round = j.committed + 1;
  for (const auto& s : change.next.sites) {
    if (!Configured(s)) {
      return Status::FailedPrecondition("site " + s + " has no sync.peers entry at site " +
                                        options_.site + ": it cannot be asked to agree");
    }
  }
  spdlog::info("job '{}': site {} asks to join: proposing to {}", name, site,
               change.Describe(j.members));
  ISTHMUS_RETURN_IF_ERROR(StartChange(name, j, change));
  return change;
}

Result<std::shared_ptr<const JobImage>> SyncEngine::Image(const std::string& name,
                                                          const Job& j) const {
  auto image = std::make_shared<JobImage>();
  image->round = j.committed;
  image->members = j.members;
  image->version = j.version;
  image->base_hash = hooks_.base_hash ? hooks_.base_hash(name) : "";
  ISTHMUS_ASSIGN_OR_RETURN(auto d, Digests(name, j.committed, 1));
  if (d.empty() || d.front().first != j.committed) {
    return Status::Corruption("job '" + name + "' has no digest of its committed round");
  }
  image->digest = d.front().second;
  for (const auto& [tname, t] : j.theta) {
    ImageTensor it{tname, t.shape, t.data, nullptr};
    if (auto m = j.momentum.find(tname); m != j.momentum.end()) it.momentum = m->second;
    image->tensors.push_back(std::move(it));
  }
  return std::shared_ptr<const JobImage>(std::move(image));
}

Status SyncEngine::StartJoin(const std::string& name, const std::string& from) {
  if (auto it = jobs_.find(name); it != jobs_.end()) {
    return Status::FailedPrecondition("job '" + name + "' already syncs on this shard (members " +
                                      it->second.members.SiteList() +
                                      "): a site joins a job it does not hold yet");
  }
  if (from == options_.site || !Configured(from)) {
    return Status::NotFound("site '" + from + "' has no sync.peers entry here");
  }
  if (!hooks_.install) return Status::FailedPrecondition("this shard cannot create joined jobs");
  auto it = joining_.find(name);
  if (it != joining_.end() && !it->second.failed && it->second.from == from) {
    return Status::Ok();  // under way
  }
  Joining jn;
  jn.from = from;
  jn.note = "joining: asking site " + from + " to add this site";
  joining_[name] = std::move(jn);
  spdlog::info("job '{}': joining, asking site {} to coordinate", name, from);
  return Status::Ok();
}

MembershipAnswer SyncEngine::OnJoiningRequest(const std::string& from,
                                              const MembershipRequest& req) {
  Joining& jn = joining_.at(req.job);
  const MembershipChange& c = req.change;
  if (jn.failed || req.step != MembershipStep::kPrepare || from != jn.from ||
      c.coordinator != from || !c.next.Has(options_.site)) {
    return {MembershipVote::kRefused, "site " + options_.site + " does not hold job '" + req.job +
                                          "' yet and is not joining it through site " + from};
  }
  if (!jn.change || !(*jn.change == c)) {
    jn.change = c;
    jn.image.reset();
    jn.digests.clear();
  }
  if (!jn.image) {
    jn.note = "joining: fetching the state of round " + std::to_string(c.next.from_round - 1) +
              " from site " + from;
  }
  return {MembershipVote::kPending, jn.note};
}

std::string SyncEngine::ImageProblem(const Joining& jn, const JobImage& image) const {
  const MembershipChange& c = *jn.change;
  Membership expect = image.members;
  expect.sites.push_back(options_.site);
  std::sort(expect.sites.begin(), expect.sites.end());
  if (image.round + 1 != c.next.from_round || image.members.epoch + 1 != c.next.epoch ||
      expect.sites != c.next.sites || image.members.Has(options_.site)) {
    return "the state of round " + std::to_string(image.round) + " does not fit the addition (" +
           c.Describe(image.members) + ")";
  }
  if (image.tensors.empty()) return "the state has no tensors";
  std::map<std::string, SyncTensor> theta;
  std::map<std::string, std::shared_ptr<const std::vector<float>>> momentum;
  const bool keeps = options_.outer_momentum != 0;
  for (const auto& t : image.tensors) {
    if (static_cast<bool>(t.momentum) != keeps) {
      return "site " + jn.from +
             " keeps outer momentum and this site does not, or the reverse "
             "(sync.outer_momentum must be the same on every site)";
    }
    theta[t.name] = SyncTensor{t.shape, t.theta};
    if (t.momentum) momentum[t.name] = t.momentum;
  }
  const std::string digest = StateDigest(image.round, theta, momentum, image.members);
  if (digest != image.digest) {
    return "the state from site " + jn.from + " hashes to " + digest.substr(0, 16) +
           ", not to its digest " + image.digest.substr(0, 16);
  }
  return "";
}

void SyncEngine::OnJoiningAnswer(const std::string& peer, const MembershipRequest& req,
                                 const MembershipAnswer& answer) {
  auto jt = joining_.find(req.job);
  if (jt == joining_.end() || jt->second.failed) return;
  Joining& jn = jt->second;
  auto fail = [&](const std::string& why) {
    jn.failed = true;
    jn.note = "join failed: " + why;
    spdlog::warn("job '{}': {}", req.job, jn.note);
  };
  if (answer.vote == MembershipVote::kRefused || answer.vote == MembershipVote::kAbandoned) {
    if (req.step == MembershipStep::kDigest && jn.image && !jn.image->members.Has(peer)) return;
    return fail("site " + peer + " refused: " + answer.reason);
  }
  if (req.step == MembershipStep::kFetch && answer.image && jn.change && *jn.change == req.change &&
      !jn.image) {
    if (std::string why = ImageProblem(jn, *answer.image); !why.empty()) return fail(why);
    jn.image = answer.image;
    jn.digests[peer] = answer.image->digest;
    jn.note = "joining: checking the state of round " + std::to_string(jn.image->round) +
              " against the members' digests";
  } else if (req.step == MembershipStep::kDigest && jn.image && jn.change &&
             *jn.change == req.change && answer.vote == MembershipVote::kPrepared) {
    jn.digests[peer] = answer.digest;
  }
  if (!jn.image) return;
  for (const auto& m : jn.image->members.sites) {
    auto d = jn.digests.find(m);
    if (d == jn.digests.end()) return;  // still asking
    if (d->second != jn.image->digest) {
      return fail("site " + m + " reports digest " + d->second.substr(0, 16) + " for round " +
                  std::to_string(jn.image->round) + ", site " + jn.from + " " +
                  jn.image->digest.substr(0, 16) + ": the members disagree");
    }
  }
  if (Status s = InstallJoined(req.job, jn); !s.ok())
    fail("cannot create the job: " + s.ToString());
}

Status SyncEngine::InstallJoined(const std::string& name, Joining& jn) {
  const JobImage& image = *jn.image;
  Job j;
  for (const auto& t : image.tensors) {
    j.theta[t.name] = SyncTensor{t.shape, t.theta};
    if (t.momentum) j.momentum[t.name] = t.momentum;
  }
  j.committed = j.local = image.round;
  j.version = image.version;
  j.members = image.members;
  j.pending = jn.change;
  WriteBatch batch;
  for (const auto& [tname, m] : j.momentum) {
    batch.Put(Column::kState, StateKey(name, 'm', tname), FloatBytes(*m));
  }
  batch.PutOwned(Column::kSync, JobKey(name, "job"), JobRecord(j));
  batch.PutOwned(Column::kSync, DigestPrefix(name) + BigEndian64(image.round), image.digest);
  ISTHMUS_RETURN_IF_ERROR(hooks_.install(name, image.base_hash, j.theta, image.version, batch));
  std::string members;
  for (const auto& [site, _] : jn.digests) members += (members.empty() ? "" : ",") + site;
  j.change_note = "joined at round " + std::to_string(image.round) + " with the state of site " +
                  jn.from + ", digest " + image.digest.substr(0, 16) + " confirmed by " + members;
  spdlog::info("job '{}': {}", name, j.change_note);
  jobs_[name] = std::move(j);
  joining_.erase(name);
  return Status::Ok();
}

// ---- catching up --------------------------------------------------------------------------

Status SyncEngine::StartCatchUp(const std::string& name, const std::string& from) {
  ISTHMUS_ASSIGN_OR_RETURN(Job * j, FindJob(name));
  if (std::string why = NonMemberReason(name, *j, options_.site); !why.empty()) {
    return Status::FailedPrecondition(why);
  }
  if (from == options_.site || !j->members.Has(from)) {
    return Status::FailedPrecondition("site " + from + " is not another member of job '" + name +
                                      "' (members " + j->members.SiteList() + ")");
  }
  if (j->pending) {
    return Status::FailedPrecondition("job '" + name + "': a membership change is under way (" +
                                      j->pending->Describe(j->members) + ")");
  }
  catching_up_[name] = from;
  j->change_note = "catching up: asking site " + from + " for its committed state";
  spdlog::info("job '{}': catching up from site {}", name, from);
  return Status::Ok();
}

void SyncEngine::OnCatchUpAnswer(const std::string& name, Job& j, const std::string& peer,
                                 const MembershipAnswer& answer) {
  auto it = catching_up_.find(name);
  if (it == catching_up_.end() || it->second != peer) return;
  catching_up_.erase(it);
  auto fail = [&](const std::string& why) {
    j.change_note = "catch-up failed: " + why;
    spdlog::warn("job '{}': {}", name, j.change_note);
  };
  if (answer.vote != MembershipVote::kPrepared || !answer.image) {
    return fail("site " + peer + " refused: " + answer.reason);
  }
  const JobImage& image = *answer.image;
  if (image.members != j.members) {
    return fail("site " + peer + " is at epoch " + std::to_string(image.members.epoch) +
                " (members " + image.members.SiteList() + "), this site at epoch " +
                std::to_string(j.members.epoch));
  }
  if (j.pending) return fail("a membership change started meanwhile");
  if (image.round <= j.committed) {
    j.change_note = "nothing to catch up: site " + peer + " has committed round " +
                    std::to_string(image.round) + ", this site round " +
                    std::to_string(j.committed);
    return;
  }
  std::map<std::string, SyncTensor> theta;
  std::map<std::string, std::shared_ptr<const std::vector<float>>> momentum;
  for (const auto& t : image.tensors) {
    auto mine = j.theta.find(t.name);
    if (mine == j.theta.end() || mine->second.shape != t.shape) {
      return fail("tensor '" + t.name + "' of site " + peer + " is not one of this job's");
    }
    if (static_cast<bool>(t.momentum) != (options_.outer_momentum != 0)) {
      return fail("sync.outer_momentum differs between this site and site " + peer);
    }
    theta[t.name] = SyncTensor{t.shape, t.theta};
    if (t.momentum) momentum[t.name] = t.momentum;
  }
  if (theta.size() != j.theta.size()) return fail("site " + peer + " sent another tensor set");
  const std::string digest = StateDigest(image.round, theta, momentum, image.members);
  if (digest != image.digest) {
    return fail("the state from site " + peer + " does not hash to its digest");
  }
  // One batch: the state of round image.round, its digest, and the removal of the inputs of
  // the rounds it covers (their result is that state).
  SyncRecord rec = j;
  rec.committed = image.round;
  rec.local = std::max(j.local, image.round);
  rec.version = std::max(j.version, image.version) + 1;
  WriteBatch batch;
  for (const auto& [tname, t] : theta) {
    batch.Put(Column::kTensors, JobKey(name, tname), FloatBytes(*t.data));
    batch.PutOwned(Column::kTensorMeta, JobKey(name, tname),
                   EncodeTensorRecord({t.shape, rec.version}));
    if (t.data && momentum.count(tname)) {
      batch.Put(Column::kState, StateKey(name, 'm', tname), FloatBytes(*momentum.at(tname)));
    }
  }
  batch.PutOwned(Column::kSync, DigestPrefix(name) + BigEndian64(image.round), image.digest);
  for (const auto& [site, rounds] : j.inbox) {
    for (const auto& [r, _] : rounds) {
      if (r > image.round) continue;
      batch.Delete(Column::kSync, HeldKey(name, site, r));
      if (site != options_.site) batch.Delete(Column::kDeltas, DeltaKey(name, site, r));
    }
  }
  batch.PutOwned(Column::kSync, JobKey(name, "job"), JobRecord(rec));
  if (Status s = store_->Write(batch); !s.ok()) return fail(s.ToString());
  const uint64_t before = j.committed;
  static_cast<SyncRecord&>(j) = rec;
  j.theta = std::move(theta);
  if (options_.outer_momentum != 0) j.momentum = std::move(momentum);
  for (auto& [site, rounds] : j.inbox) {
    for (auto r = rounds.begin(); r != rounds.end();) {
      r = r->first <= image.round ? rounds.erase(r) : std::next(r);
    }
  }
  j.view.reset();
  j.change_note = "caught up from round " + std::to_string(before) + " to round " +
                  std::to_string(image.round) + " with the state of site " + peer + " (digest " +
                  image.digest.substr(0, 16) + ")";
  spdlog::info("job '{}': {}", name, j.change_note);
  if (Status s = CommitReady(name, j); !s.ok()) spdlog::warn("job '{}': {}", name, s.ToString());
}

}  // namespace isthmus
