// Prometheus metrics for isthmus-server and isthmus-worker: the text exposition format
// (version 0.0.4) written by hand from the processes' own counters, a fixed-bucket
// histogram, and a small HTTP endpoint that serves GET /metrics and nothing else.
//
// Nothing here keeps a global registry: each process renders its metrics from the state
// it already owns when a scrape arrives (docs/METRICS.md lists every metric). Names follow
// Prometheus conventions: base units (seconds, bytes), `_total` on counters.
//
// Threads: TextWriter and Histogram are plain values (the owner serialises access).
// MetricsEndpoint runs one thread ("metrics-http"); its render callback runs there.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace isthmus::metrics {

// Label name/value pairs of one sample, in the order they are written.
using Labels = std::vector<std::pair<std::string, std::string>>;

enum class Type { kCounter, kGauge, kHistogram };

// Builds one exposition. Begin() a family (HELP and TYPE once), then write its samples.
class TextWriter {
 public:
  // Starts family `name`. A family begun twice is written once: later samples join it
  // only if they directly follow (callers group a family's samples together).
  void Begin(std::string_view name, Type type, std::string_view help);
  // One sample of the current family: `name` plus `suffix` (e.g. "_bucket"), labels, value.
  void Sample(const Labels& labels, double value, std::string_view suffix = {},
              const Labels& extra = {});
  // Begin + one sample: for the many families with a single unlabelled value.
  void Single(std::string_view name, Type type, std::string_view help, double value);
  const std::string& text() const { return out_; }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
  std::string family_;
};

// The value as the exposition format writes it: integers without a fraction, NaN, +Inf.
std::string FormatValue(double v);
// A label value with \, " and newline escaped.
std::string EscapeLabelValue(std::string_view v);

// Cumulative fixed-bucket histogram of observations (e.g. seconds).
class Histogram {
 public:
  // `upper_bounds` strictly increasing; +Inf is implicit.
  explicit Histogram(std::vector<double> upper_bounds);
  void Observe(double v);
  // The family must have been begun with Type::kHistogram. Writes _bucket{le=...}, _sum
  // and _count with `labels` first.
  void Write(TextWriter& w, const Labels& labels = {}) const;
  uint64_t count() const { return count_; }
  double sum() const { return sum_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; last is +Inf
  uint64_t count_ = 0;
  double sum_ = 0;
};

// Buckets for request and commit latencies: 0.5 ms to 2 minutes.
std::vector<double> LatencyBuckets();
// Buckets for training steps and rounds: 1 ms to 10 minutes.
std::vector<double> StepBuckets();

// "HOST:PORT" (or "[V6]:PORT") split; port 0 asks the kernel for one. InvalidArgument
// names the setting (`what`) and the expected form.
Result<std::pair<std::string, int>> ParseHostPort(const std::string& address,
                                                  const std::string& what);

// Serves the exposition over HTTP/1.1: GET (or HEAD) /metrics answers render()'s text with
// the exposition content type; render() returning an error answers 503 with its message.
// Other paths answer 404 naming /metrics, other methods 405.
//
// The endpoint is reachable by anyone who can reach its port, so no client can cost it
// more than one connection slot and a few KiB, or keep it from answering others:
//   - one thread polls every connection without blocking, so a slow or idle client holds
//     only its own connection;
//   - at most kMaxConnections are open; a new connection past that closes the one that
//     has waited longest for a complete request (new scrapes win over idle clients);
//   - a request head must arrive complete within kRequestHeadTimeout of the connection
//     opening or its last answer (else 408 and close; an idle keep-alive connection is
//     closed) and be at most kMaxRequestHeadBytes (else 431 and close);
//   - a request that announces a body (Content-Length > 0, Transfer-Encoding, Expect) is
//     answered 413 and closed; the body is never stored: up to kDrainBytes of it are read
//     and discarded during kDrainTimeout so that the client can read the refusal;
//   - an answer must be taken within kWriteTimeout.
// Scrapes that arrive together share one render() call. render() runs on the endpoint's
// thread and should be quick or bounded (a shard's waits at most 10 s for its event loop).
class MetricsEndpoint {
 public:
  using Render = std::function<Result<std::string>()>;
  static constexpr size_t kMaxConnections = 32;
  static constexpr size_t kMaxRequestHeadBytes = 8192;
  static constexpr std::chrono::milliseconds kRequestHeadTimeout{5000};
  static constexpr std::chrono::milliseconds kWriteTimeout{10000};
  static constexpr std::chrono::milliseconds kDrainTimeout{1000};
  static constexpr uint64_t kDrainBytes = uint64_t{1} << 20;
  static constexpr int kMaxRequestsPerConnection = 100;  // then the connection is closed

  // Binds `address` ("HOST:PORT"; listen.metrics / --metrics-listen) and starts serving.
  // Unavailable (naming the address and `what`) when it cannot bind.
  static Result<std::unique_ptr<MetricsEndpoint>> Start(const std::string& address,
                                                        const std::string& what, Render render);
  // Stops the thread (after the render in hand, if any) and closes every connection.
  ~MetricsEndpoint();
  int port() const { return port_; }
  const std::string& host() const { return host_; }

 private:
  MetricsEndpoint() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string host_;
  int port_ = 0;
};

}  // namespace isthmus::metrics
