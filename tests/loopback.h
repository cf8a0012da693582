// Loopback helpers shared by the tests that open real sockets.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

namespace isthmus::testing {

// A TCP port nobody listens on right now on 127.0.0.1: bound to port 0, read back,
// released. Another process could take it in between; tests accept that small race.
// Returns -1 if no port could be bound.
inline int FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return -1;
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

// The ZeroMQ endpoint for `port` on 127.0.0.1.
inline std::string LoopbackEndpoint(int port) { return "tcp://127.0.0.1:" + std::to_string(port); }

}  // namespace isthmus::testing
