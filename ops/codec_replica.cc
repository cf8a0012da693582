// Pulling by replay (codec_replica.h). Compiled with -ffp-contract=off like the rest of this
// library: the replayed commits must give the shard's bits.
#include "ops/codec_replica.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "common/pipelined.h"
#include "common/state_digest.h"
#include "ops/codec.h"
#include "ops/codec_outer.h"

namespace isthmus::codec {

std::vector<float>* ShardReplica::theta(const std::string& name) {
  auto it = state_.find(name);
  return have_ && it != state_.end() ? &it->second.theta : nullptr;
}

Status ShardReplica::Load(const ReplayReply& reply) {
  const bool momentum = reply.outer_momentum != 0.0f;
  std::map<std::string, const ReplayTensor*> m;
  for (const auto& t : reply.base_momentum) m[t.name] = &t;
  std::map<std::string, Entry> state;
  for (const auto& t : reply.base) {
    Entry e{t.shape, std::vector<float>(t.bytes.size() / sizeof(float)), {}};
    std::memcpy(e.theta.data(), t.bytes.data(), t.bytes.size());
    if (momentum) {
      auto it = m.find(t.name);
      if (it == m.end() || it->second->bytes.size() != t.bytes.size()) {
        return Status::InvalidArgument("pull by replay: tensor '" + t.name +
                                       "' came without its outer momentum");
      }
      e.momentum.resize(e.theta.size());
      std::memcpy(e.momentum.data(), it->second->bytes.data(), it->second->bytes.size());
    }
    if (!state.emplace(t.name, std::move(e)).second) {
      return Status::InvalidArgument("pull by replay: tensor '" + t.name + "' came twice");
    }
  }
  state_ = std::move(state);
  // The merge buffer at its largest now, its pages touched, not in the first replay.
  size_t largest = 0;
  for (const auto& [name, e] : state_) largest = std::max(largest, e.theta.size());
  if (merged_.size() < largest) merged_.assign(largest, 0.0f);
  round_ = reply.base_round;
  digest_ = reply.digest;  // of committed_round: equal to base_round's when nothing follows
  have_ = true;
  return Status::Ok();
}

Result<ShardReplica::RoundParts> ShardReplica::PartsOf(const std::map<std::string, Entry>& state,
                                                       const ReplayRoundDeltas& round) {
  uint64_t total = 0;
  for (const auto& d : round.deltas) total += d.tokens;
  RoundParts parts;
  for (const auto& d : round.deltas) {
    if (d.tensors.size() != state.size()) {
      return Status::InvalidArgument("pull by replay: site " + d.site + "'s delta of round " +
                                     std::to_string(round.round) + " has " +
                                     std::to_string(d.tensors.size()) + " tensors, the job " +
                                     std::to_string(state.size()));
    }
    const float w = MergeWeight(d.tokens, total, round.deltas.size());
    for (const auto& t : d.tensors) {
      if (!state.count(t.name)) {
        return Status::InvalidArgument("pull by replay: round " + std::to_string(round.round) +
                                       " has unknown tensor '" + t.name + "'");
      }
      parts[t.name].emplace_back(w, t.bytes);
    }
  }
  return parts;
}

Status ShardReplica::ApplyTensor(const std::string& name, Entry& e, const RoundParts& parts,
                                 float lr, float mu) {
  auto it = parts.find(name);
  if (it == parts.end()) return Status::Ok();  // no site sent it
  std::vector<float>& merged = merged_;
  merged.assign(e.theta.size(), 0.0f);
  bool sent = false;
  for (const auto& [w, bytes] : it->second) {
    if (IsDeferred(bytes)) continue;  // decodes to zeros: nothing to add
    sent = true;
    ISTHMUS_RETURN_IF_ERROR(DecodeAddWeighted(bytes, w, merged));
  }
  if (!sent) return Status::Ok();  // deferred by every site: no outer step, momentum kept
  if (mu != 0.0f && e.momentum.size() != e.theta.size()) {
    return Status::InvalidArgument("pull by replay: no outer momentum for tensor '" + name + "'");
  }
  ApplyOuterStep(e.theta.data(), mu != 0.0f ? e.momentum.data() : nullptr, merged.data(),
                 merged.size(), lr, mu);
  return Status::Ok();
}

Status ShardReplica::ApplyRound(std::map<std::string, Entry>& state, const ReplayRoundDeltas& round,
                                float lr, float mu) {
  ISTHMUS_ASSIGN_OR_RETURN(RoundParts parts, PartsOf(state, round));
  for (auto& [name, e] : state) ISTHMUS_RETURN_IF_ERROR(ApplyTensor(name, e, parts, lr, mu));
  return Status::Ok();
}

Result<std::string> ShardReplica::ApplyRoundAndDigest(const ReplayRoundDeltas& round,
                                                      const ReplayReply& reply, float lr,
                                                      float mu) {
  ISTHMUS_ASSIGN_OR_RETURN(RoundParts parts, PartsOf(state_, round));
  std::vector<std::pair<const std::string*, Entry*>> entries;
  for (auto& [name, e] : state_) entries.emplace_back(&name, &e);
  // The shard's fast check when it sent one (a tenth of SHA-256's time here), else the
  // digest itself.
  StateDigester digester(reply.committed_round,
                         reply.check.empty() ? DigestKind::kSha256 : DigestKind::kCheck);
  ISTHMUS_RETURN_IF_ERROR(Pipelined(
      entries.size(),
      [&](size_t i) { return ApplyTensor(*entries[i].first, *entries[i].second, parts, lr, mu); },
      [&](size_t i) {
        const Entry& e = *entries[i].second;
        digester.Add({*entries[i].first, e.shape, e.theta, e.momentum});
      }));
  return digester.Finish(reply.epoch, reply.members_from, reply.members);
}

Result<std::vector<Tensor>> ShardReplica::Pull(ShardClient& client, const std::string& job,
                                               ReplayStats& stats,
                                               std::map<std::string, std::vector<float>>& spare) {
  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  for (int attempt = 0;; ++attempt) {
    auto t = Clock::now();
    if (plain_only_) {
      ISTHMUS_ASSIGN_OR_RETURN(PullResult plain, client.Pull(job));
      stats.request_s += seconds_since(t);
      return std::move(plain.tensors);
    }
    auto got_reply = client.PullReplay(job, have_ ? round_ : 0, have_ ? digest_ : "");
    if (got_reply.status().code() == Code::kResourceExhausted) {
      // The whole state (theta and momentum, twice a plain pull) exceeds the message limit:
      // this shard's tensors are pulled whole from now on.
      spdlog::warn("pull by replay of job '{}': {}; this shard's tensors are pulled whole", job,
                   got_reply.status().message());
      plain_only_ = true;
      have_ = false;
      state_.clear();
      continue;
    }
    ISTHMUS_ASSIGN_OR_RETURN(ReplayReply reply, std::move(got_reply));
    stats.request_s += seconds_since(t);
    t = Clock::now();
    ++stats.pulls;
    stats.payload_bytes += reply.payload_bytes;
    if (!reply.replayed) {  // the job does not sync there: its tensors as they are
      have_ = false;
      return std::move(reply.plain.tensors);
    }
    const float lr = reply.outer_lr, mu = reply.outer_momentum;
    if (reply.whole) {
      ++stats.whole_pulls;
      ISTHMUS_RETURN_IF_ERROR(Load(reply));
    } else if (!have_ || reply.base_round != round_) {
      have_ = false;
      return Status::Internal("pull by replay: the shard replayed from round " +
                              std::to_string(reply.base_round) + ", this copy holds " +
                              std::to_string(round_));
    }
    // The last round's commit is hashed as it is replayed, tensor by tensor (the digest
    // covers the state after it).
    Status applied = Status::Ok();
    std::string got;
    for (size_t k = 0; k < reply.committed.size() && applied.ok(); ++k) {
      const auto& r = reply.committed[k];
      if (k + 1 < reply.committed.size()) {
        applied = ApplyRound(state_, r, lr, mu);
      } else {
        auto digest = ApplyRoundAndDigest(r, reply, lr, mu);
        applied = digest.status();
        if (digest.ok()) got = std::move(*digest);
      }
      if (applied.ok()) ++stats.rounds_replayed;
    }
    const std::string& want = reply.check.empty() ? reply.digest : reply.check;
    if (applied.ok() && !reply.committed.empty() && got != want) {
      ++stats.digest_mismatches;
      applied = Status::Corruption("the state replayed to round " +
                                   std::to_string(reply.committed_round) + " has " +
                                   (reply.check.empty() ? "digest " : "check ") +
                                   got.substr(0, 16) + ", the shard's is " + want.substr(0, 16));
    }
    if (applied.ok() && !reply.committed.empty()) {
      ++(reply.check.empty() ? stats.digest_checks : stats.fast_checks);
    }
    stats.replay_s += seconds_since(t);
    if (!applied.ok()) {
      have_ = false;
      state_.clear();
      if (attempt > 0) return applied;
      spdlog::warn("pull by replay of job '{}': {}; pulling the whole state", job,
                   applied.message());
      continue;
    }
    t = Clock::now();
    round_ = reply.committed_round;
    digest_ = reply.digest;
    // The served tensors: the committed state moved by the view's rounds (on copies).
    std::map<std::string, Entry> view;
    const std::map<std::string, Entry>* served = &state_;
    if (!reply.view.empty()) {
      ++stats.view_pulls;
      view = state_;
      for (const auto& r : reply.view) ISTHMUS_RETURN_IF_ERROR(ApplyRound(view, r, lr, mu));
      served = &view;
    }
    std::vector<Tensor> out;
    out.reserve(served->size());
    for (const auto& [name, e] : *served) {
      std::vector<float> data;
      if (auto kept = spare.extract(name)) data = std::move(kept.mapped());
      data.assign(e.theta.begin(), e.theta.end());  // in its memory when it is large enough
      out.push_back(Tensor{name, e.shape, std::move(data)});
      // After a whole state (the first pull) the next pull's buffers are taken now, as the
      // ones handed out here may never come back (they become the live weights).
      if (reply.whole && !spare.count(name)) spare[name].assign(e.theta.size(), 0.0f);
    }
    stats.serve_s += seconds_since(t);
    return out;
  }
}

Result<std::vector<Tensor>> ReplayPuller::Pull(size_t shard, ShardClient& client,
                                               const std::string& job) {
  if (replicas_.size() <= shard) replicas_.resize(shard + 1);
  return replicas_[shard].Pull(client, job, stats_, spare_);
}

void ReplayPuller::Recycle(std::vector<Tensor> pulled) {
  for (auto& t : pulled) spare_[t.name] = std::move(t.data);
}

}  // namespace isthmus::codec
