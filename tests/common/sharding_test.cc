// Tensor placement: deterministic, balanced, independent of input order.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "common/sharding.h"

namespace isthmus {
namespace {

TEST(ShardingTest, BalancedAndOrderIndependent) {
  std::vector<TensorSize> t;
  for (int i = 0; i < 40; ++i)
    t.push_back({"t" + std::to_string(i), uint64_t(1000 + 37 * (i % 7))});
  auto a = AssignTensorsToShards(t, 4);
  std::map<std::string, int> by_name;
  std::vector<uint64_t> load(4, 0);
  for (size_t i = 0; i < t.size(); ++i) {
    by_name[t[i].name] = a[i];
    ASSERT_GE(a[i], 0);
    ASSERT_LT(a[i], 4);
    load[a[i]] += t[i].bytes;
  }
  auto [lo, hi] = std::minmax_element(load.begin(), load.end());
  EXPECT_LE(*hi - *lo, 1222u);  // within the largest single tensor
  std::reverse(t.begin(), t.end());
  auto b = AssignTensorsToShards(t, 4);
  for (size_t i = 0; i < t.size(); ++i) EXPECT_EQ(b[i], by_name[t[i].name]);
}

TEST(ShardingTest, OneShardOwnsEverything) {
  auto a = AssignTensorsToShards({{"x", 5}, {"y", 7}}, 1);
  EXPECT_EQ(a, (std::vector<int>{0, 0}));
}

}  // namespace
}  // namespace isthmus
