// `isthmusctl sync verify`, the comparison: the committed-round digests and memberships of
// one shard index and one job as every site's shard reported them (DigestsReply), and what
// follows from them: the rounds every site holds under one membership, whether their digests
// agree there, which site is no longer a member (removed or left) and from which round, and
// the epochs the compared rounds were committed under. Pure, so that tests can feed it made-up
// replies; main.cc fetches the digests and prints. docs/CLI.md, "sync verify".
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/client.h"

namespace isthmus::ctl {

// One site's answer: `name` as given with --site; its digests and membership.
struct VerifySite {
  std::string name;
  DigestsInfo digests;
};

struct VerifyOutcome {
  enum Kind {
    kAgree,    // every compared round agrees (also when no round could be compared)
    kDiffer,   // a compared round differs: exit 1
    kRemoved,  // every compared round agrees, but a site is no longer a member: exit 3
  };
  Kind kind = kAgree;
  nlohmann::json row;              // the --json object of this shard and job
  std::vector<std::string> lines;  // the text, one string per line
};

// Compares the sites' digests of `job` on shard `shard`. The rounds compared are those from
// the first round every site holds (a site that joined holds none before the round it joined
// at) up to the lowest committed round, and, when a site is no longer a member by any site's
// record (it was removed or left from round N), only those before N: rounds from N on were
// merged without it. Rounds some site lacks inside that range (a catch-up skips rounds) are
// not compared.
VerifyOutcome CompareDigests(size_t shard, const std::string& job,
                             const std::vector<VerifySite>& sites);

}  // namespace isthmus::ctl
