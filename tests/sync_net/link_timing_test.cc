// Unit tests of the peer links' timing rules (server/sync/peer_link.h): how long bytes in flight
// may go unanswered, and how acks become bandwidth samples. Pure, so no shaped link needed.
#include <gtest/gtest.h>

#include "server/sync/peer_link.h"

namespace isthmus {
namespace {

using Clock = BandwidthMeter::Clock;
using std::chrono::milliseconds;

TEST(LinkTimingTest, BudgetGrowsWithBytesInFlightAtTheMeasuredRate) {
  // Nothing in flight: just the timeout.
  EXPECT_EQ(InFlightBudgetMs(2000, 0, 25000, 16384), 2000);
  // 4 x 130 KB at 25 KB/s need 20.8 s; the budget allows twice that.
  EXPECT_EQ(InFlightBudgetMs(2000, 4 * 130000, 25000, 16384), 2000 + 41600);
  // No estimate yet: the floor stands in (130 KB at 16 KB/s, twice).
  EXPECT_EQ(InFlightBudgetMs(2000, 130000, 0, 16000), 2000 + 16250);
  // A fast link adds almost nothing, so a dead fast peer is still caught quickly.
  EXPECT_LT(InFlightBudgetMs(2000, 130000, 1e9, 16384), 2001);
}

TEST(LinkTimingTest, PipelinedDeltasAreTimedFromWhenTheLinkWasFree) {
  BandwidthMeter meter(64 * 1024, 0.3);
  Clock::time_point t0{};
  meter.Restart(t0);
  // Four 100 KB deltas sent at once over a 25 KB/s link: acks at 4, 8, 12, 16 s.
  std::vector<double> samples;
  for (int i = 1; i <= 4; ++i) {
    auto s = meter.OnAck(t0 + milliseconds(1), t0 + milliseconds(1 + 4000 * i), 100000, false);
    ASSERT_TRUE(s.has_value()) << i;
    samples.push_back(*s);
  }
  for (double s : samples) EXPECT_NEAR(s, 25000, 50);
}

TEST(LinkTimingTest, AnAckReadLateDoesNotInflateTheEstimate) {
  BandwidthMeter meter(64 * 1024, 0.3);
  Clock::time_point t0{};
  meter.Restart(t0);
  // 100 KB deltas at 25 KB/s, all queued at t0; the acks of the 2nd and 4th are read
  // 3.9 s late, together with the next one (a busy event loop).
  std::optional<double> est;
  for (int i : {4000, 11900, 12000, 19900, 20000}) {
    est = meter.OnAck(t0, t0 + milliseconds(i), 100000, false);
  }
  ASSERT_TRUE(est.has_value());
  // The rate of the last pool alone would be 100 KB / 0.1 s = 1 MB/s.
  EXPECT_LT(*est, 40000);
  EXPECT_GT(*est, 15000);
}

TEST(LinkTimingTest, SmallIdleTransfersGiveNoSample) {
  BandwidthMeter meter(64 * 1024, 0.3);
  Clock::time_point t0{};
  meter.Restart(t0);
  // 2.5 KB deltas passing on the shaper's burst in 1 ms each, 10 s apart: no sample,
  // however many there are (each starts a new busy period that ends short).
  for (int i = 1; i <= 50; ++i) {
    auto sent = t0 + milliseconds(10000 * i);
    EXPECT_FALSE(meter.OnAck(sent, sent + milliseconds(1), 2500, false).has_value()) << i;
  }
}

TEST(LinkTimingTest, SmallBackToBackTransfersArePooled) {
  BandwidthMeter meter(64 * 1024, 0.3);
  Clock::time_point t0{};
  meter.Restart(t0);
  // 40 deltas of 2 KB, all queued at t0, drained at 20 KB/s (one ack every 100 ms).
  std::optional<double> last;
  int count = 0;
  for (int i = 1; i <= 40; ++i) {
    auto s = meter.OnAck(t0, t0 + milliseconds(100 * i), 2000, false);
    if (s) {
      last = s;
      ++count;
    }
  }
  ASSERT_EQ(count, 1);  // 80 KB in all: one pool of 66 KB, the rest still pooling
  EXPECT_NEAR(*last, 20000, 1);
}

TEST(LinkTimingTest, ResentDeltasGiveNoSampleAndVoidThePool) {
  BandwidthMeter meter(64 * 1024, 0.3);
  Clock::time_point t0{};
  meter.Restart(t0);
  EXPECT_FALSE(meter.OnAck(t0, t0 + milliseconds(100), 130000, true).has_value());
  // Queued behind the resend, 40 KB + 40 KB: timed from the resend's ack only.
  EXPECT_FALSE(meter.OnAck(t0, t0 + milliseconds(2100), 40000, false).has_value());
  auto s = meter.OnAck(t0, t0 + milliseconds(4100), 40000, false);
  ASSERT_TRUE(s.has_value());
  EXPECT_NEAR(*s, 20000, 1);
}

TEST(LinkTimingTest, RestartForgetsThePool) {
  BandwidthMeter meter(64 * 1024, 0.3);
  Clock::time_point t0{};
  meter.Restart(t0);
  EXPECT_FALSE(meter.OnAck(t0, t0 + milliseconds(1000), 40000, false).has_value());
  meter.Restart(t0 + milliseconds(5000));
  // The first 40 KB are gone: 40 KB more make no sample on their own.
  EXPECT_FALSE(
      meter.OnAck(t0 + milliseconds(5000), t0 + milliseconds(7000), 40000, false).has_value());
}

}  // namespace
}  // namespace isthmus
