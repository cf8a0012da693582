// The exposition text, histograms, address parsing and the HTTP endpoint of
// common/metrics.h, without a shard or a worker.
#include "common/metrics.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>

#include "tests/loopback.h"
#include "tests/metrics/hostile.h"
#include "tests/metrics/scrape.h"

namespace isthmus::metrics {
namespace {

using isthmus::testing::PromtoolCheck;
using isthmus::testing::Scrape;
using isthmus::testing::Value;
using namespace std::chrono_literals;

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

Result<std::string> OneCounter() {
  TextWriter w;
  w.Single("isthmus_up_total", Type::kCounter, "Scrapes.", 1);
  return w.Take();
}

// Issue 27 item 7: a 256 MiB POST took a shard from 40 to 326 MB. A request with a body is
// refused (413) after its head, and the body is never stored: this process's resident
// memory grows by a few MB at most while 256 MiB are offered.
TEST(MetricsEndpoint, ARequestBodyIsRefusedWithoutBeingRead) {
  auto e = MetricsEndpoint::Start("127.0.0.1:0", "test", OneCounter);
  ASSERT_TRUE(e.ok());
  const int port = (*e)->port();
  ASSERT_TRUE(Scrape(port).has_value());
  const long rss_before = isthmus::testing::VmRssKb();
  ASSERT_GT(rss_before, 0);
  const uint64_t kOffered = uint64_t{256} << 20;
  auto big = isthmus::testing::StreamBody(
      port,
      "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
      "Content-Length: " +
          std::to_string(kOffered) + "\r\n\r\n",
      kOffered);
  const long rss_after = isthmus::testing::VmRssKb();
  ASSERT_TRUE(big.connected);
  EXPECT_EQ(big.answer.rfind("HTTP/1.1 413", 0), 0u) << big.answer;
  EXPECT_NE(big.answer.find("Connection: close"), std::string::npos) << big.answer;
  EXPECT_NE(big.answer.find("GET /metrics"), std::string::npos) << big.answer;
  EXPECT_LT(big.body_sent, kOffered) << "the server read the whole body";
  EXPECT_LT(rss_after - rss_before, 8 * 1024)
      << "resident memory grew from " << rss_before << " to " << rss_after << " KiB after "
      << big.body_sent << " body bytes were sent";
  std::printf("256 MiB POST: %llu bytes went out before the answer; VmRSS %ld -> %ld KiB\n",
              static_cast<unsigned long long>(big.body_sent), rss_before, rss_after);

  // Chunked bodies, small bodies on a GET and bodies announced with Expect are refused too.
  for (const std::string head :
       {"POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n",
        "PUT /metrics HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        "Content-Length: 1000000\r\n\r\n"}) {
    auto r = isthmus::testing::StreamBody(port, head, 1 << 20);
    EXPECT_EQ(r.answer.rfind("HTTP/1.1 413", 0), 0u) << head << " -> " << r.answer;
  }
  // A request head larger than the limit is refused (431), whatever it carries.
  auto huge = isthmus::testing::StreamBody(
      port, "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(64 * 1024, 'a'), 0);
  EXPECT_EQ(huge.answer.rfind("HTTP/1.1 431", 0), 0u) << huge.answer;
  // Another method without a body: 405 naming GET.
  auto del = isthmus::testing::StreamBody(port, "DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 0);
  EXPECT_EQ(del.answer.rfind("HTTP/1.1 405", 0), 0u) << del.answer;
  EXPECT_NE(del.answer.find("Allow: GET, HEAD"), std::string::npos) << del.answer;
  // The endpoint still serves.
  auto text = Scrape(port);
  ASSERT_TRUE(text.has_value());
  EXPECT_EQ(Value(*text, "isthmus_up_total"), 1);
}

// Issue 27 item 7: the endpoint served one connection at a time, so one slowloris or 500
// idle connections blocked every scrape. With both in place a scrape still answers within
// a few seconds, and the slowloris is cut off by the request-head deadline.
TEST(MetricsEndpoint, IdleAndSlowConnectionsDoNotBlockAScrape) {
  isthmus::testing::RaiseFileLimit();
  auto e = MetricsEndpoint::Start("127.0.0.1:0", "test", OneCounter);
  ASSERT_TRUE(e.ok());
  const int port = (*e)->port();
  {
    isthmus::testing::Slowloris slow(port, 30);
    ASSERT_TRUE(slow.connected());
    std::this_thread::sleep_for(1500ms);  // it has the server's attention first
    isthmus::testing::IdleConnections idle(port, 500);
    EXPECT_GE(idle.size(), 400u) << "could not open the idle connections";
    const auto t0 = std::chrono::steady_clock::now();
    auto text = Scrape(port);
    const double scrape_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(text.has_value()) << "no answer with " << idle.size()
                                  << " idle connections and a slowloris open";
    EXPECT_EQ(Value(*text, "isthmus_up_total"), 1);
    EXPECT_LT(scrape_s, 5.0);
    std::printf("scrape with %zu idle connections and a slowloris: %.3f s\n", idle.size(),
                scrape_s);
    // Keep-alive scrapes on one connection keep working meanwhile.
    httplib::Client c("127.0.0.1", port);
    c.set_connection_timeout(5, 0);
    c.set_read_timeout(5, 0);
    for (int i = 0; i < 3; ++i) {
      auto r = c.Get("/metrics");
      ASSERT_TRUE(r) << "keep-alive scrape " << i;
      EXPECT_EQ(r->status, 200);
    }
  }
  // Alone, a slowloris is cut off by the request-head deadline (kRequestHeadTimeout),
  // well before its 30 s are over.
  isthmus::testing::Slowloris slow(port, 30);
  ASSERT_TRUE(slow.connected());
  for (int i = 0; i < 300 && !slow.done(); ++i) std::this_thread::sleep_for(100ms);
  const double limit_s = MetricsEndpoint::kRequestHeadTimeout.count() / 1000.0;
  EXPECT_GE(slow.closed_after_s(), limit_s - 0.5) << "closed before the deadline";
  EXPECT_LT(slow.closed_after_s(), limit_s + 5)
      << "the slowloris was not closed in time; it sent " << slow.bytes_sent() << " bytes";
  std::printf("a lone slowloris was closed after %.2f s (%d bytes sent)\n", slow.closed_after_s(),
              slow.bytes_sent());
}

}  // namespace
}  // namespace isthmus::metrics
