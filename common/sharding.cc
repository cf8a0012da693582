// Deterministic, order-independent greedy placement of tensors on shards.
#include "common/sharding.h"

#include <algorithm>
#include <numeric>

namespace isthmus {

std::vector<int> AssignTensorsToShards(const std::vector<TensorSize>& tensors, int num_shards) {
  std::vector<int> owner(tensors.size(), 0);
  if (num_shards <= 1) return owner;
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (tensors[a].bytes != tensors[b].bytes) return tensors[a].bytes > tensors[b].bytes;
    return tensors[a].name < tensors[b].name;
  });
  std::vector<uint64_t> load(num_shards, 0);
  for (size_t i : order) {
    int best = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = best;
    load[best] += tensors[i].bytes;
  }
  return owner;
}

}  // namespace isthmus
