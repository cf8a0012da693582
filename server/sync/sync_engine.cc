// The round protocol engine: staging, round close with error feedback, inbox, commit with
// Nesterov momentum, digests and the optimistic view. Its durable state is the SyncRecord,
// held-delta markers, digests, deltas and per-tensor state rows of storage/keys.h.
// Floating-point order is fixed (site-name order, element order) and the file is built
// without FMA contraction, so every site computes bitwise the same committed state.
#include "server/sync/sync_engine.h"

#include <fnmatch.h>
#include <pthread.h>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "common/check.h"
#include "common/pipelined.h"
#include "common/state_digest.h"
#include "common/tensor.h"
#include "server/storage/keys.h"

#include "ops/codec.h"
#include "ops/codec_outer.h"

namespace isthmus {
namespace {

using json = nlohmann::json;

// ---- codec ---------------------------------------------------------------------------
using Pipe = codec::Pipeline;
Result<Pipe> ParsePipe(std::string_view text) { return codec::ParsePipeline(text); }
std::string PipeText(const Pipe& p) { return codec::ToString(p); }
// How a round's pipeline counts (SyncRecord::pipelines) name the tensors their workers
// encoded (docs/SYNC.md, "Deltas encoded by the worker").
constexpr std::string_view kEncodedByWorker = "by-worker";

// ---- keys and bytes ------------------------------------------------------------------
using keys::BigEndian64;
using keys::DeltaKey;
using keys::DigestKey;
using keys::FromBigEndian64;
using keys::HeldKey;
using keys::StateKey;
using keys::StateKind;
using keys::SyncRecordKey;
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

using codec::ApplyOuterStep;
using codec::ApplyOuterStepTo;
using codec::MergeWeight;

}  // namespace

Result<std::map<std::string, SyncTensor>> SyncEngine::ReadTensors(Store* store,
                                                                  const std::string& job) {
  std::map<std::string, SyncTensor> out;
  const std::string prefix = keys::JobPrefix(job);
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
    ISTHMUS_ASSIGN_OR_RETURN(auto v, GetFloats(store, Column::kTensors, keys::TensorKey(job, name),
                                               static_cast<size_t>(NumElements(t.shape))));
    if (!v) return Status::Corruption("tensor '" + name + "' of job '" + job + "' is missing");
    t.data = std::make_shared<const std::vector<float>>(std::move(*v));
  }
  return out;
}

// ---- engine --------------------------------------------------------------------------
SyncEngine::SyncEngine(Store* store, SyncOptions options)
    : store_(store),
      options_(std::move(options)),
      membership_(options_.site, options_.peer_sites, keeps_momentum(),
                  std::chrono::seconds(options_.change_timeout_s), options_.now, this) {
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
  if (!options_.adaptive_ceiling.empty()) ceiling_pipe_ = parsed(options_.adaptive_ceiling);
  dense_pipe_ = parsed("dense");
  defer_pipe_ = parsed("defer");
  for (const auto& o : options_.codec_overrides) {
    const auto eq = o.find('=');
    override_pipes_.emplace_back(o.substr(0, eq), parsed(o.substr(eq + 1)));
  }
}

Result<std::unique_ptr<SyncEngine>> SyncEngine::Create(Store* store, SyncOptions options) {
  ISTHMUS_RETURN_IF_ERROR(NormalizeSyncOptions(options));
  return std::unique_ptr<SyncEngine>(new SyncEngine(store, std::move(options)));
}

void SyncEngine::Reset(Store* store) {
  DropStateWrites();
  store_ = store;
  jobs_.clear();
  deferred_.clear();
  deferred_fresh_ = false;
  membership_.Reset();
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
  batch->PutOwned(Column::kSync, SyncRecordKey(name), EncodeSyncRecord(j));
  batch->PutOwned(Column::kSync, DigestKey(name, 0),
                  StateDigest(0, j.theta, j.momentum, j.members));
}

void SyncEngine::AdoptNewJob(const std::string& name, std::map<std::string, SyncTensor> tensors,
                             uint64_t version) {
  Job& j = jobs_[name] = NewJob(std::move(tensors), version);
  SizePool(name, j);
  LoadResidualsAtStart(name, j);
}

void SyncEngine::LoadResidualsAtStart(const std::string& name, Job& j) {
  // With peers, rounds close: the residuals are read (or made) now, not by the first close
  // while the push that completed round 1 waits for its answer (341 MB in full mode).
  if (!has_peers()) return;
  if (Status s = LoadResiduals(name, j); !s.ok()) {
    spdlog::warn(
        "job '{}': the error-feedback residuals could not be loaded at the start (the first "
        "close tries again, and fails with the reason if it cannot): {}",
        name, s.ToString());
  }
}

std::vector<size_t> SyncEngine::CommitBuffers(const Job& j) const {
  // Per tensor its new theta and momentum; for one tensor at a time, the merge's sum.
  std::vector<size_t> out;
  std::set<size_t> sizes;
  for (const auto& [tname, t] : j.theta) {
    out.push_back(t.data->size());
    if (keeps_momentum()) out.push_back(t.data->size());
    sizes.insert(t.data->size());
  }
  out.insert(out.end(), sizes.begin(), sizes.end());
  return out;
}

void SyncEngine::SizePool(const std::string& name, Job& added) {
  // The pool holds at most one commit's buffers of every job (the state a commit replaces
  // comes back after it).
  auto bytes = [&](const Job& j) {
    uint64_t b = 0;
    for (size_t n : CommitBuffers(j)) b += n * sizeof(float);
    return b;
  };
  uint64_t limit = bytes(added);
  for (const auto& [other, j] : jobs_) {
    if (other != name) limit += bytes(j);
  }
  pool_->SetLimit(limit);
  // Rounds commit only with peers. Then the job's state moves into the pool's buffers, so
  // that the state the first commit replaces comes back to the pool, and the first commit's
  // buffers are taken now, at the start, not in round 1 (docs/SYNC.md, "Commit rule").
  if (!has_peers()) return;
  auto adopt = [&](const std::vector<float>& v) {
    auto b = pool_->Take(v.size());
    std::copy(v.begin(), v.end(), b->begin());
    return b;
  };
  for (auto& [tname, t] : added.theta) t.data = adopt(*t.data);
  for (auto& [tname, m] : added.momentum) m = adopt(*m);
  pool_->Reserve(CommitBuffers(added));
}

Result<bool> SyncEngine::HasSyncState(const std::string& name) const {
  ISTHMUS_ASSIGN_OR_RETURN(auto rec, store_->Get(Column::kSync, SyncRecordKey(name)));
  return rec.has_value();
}

Status SyncEngine::AttachJob(const std::string& name, std::map<std::string, SyncTensor> tensors,
                             uint64_t base_version) {
  Job j;
  j.theta = std::move(tensors);
  if (options_.outer_momentum != 0) {
    for (const auto& [tname, t] : j.theta) {
      ISTHMUS_ASSIGN_OR_RETURN(
          auto m, GetFloats(store_, Column::kState, StateKey(name, StateKind::kMomentum, tname),
                            t.data->size()));
      j.momentum[tname] = std::make_shared<const std::vector<float>>(
          m ? std::move(*m) : std::vector<float>(t.data->size(), 0.0f));
    }
  }
  ISTHMUS_ASSIGN_OR_RETURN(auto rec_text, store_->Get(Column::kSync, SyncRecordKey(name)));
  if (!rec_text) {
    // A plain job (created while sync was off), converted at the operator's word
    // (sync.convert_plain_jobs): its sync state starts now.
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
  const std::string held_prefix = keys::HeldPrefix(name);
  Status status;
  ISTHMUS_RETURN_IF_ERROR(
      store_->Scan(Column::kSync, held_prefix, [&](std::string_view k, std::string_view v) {
        auto id = keys::ParseHeldSuffix(k.substr(held_prefix.size()));
        if (!id) {
          status = Status::Corruption("bad held-delta key in job '" + name + "'");
          return false;
        }
        auto held = DecodeHeldTokens(v, name);
        if (!held.ok()) {
          status = held.status();
          return false;
        }
        j.inbox[id->site][id->round] = *held;
        return true;
      }));
  ISTHMUS_RETURN_IF_ERROR(status);
  SizePool(name, j);
  // The store holds the state of round state_round; the commits since kept their deltas.
  ISTHMUS_RETURN_IF_ERROR(RebuildState(name, j));
  Job& placed = jobs_[name] = std::move(j);
  LoadResidualsAtStart(name, placed);
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

Result<std::set<std::string>> SyncEngine::CheckPushed(
    const std::string& name, const Job& j, const std::vector<SyncPushTensor>& tensors) const {
  std::set<std::string> names;
  for (const auto& t : tensors) {
    auto it = j.theta.find(t.name);
    if (it == j.theta.end()) {
      return Status::NotFound("tensor '" + t.name + "' is not in job '" + name + "'");
    }
    const bool sized = t.encoded ? t.delta.empty() : t.delta.size() == it->second.data->size();
    if (t.shape != it->second.shape || !sized) {
      return Status::InvalidArgument("tensor '" + t.name +
                                     "': pushed shape differs from the job's shape");
    }
    if (!names.insert(t.name).second) {
      return Status::FailedPrecondition("tensor '" + t.name + "' is pushed twice");
    }
  }
  return names;
}

Result<SyncPushResult> SyncEngine::PushRound(const std::string& name, uint64_t round,
                                             uint64_t tokens,
                                             const std::vector<SyncPushTensor>& tensors,
                                             WriteBatch& batch, uint64_t compute_ms,
                                             std::shared_ptr<const void> keepalive) {
  ISTHMUS_ASSIGN_OR_RETURN(Job * j, FindJob(name));
  SyncPushResult result;
  if (round == 0) return Status::InvalidArgument("round pushes start at round 1");
  // A complete stage whose deferred close has not run (or failed: say the disk was full)
  // is closed before anything else, so the rounds stay in order.
  if (StageComplete(*j)) {
    ISTHMUS_RETURN_IF_ERROR(FinishRoundWork(name, *j));
    deferred_.erase(name);
  }
  if (std::string why = NonMemberReason(name, *j, options_.site, options_.site); !why.empty()) {
    return Status::FailedPrecondition(why + "; this site's workers have nothing to push to");
  }
  if (std::string why = membership_.RemovedNotice(name); !why.empty()) {
    return Status::FailedPrecondition(why);
  }
  if (membership_.Draining(name) && round > j->local && round != j->staged_round) {
    return Status::FailedPrecondition("this site is leaving job '" + name +
                                      "' (isthmusctl sync leave): it takes no new rounds");
  }
  if (round <= j->local) {
    // A retried push: the round closed already. Commits that failed after it (the disk was
    // full) are retried.
    ISTHMUS_RETURN_IF_ERROR(CommitReadyOrDefer(name, *j));
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
  ISTHMUS_ASSIGN_OR_RETURN(std::set<std::string> names, CheckPushed(name, *j, tensors));
  for (const auto& t : tensors) {
    if (t.encoded) {
      // The codec's check is its decoder's validation of every field, whose decode yields
      // finite values only; nothing is decoded here (the close does, into the merge).
      if (Status s = codec::Check(*t.encoded, j->theta.at(t.name).data->size()); !s.ok()) {
        return Status::InvalidArgument(
            "tensor '" + t.name +
            "': the delta its worker encoded cannot be decoded: " + s.message());
      }
    } else if (!std::all_of(t.delta.begin(), t.delta.end(),
                            [](float f) { return std::isfinite(f); })) {
      return Status::InvalidArgument("tensor '" + t.name + "': the delta is not finite");
    }
    if (j->staged_round == round && j->staged.count(t.name)) {
      return Status::FailedPrecondition("tensor '" + t.name + "' was already pushed for round " +
                                        std::to_string(round));
    }
  }
  SyncRecord next_rec = *j;
  next_rec.staged_round = round;
  next_rec.staged_tokens = std::max(j->staged_round == round ? j->staged_tokens : 0, tokens);
  next_rec.staged = j->staged_round == round ? j->staged : std::set<std::string>{};
  next_rec.staged.insert(names.begin(), names.end());
  if (j->staged_round != round && names.size() == j->theta.size() && !defer_) {
    // One push brings the whole round: close it from memory, in one write batch with the
    // push's records (no staged copy written, then read back). With deferred round work the
    // push is answered once the stage is durable instead (below), and the close follows.
    StagedDeltas pushed;
    for (const auto& t : tensors) pushed[t.name] = {t.delta, t.encoded};
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
  for (const auto& t : tensors) {
    if (t.encoded) {
      batch.Put(Column::kState, keys::StagedEncodedKey(name, round, t.name), *t.encoded);
    } else {
      batch.Put(Column::kState, keys::StagedKey(name, round, t.name), FloatBytes(t.delta));
    }
  }
  batch.PutOwned(Column::kSync, SyncRecordKey(name), EncodeSyncRecord(next_rec));
  // The largest compute time the round's pushes reported.
  const uint64_t round_compute_ms =
      std::max(j->staged_round == round ? j->staged_compute_ms : uint64_t{0}, compute_ms);
  if (defer_ && keepalive && next_rec.staged.size() == j->theta.size()) {
    // The push completes the round and its deltas are in memory: the close's encode runs
    // while the stage is written (most of that write is the disk's time, not the CPU's).
    StartEarlyEncode(name, *j, round, round_compute_ms, tensors);
  }
  const auto t_write = std::chrono::steady_clock::now();
  if (Status written = store_->Write(batch); !written.ok()) {
    j->early.reset();  // waits for the encode; the close will start over
    return written;
  }
  spdlog::debug(
      "job '{}': staged {} tensors of round {} (write {:.0f} ms)", name, tensors.size(), round,
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_write)
          .count());
  if (j->staged_round != round) {
    j->staged_mem.clear();
    j->staged_keep.clear();
  }
  j->staged_compute_ms = round_compute_ms;
  // The round's compute time sizes its close (PrepareClose) and, from this reply on, the
  // pipelines a worker that encodes its own deltas asks for (RoundPipelines).
  if (round_compute_ms > 0) j->last_round_seconds = static_cast<double>(round_compute_ms) / 1e3;
  j->staged_round = round;
  j->staged_tokens = next_rec.staged_tokens;
  j->staged = std::move(next_rec.staged);
  if (keepalive) {
    for (const auto& t : tensors) j->staged_mem[t.name] = {t.delta, t.encoded};
    j->staged_keep.push_back(std::move(keepalive));
  }
  if (StageComplete(*j)) {
    if (defer_) {
      // Durable: the reply may go; the close follows in RunDeferred (or, after a crash, in
      // AttachJob).
      deferred_.insert(name);
      deferred_fresh_ = true;
      result.close_pending = true;
      result.version = j->version;
      return result;
    }
    // The stage is durable; a failed close is retried at the next attach.
    ISTHMUS_RETURN_IF_ERROR(CloseRound(name, *j));
    result.closed = true;
    ISTHMUS_RETURN_IF_ERROR(CommitReady(name, *j));
  }
  result.version = j->version;
  return result;
}

Status SyncEngine::CommitReadyOrDefer(const std::string& name, Job& j) {
  if (!defer_) return CommitReady(name, j);
  deferred_.insert(name);
  deferred_fresh_ = true;
  return Status::Ok();
}

Status SyncEngine::FinishRoundWork(const std::string& name, Job& j) {
  if (StageComplete(j)) ISTHMUS_RETURN_IF_ERROR(CloseRound(name, j));
  return CommitReady(name, j);
}

Status SyncEngine::RunDeferred() {
  for (auto& [name, j] : jobs_) (void)FinishStateWrite(name, j, /*wait=*/false);
  if (deferred_.empty()) return Status::Ok();
  const auto now = options_.now();
  if (!deferred_fresh_ && now < deferred_retry_at_) return Status::Ok();
  deferred_fresh_ = false;
  Status first;
  for (auto it = deferred_.begin(); it != deferred_.end();) {
    auto job = jobs_.find(*it);
    Status s = job == jobs_.end() ? Status::Ok() : FinishRoundWork(*it, job->second);
    if (s.ok()) {
      if (job != jobs_.end()) job->second.round_work_error.clear();
      it = deferred_.erase(it);
      continue;
    }
    job->second.round_work_failures += 1;
    job->second.round_work_error = s.ToString();
    spdlog::warn("job '{}': the round work after a reply failed (tried again later): {}", *it,
                 s.ToString());
    if (first.ok()) first = s;
    ++it;
  }
  if (first.ok()) {
    deferred_backoff_ = std::chrono::milliseconds(0);
  } else {
    deferred_backoff_ = std::clamp(deferred_backoff_ * 2, std::chrono::milliseconds(1000),
                                   std::chrono::milliseconds(30000));
    deferred_retry_at_ = now + deferred_backoff_;
  }
  return first;
}

int SyncEngine::DeferredRetryMs() const {
  // A state write under way is applied by the first RunDeferred after it is on disk.
  constexpr int kStateWritePollMs = 20;
  bool writing = false;
  for (const auto& [name, j] : jobs_) writing |= j.state_write != nullptr;
  if (deferred_.empty()) return writing ? kStateWritePollMs : -1;
  if (deferred_fresh_) return 0;
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deferred_retry_at_ - options_.now());
  const int ms = static_cast<int>(std::max<int64_t>(left.count(), 0));
  return writing ? std::min(ms, kStateWritePollMs) : ms;
}

const codec::Pipeline& SyncEngine::ConfiguredPipeline(const std::string& tensor) const {
  for (const auto& [glob, pipe] : override_pipes_) {
    if (fnmatch(glob.c_str(), tensor.c_str(), 0) == 0) return pipe;
  }
  return codec_pipe_;
}

double SyncEngine::RoundBytesPerSecond(const Job& j, uint64_t round) const {
  // A link not measured yet counts at its share of sync.adaptive_start_mbit, the site's
  // uplink, which every member peer's delta crosses (0: no sizing until it is measured).
  const auto members = MemberPeers(j);
  const double assumed = options_.adaptive_start_mbit * 1e6 / 8 /
                         static_cast<double>(std::max<size_t>(members.size(), 1));
  double min_bw = -1;
  int measured = 0, peers = 0;
  for (const auto& p : members) {
    auto it = bandwidth_.find(p);
    const double bw = it != bandwidth_.end() ? it->second : assumed;
    ++peers;
    measured += it != bandwidth_.end();
    if (bw <= 0) return -1;
    min_bw = min_bw < 0 ? bw : std::min(min_bw, bw);
  }
  spdlog::debug("round {}: sized for {:.0f} B/s ({} of {} peer links measured)", round, min_bw,
                measured, peers);
  return min_bw;
}

codec::Pipeline SyncEngine::PipelineFor(const std::string& tensor, double bytes_per_second,
                                        double round_seconds, uint64_t numel,
                                        uint64_t total_numel) const {
  // Alone, the delta never crosses a link: keep it exact.
  if (options_.peer_sites.empty()) return dense_pipe_;
  if (options_.adaptive && round_seconds > 0 && bytes_per_second > 0) {
    const double budget = std::max(bytes_per_second * round_seconds * options_.adaptive_share *
                                       static_cast<double>(numel) /
                                       static_cast<double>(std::max<uint64_t>(total_numel, 1)),
                                   0.0);
    // No ceiling set: the tensor's configured pipeline while it fits, else the ladder
    // from that pipeline's rung down.
    const bool own_ceiling = options_.adaptive_ceiling.empty();
    const codec::Pipeline& configured = ConfiguredPipeline(tensor);
    if (own_ceiling && codec::EstimateBytes(configured, numel) <= budget) return configured;
    return codec::ChooseAdaptive(numel, static_cast<uint64_t>(budget), floor_pipe_,
                                 own_ceiling ? configured : ceiling_pipe_);
  }
  return ConfiguredPipeline(tensor);
}

std::map<std::string, codec::Pipeline> SyncEngine::ChoosePipelines(const Job& j, uint64_t round,
                                                                   double round_seconds) const {
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
  const double bw = options_.adaptive && !options_.peer_sites.empty() && round_seconds > 0
                        ? RoundBytesPerSecond(j, round)
                        : -1;
  std::map<std::string, Pipe> out;
  for (const auto& [tname, t] : j.theta) {
    out[tname] = deferred(tname)
                     ? defer_pipe_
                     : PipelineFor(tname, bw, round_seconds, t.data->size(), total_numel);
  }
  return out;
}

Result<std::map<std::string, std::string>> SyncEngine::RoundPipelines(const std::string& name,
                                                                      uint64_t round,
                                                                      uint64_t compute_ms) const {
  ISTHMUS_ASSIGN_OR_RETURN(const Job* j, FindJob(name));
  if (round == 0) return Status::InvalidArgument("rounds start at 1");
  std::map<std::string, std::string> out;
  const double seconds =
      compute_ms > 0 ? static_cast<double>(compute_ms) / 1e3 : j->last_round_seconds;
  for (const auto& [tname, p] : ChoosePipelines(*j, round, seconds)) out[tname] = PipeText(p);
  return out;
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

Status SyncEngine::LoadResiduals(const std::string& name, Job& j) {
  if (!j.residual.empty()) return Status::Ok();
  std::map<std::string, std::vector<float>> residual;
  for (const auto& [tname, t] : j.theta) {
    const size_t n = t.data->size();
    ISTHMUS_ASSIGN_OR_RETURN(
        auto stored,
        GetFloats(store_, Column::kState, StateKey(name, StateKind::kResidual, tname), n));
    residual[tname] = stored ? std::move(*stored) : std::vector<float>(n, 0.0f);
  }
  // The closes since the residuals were written: residual = (residual + staged) -
  // decode(sent), EncodeWithFeedback's own arithmetic, so the values are bit for bit the ones
  // those closes held.
  std::vector<float> decoded;
  for (uint64_t r = j.residual_round + 1; r <= j.local; ++r) {
    auto missing = [&](const std::string& what) {
      return Status::Corruption("job '" + name +
                                "': cannot recompute the error-feedback "
                                "residuals of round " +
                                std::to_string(r) + " from those of round " +
                                std::to_string(j.residual_round) + ": " + what + " is missing");
    };
    ISTHMUS_ASSIGN_OR_RETURN(auto bytes,
                             store_->Get(Column::kDeltas, DeltaKey(name, options_.site, r)));
    if (!bytes) return missing("this site's encoded delta");
    ISTHMUS_ASSIGN_OR_RETURN(EncodedDelta sent, DecodeDelta(*bytes));
    for (const auto& et : sent.tensors) {
      auto res = residual.find(et.name);
      if (res == residual.end())
        return Status::Corruption("stored delta has unknown tensor " + et.name);
      std::vector<float>& v = res->second;
      ISTHMUS_ASSIGN_OR_RETURN(auto staged, GetFloats(store_, Column::kState,
                                                      keys::StagedKey(name, r, et.name), v.size()));
      if (!staged) {
        // Encoded by its worker: the close left this residual as it was.
        ISTHMUS_ASSIGN_OR_RETURN(
            auto by_worker, store_->Get(Column::kState, keys::StagedEncodedKey(name, r, et.name)));
        if (by_worker) continue;
        return missing("the staged delta of tensor '" + et.name + "'");
      }
      decoded.assign(v.size(), 0.0f);
      ISTHMUS_RETURN_IF_ERROR(codec::Decode(et.bytes, decoded));
      codec::RecomputeResidual(v, *staged, decoded);
      j.residual_changed.insert(et.name);
    }
  }
  j.residual = std::move(residual);
  return Status::Ok();
}

Result<std::unique_ptr<SyncEngine::CloseWork>> SyncEngine::PrepareClose(
    const std::string& name, Job& j, uint64_t round, uint64_t compute_ms,
    const StagedDeltas* staged_in) {
  auto work = std::make_unique<CloseWork>();
  work->round = round;
  // The workers' compute time for this round, when they reported it, is the time its
  // transfer should fit in; otherwise the time since the previous close stands in.
  const auto now = options_.now();
  if (compute_ms > 0) {
    j.last_round_seconds = static_cast<double>(compute_ms) / 1e3;
  } else if (j.last_close) {
    j.last_round_seconds = std::chrono::duration<double>(now - *j.last_close).count();
  }
  const std::map<std::string, Pipe> pipes = ChoosePipelines(j, round, j.last_round_seconds);
  // The residuals stay in memory between closes (rebuilt from the store once after a
  // start); the new ones are written into a second buffer per tensor, taken only once the
  // close is durable.
  ISTHMUS_RETURN_IF_ERROR(LoadResiduals(name, j));
  // They are written every sync.checkpoint_rounds closes; the closes between keep the
  // round's staged delta instead, from which a start recomputes them.
  work->write_residuals = round - j.residual_round >= options_.checkpoint_rounds;
  work->reads.resize(j.theta.size());
  work->given.resize(j.theta.size());
  work->tasks.reserve(j.theta.size());
  size_t i = 0;
  for (const auto& [tname, t] : j.theta) {
    const size_t n = t.data->size();
    std::span<const float> staged;
    auto& read = work->reads[i];
    auto& given = work->given[i++];
    work->raw += n * sizeof(float);
    if (staged_in != nullptr || j.staged_mem.count(tname)) {
      const StagedDelta& in = staged_in != nullptr ? staged_in->at(tname) : j.staged_mem.at(tname);
      if (in.encoded) given = std::string(*in.encoded);
      staged = in.delta;
    } else {
      ISTHMUS_ASSIGN_OR_RETURN(
          read, GetFloats(store_, Column::kState, keys::StagedKey(name, round, tname), n));
      if (!read) {
        ISTHMUS_ASSIGN_OR_RETURN(
            given, store_->Get(Column::kState, keys::StagedEncodedKey(name, round, tname)));
      }
      if (!read && !given) {
        // Staged by a release before per-round staged rows: this close writes the residuals,
        // as the rounds after it cannot be recomputed from that row.
        ISTHMUS_ASSIGN_OR_RETURN(
            read, GetFloats(store_, Column::kState, StateKey(name, StateKind::kStaged, tname), n));
        work->write_residuals = true;
      }
      if (!read && !given) {
        return Status::Corruption("staged delta of tensor '" + tname + "' of job '" + name +
                                  "' is missing");
      }
      if (read) staged = *read;
    }
    if (given) {
      // Its worker encoded it, with error feedback in its own residual: sent as it is.
      work->pipelines[std::string(kEncodedByWorker)] += 1;
      continue;
    }
    std::vector<float>& next = j.residual_next[tname];
    next.resize(n);
    codec::FeedbackTask& task = work->tasks.emplace_back();
    task.pipeline = pipes.at(tname);
    task.delta = staged;
    task.shape = t.shape;
    task.residual_in = j.residual.at(tname);
    task.residual_out = next;
    work->pipelines[PipeText(task.pipeline)] += 1;
  }
  return work;
}

void SyncEngine::StartEarlyEncode(const std::string& name, Job& j, uint64_t round,
                                  uint64_t compute_ms, const std::vector<SyncPushTensor>& tensors) {
  StagedDeltas staged;
  if (j.staged_round == round) staged = j.staged_mem;
  for (const auto& t : tensors) staged[t.name] = {t.delta, t.encoded};
  if (staged.size() != j.theta.size()) return;  // some staged delta is only on disk
  auto work = PrepareClose(name, j, round, compute_ms, &staged);
  if (!work.ok()) return;  // the close will say why
  CloseWork* w = work->get();
  const int threads = static_cast<int>(options_.encode_threads);
  w->encoder = std::thread([w, threads] {
    pthread_setname_np(pthread_self(), "codec-encode");
    codec::EncodeWithFeedbackMany(w->tasks, threads);
  });
  j.early = std::move(*work);
}

SyncEngine::CloseWork::~CloseWork() {
  if (encoder.joinable()) encoder.join();
}

Status SyncEngine::CloseRound(const std::string& name, Job& j, const StagedDeltas* pushed,
                              WriteBatch* batch_in) {
  const uint64_t round = j.staged_round;
  const auto now = options_.now();
  EncodedDelta delta;
  delta.job = name;
  delta.site = options_.site;
  delta.round = round;
  delta.tokens = j.staged_tokens;
  // Each tensor is encoded whole on one thread; the bytes do not depend on how many. A
  // push that completed the round may have started the encode while its stage was written
  // (StartEarlyEncode): the same tasks, from the same inputs.
  std::unique_ptr<CloseWork> work = std::move(j.early);
  const auto t_encode = std::chrono::steady_clock::now();
  if (work && work->round == round && pushed == nullptr) {
    work->encoder.join();
    ++early_encodes_;
  } else {
    work.reset();
    ISTHMUS_ASSIGN_OR_RETURN(work, PrepareClose(name, j, round, j.staged_compute_ms, pushed));
    codec::EncodeWithFeedbackMany(work->tasks, static_cast<int>(options_.encode_threads));
  }
  const auto t_encoded = std::chrono::steady_clock::now();
  const bool write_residuals = work->write_residuals;
  std::map<std::string, uint64_t> pipelines = std::move(work->pipelines);
  const uint64_t raw = work->raw;
  // Tensors their workers encoded are sent as they came and keep the residual they had.
  std::set<std::string> by_worker;
  size_t i = 0, task = 0;
  for (const auto& [tname, t] : j.theta) {
    EncodedTensor et;
    et.name = tname;
    et.shape = t.shape;
    std::optional<std::string>& given = work->given[i++];
    if (given) {
      by_worker.insert(tname);
      et.bytes = std::move(*given);
    } else {
      et.bytes = std::move(work->tasks[task++].bytes);
    }
    delta.tensors.push_back(std::move(et));
  }
  const std::string serialized = EncodeDelta(delta);
  SyncRecord rec = j;  // the round is closed: nothing is staged any more
  rec.local = round;
  if (write_residuals) rec.residual_round = round;
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
  batch.PutOwned(Column::kSync, HeldKey(name, options_.site, round),
                 EncodeHeldTokens(delta.tokens));
  for (const auto& [tname, _] : j.theta) {
    if (!write_residuals) {
      // The round's staged delta stays (a push that brought the whole round wrote none).
      if (pushed != nullptr) {
        const StagedDelta& in = pushed->at(tname);
        if (in.encoded) {
          batch.Put(Column::kState, keys::StagedEncodedKey(name, round, tname), *in.encoded);
        } else {
          batch.Put(Column::kState, keys::StagedKey(name, round, tname), FloatBytes(in.delta));
        }
      }
      continue;
    }
    // A residual that only workers' encodes left as it was is its stored row still.
    const bool kept = by_worker.count(tname) > 0;
    if (!kept || j.residual_changed.count(tname)) {
      batch.Put(Column::kState, StateKey(name, StateKind::kResidual, tname),
                FloatBytes(kept ? j.residual.at(tname) : j.residual_next.at(tname)));
    }
    // The staged deltas the residuals now cover go, this round's among them.
    for (uint64_t r = j.residual_round + 1; r <= round; ++r) {
      if (r != round || pushed == nullptr) {
        batch.Delete(Column::kState, keys::StagedKey(name, r, tname));
        batch.Delete(Column::kState, keys::StagedEncodedKey(name, r, tname));
      }
    }
    if (pushed == nullptr) batch.Delete(Column::kState, StateKey(name, StateKind::kStaged, tname));
  }
  batch.PutOwned(Column::kSync, SyncRecordKey(name), EncodeSyncRecord(rec));
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  if (write_residuals) j.residual_changed.clear();
  for (const auto& [tname, _] : j.theta) {
    if (by_worker.count(tname)) continue;
    j.residual.at(tname).swap(j.residual_next.at(tname));
    if (!write_residuals) j.residual_changed.insert(tname);
  }
  j.local = round;
  j.residual_round = rec.residual_round;
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
  j.staged_mem.clear();
  j.staged_keep.clear();
  const auto ms = [](auto a, auto b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  spdlog::debug(
      "job '{}': site {} closed round {} ({} -> {} bytes; encode {:.0f} ms, write {:.0f} ms)", name,
      options_.site, round, raw, delta.WireBytes(), ms(t_encode, t_encoded),
      ms(t_encoded, std::chrono::steady_clock::now()));
  return Status::Ok();
}

Result<std::vector<EncodedDelta>> SyncEngine::RoundDeltas(const std::string& name, const Job& j,
                                                          uint64_t round,
                                                          const std::vector<std::string>& sites,
                                                          uint64_t* total) {
  // The merge weights come from the deltas' own token counts (what the held markers hold
  // too), so that a start that replays committed rounds, whose markers are gone, merges
  // exactly as the commit did.
  std::vector<EncodedDelta> deltas;
  *total = 0;
  for (const auto& s : sites) {
    ISTHMUS_ASSIGN_OR_RETURN(auto bytes, store_->Get(Column::kDeltas, DeltaKey(name, s, round)));
    if (!bytes) {
      return Status::Corruption("delta of site " + s + " round " + std::to_string(round) +
                                " of job '" + name + "' is missing");
    }
    ISTHMUS_ASSIGN_OR_RETURN(EncodedDelta d, DecodeDelta(*bytes));
    if (d.tensors.size() != j.theta.size()) {
      return Status::Corruption("stored delta of site " + d.site + " has the wrong tensor set");
    }
    for (const auto& et : d.tensors) {
      if (!j.theta.count(et.name)) {
        return Status::Corruption("stored delta has unknown tensor " + et.name);
      }
    }
    *total += d.tokens;
    deltas.push_back(std::move(d));
  }
  return deltas;
}

Status SyncEngine::MergeTensor(const std::vector<EncodedDelta>& deltas, uint64_t total,
                               const std::string& tname, std::vector<float>& out, bool* sent) {
  for (const auto& d : deltas) {
    const float w = MergeWeight(d.tokens, total, deltas.size());
    for (const auto& et : d.tensors) {
      // A deferred tensor decodes to zeros (checked when it arrived): nothing to add.
      if (et.name != tname || codec::IsDeferred(et.bytes)) continue;
      *sent = true;
      ISTHMUS_RETURN_IF_ERROR(codec::DecodeAddWeighted(et.bytes, w, out));
    }
  }
  return Status::Ok();
}

Result<std::map<std::string, std::vector<float>>> SyncEngine::Merge(
    const std::string& name, const Job& j, uint64_t round, const std::vector<std::string>& sites,
    std::set<std::string>* sent) {
  uint64_t total = 0;
  ISTHMUS_ASSIGN_OR_RETURN(auto deltas, RoundDeltas(name, j, round, sites, &total));
  std::map<std::string, std::vector<float>> merged;
  for (const auto& [tname, t] : j.theta) {
    std::vector<float>& g = merged[tname];
    g.assign(t.data->size(), 0.0f);
    bool some = false;
    ISTHMUS_RETURN_IF_ERROR(MergeTensor(deltas, total, tname, g, &some));
    if (some && sent != nullptr) sent->insert(tname);
  }
  return merged;
}

Result<SyncEngine::Stepped> SyncEngine::CommitStep(const std::string& name, const Job& j,
                                                   uint64_t round, const Membership& members,
                                                   std::set<std::string>* sent, bool* in_merge) {
  bool merge_failed = true;  // until the deltas are read
  if (in_merge != nullptr) *in_merge = false;
  auto fail = [&](Status st) {
    if (in_merge != nullptr) *in_merge = merge_failed;
    return st;
  };
  uint64_t total = 0;
  auto read = RoundDeltas(name, j, round, members.sites, &total);
  if (!read.ok()) return fail(read.status());
  const std::vector<EncodedDelta>& deltas = *read;
  merge_failed = false;
  std::vector<const std::string*> names;
  for (const auto& [tname, t] : j.theta) names.push_back(&tname);
  const size_t n = names.size();
  std::vector<SyncTensor> theta(n);
  std::vector<std::shared_ptr<const std::vector<float>>> momentum(n);
  std::vector<char> some(n, 0);
  StateDigester digester(round);
  // Tensor i's merge and step here while a helper thread hashes tensors < i.
  Status st = Pipelined(
      n,
      [&](size_t i) -> Status {
        const std::string& tname = *names[i];
        // The merge's sum, in a recycled buffer (TensorPool), back in the pool after the step.
        auto g = pool_->TakeZeroed(j.theta.at(tname).data->size());
        bool s = false;
        if (Status m = MergeTensor(deltas, total, tname, *g, &s); !m.ok()) {
          merge_failed = true;
          return m;
        }
        some[i] = s;
        ISTHMUS_ASSIGN_OR_RETURN(auto stepped, StepTensor(name, j, round, tname, *g, s));
        theta[i] = std::move(stepped.first);
        momentum[i] = std::move(stepped.second);
        return Status::Ok();
      },
      [&](size_t i) {
        digester.Add(
            {*names[i], theta[i].shape, *theta[i].data,
             momentum[i] ? std::span<const float>(*momentum[i]) : std::span<const float>()});
      });
  if (!st.ok()) return fail(st);
  Stepped out;
  for (size_t i = 0; i < n; ++i) {
    out.next.theta[*names[i]] = std::move(theta[i]);
    if (momentum[i]) out.next.momentum[*names[i]] = std::move(momentum[i]);
    if (some[i] && sent != nullptr) sent->insert(*names[i]);
  }
  out.digest = digester.Finish(members.epoch, members.from_round, members.sites);
  return out;
}

Status SyncEngine::CommitReady(const std::string& name, Job& j) {
  ISTHMUS_RETURN_IF_ERROR(CommitRounds(name, j));
  membership_.OnRoundsCommitted(name);  // a draining leave goes ahead once drained
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

SyncEngine::StateWrite::~StateWrite() {
  if (filler.joinable()) filler.join();
}

void SyncEngine::DropStateWrites() {
  for (auto& [name, j] : jobs_) j.state_write.reset();
}

Status SyncEngine::FinishStateWrites() {
  Status first;
  for (auto& [name, j] : jobs_) {
    Status s = FinishStateWrite(name, j, /*wait=*/true);
    if (first.ok()) first = s;
  }
  return first;
}

void SyncEngine::StartStateWrite(const std::string& name, Job& j, uint64_t round,
                                 uint64_t version) {
  auto w = std::make_unique<StateWrite>();
  w->round = round;
  w->tensors = std::move(j.unsaved);
  j.unsaved.clear();
  w->theta = j.theta;
  w->momentum = j.momentum;
  WriteStateRows(name, w->theta, w->momentum, w->tensors, version, w->rows);
  auto staged = store_->Stage(w->rows);
  if (!staged.ok()) {
    spdlog::warn("job '{}': cannot write the state of round {} (the next commit tries again): {}",
                 name, round, staged.status().ToString());
    j.unsaved = std::move(w->tensors);
    return;
  }
  w->staged = std::move(staged).value();
  uint64_t bytes = 0;
  for (const auto& op : w->rows.ops()) bytes += op.value.size();
  spdlog::debug("job '{}': writing the state of round {} ({:.0f} MB) in the background", name,
                round, static_cast<double>(bytes) / 1e6);
  StateWrite* raw = w.get();
  w->filler = std::thread([raw] {
    raw->staged->Fill();
    raw->filled.store(true, std::memory_order_release);
  });
  j.state_write = std::move(w);
}

Status SyncEngine::FinishStateWrite(const std::string& name, Job& j, bool wait) {
  if (!j.state_write) return Status::Ok();
  StateWrite& w = *j.state_write;
  if (!wait && !w.filled.load(std::memory_order_acquire)) return Status::Ok();
  const auto t0 = std::chrono::steady_clock::now();
  w.filler.join();
  // The record as it stands, naming the written state; the deltas it no longer needs go.
  SyncRecord rec = j;
  rec.state_round = w.round;
  WriteBatch more;
  DropOldDeltas(name, j, j.committed, rec.state_round, more);
  more.PutOwned(Column::kSync, SyncRecordKey(name), EncodeSyncRecord(rec));
  Status s = store_->Apply(std::move(w.staged), more);
  if (s.ok()) {
    j.state_round = w.round;
    spdlog::debug(
        "job '{}': wrote the state of round {} ({} tensors; applied in {:.0f} ms)", name, w.round,
        w.tensors.size(),
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  } else {
    // Not written: the next checkpoint commit writes these tensors again.
    spdlog::warn(
        "job '{}': the state of round {} was not written (the next checkpoint writes "
        "it): {}",
        name, w.round, s.ToString());
    j.unsaved.insert(w.tensors.begin(), w.tensors.end());
  }
  j.state_write.reset();
  return s;
}

Status SyncEngine::CommitOne(const std::string& name, Job& j) {
  const uint64_t round = j.committed + 1;
  const auto sites = j.members.sites;
  std::set<std::string> sent;
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  ISTHMUS_ASSIGN_OR_RETURN(Stepped stepped, CommitStep(name, j, round, j.members, &sent));
  OuterState next = std::move(stepped.next);
  const std::string digest = std::move(stepped.digest);
  const auto t1 = Clock::now();
  SyncRecord rec = j;
  rec.committed = round;
  rec.version = j.version + 1;
  // The state is written every sync.checkpoint_rounds commits; the commits between keep
  // the rounds' deltas instead (DropOldDeltas), from which a start rebuilds it.
  std::set<std::string> unsaved = j.unsaved;
  unsaved.insert(sent.begin(), sent.end());
  const uint64_t saving = j.state_write ? j.state_write->round : j.state_round;
  const bool checkpoint = round - saving >= options_.checkpoint_rounds;
  // With background_state_writes the commit writes what the commits between checkpoints
  // write, and the state follows (StartStateWrite).
  const bool in_batch = checkpoint && !options_.background_state_writes;
  if (in_batch) rec.state_round = round;
  WriteBatch batch;
  CommitBatch(name, j, round, next, in_batch ? unsaved : std::set<std::string>{}, sites, digest,
              rec, batch);
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  const auto t2 = Clock::now();
  PublishCommit(j, round, std::move(next), sites, rec.version);
  j.state_round = rec.state_round;
  j.unsaved = in_batch ? std::set<std::string>{} : std::move(unsaved);
  if (checkpoint && !in_batch) {
    // One state write at a time: the one before is due by now (4 rounds back by default).
    (void)FinishStateWrite(name, j, /*wait=*/true);
    StartStateWrite(name, j, round, rec.version);
  }
  const auto ms = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  spdlog::info("job '{}': committed round {} (digest {})", name, round, digest.substr(0, 16));
  spdlog::debug(
      "job '{}': round {}'s commit took merge, outer step and digest {:.0f} ms (overlapped), "
      "write {:.0f} ms{}",
      name, round, ms(t0, t1), ms(t1, t2),
      in_batch     ? " (with the state)"
      : checkpoint ? " (the state follows)"
                   : "");
  if (auto it = j.closed_at.find(round); it != j.closed_at.end()) {
    const double seconds = std::chrono::duration<double>(options_.now() - it->second).count();
    if (options_.on_commit) options_.on_commit(name, round, seconds);
  }
  j.closed_at.erase(j.closed_at.begin(), j.closed_at.upper_bound(round));
  return Status::Ok();
}

Status SyncEngine::RebuildState(const std::string& name, Job& j) {
  if (j.state_round >= j.committed) return Status::Ok();
  const uint64_t from = j.state_round;
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t round = from + 1; round <= j.committed; ++round) {
    // Every round after the stored state was committed by the current members: a
    // membership change writes the state first (ApplyMembership).
    std::set<std::string> sent;
    bool in_merge = false;
    auto stepped = CommitStep(name, j, round, j.members, &sent, &in_merge);
    if (!stepped.ok() && in_merge) {
      return Status::Corruption("job '" + name + "': cannot rebuild committed round " +
                                std::to_string(round) + " from the stored state of round " +
                                std::to_string(from) + ": " + stepped.status().message());
    }
    ISTHMUS_RETURN_IF_ERROR(stepped.status());
    OuterState next = std::move(stepped->next);
    const std::string digest = std::move(stepped->digest);
    ISTHMUS_ASSIGN_OR_RETURN(auto stored, store_->Get(Column::kSync, DigestKey(name, round)));
    if (!stored || *stored != digest) {
      return Status::Corruption(
          "job '" + name + "': rebuilding committed round " + std::to_string(round) +
          " from the stored state of round " + std::to_string(from) +
          " gives another digest than the commit stored (" + digest.substr(0, 16) + " against " +
          (stored ? stored->substr(0, 16) : std::string("none")) +
          "); the store is damaged: restore a snapshot, or remove this site and let it join "
          "again from a peer (isthmusctl sync remove, sync join; docs/SYNC.md)");
    }
    j.theta = std::move(next.theta);
    if (keeps_momentum()) j.momentum = std::move(next.momentum);
    j.unsaved.insert(sent.begin(), sent.end());
  }
  spdlog::info(
      "job '{}': rebuilt the committed state of round {} from the stored state of round {} "
      "and the rounds' deltas ({:.0f} ms; digests agree)",
      name, j.committed, from,
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  return Status::Ok();
}

// The outer optimiser's arithmetic (codec::ApplyOuterStep) is shared with workers that
// replay committed rounds (ops/codec_replica.h), compiled without fused multiply-adds.
Result<std::pair<SyncTensor, std::shared_ptr<const std::vector<float>>>> SyncEngine::StepTensor(
    const std::string& name, const Job& j, uint64_t round, const std::string& tname,
    const std::vector<float>& g, bool sent) const {
  const float lr = static_cast<float>(options_.outer_lr);
  const float mu = static_cast<float>(options_.outer_momentum);
  const SyncTensor& old = j.theta.at(tname);
  if (!sent) {
    // Every site deferred it (a streamed fragment not due): no outer step, momentum kept.
    return std::make_pair(old, mu != 0.0f ? j.momentum.at(tname) : nullptr);
  }
  // The committed tensors stay as they are until the commit's batch is written. The step
  // writes every value of its outputs: recycled buffers serve (TensorPool).
  const size_t n = g.size();
  auto next = pool_->Take(n);
  std::shared_ptr<std::vector<float>> m;
  if (mu != 0.0f) m = pool_->Take(n);
  const bool finite =
      ApplyOuterStepTo(old.data->data(), mu != 0.0f ? j.momentum.at(tname)->data() : nullptr,
                       g.data(), next->data(), m ? m->data() : nullptr, n, lr, mu);
  if (!finite) {
    return Status::FailedPrecondition("committing round " + std::to_string(round) + " of job '" +
                                      name + "' makes tensor '" + tname +
                                      "' non-finite; not committed");
  }
  return std::make_pair(SyncTensor{old.shape, std::move(next)},
                        std::shared_ptr<const std::vector<float>>(std::move(m)));
}

void SyncEngine::CommitBatch(const std::string& name, const Job& j, uint64_t round,
                             const OuterState& next, const std::set<std::string>& write,
                             const std::vector<std::string>& sites, const std::string& digest,
                             const SyncRecord& rec, WriteBatch& batch) const {
  WriteStateRows(name, next.theta, next.momentum, write, rec.version, batch);
  batch.PutOwned(Column::kSync, DigestKey(name, round), digest);
  // The round's held markers go; its deltas stay for sync.replay_rounds more commits, for
  // workers that replay rounds (and this site's own until every peer holds it).
  for (const auto& s : sites) batch.Delete(Column::kSync, HeldKey(name, s, round));
  DropOldDeltas(name, j, round, rec.state_round, batch);
  batch.PutOwned(Column::kSync, SyncRecordKey(name), EncodeSyncRecord(rec));
}

void SyncEngine::WriteStateRows(
    const std::string& name, const std::map<std::string, SyncTensor>& theta,
    const std::map<std::string, std::shared_ptr<const std::vector<float>>>& momentum,
    const std::set<std::string>& write, uint64_t version, WriteBatch& batch) const {
  for (const auto& tname : write) {
    const SyncTensor& t = theta.at(tname);
    batch.Put(Column::kTensors, keys::TensorKey(name, tname), FloatBytes(*t.data));
    batch.PutOwned(Column::kTensorMeta, keys::TensorKey(name, tname),
                   EncodeTensorRecord({t.shape, version}));
    if (keeps_momentum()) {
      batch.Put(Column::kState, StateKey(name, StateKind::kMomentum, tname),
                FloatBytes(*momentum.at(tname)));
    }
  }
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
  (void)FinishStateWrite(name, *j, /*wait=*/true);  // the rows below come after its own
  if (has_peers()) {
    return Status::FailedPrecondition("job '" + name +
                                      "' syncs with other sites: push deltas with a round (>= 1)");
  }
  if (j->staged_round != 0) {
    return Status::FailedPrecondition("round " + std::to_string(j->staged_round) +
                                      " is being pushed; a round-less push would mix into it");
  }
  for (const auto& t : tensors) {
    if (t.encoded) {
      return Status::InvalidArgument("tensor '" + t.name +
                                     "' comes encoded: a round-less push takes fp32 values");
    }
  }
  ISTHMUS_ASSIGN_OR_RETURN(std::set<std::string> names, CheckPushed(name, *j, tensors));
  std::map<std::string, SyncTensor> theta = j->theta;
  for (const auto& t : tensors) {
    auto it = theta.find(t.name);
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
  // The pushed tensors' rows; with committed rounds not yet written (sync.checkpoint_rounds)
  // every tensor's, so that the store's state is one round's.
  std::set<std::string> write = names;
  if (j->state_round < j->committed) {
    write.insert(j->unsaved.begin(), j->unsaved.end());
    rec.state_round = j->committed;
  }
  WriteStateRows(name, theta, j->momentum, write, version, batch);
  batch.PutOwned(Column::kSync, SyncRecordKey(name), EncodeSyncRecord(rec));
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  if (rec.state_round != j->state_round) j->unsaved.clear();
  j->state_round = rec.state_round;
  j->theta = std::move(theta);
  j->version = version;
  j->view.reset();
  return version;
}

std::map<uint64_t, std::vector<std::string>> SyncEngine::ViewRounds(const Job& j) const {
  // Rounds this site has closed and not committed, with the deltas held for them so far.
  // A peer's delta for a round this site has not closed yet is left out: the site's
  // workers are still training that round, and whether it has arrived is a matter of
  // timing. (With overlapped workers at K = 1 a pull runs once the site's last round has
  // committed, so the view is then the committed state, whatever the peers sent since.)
  std::map<uint64_t, std::vector<std::string>> rounds;  // round -> sites holding it (sorted)
  for (const auto& s : j.members.sites) {
    auto it = j.inbox.find(s);
    if (it == j.inbox.end()) continue;
    for (const auto& [r, _] : it->second) {
      if (r > j.committed && r <= j.local) rounds[r].push_back(s);
    }
  }
  return rounds;
}

Result<std::map<std::string, SyncTensor>> SyncEngine::View(const std::string& name) {
  ISTHMUS_ASSIGN_OR_RETURN(Job * j, FindJob(name));
  if (j->view) return *j->view;
  const auto rounds = ViewRounds(*j);
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

Result<ReplayPlan> SyncEngine::Replay(const std::string& name, uint64_t from,
                                      const std::string& digest) {
  ISTHMUS_ASSIGN_OR_RETURN(Job * j, FindJob(name));
  ReplayPlan plan;
  plan.committed_round = j->committed;
  plan.members = j->members;
  plan.outer_lr = static_cast<float>(options_.outer_lr);
  plan.outer_momentum = static_cast<float>(options_.outer_momentum);
  ISTHMUS_ASSIGN_OR_RETURN(auto committed_digest,
                           store_->Get(Column::kSync, DigestKey(name, j->committed)));
  if (!committed_digest) {
    return Status::Corruption("job '" + name + "' has no digest of its committed round " +
                              std::to_string(j->committed));
  }
  plan.digest = *committed_digest;
  if (j->check_of != plan.digest) {
    j->check = StateCheck(j->committed, j->theta, j->momentum, j->members);
    j->check_of = plan.digest;
  }
  plan.check = j->check;
  // One site's delta of a round, read back from the store; null when it is gone.
  auto read = [&](const std::string& site, uint64_t round) -> Result<ReplayPlan::Delta> {
    ISTHMUS_ASSIGN_OR_RETURN(auto bytes, store_->Get(Column::kDeltas, DeltaKey(name, site, round)));
    if (!bytes) return ReplayPlan::Delta{site, 0, nullptr};
    ISTHMUS_ASSIGN_OR_RETURN(EncodedDelta d, DecodeDelta(*bytes));
    const uint64_t tokens = d.tokens;  // what the held index (the merge weight) holds
    return ReplayPlan::Delta{site, tokens, std::make_shared<const EncodedDelta>(std::move(d))};
  };
  // The worker's state is usable when it is a committed round of the current membership
  // whose digest it has right and whose later rounds' deltas are all still here.
  bool usable = !digest.empty() && from <= j->committed && j->members.from_round <= from + 1;
  if (usable) {
    ISTHMUS_ASSIGN_OR_RETURN(auto known, store_->Get(Column::kSync, DigestKey(name, from)));
    usable = known && *known == digest;
  }
  for (uint64_t r = from + 1; usable && r <= j->committed; ++r) {
    ReplayPlan::Round round{r, {}};
    for (const auto& s : j->members.sites) {
      ISTHMUS_ASSIGN_OR_RETURN(auto d, read(s, r));
      if (!d.delta) {
        usable = false;
        break;
      }
      round.deltas.push_back(std::move(d));
    }
    plan.committed.push_back(std::move(round));
  }
  if (usable) {
    plan.base_round = from;
  } else {
    plan.committed.clear();
    plan.whole = true;
    plan.base_round = j->committed;
    plan.theta = j->theta;
    if (keeps_momentum()) plan.momentum = j->momentum;
  }
  for (const auto& [r, sites] : ViewRounds(*j)) {
    ReplayPlan::Round round{r, {}};
    for (const auto& s : sites) {
      ISTHMUS_ASSIGN_OR_RETURN(auto d, read(s, r));
      if (!d.delta) {
        return Status::Corruption("delta of site " + s + " round " + std::to_string(r) +
                                  " of job '" + name + "' is missing");
      }
      round.deltas.push_back(std::move(d));
    }
    plan.view.push_back(std::move(round));
  }
  return plan;
}

uint64_t SyncEngine::Version(const std::string& job) const {
  auto it = jobs_.find(job);
  return it == jobs_.end() ? 0 : it->second.version;
}
uint64_t SyncEngine::LocalRound(const std::string& job) const {
  auto it = jobs_.find(job);
  return it == jobs_.end() ? 0 : it->second.local;
}
uint64_t SyncEngine::PushedRound(const std::string& job) const {
  auto it = jobs_.find(job);
  if (it == jobs_.end()) return 0;
  return StageComplete(it->second) ? it->second.staged_round : it->second.local;
}
uint64_t SyncEngine::CommittedRound(const std::string& job) const {
  auto it = jobs_.find(job);
  return it == jobs_.end() ? 0 : it->second.committed;
}

Result<SyncJobStatus> SyncEngine::JobStatus(const std::string& name) const {
  SyncJobStatus s;
  s.job = name;
  s.site = options_.site;
  const std::optional<MembershipStatus> ms = membership_.StatusOf(name);
  if (ms) {
    s.pending = ms->pending;
    s.change_note = ms->note;
    s.catching_up = ms->catching_up;
    s.draining = ms->draining;
  }
  auto found = FindJob(name);
  if (!found.ok()) {
    if (ms) return s;  // being joined: the protocol's part is all there is
    return found.status();
  }
  const Job* j = *found;
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
  s.joined = j->joined;
  s.round_work_pending = deferred_.count(name) != 0;
  s.round_work_failures = j->round_work_failures;
  s.round_work_error = j->round_work_error;
  return s;
}

Result<std::vector<std::pair<uint64_t, std::string>>> SyncEngine::Digests(const std::string& name,
                                                                          uint64_t from_round,
                                                                          uint64_t max) const {
  ISTHMUS_ASSIGN_OR_RETURN(const Job* j, FindJob(name));
  (void)j;
  std::vector<std::pair<uint64_t, std::string>> out;
  const std::string prefix = keys::DigestPrefix(name);
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
  for (const auto& name : membership_.JoiningJobs(/*failed=*/false)) out.push_back(name);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());  // a removed site joining again
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
  ISTHMUS_ASSIGN_OR_RETURN(EncodedDelta d, DecodeDelta(*bytes));
  return std::shared_ptr<const EncodedDelta>(std::make_shared<EncodedDelta>(std::move(d)));
}

void SyncEngine::CollectGarbage(const std::string& name, const Job& j, WriteBatch& batch) const {
  DropOldDeltas(name, j, j.committed, j.state_round, batch);
}

void SyncEngine::DropOldDeltas(const std::string& name, const Job& j, uint64_t committed,
                               uint64_t state_round, WriteBatch& batch) const {
  if (committed <= options_.replay_rounds) return;
  // The rounds after the stored state stay too: a start replays them.
  const uint64_t limit = std::min(committed - options_.replay_rounds, state_round);
  // This site's own stay while a start recomputes the residuals from them (LoadResiduals).
  uint64_t own_limit = std::min(limit, j.residual_round);
  for (const auto& p : MemberPeers(j)) {
    auto it = j.acked.find(p);
    own_limit = std::min(own_limit, it == j.acked.end() ? 0 : it->second);
  }
  // Every site that ever sent a delta: the members, and sites removed since.
  std::set<std::string> sites(j.members.sites.begin(), j.members.sites.end());
  for (const auto& [s, _] : j.removed) sites.insert(s);
  for (const auto& site : sites) {
    const uint64_t upto = site == options_.site ? own_limit : limit;
    if (upto == 0) continue;
    const std::string prefix = keys::DeltaPrefix(name, site);
    (void)store_->ScanKeys(Column::kDeltas, prefix, [&](std::string_view k) {
      if (k.size() != prefix.size() + 8) return true;
      if (FromBigEndian64(k.substr(prefix.size())) > upto) return false;
      batch.Delete(Column::kDeltas, std::string(k));
      return true;
    });
  }
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
  batch.PutOwned(Column::kSync, SyncRecordKey(name), EncodeSyncRecord(j));
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
  if (std::string why = NonMemberReason(name, *j, from_site, options_.site); !why.empty()) {
    return Status::PermissionDenied(why);
  }
  if (delta.round == 0) return Status::InvalidArgument("delta for round 0");
  auto& held = j->inbox[from_site];
  if (delta.round <= j->committed || held.count(delta.round)) {
    // Duplicate: already held or committed. A resend also retries a commit that failed
    // after the delta was held (say the disk was full), so the round goes on by itself.
    ISTHMUS_RETURN_IF_ERROR(CommitReadyOrDefer(name, *j));
    return HeldContiguous(*j, from_site);
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
  for (const auto& et : delta.tensors) {
    auto it = j->theta.find(et.name);
    if (it == j->theta.end() || !seen.insert(et.name).second) {
      return Status::InvalidArgument("delta tensor '" + et.name + "' is unknown or repeated");
    }
    if (et.shape != it->second.shape) {
      return Status::InvalidArgument("delta tensor '" + et.name + "' has the wrong shape");
    }
    // Decode's validation without a tensor to decode into: bytes that pass decode to finite
    // values only, into the commit's merge.
    Status s = codec::Check(et.bytes, it->second.data->size());
    if (!s.ok()) return Status::InvalidArgument("delta tensor '" + et.name + "': " + s.message());
  }
  const std::string serialized = EncodeDelta(delta);
  SyncRecord rec_view = *j;
  rec_view.version = j->version + 1;
  WriteBatch batch;
  batch.Put(Column::kDeltas, DeltaKey(name, from_site, delta.round), serialized);
  batch.PutOwned(Column::kSync, HeldKey(name, from_site, delta.round),
                 EncodeHeldTokens(delta.tokens));
  batch.PutOwned(Column::kSync, SyncRecordKey(name), EncodeSyncRecord(rec_view));
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  held[delta.round] = delta.tokens;
  j->version = rec_view.version;
  j->view.reset();
  ISTHMUS_RETURN_IF_ERROR(CommitReadyOrDefer(name, *j));
  return HeldContiguous(*j, from_site);
}

// ---- membership: the peer links' requests go to the protocol --------------------------

Result<Membership> SyncEngine::Members(const std::string& name) const {
  ISTHMUS_ASSIGN_OR_RETURN(const Job* j, FindJob(name));
  return j->members;
}

uint64_t SyncEngine::FirstRoundTo(const std::string& peer, const std::string& job) const {
  return membership_.FirstRoundTo(peer, job);
}

std::string SyncEngine::RefusesPeer(const std::string& site, const std::string& job) const {
  return membership_.RefusesPeer(site, job);
}

uint64_t SyncEngine::RemovedFrom(const std::string& site, const std::string& job) const {
  return membership_.RemovedFrom(site, job);
}

void SyncEngine::OnRemovedNotice(const std::string& peer, const std::string& job,
                                 uint64_t removed_from) {
  membership_.OnRemovedNotice(peer, job, removed_from);
}

std::vector<MembershipRequest> SyncEngine::MembershipRequests(const std::string& peer) {
  return membership_.Requests(peer);
}

void SyncEngine::OnMembershipAnswer(const std::string& peer, const MembershipRequest& req,
                                    const MembershipAnswer& answer) {
  membership_.OnAnswer(peer, req, answer);
}

MembershipAnswer SyncEngine::OnMembershipRequest(const std::string& from,
                                                 const MembershipRequest& req) {
  return membership_.OnRequest(from, req);
}

std::vector<std::string> SyncEngine::StatusJobs() const {
  std::vector<std::string> out;
  for (const auto& [name, _] : jobs_) out.push_back(name);
  for (const auto& name : membership_.JoiningJobs(/*failed=*/true)) out.push_back(name);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// ---- MembershipHost: the writes of a membership change that touch rounds ----------------

std::vector<std::string> SyncEngine::Jobs() const {
  std::vector<std::string> out;
  for (const auto& [name, _] : jobs_) out.push_back(name);
  return out;
}

const SyncRecord* SyncEngine::Record(const std::string& job) const {
  auto it = jobs_.find(job);
  return it == jobs_.end() ? nullptr : &it->second;
}

Status SyncEngine::WritePending(const std::string& name,
                                const std::optional<MembershipChange>& pending) {
  ISTHMUS_ASSIGN_OR_RETURN(Job * j, FindJob(name));
  SyncRecord rec = *j;
  rec.pending = pending;
  WriteBatch batch;
  batch.PutOwned(Column::kSync, SyncRecordKey(name), EncodeSyncRecord(rec));
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  j->pending = pending;
  return Status::Ok();
}

Status SyncEngine::ApplyMembership(const std::string& name, const SyncRecord& next,
                                   const std::vector<std::string>& gone) {
  ISTHMUS_ASSIGN_OR_RETURN(Job * j, FindJob(name));
  (void)FinishStateWrite(name, *j, /*wait=*/true);  // the rows below come after its own
  WriteBatch batch;
  // A site that goes: its deltas for rounds from the cut on are dropped; every earlier round
  // has been committed with its delta by every site of the new membership.
  for (const auto& s : gone) {
    if (s == options_.site) continue;
    auto it = j->inbox.find(s);
    if (it == j->inbox.end()) continue;
    for (const auto& [r, _] : it->second) {
      batch.Delete(Column::kSync, HeldKey(name, s, r));
      batch.Delete(Column::kDeltas, DeltaKey(name, s, r));
    }
  }
  // The state is written with the change: rounds after the stored state are replayed at a
  // start with the members of the time (RebuildState), so they must all be the new ones'.
  SyncRecord rec = next;
  rec.state_round = j->committed;
  WriteStateRows(name, j->theta, j->momentum, j->unsaved, rec.version, batch);
  batch.PutOwned(Column::kSync, SyncRecordKey(name), EncodeSyncRecord(rec));
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  static_cast<SyncRecord&>(*j) = rec;
  j->unsaved.clear();
  for (const auto& s : gone) {
    if (s != options_.site) j->inbox.erase(s);
  }
  j->view.reset();
  return Status::Ok();
}

Status SyncEngine::CommitReady(const std::string& name) {
  ISTHMUS_ASSIGN_OR_RETURN(Job * j, FindJob(name));
  return CommitReady(name, *j);
}

Result<std::shared_ptr<const JobImage>> SyncEngine::Image(const std::string& name) const {
  ISTHMUS_ASSIGN_OR_RETURN(const Job* j, FindJob(name));
  auto image = std::make_shared<JobImage>();
  image->round = j->committed;
  image->members = j->members;
  image->version = j->version;
  image->base_hash = hooks_.base_hash ? hooks_.base_hash(name) : "";
  ISTHMUS_ASSIGN_OR_RETURN(auto digest, Digest(name, j->committed));
  if (!digest) {
    return Status::Corruption("job '" + name + "' has no digest of its committed round");
  }
  image->digest = *digest;
  for (const auto& [tname, t] : j->theta) {
    ImageTensor it{tname, t.shape, t.data, nullptr};
    if (auto m = j->momentum.find(tname); m != j->momentum.end()) it.momentum = m->second;
    image->tensors.push_back(std::move(it));
  }
  return std::shared_ptr<const JobImage>(std::move(image));
}

Result<std::optional<std::string>> SyncEngine::Digest(const std::string& name,
                                                      uint64_t round) const {
  ISTHMUS_ASSIGN_OR_RETURN(auto d, Digests(name, round, 1));
  if (d.empty() || d.front().first != round) return std::optional<std::string>();
  return std::optional<std::string>(d.front().second);
}

Status SyncEngine::InstallImage(const std::string& name, const JobImage& image,
                                const MembershipChange& change) {
  if (!hooks_.install) return Status::FailedPrecondition("this shard cannot create joined jobs");
  Job j;
  for (const auto& t : image.tensors) {
    j.theta[t.name] = SyncTensor{t.shape, t.theta};
    if (t.momentum) j.momentum[t.name] = t.momentum;
  }
  j.committed = j.local = j.state_round = j.residual_round = image.round;
  j.version = image.version;
  j.members = image.members;
  j.pending = change;
  WriteBatch batch;
  if (jobs_.count(name)) {
    // A removed site joining again: its old rounds (staged, residuals, momentum, in- and
    // outbox, held markers) go; the digests of rounds it committed stay (they are the
    // members' too).
    for (Column c : {Column::kState, Column::kDeltas}) {
      ISTHMUS_RETURN_IF_ERROR(
          store_->Scan(c, keys::JobPrefix(name), [&](std::string_view k, std::string_view) {
            batch.Delete(c, std::string(k));
            return true;
          }));
    }
    ISTHMUS_RETURN_IF_ERROR(store_->Scan(Column::kSync, keys::HeldPrefix(name),
                                         [&](std::string_view k, std::string_view) {
                                           batch.Delete(Column::kSync, std::string(k));
                                           return true;
                                         }));
  }
  for (const auto& [tname, m] : j.momentum) {
    batch.Put(Column::kState, StateKey(name, StateKind::kMomentum, tname), FloatBytes(*m));
  }
  batch.PutOwned(Column::kSync, SyncRecordKey(name), EncodeSyncRecord(j));
  batch.PutOwned(Column::kSync, DigestKey(name, image.round), image.digest);
  ISTHMUS_RETURN_IF_ERROR(hooks_.install(name, image.base_hash, j.theta, image.version, batch));
  jobs_[name] = std::move(j);
  return Status::Ok();
}

Status SyncEngine::AdoptImage(const std::string& name, const JobImage& image) {
  ISTHMUS_ASSIGN_OR_RETURN(Job * j, FindJob(name));
  (void)FinishStateWrite(name, *j, /*wait=*/true);  // the rows below come after its own
  std::map<std::string, SyncTensor> theta;
  std::map<std::string, std::shared_ptr<const std::vector<float>>> momentum;
  for (const auto& t : image.tensors) {
    auto mine = j->theta.find(t.name);
    if (mine == j->theta.end() || mine->second.shape != t.shape) {
      return Status::InvalidArgument("tensor '" + t.name +
                                     "' of the state is not one of this job's");
    }
    theta[t.name] = SyncTensor{t.shape, t.theta};
    if (t.momentum) momentum[t.name] = t.momentum;
  }
  if (theta.size() != j->theta.size()) {
    return Status::InvalidArgument("the state has another tensor set");
  }
  // One batch: the state of round image.round, its digest, and the removal of the inputs of
  // the rounds it covers (their result is that state).
  SyncRecord rec = *j;
  rec.committed = image.round;
  rec.state_round = image.round;
  rec.local = std::max(j->local, image.round);
  rec.version = std::max(j->version, image.version) + 1;
  WriteBatch batch;
  const bool write_residuals = rec.local > j->local;
  if (write_residuals) {
    // Rounds this site never closed: its residuals carry over them, written now (a start
    // could not recompute them across rounds without staged deltas).
    ISTHMUS_RETURN_IF_ERROR(LoadResiduals(name, *j));
    for (const auto& [tname, r] : j->residual) {
      batch.Put(Column::kState, StateKey(name, StateKind::kResidual, tname), FloatBytes(r));
      for (uint64_t k = j->residual_round + 1; k <= j->local; ++k) {
        batch.Delete(Column::kState, keys::StagedKey(name, k, tname));
        batch.Delete(Column::kState, keys::StagedEncodedKey(name, k, tname));
      }
    }
    rec.residual_round = rec.local;
  }
  for (const auto& [tname, t] : theta) {
    batch.Put(Column::kTensors, keys::TensorKey(name, tname), FloatBytes(*t.data));
    batch.PutOwned(Column::kTensorMeta, keys::TensorKey(name, tname),
                   EncodeTensorRecord({t.shape, rec.version}));
    if (t.data && momentum.count(tname)) {
      batch.Put(Column::kState, StateKey(name, StateKind::kMomentum, tname),
                FloatBytes(*momentum.at(tname)));
    }
  }
  batch.PutOwned(Column::kSync, DigestKey(name, image.round), image.digest);
  for (const auto& [site, rounds] : j->inbox) {
    for (const auto& [r, _] : rounds) {
      if (r > image.round) continue;
      batch.Delete(Column::kSync, HeldKey(name, site, r));
      if (site != options_.site) batch.Delete(Column::kDeltas, DeltaKey(name, site, r));
    }
  }
  batch.PutOwned(Column::kSync, SyncRecordKey(name), EncodeSyncRecord(rec));
  ISTHMUS_RETURN_IF_ERROR(store_->Write(batch));
  static_cast<SyncRecord&>(*j) = rec;
  if (write_residuals) j->residual_changed.clear();  // every row written
  j->unsaved.clear();
  j->theta = std::move(theta);
  if (keeps_momentum()) j->momentum = std::move(momentum);
  for (auto& [site, rounds] : j->inbox) {
    for (auto r = rounds.begin(); r != rounds.end();) {
      r = r->first <= image.round ? rounds.erase(r) : std::next(r);
    }
  }
  j->view.reset();
  return Status::Ok();
}

}  // namespace isthmus
