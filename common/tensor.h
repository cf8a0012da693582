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

// Makes (*out)[i] a tensor named `name` of `shape` holding numel values, growing *out as
// needed, and returns its data for the caller to fill. A tensor already there of that size
// keeps its buffer: an image refilled every round (the worker's checkpoint) then writes
// into memory it already has, instead of faulting in a fresh gigabyte each time.
inline float* RefillTensor(std::vector<Tensor>* out, size_t i, const std::string& name,
                           const std::vector<int64_t>& shape, int64_t numel) {
  if (out->size() <= i) out->resize(i + 1);
  Tensor& t = (*out)[i];
  t.name = name;
  t.shape = shape;
  t.data.resize(static_cast<size_t>(numel));
  return t.data.data();
}

// The most elements a shape may describe. Shapes come from the network and from files:
// with this bound, element count x any element size up to 64 bytes (and any offset added
// to it) fits in int64_t and size_t, so no size computed from a valid shape can wrap.
inline constexpr int64_t kMaxElements = int64_t{1} << 56;

// Product of the dims (1 for a scalar, 0 if a dim is 0); -1 if a dim is negative or the
// product of the non-zero dims exceeds kMaxElements. Zero dims are set aside so that the
// answer does not depend on their position: [2^40, 2^40, 0] is refused like [0, 2^40, 2^40].
inline int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  bool empty = false;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    if (d == 0) {
      empty = true;
      continue;
    }
    if (n > kMaxElements / d) return -1;
    n *= d;
  }
  return empty ? 0 : n;
}

}  // namespace isthmus
