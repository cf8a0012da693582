// Membership's plain helpers (see membership.h).
#include "server/membership.h"

#include <algorithm>

namespace isthmus {

bool Membership::Has(const std::string& site) const {
  return std::binary_search(sites.begin(), sites.end(), site);
}

std::string Membership::SiteList() const {
  std::string out;
  for (const auto& s : sites) out += (out.empty() ? "" : ",") + s;
  return out;
}

std::string MembershipChange::Describe(const Membership& current) const {
  std::string what;
  for (const auto& s : current.sites) {
    if (!next.Has(s)) what += (what.empty() ? "remove " : ", remove ") + s;
  }
  for (const auto& s : next.sites) {
    if (!current.Has(s)) what += (what.empty() ? "add " : ", add ") + s;
  }
  if (what.empty()) what = "keep " + next.SiteList();
  return what + " from round " + std::to_string(next.from_round) + " (epoch " +
         std::to_string(next.epoch) + "), coordinated by " + coordinator;
}

const char* MembershipStepName(MembershipStep s) {
  switch (s) {
    case MembershipStep::kPrepare:
      return "prepare";
    case MembershipStep::kQuery:
      return "query";
    case MembershipStep::kJoin:
      return "join";
    case MembershipStep::kFetch:
      return "fetch";
    case MembershipStep::kDigest:
      return "digest";
  }
  return "?";
}

const char* MembershipVoteName(MembershipVote v) {
  switch (v) {
    case MembershipVote::kPrepared:
      return "prepared";
    case MembershipVote::kApplied:
      return "applied";
    case MembershipVote::kPending:
      return "pending";
    case MembershipVote::kRefused:
      return "refused";
    case MembershipVote::kAbandoned:
      return "abandoned";
  }
  return "?";
}

}  // namespace isthmus
