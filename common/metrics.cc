// The exposition text, histograms and the HTTP endpoint behind common/metrics.h.
#include "common/metrics.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

// --- the HTTP endpoint ---------------------------------------------------------------------
//
// One thread polls the listening socket and every connection without blocking, so a client
// holds nothing but its own connection: a slowloris, an idle keep-alive connection or a
// large upload costs one slot and a few KiB, never the attention of the thread. Only
// GET/HEAD /metrics is served; a request that announces a body is refused after its head,
// and the body is discarded unread (a bounded amount, so the refusal can be read), never
// stored.

namespace {

using Clock = std::chrono::steady_clock;

// What a request head asks for.
struct Head {
  int status = 0;          // an error to answer with (0: serve it)
  std::string reason;      // the error's body
  bool head_only = false;  // HEAD: headers without the body
  bool close = false;      // the client does not keep the connection
};

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string Trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t' || s[e - 1] == '\r')) --e;
  return s.substr(b, e - b);
}

// Parses a complete request head (request line and header lines, without the blank line).
Head ParseHead(const std::string& text) {
  Head h;
  std::vector<std::string> lines;
  for (size_t pos = 0; pos <= text.size();) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    lines.push_back(Trim(text.substr(pos, nl - pos)));
    pos = nl + 1;
  }
  const std::string& line = lines.front();
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string::npos) {
    return {400, "malformed request line; isthmus serves GET /metrics\n", false, true};
  }
  const std::string method = line.substr(0, sp1);
  const std::string target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string version = line.substr(sp2 + 1);
  if (version != "HTTP/1.1" && version != "HTTP/1.0") {
    return {400, "unsupported protocol '" + version + "'; isthmus serves GET /metrics\n", false,
            true};
  }
  bool body = false, keep_alive = false;
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t colon = lines[i].find(':');
    if (colon == std::string::npos) continue;
    const std::string name = Lower(Trim(lines[i].substr(0, colon)));
    const std::string value = Lower(Trim(lines[i].substr(colon + 1)));
    if (name == "content-length" && value != "0") body = true;
    if (name == "transfer-encoding" || name == "expect") body = true;
    if (name == "connection") {
      h.close = h.close || value.find("close") != std::string::npos;
      keep_alive = value.find("keep-alive") != std::string::npos;
    }
  }
  if (version == "HTTP/1.0" && !keep_alive) h.close = true;
  // A body would have to be read (or skipped) before the next request on this connection:
  // refuse it and close instead, whatever the method and path.
  if (body) {
    return {413,
            "isthmus serves Prometheus metrics with GET /metrics and takes no request body; "
            "this one was refused unread\n",
            false, true};
  }
  if (method != "GET" && method != "HEAD") {
    return {405, "isthmus serves Prometheus metrics with GET /metrics, not with " + method + "\n",
            false, true};
  }
  const std::string path = target.substr(0, target.find('?'));
  if (path != "/metrics") {
    return {404, "isthmus serves Prometheus metrics at /metrics, not at " + path + "\n", false,
            h.close};
  }
  h.head_only = method == "HEAD";
  return h;
}

const char* StatusText(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 413:
      return "Payload Too Large";
    case 431:
      return "Request Header Fields Too Large";
    case 503:
      return "Service Unavailable";
  }
  return "Error";
}

std::string Response(int status, const std::string& content_type, const std::string& body,
                     bool head_only, bool close) {
  std::string out = "HTTP/1.1 " + std::to_string(status) + " " + StatusText(status) + "\r\n";
  out += "Content-Type: " + content_type + "\r\n";
  out += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  if (status == 405) out += "Allow: GET, HEAD\r\n";
  out += close ? "Connection: close\r\n\r\n" : "Connection: keep-alive\r\n\r\n";
  if (!head_only) out += body;
  return out;
}

constexpr const char* kPlain = "text/plain; charset=utf-8";

bool HasHeadEnd(const std::string& in) {
  return in.find("\r\n\r\n") != std::string::npos || in.find("\n\n") != std::string::npos;
}

struct Conn {
  enum class State { kReading, kWriting, kDraining };
  int fd = -1;
  State state = State::kReading;
  std::string in;   // received, not yet answered: at most kMaxRequestHeadBytes + 1
  std::string out;  // the response being sent
  size_t out_sent = 0;
  bool close_after = false;  // close once `out` is sent
  int requests = 0;
  Clock::time_point since;     // when the wait for the current request began (evictions)
  Clock::time_point deadline;  // of the current state
  uint64_t drained = 0;
};

}  // namespace

struct MetricsEndpoint::Impl {
  Render render;
  int listen_fd = -1;
  int wake_fd = -1;  // the destructor's stop request
  std::thread thread;
  std::vector<Conn> conns;  // the thread's alone

  ~Impl() {
    for (auto& c : conns) ::close(c.fd);
    if (listen_fd >= 0) ::close(listen_fd);
    if (wake_fd >= 0) ::close(wake_fd);
  }

  void Run();
  void Accept(Clock::time_point now);
  // Reads what `c` sent; returns false when the connection is finished with.
  bool Read(Conn& c);
  bool Write(Conn& c, Clock::time_point now);
  // Looks for a complete request head in c.in; answers errors, and marks a scrape in
  // `*scrape` (its response is built once the text is rendered).
  void Parse(Conn& c, Clock::time_point now, bool* scrape, bool* head_only);
  void Answer(Conn& c, std::string response, bool close, Clock::time_point now);
};

void MetricsEndpoint::Impl::Answer(Conn& c, std::string response, bool close,
                                   Clock::time_point now) {
  c.out = std::move(response);
  c.out_sent = 0;
  c.close_after = close || ++c.requests >= kMaxRequestsPerConnection;
  c.state = Conn::State::kWriting;
  c.deadline = now + kWriteTimeout;
}

void MetricsEndpoint::Impl::Parse(Conn& c, Clock::time_point now, bool* scrape, bool* head_only) {
  *scrape = false;
  size_t end = c.in.find("\r\n\r\n");
  size_t skip = 4;
  if (const size_t lf = c.in.find("\n\n"); lf != std::string::npos && lf < end) end = lf, skip = 2;
  if (end == std::string::npos || end > kMaxRequestHeadBytes) {
    if (c.in.size() > kMaxRequestHeadBytes) {
      Answer(c,
             Response(431, kPlain,
                      "the request head is larger than " + std::to_string(kMaxRequestHeadBytes) +
                          " bytes; isthmus serves GET /metrics\n",
                      false, true),
             true, now);
      c.in.clear();
    }
    return;
  }
  const Head h = ParseHead(c.in.substr(0, end));
  c.in.erase(0, end + skip);
  if (h.status != 0) {
    if (h.close) c.in.clear();  // a refused body's first bytes, say: never parsed
    Answer(c, Response(h.status, kPlain, h.reason, false, h.close), h.close, now);
    return;
  }
  *scrape = true;
  *head_only = h.head_only;
  c.close_after = h.close;
}

bool MetricsEndpoint::Impl::Read(Conn& c) {
  char buf[4096];
  while (true) {
    size_t want = sizeof buf;
    if (c.state == Conn::State::kReading) {
      // At most one byte past the limit is kept: enough to know the head is too large.
      if (c.in.size() > kMaxRequestHeadBytes) return true;
      want = std::min(want, kMaxRequestHeadBytes + 1 - c.in.size());
    } else if (c.state != Conn::State::kDraining) {
      return true;  // a pipelined request waits in the kernel until the answer is out
    }
    const ssize_t n = ::recv(c.fd, buf, want, MSG_DONTWAIT);
    if (n == 0) return false;  // the client closed
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    if (c.state == Conn::State::kDraining) {
      c.drained += static_cast<uint64_t>(n);
      if (c.drained > kDrainBytes) return false;
    } else {
      c.in.append(buf, static_cast<size_t>(n));
    }
  }
}

bool MetricsEndpoint::Impl::Write(Conn& c, Clock::time_point now) {
  while (c.out_sent < c.out.size()) {
    const ssize_t n = ::send(c.fd, c.out.data() + c.out_sent, c.out.size() - c.out_sent,
                             MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    c.out_sent += static_cast<size_t>(n);
  }
  c.out.clear();
  c.out.shrink_to_fit();
  if (c.close_after) {
    // Let the client read the answer: stop sending, and discard (a bounded amount of)
    // whatever it still sends, so that closing does not reset the connection under it.
    ::shutdown(c.fd, SHUT_WR);
    c.state = Conn::State::kDraining;
    c.deadline = now + kDrainTimeout;
    c.drained = 0;
    return true;
  }
  c.state = Conn::State::kReading;
  c.since = now;
  c.deadline = now + kRequestHeadTimeout;
  return true;
}

void MetricsEndpoint::Impl::Accept(Clock::time_point now) {
  for (int i = 0; i < 64; ++i) {
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN, or out of descriptors: try again on the next round
    if (conns.size() >= kMaxConnections) {
      // Make room by closing the connection that matters least: one being drained after a
      // refusal, else the one that has waited longest without a complete request, else the
      // oldest answer in progress; a complete request waiting for its answer goes last. A
      // new scrape wins over idle and slow clients.
      auto rank = [](const Conn& c) {
        switch (c.state) {
          case Conn::State::kDraining:
            return 0;
          case Conn::State::kReading:
            return HasHeadEnd(c.in) ? 3 : 1;
          case Conn::State::kWriting:
            return 2;
        }
        return 1;
      };
      auto victim = std::min_element(conns.begin(), conns.end(), [&](const Conn& a, const Conn& b) {
        return rank(a) != rank(b) ? rank(a) < rank(b) : a.since < b.since;
      });
      ::close(victim->fd);
      conns.erase(victim);
    }
    Conn c;
    c.fd = fd;
    c.since = now;
    c.deadline = now + kRequestHeadTimeout;
    // A client that sent its request with the connection (a scraper does) is read now, so
    // that a burst of connections behind it cannot push it out before it is served.
    if (!Read(c)) {
      ::close(fd);
      continue;
    }
    conns.push_back(std::move(c));
  }
}

void MetricsEndpoint::Impl::Run() {
  ::prctl(PR_SET_NAME, "metrics-http", 0, 0, 0);
  std::vector<pollfd> fds;
  while (true) {
    Clock::time_point now = Clock::now();
    auto next = now + std::chrono::seconds(1);
    fds.assign(2, pollfd{});
    fds[0] = {wake_fd, POLLIN, 0};
    fds[1] = {listen_fd, POLLIN, 0};
    for (const auto& c : conns) {
      fds.push_back(
          {c.fd, static_cast<short>(c.state == Conn::State::kWriting ? POLLOUT : POLLIN), 0});
      next = std::min(next, c.deadline);
      // A request that came in behind the last answer (pipelined) is parsed at once.
      if (c.state == Conn::State::kReading && HasHeadEnd(c.in)) next = now;
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count();
    const int n = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait, 0) + 1));
    if (n < 0 && errno != EINTR) return;
    if (fds[0].revents & POLLIN) return;
    now = Clock::now();
    // Serve what the connections sent; scrapes that arrive together share one rendering.
    std::vector<bool> keep(conns.size(), true);
    std::vector<std::pair<size_t, bool>> scrapes;  // connection, HEAD
    for (size_t i = 0; i < conns.size(); ++i) {
      Conn& c = conns[i];
      if (fds[2 + i].revents != 0) {
        keep[i] = c.state == Conn::State::kWriting ? Write(c, now) : Read(c);
      }
      if (keep[i] && c.state == Conn::State::kReading && !c.in.empty()) {
        bool scrape = false, head_only = false;
        Parse(c, now, &scrape, &head_only);
        if (scrape) scrapes.emplace_back(i, head_only);
      }
    }
    if (!scrapes.empty()) {
      auto text = render();
      for (const auto& [i, head_only] : scrapes) {
        Conn& c = conns[i];
        const bool close = c.close_after;
        if (text.ok()) {
          Answer(c,
                 Response(200, "text/plain; version=0.0.4; charset=utf-8", *text, head_only, close),
                 close, now);
        } else {
          Answer(c, Response(503, kPlain, text.status().ToString() + "\n", head_only, close), close,
                 now);
        }
        keep[i] = Write(c, now);
      }
    }
    // Answers for errors found while parsing go out at once too.
    for (size_t i = 0; i < conns.size(); ++i) {
      if (keep[i] && conns[i].state == Conn::State::kWriting && conns[i].out_sent == 0) {
        keep[i] = Write(conns[i], now);
      }
    }
    // Deadlines: a request head that did not arrive in time gets 408 (an idle keep-alive
    // connection is just closed); an answer not taken in time, or a drain, ends.
    for (size_t i = 0; i < conns.size(); ++i) {
      Conn& c = conns[i];
      if (!keep[i] || now < c.deadline) continue;
      if (c.state == Conn::State::kReading && !c.in.empty()) {
        const std::string r =
            Response(408, kPlain, "the request head did not arrive in time\n", false, true);
        (void)!::send(c.fd, r.data(), r.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      }
      keep[i] = false;
    }
    size_t w = 0;
    for (size_t i = 0; i < conns.size(); ++i) {
      if (keep[i]) {
        if (w != i) conns[w] = std::move(conns[i]);
        ++w;
      } else {
        ::close(conns[i].fd);
      }
    }
    conns.resize(w);
    if (fds[1].revents & POLLIN) Accept(now);
  }
}

Result<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(const std::string& address,
                                                                const std::string& what,
                                                                Render render) {
  ISTHMUS_ASSIGN_OR_RETURN(auto hp, ParseHostPort(address, what));
  std::unique_ptr<MetricsEndpoint> e(new MetricsEndpoint());
  e->impl_ = std::make_unique<Impl>();
  Impl& impl = *e->impl_;
  impl.render = std::move(render);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int gai =
      ::getaddrinfo(hp.first.c_str(), std::to_string(hp.second).c_str(), &hints, &found);
  std::string why = gai != 0 ? ::gai_strerror(gai) : "no address";
  for (addrinfo* a = found; a != nullptr && impl.listen_fd < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    // SO_REUSEADDR only: SO_REUSEPORT would let a second process bind the same port and
    // take half the scrapes instead of failing to start.
    int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
      impl.listen_fd = fd;
    } else {
      why = std::strerror(errno);
      ::close(fd);
    }
  }
  if (found != nullptr) ::freeaddrinfo(found);
  if (impl.listen_fd < 0) {
    return Status::Unavailable("cannot listen for metrics on " + address + " (" + what +
                               "): " + why + ": is the address local and the port free?");
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(impl.listen_fd, reinterpret_cast<sockaddr*>(&bound), &len);
  e->host_ = hp.first;
  e->port_ =
      ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port
                                        : reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
  impl.wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (impl.wake_fd < 0) {
    return Status::Internal(std::string("metrics endpoint: eventfd failed: ") +
                            std::strerror(errno));
  }
  impl.thread = std::thread([&impl] { impl.Run(); });
  return e;
}

MetricsEndpoint::~MetricsEndpoint() {
  if (!impl_) return;
  const uint64_t one = 1;
  (void)!::write(impl_->wake_fd, &one, sizeof one);
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace isthmus::metrics
