// The round driver (see round_driver.h): the end of a round, in the caller or in the
// background, and the merge of the pulled state into the live weights.
#include "common/round_driver.h"

#include <pthread.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <map>
#include <thread>

#include "common/parallel_for.h"

namespace isthmus {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The seconds of [a0, a1] that lie within [b0, b1].
double Overlap(Clock::time_point a0, Clock::time_point a1, Clock::time_point b0,
               Clock::time_point b1) {
  const auto from = std::max(a0, b0), to = std::min(a1, b1);
  return to > from ? Seconds(to - from) : 0.0;
}

std::string R(uint64_t round) { return "round " + std::to_string(round); }

// The host boundary's passes stream hundreds of MB (341 MB a tensor set in full mode), far
// more than any cache: stores to buffers nothing reads before the next boundary bypass the
// cache where the CPU can (SSE's streaming stores: no read of the line before it is
// written, none of it evicting what the caller works on), and the live weights are written
// only where a value changes. The arithmetic is the scalar loop's, value for value.
constexpr uintptr_t kStreamAlign = 16;
bool Streamable(const float* a, const float* b) {
  return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) % kStreamAlign) == 0;
}

// d := live - base; base := base + d; live := base where it differs (TakeDelta).
void TakeDeltaPass(float* live, float* base, float* d, size_t n) {
  size_t i = 0;
#if defined(__SSE2__)
  if (Streamable(base, d)) {
    for (; i + 4 <= n; i += 4) {
      const __m128 l = _mm_loadu_ps(live + i), b = _mm_load_ps(base + i);
      const __m128 di = _mm_sub_ps(l, b), nb = _mm_add_ps(b, di);
      _mm_stream_ps(d + i, di);
      _mm_stream_ps(base + i, nb);
      // Compared bit for bit: -0 and +0 (and NaNs) differ here as in memory.
      const __m128i same = _mm_cmpeq_epi32(_mm_castps_si128(nb), _mm_castps_si128(l));
      if (_mm_movemask_epi8(same) != 0xffff) _mm_storeu_ps(live + i, nb);
    }
    _mm_sfence();
  }
#endif
  for (; i < n; ++i) {
    d[i] = live[i] - base[i];
    live[i] = base[i] + d[i];
    base[i] = live[i];
  }
}

// live := live + (p - base) (progressed) or p; base := p (Rebase), unless `base_too` is false
// (RebaseTaking, which takes p's buffer as the base).
void RebasePass(float* live, float* base, const float* p, size_t n, bool progressed,
                bool base_too = true) {
  size_t i = 0;
#if defined(__SSE2__)
  if (Streamable(base, p)) {
    for (; i + 4 <= n; i += 4) {
      const __m128 pp = _mm_load_ps(p + i);
      const __m128 nl =
          progressed ? _mm_add_ps(_mm_loadu_ps(live + i), _mm_sub_ps(pp, _mm_load_ps(base + i)))
                     : pp;
      _mm_storeu_ps(live + i, nl);
      if (base_too) _mm_stream_ps(base + i, pp);
    }
    _mm_sfence();
  }
#endif
  for (; i < n; ++i) {
    live[i] = progressed ? live[i] + (p[i] - base[i]) : p[i];
    if (base_too) base[i] = p[i];
  }
}

}  // namespace

// --- DeltaBuffers, HostLiveParams --------------------------------------------------------

std::vector<float> DeltaBuffers::Take(size_t i, size_t n) {
  std::vector<float> b;
  if (i < spare_.size()) b = std::move(spare_[i]);
  b.resize(n);
  return b;
}

void DeltaBuffers::Keep(std::vector<Tensor> delta) {
  spare_.resize(delta.size());
  for (size_t i = 0; i < delta.size(); ++i) spare_[i] = std::move(delta[i].data);
}

void DeltaBuffers::Reserve(const std::vector<size_t>& sizes) {
  if (spare_.size() < sizes.size()) spare_.resize(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (spare_[i].size() < sizes[i]) spare_[i].assign(sizes[i], 0.0f);
  }
}

HostLiveParams::HostLiveParams(std::vector<LiveTensor> live, HostPasses passes)
    : passes_(passes), live_(std::move(live)) {
  base_.resize(live_.size());
  (void)Reset();
  std::vector<size_t> sizes;
  for (const auto& b : base_) sizes.push_back(b.size());
  spare_.Reserve(sizes);
}

Status HostLiveParams::Reset() {
  for (size_t t = 0; t < live_.size(); ++t) {
    const auto n = static_cast<size_t>(NumElements(live_[t].shape));
    base_[t].assign(live_[t].data, live_[t].data + n);
  }
  return Status::Ok();
}

void HostLiveParams::ForChunks(
    const std::function<void(size_t t, size_t begin, size_t end)>& pass) const {
  struct Piece {
    size_t t, begin, end;
  };
  const size_t chunk = std::max<size_t>(passes_.chunk, 4);
  std::vector<Piece> pieces;
  for (size_t t = 0; t < base_.size(); ++t) {
    const size_t n = base_[t].size();
    for (size_t b = 0; b < n; b += chunk) pieces.push_back({t, b, std::min(n, b + chunk)});
  }
  const size_t threads = passes_.threads > 0
                             ? static_cast<size_t>(passes_.threads)
                             : std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 8);
  ForEachIndex(pieces.size(), threads, "live-pass",
               [&](size_t k) { pass(pieces[k].t, pieces[k].begin, pieces[k].end); });
}

Result<std::vector<Tensor>> HostLiveParams::TakeDelta() {
  std::vector<Tensor> out;
  out.reserve(live_.size());
  for (size_t t = 0; t < live_.size(); ++t) {
    out.push_back({live_[t].name, live_[t].shape, spare_.Take(t, base_[t].size())});
  }
  // live := base + d: what a shard that adds the delta to base holds.
  ForChunks([&](size_t t, size_t b, size_t e) {
    TakeDeltaPass(live_[t].data + b, base_[t].data() + b, out[t].data.data() + b, e - b);
  });
  return out;
}

Result<std::vector<size_t>> HostLiveParams::Match(const std::vector<Tensor>* pulled) const {
  if (pulled == nullptr) return Status::InvalidArgument("no pulled state to merge");
  std::map<std::string, size_t> by_name;
  for (size_t i = 0; i < pulled->size(); ++i) by_name[(*pulled)[i].name] = i;
  std::vector<size_t> src(live_.size());
  for (size_t t = 0; t < live_.size(); ++t) {
    auto it = by_name.find(live_[t].name);
    if (it == by_name.end()) {
      return Status::InvalidArgument("the pulled state has no tensor '" + live_[t].name + "'");
    }
    const Tensor& p = (*pulled)[it->second];
    if (p.shape != live_[t].shape || p.data.size() != base_[t].size()) {
      return Status::InvalidArgument("the pulled tensor '" + live_[t].name +
                                     "' has another shape than the live one");
    }
    src[t] = it->second;
  }
  return src;
}

Status HostLiveParams::Rebase(const std::vector<Tensor>* pulled, bool progressed) {
  ISTHMUS_ASSIGN_OR_RETURN(std::vector<size_t> src, Match(pulled));
  // live + (P - base): the local progress since the base, on top of the new base.
  ForChunks([&](size_t t, size_t b, size_t e) {
    RebasePass(live_[t].data + b, base_[t].data() + b, (*pulled)[src[t]].data.data() + b, e - b,
               progressed);
  });
  return Status::Ok();
}

Status HostLiveParams::RebaseTaking(std::vector<Tensor>* pulled, bool progressed) {
  ISTHMUS_ASSIGN_OR_RETURN(std::vector<size_t> src, Match(pulled));
  ForChunks([&](size_t t, size_t b, size_t e) {
    RebasePass(live_[t].data + b, base_[t].data() + b, (*pulled)[src[t]].data.data() + b, e - b,
               progressed, /*base_too=*/false);
  });
  // The pulled values are the base now; the old base goes back in `pulled`.
  for (size_t t = 0; t < live_.size(); ++t) base_[t].swap((*pulled)[src[t]].data);
  return Status::Ok();
}

// --- RoundDriver ------------------------------------------------------------------------

RoundDriver::RoundDriver(RoundShards& shards, LiveParams* params, RoundDriverOptions options)
    : shards_(shards), params_(params), o_(std::move(options)) {
  thread_ = std::thread([this] { Loop(); });
}

RoundDriver::~RoundDriver() {
  {
    std::lock_guard lk(mu_);
    quit_ = true;
    cancel_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void RoundDriver::Loop() {
  pthread_setname_np(pthread_self(), "round-driver");
  for (;;) {
    RoundInFlight in;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [this] { return quit_ || next_.has_value(); });
      if (quit_) return;
      in = std::move(*next_);
      next_.reset();
    }
    RunRound(in);
  }
}

void RoundDriver::RunRound(RoundInFlight& in) {
  Outcome out;
  RoundReport& rep = out.report;
  rep.round = in.round;
  Status first;
  if (in.first) {
    const auto t0 = Clock::now();
    first = in.first();
    in.first = nullptr;  // what it holds (the worker's checkpoint image) goes now
    rep.first_s = Seconds(Clock::now() - t0);
  }
  auto t = Clock::now();
  std::vector<TensorView> views;
  views.reserve(in.delta->size());
  for (const auto& d : *in.delta) views.push_back({d.name, d.shape, d.data.data()});
  if (first.ok() && o_.fault) o_.fault("pushing", in.round);
  auto pushed =
      !first.ok() ? Result<std::vector<ShardPush>>(first)
      : o_.push   ? shards_.PushRound(in.round, in.tokens, in.compute_ms, views, o_.rank, o_.world)
                  : Result<std::vector<ShardPush>>(std::vector<ShardPush>{});
  rep.pushed_at = Clock::now();
  rep.push_s = Seconds(rep.pushed_at - t);
  if (!pushed.ok()) {
    out.status = pushed.status();
  } else {
    rep.pushes = std::move(pushed).value();
    rep.pushed = true;
    for (const auto& p : rep.pushes) rep.staleness.limit = p.rounds.max_rounds_ahead;
    if (o_.fault) o_.fault("pushed", in.round);
    if (o_.pull) {
      out.status = WaitForBound(in, rep);
      if (out.status.ok()) {
        {
          std::lock_guard lk(mu_);
          stage_ = Stage::kPulling;
        }
        cv_.notify_all();
        t = Clock::now();
        auto p = shards_.Pull();
        rep.pull_s = Seconds(Clock::now() - t);
        if (!p.ok()) {
          out.status = p.status();
        } else {
          out.pulled = std::move(p).value();
          if (o_.fault) o_.fault("pulled", in.round);
        }
      }
    }
  }
  // The delta is the caller's again (Wait may recycle it): this thread holds none of it.
  views.clear();
  in.delta.reset();
  {
    std::lock_guard lk(mu_);
    outcome_ = std::move(out);
    stage_ = Stage::kDone;
  }
  cv_.notify_all();
}

Status RoundDriver::WaitForBound(const RoundInFlight& in, RoundReport& rep) {
  {
    std::lock_guard lk(mu_);
    stage_ = Stage::kWaiting;
    push_s_ = rep.push_s;
  }
  cv_.notify_all();
  rep.waited_from = Clock::now();
  const auto deadline = rep.waited_from + o_.wait_timeout;
  Status result;
  for (;;) {
    auto st = shards_.CheckStaleness();
    if (!st.ok()) {
      result = st.status();
      break;
    }
    rep.staleness = *st;
    const uint64_t k = st->limit;
    // Without overlap the rank trains its next round once this one is within K. With
    // overlap it trains the next round while this one is in flight, so this one must come
    // within K - 1 (K = 0: the caller waits for the commit itself, AwaitBound).
    const uint64_t target = o_.overlap && k > 0 ? k - 1 : k;
    const bool everywhere = st->lowest_local_round >= in.round;
    if ((everywhere && st->rounds_ahead <= target) || (o_.stopping && o_.stopping())) break;
    std::string why =
        !everywhere
            ? "waiting for the other ranks' pushes of " + R(in.round) + " to reach every shard"
            : "waiting for the WAN: " + std::to_string(st->rounds_ahead) +
                  " rounds ahead of the last commit (limit " + std::to_string(k) +
                  (o_.overlap && k > 0 ? ", counting the round being trained" : "") +
                  ") on shard " + std::to_string(st->shard);
    if (o_.wait_timeout.count() > 0 && Clock::now() + o_.poll > deadline) {
      result = Status::Timeout(
          R(in.round) + ": the WAN did not catch up in " +
          std::to_string(
              std::chrono::duration_cast<std::chrono::seconds>(o_.wait_timeout).count()) +
          " s (" + why + ")");
      break;
    }
    rep.waited = true;
    std::unique_lock lk(mu_);
    wait_reason_ = std::move(why);
    if (cv_.wait_for(lk, o_.poll, [this] { return cancel_; })) {
      result = Status::Unavailable(R(in.round) +
                                   ": given up while waiting for the WAN (another rank of the "
                                   "site failed, or the driver was closed)");
      break;
    }
  }
  rep.waited_to = Clock::now();
  rep.wait_s = Seconds(rep.waited_to - rep.waited_from);
  return result;
}

Status RoundDriver::Start(RoundInFlight in) {
  if (inflight_) {
    return Status::FailedPrecondition(R(in.round) + " cannot start: " + R(inflight_->round) +
                                      " is still in flight");
  }
  if (!in.delta) return Status::InvalidArgument(R(in.round) + ": no delta");
  inflight_ = in;
  inflight_->first = nullptr;  // run by the driver's thread only: this copy need not hold it
  said_wait_ = false;
  {
    std::lock_guard lk(mu_);
    next_ = std::move(in);
    stage_ = Stage::kPushing;
    outcome_ = Outcome{};
    cancel_ = false;
    wait_reason_.clear();
  }
  cv_.notify_all();
  return Status::Ok();
}

RoundDriver::Stage RoundDriver::stage() const {
  if (!inflight_) return Stage::kIdle;
  std::lock_guard lk(mu_);
  return stage_;
}

bool RoundDriver::Ready() const {
  if (!inflight_) return false;
  std::lock_guard lk(mu_);
  return stage_ == Stage::kDone;
}

bool RoundDriver::Failed() const {
  if (!inflight_) return false;
  std::lock_guard lk(mu_);
  return stage_ == Stage::kDone && !outcome_.status.ok();
}

void RoundDriver::Cancel() {
  {
    std::lock_guard lk(mu_);
    cancel_ = true;
  }
  cv_.notify_all();
}

Status RoundDriver::Block(const std::function<bool()>& done_locked) {
  // Checked on the caller's thread; reports a wait for the WAN once per round.
  auto done = [&] {
    std::string reason;
    double push_s = 0;
    bool ok;
    {
      std::lock_guard lk(mu_);
      ok = done_locked();
      if (!ok && stage_ == Stage::kWaiting && !said_wait_) {
        reason = wait_reason_;
        push_s = push_s_;
      }
    }
    if (!reason.empty()) {
      said_wait_ = true;
      if (o_.on_wan_wait) o_.on_wan_wait(reason, push_s);
    }
    return ok;
  };
  if (o_.await) return o_.await(done);
  while (!done()) {
    std::unique_lock lk(mu_);
    cv_.wait_for(lk, std::chrono::milliseconds(100), [&] { return done_locked(); });
  }
  return Status::Ok();
}

Result<double> RoundDriver::AwaitBound() {
  if (!inflight_) return 0.0;
  const auto t0 = Clock::now();
  ISTHMUS_RETURN_IF_ERROR(
      Block([this] { return stage_ == Stage::kPulling || stage_ == Stage::kDone; }));
  return Seconds(Clock::now() - t0);
}

RoundDriver::Outcome RoundDriver::Wait() {
  Outcome out;
  if (!inflight_) return out;
  const auto t0 = blocked_from_.value_or(Clock::now());
  blocked_from_.reset();
  Status blocked = Block([this] { return stage_ == Stage::kDone; });
  if (!blocked.ok()) {
    // The caller's own wait failed (e.g. a rank of the site gone): give the round up.
    Cancel();
  }
  {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [this] { return stage_ == Stage::kDone; });
    out = std::move(outcome_);
    outcome_ = Outcome{};
    stage_ = Stage::kIdle;
  }
  const auto t1 = Clock::now();
  out.report.blocked_s = Seconds(t1 - t0);
  if (out.report.waited) {
    out.report.blocked_wan_s = Overlap(t0, t1, out.report.waited_from, out.report.waited_to);
  }
  if (o_.follow_limit && (out.report.staleness.shard >= 0 || out.report.pushed)) {
    limit_ = out.report.staleness.limit;
  }
  if (!blocked.ok() && out.status.ok()) out.status = blocked;
  if (!out.status.ok() && !out.report.pushed) failed_ = inflight_;
  std::shared_ptr<const std::vector<Tensor>> delta = std::move(inflight_->delta);
  inflight_.reset();
  // A delta EndRound made (non-const, so casting the const away is sound) that nothing else
  // holds (no retry, no checkpoint keeps it): its buffers go back.
  const bool ours = delta && delta.get() == taken_;
  taken_ = nullptr;
  if (params_ != nullptr && ours && delta.use_count() == 1) {
    params_->Recycle(std::move(*std::const_pointer_cast<std::vector<Tensor>>(delta)));
  }
  return out;
}

Result<RoundReport> RoundDriver::Complete() {
  if (!inflight_) return RoundReport{};
  Outcome out = Wait();
  Status st = o_.agree ? o_.agree(out.status) : out.status;
  if (!st.ok()) return st;
  if (params_ != nullptr) {
    ISTHMUS_RETURN_IF_ERROR(params_->RebaseTaking(o_.pull ? &out.pulled : nullptr, progressed_));
    out.report.merged = true;
    if (!out.pulled.empty()) shards_.Recycle(std::move(out.pulled));
  }
  return std::move(out.report);
}

Result<RoundReport> RoundDriver::EndRound(
    uint64_t round, uint64_t tokens, uint64_t compute_ms,
    const std::function<Status(RoundInFlight&)>& before_push) {
  if (params_ == nullptr) return Status::FailedPrecondition("EndRound needs LiveParams");
  RoundReport report;
  if (inflight_) {
    ISTHMUS_ASSIGN_OR_RETURN(report, Complete());
  }
  ISTHMUS_ASSIGN_OR_RETURN(std::vector<Tensor> delta, params_->TakeDelta());
  progressed_ = false;
  // Made non-const and handed out as const: Wait gives it back to Recycle when no one else
  // holds it.
  auto made = std::make_shared<std::vector<Tensor>>(std::move(delta));
  taken_ = made.get();
  RoundInFlight in{round, tokens, compute_ms, std::move(made), nullptr};
  if (before_push) ISTHMUS_RETURN_IF_ERROR(before_push(in));
  // Without overlap the caller is blocked from the hand-over on, before the driver's thread
  // starts the push: the whole push, wait and pull lie within blocked_s.
  if (!o_.overlap) blocked_from_ = Clock::now();
  if (Status started = Start(std::move(in)); !started.ok()) {
    blocked_from_.reset();
    return started;
  }
  if (!o_.overlap) return Complete();
  if (limit_ == 0) {
    // K = 0: the round in flight must commit before the next one trains.
    ISTHMUS_ASSIGN_OR_RETURN(double blocked, AwaitBound());
    report.blocked_s += blocked;
  }
  return report;
}

}  // namespace isthmus
