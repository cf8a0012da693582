// A sync job's membership (docs/SYNC.md, "Membership"): which sites merge their deltas into
// which rounds. It is committed state, versioned by an epoch and changed only at a round
// boundary, by a change that every site of the new set agreed to (two phases over the peer
// links: prepare, then apply). These are the plain types the engine stores and the links
// carry; the rules live in the sync engine.
#pragma once

#include <cstdint>
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
enum class MembershipStep { kPrepare, kQuery };
struct MembershipRequest {
  std::string job;
  MembershipStep step = MembershipStep::kPrepare;
  MembershipChange change;
};

// kPrepared: agreed, and holding. kApplied: the change is in effect there. kPending: (to a
// query) not decided yet. kRefused: no, for `reason`; nothing changed there. kAbandoned: (to a
// query) the coordinator gave the change up.
enum class MembershipVote { kPrepared, kApplied, kPending, kRefused, kAbandoned };
struct MembershipAnswer {
  MembershipVote vote = MembershipVote::kRefused;
  std::string reason;
};
const char* MembershipVoteName(MembershipVote v);

}  // namespace isthmus
