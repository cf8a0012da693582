#include "bench/wan/wan_load.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <thread>

#include "common/safetensors.h"
#include "ops/codec_worker.h"

namespace isthmus::wanload {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string RoundFile(const std::string& dir, int r) {
  return dir + "/round-" + std::to_string(r) + ".safetensors";
}

}  // namespace

Result<RecordedDeltas> LoadRecordedDeltas(const std::string& dir, int max_rounds) {
  auto prev = ReadSafetensorsTensors(RoundFile(dir, 0));
  if (!prev.ok()) {
    return Status::NotFound("no recorded start " + RoundFile(dir, 0) + " (" +
                            prev.status().message() + "; run bench/wan/record.sh)");
  }
  RecordedDeltas out;
  for (const auto& t : *prev) out.numel += t.data.size();
  for (int r = 1; max_rounds <= 0 || r <= max_rounds; ++r) {
    const std::string path = RoundFile(dir, r);
    auto next = ReadSafetensorsTensors(path);
    if (!next.ok()) {
      if (r == 1)
        return Status::NotFound("no recorded round " + path + ": " + next.status().message());
      break;  // the last round recorded
    }
    if (next->size() != prev->size()) {
      return Status::InvalidArgument(path + " holds " + std::to_string(next->size()) +
                                     " tensors, round-0 " + std::to_string(prev->size()));
    }
    std::vector<Tensor> delta;
    delta.reserve(next->size());
    for (size_t i = 0; i < next->size(); ++i) {
      const Tensor& a = (*prev)[i];
      const Tensor& b = (*next)[i];
      if (a.name != b.name || a.shape != b.shape) {
        return Status::InvalidArgument(path + ": tensor '" + b.name +
                                       "' does not match round-0's '" + a.name +
                                       "' (name or shape)");
      }
      Tensor d{b.name, b.shape, std::vector<float>(b.data.size())};
      for (size_t k = 0; k < d.data.size(); ++k) d.data[k] = b.data[k] - a.data[k];
      delta.push_back(std::move(d));
    }
    out.rounds.push_back(std::move(delta));
    prev = std::move(next);
  }
  return out;
}

LoadSummary Summarize(const std::vector<RoundTiming>& rounds, size_t skip) {
  LoadSummary s;
  double latency_sum = 0;
  size_t committed = 0;
  for (size_t i = skip; i < rounds.size(); ++i) {
    const auto& r = rounds[i];
    ++s.rounds;
    s.compute_s += r.compute_s;
    s.push_s += r.push_s;
    s.wait_s += r.wait_s;
    s.pull_s += r.pull_s;
    s.wall_s += r.wall_s;
    s.boundary_s += r.boundary_s;
    s.blocked_s += r.blocked_s;
    s.blocked_wan_s += r.blocked_wan_s;
    if (r.wait_s > 1e-3) ++s.rounds_waited;
    if (r.commit_latency_s >= 0) {
      latency_sum += r.commit_latency_s;
      s.max_commit_latency_s = std::max(s.max_commit_latency_s, r.commit_latency_s);
      ++committed;
    }
  }
  if (s.wall_s > 0) {
    s.wait_fraction = s.blocked_wan_s / s.wall_s;
    s.utilisation = 1.0 - s.wait_fraction;
    s.compute_fraction = s.compute_s / s.wall_s;
  }
  if (committed > 0) s.mean_commit_latency_s = latency_sum / static_cast<double>(committed);
  return s;
}

SyntheticSite::SyntheticSite(size_t shards, ConnectFn connect, ConnectSiteFn connect_site,
                             SiteOptions options)
    : shards_(shards),
      connect_(std::move(connect)),
      connect_site_(std::move(connect_site)),
      o_(std::move(options)) {}

SyntheticSite::~SyntheticSite() = default;

Status SyntheticSite::Prepare(const RecordedDeltas& deltas) {
  if (deltas.rounds.empty()) return Status::InvalidArgument("no recorded deltas to replay");
  std::map<std::string, size_t> index;
  const auto& first = deltas.rounds.front();
  for (size_t i = 0; i < first.size(); ++i) index[first[i].name] = i;
  driver_.reset();
  ISTHMUS_ASSIGN_OR_RETURN(site_, connect_site_());
  if (site_->num_shards() != shards_) {
    return Status::InvalidArgument("the site client has " + std::to_string(site_->num_shards()) +
                                   " shards, not " + std::to_string(shards_));
  }
  codec::FeedbackEncoder* encoder = nullptr;  // the site client's, when the site encodes
  if (o_.encode_threads > 0) {
    auto enc = std::make_unique<codec::FeedbackEncoder>(o_.encode_threads);
    encoder = enc.get();
    site_->SetEncoder(std::move(enc));
  }
  ISTHMUS_RETURN_IF_ERROR(site_->Hello("").status());
  // The puller from the first pull on, as isthmus-worker: round 1's pull then replays.
  if (o_.pull_by_replay) site_->SetPuller(std::make_unique<codec::ReplayPuller>());
  ISTHMUS_ASSIGN_OR_RETURN(std::vector<Tensor> pulled, site_->Pull());
  live_.assign(first.size(), Tensor{});
  size_t found = 0;
  for (auto& t : pulled) {
    auto it = index.find(t.name);
    if (it == index.end() || first[it->second].shape != t.shape) {
      return Status::InvalidArgument("job '" + o_.job + "' tensor '" + t.name + "' on shard " +
                                     std::to_string(site_->placement().at(t.name)) +
                                     " is not in the recorded deltas with that shape");
    }
    live_[it->second] = std::move(t);
    ++found;
  }
  if (found != first.size()) {
    return Status::InvalidArgument("the recorded deltas hold " + std::to_string(first.size()) +
                                   " tensors, job '" + o_.job + "' " + std::to_string(found));
  }
  if (encoder != nullptr) {
    std::map<std::string, size_t> sizes;  // as isthmus-worker: at start-up, not in round 1
    for (const auto& t : live_) sizes[t.name] = t.data.size();
    encoder->Reserve(sizes);
  }
  std::vector<LiveTensor> views;
  for (auto& t : live_) views.push_back({t.name, t.shape, t.data.data()});
  HostPasses passes;
  passes.threads = o_.pass_threads;
  params_ = std::make_unique<HostLiveParams>(std::move(views), passes);
  rounds_ = std::make_unique<SiteRounds>(*site_);
  RoundDriverOptions d;
  d.overlap = o_.overlap;
  d.poll = std::chrono::milliseconds(o_.poll_ms);
  driver_ = std::make_unique<RoundDriver>(*rounds_, params_.get(), d);
  ISTHMUS_ASSIGN_OR_RETURN(Staleness st, site_->CheckStaleness());
  driver_->set_limit(st.limit);
  return Status::Ok();
}

Result<std::vector<RoundTiming>> SyntheticSite::Run(const RecordedDeltas& deltas) {
  if (!driver_) return Status::FailedPrecondition("Prepare() first");
  // The watcher: when did every shard commit round r?
  std::vector<std::unique_ptr<ShardClient>> watch;
  for (size_t s = 0; s < shards_; ++s) {
    ISTHMUS_ASSIGN_OR_RETURN(auto c, connect_(s));
    watch.push_back(std::move(c));
  }
  std::mutex mu;
  std::map<uint64_t, Clock::time_point> committed_at;  // GUARDED_BY(mu)
  Status watch_status;                                 // GUARDED_BY(mu)
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> last_wanted{0};
  std::thread watcher([&] {
    uint64_t seen = 0;
    while (!stop.load()) {
      uint64_t low = UINT64_MAX;
      for (auto& c : watch) {
        auto h = c->Hello(o_.job, wire::Role::Worker, "", o_.client_name + "-watch");
        if (!h.ok()) {
          std::lock_guard lk(mu);
          watch_status = h.status();
          return;
        }
        low = std::min(low, h->rounds.committed_round);
      }
      const auto now = Clock::now();
      if (low != UINT64_MAX && low > seen) {
        std::lock_guard lk(mu);
        for (uint64_t r = seen + 1; r <= low; ++r) committed_at[r] = now;
        seen = low;
      }
      if (last_wanted.load() > 0 && seen >= last_wanted.load()) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(o_.poll_ms));
    }
  });
  auto finish = [&] {
    stop = true;
    watcher.join();
  };

  std::vector<RoundTiming> out(static_cast<size_t>(std::max(0, o_.rounds)));
  std::map<uint64_t, Clock::time_point> pushed_at;
  // A completed round's background figures go to that round's row.
  auto record = [&](const RoundReport& rep) {
    if (rep.round == 0 || rep.round > out.size()) return;
    RoundTiming& t = out[rep.round - 1];
    t.push_s = rep.push_s;
    t.wait_s = rep.wait_s;
    t.pull_s = rep.pull_s;
    pushed_at[rep.round] = rep.pushed_at;
  };
  const int steps = std::max(1, o_.steps_per_round);
  const auto step = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(o_.round_seconds / steps));
  Status failed;
  for (int r = 1; r <= o_.rounds && failed.ok(); ++r) {
    RoundTiming& t = out[static_cast<size_t>(r - 1)];
    t.round = static_cast<uint64_t>(r);
    const auto start = Clock::now();
    const auto& delta = deltas.rounds[static_cast<size_t>(r - 1) % deltas.rounds.size()];
    for (int s = 0; s < steps && failed.ok(); ++s) {
      const auto s0 = Clock::now();
      std::this_thread::sleep_until(s0 + step);  // the GPU's inner steps
      if (s == steps - 1) {
        // What the round trained: the recorded delta, in the live weights.
        for (size_t i = 0; i < delta.size(); ++i) {
          float* w = live_[i].data.data();
          const float* d = delta[i].data.data();
          for (size_t k = 0; k < delta[i].data.size(); ++k) w[k] += d[k];
        }
      }
      t.compute_s += Seconds(Clock::now() - s0);
      driver_->Stepped();
      // A round in flight is done and its merge step has come (or, with merge.wait, its
      // step has come, and the wait for it counts against computing): merge it here.
      if (o_.merge.Now(s + 1, steps, driver_->busy(), driver_->Ready())) {
        const auto m0 = Clock::now();
        auto rep = driver_->Complete();
        t.boundary_s += Seconds(Clock::now() - m0);
        if (!rep.ok()) {
          failed = rep.status();
          break;
        }
        record(*rep);
      }
    }
    if (!failed.ok()) break;
    const auto b0 = Clock::now();
    auto rep = driver_->EndRound(static_cast<uint64_t>(r), o_.tokens_per_round,
                                 static_cast<uint64_t>(o_.round_seconds * 1e3 + 0.5));
    t.boundary_s += Seconds(Clock::now() - b0);
    if (!rep.ok()) {
      failed = rep.status();
      break;
    }
    t.blocked_s += rep->blocked_s;
    t.blocked_wan_s += rep->blocked_wan_s;
    record(*rep);
    t.wall_s = Seconds(Clock::now() - start);
  }
  if (failed.ok() && driver_->busy()) {
    // The last round in flight: not part of any round's figures.
    const auto d0 = Clock::now();
    auto rep = driver_->Complete();
    drain_s_ = Seconds(Clock::now() - d0);
    if (!rep.ok()) {
      failed = rep.status();
    } else {
      record(*rep);
    }
  }
  if (!failed.ok()) {
    finish();
    return failed;
  }
  // Let the last rounds commit (bounded) so their latency is known too.
  last_wanted = static_cast<uint64_t>(o_.rounds);
  const auto drain_until =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(std::max(10.0, 10 * o_.round_seconds)));
  for (;;) {
    {
      std::lock_guard lk(mu);
      if (!watch_status.ok() || committed_at.count(last_wanted.load()) > 0) break;
    }
    if (Clock::now() >= drain_until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(o_.poll_ms));
  }
  finish();
  if (!watch_status.ok()) return watch_status;
  for (auto& t : out) {
    auto it = committed_at.find(t.round);
    auto p = pushed_at.find(t.round);
    if (it != committed_at.end() && p != pushed_at.end())
      t.commit_latency_s = std::max(0.0, Seconds(it->second - p->second));
  }
  return out;
}

const codec::ReplayStats* SyntheticSite::replay_stats() const {
  auto* p = site_ ? dynamic_cast<const codec::ReplayPuller*>(site_->puller()) : nullptr;
  return p ? &p->stats() : nullptr;
}

}  // namespace isthmus::wanload
