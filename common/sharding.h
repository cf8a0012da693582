// Which shard of a site owns which tensor. Every party (isthmusctl when it creates a job,
// workers when they push and pull) computes the same placement from the tensor list
// alone, so no directory service is needed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace isthmus {

struct TensorSize {
  std::string name;
  uint64_t bytes = 0;
};

// Returns, for each input tensor (same order), the index of its shard in [0, num_shards).
// Deterministic greedy balance: largest first (ties by name), each to the least-loaded
// shard (ties to the lowest index). Independent of the input order.
std::vector<int> AssignTensorsToShards(const std::vector<TensorSize>& tensors, int num_shards);

}  // namespace isthmus
