// The ZAP handler (ZeroMQ RFC 27) and CURVE socket options.
#include "common/transport.h"

#include <spdlog/spdlog.h>

#include <cerrno>

namespace isthmus {

ZapHandler::ZapHandler(zmq::context_t& ctx) : ctx_(ctx) {}

ZapHandler::~ZapHandler() { Stop(); }

Status ZapHandler::Start() {
  if (started_.exchange(true)) return Status::Ok();
  std::mutex m;
  std::condition_variable cv;
  bool ready = false;
  thread_ = std::thread([&, this] {
    pthread_setname_np(pthread_self(), "zap");
    zmq::socket_t sock(ctx_, zmq::socket_type::rep);
    try {
      sock.set(zmq::sockopt::linger, 0);
      sock.bind("inproc://zeromq.zap.01");
    } catch (const zmq::error_t& e) {
      std::lock_guard lk(m);
      start_status_ = Status::Internal(std::string("cannot bind ZAP endpoint: ") + e.what());
      ready = true;
      cv.notify_one();
      return;
    }
    {
      std::lock_guard lk(m);
      ready = true;
      cv.notify_one();
    }
    // Serve until Stop(); poll with a timeout so the stop flag is seen.
    while (!stop_.load()) {
      zmq::pollitem_t item{sock.handle(), 0, ZMQ_POLLIN, 0};
      try {
        if (zmq::poll(&item, 1, std::chrono::milliseconds(100)) == 0) continue;
      } catch (const zmq::error_t& e) {
        if (e.num() == EINTR) continue;  // a signal landed on this thread
        break;                           // context terminated
      }
      std::vector<zmq::message_t> frames;
      while (true) {
        zmq::message_t f;
        if (!sock.recv(f, zmq::recv_flags::none)) break;
        bool more = f.more();
        frames.push_back(std::move(f));
        if (!more) break;
      }
      // Request: version, request id, domain, address, identity, mechanism, credentials...
      std::string version = frames.size() > 0 ? frames[0].to_string() : "";
      std::string request_id = frames.size() > 1 ? frames[1].to_string() : "";
      std::string domain = frames.size() > 2 ? frames[2].to_string() : "";
      std::string address = frames.size() > 3 ? frames[3].to_string() : "";
      std::string mechanism = frames.size() > 5 ? frames[5].to_string() : "";
      std::string key;
      bool ok = false;
      if (version == "1.0" && mechanism == "CURVE" && frames.size() > 6 && frames[6].size() == 32) {
        char z85[41];
        zmq_z85_encode(z85, static_cast<const uint8_t*>(frames[6].data()), 32);
        key = z85;
        ok = Admit(domain, key);
      }
      if (ok) {
        ++accepted_;
        spdlog::debug("zap: admitted key {} on {} from {}", key, domain, address);
      } else {
        ++rejected_;
        spdlog::warn("zap: refused {} key '{}' on the {} socket from {} (not in its allowlist)",
                     mechanism.empty() ? "unauthenticated" : mechanism, key, domain, address);
      }
      std::array<std::string, 6> reply = {
          "1.0", request_id, ok ? "200" : "400", ok ? "OK" : "key not allowed", ok ? key : "", ""};
      for (size_t i = 0; i < reply.size(); ++i) {
        sock.send(zmq::buffer(reply[i]),
                  i + 1 < reply.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
      }
    }
  });
  std::unique_lock lk(m);
  cv.wait(lk, [&] { return ready; });
  return start_status_;
}

void ZapHandler::Stop() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

std::vector<std::string> ZapHandler::SetAllowlist(const std::string& domain,
                                                  const std::vector<std::string>& keys) {
  std::set<std::string> next(keys.begin(), keys.end());
  std::vector<std::string> removed;
  std::lock_guard lk(mu_);
  for (const auto& k : allow_[domain]) {
    if (next.count(k) == 0) removed.push_back(k);
  }
  allow_[domain] = std::move(next);
  return removed;
}

bool ZapHandler::Revoke(const std::string& domain, const std::string& key) {
  std::lock_guard lk(mu_);
  auto it = allow_.find(domain);
  return it != allow_.end() && it->second.erase(key) > 0;
}

bool ZapHandler::Admit(const std::string& domain, const std::string& key) const {
  std::lock_guard lk(mu_);
  auto it = allow_.find(domain);
  return it != allow_.end() && it->second.count(key) > 0;
}

void ConfigureCurveServer(zmq::socket_t& socket, const KeyPair& server_keys,
                          const std::string& domain) {
  socket.set(zmq::sockopt::curve_server, true);
  socket.set(zmq::sockopt::curve_secretkey, server_keys.secret_key);
  socket.set(zmq::sockopt::zap_domain, domain);
}

void ConfigureCurveClient(zmq::socket_t& socket, const KeyPair& client_keys,
                          const std::string& server_public) {
  socket.set(zmq::sockopt::curve_serverkey, server_public);
  socket.set(zmq::sockopt::curve_publickey, client_keys.public_key);
  socket.set(zmq::sockopt::curve_secretkey, client_keys.secret_key);
}

}  // namespace isthmus
