// The digest of a committed state (see digest.h): common/state_digest.h over the shard's
// tensors, the one definition a worker that replays rounds uses too.
#include "server/sync/digest.h"

#include "common/state_digest.h"

namespace isthmus {

namespace {

std::string DigestOf(uint64_t round, const std::map<std::string, SyncTensor>& theta,
                     const std::map<std::string, std::shared_ptr<const std::vector<float>>>& m,
                     const Membership& members, DigestKind kind) {
  std::vector<DigestTensor> tensors;
  tensors.reserve(theta.size());
  for (const auto& [name, t] : theta) {
    DigestTensor d{name, t.shape, *t.data, {}};
    auto it = m.find(name);
    if (it != m.end() && it->second) d.momentum = *it->second;
    tensors.push_back(d);
  }
  return StateDigestOf(round, tensors, members.epoch, members.from_round, members.sites, kind);
}

}  // namespace

std::string StateDigest(uint64_t round, const std::map<std::string, SyncTensor>& theta,
                        const std::map<std::string, std::shared_ptr<const std::vector<float>>>& m,
                        const Membership& members) {
  return DigestOf(round, theta, m, members, DigestKind::kSha256);
}

std::string StateCheck(uint64_t round, const std::map<std::string, SyncTensor>& theta,
                       const std::map<std::string, std::shared_ptr<const std::vector<float>>>& m,
                       const Membership& members) {
  return DigestOf(round, theta, m, members, DigestKind::kCheck);
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
