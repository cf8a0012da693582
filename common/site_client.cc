// The site client (see site_client.h): a job's shards seen as one, for worker ranks.
#include "common/site_client.h"

#include <set>
#include <thread>

#include "common/sharding.h"

namespace isthmus {
namespace {

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

}  // namespace

Result<std::unique_ptr<SiteClient>> SiteClient::Connect(const SiteOptions& options) {
  if (options.job.empty()) return Status::InvalidArgument("no job named");
  if (options.servers.empty()) return Status::InvalidArgument("no shard endpoints given");
  if (!options.insecure_plaintext) {
    const size_t keys = options.server_public_keys.size();
    if (keys != 1 && keys != options.servers.size()) {
      return Status::InvalidArgument(
          "give one server public key for all shards or one per shard (got " +
          std::to_string(keys) + " for " + std::to_string(options.servers.size()) + " shards)");
    }
    if (options.client_keys.secret_key.empty()) {
      return Status::InvalidArgument("no client key pair given (or use insecure_plaintext)");
    }
  }
  auto site = std::unique_ptr<SiteClient>(new SiteClient(options));
  if (site->options_.client_name.empty()) site->options_.client_name = "site";
  for (size_t i = 0; i < options.servers.size(); ++i) {
    ClientOptions o;
    o.endpoint = options.servers[i];
    o.insecure_plaintext = options.insecure_plaintext;
    o.timeout_ms = options.timeout_ms;
    o.connect_timeout_ms = options.connect_timeout_ms;
    o.retries = options.retries;
    o.interrupted = options.interrupted;
    if (!options.insecure_plaintext) {
      const auto& keys = options.server_public_keys;
      o.server_public_key = keys.size() == 1 ? keys[0] : keys[i];
      const auto& files = options.server_key_files;
      if (files.size() == keys.size()) o.server_key_file = files.size() == 1 ? files[0] : files[i];
      o.client_keys = options.client_keys;
    }
    auto c = ShardClient::Connect(o);
    if (!c.ok()) return site->AtShard(i, c.status());
    site->shards_.push_back(std::move(c).value());
  }
  return site;
}

std::string SiteClient::Where(size_t i) const {
  return "shard " + std::to_string(i) + " (" + options_.servers.at(i) + ")";
}

Status SiteClient::AtShard(size_t i, const Status& status) const {
  return Status(status.code(), Where(i) + ": " + status.message());
}

std::string SiteClient::PushKey(uint64_t round, int shard) const {
  return options_.job + "/" + options_.client_name + "/r" + std::to_string(round) + "/s" +
         std::to_string(shard);
}

Result<std::vector<HelloInfo>> SiteClient::Hello(const std::string& base_hash) {
  base_hash_ = base_hash;
  std::vector<HelloInfo> out;
  for (size_t i = 0; i < shards_.size(); ++i) {
    auto h = shards_[i]->Hello(options_.job, wire::Role::Worker, base_hash, options_.client_name);
    if (!h.ok()) {
      const Status& s = h.status();
      if (s.code() == Code::kFailedPrecondition) {
        return AtShard(i, Status::FailedPrecondition("holds job '" + options_.job +
                                                     "' for another base model (ours is " +
                                                     base_hash + "): " + s.message()));
      }
      if (s.code() == Code::kTimeout) {
        return AtShard(i, Status::Timeout("did not answer (down, wrong endpoint, or our key is "
                                          "not on its worker allowlist): " +
                                          s.message()));
      }
      return AtShard(i, s);
    }
    if (h->tensor_count == 0) {
      return AtShard(i, Status::NotFound("has no job '" + options_.job +
                                         "' (create it with isthmusctl job create)"));
    }
    out.push_back(std::move(h).value());
  }
  return out;
}

Status SiteClient::Place(const std::string& name, size_t i,
                         std::map<std::string, int>& seen) const {
  auto want = placement_.find(name);
  if (want != placement_.end() && want->second != static_cast<int>(i)) {
    return Status::FailedPrecondition("tensor " + name + " is on " + Where(i) + ", not on shard " +
                                      std::to_string(want->second) +
                                      ": give the servers in the order the job was created with");
  }
  seen[name] = static_cast<int>(i);
  return Status::Ok();
}

Result<std::vector<Tensor>> SiteClient::Pull() {
  std::vector<Tensor> all;
  std::map<std::string, int> seen;
  for (size_t i = 0; i < shards_.size(); ++i) {
    auto r = [&]() -> Result<std::vector<Tensor>> {
      if (puller_) return puller_->Pull(i, *shards_[i], options_.job);
      ISTHMUS_ASSIGN_OR_RETURN(PullResult p, shards_[i]->Pull(options_.job));
      return std::move(p.tensors);
    }();
    if (!r.ok()) return AtShard(i, Status(r.status().code(), "pull: " + r.status().message()));
    for (auto& t : *r) {
      ISTHMUS_RETURN_IF_ERROR(Place(t.name, i, seen));
      all.push_back(std::move(t));
    }
  }
  placement_ = std::move(seen);
  shapes_.clear();
  for (const auto& t : all) shapes_[t.name] = t.shape;
  return all;
}

Result<std::vector<PullView>> SiteClient::PullInPlace() {
  std::vector<PullView> views;
  std::map<std::string, int> seen;
  for (size_t i = 0; i < shards_.size(); ++i) {
    auto r = shards_[i]->PullInPlace(options_.job);
    if (!r.ok()) return AtShard(i, Status(r.status().code(), "pull: " + r.status().message()));
    for (const auto& t : r->tensors) ISTHMUS_RETURN_IF_ERROR(Place(t.name, i, seen));
    views.push_back(std::move(r).value());
  }
  placement_ = std::move(seen);
  shapes_.clear();
  for (const auto& v : views) {
    for (const auto& t : v.tensors) shapes_[t.name] = t.shape;
  }
  return views;
}

std::map<std::string, int> SiteClient::PlaceTensors(const std::vector<TensorView>& tensors,
                                                    int num_shards) {
  std::vector<TensorSize> sizes;
  for (const auto& t : tensors) {
    sizes.push_back({t.name, static_cast<uint64_t>(std::max<int64_t>(0, NumElements(t.shape))) *
                                 sizeof(float)});
  }
  const std::vector<int> shard = AssignTensorsToShards(sizes, num_shards);
  std::map<std::string, int> out;
  for (size_t i = 0; i < tensors.size(); ++i) out[tensors[i].name] = shard[i];
  return out;
}

Result<std::vector<ShardPush>> SiteClient::PushRound(uint64_t round, uint64_t tokens,
                                                     uint64_t compute_ms,
                                                     const std::vector<TensorView>& deltas,
                                                     int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world) {
    return Status::InvalidArgument("rank " + std::to_string(rank) + " of world size " +
                                   std::to_string(world) + " is not a rank of the site");
  }
  ISTHMUS_RETURN_IF_ERROR(CheckTensorViews(deltas));
  std::vector<std::vector<TensorView>> per_shard(shards_.size());
  for (const auto& d : deltas) {
    auto it = placement_.find(d.name);
    if (it == placement_.end()) {
      return Status::NotFound("tensor '" + d.name + "' is not a tensor of job '" + options_.job +
                              "' on any shard" +
                              (placement_.empty() ? " (pull first, or set the placement)" : ""));
    }
    if (auto shape = shapes_.find(d.name); shape != shapes_.end() && shape->second != d.shape) {
      return Status::InvalidArgument("round " + std::to_string(round) + ": tensor '" + d.name +
                                     "' has shape " + ShapeText(d.shape) + ", the job's is " +
                                     ShapeText(shape->second) + "; nothing was sent");
    }
    per_shard.at(it->second).push_back(d);
  }
  // Each shard this rank pushes gets its whole tensor set: a shard that staged part of a
  // round would wait for the rest under the same key (and a retry with more is another push).
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (static_cast<int>(s % world) != rank) continue;
    std::set<std::string> have;
    for (const auto& d : per_shard[s]) {
      if (!have.insert(d.name).second) {
        return Status::InvalidArgument("round " + std::to_string(round) + ": tensor '" + d.name +
                                       "' is given twice; nothing was sent");
      }
    }
    std::string missing;
    size_t count = 0;
    for (const auto& [name, shard] : placement_) {
      if (shard != static_cast<int>(s) || have.count(name)) continue;
      if (++count <= 8) missing += (missing.empty() ? "" : ", ") + name;
    }
    if (count > 0) {
      return Status::InvalidArgument(
          "round " + std::to_string(round) + " leaves out " + std::to_string(count) + " of " +
          Where(s) + "'s tensors (" + missing + (count > 8 ? ", ..." : "") +
          "): a round's push carries every tensor of the shards it goes to (zeros for one that "
          "did not change); nothing was sent");
    }
  }
  std::vector<ShardPush> out;
  for (size_t s = 0; s < shards_.size(); ++s) {
    if (static_cast<int>(s % world) != rank) continue;
    ShardPush p;
    p.shard = static_cast<int>(s);
    p.key = PushKey(round, p.shard);
    p.tensors = per_shard[s].size();
    ISTHMUS_RETURN_IF_ERROR(EncodeFor(s, round, compute_ms, per_shard[s]));
    for (const auto& t : per_shard[s]) {
      const uint64_t raw = static_cast<uint64_t>(NumElements(t.shape)) * sizeof(float);
      pushed_raw_bytes_ += raw;
      pushed_bytes_ += t.encoded ? t.encoded->size() : raw;
    }
    auto r = shards_[s]->Push(options_.job, p.key, round, tokens, per_shard[s], compute_ms);
    if (!r.ok()) {
      std::string done;
      for (const auto& d : out) done += (done.empty() ? "" : ", ") + std::to_string(d.shard);
      return AtShard(
          s, Status(r.status().code(),
                    "push of round " + std::to_string(round) + ": " + r.status().message() + " (" +
                        (done.empty() ? std::string("no shard has the round yet")
                                      : "shards " + done + " have the round") +
                        "; calling PushRound again for this round completes it)"));
    }
    p.duplicate = r->duplicate;
    p.rounds = r->rounds;
    out.push_back(std::move(p));
  }
  if (encoder_) encoder_->Done(round);
  return out;
}

Status SiteClient::EncodeFor(size_t shard, uint64_t round, uint64_t compute_ms,
                             std::vector<TensorView>& deltas) {
  if (!encoder_) return Status::Ok();
  std::map<std::string, std::string> pipes;
  if (!encoder_->Kept(round, deltas, &pipes)) {
    // The pipelines the round's close would choose now (adaptive sizing from the link's
    // latest bandwidth), asked right before the round is encoded.
    auto h = shards_[shard]->Hello(options_.job, wire::Role::Worker, base_hash_,
                                   options_.client_name, true, compute_ms);
    if (!h.ok()) return AtShard(shard, h.status());
    // Pipelines of another round (the shard holds this one already: a retried push) or none
    // (the job does not sync): the fp32 deltas go, and the shard answers them as it does.
    if (h->pipelines.round != round) return Status::Ok();
    pipes = std::move(h->pipelines.pipelines);
  }
  std::vector<TensorView> to_encode;
  std::vector<size_t> at;
  for (size_t i = 0; i < deltas.size(); ++i) {
    auto it = pipes.find(deltas[i].name);
    // Dense: the fp32 values are what an encoding would carry.
    if (it == pipes.end() || it->second == "dense") continue;
    to_encode.push_back(deltas[i]);
    at.push_back(i);
  }
  if (to_encode.empty()) return Status::Ok();
  auto bytes = encoder_->Encode(round, to_encode, pipes);
  if (!bytes.ok()) {
    return AtShard(
        shard, Status(bytes.status().code(), "cannot encode round " + std::to_string(round) + ": " +
                                                 bytes.status().message()));
  }
  for (size_t k = 0; k < at.size(); ++k) deltas[at[k]].encoded = (*bytes)[k];
  return Status::Ok();
}

Result<Staleness> SiteClient::CheckStaleness() {
  Staleness st;
  for (size_t i = 0; i < shards_.size(); ++i) {
    auto h = shards_[i]->Hello(options_.job, wire::Role::Worker, base_hash_, options_.client_name);
    if (!h.ok()) return AtShard(i, h.status());
    const RoundInfo& r = h->rounds;
    st.lowest_local_round = i == 0 ? r.local_round : std::min(st.lowest_local_round, r.local_round);
    const uint64_t ahead =
        r.local_round > r.committed_round ? r.local_round - r.committed_round : 0;
    if (st.shard < 0 || ahead > st.rounds_ahead) {
      st.shard = static_cast<int>(i);
      st.rounds_ahead = ahead;
      st.limit = r.max_rounds_ahead;
    }
    if (ahead > r.max_rounds_ahead && !st.too_far_ahead) {
      st.too_far_ahead = true;
      st.reason = "waiting for the WAN: " + std::to_string(ahead) +
                  " rounds ahead of the last commit (limit " + std::to_string(r.max_rounds_ahead) +
                  ") on shard " + std::to_string(i);
    }
  }
  return st;
}

Result<Staleness> SiteClient::WaitWithinStaleness(std::chrono::milliseconds timeout,
                                                  const std::atomic<bool>* stop,
                                                  std::chrono::milliseconds poll) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    ISTHMUS_ASSIGN_OR_RETURN(Staleness st, CheckStaleness());
    if (!st.too_far_ahead || (stop != nullptr && stop->load()) ||
        std::chrono::steady_clock::now() + poll > deadline) {
      return st;
    }
    // Sleep in slices, so that an interrupt is seen within 100 ms whatever `poll` is.
    const auto wake = std::chrono::steady_clock::now() + poll;
    for (auto now = std::chrono::steady_clock::now(); now < wake;
         now = std::chrono::steady_clock::now()) {
      if (options_.interrupted && options_.interrupted()) {
        return Status::Unavailable("interrupted while waiting for the WAN (" + st.reason + ")");
      }
      std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
          wake - now, std::chrono::milliseconds(100)));
    }
  }
}

}  // namespace isthmus
