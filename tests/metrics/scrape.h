// Helpers of the metrics tests: GET /metrics from a live endpoint, read one series' value
// out of the exposition text, and run `promtool check metrics` on it.
#pragma once

#include <httplib.h>
#include <sys/wait.h>

#include <cstdio>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace isthmus::testing {

// The body of GET http://127.0.0.1:PORT/metrics, or nullopt when it did not answer 200.
inline std::optional<std::string> Scrape(int port) {
  httplib::Client c("127.0.0.1", port);
  c.set_connection_timeout(5, 0);
  c.set_read_timeout(15, 0);
  auto r = c.Get("/metrics");
  if (!r || r->status != 200) return std::nullopt;
  return r->body;
}

// The value of `series` (the name with its labels exactly as written, e.g.
// `isthmus_requests_total{socket="worker",op="push",outcome="OK"}`), nullopt if absent.
inline std::optional<double> Value(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.size() > series.size() && line.compare(0, series.size(), series) == 0 &&
        line[series.size()] == ' ') {
      return std::stod(line.substr(series.size() + 1));
    }
  }
  return std::nullopt;
}

// The family names of an exposition (its "# TYPE name ..." lines).
inline std::vector<std::string> Families(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("# TYPE ", 0) == 0) out.push_back(line.substr(7, line.find(' ', 7) - 7));
  }
  return out;
}

struct PromtoolResult {
  bool available = false;  // promtool is installed
  int exit_code = -1;
  std::string output;
};

// Runs `promtool check metrics` with `text` on its standard input.
inline PromtoolResult PromtoolCheck(const std::string& text) {
  PromtoolResult r;
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) return r;
  r.available = true;
  char path[] = "/tmp/isthmus-promtool-XXXXXX";
  int fd = ::mkstemp(path);
  if (fd < 0) return r;
  FILE* f = ::fdopen(fd, "w");
  std::fwrite(text.data(), 1, text.size(), f);
  std::fclose(f);
  std::string cmd = std::string("promtool check metrics < ") + path + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  char buf[512];
  while (p && std::fgets(buf, sizeof buf, p)) r.output += buf;
  const int status = p ? ::pclose(p) : -1;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::remove(path);
  return r;
}

}  // namespace isthmus::testing
