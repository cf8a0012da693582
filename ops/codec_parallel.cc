// EncodeWithFeedbackMany: a round's tensors encoded with error feedback on several threads.
// The codec itself stays single-threaded per tensor (its byte format is defined by one fixed
// order of operations); what runs in parallel is whole tensors, so the results cannot
// depend on the number of threads.
#include <algorithm>
#include <numeric>
#include <vector>

#include "common/parallel_for.h"
#include "ops/codec.h"

namespace isthmus::codec {

void EncodeWithFeedbackMany(std::span<FeedbackTask> tasks, int threads) {
  // Largest first, so the last tasks to start are the short ones.
  std::vector<size_t> order(tasks.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return tasks[a].delta.size() > tasks[b].delta.size();
  });
  ForEachIndex(order.size(), static_cast<size_t>(std::max(threads, 1)), "codec-encode",
               [&](size_t k) {
                 FeedbackTask& t = tasks[order[k]];
                 t.bytes = EncodeWithFeedback(t.pipeline, t.delta, t.shape, t.residual_in,
                                              t.residual_out, t.decoded);
               });
}

}  // namespace isthmus::codec
