// The exposition text, histograms and the HTTP endpoint behind common/metrics.h.
#include "common/metrics.h"

#include <httplib.h>
#include <sys/prctl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>

namespace isthmus::metrics {
namespace {

const char* TypeName(Type t) {
  switch (t) {
    case Type::kCounter:
      return "counter";
    case Type::kGauge:
      return "gauge";
    case Type::kHistogram:
      return "histogram";
  }
  return "untyped";
}

// HELP text escapes only backslash and newline.
std::string EscapeHelp(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void AppendLabels(std::string& out, const Labels& a, const Labels& b) {
  if (a.empty() && b.empty()) return;
  out += '{';
  bool first = true;
  for (const Labels* set : {&a, &b}) {
    for (const auto& [k, v] : *set) {
      if (!first) out += ',';
      first = false;
      out += k;
      out += "=\"";
      out += EscapeLabelValue(v);
      out += '"';
    }
  }
  out += '}';
}

}  // namespace

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[40];
  if (v == std::floor(v) && std::fabs(v) < 9.007199254740992e15) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  } else {
    // The shortest form that reads back as the same double (0.1, not 0.10000000000000001).
    for (int digits = 15; digits <= 17; ++digits) {
      std::snprintf(buf, sizeof buf, "%.*g", digits, v);
      if (std::strtod(buf, nullptr) == v) break;
    }
  }
  return buf;
}

std::string EscapeLabelValue(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void TextWriter::Begin(std::string_view name, Type type, std::string_view help) {
  if (family_ == name) return;
  family_ = std::string(name);
  out_ += "# HELP ";
  out_ += name;
  out_ += ' ';
  out_ += EscapeHelp(help);
  out_ += "\n# TYPE ";
  out_ += name;
  out_ += ' ';
  out_ += TypeName(type);
  out_ += '\n';
}

void TextWriter::Sample(const Labels& labels, double value, std::string_view suffix,
                        const Labels& extra) {
  out_ += family_;
  out_ += suffix;
  AppendLabels(out_, labels, extra);
  out_ += ' ';
  out_ += FormatValue(value);
  out_ += '\n';
}

void TextWriter::Single(std::string_view name, Type type, std::string_view help, double value) {
  Begin(name, type, help);
  Sample({}, value);
}

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double v) {
  if (std::isnan(v)) return;
  const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  ++counts_[i];
  ++count_;
  sum_ += v;
}

void Histogram::Write(TextWriter& w, const Labels& labels) const {
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    w.Sample(labels, static_cast<double>(cumulative), "_bucket", {{"le", FormatValue(bounds_[i])}});
  }
  w.Sample(labels, static_cast<double>(count_), "_bucket", {{"le", "+Inf"}});
  w.Sample(labels, sum_, "_sum");
  w.Sample(labels, static_cast<double>(count_), "_count");
}

std::vector<double> LatencyBuckets() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
          0.5,    1,     2.5,    5,     10,   30,    60,   120};
}

std::vector<double> StepBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
          1,     2.5,    5,     10,   30,    60,   120, 300,  600};
}

Result<std::pair<std::string, int>> ParseHostPort(const std::string& address,
                                                  const std::string& what) {
  auto bad = [&](const std::string& why) {
    return Status::InvalidArgument(what + " '" + address + "': " + why +
                                   " (expected HOST:PORT, e.g. 127.0.0.1:9464 or [::1]:9464)");
  };
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return bad("no host or no port");
  }
  std::string host = address.substr(0, colon);
  if (host.front() == '[') {
    if (host.back() != ']' || host.size() < 3) return bad("unbalanced brackets around the host");
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != std::string::npos) {
    return bad("an IPv6 host needs brackets");
  }
  const std::string port_text = address.substr(colon + 1);
  if (port_text.size() > 5 || !std::all_of(port_text.begin(), port_text.end(),
                                           [](char c) { return c >= '0' && c <= '9'; })) {
    return bad("the port is not a number");
  }
  const int port = std::stoi(port_text);
  if (port > 65535) return bad("the port is above 65535");
  return std::make_pair(host, port);
}

struct MetricsEndpoint::Impl {
  httplib::Server server;
  std::thread listener;
  std::atomic<bool> listener_done{false};
};

Result<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(const std::string& address,
                                                                const std::string& what,
                                                                Render render) {
  ISTHMUS_ASSIGN_OR_RETURN(auto hp, ParseHostPort(address, what));
  std::unique_ptr<MetricsEndpoint> e(new MetricsEndpoint());
  e->impl_ = std::make_unique<Impl>();
  auto& svr = e->impl_->server;
  // One request thread: scrapes are rare and small, and threads stay few.
  svr.new_task_queue = [] { return new httplib::ThreadPool(1); };
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, which would let a second
  // process bind the same port and take half the scrapes instead of failing to start.
  svr.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  svr.set_read_timeout(5, 0);
  svr.set_write_timeout(5, 0);
  svr.set_keep_alive_max_count(10);
  svr.Get("/metrics", [render](const httplib::Request&, httplib::Response& res) {
    ::prctl(PR_SET_NAME, "metrics-http", 0, 0, 0);
    auto text = render();
    if (!text.ok()) {
      res.status = 503;
      res.set_content(text.status().ToString() + "\n", "text/plain; charset=utf-8");
      return;
    }
    res.set_content(std::move(*text), "text/plain; version=0.0.4; charset=utf-8");
  });
  svr.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (res.status == 404) {
      res.set_content("isthmus serves Prometheus metrics at /metrics, not at " + req.path + "\n",
                      "text/plain; charset=utf-8");
    }
  });
  int port = hp.second;
  if (port == 0) {
    port = svr.bind_to_any_port(hp.first);
    if (port < 0) port = 0;
  } else if (!svr.bind_to_port(hp.first, port)) {
    port = 0;
  }
  if (port == 0) {
    return Status::Unavailable("cannot listen for metrics on " + address + " (" + what +
                               "): is the address local and the port free?");
  }
  e->host_ = hp.first;
  e->port_ = port;
  e->impl_->listener = std::thread([impl = e->impl_.get()] {
    ::prctl(PR_SET_NAME, "metrics-listen", 0, 0, 0);
    impl->server.listen_after_bind();
    impl->listener_done = true;
  });
  return e;
}

MetricsEndpoint::~MetricsEndpoint() {
  if (!impl_) return;
  // stop() only acts on a server that is already listening: give the listener thread a
  // moment to get there when the endpoint is destroyed right after Start().
  for (int i = 0; i < 500 && !impl_->server.is_running() && !impl_->listener_done; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  impl_->server.stop();
  if (impl_->listener.joinable()) impl_->listener.join();
}

}  // namespace isthmus::metrics
