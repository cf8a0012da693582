// Loopback helpers shared by the tests that open real sockets.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace isthmus::testing {

// 4 under ThreadSanitizer, 2 under AddressSanitizer, 1 otherwise: how much a sanitized
// build multiplies time and memory (TimeScale, MemoryScale).
inline int SanitizerFactor() {
#if defined(__SANITIZE_THREAD__)
  return 4;
#elif defined(__SANITIZE_ADDRESS__)
  return 2;
#else
  return 1;
#endif
}

// How much longer than in a plain build a test should wait for something that takes
// wall-clock time (a commit across processes, a silence detector): sanitized builds run
// several times slower, and more so with tests running side by side on few cores.
// SanitizerFactor(), unless ISTHMUS_TEST_TIME_SCALE (a positive integer) overrides it.
inline int TimeScale() {
  if (const char* env = std::getenv("ISTHMUS_TEST_TIME_SCALE")) {
    const int v = std::atoi(env);
    if (v > 0) return v;
  }
  return SanitizerFactor();
}

// How much more memory than in a plain build a test should allow a process to grow by: the
// sanitizers' shadow memory and redzones grow with what a process allocates (a bound on
// resident memory set for a plain build was passed by 22 MB against 16 MB under
// ThreadSanitizer with 500 connections open).
inline int MemoryScale() { return SanitizerFactor(); }

// The part of [1024, 65535] outside the kernel's ephemeral port range
// (net.ipv4.ip_local_port_range) where test ports are picked: the larger of the two gaps
// around that range, above the well-known ports.
inline void TestPortRange(int* lo, int* hi) {
  int eph_lo = 32768, eph_hi = 60999;
  if (std::FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d %d", &eph_lo, &eph_hi) != 2) eph_lo = 32768, eph_hi = 60999;
    std::fclose(f);
  }
  *lo = 10000, *hi = eph_lo - 1;
  if (65535 - eph_hi > *hi - *lo) *lo = eph_hi + 1, *hi = 65535;
  if (*hi <= *lo) *lo = 1024, *hi = 65535;
}

// Binds TCP socket `fd` to `port` on 127.0.0.1; true on success.
inline bool BindLoopback(int fd, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  return ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
}

// True if a TCP socket can bind `port` on 127.0.0.1 now.
inline bool CanBindLoopback(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  const bool bound = BindLoopback(fd, port);
  ::close(fd);
  return bound;
}

// Claims ports `base` .. `base + count - 1` for the rest of this process's life among the
// processes that pick test ports here (C++ tests and tests/python through
// deploy/free_port.py), all or none; false if another live process holds one of them. A
// port that one test found free but has not bound yet (its server is still starting) is
// free to a bind() probe in every other test: under ctest -j a second test picked the same
// admin port, and the first test's client met the second's server. A claim is an
// exclusive flock(2) on a file named after the port in a folder of the temp dir; the file
// stays open until the process exits, when the kernel drops the lock, so a crashed test
// leaves no claim behind. Where that folder cannot be used, claims always succeed and the
// bind() probe alone decides.
inline bool ClaimPorts(int base, int count) {
  static const std::string dir = [] {
    std::error_code ec;
    const auto d = std::filesystem::temp_directory_path(ec) / "isthmus-test-ports";
    std::filesystem::create_directories(d, ec);
    // Every user's tests share the folder (a test run as root may drop to another user).
    std::filesystem::permissions(
        d, std::filesystem::perms::all | std::filesystem::perms::sticky_bit, ec);
    return d.string();
  }();
  std::vector<int> fds;
  bool all = true;
  for (int k = 0; k < count && all; ++k) {
    const std::string path = dir + "/" + std::to_string(base + k);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) continue;  // no usable folder: the bind() probe decides
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      ::close(fd);
      all = false;
    } else {
      fds.push_back(fd);
    }
  }
  if (!all) {
    for (int fd : fds) ::close(fd);  // closing drops the lock
  }
  return all;  // on success the descriptors stay open, holding the claim
}

// The first of `count` consecutive TCP ports nobody listens on right now on 127.0.0.1,
// chosen the same way as FreePort below (e.g. a fleet's base port: `isthmusctl fleet init` puts
// shard i on base+10i .. base+10i+2). Returns -1 if no such run of ports was found.
inline int FreePortRange(int count) {
  int lo = 0, hi = 0;
  TestPortRange(&lo, &hi);
  static std::atomic<unsigned> counter{0};
  unsigned seed =
      static_cast<unsigned>(::getpid()) * 2654435761u ^
      static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
      (counter.fetch_add(1) * 40503u);
  const int span = hi - lo + 1 - (count - 1);
  if (count < 1 || span < 1) return -1;
  for (int i = 0; i < span; ++i) {
    const int base = lo + static_cast<int>((seed + static_cast<unsigned>(i) * 7919u) % span);
    bool all = true;
    for (int k = 0; k < count && all; ++k) all = CanBindLoopback(base + k);
    if (all && ClaimPorts(base, count)) return base;
  }
  return -1;
}

// A TCP port nobody listens on right now on 127.0.0.1, chosen outside the kernel's
// ephemeral range (net.ipv4.ip_local_port_range). A port from inside that range (what
// binding port 0 gives) can be taken at any moment as the source port of some outgoing
// connection, and tests bind their ports later, often again after a restart: CI saw
// "Address already in use" for a site's peer port that way. Ports are tried from a
// random start, probed with bind() and claimed for this process (ClaimPorts), so no other
// test picks it while this one has not bound it yet, and this one does not pick it twice.
// Returns -1 if no port could be bound.
inline int FreePort() { return FreePortRange(1); }

// A port of the test range held bound (not listening) on 127.0.0.1 for this object's life:
// nobody else can bind it, so a connection to it is refused for sure (a port that FreePort
// found free can be taken by another test a moment later). listen() turns it into a port
// that accepts TCP connections into the kernel's backlog and never answers. port() is -1 if
// no port could be bound.
class HeldPort {
 public:
  HeldPort() : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    for (int i = 0; i < 20 && fd_ >= 0 && port_ < 0; ++i) {
      const int p = FreePort();
      if (p > 0 && BindLoopback(fd_, p)) port_ = p;
    }
  }
  ~HeldPort() {
    if (fd_ >= 0) ::close(fd_);
  }
  HeldPort(const HeldPort&) = delete;
  HeldPort& operator=(const HeldPort&) = delete;
  int port() const { return port_; }
  bool listen() { return port_ > 0 && ::listen(fd_, 16) == 0; }

 private:
  int fd_;
  int port_ = -1;
};

// The ZeroMQ endpoint for `port` on 127.0.0.1.
inline std::string LoopbackEndpoint(int port) { return "tcp://127.0.0.1:" + std::to_string(port); }

}  // namespace isthmus::testing
