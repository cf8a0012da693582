// Pipelined (common/pipelined.h): the two passes give what they give one after the other,
// consume sees each item only once produce finished it, and a failure stops both.
#include "common/pipelined.h"

#include <gtest/gtest.h>

#include <atomic>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/state_digest.h"

namespace isthmus {
namespace {

TEST(Pipelined, ConsumesEveryItemInOrderAfterItIsProduced) {
  for (size_t n : {0u, 1u, 2u, 7u, 200u}) {
    std::vector<std::vector<int>> items(n);
    std::vector<size_t> order;
    std::atomic<size_t> produced{0};
    long sum = 0;
    Status st = Pipelined(
        n,
        [&](size_t i) {
          items[i].assign(1000, static_cast<int>(i));
          produced = i + 1;
          return Status::Ok();
        },
        [&](size_t i) {
          EXPECT_GT(produced.load(), i);  // handed over only once produced
          order.push_back(i);
          sum += std::accumulate(items[i].begin(), items[i].end(), 0L);
        });
    ASSERT_TRUE(st.ok()) << st.ToString();
    std::vector<size_t> want(n);
    std::iota(want.begin(), want.end(), 0);
    EXPECT_EQ(order, want) << "n " << n;
    long expect = 0;
    for (size_t i = 0; i < n; ++i) expect += 1000L * static_cast<long>(i);
    EXPECT_EQ(sum, expect);
  }
}

TEST(Pipelined, AFailureStopsBothPassesAndIsReturned) {
  for (size_t fail_at : {0u, 1u, 5u, 9u}) {
    std::vector<size_t> produced_calls, consumed;
    Status st = Pipelined(
        10,
        [&](size_t i) {
          produced_calls.push_back(i);
          if (i == fail_at) return Status::FailedPrecondition("item " + std::to_string(i));
          return Status::Ok();
        },
        [&](size_t i) { consumed.push_back(i); });
    EXPECT_EQ(st.code(), Code::kFailedPrecondition);
    EXPECT_EQ(st.message(), "item " + std::to_string(fail_at));
    std::vector<size_t> want_produced(fail_at + 1), want_consumed(fail_at);
    std::iota(want_produced.begin(), want_produced.end(), 0);
    std::iota(want_consumed.begin(), want_consumed.end(), 0);
    EXPECT_EQ(produced_calls, want_produced) << "nothing after the failure is produced";
    EXPECT_EQ(consumed, want_consumed) << "only what was produced before it is consumed";
  }
}

TEST(Pipelined, AnExceptionFromProduceStopsTheHelperAndGoesUp) {
  std::vector<size_t> consumed;
  EXPECT_THROW(Pipelined(
                   10,
                   [&](size_t i) -> Status {
                     if (i == 3) throw std::runtime_error("out of memory");
                     return Status::Ok();
                   },
                   [&](size_t i) { consumed.push_back(i); }),
               std::runtime_error);
  // Joined before the throw left Pipelined: what was handed over is consumed, nothing else.
  EXPECT_EQ(consumed, (std::vector<size_t>{0, 1, 2}));
}

// The digest fed tensor by tensor from the pipeline equals the one over the whole state,
// for the SHA-256 digest and for the fast check alike.
class PipelinedDigest : public ::testing::TestWithParam<DigestKind> {};

TEST_P(PipelinedDigest, AStateHashedAsItIsProducedHasTheStateDigest) {
  const DigestKind kind = GetParam();
  const std::vector<std::string> names = {"a.w", "b.w", "c.bias"};
  const std::vector<std::vector<int64_t>> shapes = {{3, 5}, {7}, {2, 2}};
  std::vector<std::vector<float>> theta(3), momentum(3);
  StateDigester d(42, kind);
  Status st = Pipelined(
      3,
      [&](size_t i) {
        const size_t n = static_cast<size_t>(
            std::accumulate(shapes[i].begin(), shapes[i].end(), 1L, std::multiplies<>()));
        for (size_t k = 0; k < n; ++k) {
          theta[i].push_back(0.25f * static_cast<float>(k) - static_cast<float>(i));
          momentum[i].push_back(static_cast<float>(k * i) * 1e-3f);
        }
        if (i == 1) momentum[i].clear();  // a tensor without momentum hashes without it
        return Status::Ok();
      },
      [&](size_t i) {
        d.Add({names[i], shapes[i], theta[i], momentum[i]});
      });
  ASSERT_TRUE(st.ok());
  const std::string piped = d.Finish(3, 2, {"alpha", "beta"});
  std::vector<DigestTensor> all;
  for (size_t i = 0; i < 3; ++i) all.push_back({names[i], shapes[i], theta[i], momentum[i]});
  EXPECT_EQ(piped, StateDigestOf(42, all, 3, 2, {"alpha", "beta"}, kind));
  // Hex: 32 bytes of SHA-256, 16 of XXH3-128; the two kinds never agree.
  EXPECT_EQ(piped.size(), kind == DigestKind::kSha256 ? 64u : 32u);
  const DigestKind other = kind == DigestKind::kSha256 ? DigestKind::kCheck : DigestKind::kSha256;
  EXPECT_NE(piped.substr(0, 32),
            StateDigestOf(42, all, 3, 2, {"alpha", "beta"}, other).substr(0, 32));
  // Any change of a value, the round or the membership changes it.
  EXPECT_NE(piped, StateDigestOf(43, all, 3, 2, {"alpha", "beta"}, kind));
  EXPECT_NE(piped, StateDigestOf(42, all, 3, 2, {"alpha"}, kind));
  momentum[0][1] += 1e-3f;
  EXPECT_NE(piped, StateDigestOf(42, all, 3, 2, {"alpha", "beta"}, kind));
  momentum[0][1] -= 1e-3f;
  EXPECT_EQ(piped, StateDigestOf(42, all, 3, 2, {"alpha", "beta"}, kind));
  theta[2][3] = -0.0f;
  EXPECT_NE(piped, StateDigestOf(42, all, 3, 2, {"alpha", "beta"}, kind));
}

INSTANTIATE_TEST_SUITE_P(Kinds, PipelinedDigest,
                         ::testing::Values(DigestKind::kSha256, DigestKind::kCheck),
                         [](const auto& info) {
                           return info.param == DigestKind::kSha256 ? "Sha256" : "FastCheck";
                         });

}  // namespace
}  // namespace isthmus
