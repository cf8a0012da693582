// Helpers shared by the CPU backend's source files (cpu_ops.cc, cpu_attention.cc). Not a
// public interface: callers use Ops from ops/ops.h.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/ops.h"

namespace isthmus::ops::cpu {

// Row-major sgemm on strided operands: c = alpha * op(a) op(b) + beta * c, op(a) [m,k],
// op(b) [k,n], with leading dimensions lda/ldb/ldc (elements between consecutive rows
// as stored).
void Sgemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
           const float* b, int ldb, float beta, float* c, int ldc);

// An fp32 view of n elements of backend (host) memory: the memory itself when it is fp32,
// else a converted copy.
class In {
 public:
  In(CRef ref, int64_t n);
  const float* get() const { return ptr_; }

 private:
  std::vector<float> copy_;
  const float* ptr_;
};

// An fp32 buffer for n output elements: the memory itself when it is fp32, else a scratch
// copy (loaded from the memory when `load` is set, for accumulating kernels) that Commit()
// rounds into the memory. Commit() must be called once the values are final.
class Out {
 public:
  Out(Ref ref, int64_t n, bool load);
  float* get() { return ptr_; }
  void Commit();

 private:
  Ref ref_;
  int64_t n_;
  std::vector<float> copy_;
  float* ptr_;
};

// Converts n values between fp32 and bf16 (round to nearest even).
void ToBf16(const float* src, Bf16* dst, int64_t n);
void FromBf16(const Bf16* src, float* dst, int64_t n);

void AttentionForward(const float* qkv, float* out, float* lse, int B, int T, int C, int H);
void AttentionBackward(const float* dout, const float* qkv, const float* out, const float* lse,
                       float* dqkv, int B, int T, int C, int H);

}  // namespace isthmus::ops::cpu
