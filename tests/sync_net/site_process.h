// Runs one site's single shard as a real isthmus-server process for the multi-site tests:
// its own keys, ports (worker, admin, peer) and TOML config naming the other sites as
// peers, so several sites can run side by side on loopback with CURVE.
#pragma once

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/client.h"
#include "common/keys.h"

namespace isthmus::testing {

inline int FreeLoopbackPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

class SiteProcess {
 public:
  SiteProcess(std::string site, const std::filesystem::path& root) : site_(std::move(site)) {
    dir_ = root / site_;
    std::filesystem::create_directories(dir_ / "workers");
    std::filesystem::create_directories(dir_ / "admins");
    server_keys_ = MakeKeys((dir_ / "server").string());
    worker_keys_ = MakeKeys((dir_ / "workers" / "w0").string());
    admin_keys_ = MakeKeys((dir_ / "admins" / "a0").string());
    worker_port_ = FreeLoopbackPort();
    admin_port_ = FreeLoopbackPort();
    peer_port_ = FreeLoopbackPort();
  }
  ~SiteProcess() { Kill(SIGKILL); }

  // Writes the config: every site in `all` other than this one is a peer. `extra_sync` is
  // added to the [sync] table (e.g. "outer_momentum = 0.9"). Sites named in `unlisted`
  // stay peers but their keys are left off security.peer_keys.
  void Configure(const std::vector<SiteProcess*>& all, const std::string& extra_sync = "",
                 const std::set<std::string>& unlisted = {}) {
    std::ofstream out(dir_ / "server.toml");
    out << "[shard]\nid = \"" << site_ << "-0\"\ndata_dir = \"" << (dir_ / "data").string()
        << "\"\n"
        << "[listen]\nworker = \"" << Endpoint(worker_port_) << "\"\nadmin = \""
        << Endpoint(admin_port_) << "\"\npeer = \"" << Endpoint(peer_port_) << "\"\n"
        << "[security]\nsecret_key = \"" << (dir_ / "server.key").string() << "\"\n"
        << "worker_keys = [\"" << (dir_ / "workers").string() << "\"]\n"
        << "admin_keys = [\"" << (dir_ / "admins").string() << "\"]\n"
        << "peer_keys = [";
    bool first = true;
    for (auto* s : all) {
      if (s == this || unlisted.count(s->site_)) continue;
      out << (first ? "" : ", ") << "\"" << (s->dir_ / "server.pub").string() << "\"";
      first = false;
    }
    out << "]\n[sync]\nsite = \"" << site_ << "\"\npeers = [";
    first = true;
    for (auto* s : all) {
      if (s == this) continue;
      out << (first ? "" : ", ") << "\"" << s->site_ << "=" << Endpoint(s->peer_port_) << "="
          << (s->dir_ / "server.pub").string() << "\"";
      first = false;
    }
    out << "]\nresend_ms = 300\nbackoff_max_ms = 1500\n" << extra_sync << "\n";
  }

  ::testing::AssertionResult Start() {
    log_path_ = (dir_ / ("server-" + std::to_string(starts_++) + ".log")).string();
    pid_ = ::fork();
    if (pid_ == 0) {
      std::freopen(log_path_.c_str(), "w", stderr);
      std::string cfg = "--config=" + (dir_ / "server.toml").string();
      ::execl(ISTHMUS_SERVER_BIN, ISTHMUS_SERVER_BIN, cfg.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    auto admin = Admin(300, 0);
    for (int i = 0; i < 100; ++i) {
      if (admin->Stats().ok()) return ::testing::AssertionSuccess();
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return ::testing::AssertionFailure() << site_ << " exited at start: " << Log();
      }
    }
    return ::testing::AssertionFailure() << site_ << " did not answer: " << Log();
  }
  void Kill(int sig) {
    if (pid_ <= 0) return;
    ::kill(pid_, sig);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }

  std::unique_ptr<ShardClient> Worker(int timeout_ms = 5000, int retries = 2) const {
    return Client(worker_port_, worker_keys_, timeout_ms, retries);
  }
  std::unique_ptr<ShardClient> Admin(int timeout_ms = 5000, int retries = 2) const {
    return Client(admin_port_, admin_keys_, timeout_ms, retries);
  }
  std::string Log() const {
    std::ifstream in(log_path_);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  const std::string& site() const { return site_; }
  const std::filesystem::path& dir() const { return dir_; }
  std::string admin_endpoint() const { return Endpoint(admin_port_); }
  std::string peer_endpoint() const { return Endpoint(peer_port_); }
  const KeyPair& server_keys() const { return server_keys_; }
  static std::string Endpoint(int port) { return "tcp://127.0.0.1:" + std::to_string(port); }

 private:
  static KeyPair MakeKeys(const std::string& prefix) {
    auto k = GenerateKeyPair();
    EXPECT_TRUE(k.ok());
    EXPECT_TRUE(WriteKeyPairFiles(prefix, *k, true).ok());
    return *k;
  }
  std::unique_ptr<ShardClient> Client(int port, const KeyPair& keys, int timeout_ms,
                                      int retries) const {
    ClientOptions o;
    o.endpoint = Endpoint(port);
    o.server_public_key = server_keys_.public_key;
    o.client_keys = keys;
    o.timeout_ms = timeout_ms;
    o.retries = retries;
    auto c = ShardClient::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }

  std::string site_;
  std::filesystem::path dir_;
  std::string log_path_;
  KeyPair server_keys_, worker_keys_, admin_keys_;
  int worker_port_ = 0, admin_port_ = 0, peer_port_ = 0;
  pid_t pid_ = -1;
  int starts_ = 0;
};

}  // namespace isthmus::testing
