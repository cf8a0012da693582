// Runs a real isthmus-server process for integration tests: writes its keys and TOML
// config into a temp folder, picks free loopback ports, starts the binary, waits until
// the admin socket answers, and stops it with SIGTERM or SIGKILL. Clients made by
// WorkerClient()/AdminClient() use CURVE with keys on the server's allowlists.
#pragma once

#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "common/client.h"
#include "common/keys.h"
#include "common/transport.h"
#include "common/wire.h"
#include "tests/loopback.h"

namespace isthmus::testing {

// The program `env` names when it is set (a test binary run away from its build tree, e.g.
// on a GPU machine, finds the programs it starts that way), else the build's.
inline const char* BinaryPath(const char* env, const char* built) {
  const char* p = std::getenv(env);
  return p != nullptr && *p != '\0' ? p : built;
}

class ServerProcess {
 public:
  // `extra` are additional TOML lines (e.g. "[limits]\nmax_message_bytes = 1048576").
  // The process gets its own temp folder, named after the running test, removed at the end.
  explicit ServerProcess(std::string extra_toml = "")
      : ServerProcess(TempDirForTest(), "server", /*owns_dir=*/true) {
    extra_ = std::move(extra_toml);
    WriteConfig();
  }
  ~ServerProcess() {
    Kill(SIGKILL);
    if (owns_dir_) std::filesystem::remove_all(dir_);
  }

  // Starts the binary and waits (up to 30 s times TimeScale()) until the admin socket
  // answers Stats.
  ::testing::AssertionResult Start() {
    log_path_ = (dir_ / ("server-" + std::to_string(starts_++) + ".log")).string();
    pid_ = ::fork();
    if (pid_ == 0) {
      std::freopen(log_path_.c_str(), "w", stderr);
      if (run_as_uid_ >= 0 && ::geteuid() == 0 &&
          (::setgroups(0, nullptr) != 0 || ::setgid(run_as_gid_) != 0 ||
           ::setuid(static_cast<uid_t>(run_as_uid_)) != 0)) {
        std::perror("cannot drop privileges");
        _exit(126);
      }
      for (const auto& [name, value] : env_) ::setenv(name.c_str(), value.c_str(), 1);
      if (!netns_.empty()) {
        const int fd = ::open(("/run/netns/" + netns_).c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) {
          std::perror(("cannot enter network namespace " + netns_).c_str());
          _exit(125);
        }
      }
      std::string cfg = "--config=" + (dir_ / "server.toml").string();
      const char* bin = BinaryPath("ISTHMUS_SERVER_BIN", ISTHMUS_SERVER_BIN);
      ::execl(bin, bin, cfg.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    // Waits by the clock, not by a count of calls: a call can fail at once (a refused
    // handshake) as well as after its 300 ms timeout.
    const int wait_s = 30 * TimeScale();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(wait_s);
    auto admin = AdminClient(300, 0);
    std::string last_error;
    while (std::chrono::steady_clock::now() < deadline) {
      auto st = admin->Stats();
      if (st.ok()) return ::testing::AssertionSuccess();
      last_error = st.status().ToString();
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        last_exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        return ::testing::AssertionFailure() << label_ << " exited at start: " << Log();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return ::testing::AssertionFailure() << label_ << " did not answer within " << wait_s
                                         << " s (last call: " << last_error << "): " << Log();
  }

  // Sends `sig` and waits for the process; returns its exit status (as waitpid's).
  int Kill(int sig) {
    if (pid_ <= 0) return -1;
    ::kill(pid_, sig);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }
  void Signal(int sig) {
    if (pid_ > 0) ::kill(pid_, sig);
  }

  std::unique_ptr<ShardClient> WorkerClient(int timeout_ms = 5000, int retries = 2) const {
    return Client(worker_port_, worker_keys_, timeout_ms, retries);
  }
  std::unique_ptr<ShardClient> AdminClient(int timeout_ms = 5000, int retries = 2) const {
    return Client(admin_port_, admin_keys_, timeout_ms, retries);
  }
  // A client on the worker socket with the given key (e.g. one on no allowlist).
  std::unique_ptr<ShardClient> Client(int port, const KeyPair& keys, int timeout_ms,
                                      int retries) const {
    ClientOptions o;
    o.endpoint = At(port);
    o.server_public_key = server_keys_.public_key;
    o.client_keys = keys;
    o.timeout_ms = timeout_ms;
    o.retries = retries;
    auto c = ShardClient::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }

  std::string Log() const {
    std::ifstream in(log_path_);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  static std::string Endpoint(int port) { return LoopbackEndpoint(port); }
  // This process's endpoint for `port`: loopback, or its address in its network namespace.
  std::string At(int port) const {
    return address_.empty() ? Endpoint(port) : "tcp://" + address_ + ":" + std::to_string(port);
  }
  int worker_port() const { return worker_port_; }
  int admin_port() const { return admin_port_; }
  // Exit code of a server that stopped during Start(); -1 if none or killed by a signal.
  int last_exit_code() const { return last_exit_code_; }
  const KeyPair& server_keys() const { return server_keys_; }
  const KeyPair& worker_keys() const { return worker_keys_; }
  const KeyPair& admin_keys() const { return admin_keys_; }
  std::filesystem::path dir() const { return dir_; }
  void set_extra(std::string extra) {
    extra_ = std::move(extra);
    WriteConfig();
  }
  pid_t pid() const { return pid_; }
  // The server's key pair as its clients know it, after the test rotated it on disk.
  void set_server_keys(const KeyPair& keys) { server_keys_ = keys; }
  // Environment variables set for the process at each Start() (e.g. a preloaded library).
  void set_env(std::map<std::string, std::string> env) { env_ = std::move(env); }
  // Start() runs the binary in network namespace `netns` (one the test made with `ip netns
  // add`), where it listens on `address`, and clients reach it there. Call before the
  // config is written.
  void set_netns(std::string netns, std::string address) {
    netns_ = std::move(netns);
    address_ = std::move(address);
  }
  // When the test runs as root, Start() runs the binary as this user and group, so that
  // the test's own files (root's) are another user's to the server. No effect otherwise.
  void set_run_as(uid_t uid, gid_t gid) {
    run_as_uid_ = static_cast<int64_t>(uid);
    run_as_gid_ = gid;
  }

 protected:
  // Makes `dir` with fresh server, worker and admin keys and picks the worker and admin
  // ports; writes no config (the caller does). `label` names the process in failures.
  ServerProcess(std::filesystem::path dir, std::string label, bool owns_dir)
      : dir_(std::move(dir)), label_(std::move(label)), owns_dir_(owns_dir) {
    if (owns_dir_) std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_ / "workers");
    std::filesystem::create_directories(dir_ / "admins");
    server_keys_ = MakeKeys((dir_ / "server").string());
    worker_keys_ = MakeKeys((dir_ / "workers" / "w0").string());
    admin_keys_ = MakeKeys((dir_ / "admins" / "a0").string());
    worker_port_ = FreePort();
    admin_port_ = FreePort();
  }

  // The [shard], [listen] and [security] tables every config starts with; `peer_port`
  // adds a peer listener when positive, `shard_index` sets shard.index when >= 0.
  void WriteBaseConfig(std::ostream& out, const std::string& shard_id, int peer_port,
                       int shard_index = -1) const {
    // ISTHMUS_TEST_SERVER_LOG_LEVEL=debug makes every server a test starts log at that
    // level, to see what happened in a failure that is hard to reproduce. A dotted key
    // before the first table: the tables the callers append stay as they are.
    if (const char* level = std::getenv("ISTHMUS_TEST_SERVER_LOG_LEVEL"); level && *level) {
      out << "log.level = \"" << level << "\"\n";
    }
    out << "[shard]\nid = \"" << shard_id << "\"\ndata_dir = \"" << (dir_ / "data").string()
        << "\"\n";
    if (shard_index >= 0) out << "index = " << shard_index << "\n";
    out << "[listen]\nworker = \"" << At(worker_port_) << "\"\nadmin = \"" << At(admin_port_)
        << "\"\n";
    if (peer_port > 0) out << "peer = \"" << At(peer_port) << "\"\n";
    out << "[security]\nsecret_key = \"" << (dir_ / "server.key").string() << "\"\n"
        << "worker_keys = [\"" << (dir_ / "workers").string() << "\"]\n"
        << "admin_keys = [\"" << (dir_ / "admins").string() << "\"]\n";
  }

 private:
  static std::filesystem::path TempDirForTest() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = info ? info->name() : "t";
    std::replace(name.begin(), name.end(), '/', '_');  // a parameterized test's "Name/n32"
    return std::filesystem::temp_directory_path() /
           ("isthmus-it-" + name + "-" + std::to_string(::getpid()) + "-" +
            std::to_string(counter_++));
  }
  static KeyPair MakeKeys(const std::string& prefix) {
    auto k = GenerateKeyPair();
    EXPECT_TRUE(k.ok());
    EXPECT_TRUE(WriteKeyPairFiles(prefix, *k, true).ok());
    return *k;
  }
  void WriteConfig() {
    std::ofstream out(dir_ / "server.toml");
    WriteBaseConfig(out, "it", 0);
    out << extra_ << "\n";
  }

  std::string extra_;
  std::map<std::string, std::string> env_;
  std::string netns_, address_;
  std::filesystem::path dir_;
  std::string label_;
  bool owns_dir_ = true;
  std::string log_path_;
  KeyPair server_keys_, worker_keys_, admin_keys_;
  int worker_port_ = 0, admin_port_ = 0;
  pid_t pid_ = -1;
  int starts_ = 0;
  int last_exit_code_ = -1;
  int64_t run_as_uid_ = -1;
  gid_t run_as_gid_ = 0;
  static inline int counter_ = 0;
};

// A DEALER on a server's worker (or admin) socket that sends hand-made frames: for
// requests a ShardClient would never send.
class RawSocket {
 public:
  explicit RawSocket(const ServerProcess& server, bool admin = false)
      : socket_(ctx_, zmq::socket_type::dealer) {
    ConfigureCurveClient(socket_, admin ? server.admin_keys() : server.worker_keys(),
                         server.server_keys().public_key);
    socket_.set(zmq::sockopt::linger, 0);
    socket_.connect(ServerProcess::Endpoint(admin ? server.admin_port() : server.worker_port()));
  }
  // Sends one message of these frames, without waiting for a reply.
  void Send(const std::vector<std::string>& frames) {
    for (size_t i = 0; i < frames.size(); ++i) {
      zmq::message_t m(frames[i].data(), frames[i].size());
      socket_.send(m, i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
  }
  // Waits up to `timeout_ms` for a reply; returns the status it carries (OK for a non-error
  // reply), Timeout when none came. `request_id`, when given, receives the id it echoed.
  Status Receive(uint64_t* request_id = nullptr, int timeout_ms = 5000) {
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(timeout_ms));
    if (!(item.revents & ZMQ_POLLIN)) return Status::Timeout("no reply");
    auto reply = ReceiveMessage(socket_, nullptr);
    if (!reply.ok()) return reply.status();
    auto env = ParseEnvelope(reply->header, WireLimits{});
    if (!env.ok()) return Status::Internal("server sent an unparsable reply");
    if (request_id != nullptr) *request_id = (*env)->request_id();
    return ErrorFromEnvelope(*env);
  }
  // Send, then Receive.
  Status Call(const std::vector<std::string>& frames, uint64_t* request_id = nullptr) {
    Send(frames);
    return Receive(request_id);
  }

 private:
  zmq::context_t ctx_;
  zmq::socket_t socket_;
};

}  // namespace isthmus::testing
