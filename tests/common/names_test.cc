// The name rules of common/names.h: sites, shard ids and tensor names beside the job rule,
// and how an error message quotes a hostile name.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/names.h"

namespace isthmus {
namespace {

TEST(NamesTest, SitesFollowTheJobRuleAndShardIdsAllowTwiceTheLength) {
  for (const std::string& ok :
       std::vector<std::string>{"A", "siteA", "eu-west.1", "a_b", std::string(64, 's')}) {
    EXPECT_TRUE(IsValidSiteName(ok)) << ok;
  }
  for (const std::string& bad :
       std::vector<std::string>{"", "../../etc", "a/b", ".hidden", "a b", "a\nb",
                                std::string("a\0b", 3), std::string(65, 's')}) {
    EXPECT_FALSE(IsValidSiteName(bad)) << PrintableName(bad);
  }
  EXPECT_TRUE(IsValidShardId(std::string(64, 's') + "-999"));
  EXPECT_TRUE(IsValidShardId(std::string(128, 'i')));
  EXPECT_FALSE(IsValidShardId(std::string(129, 'i')));
  EXPECT_FALSE(IsValidShardId("shard\t0"));
  EXPECT_FALSE(IsValidShardId(""));
}

TEST(NamesTest, TensorNamesMayNotClimbOutOfAFolderOrHoldControlCharacters) {
  for (const std::string& ok :
       std::vector<std::string>{"w", "base_model.model.h.0.attn.c_attn.lora_A.weight", "layer/0/w",
                                "a..b", "x/...", "Zürich", std::string(512, 'n')}) {
    EXPECT_TRUE(IsValidTensorName(ok)) << ok;
  }
  for (const std::string& bad : std::vector<std::string>{
           "", "../x", "a/../b", "a/..", "..", ".", "./x", "a/./b", "/etc/x",
           std::string("a\0b", 3), "a\nb", "tab\there", "del\x7f", std::string(513, 'n')}) {
    EXPECT_FALSE(IsValidTensorName(bad)) << PrintableName(bad);
  }
}

TEST(NamesTest, PrintableNameEscapesControlCharactersAndCutsLongNames) {
  EXPECT_EQ(PrintableName("plain-name"), "plain-name");
  EXPECT_EQ(PrintableName(std::string("a\0b\n\\", 5)), "a\\x00b\\x0a\\x5c");
  const std::string huge(1 << 20, 'x');
  EXPECT_EQ(PrintableName(huge), std::string(64, 'x') + "...(1048576 bytes)");
}

}  // namespace
}  // namespace isthmus
