// SHA-256 over a committed state (see digest.h), with OpenSSL's EVP interface.
#include "server/sync/digest.h"

#include <openssl/evp.h>

#include <string_view>

#include "server/storage/keys.h"

namespace isthmus {
namespace {

void PutU64(std::string& out, uint64_t v) { out += keys::BigEndian64(v); }
void PutStr(std::string& out, std::string_view s) {
  PutU64(out, s.size());
  out.append(s);
}
std::string_view FloatBytes(const std::vector<float>& v) {
  return {reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float)};
}

}  // namespace

std::string StateDigest(uint64_t round, const std::map<std::string, SyncTensor>& theta,
                        const std::map<std::string, std::shared_ptr<const std::vector<float>>>& m,
                        const Membership& members) {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  auto update = [&](std::string_view s) { EVP_DigestUpdate(ctx, s.data(), s.size()); };
  update(keys::BigEndian64(round));
  for (const auto& [name, t] : theta) {
    std::string head;
    PutStr(head, name);
    PutU64(head, t.shape.size());
    for (int64_t d : t.shape) PutU64(head, static_cast<uint64_t>(d));
    update(head);
    update(FloatBytes(*t.data));
    auto it = m.find(name);
    if (it != m.end() && it->second) update(FloatBytes(*it->second));
  }
  std::string tail;
  PutU64(tail, members.epoch);
  PutU64(tail, members.from_round);
  PutU64(tail, members.sites.size());
  for (const auto& s : members.sites) PutStr(tail, s);
  update(tail);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx, md, &len);
  EVP_MD_CTX_free(ctx);
  static const char* kHex = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) {
    hex.push_back(kHex[md[i] >> 4]);
    hex.push_back(kHex[md[i] & 15]);
  }
  return hex;
}

std::string ImageDigest(const JobImage& image) {
  std::map<std::string, SyncTensor> theta;
  std::map<std::string, std::shared_ptr<const std::vector<float>>> momentum;
  for (const auto& t : image.tensors) {
    theta[t.name] = SyncTensor{t.shape, t.theta};
    if (t.momentum) momentum[t.name] = t.momentum;
  }
  return StateDigest(image.round, theta, momentum, image.members);
}

}  // namespace isthmus
