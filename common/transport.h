// ZeroMQ plumbing shared by the server, the client library and isthmusctl: CURVE set-up
// for server and client sockets, and the ZAP handler that admits only allow-listed
// public keys per role. Every socket a server binds names its role as its ZAP domain
// ("worker", "peer", "admin"); the handler looks the client's key up in that domain's
// allowlist.
//
// Threads: ZapHandler owns one thread ("zap") that serves libzmq's authentication
// requests; every other method may be called from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "common/keys.h"
#include "common/status.h"

namespace isthmus {

// ZAP domains, one per role/socket.
inline constexpr const char* kDomainWorker = "worker";
inline constexpr const char* kDomainPeer = "peer";
inline constexpr const char* kDomainAdmin = "admin";

class ZapHandler {
 public:
  // Binds inproc://zeromq.zap.01 in `ctx`. Must be started before any CURVE server
  // socket of that context binds, and stopped before the context is closed.
  explicit ZapHandler(zmq::context_t& ctx);
  ~ZapHandler();
  ZapHandler(const ZapHandler&) = delete;
  ZapHandler& operator=(const ZapHandler&) = delete;

  Status Start();
  void Stop();

  // Replaces the allowlist of `domain` (Z85 public keys). Unknown domains admit nobody.
  // Returns the keys that were on it and are not any more. Any thread.
  std::vector<std::string> SetAllowlist(const std::string& domain,
                                        const std::vector<std::string>& keys);
  // Takes `key` off the allowlist of `domain` from the next handshake on (a revoked key);
  // returns whether it was on it. Any thread.
  bool Revoke(const std::string& domain, const std::string& key);

  // Whether `key` is on the allowlist of `domain` now. Any thread.
  bool Admit(const std::string& domain, const std::string& key) const;

  uint64_t accepted() const { return accepted_.load(); }
  uint64_t rejected() const { return rejected_.load(); }

 private:
  void Run();

  zmq::context_t& ctx_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> rejected_{0};
  mutable std::mutex mu_;
  std::map<std::string, std::set<std::string>> allow_;  // GUARDED_BY(mu_)
  Status start_status_;
  std::atomic<bool> started_{false};
};

// Makes `socket` a CURVE server with `server_keys`, authenticated in ZAP `domain`.
// Call before bind().
void ConfigureCurveServer(zmq::socket_t& socket, const KeyPair& server_keys,
                          const std::string& domain);

// Makes `socket` a CURVE client of the server whose public key is `server_public`.
// Call before connect().
void ConfigureCurveClient(zmq::socket_t& socket, const KeyPair& client_keys,
                          const std::string& server_public);

}  // namespace isthmus
