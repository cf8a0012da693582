// TensorPool: buffers come back only when their last reference goes, the limit holds, and
// buffers released on other threads are handed out whole (run under TSan and ASan in CI).
#include "server/sync/tensor_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace isthmus {
namespace {

TEST(TensorPool, ABufferComesBackOnlyWhenItsLastReferenceGoes) {
  auto pool = TensorPool::Create(1 << 20);
  auto a = pool->Take(100);
  const float* where = a->data();
  std::fill(a->begin(), a->end(), 3.0f);
  auto b = a;  // a reader still holds it
  a.reset();
  EXPECT_EQ(pool->stats().held_bytes, 0u);
  auto fresh = pool->Take(100);
  EXPECT_NE(fresh->data(), where);  // not the buffer still held
  EXPECT_EQ((*b)[99], 3.0f);
  b.reset();
  EXPECT_EQ(pool->stats().held_bytes, 400u);
  auto again = pool->Take(100);
  EXPECT_EQ(again->data(), where);
  EXPECT_EQ(pool->stats().recycled, 1u);
  EXPECT_EQ(pool->stats().taken, 3u);
  auto other = pool->Take(50);  // another size: not that buffer
  EXPECT_EQ(pool->stats().recycled, 1u);
  fresh.reset();
  auto zeroed = pool->TakeZeroed(100);
  ASSERT_EQ(zeroed->size(), 100u);
  for (float v : *zeroed) ASSERT_EQ(v, 0.0f);
}

TEST(TensorPool, TheLimitHoldsAndAShrunkLimitDropsBuffers) {
  auto pool = TensorPool::Create(1000);
  auto a = pool->Take(200);  // 800 bytes
  auto b = pool->Take(200);
  a.reset();
  b.reset();  // would make 1600: freed
  EXPECT_EQ(pool->stats().held_bytes, 800u);
  pool->Reserve({10, 20});  // 40 + 80 more: 920
  EXPECT_EQ(pool->stats().held_bytes, 920u);
  pool->Reserve({100});  // 400 more would pass the limit
  EXPECT_EQ(pool->stats().held_bytes, 920u);
  pool->SetLimit(150);  // the largest go first
  EXPECT_EQ(pool->stats().held_bytes, 120u);
  auto c = pool->Take(20);
  EXPECT_EQ(pool->stats().recycled, 1u);
  EXPECT_EQ(pool->stats().held_bytes, 40u);
}

TEST(TensorPool, ABufferMayOutliveItsPool) {
  auto pool = TensorPool::Create(1 << 20);
  auto a = pool->Take(64);
  (*a)[63] = 1.0f;
  pool.reset();
  EXPECT_EQ((*a)[63], 1.0f);
  a.reset();  // freed, no pool to go back to
}

TEST(TensorPool, BuffersReleasedOnOtherThreadsAreHandedOutWhole) {
  auto pool = TensorPool::Create(64 * 1024);
  constexpr int kThreads = 4;
  constexpr int kRounds = 300;
  std::atomic<int> torn{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::pair<std::shared_ptr<std::vector<float>>, float>> kept;
      for (int r = 0; r < kRounds; ++r) {
        const size_t n = 256 + 256 * (r % 3);
        auto v = pool->Take(n);
        const float mark = static_cast<float>(t * kRounds + r);
        std::fill(v->begin(), v->end(), mark);
        kept.emplace_back(std::move(v), mark);
        if (kept.size() == 3) {
          // No other taker may have written into a buffer this thread still holds.
          for (const auto& [k, m] : kept) {
            if (std::any_of(k->begin(), k->end(), [m = m](float x) { return x != m; })) ++torn;
          }
          kept.clear();
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(torn.load(), 0);
  const auto s = pool->stats();
  EXPECT_EQ(s.taken, static_cast<uint64_t>(kThreads * kRounds));
  EXPECT_GT(s.recycled, 0u);
  EXPECT_LE(s.held_bytes, 64u * 1024);
}

}  // namespace
}  // namespace isthmus
