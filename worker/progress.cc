// Progress reporting of isthmus-worker (see progress.h).
#include "worker/progress.h"

#include <unistd.h>

#include <cmath>

namespace isthmus::worker {

bool IsTerminal(FILE* f) { return ::isatty(::fileno(f)) == 1; }

Progress::Progress(const ProgressOptions& options) : options_(options) {}

Progress::~Progress() { Finish(); }

std::string Progress::FormatDuration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>(s % 3600 / 60));
  } else if (s >= 60) {
    std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  } else {
    std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(s));
  }
  return buf;
}

void Progress::OnStep(int64_t step, int64_t round, float loss, uint64_t tokens) {
  auto now = std::chrono::steady_clock::now();
  if (started_) {
    double dt = std::chrono::duration<double>(now - last_time_).count();
    double r = dt > 0 ? static_cast<double>(tokens) / dt : 0;
    rate_ = rate_ == 0 ? r : 0.9 * rate_ + 0.1 * r;
    step_s_ = step_s_ == 0 ? dt : 0.9 * step_s_ + 0.1 * dt;
    loss_avg_ = 0.9f * loss_avg_ + 0.1f * loss;
  } else {
    loss_avg_ = loss;
  }
  started_ = true;
  last_time_ = now;
  step_ = step;
  round_ = round;
  loss_ = loss;
  if (options_.live) {
    // Redraw at most ~10 times a second: terminals are slow and steps can be fast.
    if (now - last_draw_ >= std::chrono::milliseconds(100) || step == options_.total_steps) {
      last_draw_ = now;
      Draw();
    }
  } else if (step % options_.log_every == 0) {
    Draw();
  }
}

void Progress::Draw() {
  char eta[48] = "";
  if (options_.total_steps > 0 && step_s_ > 0) {
    double left = static_cast<double>(options_.total_steps - step_) * step_s_;
    std::snprintf(eta, sizeof eta, " | ETA %s", FormatDuration(left).c_str());
  }
  char total[32] = "";
  if (options_.total_steps > 0) {
    std::snprintf(total, sizeof total, "/%lld", static_cast<long long>(options_.total_steps));
  }
  if (options_.live) {
    std::fprintf(options_.out, "\r\033[Kround %lld | step %lld%s | loss %.4f | %.0f tok/s%s",
                 static_cast<long long>(round_), static_cast<long long>(step_), total, loss_avg_,
                 rate_, eta);
    line_open_ = true;
  } else {
    std::fprintf(options_.out, "round %lld step %lld%s loss %.4f (avg %.4f) %.0f tok/s%s\n",
                 static_cast<long long>(round_), static_cast<long long>(step_), total, loss_,
                 loss_avg_, rate_, eta);
  }
  std::fflush(options_.out);
}

void Progress::Message(const std::string& line) {
  if (line_open_) std::fputs("\r\033[K", options_.out);
  std::fprintf(options_.out, "%s\n", line.c_str());
  if (line_open_) Draw();
  std::fflush(options_.out);
}

void Progress::Finish() {
  if (line_open_) {
    std::fputc('\n', options_.out);
    std::fflush(options_.out);
    line_open_ = false;
  }
}

}  // namespace isthmus::worker
