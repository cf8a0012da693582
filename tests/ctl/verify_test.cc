// isthmusctl sync verify's comparison on made-up digest replies: a removed site is reported
// with the round and epoch it left at and the remedy (exit 3), not as agreeing; a joined site
// is compared from the round it holds, with the epochs named; digests that differ within
// one membership are still a difference (exit 1); replies without a membership are compared
// as before.
#include <gtest/gtest.h>

#include "server/ctl/verify.h"

namespace isthmus::ctl {
namespace {

// Digests of rounds [from, to]: "common-r" up to `common_to`, "<tag>-r" after it.
std::vector<std::pair<uint64_t, std::string>> Digests(uint64_t from, uint64_t to,
                                                      uint64_t common_to, const std::string& tag) {
  std::vector<std::pair<uint64_t, std::string>> out;
  for (uint64_t r = from; r <= to; ++r) {
    out.emplace_back(r, (r <= common_to ? "common-" : tag + "-") + std::to_string(r));
  }
  return out;
}

DigestsInfo Info(const std::string& site, uint64_t committed, uint64_t epoch, uint64_t from,
                 std::vector<std::string> members) {
  DigestsInfo d;
  d.job = "job";
  d.site = site;
  d.committed_round = committed;
  d.has_members = true;
  d.epoch = epoch;
  d.members_from = from;
  d.members = std::move(members);
  return d;
}

std::string Text(const VerifyOutcome& v) {
  std::string out;
  for (const auto& l : v.lines) out += l + "\n";
  return out;
}

TEST(SyncVerify, ARemovedSiteIsReportedWithItsRoundAndEpochNotAsAgreeing) {
  // gamma was removed from round 3; alpha and beta went on to round 6. gamma, restarted,
  // still believes it is a member of epoch 0.
  DigestsInfo alpha = Info("alpha", 6, 1, 3, {"alpha", "beta"});
  alpha.digests = Digests(0, 6, 6, "members");
  alpha.removed = {{"gamma", 3}};
  DigestsInfo gamma = Info("gamma", 2, 0, 0, {"alpha", "beta", "gamma"});
  gamma.digests = Digests(0, 2, 2, "gamma");
  const VerifyOutcome v = CompareDigests(0, "job", {{"alpha", alpha}, {"gamma", gamma}});
  const std::string text = Text(v);
  EXPECT_EQ(v.kind, VerifyOutcome::kRemoved) << text;
  EXPECT_NE(text.find("shard 0 job job: site gamma is no longer a member: removed from round 3 "
                      "(site alpha stands at epoch 1, members alpha,beta from round 3)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("2 sites agree on rounds 0..2 (3 digests compared; epoch 0;"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("remedy: to compare the members on later rounds, run sync verify without "
                      "--site gamma"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("isthmusctl sync join --from alpha -j job"), std::string::npos) << text;
  EXPECT_EQ(v.row["removed"]["gamma"]["from_round"], 3);
  EXPECT_EQ(v.row["removed"]["gamma"]["epoch"], 1);
  EXPECT_EQ(v.row["removed"]["gamma"]["by"], "alpha");
  EXPECT_EQ(v.row["first_round"], 0);
  EXPECT_EQ(v.row["last_round"], 2);
  EXPECT_EQ(v.row["agree"], true);

  // The two members alone: they agree on every round, across the change.
  DigestsInfo beta = alpha;
  beta.site = "beta";
  const VerifyOutcome m = CompareDigests(0, "job", {{"alpha", alpha}, {"beta", beta}});
  EXPECT_EQ(m.kind, VerifyOutcome::kAgree) << Text(m);
  EXPECT_NE(Text(m).find("2 sites agree on rounds 0..6 (7 digests compared; epochs 0..1, epoch 1 "
                         "from round 3;"),
            std::string::npos)
      << Text(m);
}

TEST(SyncVerify, SitesThatCutEachOtherOffAreNotMembersRatherThanDiffering) {
  // Two sites; each removed the other from round 2 and committed round 2 alone.
  DigestsInfo alpha = Info("alpha", 2, 1, 2, {"alpha"});
  alpha.digests = Digests(0, 2, 1, "alpha");
  alpha.removed = {{"beta", 2}};
  DigestsInfo beta = Info("beta", 2, 1, 2, {"beta"});
  beta.digests = Digests(0, 2, 1, "beta");
  beta.removed = {{"alpha", 2}};
  const VerifyOutcome v = CompareDigests(1, "job", {{"alpha", alpha}, {"beta", beta}});
  const std::string text = Text(v);
  EXPECT_EQ(v.kind, VerifyOutcome::kRemoved) << text;
  EXPECT_NE(text.find("site beta is no longer a member: removed from round 2"), std::string::npos)
      << text;
  EXPECT_NE(text.find("site alpha is no longer a member: removed from round 2"), std::string::npos)
      << text;
  EXPECT_NE(text.find("2 sites agree on rounds 0..1"), std::string::npos) << text;
  EXPECT_EQ(text.find("DIFFER"), std::string::npos) << text;
}

TEST(SyncVerify, ASiteThatLeftSaysSoItself) {
  DigestsInfo gamma = Info("gamma", 2, 1, 3, {"alpha", "beta"});
  gamma.digests = Digests(0, 2, 2, "gamma");
  gamma.removed = {{"gamma", 3}};
  DigestsInfo alpha = Info("alpha", 2, 0, 0, {"alpha", "beta", "gamma"});  // not told yet
  alpha.digests = Digests(0, 2, 2, "alpha");
  const VerifyOutcome v = CompareDigests(0, "job", {{"alpha", alpha}, {"gamma", gamma}});
  EXPECT_EQ(v.kind, VerifyOutcome::kRemoved) << Text(v);
  EXPECT_NE(Text(v).find("site gamma is no longer a member: it left from round 3"),
            std::string::npos)
      << Text(v);
}

TEST(SyncVerify, AJoinedSiteIsComparedFromTheRoundItHoldsWithTheEpochsNamed) {
  // delta joined with the state of round 3 and merges from round 4 (epoch 1).
  const std::vector<std::string> members = {"alpha", "beta", "delta", "gamma"};
  DigestsInfo alpha = Info("alpha", 5, 1, 4, members);
  alpha.digests = Digests(0, 5, 5, "x");
  alpha.joined = {{"delta", 4}};
  DigestsInfo delta = Info("delta", 5, 1, 4, members);
  delta.digests = Digests(3, 5, 5, "x");
  delta.joined = {{"delta", 4}};
  const VerifyOutcome v = CompareDigests(0, "job", {{"alpha", alpha}, {"delta", delta}});
  const std::string text = Text(v);
  EXPECT_EQ(v.kind, VerifyOutcome::kAgree) << text;
  EXPECT_NE(text.find("2 sites agree on rounds 3..5 (3 digests compared; epochs 0..1, epoch 1 "
                      "from round 4; committed: alpha 5, delta 5)"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("rounds 0.."), std::string::npos) << "delta holds no round before 3\n"
                                                        << text;
  EXPECT_NE(text.find("rounds before 3 are not compared: site delta holds none (it joined from "
                      "round 4)"),
            std::string::npos)
      << text;
  EXPECT_EQ(v.row["first_round"], 3);
  EXPECT_EQ(v.row["last_round"], 5);
  EXPECT_EQ(v.row["rounds_compared"], 3);
  EXPECT_EQ(v.row["epochs"]["first"], 0);
  EXPECT_EQ(v.row["epochs"]["last"], 1);
  EXPECT_EQ(v.row["joined"]["delta"], 4);
}

TEST(SyncVerify, DigestsThatDifferWithinOneMembershipAreADifference) {
  DigestsInfo alpha = Info("alpha", 4, 0, 0, {"alpha", "beta"});
  alpha.digests = Digests(0, 4, 1, "alpha");
  DigestsInfo beta = Info("beta", 3, 0, 0, {"alpha", "beta"});
  beta.digests = Digests(0, 3, 1, "beta");
  const VerifyOutcome v = CompareDigests(0, "job", {{"alpha", alpha}, {"beta", beta}});
  const std::string text = Text(v);
  EXPECT_EQ(v.kind, VerifyOutcome::kDiffer) << text;
  EXPECT_NE(text.find("shard 0 job job: DIFFER at round 2 (rounds 0..2; epoch 0)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("  alpha        alpha-2"), std::string::npos) << text;
  EXPECT_EQ(v.row["first_differing_round"], 2);
  EXPECT_EQ(v.row["digests"]["beta"], "beta-2");
}

TEST(SyncVerify, RepliesWithoutAMembershipAreComparedAsBefore) {
  DigestsInfo a, b;
  a.committed_round = 2;
  a.digests = Digests(0, 2, 2, "a");
  b.committed_round = 3;
  b.digests = Digests(0, 3, 2, "b");
  const VerifyOutcome v = CompareDigests(0, "job", {{"alpha", a}, {"beta", b}});
  EXPECT_EQ(v.kind, VerifyOutcome::kAgree) << Text(v);
  EXPECT_NE(Text(v).find("2 sites agree on rounds 0..2 (3 digests compared; epochs not reported"),
            std::string::npos)
      << Text(v);
  EXPECT_TRUE(v.row["epoch"].is_null());
}

}  // namespace
}  // namespace isthmus::ctl
