// The codec byte format: encoders for the sparsify/quantise/zstd pipeline and the low-rank
// codec, and the one decoder that reads them back from the network. Everything is
// single-threaded with a fixed operation order, so bytes and floats are bitwise
// reproducible across machines. Layout documented in docs/CODECS.md.
#include <zstd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "ops/codec.h"

#include "common/check.h"

#include "common/varint.h"

namespace isthmus::codec {
namespace {

constexpr uint8_t kMagic0 = 'I';
constexpr uint8_t kMagic1 = 'C';
constexpr uint8_t kVersion = 2;
constexpr uint8_t kKindPlain = 0;
constexpr uint8_t kKindLowRank = 1;
constexpr uint8_t kKindDeferred = 2;  // no body: zeros (pipeline "defer")
constexpr size_t kFixedHeader = 5;    // magic (2), version, kind, flags; varints follow
// Plain flags byte: bits 0-1 sparsifier, bits 2-3 width code, bit 4 body is zstd-compressed.
constexpr uint8_t kFlagZstd = 1u << 4;
constexpr uint8_t kFlagsReserved = 0xe0;
constexpr uint32_t kMaxBlock = 1u << 20;
constexpr uint32_t kMaxRank = 256;
constexpr float kClamp = 1e30f;
constexpr uint64_t kLowRankSeed = 0x6973746d75730001ull;  // "istmus" + 1

// ---- little-endian byte helpers -------------------------------------------------------

void PutU8(std::string* s, uint8_t v) { s->push_back(static_cast<char>(v)); }
void PutU32(std::string* s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutF32(std::string* s, float v) { PutU32(s, std::bit_cast<uint32_t>(v)); }
uint32_t LoadU32(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}
float LoadF32(const uint8_t* p) { return std::bit_cast<float>(LoadU32(p)); }

// A bounds-checked reader over untrusted bytes.
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  size_t remaining() const { return n_ - pos_; }
  const uint8_t* here() const { return p_ + pos_; }
  bool Skip(size_t k) {
    if (k > remaining()) return false;
    pos_ += k;
    return true;
  }
  bool Varint(uint64_t* v) {
    const uint8_t* at = p_ + pos_;
    if (!ReadVarint(&at, p_ + n_, v)) return false;
    pos_ = static_cast<size_t>(at - p_);
    return true;
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

Status Bad(const std::string& what) { return Status::InvalidArgument("codec: " + what); }

// ---- plain pipeline -------------------------------------------------------------------

uint32_t QMax(uint32_t bits) { return (1u << (bits - 1)) - 1; }  // 127, 7, 1

constexpr uint32_t kWidths[4] = {32, 8, 4, 2};  // indexed by the flags' 2-bit width code
uint8_t WidthCode(uint32_t bits) { return bits == 8 ? 1 : bits == 4 ? 2 : bits == 2 ? 3 : 0; }

void PutFixedHeader(std::string* s, uint8_t kind, uint8_t flags) {
  PutU8(s, kMagic0);
  PutU8(s, kMagic1);
  PutU8(s, kVersion);
  PutU8(s, kind);
  PutU8(s, flags);
}

uint64_t ValuesBytes(uint64_t nnz, uint32_t bits, uint32_t qblock) {
  if (bits == 32) return 4 * nnz;
  return 4 * ((nnz + qblock - 1) / qblock) + (nnz * bits + 7) / 8;
}

// Whether Sanitize changes f: not finite or beyond the clamp (NaN compares false).
inline bool Unsanitary(float f) { return !(std::fabs(f) <= kClamp); }

// Whether x needs Sanitize.
bool NeedsSanitize(std::span<const float> x) {
  bool bad = false;
  for (float f : x) bad |= Unsanitary(f);
  return bad;
}

std::vector<float> Sanitize(std::span<const float> x) {
  std::vector<float> v(x.begin(), x.end());
  for (float& f : v) {
    if (!std::isfinite(f)) f = 0.0f;
    f = std::clamp(f, -kClamp, kClamp);
  }
  return v;
}

// Top-k selects on a strided sample first when there are at least this many values and k
// is at most a quarter of them; kSamples values make the sample.
constexpr uint64_t kSampleFrom = uint64_t{1} << 16;
constexpr uint64_t kSamples = 4096;

// The j-th largest of m, j in [1, m.size()] (m is reordered).
float KthLargest(std::vector<float>& m, uint64_t j) {
  std::nth_element(m.begin(), m.begin() + static_cast<ptrdiff_t>(j - 1), m.end(),
                   std::greater<float>());
  return m[j - 1];
}

// A magnitude below the k-th largest of x[0, n) with high probability: the one a few
// standard deviations of the sample's rank below the k-th in a strided sample. `mag` is
// scratch.
float SampledLowerBound(const float* x, uint64_t n, uint64_t k, std::vector<float>& mag) {
  const uint64_t stride = n / kSamples;
  mag.resize(kSamples);
  for (uint64_t i = 0; i < kSamples; ++i) mag[i] = std::fabs(x[i * stride]);
  const double expect =
      static_cast<double>(k) * static_cast<double>(kSamples) / static_cast<double>(n);
  const auto rank =
      std::min<uint64_t>(kSamples, static_cast<uint64_t>(expect + 4.0 * std::sqrt(expect)) + 16);
  return KthLargest(mag, rank);
}

// Appends to `at` the positions i of x[0, n) with |x[i]| >= lo, ascending: one pass, without
// a branch per value (each block's positions are written unconditionally and counted by the
// comparison).
void PositionsAtLeast(const float* x, uint64_t n, float lo, std::vector<uint32_t>* at) {
  constexpr uint64_t kBlock = 4096;
  uint32_t block[kBlock];
  for (uint64_t b = 0; b < n; b += kBlock) {
    const uint64_t e = std::min(n, b + kBlock);
    size_t c = 0;
    for (uint64_t i = b; i < e; ++i) {
      block[c] = static_cast<uint32_t>(i);
      c += std::fabs(x[i]) >= lo;
    }
    at->insert(at->end(), block, block + c);
  }
}

// Sorted indices of the kept entries of v[begin, end): the k largest magnitudes, ties going
// to the lower index ("largest magnitude first, lower index on ties", a strict total order,
// so the set does not depend on the selection algorithm). Found through the k-th largest
// magnitude T: every entry above T is kept, and of those equal to T the lowest-indexed ones
// up to k.
//
// On a large tensor with k at most a quarter of it, one pass over the values finds the
// candidates, the positions whose magnitude reaches a bound from a strided sample
// (SampledLowerBound), and everything after runs on the candidates alone: when at least k
// reach the bound, the k-th largest among them is the k-th largest of all, and every entry
// at or above it is a candidate, so the set is the one a selection over all values gives and
// does not depend on the sample. When fewer reach it (a sample that missed the large
// values), the selection runs on every value, as for a small tensor.
void SelectTopK(std::span<const float> v, uint64_t begin, uint64_t end, uint64_t k,
                std::vector<uint64_t>* kept) {
  ISTHMUS_CHECK(end - begin <= UINT32_MAX, "top-k over more than 4G elements");
  const uint64_t n = end - begin;
  const float* x = v.data() + begin;
  if (k >= n) {
    for (uint64_t i = 0; i < n; ++i) kept->push_back(begin + i);
    return;
  }
  if (k == 0) return;
  std::vector<float> mag;
  std::vector<uint32_t> cand;
  if (n >= kSampleFrom && k <= n / 4) {
    const float lo = SampledLowerBound(x, n, k, mag);
    cand.reserve(static_cast<size_t>(std::min<uint64_t>(n, 2 * k + 1024)));
    PositionsAtLeast(x, n, lo, &cand);
    if (cand.size() < k) cand.clear();
  }
  // What is kept is chosen among `cand` if there are candidates, else among all values.
  const bool among_cand = !cand.empty();
  const uint64_t m = among_cand ? cand.size() : n;
  auto at = [&](uint64_t j) { return among_cand ? uint64_t{cand[j]} : j; };
  mag.resize(m);
  for (uint64_t j = 0; j < m; ++j) mag[j] = std::fabs(x[at(j)]);
  const float t = KthLargest(mag, k);
  uint64_t above = 0;
  for (uint64_t j = 0; j < m; ++j) above += std::fabs(x[at(j)]) > t;
  uint64_t ties = k - above;  // entries equal to t to keep, lowest index first
  for (uint64_t j = 0; j < m; ++j) {
    const uint64_t i = at(j);
    const float a = std::fabs(x[i]);
    if (a > t) {
      kept->push_back(begin + i);
    } else if (a == t && ties > 0) {
      kept->push_back(begin + i);
      --ties;
    }
  }
}

uint64_t KeepCount(double density, uint64_t n) {
  if (n == 0) return 0;
  uint64_t k = static_cast<uint64_t>(std::ceil(density * static_cast<double>(n)));
  return std::clamp<uint64_t>(k, 1, n);
}

// Scale of one quantisation block. int8/int4: max|v| / qmax, so no value clips. int2
// (ternary {-s, 0, s}): one Lloyd step from the mean magnitude, a far smaller error than
// max|v| on the flat-magnitude values top-k leaves behind.
float BlockScale(const float* v, size_t n, uint32_t bits) {
  if (bits != 2) {
    float m = 0.0f;
    for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(v[i]));
    return m / static_cast<float>(QMax(bits));
  }
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) sum += std::fabs(v[i]);
  const double s0 = sum / static_cast<double>(n);
  double sum1 = 0.0;
  size_t n1 = 0;
  for (size_t i = 0; i < n; ++i) {
    if (std::fabs(v[i]) >= 0.5 * s0) {
      sum1 += std::fabs(v[i]);
      ++n1;
    }
  }
  return n1 ? static_cast<float>(sum1 / static_cast<double>(n1)) : 0.0f;
}

void PutValues(std::string* s, std::span<const float> vals, uint32_t bits, uint32_t qblock) {
  if (bits == 32) {
    for (float f : vals) PutF32(s, f);
    return;
  }
  const size_t n = vals.size();
  const int qmax = static_cast<int>(QMax(bits));
  const uint32_t mask = (1u << bits) - 1;
  std::vector<float> scales;
  for (size_t b = 0; b < n; b += qblock)
    scales.push_back(BlockScale(&vals[b], std::min<size_t>(qblock, n - b), bits));
  for (float sc : scales) PutF32(s, sc);
  std::string codes((n * bits + 7) / 8, '\0');
  for (size_t i = 0; i < n; ++i) {
    const float sc = scales[i / qblock];
    int q = 0;
    if (sc > 0.0f) {
      q = static_cast<int>(std::nearbyint(vals[i] / sc));  // round half to even
      q = std::clamp(q, -qmax, qmax);
    }
    const size_t bit = i * bits;
    codes[bit / 8] = static_cast<char>(static_cast<uint8_t>(codes[bit / 8]) |
                                       ((static_cast<uint32_t>(q) & mask) << (bit % 8)));
  }
  s->append(codes);
}

std::string EncodePlain(const Pipeline& p, std::span<const float> v) {
  const uint64_t numel = v.size();
  std::vector<uint64_t> kept;
  if (p.sparsifier == Sparsifier::kTopK) {
    const uint64_t k = KeepCount(p.density, numel);
    kept.reserve(k);
    SelectTopK(v, 0, numel, k, &kept);
  } else if (p.sparsifier == Sparsifier::kBlockTopK) {
    const uint64_t b = std::max<uint32_t>(p.sparse_block, 1);
    // Reserved once (each block's count rounds up): reserving per block would copy the
    // kept indices again at every block.
    kept.reserve(KeepCount(p.density, numel) + numel / b + 1);
    for (uint64_t start = 0; start < numel; start += b) {
      const uint64_t end = std::min(numel, start + b);
      SelectTopK(v, start, end, KeepCount(p.density, end - start), &kept);
    }
  }
  const bool sparse = p.sparsifier != Sparsifier::kNone;
  const uint64_t nnz = sparse ? kept.size() : numel;
  const uint32_t bits = p.bits;
  const uint32_t qblock = bits == 32 ? 0 : std::clamp<uint32_t>(p.quant_block, 1, kMaxBlock);

  std::string body;
  std::vector<float> vals;
  if (sparse) {
    vals.reserve(nnz);
    uint64_t next = 0;  // the lowest index the next entry may have
    for (uint64_t i : kept) {
      PutVarint(&body, i - next);
      next = i + 1;
      vals.push_back(v[i]);
    }
  }
  PutValues(&body, sparse ? vals : v, bits, qblock);

  std::string header;
  const bool block_sparse = p.sparsifier == Sparsifier::kBlockTopK;
  uint8_t flags = static_cast<uint8_t>(static_cast<uint8_t>(p.sparsifier) | WidthCode(bits) << 2);
  PutVarint(&header, numel);
  if (sparse) PutVarint(&header, nnz);
  if (bits != 32) PutVarint(&header, qblock);
  if (block_sparse) PutVarint(&header, p.sparse_block);

  std::string out;
  if (p.zstd && !body.empty()) {
    // zstd is tried and kept only if frame plus its length varint beat the raw body: on
    // small tensors the frame header often costs more than entropy coding saves.
    std::string frame(ZSTD_compressBound(body.size()), '\0');
    // One context per thread, reused: creating one per call dominates small tensors' cost.
    thread_local std::unique_ptr<ZSTD_CCtx, size_t (*)(ZSTD_CCtx*)> cctx(ZSTD_createCCtx(),
                                                                         ZSTD_freeCCtx);
    const size_t z = ZSTD_compressCCtx(cctx.get(), frame.data(), frame.size(), body.data(),
                                       body.size(), p.zstd_level);
    // Only fails on a too-small destination, which the bound rules out.
    ISTHMUS_CHECK(!ZSTD_isError(z), std::string("zstd: ") + ZSTD_getErrorName(z));
    frame.resize(z);
    std::string raw_len;
    PutVarint(&raw_len, body.size());
    if (raw_len.size() + frame.size() < body.size()) {
      out.reserve(kFixedHeader + header.size() + raw_len.size() + frame.size());
      PutFixedHeader(&out, kKindPlain, flags | kFlagZstd);
      out += header;
      out += raw_len;
      out += frame;
      return out;
    }
  }
  out.reserve(kFixedHeader + header.size() + body.size());
  PutFixedHeader(&out, kKindPlain, flags);
  out += header;
  out += body;
  return out;
}

// Where a decode goes: `numel` values written to `out`, or with `add_w` *add_w times each
// stored value added to them (a sparse encoding's unstored values are zeros: nothing to
// add); with `out` null, nowhere: the encoding is only validated (Check).
struct Target {
  float* out = nullptr;
  uint64_t numel = 0;
  const float* add_w = nullptr;
};
Target Into(std::span<float> out, const float* add_w = nullptr) {
  return {out.data(), out.size(), add_w};
}

// Decodes a plain (kind 0) encoding to `to` (already checked: the encoded element count is
// to.numel). `hdr` stands after the numel varint. Writes only after everything validated.
Status DecodePlain(uint8_t flags, Reader hdr, const Target& to) {
  const uint64_t numel = to.numel;
  const uint8_t sparsifier = flags & 3;
  const uint32_t bits = kWidths[(flags >> 2) & 3];
  const bool zstd = flags & kFlagZstd;
  if (sparsifier > 2) return Bad("unknown sparsifier " + std::to_string(sparsifier));
  if (flags & kFlagsReserved) return Bad("bad flags");
  const bool sparse = sparsifier != 0;
  uint64_t nnz = numel, qblock = 0, sparse_block = 0;
  if (sparse && !hdr.Varint(&nnz)) return Bad("bad nonzero count varint");
  if (bits != 32 && !hdr.Varint(&qblock)) return Bad("bad quantisation block varint");
  if (sparsifier == 2 && !hdr.Varint(&sparse_block)) return Bad("bad sparsifier block varint");
  if (bits != 32 && (qblock == 0 || qblock > kMaxBlock))
    return Bad("bad quantisation block " + std::to_string(qblock));
  if (sparsifier == 2 && (sparse_block == 0 || sparse_block > kMaxBlock))
    return Bad("bad sparsifier block " + std::to_string(sparse_block));
  if (nnz > numel)
    return Bad("bad nonzero count " + std::to_string(nnz) + " of " + std::to_string(numel));

  const uint64_t value_bytes = ValuesBytes(nnz, bits, static_cast<uint32_t>(qblock));
  const uint64_t min_index_bytes = sparse ? nnz : 0;
  const uint64_t max_index_bytes = sparse ? 10 * nnz : 0;
  const uint8_t* body = hdr.here();
  size_t body_size = hdr.remaining();
  std::string inflated;
  if (zstd) {
    uint64_t raw = 0;
    if (!hdr.Varint(&raw)) return Bad("bad uncompressed size varint");
    if (raw < min_index_bytes + value_bytes || raw > max_index_bytes + value_bytes)
      return Bad("implausible uncompressed size " + std::to_string(raw));
    const uint8_t* frame = hdr.here();
    const size_t frame_size = hdr.remaining();
    const unsigned long long content = ZSTD_getFrameContentSize(frame, frame_size);
    if (content != raw) return Bad("zstd frame size does not match header");
    const size_t compressed = ZSTD_findFrameCompressedSize(frame, frame_size);
    if (ZSTD_isError(compressed) || compressed != frame_size)
      return Bad("zstd frame does not span the section");
    inflated.resize(raw);
    thread_local std::unique_ptr<ZSTD_DCtx, size_t (*)(ZSTD_DCtx*)> dctx(ZSTD_createDCtx(),
                                                                         ZSTD_freeDCtx);
    const size_t got = ZSTD_decompressDCtx(dctx.get(), inflated.data(), raw, frame, frame_size);
    if (ZSTD_isError(got) || got != raw) return Bad("zstd frame does not decompress");
    body = reinterpret_cast<const uint8_t*>(inflated.data());
    body_size = inflated.size();
  }

  Reader r(body, body_size);
  std::vector<uint64_t> idx;
  if (sparse) {
    idx.resize(nnz);
    uint64_t next = 0;
    for (uint64_t k = 0; k < nnz; ++k) {
      uint64_t gap = 0;
      if (!r.Varint(&gap)) return Bad("bad sparse index varint");
      if (next >= numel || gap >= numel - next) return Bad("sparse index out of range");
      idx[k] = next + gap;
      next = idx[k] + 1;
    }
  }
  if (r.remaining() != value_bytes) return Bad("value section has the wrong size");
  const uint8_t* vb = r.here();
  std::vector<float> vals(nnz);
  if (bits == 32) {
    for (uint64_t k = 0; k < nnz; ++k) {
      vals[k] = LoadF32(vb + 4 * k);
      if (!std::isfinite(vals[k])) return Bad("non-finite value");
    }
  } else {
    const uint64_t nblocks = (nnz + qblock - 1) / qblock;
    const float qmax = static_cast<float>(QMax(bits));
    std::vector<float> scales(nblocks);
    for (uint64_t b = 0; b < nblocks; ++b) {
      scales[b] = LoadF32(vb + 4 * b);
      if (!std::isfinite(scales[b]) || scales[b] < 0.0f || !std::isfinite(scales[b] * qmax))
        return Bad("bad block scale");
    }
    const uint8_t* codes = vb + 4 * nblocks;
    const uint32_t mask = (1u << bits) - 1;
    const uint32_t sign = 1u << (bits - 1);
    for (uint64_t k = 0; k < nnz; ++k) {
      const uint64_t bit = k * bits;
      const uint32_t c = (codes[bit / 8] >> (bit % 8)) & mask;
      if (c == sign) return Bad("reserved quantisation code");
      const int q =
          c & sign ? static_cast<int>(c) - static_cast<int>(1u << bits) : static_cast<int>(c);
      vals[k] = static_cast<float>(q) * scales[k / qblock];
    }
    const uint64_t used_bits = nnz * bits;
    if (used_bits % 8 != 0 && (codes[used_bits / 8] >> (used_bits % 8)) != 0)
      return Bad("non-zero padding bits");
  }

  float* out = to.out;
  if (out == nullptr) return Status::Ok();
  if (to.add_w != nullptr) {
    const float w = *to.add_w;
    if (sparse) {
      for (uint64_t k = 0; k < nnz; ++k) out[idx[k]] += w * vals[k];
    } else {
      for (uint64_t k = 0; k < nnz; ++k) out[k] += w * vals[k];
    }
  } else if (sparse) {
    std::fill(out, out + numel, 0.0f);
    for (uint64_t k = 0; k < nnz; ++k) out[idx[k]] = vals[k];
  } else {
    std::copy(vals.begin(), vals.end(), out);
  }
  return Status::Ok();
}

// ---- low-rank (PowerSGD-style) --------------------------------------------------------

uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

bool LowRankApplies(uint32_t rank, std::span<const int64_t> shape) {
  if (rank == 0 || shape.size() != 2 || shape[0] <= 0 || shape[1] <= 0) return false;
  const uint64_t rows = static_cast<uint64_t>(shape[0]), cols = static_cast<uint64_t>(shape[1]);
  return uint64_t{rank} * (rows + cols) * 2 <= rows * cols;
}

// The factors' pipeline: the rest of p without low-rank or sparsifier.
Pipeline FactorPipeline(const Pipeline& p) {
  Pipeline f = p;
  f.lowrank_rank = 0;
  f.sparsifier = Sparsifier::kNone;
  f.density = 1.0;
  f.sparse_block = 0;
  return f;
}

// Returns false (and the caller falls back) if the factors are not finite.
bool EncodeLowRank(const Pipeline& p, std::span<const float> m, uint64_t rows, uint64_t cols,
                   std::string* out) {
  const uint64_t r = p.lowrank_rank;
  // Q0 (cols x r): deterministic uniform(-1, 1) from the shape, rank and a fixed seed.
  uint64_t state = kLowRankSeed ^ (rows * 0x100000001b3ull) ^ (cols << 20) ^ r;
  std::vector<double> q0(cols * r);
  for (double& q : q0) q = static_cast<double>(SplitMix64(&state) >> 11) * 0x1p-52 - 1.0;
  // P = M Q0 (rows x r), then orthonormalise its columns (modified Gram-Schmidt).
  std::vector<double> pm(rows * r, 0.0);
  for (uint64_t i = 0; i < rows; ++i)
    for (uint64_t j = 0; j < cols; ++j) {
      const double mij = m[i * cols + j];
      for (uint64_t k = 0; k < r; ++k) pm[i * r + k] += mij * q0[j * r + k];
    }
  for (uint64_t k = 0; k < r; ++k) {
    for (uint64_t l = 0; l < k; ++l) {
      double dot = 0.0;
      for (uint64_t i = 0; i < rows; ++i) dot += pm[i * r + k] * pm[i * r + l];
      for (uint64_t i = 0; i < rows; ++i) pm[i * r + k] -= dot * pm[i * r + l];
    }
    double norm = 0.0;
    for (uint64_t i = 0; i < rows; ++i) norm += pm[i * r + k] * pm[i * r + k];
    norm = std::sqrt(norm);
    const double inv = norm > 1e-30 ? 1.0 / norm : 0.0;
    for (uint64_t i = 0; i < rows; ++i) pm[i * r + k] *= inv;
  }
  const Pipeline fp = FactorPipeline(p);
  std::vector<float> pf(pm.begin(), pm.end());
  const std::string p_bytes = EncodePlain(fp, pf);
  // Q = M^T P_hat with P_hat what the receiver decodes, so Q absorbs P's quantisation error.
  std::vector<float> p_hat(pf.size());
  if (!Decode(p_bytes, p_hat).ok()) return false;
  std::vector<double> qm(cols * r, 0.0);
  for (uint64_t i = 0; i < rows; ++i)
    for (uint64_t j = 0; j < cols; ++j) {
      const double mij = m[i * cols + j];
      for (uint64_t k = 0; k < r; ++k) qm[j * r + k] += mij * p_hat[i * r + k];
    }
  std::vector<float> qf(qm.size());
  for (size_t i = 0; i < qm.size(); ++i) {
    qf[i] = static_cast<float>(qm[i]);
    if (!std::isfinite(qf[i])) return false;
  }
  const std::string q_bytes = EncodePlain(fp, qf);

  out->clear();
  PutFixedHeader(out, kKindLowRank, 0);
  PutVarint(out, rows * cols);
  PutVarint(out, rows);
  PutVarint(out, r);
  PutVarint(out, p_bytes.size());
  *out += p_bytes;
  *out += q_bytes;
  return true;
}

Status DecodeAny(std::string_view bytes, const Target& to, bool allow_lowrank);

// `hdr` stands after the numel varint (already checked: the encoded element count is
// to.numel).
Status DecodeLowRank(uint8_t flags, Reader hdr, const Target& to) {
  if (flags != 0) return Bad("bad low-rank flags");
  uint64_t rows = 0, rank = 0, len_p = 0;
  if (!hdr.Varint(&rows) || !hdr.Varint(&rank) || !hdr.Varint(&len_p))
    return Bad("truncated low-rank header");
  const uint64_t numel = to.numel;
  if (rows == 0 || numel % rows != 0) return Bad("low-rank shape does not match the element count");
  const uint64_t cols = numel / rows;
  if (rank == 0 || rank > kMaxRank || rank * (rows + cols) * 2 > numel)
    return Bad("bad low-rank rank " + std::to_string(rank));
  if (len_p > hdr.remaining()) return Bad("low-rank factor length out of range");
  const char* base = reinterpret_cast<const char*>(hdr.here());
  std::vector<float> pf(rows * rank), qf(cols * rank);
  ISTHMUS_RETURN_IF_ERROR(DecodeAny(std::string_view(base, len_p), Into(pf), false));
  ISTHMUS_RETURN_IF_ERROR(
      DecodeAny(std::string_view(base + len_p, hdr.remaining() - len_p), Into(qf), false));
  // M = P Q^T in a fixed order (double accumulation, k ascending).
  std::vector<float> m(numel);
  for (uint64_t i = 0; i < rows; ++i)
    for (uint64_t j = 0; j < cols; ++j) {
      double acc = 0.0;
      for (uint64_t k = 0; k < rank; ++k)
        acc += static_cast<double>(pf[i * rank + k]) * static_cast<double>(qf[j * rank + k]);
      const float f = static_cast<float>(acc);
      if (!std::isfinite(f)) return Bad("low-rank product is not finite");
      m[i * cols + j] = f;
    }
  float* out = to.out;
  if (out == nullptr) return Status::Ok();
  if (to.add_w != nullptr) {
    const float w = *to.add_w;
    for (uint64_t i = 0; i < numel; ++i) out[i] += w * m[i];
  } else {
    std::copy(m.begin(), m.end(), out);
  }
  return Status::Ok();
}

Status DecodeAny(std::string_view bytes, const Target& to, bool allow_lowrank) {
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  const size_t size = bytes.size();
  if (size < kFixedHeader) return Bad("truncated header (" + std::to_string(size) + " bytes)");
  if (data[0] != kMagic0 || data[1] != kMagic1) return Bad("bad magic");
  if (data[2] != kVersion)
    return Bad("unsupported format version " + std::to_string(data[2]) + " (this decoder reads " +
               std::to_string(kVersion) + " only; upgrade the sender)");
  Reader hdr(data + kFixedHeader, size - kFixedHeader);
  uint64_t numel = 0;
  if (!hdr.Varint(&numel)) return Bad("bad element count varint");
  if (numel != to.numel)
    return Bad("encoded " + std::to_string(numel) + " elements, expected " +
               std::to_string(to.numel));
  if (data[3] == kKindPlain) return DecodePlain(data[4], hdr, to);
  if (data[3] == kKindLowRank && allow_lowrank) return DecodeLowRank(data[4], hdr, to);
  if (data[3] == kKindDeferred) {
    if (data[4] != 0 || hdr.remaining() != 0) return Bad("deferred encoding with flags or a body");
    if (to.out != nullptr && to.add_w == nullptr) std::fill(to.out, to.out + numel, 0.0f);
    return Status::Ok();
  }
  return Bad("unknown encoding kind " + std::to_string(data[3]));
}

// Encode with the caller's answer to NeedsSanitize(x).
std::string EncodeChecked(const Pipeline& p, std::span<const float> x,
                          std::span<const int64_t> shape, bool needs_sanitize) {
  if (p.defer) {
    std::string out;
    PutFixedHeader(&out, kKindDeferred, 0);
    PutVarint(&out, x.size());
    return out;
  }
  // Only a tensor with values to sanitize is copied.
  std::vector<float> sanitized;
  std::span<const float> v = x;
  if (needs_sanitize) {
    sanitized = Sanitize(x);
    v = sanitized;
  }
  if (LowRankApplies(p.lowrank_rank, shape) &&
      static_cast<uint64_t>(shape[0]) * static_cast<uint64_t>(shape[1]) == v.size()) {
    std::string out;
    if (EncodeLowRank(p, v, static_cast<uint64_t>(shape[0]), static_cast<uint64_t>(shape[1]), &out))
      return out;
  }
  Pipeline rest = p;
  rest.lowrank_rank = 0;
  return EncodePlain(rest, v);
}

}  // namespace

std::string Encode(const Pipeline& p, std::span<const float> x, std::span<const int64_t> shape) {
  return EncodeChecked(p, x, shape, !p.defer && NeedsSanitize(x));
}

Status Decode(std::string_view bytes, std::span<float> out) {
  return DecodeAny(bytes, Into(out), true);
}

Status Check(std::string_view bytes, uint64_t numel) {
  return DecodeAny(bytes, Target{nullptr, numel, nullptr}, true);
}

Status DecodeAddWeighted(std::string_view bytes, float w, std::span<float> out) {
  return DecodeAny(bytes, Into(out, &w), true);
}

bool IsDeferred(std::string_view bytes) {
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  return bytes.size() >= kFixedHeader && data[0] == kMagic0 && data[1] == kMagic1 &&
         data[2] == kVersion && data[3] == kKindDeferred;
}

std::string EncodeWithFeedback(const Pipeline& p, std::span<const float> delta,
                               std::span<const int64_t> shape, std::span<float> residual,
                               std::span<float> decoded) {
  return EncodeWithFeedback(p, delta, shape, residual, residual, decoded);
}

std::string EncodeWithFeedback(const Pipeline& p, std::span<const float> delta,
                               std::span<const int64_t> shape, std::span<const float> residual_in,
                               std::span<float> residual_out, std::span<float> decoded) {
  ISTHMUS_CHECK(residual_in.size() == delta.size() && residual_out.size() == delta.size() &&
                    (decoded.empty() || decoded.size() == delta.size()),
                "residuals and decoded must be the delta's size");
  // v = delta + residual lives in residual_out until the residual replaces it (the same
  // operations as with a separate v), checked for values to sanitize in the same pass.
  float* v = residual_out.data();
  bool bad = false;
  for (size_t i = 0; i < delta.size(); ++i) {
    v[i] = delta[i] + residual_in[i];
    bad |= Unsanitary(v[i]);
  }
  std::string q = EncodeChecked(p, residual_out, shape, bad);
  if (decoded.empty()) {
    // residual = v - decoded without the decoded tensor: v + (-1 * stored value) where the
    // encoding stores a value, and v where it does not (v - (+0.0) is v). Bit for bit the
    // subtraction below, which a sparse encoding would pay a zeroed tensor and a whole pass
    // for.
    const float minus_one = -1.0f;
    const Status st = DecodeAny(q, Into(residual_out, &minus_one), true);
    ISTHMUS_CHECK(st.ok(), "our own encoding did not decode: " + st.ToString());
    return q;
  }
  const Status st = Decode(q, decoded);
  ISTHMUS_CHECK(st.ok(), "our own encoding did not decode: " + st.ToString());
  for (size_t i = 0; i < delta.size(); ++i) v[i] = v[i] - decoded[i];
  return q;
}

void RecomputeResidual(std::span<float> residual, std::span<const float> delta,
                       std::span<const float> decoded) {
  ISTHMUS_CHECK(residual.size() == delta.size() && decoded.size() == delta.size(),
                "residual, delta and decoded must have one size");
  float* v = residual.data();
  for (size_t i = 0; i < delta.size(); ++i) v[i] = delta[i] + v[i];
  for (size_t i = 0; i < delta.size(); ++i) v[i] = v[i] - decoded[i];
}

}  // namespace isthmus::codec
