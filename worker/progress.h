// What a person watching isthmus-worker sees: on a terminal one live line rewritten in
// place (round, step, loss, tokens/s, ETA); otherwise (a log file, the journal) a plain
// line every N steps. Messages (validation, waits, the summary) go out as whole lines
// without breaking the live one.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace isthmus::worker {

struct ProgressOptions {
  bool live = false;        // rewrite one line with '\r' (use on a terminal only)
  int64_t log_every = 10;   // plain mode: a line every N steps
  int64_t total_steps = 0;  // for the ETA; 0: unknown (no ETA)
  FILE* out = stderr;       // borrowed
};

// Not thread-safe: the training thread owns it.
class Progress {
 public:
  explicit Progress(const ProgressOptions& options);
  ~Progress();

  // Reports step `step` (1-based, global) of round `round`, its loss and the site's
  // tokens trained by it. Tokens/s is a moving figure over the recent steps.
  void OnStep(int64_t step, int64_t round, float loss, uint64_t tokens);
  // Prints `line` as a line of its own (the live line is redrawn after it).
  void Message(const std::string& line);
  // Ends the live line (if any); call before the process prints anything else.
  void Finish();

  double tokens_per_s() const { return rate_; }

  // "1h02m", "4m05s", "12s".
  static std::string FormatDuration(double seconds);

 private:
  void Draw();

  ProgressOptions options_;
  std::chrono::steady_clock::time_point last_time_;
  std::chrono::steady_clock::time_point last_draw_;
  bool started_ = false;
  bool line_open_ = false;
  double rate_ = 0;    // tokens/s, exponential moving average
  double step_s_ = 0;  // seconds per step, exponential moving average
  int64_t step_ = 0, round_ = 0;
  float loss_ = 0, loss_avg_ = 0;
};

// True when `f` is a terminal.
bool IsTerminal(FILE* f);

}  // namespace isthmus::worker
