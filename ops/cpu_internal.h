// Helpers shared by the CPU backend's source files (cpu_ops.cc, cpu_attention.cc). Not a
// public interface: callers use Ops from ops/ops.h.
#pragma once

namespace isthmus::ops::cpu {

// Row-major sgemm on strided operands: c = alpha * op(a) op(b) + beta * c, op(a) [m,k],
// op(b) [k,n], with leading dimensions lda/ldb/ldc (elements between consecutive rows
// as stored).
void Sgemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
           const float* b, int ldb, float beta, float* c, int ldc);

void AttentionForward(const float* qkv, float* out, float* att, int B, int T, int C, int H);
void AttentionBackward(const float* dout, const float* qkv, const float* att, float* dqkv,
                       float* datt_scratch, int B, int T, int C, int H);

}  // namespace isthmus::ops::cpu
