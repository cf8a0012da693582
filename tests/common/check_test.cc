// Release-build invariant checks and Status-returning number parsing (common/check.h).
#include <gtest/gtest.h>

#include "common/check.h"

namespace isthmus {
namespace {

TEST(ParseNumbers, AcceptWholeDecimalsAndRefuseTheRestNamingTheField) {
  EXPECT_EQ(*ParseInt64("12", "round"), 12);
  EXPECT_EQ(*ParseInt64("-7", "x"), -7);
  EXPECT_EQ(*ParseUint64("18446744073709551615", "x"), UINT64_MAX);
  for (const char* bad : {"", "12abc", " 12", "1e9", "0x10", "9223372036854775808", "--1"}) {
    auto r = ParseInt64(bad, "checkpoint round");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_NE(r.status().message().find("checkpoint round"), std::string::npos);
  }
  EXPECT_FALSE(ParseUint64("-1", "x").ok());
  EXPECT_FALSE(ParseUint64("18446744073709551616", "x").ok());
}

TEST(CheckDeathTest, AFailedCheckNamesFileConditionAndMessageAndAborts) {
  const int n = 3;
  EXPECT_DEATH(ISTHMUS_CHECK(n == 4, "n must be 4"),
               "check_test.cc:[0-9]+: check failed: n == 4: n must be 4");
  ISTHMUS_CHECK(n == 3, "never printed");  // a holding check does nothing
}

}  // namespace
}  // namespace isthmus
