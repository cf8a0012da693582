// Rendezvous stores: the TCP store server and client, the job-scoped wrapper that bounds
// every wait, and the conversion of Gloo's exceptions into Status.
#include "worker/comm/rendezvous.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <thread>
#include <unordered_map>

#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/store.h>

namespace isthmus::comm {

using Clock = std::chrono::steady_clock;

// A store that can say whether keys exist without blocking, so that waits can be timed here
// with millisecond precision.
class PollableStore : public gloo::rendezvous::Store {
 public:
  virtual bool Has(const std::vector<std::string>& keys) = 0;

  void wait(const std::vector<std::string>& keys) override { wait(keys, kDefaultTimeout); }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    const auto deadline = Clock::now() + timeout;
    auto pause = std::chrono::milliseconds(1);
    while (!Has(keys)) {
      if (Clock::now() >= deadline) {
        std::string names;
        for (const auto& k : keys) names += (names.empty() ? "" : ", ") + k;
        throw gloo::IoException(
            gloo::MakeString("Wait timeout for key(s) ", names, " after ", timeout.count(), " ms"));
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(20));
    }
  }
};

namespace {

// Wire format of the TCP store (all integers little-endian, this project's hosts are):
//   request:  op u8 | key_len u32 | value_len u32 | key | value
//   kSet  -> ok u8 (1)
//   kGet  -> found u8 | value_len u32 | value   (value_len 0 when not found)
//   kCheck-> found u8
enum Op : uint8_t { kSet = 1, kGet = 2, kCheck = 3 };
constexpr size_t kHeaderBytes = 9;
constexpr uint32_t kMaxKeyBytes = 4096;
constexpr uint32_t kMaxValueBytes = 64u << 20;

void PutU32(std::vector<char>& out, uint32_t v) {
  char b[4];
  std::memcpy(b, &v, 4);
  out.insert(out.end(), b, b + 4);
}
uint32_t GetU32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

std::string ErrnoText(const std::string& what) { return what + ": " + std::strerror(errno); }

bool SendAll(int fd, const char* data, size_t n) {
  while (n > 0) {
    ssize_t k = ::send(fd, data, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    data += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool RecvAll(int fd, char* data, size_t n) {
  while (n > 0) {
    ssize_t k = ::recv(fd, data, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    data += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

void SetIoTimeout(int fd, std::chrono::milliseconds timeout) {
  timeval tv{};
  tv.tv_sec = timeout.count() / 1000;
  tv.tv_usec = (timeout.count() % 1000) * 1000;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

struct AddrInfoDeleter {
  void operator()(addrinfo* a) const { ::freeaddrinfo(a); }
};

Result<std::unique_ptr<addrinfo, AddrInfoDeleter>> Resolve(const std::string& host, uint16_t port,
                                                           bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string port_text = std::to_string(port);
  int rc = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &res);
  if (rc != 0) {
    return Status::Unavailable("cannot resolve '" + host + "': " + ::gai_strerror(rc));
  }
  return std::unique_ptr<addrinfo, AddrInfoDeleter>(res);
}

// Gloo's FileStore measures its wait timeout in whole seconds (a 2 s timeout expires after
// 3 s); its protected check() lets the wait above be exact instead.
class FileStore : public PollableStore {
 public:
  explicit FileStore(const std::string& dir) : store_(dir) {}
  // Gloo's set refuses a key that exists; a launch's rendezvous rewrites its own (a rank's
  // nonce over an earlier launch's), so this writes the file as Gloo does and renames it
  // over the old one.
  void set(const std::string& key, const std::vector<char>& data) override {
    store_.Overwrite(key, data);
  }
  std::vector<char> get(const std::string& key) override { return store_.get(key); }
  bool Has(const std::vector<std::string>& keys) override { return store_.Check(keys); }

 private:
  struct Checkable : gloo::rendezvous::FileStore {
    using gloo::rendezvous::FileStore::FileStore;
    bool Check(const std::vector<std::string>& keys) { return check(keys); }
    void Overwrite(const std::string& key, const std::vector<char>& data) {
      const std::string tmp = tmpPath(key), path = objectPath(key);
      {
        std::ofstream out(tmp, std::ios::out | std::ios::trunc | std::ios::binary);
        out.write(data.data(), static_cast<std::streamsize>(data.size()));
        if (!out) throw gloo::IoException(gloo::MakeString("cannot write ", tmp));
      }
      if (::rename(tmp.c_str(), path.c_str()) != 0) {
        throw gloo::IoException(gloo::MakeString("rename ", tmp, ": ", std::strerror(errno)));
      }
    }
  };
  Checkable store_;
};

// Gloo's Store interface over one connection to a TcpStoreServer. Methods throw
// gloo::IoException on failure, as Gloo expects of a store.
class TcpStoreClient : public PollableStore {
 public:
  TcpStoreClient(int fd, std::chrono::milliseconds timeout) : fd_(fd), timeout_(timeout) {}
  ~TcpStoreClient() override { ::close(fd_); }

  void set(const std::string& key, const std::vector<char>& data) override {
    std::vector<char> reply = Call(kSet, key, data, 1);
    (void)reply;
  }

  std::vector<char> get(const std::string& key) override {
    wait({key}, timeout_);
    std::vector<char> reply = Call(kGet, key, {}, 5);
    if (reply[0] == 0)
      throw gloo::IoException(gloo::MakeString("tcp store: key '", key, "' vanished"));
    uint32_t len = GetU32(reply.data() + 1);
    if (len > kMaxValueBytes)
      throw gloo::IoException(gloo::MakeString("tcp store: value too large"));
    std::vector<char> value(len);
    if (len > 0 && !RecvAll(fd_, value.data(), len)) {
      throw gloo::IoException(gloo::MakeString("tcp store: connection lost reading '", key, "'"));
    }
    return value;
  }

  bool Has(const std::vector<std::string>& keys) override {
    for (const std::string& key : keys) {
      if (Call(kCheck, key, {}, 1)[0] == 0) return false;
    }
    return true;
  }

 private:
  // Sends one request and reads the first `reply_bytes` of its reply.
  std::vector<char> Call(Op op, const std::string& key, const std::vector<char>& value,
                         size_t reply_bytes) {
    std::vector<char> frame;
    frame.reserve(kHeaderBytes + key.size() + value.size());
    frame.push_back(static_cast<char>(op));
    PutU32(frame, static_cast<uint32_t>(key.size()));
    PutU32(frame, static_cast<uint32_t>(value.size()));
    frame.insert(frame.end(), key.begin(), key.end());
    frame.insert(frame.end(), value.begin(), value.end());
    std::vector<char> reply(reply_bytes);
    if (!SendAll(fd_, frame.data(), frame.size()) || !RecvAll(fd_, reply.data(), reply.size())) {
      throw gloo::IoException(
          gloo::MakeString("tcp store: connection lost (", std::strerror(errno), ")"));
    }
    return reply;
  }

  int fd_;
  std::chrono::milliseconds timeout_;
};

Result<std::unique_ptr<PollableStore>> ConnectTcpStore(const std::string& host, uint16_t port,
                                                       std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::string last_error = "no address";
  while (true) {
    auto addrs = Resolve(host, port, false);
    if (addrs.ok()) {
      for (addrinfo* a = addrs->get(); a != nullptr; a = a->ai_next) {
        int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          int one = 1;
          ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
          SetIoTimeout(fd, timeout);
          return std::unique_ptr<PollableStore>(new TcpStoreClient(fd, timeout));
        }
        last_error = ErrnoText("connect");
        ::close(fd);
      }
    } else {
      last_error = addrs.status().message();
    }
    if (Clock::now() >= deadline) {
      return Status::Timeout("tcp store " + host + ":" + std::to_string(port) +
                             " not reachable within " + std::to_string(timeout.count()) +
                             " ms: " + last_error);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// Prefixes keys with the job's prefix and bounds every wait (Gloo's own stores fall back to a
// fixed 30 s when called without a timeout).
class ScopedStore : public gloo::rendezvous::Store {
 public:
  ScopedStore(PollableStore& base, std::string prefix, std::chrono::milliseconds timeout)
      : base_(base), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    base_.set(Key(key), data);
  }
  std::vector<char> get(const std::string& key) override {
    base_.wait({Key(key)}, timeout_);
    return base_.get(Key(key));
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const auto& k : keys) full.push_back(Key(k));
    base_.wait(full, std::min(timeout, timeout_));
  }

 private:
  std::string Key(const std::string& key) const { return prefix_ + "/" + key; }

  PollableStore& base_;
  const std::string prefix_;
  const std::chrono::milliseconds timeout_;
};

bool ContainsTimeout(std::string_view text) {
  std::string lower(text);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return lower.find("timeout") != std::string::npos || lower.find("timed out") != std::string::npos;
}

}  // namespace

Result<RendezvousSpec> ParseRendezvous(std::string_view spec) {
  RendezvousSpec out;
  if (spec.starts_with("file:")) {
    out.kind = RendezvousSpec::Kind::kFile;
    out.dir = std::string(spec.substr(5));
    if (out.dir.empty()) return Status::InvalidArgument("rendezvous 'file:' needs a directory");
    return out;
  }
  if (!spec.starts_with("tcp:")) {
    return Status::InvalidArgument("rendezvous '" + std::string(spec) +
                                   "' is neither file:DIR nor tcp:HOST:PORT");
  }
  out.kind = RendezvousSpec::Kind::kTcp;
  std::string_view rest = spec.substr(4);
  size_t colon = rest.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == rest.size()) {
    return Status::InvalidArgument("rendezvous '" + std::string(spec) + "' must be tcp:HOST:PORT");
  }
  std::string_view host = rest.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  out.host = std::string(host);
  unsigned long port = 0;
  for (char c : rest.substr(colon + 1)) {
    if (c < '0' || c > '9' || port > 65535) {
      return Status::InvalidArgument("rendezvous '" + std::string(spec) + "': bad port");
    }
    port = port * 10 + static_cast<unsigned long>(c - '0');
  }
  if (port == 0 || port > 65535) {
    return Status::InvalidArgument("rendezvous '" + std::string(spec) + "': bad port");
  }
  out.port = static_cast<uint16_t>(port);
  return out;
}

struct TcpStoreServer::Thread {
  std::thread thread;
};

Result<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(const std::string& host,
                                                              uint16_t port) {
  ISTHMUS_ASSIGN_OR_RETURN(auto addrs, Resolve(host, port, true));
  std::string last_error = "no address";
  int fd = -1;
  for (addrinfo* a = addrs.get(); a != nullptr; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0) break;
    last_error = ErrnoText("bind " + host + ":" + std::to_string(port));
    ::close(fd);
    fd = -1;
  }
  if (fd < 0) return Status::Unavailable("tcp store server: " + last_error);

  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  uint16_t bound_port = bound.ss_family == AF_INET6
                            ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                            : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);

  std::unique_ptr<TcpStoreServer> server(new TcpStoreServer());
  server->listen_fd_ = fd;
  server->port_ = bound_port;
  server->wake_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (server->wake_fd_ < 0) return Status::Internal(ErrnoText("eventfd"));
  server->thread_ = std::make_unique<Thread>();
  server->thread_->thread = std::thread([s = server.get()] {
    pthread_setname_np(pthread_self(), "comm-store");
    s->Serve();
  });
  return server;
}

TcpStoreServer::~TcpStoreServer() {
  if (thread_ && thread_->thread.joinable()) {
    uint64_t one = 1;
    ssize_t n = ::write(wake_fd_, &one, sizeof(one));
    (void)n;
    thread_->thread.join();
  }
  if (wake_fd_ >= 0) ::close(wake_fd_);
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

void TcpStoreServer::Serve() {
  std::unordered_map<std::string, std::vector<char>> kv;
  std::map<int, std::vector<char>> inbox;  // per client: bytes not yet parsed
  std::vector<pollfd> fds;
  while (true) {
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    for (const auto& [fd, buf] : inbox) fds.push_back({fd, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[0].revents != 0) break;
    if (fds[1].revents & POLLIN) {
      int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client >= 0) {
        int one = 1;
        ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        // Replies are a few bytes; a client that stops reading is dropped, not waited for.
        SetIoTimeout(client, std::chrono::milliseconds(1000));
        inbox[client];
      }
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const int fd = fds[i].fd;
      std::vector<char>& buf = inbox[fd];
      char chunk[64 * 1024];
      ssize_t n = ::recv(fd, chunk, sizeof(chunk), MSG_DONTWAIT);
      bool drop = n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR);
      if (n > 0) buf.insert(buf.end(), chunk, chunk + n);
      // Answer every complete request in the buffer.
      while (!drop && buf.size() >= kHeaderBytes) {
        const uint8_t op = static_cast<uint8_t>(buf[0]);
        const uint32_t key_len = GetU32(buf.data() + 1);
        const uint32_t value_len = GetU32(buf.data() + 5);
        if (key_len > kMaxKeyBytes || value_len > kMaxValueBytes ||
            (op != kSet && op != kGet && op != kCheck)) {
          drop = true;
          break;
        }
        if (buf.size() < kHeaderBytes + key_len + value_len) break;
        std::string key(buf.data() + kHeaderBytes, key_len);
        const char* value = buf.data() + kHeaderBytes + key_len;
        std::vector<char> reply;
        if (op == kSet) {
          kv[key].assign(value, value + value_len);
          reply.push_back(1);
        } else {
          auto it = kv.find(key);
          reply.push_back(it != kv.end() ? 1 : 0);
          if (op == kGet) {
            PutU32(reply, it != kv.end() ? static_cast<uint32_t>(it->second.size()) : 0);
            if (it != kv.end()) reply.insert(reply.end(), it->second.begin(), it->second.end());
          }
        }
        buf.erase(buf.begin(), buf.begin() + kHeaderBytes + key_len + value_len);
        if (!SendAll(fd, reply.data(), reply.size())) drop = true;
      }
      if (drop) {
        ::close(fd);
        inbox.erase(fd);
      }
    }
  }
  for (const auto& [fd, buf] : inbox) ::close(fd);
}

Result<std::unique_ptr<Rendezvous>> Rendezvous::Open(const std::string& spec, int rank,
                                                     const std::string& prefix,
                                                     std::chrono::milliseconds timeout) {
  ISTHMUS_ASSIGN_OR_RETURN(RendezvousSpec parsed, ParseRendezvous(spec));
  if (prefix.empty() || prefix.find('/') != std::string::npos) {
    return Status::InvalidArgument("rendezvous prefix '" + prefix +
                                   "' must be non-empty and contain no '/'");
  }
  std::unique_ptr<Rendezvous> r(new Rendezvous());
  if (parsed.kind == RendezvousSpec::Kind::kFile) {
    std::error_code ec;
    if (!std::filesystem::is_directory(parsed.dir, ec)) {
      return Status::NotFound("rendezvous directory '" + parsed.dir + "' does not exist");
    }
    try {
      r->base_ = std::make_unique<FileStore>(parsed.dir);
    } catch (const std::exception& e) {
      return StatusFromGlooException("file store", e);
    }
  } else {
    if (rank == 0) {
      ISTHMUS_ASSIGN_OR_RETURN(r->server_, TcpStoreServer::Start(parsed.host, parsed.port));
    }
    ISTHMUS_ASSIGN_OR_RETURN(r->base_, ConnectTcpStore(parsed.host, parsed.port, timeout));
  }
  r->scoped_ = std::make_unique<ScopedStore>(*r->base_, prefix, timeout);
  r->prefix_ = prefix;
  r->timeout_ = timeout;
  return r;
}

Status Rendezvous::AgreeOnLaunch(int rank, int world_size) {
  if (!launch_id_.empty()) return Status::FailedPrecondition("AgreeOnLaunch called twice");
  std::random_device device;
  auto random_hex = [&device] {
    char buf[33];
    std::snprintf(buf, sizeof buf, "%08x%08x%08x%08x", device(), device(), device(), device());
    return std::string(buf);
  };
  const auto deadline = Clock::now() + timeout_;
  auto key = [&](const char* what, int r) {
    return prefix_ + "/launch-" + what + "/" + std::to_string(r);
  };
  auto read = [&](const std::string& k) -> std::string {
    if (!base_->Has({k})) return "";
    const std::vector<char> v = base_->get(k);
    return std::string(v.begin(), v.end());
  };
  auto write = [&](const std::string& k, const std::string& v) {
    base_->set(k, std::vector<char>(v.begin(), v.end()));
  };
  try {
    if (rank == 0) {
      const std::string id = random_hex();
      std::vector<std::string> echoed(world_size);    // the nonce answered, per rank
      std::vector<std::string> mismatch(world_size);  // a rank's other world size
      std::vector<bool> done(world_size, false);
      for (;;) {
        bool all = true;
        for (int r = 1; r < world_size; ++r) {
          if (done[r]) continue;
          // A nonce that changed (an earlier launch's was read first) is answered again.
          const std::string nonce = read(key("hello", r));
          if (!nonce.empty() && nonce != echoed[r]) {
            // "NONCE/WORLD": a rank launched with another world size is told, and stops.
            const auto slash = nonce.find('/');
            const std::string theirs = slash == std::string::npos ? "" : nonce.substr(slash + 1);
            if (theirs != std::to_string(world_size)) {
              write(key("answer", r), "refused:" + nonce);
              mismatch[r] = theirs;
            } else {
              write(key("answer", r), id + ":" + nonce);
              mismatch[r].clear();
            }
            echoed[r] = nonce;
          }
          done[r] = !echoed[r].empty() && read(key("ack", r)) == id + ":" + echoed[r];
          all = all && done[r];
        }
        for (int r = 1; r < world_size; ++r) {
          if (!mismatch[r].empty()) {
            // Rank 0 may serve the store: it stops only once the refused rank has read its
            // refusal (or at the deadline), so that rank learns why rather than losing the
            // connection.
            while (read(key("ack", r)) != "refused:" + echoed[r] && Clock::now() < deadline) {
              std::this_thread::sleep_for(std::chrono::milliseconds(5));
            }
            return Status::FailedPrecondition(
                "rank " + std::to_string(r) + " was launched with --world-size " + mismatch[r] +
                " but rank 0 with " + std::to_string(world_size) +
                ": give every rank of the site the same --world-size");
          }
        }
        if (all) break;
        if (Clock::now() >= deadline) {
          std::string missing;
          for (int r = 1; r < world_size; ++r) {
            if (!done[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
          }
          return Status::Timeout("rendezvous: rank(s) " + missing +
                                 " did not join this launch within " +
                                 std::to_string(timeout_.count()) + " ms");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      launch_id_ = id;
    } else {
      const std::string nonce = random_hex() + "/" + std::to_string(world_size);
      write(key("hello", rank), nonce);
      for (;;) {
        const std::string answer = read(key("answer", rank));
        if (answer == "refused:" + nonce) {
          try {
            write(key("ack", rank), answer);
          } catch (const std::exception&) {
            // Rank 0 is gone already; the refusal was read, which is all that counts.
          }
          return Status::FailedPrecondition(
              "rank 0 was launched with another --world-size than this rank " +
              std::to_string(rank) + " (" + std::to_string(world_size) +
              "): give every rank of the site the same --world-size");
        }
        const auto colon = answer.find(':');
        if (colon != std::string::npos && answer.substr(colon + 1) == nonce) {
          launch_id_ = answer.substr(0, colon);
          write(key("ack", rank), answer);
          break;
        }
        if (Clock::now() >= deadline) {
          return Status::Timeout("rendezvous: rank 0 did not answer rank " + std::to_string(rank) +
                                 " for this launch within " + std::to_string(timeout_.count()) +
                                 " ms");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
  } catch (const std::exception& e) {
    return StatusFromGlooException("rendezvous: agreeing on the launch", e);
  }
  // Every later key of this launch carries its id.
  scoped_ = std::make_unique<ScopedStore>(*base_, prefix_ + "." + launch_id_, timeout_);
  return Status::Ok();
}

Rendezvous::~Rendezvous() {
  // The client connection goes before the server it talks to.
  scoped_.reset();
  base_.reset();
  server_.reset();
}

Status Rendezvous::Set(const std::string& key, const std::vector<char>& value) {
  try {
    scoped_->set(key, value);
    return Status::Ok();
  } catch (const std::exception& e) {
    return StatusFromGlooException("rendezvous set '" + key + "'", e);
  }
}

Result<std::vector<char>> Rendezvous::Get(const std::string& key) {
  try {
    return scoped_->get(key);
  } catch (const std::exception& e) {
    return StatusFromGlooException("rendezvous get '" + key + "'", e);
  }
}

gloo::rendezvous::Store& Rendezvous::store() { return *scoped_; }

void Rendezvous::StopServing() { server_.reset(); }

Status StatusFromGlooException(std::string_view what, const std::exception& e) {
  std::string message = std::string(what) + ": " + e.what();
  if (dynamic_cast<const gloo::IoException*>(&e) != nullptr) {
    return ContainsTimeout(e.what()) ? Status::Timeout(std::move(message))
                                     : Status::Unavailable(std::move(message));
  }
  // EnforceNotMet and plain gloo::Exception: a broken invariant or misuse, but Gloo also
  // reports some transport timeouts this way, so look at the text too.
  if (ContainsTimeout(e.what())) return Status::Timeout(std::move(message));
  return Status::Internal(std::move(message));
}

namespace {

// Marks `key` as read by this rank; rank 0 returns once every rank has. Rank 0 may serve
// the store (tcp:) and takes it down when it stops, so it must not stop on a mismatch while
// a rank is still reading (that rank would see the connection lost, not the mismatch).
// The other ranks have read all they need by now: a mark that fails means rank 0 is gone
// and changes nothing for them.
Status AllHaveRead(Rendezvous& rendezvous, int rank, int world_size, const std::string& key) {
  Status marked = rendezvous.Set(key + "-read/" + std::to_string(rank), {'1'});
  if (rank != 0) return Status::Ok();
  ISTHMUS_RETURN_IF_ERROR(marked);
  for (int other = 1; other < world_size; ++other) {
    ISTHMUS_RETURN_IF_ERROR(rendezvous.Get(key + "-read/" + std::to_string(other)).status());
  }
  return Status::Ok();
}

}  // namespace

Status AgreeOnDistinctDevices(Rendezvous& rendezvous, int rank, int world_size,
                              const std::string& device) {
  ISTHMUS_RETURN_IF_ERROR(rendezvous.Set("device/" + std::to_string(rank),
                                         std::vector<char>(device.begin(), device.end())));
  // Every rank reads every rank's device, so all of them stop, not only the pair.
  std::map<std::string, int> first_holder;
  Status verdict = Status::Ok();
  for (int r = 0; r < world_size; ++r) {
    std::string theirs = device;
    if (r != rank) {
      ISTHMUS_ASSIGN_OR_RETURN(std::vector<char> v, rendezvous.Get("device/" + std::to_string(r)));
      theirs.assign(v.begin(), v.end());
    }
    auto [it, fresh] = first_holder.emplace(theirs, r);
    if (!fresh && verdict.ok()) {
      verdict = Status::FailedPrecondition(
          "ranks " + std::to_string(it->second) + " and " + std::to_string(r) + " both use " +
          theirs +
          ": one rank per GPU (give each rank of a node its own --local-rank or "
          "--device cuda:N)");
    }
  }
  ISTHMUS_RETURN_IF_ERROR(AllHaveRead(rendezvous, rank, world_size, "device"));
  return verdict;
}

namespace {

// Writes this rank's `value` under key/<rank> and reads every other rank's; the first
// that differs becomes FailedPrecondition(differ(other, theirs)), returned once every rank
// has read every value.
Status AgreeOnValue(Rendezvous& rendezvous, int rank, int world_size, const std::string& key,
                    const std::string& value,
                    const std::function<std::string(int, const std::string&)>& differ) {
  ISTHMUS_RETURN_IF_ERROR(rendezvous.Set(key + "/" + std::to_string(rank),
                                         std::vector<char>(value.begin(), value.end())));
  Status verdict = Status::Ok();
  for (int other = 0; other < world_size; ++other) {
    if (other == rank) continue;
    ISTHMUS_ASSIGN_OR_RETURN(std::vector<char> theirs,
                             rendezvous.Get(key + "/" + std::to_string(other)));
    const std::string them(theirs.begin(), theirs.end());
    if (them != value && verdict.ok()) verdict = Status::FailedPrecondition(differ(other, them));
  }
  ISTHMUS_RETURN_IF_ERROR(AllHaveRead(rendezvous, rank, world_size, key));
  return verdict;
}

}  // namespace

Status AgreeOnKind(Rendezvous& rendezvous, int rank, int world_size, const std::string& kind) {
  return AgreeOnValue(rendezvous, rank, world_size, "kind", kind,
                      [&](int other, const std::string& theirs) {
                        return "rank " + std::to_string(other) + " joined as " + theirs +
                               " but rank " + std::to_string(rank) + " as " + kind +
                               ": all ranks of a site must use the same device kind (the same "
                               "--device family)";
                      });
}

Status AgreeOnSettings(Rendezvous& rendezvous, int rank, int world_size,
                       const std::string& settings) {
  return AgreeOnValue(rendezvous, rank, world_size, "settings", settings,
                      [&](int other, const std::string& theirs) {
                        return "rank " + std::to_string(other) + " was launched with " + theirs +
                               " but rank " + std::to_string(rank) + " with " + settings +
                               ": every rank of a site must be launched with the same value";
                      });
}

}  // namespace isthmus::comm
