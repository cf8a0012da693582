// EncodeWithFeedbackMany: a round's tensors encoded with error feedback on several threads.
// The codec itself stays single-threaded per tensor (its byte format is defined by one fixed
// order of operations); what runs in parallel is whole tensors, so the results cannot
// depend on the number of threads.
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <thread>
#include <vector>

#include "ops/codec.h"

namespace isthmus::codec {

void EncodeWithFeedbackMany(std::span<FeedbackTask> tasks, int threads) {
  // Largest first, so the last tasks to start are the short ones.
  std::vector<size_t> order(tasks.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return tasks[a].delta.size() > tasks[b].delta.size();
  });
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t k = next.fetch_add(1); k < order.size(); k = next.fetch_add(1)) {
      FeedbackTask& t = tasks[order[k]];
      t.bytes = EncodeWithFeedback(t.pipeline, t.delta, t.shape, t.residual_in, t.residual_out,
                                   t.decoded);
    }
  };
  const size_t helpers = std::min<size_t>(threads > 1 ? static_cast<size_t>(threads) - 1 : 0,
                                          tasks.size() > 0 ? tasks.size() - 1 : 0);
  std::vector<std::thread> pool;
  pool.reserve(helpers);
  for (size_t i = 0; i < helpers; ++i) {
    pool.emplace_back([&work] {
      pthread_setname_np(pthread_self(), "codec-encode");
      work();
    });
  }
  work();
  for (auto& th : pool) th.join();
}

}  // namespace isthmus::codec
