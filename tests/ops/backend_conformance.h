// Conformance of a compute backend to the CPU reference (ops/ops.h): every kernel on the
// same random inputs, forward and backward, in fp32 and bf16, and a whole training step of
// the model. Included by one test file per backend, which instantiates the suite with a
// factory and the shapes to run: tests/ops/emu_backend_test.cc (the CUDA kernels on the
// CPU emulator, small shapes) and tests/gpu/cuda_backend_test.cc (a GPU, training shapes).
//
// Tolerances, as max |got - ref| / max |ref| over a tensor:
//   fp32: 1e-5 for elementwise kernels, layer norm, attention and cross-entropy; 2e-5 for
//   matmuls and what is built from them (the sums run in another order, and their rounding
//   grows like sqrt(k) * 2^-24), more where a test says why.
//   bf16: 1.6e-2. bf16 keeps 8 significant bits (2^-9 relative rounding at each store);
//   a kernel that rounds once is within 0.4% of the reference, and the composed ones
//   (LoRA, attention with bf16 P on tensor cores) round two or three times.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "ops/buffer.h"
#include "ops/ops.h"
#include "worker/model/gpt.h"
#include "worker/model/trainer.h"

namespace isthmus::ops::conformance {

struct Shape {
  int B, T, C, H, V, rank;
  std::string Name() const {
    return std::to_string(B) + "x" + std::to_string(T) + "_C" + std::to_string(C) + "_H" +
           std::to_string(H);
  }
};

// A backend to test: made fresh for each test; null with *why set when it cannot run
// here (the test then skips with that reason).
struct BackendCase {
  std::string name;
  std::function<std::unique_ptr<Ops>(std::string* why)> make;
  Shape shape;
};

inline std::string CaseName(const ::testing::TestParamInfo<BackendCase>& info) {
  return info.param.name + "_" + info.param.shape.Name();
}

// How gtest (and so ctest's test names) shows a case.
inline void PrintTo(const BackendCase& c, std::ostream* os) {
  *os << c.name << " " << c.shape.Name();
}

constexpr double kF32Tol = 1e-5;
constexpr double kF32MatmulTol = 2e-5;
constexpr double kBf16Tol = 1.6e-2;

inline double Tol(Dtype d, double f32) { return d == Dtype::kF32 ? f32 : kBf16Tol; }

// Backend buffers made from host vectors and read back as fp32, whatever their dtype.
class Mem {
 public:
  explicit Mem(Ops& ops) : ops_(ops) {}
  Ref In(const std::vector<float>& v, Dtype d = Dtype::kF32) {
    Ref r = Alloc(v.size(), d);
    Put(r, v);
    return r;
  }
  // An output pre-filled with a value no kernel produces by accident.
  Ref Out(size_t n, Dtype d = Dtype::kF32) { return In(std::vector<float>(n, 1234.5f), d); }
  const int32_t* Ints(const std::vector<int32_t>& v) {
    Ref r = Alloc(v.size(), Dtype::kF32);
    ops_.Upload(r.data, v.data(), v.size() * sizeof(int32_t));
    return static_cast<const int32_t*>(r.data);
  }
  std::vector<float> Read(Ref r, size_t n) {
    std::vector<float> out(n);
    if (r.dtype == Dtype::kF32) {
      ops_.Download(out.data(), r.data, n * sizeof(float));
    } else {
      std::vector<Bf16> h(n);
      ops_.Download(h.data(), r.data, n * sizeof(Bf16));
      for (size_t i = 0; i < n; ++i) out[i] = FromBf16(h[i]);
    }
    return out;
  }

 private:
  Ref Alloc(size_t n, Dtype d) {
    auto b = Buffer::Allocate(ops_, std::max<size_t>(n, 1) * DtypeSize(d));
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    bufs_.push_back(std::move(b).value());
    return {bufs_.back().data(), d};
  }
  void Put(Ref r, const std::vector<float>& v) {
    if (r.dtype == Dtype::kF32) {
      ops_.Upload(r.data, v.data(), v.size() * sizeof(float));
    } else {
      std::vector<Bf16> h(v.size());
      for (size_t i = 0; i < v.size(); ++i) h[i] = ToBf16(v[i]);
      ops_.Upload(r.data, h.data(), h.size() * sizeof(Bf16));
    }
  }
  Ops& ops_;
  std::vector<Buffer> bufs_;
};

inline std::vector<float> Random(size_t n, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Checks max |got - ref| <= tol * max |ref| and prints the figure.
inline void ExpectClose(const std::string& what, const std::vector<float>& got,
                        const std::vector<float>& ref, double tol) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double max_ref = 0.0, max_err = 0.0;
  size_t worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    max_ref = std::max(max_ref, std::fabs(double(ref[i])));
    const double err = std::fabs(double(got[i]) - ref[i]);
    if (!(err <= max_err)) {  // also catches NaN
      max_err = err;
      worst = i;
    }
  }
  const double rel = max_ref > 0 ? max_err / max_ref : max_err;
  std::printf("  %-40s n=%-8zu max|ref|=%-10.3g rel err=%.3g\n", what.c_str(), ref.size(), max_ref,
              rel);
  EXPECT_LE(rel, tol) << what << ": element " << worst << " is " << got[worst] << ", reference "
                      << ref[worst];
}

// Runs `body` on the CPU reference and on the backend under test with the same inputs and
// compares every output it returns.
using Outputs = std::vector<std::pair<std::string, std::vector<float>>>;

class BackendTest : public ::testing::TestWithParam<BackendCase> {
 protected:
  void SetUp() override {
    std::string why;
    ops_ = GetParam().make(&why);
    if (!ops_) GTEST_SKIP() << GetParam().name << " cannot run here: " << why;
  }

  void Compare(const std::string& what, const std::function<Outputs(Ops&, Mem&)>& body,
               double tol) {
    Mem ref_mem(CpuOps()), got_mem(*ops_);
    const Outputs ref = body(CpuOps(), ref_mem);
    const Outputs got = body(*ops_, got_mem);
    ASSERT_TRUE(ops_->Synchronize().ok()) << ops_->status().ToString();
    ASSERT_EQ(ref.size(), got.size());
    for (size_t i = 0; i < ref.size(); ++i) {
      ExpectClose(what + " " + ref[i].first, got[i].second, ref[i].second, tol);
    }
  }

  const Shape& shape() const { return GetParam().shape; }
  std::unique_ptr<Ops> ops_;
};

inline const Dtype kDtypes[] = {Dtype::kF32, Dtype::kBF16};

TEST_P(BackendTest, Matmul) {
  const Shape& s = shape();
  const int m = s.B * s.T, n = 3 * s.C, k = s.C;
  for (Dtype in : kDtypes) {
    for (Dtype out : kDtypes) {
      if (in == Dtype::kF32 && out == Dtype::kBF16) continue;  // outside the contract
      for (int t = 0; t < 4; ++t) {
        const bool ta = t & 1, tb = t & 2;
        std::mt19937 rng(100 + t);
        const auto a = Random(static_cast<size_t>(m) * k, rng);
        const auto b = Random(static_cast<size_t>(k) * n, rng);
        const auto c0 = Random(static_cast<size_t>(m) * n, rng);
        Compare(
            std::string("matmul ") + DtypeName(in) + "->" + DtypeName(out) + (ta ? " aT" : "") +
                (tb ? " bT" : ""),
            [&](Ops& o, Mem& mem) -> Outputs {
              Ref c = mem.In(c0, out);
              o.Matmul(mem.In(a, in), mem.In(b, in), c, m, n, k, ta, tb, 0.5f, 1.0f);
              return {{"c", mem.Read(c, c0.size())}};
            },
            Tol(out, kF32MatmulTol));
      }
    }
  }
}

TEST_P(BackendTest, CastSubtractSumSquares) {
  const Shape& s = shape();
  const size_t n = static_cast<size_t>(s.B) * s.T * s.C + 7;
  std::mt19937 rng(1);
  const auto a = Random(n, rng), b = Random(n, rng);
  Compare(
      "elementwise",
      [&](Ops& o, Mem& mem) -> Outputs {
        Ref h = mem.Out(n, Dtype::kBF16), back = mem.Out(n), d = mem.Out(n), sq = mem.Out(1);
        o.Cast(mem.In(a), h, static_cast<int64_t>(n));
        o.Cast(h, back, static_cast<int64_t>(n));
        Ref ar = mem.In(a);
        o.Subtract(static_cast<const float*>(ar.data), static_cast<const float*>(mem.In(b).data),
                   static_cast<float*>(d.data), static_cast<int64_t>(n));
        o.SumSquares(static_cast<const float*>(ar.data), static_cast<int64_t>(n),
                     static_cast<float*>(sq.data));
        return {{"cast round trip", mem.Read(back, n)},
                {"subtract", mem.Read(d, n)},
                {"sum of squares", mem.Read(sq, 1)}};
      },
      kF32Tol);
}

TEST_P(BackendTest, Embedding) {
  const Shape& s = shape();
  const int N = s.B * s.T;
  std::mt19937 rng(2);
  std::vector<int32_t> tokens(N);
  std::uniform_int_distribution<int32_t> tok(0, s.V - 1);
  for (auto& t : tokens) t = tok(rng) % 17;  // few distinct tokens: long groups
  std::vector<int32_t> order(N), starts(s.V + 1);
  GroupByToken(tokens.data(), N, s.V, order.data(), starts.data());
  const auto wte = Random(static_cast<size_t>(s.V) * s.C, rng);
  const auto wpe = Random(static_cast<size_t>(s.T) * s.C, rng);
  const auto dout = Random(static_cast<size_t>(N) * s.C, rng);
  const auto dwte0 = Random(wte.size(), rng), dwpe0 = Random(wpe.size(), rng);
  Compare(
      "embedding",
      [&](Ops& o, Mem& mem) -> Outputs {
        Ref out = mem.Out(dout.size()), dwte = mem.In(dwte0), dwpe = mem.In(dwpe0);
        Ref out_no_wpe = mem.Out(dout.size());
        o.EmbeddingForward(mem.Ints(tokens), static_cast<const float*>(mem.In(wte).data),
                           static_cast<const float*>(mem.In(wpe).data),
                           static_cast<float*>(out.data), s.B, s.T, s.C);
        o.EmbeddingForward(mem.Ints(tokens), static_cast<const float*>(mem.In(wte).data), nullptr,
                           static_cast<float*>(out_no_wpe.data), s.B, s.T, s.C);
        o.EmbeddingBackward(static_cast<const float*>(mem.In(dout).data), mem.Ints(order),
                            mem.Ints(starts), static_cast<float*>(dwte.data),
                            static_cast<float*>(dwpe.data), s.B, s.T, s.C, s.V);
        return {{"out", mem.Read(out, dout.size())},
                {"out without wpe", mem.Read(out_no_wpe, dout.size())},
                {"dwte (accumulated)", mem.Read(dwte, wte.size())},
                {"dwpe (accumulated)", mem.Read(dwpe, wpe.size())}};
      },
      kF32Tol);
}

TEST_P(BackendTest, LayerNorm) {
  const Shape& s = shape();
  const int N = s.B * s.T, C = s.C;
  std::mt19937 rng(3);
  auto x = Random(static_cast<size_t>(N) * C, rng, 3.0f);
  for (float& v : x) v += 5.0f;
  const auto w = Random(C, rng), b = Random(C, rng);
  const auto dx0 = Random(x.size(), rng), dw0 = Random(C, rng), db0 = Random(C, rng);
  for (Dtype d : kDtypes) {
    const auto dout = Random(x.size(), rng);
    Compare(
        std::string("layernorm ") + DtypeName(d),
        [&](Ops& o, Mem& mem) -> Outputs {
          Ref out = mem.Out(x.size(), d), mean = mem.Out(N), rstd = mem.Out(N);
          Ref xr = mem.In(x), wr = mem.In(w);
          Ref dx = mem.In(dx0), dw = mem.In(dw0), db = mem.In(db0);
          auto f = [](Ref r) { return static_cast<float*>(r.data); };
          o.LayerNormForward(f(xr), f(wr), f(mem.In(b)), out, f(mean), f(rstd), N, C);
          o.LayerNormBackward(mem.In(dout, d), f(xr), f(wr), f(mean), f(rstd), f(dx), f(dw), f(db),
                              N, C);
          return {{"out", mem.Read(out, x.size())}, {"mean", mem.Read(mean, N)},
                  {"rstd", mem.Read(rstd, N)},      {"dx (accumulated)", mem.Read(dx, x.size())},
                  {"dweight", mem.Read(dw, C)},     {"dbias", mem.Read(db, C)}};
        },
        Tol(d, kF32Tol));
  }
}

TEST_P(BackendTest, LinearAndLora) {
  const Shape& s = shape();
  const int N = s.B * s.T, in = s.C, out_dim = 4 * s.C, r = s.rank;
  const float scale = 2.0f;
  std::mt19937 rng(4);
  const auto x = Random(static_cast<size_t>(N) * in, rng);
  const auto w = Random(static_cast<size_t>(in) * out_dim, rng, 0.05f);
  const auto bias = Random(out_dim, rng);
  const auto res = Random(static_cast<size_t>(N) * out_dim, rng);
  const auto a = Random(static_cast<size_t>(r) * in, rng, 0.05f);
  const auto bb = Random(static_cast<size_t>(out_dim) * r, rng, 0.05f);
  const auto dout = Random(static_cast<size_t>(N) * out_dim, rng);
  const auto dw0 = Random(w.size(), rng), db0 = Random(out_dim, rng);
  const auto da0 = Random(a.size(), rng), dbb0 = Random(bb.size(), rng);
  for (Dtype d : kDtypes) {
    Compare(
        std::string("linear ") + DtypeName(d),
        [&](Ops& o, Mem& mem) -> Outputs {
          auto f = [](Ref q) { return static_cast<float*>(q.data); };
          Ref xr = mem.In(x, d), wr = mem.In(w, d);
          Ref out = mem.Out(res.size(), d), out_res = mem.In(res);
          Ref dx = mem.Out(x.size(), d), dw = mem.In(dw0), db = mem.In(db0);
          o.LinearForward(xr, wr, f(mem.In(bias)), nullptr, out, N, in, out_dim);
          o.LinearForward(xr, wr, f(mem.In(bias)), f(out_res), out_res, N, in, out_dim);
          o.LinearBackward(mem.In(dout, d), xr, wr, dx, f(dw), f(db), N, in, out_dim);
          return {{"out", mem.Read(out, res.size())},
                  {"out + residual (aliased)", mem.Read(out_res, res.size())},
                  {"dx", mem.Read(dx, x.size())},
                  {"dw (accumulated)", mem.Read(dw, w.size())},
                  {"dbias (accumulated)", mem.Read(db, bias.size())}};
        },
        Tol(d, kF32MatmulTol));
    Compare(
        std::string("lora ") + DtypeName(d),
        [&](Ops& o, Mem& mem) -> Outputs {
          auto f = [](Ref q) { return static_cast<float*>(q.data); };
          Ref xr = mem.In(x, d), wr = mem.In(w, d), ar = mem.In(a, d), br = mem.In(bb, d);
          Ref out = mem.Out(res.size(), d), xa = mem.Out(static_cast<size_t>(N) * r, d);
          Ref dx = mem.Out(x.size(), d), dxa = mem.Out(static_cast<size_t>(N) * r, d);
          Ref da = mem.In(da0), dbb = mem.In(dbb0);
          o.LoraLinearForward(xr, wr, f(mem.In(bias)), ar, br, scale, nullptr, out, xa, N, in,
                              out_dim, r);
          o.LoraLinearBackward(mem.In(dout, d), xr, wr, ar, br, scale, xa, dx, nullptr, nullptr,
                               f(da), f(dbb), dxa, N, in, out_dim, r);
          return {{"out", mem.Read(out, res.size())},
                  {"xa", mem.Read(xa, static_cast<size_t>(N) * r)},
                  {"dx", mem.Read(dx, x.size())},
                  {"dA (accumulated)", mem.Read(da, a.size())},
                  {"dB (accumulated)", mem.Read(dbb, bb.size())}};
        },
        Tol(d, kF32MatmulTol));
  }
}

TEST_P(BackendTest, Gelu) {
  const Shape& s = shape();
  const size_t n = static_cast<size_t>(s.B) * s.T * 4 * s.C + 3;
  std::mt19937 rng(5);
  const auto x = Random(n, rng, 3.0f), dout = Random(n, rng);
  for (Dtype d : kDtypes) {
    Compare(
        std::string("gelu ") + DtypeName(d),
        [&](Ops& o, Mem& mem) -> Outputs {
          Ref xr = mem.In(x, d), out = mem.Out(n, d), dx = mem.In(dout, d);
          o.GeluForward(xr, out, static_cast<int64_t>(n));
          o.GeluBackward(dx, xr, dx, static_cast<int64_t>(n));  // in place
          return {{"out", mem.Read(out, n)}, {"dx (in place)", mem.Read(dx, n)}};
        },
        Tol(d, kF32Tol));
  }
}

TEST_P(BackendTest, RmsNorm) {
  const Shape& s = shape();
  const int N = s.B * s.T, C = s.C;
  std::mt19937 rng(20);
  const auto x = Random(static_cast<size_t>(N) * C, rng, 3.0f), w = Random(C, rng);
  const auto dx0 = Random(x.size(), rng), dw0 = Random(C, rng);
  for (Dtype d : kDtypes) {
    const auto dout = Random(x.size(), rng);
    Compare(
        std::string("rmsnorm ") + DtypeName(d),
        [&](Ops& o, Mem& mem) -> Outputs {
          auto f = [](Ref r) { return static_cast<float*>(r.data); };
          Ref out = mem.Out(x.size(), d), rstd = mem.Out(N);
          Ref xr = mem.In(x), wr = mem.In(w), dx = mem.In(dx0), dw = mem.In(dw0);
          Ref dx_frozen = mem.In(dx0);
          o.RmsNormForward(f(xr), f(wr), out, f(rstd), N, C, 1e-6f);
          Ref dr = mem.In(dout, d);
          o.RmsNormBackward(dr, f(xr), f(wr), f(rstd), f(dx), f(dw), N, C);
          o.RmsNormBackward(dr, f(xr), f(wr), f(rstd), f(dx_frozen), nullptr, N, C);
          return {{"out", mem.Read(out, x.size())},
                  {"rstd", mem.Read(rstd, N)},
                  {"dx (accumulated)", mem.Read(dx, x.size())},
                  {"dweight (accumulated)", mem.Read(dw, C)},
                  {"dx, frozen weight", mem.Read(dx_frozen, x.size())}};
        },
        Tol(d, kF32Tol));
  }
}

TEST_P(BackendTest, Swiglu) {
  const Shape& s = shape();
  const size_t n = static_cast<size_t>(s.B) * s.T * 4 * s.C + 3;
  std::mt19937 rng(21);
  const auto gate = Random(n, rng, 3.0f), up = Random(n, rng), dout = Random(n, rng);
  for (Dtype d : kDtypes) {
    Compare(
        std::string("swiglu ") + DtypeName(d),
        [&](Ops& o, Mem& mem) -> Outputs {
          Ref g = mem.In(gate, d), u = mem.In(up, d), out = mem.Out(n, d);
          Ref dg = mem.Out(n, d), du = mem.Out(n, d), dr = mem.In(dout, d);
          o.SwigluForward(g, u, out, static_cast<int64_t>(n));
          o.SwigluBackward(dr, g, u, dg, du, static_cast<int64_t>(n));
          o.SwigluBackward(dr, g, u, g, u, static_cast<int64_t>(n));  // in place
          return {{"out", mem.Read(out, n)},
                  {"dgate", mem.Read(dg, n)},
                  {"dup", mem.Read(du, n)},
                  {"dgate (in place)", mem.Read(g, n)},
                  {"dup (in place)", mem.Read(u, n)}};
        },
        Tol(d, kF32Tol));
  }
}

TEST_P(BackendTest, RopeGqa) {
  const Shape& s = shape();
  const int H = s.H, D = s.C / s.H, N = s.B * s.T;
  ASSERT_EQ(D % 2, 0) << "RoPE needs an even head size";
  std::vector<float> rope(static_cast<size_t>(s.T) * D);
  for (int t = 0; t < s.T; ++t) {
    for (int i = 0; i < D / 2; ++i) {
      const double angle = t * std::pow(10000.0, -2.0 * i / D);
      rope[t * D + i] = static_cast<float>(std::cos(angle));
      rope[t * D + D / 2 + i] = static_cast<float>(std::sin(angle));
    }
  }
  std::mt19937 rng(22);
  // Plain multi-head, and grouped (two query heads per kv head, or one kv head).
  for (int Hkv : {H, H % 2 == 0 ? H / 2 : 1}) {
    const size_t qn = static_cast<size_t>(N) * H * D, kn = static_cast<size_t>(N) * Hkv * D;
    const auto q = Random(qn, rng), k = Random(kn, rng), v = Random(kn, rng);
    const auto dqkv = Random(3 * qn, rng);
    for (Dtype d : kDtypes) {
      Compare(
          "rope H " + std::to_string(H) + " Hkv " + std::to_string(Hkv) + " " + DtypeName(d),
          [&](Ops& o, Mem& mem) -> Outputs {
            Ref qkv = mem.Out(3 * qn, d), dq = mem.Out(qn, d), dk = mem.Out(kn, d);
            Ref dv = mem.Out(kn, d), table = mem.In(rope);
            const float* rp = static_cast<const float*>(table.data);
            o.RopeGqaForward(mem.In(q, d), mem.In(k, d), mem.In(v, d), rp, qkv, s.B, s.T, H, Hkv,
                             D);
            o.RopeGqaBackward(mem.In(dqkv, d), rp, dq, dk, dv, s.B, s.T, H, Hkv, D);
            return {{"qkv", mem.Read(qkv, 3 * qn)},
                    {"dq", mem.Read(dq, qn)},
                    {"dk", mem.Read(dk, kn)},
                    {"dv", mem.Read(dv, kn)}};
          },
          Tol(d, kF32Tol));
    }
  }
}

TEST_P(BackendTest, Attention) {
  const Shape& s = shape();
  std::mt19937 rng(6);
  const size_t n = static_cast<size_t>(s.B) * s.T * s.C;
  const auto qkv = Random(3 * n, rng), dout = Random(n, rng);
  const size_t rows = static_cast<size_t>(s.B) * s.H * s.T;
  for (Dtype d : kDtypes) {
    Compare(
        std::string("attention ") + DtypeName(d),
        [&](Ops& o, Mem& mem) -> Outputs {
          Ref q = mem.In(qkv, d), out = mem.Out(n, d), lse = mem.Out(rows);
          Ref dq = mem.Out(3 * n, d);
          Ref scratch = mem.Out(AttentionScratchFloats(s.B, s.T, s.C, s.H));
          o.AttentionForward(q, out, static_cast<float*>(lse.data), s.B, s.T, s.C, s.H);
          o.AttentionBackward(mem.In(dout, d), q, out, static_cast<float*>(lse.data), dq,
                              static_cast<float*>(scratch.data), s.B, s.T, s.C, s.H);
          return {{"out", mem.Read(out, n)},
                  {"lse", mem.Read(lse, rows)},
                  {"dqkv", mem.Read(dq, 3 * n)}};
        },
        // fp32: scores are sums over hs and the softmax sums run over up to T terms.
        Tol(d, 2e-5));
  }
}

TEST_P(BackendTest, SoftmaxCrossEntropy) {
  const Shape& s = shape();
  const int N = s.B * s.T;
  std::mt19937 rng(7);
  const auto logits = Random(static_cast<size_t>(N) * s.V, rng, 3.0f);
  std::vector<int32_t> targets(N);
  std::uniform_int_distribution<int32_t> t(0, s.V - 1);
  for (int i = 0; i < N; ++i) targets[i] = i % 13 == 5 ? -1 : t(rng);
  const std::vector<float> dloss = {1.0f / static_cast<float>(N)};
  for (Dtype d : kDtypes) {
    Compare(
        std::string("cross-entropy ") + DtypeName(d),
        [&](Ops& o, Mem& mem) -> Outputs {
          Ref lg = mem.In(logits, d), losses = mem.Out(N);
          Ref dl = mem.Out(logits.size(), d), in_place = mem.In(logits, d);
          Ref scale = mem.In(dloss), losses2 = mem.Out(N);
          o.SoftmaxCrossEntropy(lg, mem.Ints(targets), static_cast<float*>(losses.data), dl,
                                static_cast<const float*>(scale.data), N, s.V);
          o.SoftmaxCrossEntropy(in_place, mem.Ints(targets), static_cast<float*>(losses2.data),
                                in_place, static_cast<const float*>(scale.data), N, s.V);
          return {{"losses", mem.Read(losses, N)},
                  {"dlogits", mem.Read(dl, logits.size())},
                  {"dlogits in place", mem.Read(in_place, logits.size())}};
        },
        Tol(d, kF32Tol));
  }
}

TEST_P(BackendTest, DistillCrossEntropy) {
  const Shape& s = shape();
  const int N = s.B * s.T;
  std::mt19937 rng(17);
  const auto logits = Random(static_cast<size_t>(N) * s.V, rng, 3.0f);
  std::vector<int32_t> targets(N);
  std::uniform_int_distribution<int32_t> t(0, s.V - 1);
  for (int i = 0; i < N; ++i) targets[i] = i % 11 == 4 ? -1 : t(rng);
  const std::vector<float> dloss = {1.0f / static_cast<float>(N)};
  // A sparse teacher (k distinct ids per row) and a full-vocabulary one (k = V).
  for (int k : {std::min(s.V, 7), s.V}) {
    std::vector<int32_t> ids;
    for (int i = 0; i < N; ++i) {
      std::vector<int32_t> all(s.V);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      ids.insert(ids.end(), all.begin(), all.begin() + k);
    }
    const auto teacher = Random(static_cast<size_t>(N) * k, rng, 3.0f);
    const DistillLoss cfg{k, 0.25f, 2.0f};
    for (Dtype d : kDtypes) {
      Compare(
          "distillation k " + std::to_string(k) + " " + DtypeName(d),
          [&](Ops& o, Mem& mem) -> Outputs {
            Ref lg = mem.In(logits, d), losses = mem.Out(N);
            Ref dl = mem.Out(logits.size(), d), in_place = mem.In(logits, d);
            Ref scale = mem.In(dloss), losses2 = mem.Out(N), tl = mem.In(teacher);
            o.DistillCrossEntropy(lg, mem.Ints(targets), mem.Ints(ids),
                                  static_cast<const float*>(tl.data), cfg,
                                  static_cast<float*>(losses.data), dl,
                                  static_cast<const float*>(scale.data), N, s.V);
            o.DistillCrossEntropy(in_place, mem.Ints(targets), mem.Ints(ids),
                                  static_cast<const float*>(tl.data), cfg,
                                  static_cast<float*>(losses2.data), in_place,
                                  static_cast<const float*>(scale.data), N, s.V);
            return {{"losses", mem.Read(losses, N)},
                    {"dlogits", mem.Read(dl, logits.size())},
                    {"dlogits in place", mem.Read(in_place, logits.size())}};
          },
          Tol(d, kF32Tol));
    }
  }
}

TEST_P(BackendTest, AdamW) {
  const Shape& s = shape();
  const int64_t n = static_cast<int64_t>(s.C) * s.C + 100;
  std::mt19937 rng(8);
  const auto p0 = Random(n, rng), g = Random(n, rng, 0.01f), m0 = Random(n, rng, 0.001f);
  auto v0 = Random(n, rng, 0.001f);
  for (float& x : v0) x = x * x;
  const auto chunks = MakeAdamWChunks({{0, n / 2, true}, {n / 2 + 5, n - n / 2 - 5, false}});
  const AdamWScalars sc{1e-3f, 0.1f, 0.05f, 0.0f};
  AdamWConfig cfg{0.9f, 0.95f, 1e-8f, 0.1f, 0.5f};
  Compare(
      "adamw",
      [&](Ops& o, Mem& mem) -> Outputs {
        auto f = [](Ref q) { return static_cast<float*>(q.data); };
        Ref p = mem.In(p0), gr = mem.In(g), m = mem.In(m0), v = mem.In(v0);
        Ref copy = mem.Out(n, Dtype::kBF16), sumsq = mem.Out(1);
        Ref ch = mem.Out(chunks.size() * sizeof(AdamWChunk) / sizeof(float));
        o.Upload(ch.data, chunks.data(), chunks.size() * sizeof(AdamWChunk));
        Ref scal = mem.Out(sizeof(AdamWScalars) / sizeof(float));
        o.Upload(scal.data, &sc, sizeof sc);
        o.SumSquares(f(gr), n, f(sumsq));
        o.AdamW(f(p), f(gr), f(m), f(v), copy, static_cast<const AdamWChunk*>(ch.data),
                static_cast<int>(chunks.size()), f(sumsq),
                static_cast<const AdamWScalars*>(scal.data), cfg);
        return {{"param", mem.Read(p, n)},
                {"m", mem.Read(m, n)},
                {"v", mem.Read(v, n)},
                {"bf16 copy", mem.Read(copy, n)}};
      },
      kF32Tol);
}

// One training step of the whole model (forward, backward, clipping, AdamW) on the
// backend against the same step on the CPU: loss, gradients and updated parameters.
TEST_P(BackendTest, TrainingStepMatchesCpu) {
  const Shape& s = shape();
  model::GptConfig c;
  c.n_layer = 2;
  c.n_embd = s.C;
  c.n_head = s.H;
  c.n_ctx = s.T;
  c.vocab_size = s.V;
  model::LoraConfig lora;
  lora.rank = s.rank;
  std::mt19937 rng(9);
  std::vector<int32_t> tokens(static_cast<size_t>(s.B) * s.T), targets(tokens.size());
  std::uniform_int_distribution<int32_t> t(0, s.V - 1);
  for (auto& x : tokens) x = t(rng);
  for (auto& x : targets) x = t(rng);
  for (model::TrainMode mode : {model::TrainMode::kLora, model::TrainMode::kFull}) {
    for (Dtype d : kDtypes) {
      struct Run {
        float loss = 0;
        std::vector<float> grads, params;
      };
      auto run = [&](Ops& o) {
        Run r;
        auto gpt = model::Gpt::CreateRandom(c, mode, lora, 3, {&o, d});
        EXPECT_TRUE(gpt.ok()) << gpt.status().ToString();
        if (!gpt.ok()) return r;
        std::vector<Tensor> start = (*gpt)->ExportTrainable();
        std::mt19937 b_rng(11);
        for (Tensor& x : start) {  // B = 0 would leave A without gradient
          if (x.name.find("lora_B") != std::string::npos) {
            for (float& v : x.data) v = 0.02f * static_cast<float>(b_rng() % 7) - 0.06f;
          }
        }
        EXPECT_TRUE((*gpt)->LoadTrainable(start).ok());
        model::TrainerConfig tc;
        tc.warmup_steps = 0;
        tc.max_lr = 1e-3f;
        auto trainer = model::Trainer::Create(**gpt, tc);
        EXPECT_TRUE(trainer.ok()) << trainer.status().ToString();
        (*trainer)->SetGradHook([&](float* grads, size_t count) {
          r.grads.resize(count - 1);
          o.Download(r.grads.data(), grads, r.grads.size() * sizeof(float));
          return o.status();
        });
        auto st = (*trainer)->Step(tokens.data(), targets.data(), s.B, s.T);
        EXPECT_TRUE(st.ok()) << st.status().ToString();
        r.loss = st.ok() ? st->loss : NAN;
        for (const Tensor& x : (*gpt)->ExportTrainable()) {
          r.params.insert(r.params.end(), x.data.begin(), x.data.end());
        }
        return r;
      };
      const std::string what =
          std::string("step ") + model::TrainModeName(mode) + " " + DtypeName(d);
      const Run ref = run(CpuOps()), got = run(*ops_);
      ASSERT_TRUE(ops_->Synchronize().ok()) << ops_->status().ToString();
      ExpectClose(what + " loss", {got.loss}, {ref.loss}, Tol(d, 1e-5));
      // Gradients pass through every kernel twice (forward and backward).
      ExpectClose(what + " gradients", got.grads, ref.grads, d == Dtype::kF32 ? 1e-4 : 5e-2);
      // AdamW's first step moves every parameter by about lr in the direction of its
      // gradient's sign, so a gradient that is zero up to rounding may flip: compare the
      // parameters to within 2 lr, and require nearly all of them to agree closely.
      ASSERT_EQ(got.params.size(), ref.params.size());
      constexpr double kClose = 1e-5;  // 1% of the step
      size_t close = 0;
      double worst = 0;
      for (size_t i = 0; i < ref.params.size(); ++i) {
        const double diff = std::fabs(double(got.params[i]) - ref.params[i]);
        worst = std::max(worst, diff);
        close += diff <= kClose;
      }
      std::printf("  %-40s params within 1e-5: %zu of %zu, worst %.3g\n", what.c_str(), close,
                  ref.params.size(), worst);
      EXPECT_LE(worst, 2.05e-3) << what;
      EXPECT_GE(static_cast<double>(close), (d == Dtype::kF32 ? 0.99 : 0.9) * ref.params.size())
          << what;
    }
  }
}

}  // namespace isthmus::ops::conformance
