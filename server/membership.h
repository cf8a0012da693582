// A sync job's membership (docs/SYNC.md, "Membership"): which sites merge their deltas into
// which rounds. It is committed state, versioned by an epoch and changed only at a round
// boundary, by a change that every site of the new set agreed to (two phases over the peer
// links: prepare, then apply). These are the plain types the engine stores and the links
// carry; the rules live in the sync engine.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace isthmus {

// "From round `from_round` on, rounds commit with the deltas of exactly `sites`."
struct Membership {
  uint64_t epoch = 0;              // 0: the sites the job started with
  std::vector<std::string> sites;  // sorted, distinct
  uint64_t from_round = 0;         // first round merged over `sites` (0: from the start)
  bool operator==(const Membership&) const = default;
  bool Has(const std::string& site) const;
  std::string SiteList() const;  // "a,b,c"
};

// A membership change under way: the membership it makes, and the site coordinating it.
struct MembershipChange {
  Membership next;
  std::string coordinator;
  bool operator==(const MembershipChange&) const = default;
  // "remove gamma from round 4 (epoch 1), coordinated by alpha", against `current`.
  std::string Describe(const Membership& current) const;
};

// One membership request between two sites' shards, for one job. kPrepare: the coordinator
// asks a site of the new membership to agree (and hold its commits at the boundary until the
// outcome is known). kQuery: a site that agreed asks the coordinator for the outcome.
// A joining site (not yet holding the job) sends: kJoin, asking a member to coordinate its
// addition (`change.next.sites` = the joining site); kFetch, asking the coordinator for the
// committed state the addition starts from; kDigest, asking any member for its digest of
// that round.
enum class MembershipStep { kPrepare, kQuery, kJoin, kFetch, kDigest };
struct MembershipRequest {
  std::string job;
  MembershipStep step = MembershipStep::kPrepare;
  MembershipChange change;
};

// kPrepared: agreed, and holding. kApplied: the change is in effect there. kPending: (to a
// query) not decided yet. kRefused: no, for `reason`; nothing changed there. kAbandoned: (to a
// query) the coordinator gave the change up.
enum class MembershipVote { kPrepared, kApplied, kPending, kRefused, kAbandoned };

// A job's committed state at one round, as a member hands it to a joining site.
struct ImageTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::shared_ptr<const std::vector<float>> theta;
  std::shared_ptr<const std::vector<float>> momentum;  // null when no momentum is kept
};
struct JobImage {
  uint64_t round = 0;    // the committed round
  std::string digest;    // its digest, as the member stores it
  Membership members;    // the membership that round was committed under
  uint64_t version = 0;  // the member's served version
  std::string base_hash;
  std::vector<ImageTensor> tensors;  // name order
};

struct MembershipAnswer {
  MembershipVote vote = MembershipVote::kRefused;
  std::string reason;
  std::string digest = {};                          // kDigest: the round's digest
  std::shared_ptr<const JobImage> image = nullptr;  // kFetch
};
const char* MembershipVoteName(MembershipVote v);
const char* MembershipStepName(MembershipStep s);

}  // namespace isthmus
