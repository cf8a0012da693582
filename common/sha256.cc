#include "common/sha256.h"

#include <cstdlib>

namespace isthmus {

Sha256::Sha256() : ctx_(EVP_MD_CTX_new(), EVP_MD_CTX_free) {
  // Fails only when out of memory; nothing sensible remains to do then.
  if (!ctx_ || EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) != 1) std::abort();
}

void Sha256::Update(const void* p, size_t n) { EVP_DigestUpdate(ctx_.get(), p, n); }

std::array<unsigned char, 32> Sha256::Digest() {
  std::array<unsigned char, 32> d{};
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx_.get(), d.data(), &len);
  return d;
}

std::string Sha256::HexDigest() {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned char c : Digest()) {
    hex.push_back(kHex[c >> 4]);
    hex.push_back(kHex[c & 0xf]);
  }
  return hex;
}

}  // namespace isthmus
