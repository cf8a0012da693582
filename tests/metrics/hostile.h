// Hostile HTTP clients for the metrics endpoint tests: a large request body streamed from
// one small buffer, many idle connections, a slowloris that sends its request head one byte
// a second, and the resident memory of a process. Every loop here is bounded in time or
// count, so a server that misbehaves fails a test instead of hanging it.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace isthmus::testing {

// VmRSS of process `pid` ("self" for this one) in KiB, -1 if it cannot be read.
inline long VmRssKb(const std::string& pid = "self") {
  std::ifstream in("/proc/" + pid + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

// A TCP connection to 127.0.0.1:`port`, connected within `timeout` (non-blocking connect,
// so a full accept queue costs a bounded wait, not the kernel's SYN retries); -1 if not.
// The socket is left blocking, with send and receive timeouts of `timeout`.
inline int ConnectLoopback(int port, std::chrono::milliseconds timeout) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    pollfd p{fd, POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof err;
    if (errno != EINPROGRESS || ::poll(&p, 1, static_cast<int>(timeout.count())) != 1 ||
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      ::close(fd);
      return -1;
    }
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  timeval tv{static_cast<time_t>(timeout.count() / 1000),
             static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

inline bool SendAll(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

// What the server answered (its first bytes, up to 4 KiB; empty when it only closed) and
// how much of the body went out before it did.
struct BodyResult {
  std::string answer;
  uint64_t body_sent = 0;
  bool connected = false;
};

// Sends `head` (which announces a body), then streams `body_bytes` zero bytes from one
// 64 KiB buffer, stopping as soon as the server answers or stops reading (the send timeout
// bounds each stall), and reads the answer.
inline BodyResult StreamBody(int port, const std::string& head, uint64_t body_bytes) {
  BodyResult r;
  const int fd = ConnectLoopback(port, std::chrono::milliseconds(3000));
  if (fd < 0) return r;
  r.connected = true;
  static const std::vector<char> chunk(64 * 1024, 0);
  if (SendAll(fd, head)) {
    while (r.body_sent < body_bytes) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 0) == 1) break;  // an answer (or the close) is there: stop sending
      const size_t want =
          static_cast<size_t>(std::min<uint64_t>(chunk.size(), body_bytes - r.body_sent));
      const ssize_t n = ::send(fd, chunk.data(), want, MSG_NOSIGNAL);
      if (n <= 0) break;
      r.body_sent += static_cast<uint64_t>(n);
    }
  }
  char buf[4096];
  const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
  if (n > 0) r.answer.assign(buf, static_cast<size_t>(n));
  ::close(fd);
  return r;
}

// Raises this process's open-file limit to its hard limit (tests open hundreds of sockets).
inline void RaiseFileLimit() {
  rlimit l{};
  if (::getrlimit(RLIMIT_NOFILE, &l) == 0 && l.rlim_cur < l.rlim_max) {
    l.rlim_cur = l.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &l);
  }
}

// `n` connections that send nothing (fewer when connecting takes longer than ~2 s each).
// Closed by the destructor.
class IdleConnections {
 public:
  IdleConnections(int port, int n) {
    for (int i = 0; i < n; ++i) {
      const int fd = ConnectLoopback(port, std::chrono::milliseconds(2000));
      if (fd >= 0) fds_.push_back(fd);
    }
  }
  ~IdleConnections() {
    for (int fd : fds_) ::close(fd);
  }
  size_t size() const { return fds_.size(); }

 private:
  std::vector<int> fds_;
};

// A slowloris: a thread that sends a request head one byte a second and never finishes
// it, until the server closes the connection or `max_seconds` passed. closed_after_s()
// says when the server closed it (-1: it did not).
class Slowloris {
 public:
  Slowloris(int port, int max_seconds) {
    fd_ = ConnectLoopback(port, std::chrono::milliseconds(3000));
    thread_ = std::thread([this, max_seconds] { Run(max_seconds); });
  }
  ~Slowloris() {
    stop_ = true;
    thread_.join();
    if (fd_ >= 0) ::close(fd_);
  }
  bool connected() const { return fd_ >= 0; }
  int bytes_sent() const { return sent_; }
  double closed_after_s() const { return closed_after_s_; }
  bool done() const { return done_; }

 private:
  void Run(int max_seconds) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string head = "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    for (int i = 0; fd_ >= 0 && !stop_ && i < max_seconds * 10; ++i) {
      if (i % 10 == 0) {
        const char c = i / 10 < static_cast<int>(head.size()) ? head[i / 10] : 'a';
        if (::send(fd_, &c, 1, MSG_NOSIGNAL) != 1) break;
        ++sent_;
      }
      // The server closing (EOF, a 408 or a reset) shows as readable.
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 100) == 1) break;
    }
    pollfd p{fd_, POLLIN, 0};
    if (fd_ >= 0 && !stop_ && ::poll(&p, 1, 0) == 1) {
      closed_after_s_ =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    done_ = true;
  }

  int fd_ = -1;
  std::thread thread_;
  std::atomic<bool> stop_{false}, done_{false};
  std::atomic<int> sent_{0};
  std::atomic<double> closed_after_s_{-1};
};

}  // namespace isthmus::testing
