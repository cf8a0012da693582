// The exposition text, histograms, address parsing and the HTTP endpoint of
// common/metrics.h, without a shard or a worker.
#include "common/metrics.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>

#include "tests/loopback.h"
#include "tests/metrics/scrape.h"

namespace isthmus::metrics {
namespace {

using isthmus::testing::PromtoolCheck;
using isthmus::testing::Scrape;
using isthmus::testing::Value;

TEST(MetricsText, FamiliesHaveHelpAndTypeOnceAndLabelsAreEscaped) {
  TextWriter w;
  w.Begin("isthmus_x_total", Type::kCounter, "Things.\nMore \\ things.");
  w.Sample({{"op", "push"}}, 3);
  w.Sample({{"op", "say \"hi\"\n\\"}}, 4.5);
  w.Begin("isthmus_x_total", Type::kCounter, "again");  // the same family continues
  w.Sample({{"op", "pull"}}, 1e20);
  w.Single("isthmus_y", Type::kGauge, "A gauge.", NAN);
  EXPECT_EQ(w.text(),
            "# HELP isthmus_x_total Things.\\nMore \\\\ things.\n"
            "# TYPE isthmus_x_total counter\n"
            "isthmus_x_total{op=\"push\"} 3\n"
            "isthmus_x_total{op=\"say \\\"hi\\\"\\n\\\\\"} 4.5\n"
            "isthmus_x_total{op=\"pull\"} 1e+20\n"
            "# HELP isthmus_y A gauge.\n"
            "# TYPE isthmus_y gauge\n"
            "isthmus_y NaN\n");
  EXPECT_EQ(FormatValue(INFINITY), "+Inf");
  EXPECT_EQ(FormatValue(-INFINITY), "-Inf");
  EXPECT_EQ(FormatValue(0.25), "0.25");
  EXPECT_EQ(FormatValue(-7), "-7");
}

TEST(MetricsText, HistogramBucketsAreCumulativeWithSumAndCount) {
  Histogram h({0.1, 1, 10});
  for (double v : {0.05, 0.1, 0.5, 2.0, 50.0, double{NAN}}) h.Observe(v);  // NaN is not counted
  TextWriter w;
  w.Begin("isthmus_push_seconds", Type::kHistogram, "Durations.");
  h.Write(w, {{"op", "push"}});
  const std::string& t = w.text();
  EXPECT_EQ(Value(t, "isthmus_push_seconds_bucket{op=\"push\",le=\"0.1\"}"), 2)
      << t;  // 0.1 itself falls in le=0.1
  EXPECT_EQ(Value(t, "isthmus_push_seconds_bucket{op=\"push\",le=\"1\"}"), 3) << t;
  EXPECT_EQ(Value(t, "isthmus_push_seconds_bucket{op=\"push\",le=\"10\"}"), 4) << t;
  EXPECT_EQ(Value(t, "isthmus_push_seconds_bucket{op=\"push\",le=\"+Inf\"}"), 5) << t;
  EXPECT_EQ(Value(t, "isthmus_push_seconds_count{op=\"push\"}"), 5) << t;
  EXPECT_NEAR(*Value(t, "isthmus_push_seconds_sum{op=\"push\"}"), 52.65, 1e-9) << t;
  auto check = PromtoolCheck(t);
  if (check.available) {
    EXPECT_EQ(check.exit_code, 0) << check.output << t;
  }
}

TEST(MetricsText, PromtoolRefusesWhatTheConventionsForbid) {
  // The check used by the process tests can fail: a counter without _total.
  TextWriter w;
  w.Single("isthmus_requests", Type::kCounter, "Requests.", 1);
  auto check = PromtoolCheck(w.text());
  if (!check.available) GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  EXPECT_NE(check.exit_code, 0) << check.output;
  EXPECT_NE(check.output.find("_total"), std::string::npos) << check.output;
}

TEST(MetricsAddress, HostPortFormsAndMistakes) {
  auto a = ParseHostPort("127.0.0.1:9464", "listen.metrics");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->first, "127.0.0.1");
  EXPECT_EQ(a->second, 9464);
  auto b = ParseHostPort("[::1]:0", "x");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->first, "::1");
  EXPECT_EQ(b->second, 0);
  for (const char* bad : {"9464", ":9464", "host:", "host:port", "host:70000", "::1:9464",
                          "[::1:9464", "tcp://127.0.0.1:9464x"}) {
    auto r = ParseHostPort(bad, "listen.metrics");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("listen.metrics"), std::string::npos);
    EXPECT_NE(r.status().message().find("HOST:PORT"), std::string::npos);
  }
}

TEST(MetricsEndpoint, ServesTheRenderedTextAndSaysWhereOtherwise) {
  std::atomic<int> calls{0};
  auto e = MetricsEndpoint::Start("127.0.0.1:0", "test", [&]() -> Result<std::string> {
    TextWriter w;
    w.Single("isthmus_calls_total", Type::kCounter, "Scrapes.", ++calls);
    return w.Take();
  });
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  const int port = (*e)->port();
  ASSERT_GT(port, 0);
  auto first = Scrape(port);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(Value(*first, "isthmus_calls_total"), 1);
  EXPECT_EQ(Value(*Scrape(port), "isthmus_calls_total"), 2);
  httplib::Client c("127.0.0.1", port);
  auto r = c.Get("/metrics");
  ASSERT_TRUE(r);
  EXPECT_NE(r->get_header_value("Content-Type").find("version=0.0.4"), std::string::npos);
  auto other = c.Get("/");
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 404);
  EXPECT_NE(other->body.find("/metrics"), std::string::npos);
  // A port in use is refused, naming the setting.
  auto again = MetricsEndpoint::Start("127.0.0.1:" + std::to_string(port), "listen.metrics",
                                      []() -> Result<std::string> { return std::string(); });
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), Code::kUnavailable);
  EXPECT_NE(again.status().message().find("listen.metrics"), std::string::npos);
}

TEST(MetricsEndpoint, ARenderErrorAnswers503WithItsMessage) {
  auto e = MetricsEndpoint::Start("127.0.0.1:0", "test", []() -> Result<std::string> {
    return Status::Unavailable("the shard is shutting down");
  });
  ASSERT_TRUE(e.ok());
  httplib::Client c("127.0.0.1", (*e)->port());
  auto r = c.Get("/metrics");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  EXPECT_NE(r->body.find("shutting down"), std::string::npos);
}

TEST(MetricsEndpoint, StopsPromptlyRightAfterStart) {
  for (int i = 0; i < 20; ++i) {
    auto e = MetricsEndpoint::Start("127.0.0.1:0", "test",
                                    []() -> Result<std::string> { return std::string(); });
    ASSERT_TRUE(e.ok());
  }  // each destructor must return (a hang fails the test by its timeout)
}

}  // namespace
}  // namespace isthmus::metrics
