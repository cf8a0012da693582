// Learning-rate schedule shared by every backend (it is host-side arithmetic, not a kernel).
#include <cmath>
#include <numbers>

#include "ops/ops.h"

namespace isthmus::ops {

float WarmupCosineLr(int64_t step, int64_t warmup_steps, int64_t total_steps, float max_lr,
                     float min_lr) {
  if (step < warmup_steps) {
    return max_lr * static_cast<float>(static_cast<double>(step) / warmup_steps);
  }
  if (step >= total_steps) return min_lr;
  const double progress =
      static_cast<double>(step - warmup_steps) / static_cast<double>(total_steps - warmup_steps);
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return static_cast<float>(min_lr + (static_cast<double>(max_lr) - min_lr) * cosine);
}

}  // namespace isthmus::ops
