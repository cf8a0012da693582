// The digest of a committed state: how sites (and `isthmusctl sync verify`) check that they
// committed bitwise the same thing, and how a joining or catching-up site checks the state a
// member hands it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "server/storage/records.h"
#include "server/sync/membership.h"

namespace isthmus {

// A tensor of a job as the shard holds it. `data` is shared, never mutated.
struct SyncTensor {
  std::vector<int64_t> shape;
  std::shared_ptr<const std::vector<float>> data;
};

// SHA-256 (hex) of a committed state: round, then for each tensor in name order its name,
// shape, theta bytes and momentum bytes (momentum omitted when null), then the membership
// the round was committed under (epoch, first round, sites).
std::string StateDigest(uint64_t round, const std::map<std::string, SyncTensor>& theta,
                        const std::map<std::string, std::shared_ptr<const std::vector<float>>>& m,
                        const Membership& members);

// The fast check of the same state (DigestKind::kCheck), which a worker that replays
// committed rounds checks its copy with.
std::string StateCheck(uint64_t round, const std::map<std::string, SyncTensor>& theta,
                       const std::map<std::string, std::shared_ptr<const std::vector<float>>>& m,
                       const Membership& members);

// StateDigest of a member's image (its tensors, momentum where present, round and
// membership): equal to image.digest when the image is what the member committed.
std::string ImageDigest(const JobImage& image);

}  // namespace isthmus
