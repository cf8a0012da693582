// Incremental SHA-256 (OpenSSL), for content digests of files and buffers.
#pragma once

#include <openssl/evp.h>

#include <array>
#include <cstddef>
#include <memory>
#include <string>

namespace isthmus {

class Sha256 {
 public:
  Sha256();
  void Update(const void* p, size_t n);
  // Ends the digest; call once.
  std::array<unsigned char, 32> Digest();
  // Digest() as 64 lower-case hex digits.
  std::string HexDigest();

 private:
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx_;
};

}  // namespace isthmus
