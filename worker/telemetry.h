// What rank 0 of isthmus-worker tells the world while it trains, besides its log: the
// Prometheus metrics of --metrics-listen and the JSON Lines of --events (a record per
// round and per validation, which deploy/report.py turns into plots). docs/METRICS.md
// lists the metrics, docs/WORKER.md the event records.
//
// Threads: the round loop calls the On* methods; the metrics endpoint's thread renders
// under the same mutex. Every method is a no-op on a Telemetry made with Off().
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "common/metrics.h"
#include "common/status.h"

namespace isthmus::worker {

// Fixed facts about the run, for the start record and the info metric.
struct RunInfo {
  std::string site;  // --client-name
  std::string job;
  std::string device, precision, mode;
  int world_size = 1;
  int64_t steps_per_round = 0;
  bool standalone = false;
};

class Telemetry {
 public:
  // Opens the events file (appending) and starts the metrics endpoint, each when given.
  // Errors name the flag and the address or file.
  static Result<std::unique_ptr<Telemetry>> Open(const std::string& metrics_listen,
                                                 const std::string& events_file);
  static std::unique_ptr<Telemetry> Off();
  ~Telemetry();

  void OnStart(const RunInfo& info, int64_t round, int64_t step);
  void OnStep(double seconds, double loss, uint64_t tokens, bool skipped);
  void OnPush(double seconds);
  // Writing a checkpoint took `seconds` (with --overlap on the round driver's thread,
  // before the round's push; else on the training loop's, after the round).
  void OnCheckpoint(double seconds);
  // A step's in-site gradient all-reduce took `seconds` (with --bucket-mb > 0 on the
  // reducing thread, overlapped with the backward) of which the step waited `exposed`.
  void OnAllReduce(double seconds, double exposed);
  // The site is too far ahead of the last commit: rank 0 waits for the WAN from now on.
  void OnWanWaitBegin();
  // The wait after a round is over (0 when there was none).
  void OnWanWait(double seconds);
  void OnPull(double seconds);
  // The training loop waited this long at a round boundary for the round in flight (its
  // push, WAN wait and pull, as far as they were not done yet).
  void OnBlocked(double seconds);
  // A round's push, wait or pull failed (the run then stops; the round stays in the
  // checkpoint).
  void OnRoundFailure(int64_t round, const std::string& error);
  // A round is done (pushed and pulled, or local in a standalone run).
  void OnRound(int64_t round, int64_t step, uint64_t tokens_total, double compute_seconds,
               uint64_t round_tokens, double wall_seconds);
  // `set`: "site" for the rank's own validation data, else an --eval-set name.
  void OnValidation(int64_t round, int64_t step, const std::string& set, double loss);
  // --translate-set: `lines` translations into `language` written to `file`.
  void OnTranslations(int64_t round, int64_t step, const std::string& language,
                      const std::string& file, int64_t lines);
  void OnEnd(int64_t round, int64_t step, uint64_t tokens_total, bool interrupted);

  // The port the endpoint listens on (0: no endpoint).
  int metrics_port() const;

 private:
  Telemetry();
  void Event(const std::string& json_line);  // caller holds mu_
  std::string Render();

  std::mutex mu_;
  std::ofstream events_;  // guarded by mu_
  bool events_on_ = false;
  std::unique_ptr<metrics::MetricsEndpoint> endpoint_;
  // Everything below: guarded by mu_.
  RunInfo info_;
  double started_unix_ = 0;
  int64_t round_ = 0, step_ = 0;
  uint64_t steps_total_ = 0, skipped_total_ = 0, tokens_total_ = 0, rounds_total_ = 0;
  uint64_t wan_waits_total_ = 0, round_failures_total_ = 0;
  double blocked_seconds_total_ = 0;
  double allreduce_seconds_total_ = 0, allreduce_exposed_seconds_total_ = 0;
  bool waiting_for_wan_ = false;
  double wan_wait_seconds_total_ = 0;
  double loss_ = 0, tokens_per_second_ = 0;
  bool have_loss_ = false;
  std::map<std::string, double> validation_;  // set -> last loss
  metrics::Histogram step_seconds_;
  metrics::Histogram push_seconds_;
  metrics::Histogram pull_seconds_;
  metrics::Histogram round_seconds_;
  // Round being built for the events file.
  double round_loss_sum_ = 0;
  uint64_t round_loss_steps_ = 0;
  double round_push_s_ = 0, round_pull_s_ = 0, round_wait_s_ = 0, round_blocked_s_ = 0;
  double round_checkpoint_s_ = 0;
};

}  // namespace isthmus::worker
