#include "bench/wan/wan_load.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <thread>

#include "common/safetensors.h"

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
    if (r.wait_s > 1e-3) ++s.rounds_waited;
    if (r.commit_latency_s >= 0) {
      latency_sum += r.commit_latency_s;
      s.max_commit_latency_s = std::max(s.max_commit_latency_s, r.commit_latency_s);
      ++committed;
    }
  }
  s.wall_s = s.compute_s + s.push_s + s.wait_s + s.pull_s;
  if (s.wall_s > 0) {
    s.wait_fraction = s.wait_s / s.wall_s;
    s.utilisation = 1.0 - s.wait_fraction;
    s.compute_fraction = s.compute_s / s.wall_s;
  }
  if (committed > 0) s.mean_commit_latency_s = latency_sum / static_cast<double>(committed);
  return s;
}

SyntheticSite::SyntheticSite(size_t shards, ConnectFn connect, SiteOptions options)
    : shards_(shards), connect_(std::move(connect)), o_(std::move(options)) {}

Status SyntheticSite::Prepare(const RecordedDeltas& deltas) {
  if (deltas.rounds.empty()) return Status::InvalidArgument("no recorded deltas to replay");
  std::map<std::string, size_t> index;
  const auto& first = deltas.rounds.front();
  for (size_t i = 0; i < first.size(); ++i) index[first[i].name] = i;
  clients_.clear();
  placement_.assign(shards_, {});
  size_t found = 0;
  for (size_t s = 0; s < shards_; ++s) {
    ISTHMUS_ASSIGN_OR_RETURN(auto client, connect_(s));
    auto pulled = client->Pull(o_.job);
    if (!pulled.ok()) {
      return Status(pulled.status().code(),
                    "shard " + std::to_string(s) + ": " + pulled.status().message());
    }
    for (const auto& t : pulled->tensors) {
      auto it = index.find(t.name);
      if (it == index.end() || first[it->second].shape != t.shape) {
        return Status::InvalidArgument("job '" + o_.job + "' tensor '" + t.name + "' on shard " +
                                       std::to_string(s) +
                                       " is not in the recorded deltas with that shape");
      }
      placement_[s].push_back(it->second);
      ++found;
    }
    clients_.push_back(std::move(client));
  }
  if (found != first.size()) {
    return Status::InvalidArgument("the recorded deltas hold " + std::to_string(first.size()) +
                                   " tensors, job '" + o_.job + "' " + std::to_string(found));
  }
  return Status::Ok();
}

Status SyntheticSite::Push(uint64_t round, const std::vector<Tensor>& delta, uint64_t compute_ms) {
  for (size_t s = 0; s < shards_; ++s) {
    std::vector<TensorView> views;
    for (size_t i : placement_[s])
      views.push_back({delta[i].name, delta[i].shape, delta[i].data.data()});
    const std::string key =
        o_.job + "/" + o_.client_name + "/r" + std::to_string(round) + "/s" + std::to_string(s);
    auto r = clients_[s]->Push(o_.job, key, round, o_.tokens_per_round, views, compute_ms);
    if (!r.ok()) {
      return Status(r.status().code(), "push of round " + std::to_string(round) + " to shard " +
                                           std::to_string(s) + ": " + r.status().message());
    }
  }
  return Status::Ok();
}

Status SyntheticSite::WaitForWan() {
  for (;;) {
    bool ahead = false;
    for (size_t s = 0; s < shards_; ++s) {
      auto h = clients_[s]->Hello(o_.job, wire::Role::Worker, "", o_.client_name);
      if (!h.ok()) return h.status();
      const auto& r = h->rounds;
      // The workers' rule (SiteClient::CheckStaleness): K = 0 waits for every commit.
      ahead |= r.local_round > r.committed_round &&
               r.local_round - r.committed_round > r.max_rounds_ahead;
    }
    if (!ahead) return Status::Ok();
    std::this_thread::sleep_for(std::chrono::milliseconds(o_.poll_ms));
  }
}

Status SyntheticSite::PullAll() {
  for (size_t s = 0; s < shards_; ++s) {
    auto r = clients_[s]->Pull(o_.job);
    if (!r.ok()) {
      return Status(r.status().code(),
                    "pull from shard " + std::to_string(s) + ": " + r.status().message());
    }
  }
  return Status::Ok();
}

Result<std::vector<RoundTiming>> SyntheticSite::Run(const RecordedDeltas& deltas) {
  if (clients_.size() != shards_) return Status::FailedPrecondition("Prepare() first");
  // The watcher: when did every shard commit round r?
  std::vector<std::unique_ptr<ShardClient>> watch;
  for (size_t s = 0; s < shards_; ++s) {
    ISTHMUS_ASSIGN_OR_RETURN(auto c, connect_(s));
    watch.push_back(std::move(c));
  }
  std::mutex mu;
  std::map<uint64_t, Clock::time_point> committed_at;  // GUARDED_BY(mu)
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> last_wanted{0};
  Status watch_status;
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

  std::vector<RoundTiming> out;
  std::vector<Clock::time_point> pushed_at;
  const auto compute =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.round_seconds));
  Status failed;
  for (int r = 1; r <= o_.rounds; ++r) {
    RoundTiming t;
    t.round = static_cast<uint64_t>(r);
    const auto start = Clock::now();
    std::this_thread::sleep_until(start + compute);  // the GPU's H inner steps
    const auto computed = Clock::now();
    const auto& delta = deltas.rounds[static_cast<size_t>(r - 1) % deltas.rounds.size()];
    failed = Push(t.round, delta, static_cast<uint64_t>(o_.round_seconds * 1e3 + 0.5));
    if (!failed.ok()) break;
    const auto pushed = Clock::now();
    pushed_at.push_back(pushed);
    failed = WaitForWan();
    if (!failed.ok()) break;
    const auto waited = Clock::now();
    failed = PullAll();
    if (!failed.ok()) break;
    const auto pulled = Clock::now();
    t.compute_s = Seconds(computed - start);
    t.push_s = Seconds(pushed - computed);
    t.wait_s = Seconds(waited - pushed);
    t.pull_s = Seconds(pulled - waited);
    out.push_back(t);
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
  for (size_t i = 0; i < out.size(); ++i) {
    auto it = committed_at.find(out[i].round);
    if (it != committed_at.end())
      out[i].commit_latency_s = std::max(0.0, Seconds(it->second - pushed_at[i]));
  }
  return out;
}

}  // namespace isthmus::wanload
