// The outer step's arithmetic (codec_outer.h). Compiled with -ffp-contract=off, as every
// file of this library: no fused multiply-add changes a rounding between machines.
#include "ops/codec_outer.h"

#include <cmath>

namespace isthmus::codec {

float MergeWeight(uint64_t tokens, uint64_t total, size_t sites) {
  if (total == 0) return static_cast<float>(1.0 / static_cast<double>(sites));
  return static_cast<float>(static_cast<double>(tokens) / static_cast<double>(total));
}

void AddWeighted(std::span<float> out, float w, std::span<const float> decoded) {
  float* o = out.data();
  const float* d = decoded.data();
  for (size_t i = 0; i < out.size(); ++i) o[i] += w * d[i];
}

void ApplyOuterStep(float* theta, float* m, const float* g, size_t n, float lr, float mu) {
  if (mu == 0.0f) {
    for (size_t i = 0; i < n; ++i) theta[i] += lr * g[i];
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    m[i] = mu * m[i] + g[i];
    theta[i] += lr * (g[i] + mu * m[i]);
  }
}

bool ApplyOuterStepTo(const float* theta, const float* m, const float* g, float* theta_out,
                      float* m_out, size_t n, float lr, float mu) {
  bool finite = true;
  if (mu == 0.0f) {
    for (size_t i = 0; i < n; ++i) {
      theta_out[i] = theta[i] + lr * g[i];
      finite &= std::isfinite(theta_out[i]);
    }
    return finite;
  }
  for (size_t i = 0; i < n; ++i) {
    m_out[i] = mu * m[i] + g[i];
    theta_out[i] = theta[i] + lr * (g[i] + mu * m_out[i]);
    finite &= std::isfinite(theta_out[i]);
  }
  return finite;
}

}  // namespace isthmus::codec
