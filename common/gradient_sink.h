// The seam between a training step that produces a flat gradient piece by piece (the
// backward finishes the last block's tensors first) and whatever reduces that gradient
// across the ranks of a site while the rest of the backward still runs. The trainer
// (worker/model/trainer.h) calls it; the bucketed all-reduce (worker/comm/
// bucketed_all_reduce.h) implements it. Neither needs the other's headers.
#pragma once

#include <cstddef>
#include <functional>

#include "common/status.h"

namespace isthmus {

class GradientSink {
 public:
  virtual ~GradientSink() = default;

  // A step's gradient begins: `count` floats at `grads` (backend memory), none final yet.
  virtual void Begin(float* grads, size_t count) = 0;
  // grads[from, count) are final once `wait` returns (it blocks until the backend has run
  // the work that produced them, and may be called on any thread). Calls come with
  // decreasing `from`, the last with 0; they return at once.
  virtual void Final(size_t from, std::function<Status()> wait) = 0;
  // Returns once the whole gradient has been handled (reduced across the ranks), with the
  // first error of any piece. After a non-OK result the step must not be applied.
  virtual Status End() = 0;
};

}  // namespace isthmus
