// A named fp32 tensor: the unit the shard stores, the wire carries and checkpoints hold.
// fp32 is the only dtype held in memory; other dtypes are converted at file/wire edges.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace isthmus {

struct Tensor {
  std::string name;            // GPT-2 style, e.g. "h.0.attn.c_attn.weight"
  std::vector<int64_t> shape;  // row-major; empty means a scalar
  std::vector<float> data;     // size() == NumElements(shape)

  int64_t numel() const { return static_cast<int64_t>(data.size()); }
};

// Product of the dims (1 for a scalar); -1 if a dim is negative or the product overflows.
inline int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d != 0 && n > (int64_t{1} << 62) / d) return -1;
    n *= d;
  }
  return n;
}

}  // namespace isthmus
