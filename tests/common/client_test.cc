// How long a ShardClient call waits when its shard is not there (issue 27 item 8): a dead
// endpoint, an endpoint that accepts TCP but never completes the ZeroMQ handshake, a
// connection that drops before the reply, and a caller that asks the call to stop. The
// shard is a plaintext ROUTER in this process (or nothing), so each case is exact.
#include "common/client.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "common/keys.h"
#include "common/transport.h"
#include "common/wire.h"
#include "tests/loopback.h"

namespace isthmus {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using isthmus::testing::FreePort;
using isthmus::testing::HeldPort;
using isthmus::testing::LoopbackEndpoint;

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

ClientOptions Plaintext(int port) {
  ClientOptions o;
  o.endpoint = LoopbackEndpoint(port);
  o.insecure_plaintext = true;
  return o;
}

// A stand-in shard: a ROUTER on 127.0.0.1:port (plaintext, or CURVE with `keys` and no
// ZAP handler, so any client key is let in) that answers Hello when told to.
class FakeShard {
 public:
  explicit FakeShard(int port, const KeyPair* keys = nullptr) : port_(port), keys_(keys) {}
  // Binds (retrying for up to 2 s while the port is still being released).
  bool Bind() {
    for (int i = 0; i < 100; ++i) {
      try {
        socket_ = std::make_unique<zmq::socket_t>(ctx_, zmq::socket_type::router);
        socket_->set(zmq::sockopt::linger, 0);
        if (keys_ != nullptr) ConfigureCurveServer(*socket_, *keys_, "worker");
        socket_->bind(LoopbackEndpoint(port_));
        return true;
      } catch (const zmq::error_t&) {
        socket_.reset();
        std::this_thread::sleep_for(20ms);
      }
    }
    return false;
  }
  // Closes the socket, and with it every connection.
  void Close() { socket_.reset(); }
  // Waits up to `timeout` for a request; its request id (0: none came).
  uint64_t Receive(std::chrono::milliseconds timeout, zmq::message_t* routing_id) {
    zmq::pollitem_t item{socket_->handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, timeout) <= 0) return 0;
    auto msg = ReceiveMessage(*socket_, routing_id);
    if (!msg.ok()) return 0;
    auto env = ParseEnvelope(msg->header, WireLimits{});
    return env.ok() ? (*env)->request_id() : 0;
  }
  void ReplyHello(const zmq::message_t& routing_id, uint64_t request_id) {
    flatbuffers::FlatBufferBuilder fbb;
    auto body = wire::CreateHelloReplyDirect(fbb, "fake-0", "test", 1, "", 1);
    FinishEnvelope(fbb, request_id, wire::Body::HelloReply, body.Union());
    ASSERT_TRUE(SendMessage(*socket_, &routing_id, fbb, {}).ok());
  }

 private:
  zmq::context_t ctx_{1};
  std::unique_ptr<zmq::socket_t> socket_;
  int port_;
  const KeyPair* keys_;
};

// A port one test process picked stays its own until it exits, bound or not: neither
// another process nor the same one picks it again (CI saw two tests start servers on one
// admin port picked by both before either had bound it).
TEST(TestPorts, APickedPortIsClaimedUntilItsProcessExits) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t child = ::fork();
  if (child == 0) {  // picks a port, reports it, and holds it until the pipe closes
    ::close(fds[0]);
    const int p = FreePort();
    if (::write(fds[1], &p, sizeof p) != static_cast<ssize_t>(sizeof p)) _exit(1);
    ::pause();
    _exit(0);
  }
  ::close(fds[1]);
  int port = -1;
  ASSERT_EQ(::read(fds[0], &port, sizeof port), static_cast<ssize_t>(sizeof port));
  ::close(fds[0]);
  ASSERT_GT(port, 0);
  EXPECT_TRUE(isthmus::testing::CanBindLoopback(port)) << "nobody has bound it yet";
  EXPECT_FALSE(isthmus::testing::ClaimPorts(port, 1)) << "another live process picked it";
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  EXPECT_TRUE(isthmus::testing::ClaimPorts(port, 1)) << "its process is gone";
  EXPECT_FALSE(isthmus::testing::ClaimPorts(port, 1)) << "this process holds it now";
}

// Nothing listens: the defaults give up after connect_timeout_ms per attempt (5 s), not
// after timeout_ms (30 s) per attempt as before, and say what to check.
TEST(ShardClientReach, ADeadEndpointFailsWithinTheConnectTimeout) {
  HeldPort dead;  // bound, never listening: connections are refused (no other test takes it)
  ASSERT_GT(dead.port(), 0);
  ClientOptions o = Plaintext(dead.port());
  o.retries = 0;  // the defaults otherwise: 30 s per attempt, 5 s to connect
  auto c = ShardClient::Connect(o);
  ASSERT_TRUE(c.ok());
  auto t0 = Clock::now();
  auto h = (*c)->Hello("j", wire::Role::Worker, "", "t");
  const double s = SecondsSince(t0);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), Code::kUnavailable) << h.status().ToString();
  EXPECT_NE(h.status().message().find(o.endpoint), std::string::npos) << h.status().ToString();
  EXPECT_NE(h.status().message().find("is isthmus-server running there"), std::string::npos)
      << h.status().ToString();
  EXPECT_GE(s, 4.5);
  EXPECT_LT(s, 10.0) << "the call waited for the reply timeout instead";

  // Every attempt counts: (1 + retries) x connect_timeout_ms.
  o.connect_timeout_ms = 300;
  o.retries = 2;
  c = ShardClient::Connect(o);
  ASSERT_TRUE(c.ok());
  t0 = Clock::now();
  h = (*c)->Hello("j", wire::Role::Worker, "", "t");
  EXPECT_EQ(h.status().code(), Code::kUnavailable) << h.status().ToString();
  EXPECT_NE(h.status().message().find("3 attempt(s)"), std::string::npos) << h.status().ToString();
  EXPECT_GE(SecondsSince(t0), 0.85);
  EXPECT_LT(SecondsSince(t0), 5.0);
}

// A port that accepts TCP connections (the kernel's backlog) but is no isthmus-server (or
// one that is stopped): the handshake never completes, and the message says so.
TEST(ShardClientReach, AnEndpointWithoutAHandshakeIsNamedAsSuch) {
  HeldPort silent;
  ASSERT_GT(silent.port(), 0);
  ASSERT_TRUE(silent.listen());  // never accepted
  const int port = silent.port();
  ClientOptions o = Plaintext(port);
  o.connect_timeout_ms = 500;
  o.retries = 0;
  auto c = ShardClient::Connect(o);
  ASSERT_TRUE(c.ok());
  const auto t0 = Clock::now();
  auto h = (*c)->Hello("j", wire::Role::Worker, "", "t");
  EXPECT_LT(SecondsSince(t0), 5.0);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), Code::kUnavailable) << h.status().ToString();
  EXPECT_NE(h.status().message().find("completed no ZeroMQ handshake"), std::string::npos)
      << h.status().ToString();
}

// The shard drops the connection while the request is in hand (a crash, a restart): the
// attempt ends at once and the retry reaches the shard that came back, well before
// timeout_ms (30 s) would have passed.
TEST(ShardClientReach, ALostConnectionIsRetriedAtOnce) {
  const int port = FreePort();
  FakeShard shard(port);
  ASSERT_TRUE(shard.Bind());
  uint64_t first = 0, second = 0;
  std::thread server([&] {
    zmq::message_t rid;
    first = shard.Receive(10s, &rid);
    shard.Close();  // the request in hand is never answered
    std::this_thread::sleep_for(300ms);
    if (!shard.Bind()) return;
    zmq::message_t rid2;
    second = shard.Receive(10s, &rid2);
    if (second != 0) shard.ReplyHello(rid2, second);
  });
  ClientOptions o = Plaintext(port);  // timeout_ms 30 s, connect_timeout_ms 5 s, retries 2
  auto c = ShardClient::Connect(o);
  ASSERT_TRUE(c.ok());
  const auto t0 = Clock::now();
  auto h = (*c)->Hello("j", wire::Role::Worker, "", "t");
  const double s = SecondsSince(t0);
  server.join();
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->shard_id, "fake-0");
  EXPECT_NE(first, 0u);
  EXPECT_EQ(second, first) << "the retry is the same request";
  EXPECT_LT(s, 10.0);
}

// connect_timeout_ms bounds only the connection: a connected shard that takes longer than
// that to answer (a large push, a slow disk) is waited for, up to timeout_ms; with CURVE
// (what shards use) and without.
TEST(ShardClientReach, AConnectedShardSlowerThanTheConnectTimeoutIsWaitedFor) {
  const KeyPair server_keys = *GenerateKeyPair();
  for (bool curve : {false, true}) {
    SCOPED_TRACE(curve ? "CURVE" : "plaintext");
    const int port = FreePort();
    FakeShard shard(port, curve ? &server_keys : nullptr);
    ASSERT_TRUE(shard.Bind());
    std::thread server([&] {
      zmq::message_t rid;
      const uint64_t id = shard.Receive(10s, &rid);
      std::this_thread::sleep_for(1500ms);
      if (id != 0) shard.ReplyHello(rid, id);
    });
    ClientOptions o = Plaintext(port);
    if (curve) {
      o.insecure_plaintext = false;
      o.server_public_key = server_keys.public_key;
      o.client_keys = *GenerateKeyPair();
    }
    o.connect_timeout_ms = 300;
    o.timeout_ms = 10000;
    o.retries = 0;
    auto c = ShardClient::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    auto h = (*c)->Hello("j", wire::Role::Worker, "", "t");
    server.join();
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    EXPECT_EQ(h->shard_id, "fake-0");
  }
}

// A wrong server key fails every attempt's handshake: PermissionDenied naming the key, and
// quickly (each attempt ends at its failed handshake, not at a timeout). One failed
// handshake alone is not taken for a wrong key: a server killed during a handshake looks
// the same, and the next attempt tells (a worker saw "check the server public key" when a
// shard was SIGKILLed).
TEST(ShardClientReach, AWrongServerKeyFailsEveryAttemptSayingSo) {
  auto server_keys = GenerateKeyPair();
  auto other = GenerateKeyPair();
  ASSERT_TRUE(server_keys.ok() && other.ok());
  const int port = FreePort();
  FakeShard shard(port, &*server_keys);
  ASSERT_TRUE(shard.Bind());
  ClientOptions o = Plaintext(port);
  o.insecure_plaintext = false;
  o.server_public_key = other->public_key;
  o.client_keys = *GenerateKeyPair();
  o.connect_timeout_ms = 5000;
  o.timeout_ms = 30000;
  o.retries = 2;
  auto c = ShardClient::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const auto t0 = Clock::now();
  auto h = (*c)->Hello("j", wire::Role::Worker, "", "t");
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), Code::kPermissionDenied) << h.status().ToString();
  EXPECT_NE(h.status().message().find("check the server public key"), std::string::npos)
      << h.status().ToString();
  EXPECT_NE(h.status().message().find("3 attempt(s)"), std::string::npos) << h.status().ToString();
  EXPECT_LT(SecondsSince(t0), 10.0) << "the attempts waited for their timeouts";
}

// ClientOptions::interrupted stops a call that waits for a shard that never answers.
TEST(ShardClientReach, AnInterruptStopsAWaitingCall) {
  const int port = FreePort();
  FakeShard shard(port);
  ASSERT_TRUE(shard.Bind());
  ClientOptions o = Plaintext(port);
  std::atomic<int> asked{0};
  const auto t0 = Clock::now();
  o.interrupted = [&] {
    ++asked;
    return SecondsSince(t0) > 0.5;
  };
  auto c = ShardClient::Connect(o);
  ASSERT_TRUE(c.ok());
  auto h = (*c)->Hello("j", wire::Role::Worker, "", "t");
  const double s = SecondsSince(t0);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), Code::kUnavailable);
  EXPECT_NE(h.status().message().find("interrupted"), std::string::npos) << h.status().ToString();
  EXPECT_GE(s, 0.5);
  EXPECT_LT(s, 3.0);
  EXPECT_GE(asked.load(), 3) << "asked every 100 ms or so while waiting";
}

}  // namespace
}  // namespace isthmus
