// Rank 0's metrics and event records (see telemetry.h).
#include "worker/telemetry.h"

#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>

#include "common/version.h"

namespace isthmus::worker {
namespace {

using json = nlohmann::json;

double NowUnix() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Non-finite numbers have no JSON form: null.
json Number(double v) { return std::isfinite(v) ? json(v) : json(); }

}  // namespace

Telemetry::Telemetry()
    : step_seconds_(metrics::StepBuckets()),
      push_seconds_(metrics::LatencyBuckets()),
      pull_seconds_(metrics::LatencyBuckets()),
      round_seconds_(metrics::StepBuckets()) {
  started_unix_ = NowUnix();
}

Telemetry::~Telemetry() { endpoint_.reset(); }

std::unique_ptr<Telemetry> Telemetry::Off() { return std::unique_ptr<Telemetry>(new Telemetry()); }

Result<std::unique_ptr<Telemetry>> Telemetry::Open(const std::string& metrics_listen,
                                                   const std::string& events_file) {
  std::unique_ptr<Telemetry> t(new Telemetry());
  if (!events_file.empty()) {
    t->events_.open(events_file, std::ios::app);
    if (!t->events_) {
      return Status::IoError("cannot open the --events file '" + events_file + "' for appending");
    }
    t->events_on_ = true;
  }
  if (!metrics_listen.empty()) {
    Telemetry* self = t.get();
    ISTHMUS_ASSIGN_OR_RETURN(t->endpoint_,
                             metrics::MetricsEndpoint::Start(
                                 metrics_listen, "--metrics-listen",
                                 [self]() -> Result<std::string> { return self->Render(); }));
  }
  return t;
}

int Telemetry::metrics_port() const { return endpoint_ ? endpoint_->port() : 0; }

void Telemetry::Event(const std::string& line) {
  if (!events_on_) return;
  events_ << line << '\n';
  events_.flush();
}

void Telemetry::OnStart(const RunInfo& info, int64_t round, int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  info_ = info;
  round_ = round;
  step_ = step;
  Event(json{{"time", NowUnix()},
             {"event", "start"},
             {"site", info.site},
             {"job", info.job},
             {"device", info.device},
             {"precision", info.precision},
             {"mode", info.mode},
             {"world_size", info.world_size},
             {"steps_per_round", info.steps_per_round},
             {"standalone", info.standalone},
             {"round", round},
             {"step", step}}
            .dump());
}

void Telemetry::OnStep(double seconds, double loss, uint64_t tokens, bool skipped) {
  std::lock_guard<std::mutex> lock(mu_);
  ++steps_total_;
  ++step_;
  tokens_total_ += tokens;
  step_seconds_.Observe(seconds);
  if (skipped) {
    ++skipped_total_;
    return;
  }
  if (std::isfinite(loss)) {
    loss_ = loss;
    have_loss_ = true;
    round_loss_sum_ += loss;
    ++round_loss_steps_;
  }
}

void Telemetry::OnPush(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  push_seconds_.Observe(seconds);
  round_push_s_ += seconds;
}

void Telemetry::OnCheckpoint(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  round_checkpoint_s_ += seconds;
}

void Telemetry::OnWanWaitBegin() {
  std::lock_guard<std::mutex> lock(mu_);
  waiting_for_wan_ = true;
}

void Telemetry::OnWanWait(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  waiting_for_wan_ = false;
  round_wait_s_ += seconds;
  if (seconds > 0) {
    ++wan_waits_total_;
    wan_wait_seconds_total_ += seconds;
  }
}

void Telemetry::OnPull(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  pull_seconds_.Observe(seconds);
  round_pull_s_ += seconds;
}

void Telemetry::OnAllReduce(double seconds, double exposed) {
  std::lock_guard<std::mutex> lock(mu_);
  allreduce_seconds_total_ += seconds;
  allreduce_exposed_seconds_total_ += exposed;
}

void Telemetry::OnBlocked(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  blocked_seconds_total_ += seconds;
  round_blocked_s_ += seconds;
}

void Telemetry::OnRoundFailure(int64_t round, const std::string& error) {
  std::lock_guard<std::mutex> lock(mu_);
  ++round_failures_total_;
  Event(json{{"time", NowUnix()}, {"event", "round_failure"}, {"round", round}, {"error", error}}
            .dump());
}

void Telemetry::OnRound(int64_t round, int64_t step, uint64_t tokens_total, double compute_seconds,
                        uint64_t round_tokens, double wall_seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  ++rounds_total_;
  round_ = round;
  step_ = step;
  tokens_total_ = tokens_total;
  round_seconds_.Observe(wall_seconds);
  if (compute_seconds > 0) tokens_per_second_ = static_cast<double>(round_tokens) / compute_seconds;
  const double mean_loss = round_loss_steps_ > 0 ? round_loss_sum_ / round_loss_steps_ : NAN;
  Event(json{{"time", NowUnix()},
             {"event", "round"},
             {"round", round},
             {"step", step},
             {"tokens", tokens_total},
             {"round_tokens", round_tokens},
             {"loss", Number(mean_loss)},
             {"compute_s", compute_seconds},
             {"wall_s", wall_seconds},
             {"push_s", round_push_s_},
             {"wan_wait_s", round_wait_s_},
             {"pull_s", round_pull_s_},
             {"blocked_s", round_blocked_s_},
             {"checkpoint_s", round_checkpoint_s_},
             {"tokens_per_s", tokens_per_second_}}
            .dump());
  round_loss_sum_ = 0;
  round_loss_steps_ = 0;
  round_push_s_ = round_pull_s_ = round_wait_s_ = round_blocked_s_ = round_checkpoint_s_ = 0;
}

void Telemetry::OnValidation(int64_t round, int64_t step, const std::string& set, double loss) {
  std::lock_guard<std::mutex> lock(mu_);
  validation_[set] = loss;
  Event(json{{"time", NowUnix()},
             {"event", "validation"},
             {"round", round},
             {"step", step},
             {"set", set},
             {"loss", Number(loss)}}
            .dump());
}

void Telemetry::OnTranslations(int64_t round, int64_t step, const std::string& language,
                               const std::string& file, int64_t lines) {
  std::lock_guard<std::mutex> lock(mu_);
  Event(json{{"time", NowUnix()},
             {"event", "translations"},
             {"round", round},
             {"step", step},
             {"language", language},
             {"file", file},
             {"lines", lines}}
            .dump());
}

void Telemetry::OnEnd(int64_t round, int64_t step, uint64_t tokens_total, bool interrupted) {
  std::lock_guard<std::mutex> lock(mu_);
  Event(json{{"time", NowUnix()},
             {"event", "end"},
             {"round", round},
             {"step", step},
             {"tokens", tokens_total},
             {"interrupted", interrupted}}
            .dump());
}

std::string Telemetry::Render() {
  using metrics::Type;
  std::lock_guard<std::mutex> lock(mu_);
  metrics::TextWriter w;
  w.Begin("isthmus_worker_info", Type::kGauge,
          "Constant 1, labelled with the version, site, job, device, precision and training "
          "mode of this worker (rank 0).");
  w.Sample({{"version", kIsthmusVersion},
            {"site", info_.site},
            {"job", info_.job},
            {"device", info_.device},
            {"precision", info_.precision},
            {"mode", info_.mode}},
           1);
  w.Single("process_start_time_seconds", Type::kGauge,
           "Start time of the process since the Unix epoch, in seconds.", started_unix_);
  w.Single("isthmus_worker_world_size", Type::kGauge, "Ranks of this site.", info_.world_size);
  w.Single("isthmus_worker_round", Type::kGauge, "The last round this rank finished.",
           static_cast<double>(round_));
  w.Single("isthmus_worker_step", Type::kGauge, "Optimizer steps taken (the schedule position).",
           static_cast<double>(step_));
  w.Single("isthmus_worker_steps_total", Type::kCounter, "Optimizer steps taken by this process.",
           static_cast<double>(steps_total_));
  w.Single("isthmus_worker_skipped_steps_total", Type::kCounter,
           "Steps skipped for a non-finite gradient.", static_cast<double>(skipped_total_));
  w.Single("isthmus_worker_rounds_total", Type::kCounter,
           "Rounds this process finished (pushed and pulled; with --overlap, trained: the "
           "last one's push and pull complete during the next round).",
           static_cast<double>(rounds_total_));
  w.Single("isthmus_worker_tokens_total", Type::kCounter,
           "Training tokens of the whole site (every rank's batches) since the job began.",
           static_cast<double>(tokens_total_));
  w.Single("isthmus_worker_tokens_per_second", Type::kGauge,
           "Training throughput of the site in the last round: its tokens over its compute time "
           "(steps only; no WAN wait, push or pull).",
           tokens_per_second_);
  w.Single("isthmus_worker_loss", Type::kGauge, "Training loss of the last step (nats per token).",
           have_loss_ ? loss_ : NAN);
  w.Begin("isthmus_worker_validation_loss", Type::kGauge,
          "The last validation loss per set: 'site' is the site's own validation data, the "
          "others are --eval-set names (nats per token).");
  for (const auto& [set, loss] : validation_) w.Sample({{"set", set}}, loss);
  w.Single("isthmus_worker_wan_waits_total", Type::kCounter,
           "Rounds after which the site waited for the WAN (more than sync.max_rounds_ahead "
           "rounds ahead of the last commit).",
           static_cast<double>(wan_waits_total_));
  w.Single("isthmus_worker_wan_wait_seconds_total", Type::kCounter,
           "Time spent waiting for the WAN (waits that have ended).", wan_wait_seconds_total_);
  w.Single("isthmus_worker_waiting_for_wan", Type::kGauge,
           "1 while the site waits for the WAN before its next round.",
           waiting_for_wan_ ? 1.0 : 0.0);
  w.Single("isthmus_worker_boundary_blocked_seconds_total", Type::kCounter,
           "Time the training loop waited at round boundaries for the round in flight (its "
           "push, WAN wait and pull, as far as they were not done).",
           blocked_seconds_total_);
  w.Single("isthmus_worker_allreduce_seconds_total", Type::kCounter,
           "Time the in-site gradient all-reduce took (with --bucket-mb > 0: its buckets on "
           "the reducing thread, overlapped with the backward).",
           allreduce_seconds_total_);
  w.Single("isthmus_worker_allreduce_exposed_seconds_total", Type::kCounter,
           "The part of the gradient all-reduce's time the steps waited for (all of it with "
           "--bucket-mb 0).",
           allreduce_exposed_seconds_total_);
  w.Single("isthmus_worker_round_failures_total", Type::kCounter,
           "Rounds whose push, wait for the WAN or pull failed (the run stops; the round is "
           "kept in the checkpoint).",
           static_cast<double>(round_failures_total_));
  w.Begin("isthmus_worker_step_duration_seconds", Type::kHistogram,
          "Time of one training step (forward, backward, gradient all-reduce, optimizer).");
  step_seconds_.Write(w);
  w.Begin("isthmus_worker_push_duration_seconds", Type::kHistogram,
          "Time to push this rank's part of a round delta to the shards.");
  push_seconds_.Write(w);
  w.Begin("isthmus_worker_pull_duration_seconds", Type::kHistogram,
          "Time to pull the merged tensors from the shards and share them with every rank.");
  pull_seconds_.Write(w);
  w.Begin("isthmus_worker_round_duration_seconds", Type::kHistogram,
          "Wall time of a round: steps, push, WAN wait and pull.");
  round_seconds_.Write(w);
  return w.Take();
}

}  // namespace isthmus::worker
