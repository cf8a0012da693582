// SHA-256 over a committed state (state_digest.h), with OpenSSL's EVP interface; the fast
// check with xxHash's XXH3-128, compiled in from its header (no library at run time).
#include "common/state_digest.h"

#include <openssl/evp.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace isthmus {
namespace {

void PutU64(std::string& out, uint64_t v) {
  for (int i = 7; i >= 0; --i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutStr(std::string& out, std::string_view s) {
  PutU64(out, s.size());
  out.append(s);
}

}  // namespace

struct StateDigester::Xxh3 {
  XXH3_state_t state;
};

StateDigester::StateDigester(uint64_t round, DigestKind kind) {
  if (kind == DigestKind::kCheck) {
    xxh_ = new Xxh3;
    XXH3_128bits_reset(&xxh_->state);
  } else {
    ctx_ = EVP_MD_CTX_new();
    EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr);
  }
  std::string head;
  PutU64(head, round);
  Update(head.data(), head.size());
}

StateDigester::~StateDigester() {
  if (ctx_ != nullptr) EVP_MD_CTX_free(ctx_);
  delete xxh_;
}

void StateDigester::Update(const void* p, size_t n) {
  if (xxh_ != nullptr) {
    XXH3_128bits_update(&xxh_->state, p, n);
  } else {
    EVP_DigestUpdate(ctx_, p, n);
  }
}

void StateDigester::Add(const DigestTensor& t) {
  std::string head;
  PutStr(head, t.name);
  PutU64(head, t.shape.size());
  for (int64_t d : t.shape) PutU64(head, static_cast<uint64_t>(d));
  Update(head.data(), head.size());
  Update(t.theta.data(), t.theta.size_bytes());
  if (!t.momentum.empty()) Update(t.momentum.data(), t.momentum.size_bytes());
}

std::string StateDigester::Finish(uint64_t epoch, uint64_t from_round,
                                  const std::vector<std::string>& sites) {
  std::string tail;
  PutU64(tail, epoch);
  PutU64(tail, from_round);
  PutU64(tail, sites.size());
  for (const auto& s : sites) PutStr(tail, s);
  Update(tail.data(), tail.size());
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (xxh_ != nullptr) {
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(&xxh_->state));
    len = sizeof(c.digest);
    for (unsigned int i = 0; i < len; ++i) md[i] = c.digest[i];
  } else {
    EVP_DigestFinal_ex(ctx_, md, &len);
  }
  static const char* kHex = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) {
    hex.push_back(kHex[md[i] >> 4]);
    hex.push_back(kHex[md[i] & 15]);
  }
  return hex;
}

std::string StateDigestOf(uint64_t round, const std::vector<DigestTensor>& tensors, uint64_t epoch,
                          uint64_t from_round, const std::vector<std::string>& sites,
                          DigestKind kind) {
  StateDigester d(round, kind);
  for (const auto& t : tensors) d.Add(t);
  return d.Finish(epoch, from_round, sites);
}

}  // namespace isthmus
