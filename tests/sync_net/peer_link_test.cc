// Peer links in one process: each site is a PeerLinks on its own thread and ZeroMQ
// context (its own ZAP handler and CURVE keys) on loopback, with an in-memory engine
// double behind it. Shows exactly-once delivery, resends across a receiver restart,
// pause/resume, refusal of unlisted keys, of deltas claiming another site, of malformed
// frames, and that replays change nothing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "common/keys.h"
#include "common/transport.h"
#include "common/varint.h"
#include "server/sync/peer_link.h"
#include "tests/loopback.h"

namespace isthmus {
namespace {

using namespace std::chrono_literals;

using testing::FreePort;

std::string Endpoint(int port) { return testing::LoopbackEndpoint(port); }

bool WaitFor(const std::function<bool()>& pred, std::chrono::milliseconds limit = 10s) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return pred();
}

// The engine's role, in memory: an outbox of this site's deltas and an inbox of peers'
// deltas that keeps the first copy of each round. Locked: the test thread reads it while
// the link thread feeds it.
class MemoryEngine : public DeltaSource, public DeltaSink {
 public:
  explicit MemoryEngine(std::string site, std::vector<std::string> jobs = {"job"})
      : site_(std::move(site)), jobs_(std::move(jobs)) {}

  // Encoded sizes above zero pad a tensor to that many bytes (a large tensor travels in a
  // frame of its own).
  static std::shared_ptr<EncodedDelta> MakeDelta(const std::string& job, const std::string& site,
                                                 uint64_t round, size_t a_bytes = 0,
                                                 size_t b_bytes = 0) {
    auto d = std::make_shared<EncodedDelta>();
    d->job = job;
    d->site = site;
    d->round = round;
    d->tokens = 1000 + round;
    std::string a = "A:" + site + ":" + std::to_string(round);
    if (a_bytes > a.size()) a.resize(a_bytes, static_cast<char>('k' + round % 8));
    d->tensors.push_back({"a.weight", {4, 8}, a});
    d->tensors.push_back(
        {"b.bias",
         {8},
         std::string(std::max<size_t>(b_bytes, 100 + round), static_cast<char>('a' + round % 26))});
    return d;
  }
  void AddOwn(uint64_t round, const std::string& job = "job", size_t a_bytes = 0,
              size_t b_bytes = 0) {
    std::lock_guard lk(mu_);
    outbox_[job][round] = MakeDelta(job, site_, round, a_bytes, b_bytes);
  }

  std::vector<std::string> SyncJobs() const override { return jobs_; }
  uint64_t OutboxHighRound(const std::string& job) const override {
    std::lock_guard lk(mu_);
    auto it = outbox_.find(job);
    return it == outbox_.end() || it->second.empty() ? 0 : it->second.rbegin()->first;
  }
  Result<std::shared_ptr<const EncodedDelta>> OutboxDelta(const std::string& job,
                                                          uint64_t round) override {
    std::lock_guard lk(mu_);
    auto it = outbox_.find(job);
    if (it == outbox_.end() || it->second.count(round) == 0) return Status::NotFound("no round");
    return std::shared_ptr<const EncodedDelta>(it->second[round]);
  }
  void OnPeerAck(const std::string& peer, const std::string& job, uint64_t held) override {
    std::lock_guard lk(mu_);
    acks_[peer + "/" + job] = held;
  }
  void OnLinkBandwidth(const std::string& peer, double bps) override {
    std::lock_guard lk(mu_);
    bandwidth_[peer] = bps;
  }
  Result<uint64_t> ReceiveDelta(const std::string& from, const EncodedDelta& d) override {
    std::lock_guard lk(mu_);
    ++receives_;
    if (std::find(jobs_.begin(), jobs_.end(), d.job) == jobs_.end()) {
      return Status::NotFound("unknown job");
    }
    if (d.site != from) return Status::PermissionDenied("site mismatch");
    if (d.tensors.size() != 2) return Status::InvalidArgument("wrong tensor set");
    for (const auto& t : d.tensors) {
      if (t.bytes.empty() || t.bytes[0] == 'X') return Status::InvalidArgument("undecodable");
    }
    auto& rounds = inbox_[from + "/" + d.job];
    if (d.round > HeldLocked(from, d.job) + 16) return Status::InvalidArgument("too far ahead");
    if (!rounds.emplace(d.round, d).second) ++duplicates_;
    return HeldLocked(from, d.job);
  }
  uint64_t HeldFrom(const std::string& site, const std::string& job) const override {
    std::lock_guard lk(mu_);
    return HeldLocked(site, job);
  }
  Result<std::vector<std::pair<std::string, std::vector<int64_t>>>> JobTensors(
      const std::string& job) const override {
    if (std::find(jobs_.begin(), jobs_.end(), job) == jobs_.end()) {
      return Status::NotFound("unknown job");
    }
    return std::vector<std::pair<std::string, std::vector<int64_t>>>{{"a.weight", {4, 8}},
                                                                     {"b.bias", {8}}};
  }

  // Membership is the sync engine's (tested in sync_engine_test and sync_process_test):
  // this stand-in has every site a member and no changes.
  uint64_t FirstRoundTo(const std::string&, const std::string&) const override { return 1; }
  std::vector<MembershipRequest> MembershipRequests(const std::string&) override { return {}; }
  void OnMembershipAnswer(const std::string&, const MembershipRequest&,
                          const MembershipAnswer&) override {}
  MembershipAnswer OnMembershipRequest(const std::string&, const MembershipRequest&) override {
    return {MembershipVote::kRefused, "no membership changes here"};
  }
  std::string RefusesPeer(const std::string&, const std::string&) const override { return ""; }
  uint64_t RemovedFrom(const std::string&, const std::string&) const override { return 0; }
  void OnRemovedNotice(const std::string&, const std::string&, uint64_t) override {}

  uint64_t Held(const std::string& site) const { return HeldFrom(site, "job"); }
  size_t InboxSize(const std::string& site) const {
    std::lock_guard lk(mu_);
    auto it = inbox_.find(site + "/job");
    return it == inbox_.end() ? 0 : it->second.size();
  }
  std::optional<EncodedDelta> Received(const std::string& site, uint64_t round) const {
    std::lock_guard lk(mu_);
    auto it = inbox_.find(site + "/job");
    if (it == inbox_.end() || it->second.count(round) == 0) return std::nullopt;
    return it->second.at(round);
  }
  uint64_t Ack(const std::string& peer) const {
    std::lock_guard lk(mu_);
    auto it = acks_.find(peer + "/job");
    return it == acks_.end() ? 0 : it->second;
  }
  double Bandwidth(const std::string& peer) const {
    std::lock_guard lk(mu_);
    auto it = bandwidth_.find(peer);
    return it == bandwidth_.end() ? 0 : it->second;
  }
  uint64_t receives() const {
    std::lock_guard lk(mu_);
    return receives_;
  }
  uint64_t duplicates() const {
    std::lock_guard lk(mu_);
    return duplicates_;
  }

 private:
  uint64_t HeldLocked(const std::string& site, const std::string& job) const {
    auto it = inbox_.find(site + "/" + job);
    if (it == inbox_.end()) return 0;
    uint64_t r = 0;
    while (it->second.count(r + 1)) ++r;
    return r;
  }

  std::string site_;
  std::vector<std::string> jobs_;
  mutable std::mutex mu_;
  std::map<std::string, std::map<uint64_t, std::shared_ptr<EncodedDelta>>> outbox_;
  std::map<std::string, std::map<uint64_t, EncodedDelta>> inbox_;
  std::map<std::string, uint64_t> acks_;
  std::map<std::string, double> bandwidth_;
  uint64_t receives_ = 0, duplicates_ = 0;
};

struct SiteSpec {
  std::string site;
  KeyPair keys;
  int port = 0;
};

SiteSpec MakeSite(const std::string& site) {
  auto keys = GenerateKeyPair();
  EXPECT_TRUE(keys.ok());
  return SiteSpec{site, *keys, FreePort()};
}

PeerLinkSpec AsPeer(const SiteSpec& s) {
  return PeerLinkSpec{s.site, Endpoint(s.port), s.keys.public_key, {s.keys.public_key}, ""};
}

// One site's links on their own thread and context, like a shard's event loop.
class Node {
 public:
  Node(const SiteSpec& self, std::vector<PeerLinkSpec> peers, std::vector<std::string> allow,
       MemoryEngine* engine, int resend_ms = 300, int backoff_max_ms = 1200,
       std::function<void(PeerLinkOptions&)> tweak = nullptr) {
    std::promise<Status> started;
    auto fut = started.get_future();
    thread_ = std::thread([&, self, peers, allow, engine, resend_ms, backoff_max_ms, tweak] {
      zmq::context_t ctx(1);
      ZapHandler zap(ctx);
      zap.SetAllowlist(kDomainPeer, allow);
      Status s = zap.Start();
      PeerLinkOptions o;
      o.site = self.site;
      o.shard_index = 0;
      o.listen_endpoint = Endpoint(self.port);
      o.keys = self.keys;
      o.peers = peers;
      o.resend_ms = resend_ms;
      o.backoff_max_ms = backoff_max_ms;
      o.window = 3;
      o.min_sample_bytes = 1;  // the test deltas are tiny; every ack may be a sample
      o.ack_delay_ms = 500;    // acks ride in the peer's deltas or go alone this soon
      o.initial_digest = [](const std::string& job) { return "digest-of-" + job; };
      if (tweak) tweak(o);
      auto links = std::make_unique<PeerLinks>(ctx, o, engine, engine);
      if (s.ok()) s = links->Start();
      started.set_value(s);
      if (!s.ok()) return;
      while (!stop_.load()) {
        links->PollOnce(20);
        std::vector<std::function<void(PeerLinks&)>> work;
        {
          std::lock_guard lk(mu_);
          work.swap(queue_);
        }
        for (auto& w : work) w(*links);
      }
      links.reset();
      zap.Stop();
      ctx.close();
    });
    start_status_ = fut.get();
  }
  ~Node() {
    stop_.store(true);
    thread_.join();
  }
  const Status& start_status() const { return start_status_; }

  // Runs f on the loop thread and waits for it.
  template <class F>
  auto Run(F f) -> decltype(f(std::declval<PeerLinks&>())) {
    using R = decltype(f(std::declval<PeerLinks&>()));
    auto p = std::make_shared<std::promise<R>>();
    auto fut = p->get_future();
    {
      std::lock_guard lk(mu_);
      queue_.push_back([p, f](PeerLinks& l) mutable { p->set_value(f(l)); });
    }
    return fut.get();
  }
  PeerLinkStats StatsOf(const std::string& site) {
    return Run([site](PeerLinks& l) {
      for (auto& s : l.Stats()) {
        if (s.site == site) return s;
      }
      return PeerLinkStats{};
    });
  }

 private:
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<std::function<void(PeerLinks&)>> queue_;
  Status start_status_;
};

TEST(PeerLink, DeliversEveryRoundExactlyOnceBothWays) {
  SiteSpec a = MakeSite("alpha"), b = MakeSite("beta");
  MemoryEngine ea("alpha"), eb("beta");
  for (uint64_t r = 1; r <= 4; ++r) ea.AddOwn(r), eb.AddOwn(r);
  Node na(a, {AsPeer(b)}, {b.keys.public_key}, &ea);
  Node nb(b, {AsPeer(a)}, {a.keys.public_key}, &eb);
  ASSERT_TRUE(na.start_status().ok()) << na.start_status().ToString();
  ASSERT_TRUE(nb.start_status().ok()) << nb.start_status().ToString();
  // Rounds produced while the links run are sent as they appear.
  for (uint64_t r = 5; r <= 12; ++r) {
    ea.AddOwn(r);
    eb.AddOwn(r);
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE(WaitFor([&] { return eb.Held("alpha") == 12 && ea.Held("beta") == 12; }))
      << eb.Held("alpha") << " " << ea.Held("beta");
  ASSERT_TRUE(WaitFor([&] { return ea.Ack("beta") == 12 && eb.Ack("alpha") == 12; }));
  // The engine hears of an ack as soon as any reply carries it; the link counts each delta's
  // own reply, which may come after a later round's (under load): wait for the count too.
  ASSERT_TRUE(WaitFor([&] { return na.StatsOf("beta").deltas_acked == 12u; }))
      << na.StatsOf("beta").deltas_acked;
  EXPECT_EQ(eb.InboxSize("alpha"), 12u);
  for (uint64_t r = 1; r <= 12; ++r) {
    auto got = eb.Received("alpha", r);
    ASSERT_TRUE(got.has_value());
    auto want = MemoryEngine::MakeDelta("job", "alpha", r);
    EXPECT_EQ(got->tokens, want->tokens);
    ASSERT_EQ(got->tensors.size(), 2u);
    EXPECT_EQ(got->tensors[0].bytes, want->tensors[0].bytes);
    EXPECT_EQ(got->tensors[1].bytes, want->tensors[1].bytes);
    EXPECT_EQ(got->tensors[0].shape, want->tensors[0].shape);
  }
  auto s = na.StatsOf("beta");
  EXPECT_TRUE(s.connected);
  EXPECT_EQ(s.deltas_acked, 12u);
  EXPECT_GE(s.bytes_sent, 12u * 100);
  EXPECT_GT(s.bandwidth_bps, 0);
  EXPECT_GT(ea.Bandwidth("beta"), 0);
  EXPECT_GT(s.CompressionRatio(), 0);
  ASSERT_EQ(s.jobs.size(), 1u);
  EXPECT_EQ(s.jobs[0].acked_round, 12u);
  EXPECT_EQ(s.jobs[0].outbox_round, 12u);
  EXPECT_EQ(nb.StatsOf("alpha").bytes_received, s.bytes_sent);
}

// Tensors of 64 KiB and more travel in frames of their own, beside a shared frame of the
// small ones: every order of small and large arrives intact.
TEST(PeerLink, LargeTensorsTravelInTheirOwnFramesBesideSmallOnes) {
  SiteSpec a = MakeSite("alpha"), b = MakeSite("beta");
  MemoryEngine ea("alpha"), eb("beta");
  const size_t big = 70 * 1024;
  const std::vector<std::pair<size_t, size_t>> sizes = {{0, big}, {big, 0}, {big, big + 1}, {0, 0}};
  for (uint64_t r = 1; r <= sizes.size(); ++r) {
    ea.AddOwn(r, "job", sizes[r - 1].first, sizes[r - 1].second);
  }
  Node na(a, {AsPeer(b)}, {b.keys.public_key}, &ea);
  Node nb(b, {AsPeer(a)}, {a.keys.public_key}, &eb);
  ASSERT_TRUE(na.start_status().ok()) << na.start_status().ToString();
  ASSERT_TRUE(nb.start_status().ok()) << nb.start_status().ToString();
  ASSERT_TRUE(WaitFor([&] { return eb.Held("alpha") == sizes.size(); }))
      << eb.Held("alpha") << "; sender's last error: " << na.StatsOf("beta").last_error
      << "; receiver's: " << nb.StatsOf("alpha").last_error;
  for (uint64_t r = 1; r <= sizes.size(); ++r) {
    auto got = eb.Received("alpha", r);
    ASSERT_TRUE(got.has_value()) << "round " << r;
    auto want = MemoryEngine::MakeDelta("job", "alpha", r, sizes[r - 1].first, sizes[r - 1].second);
    ASSERT_EQ(got->tensors.size(), 2u);
    EXPECT_EQ(got->tensors[0].bytes, want->tensors[0].bytes) << "round " << r;
    EXPECT_EQ(got->tensors[1].bytes, want->tensors[1].bytes) << "round " << r;
  }
  EXPECT_EQ(na.StatsOf("beta").last_error, "");
}

TEST(PeerLink, ResendsWhatTheReceiverLacksAfterItRestarts) {
  SiteSpec a = MakeSite("alpha"), b = MakeSite("beta");
  MemoryEngine ea("alpha"), eb("beta");  // eb survives the restart: it is the durable inbox
  Node na(a, {AsPeer(b)}, {b.keys.public_key}, &ea);
  {
    Node nb(b, {AsPeer(a)}, {a.keys.public_key}, &eb);
    for (uint64_t r = 1; r <= 3; ++r) ea.AddOwn(r);
    ASSERT_TRUE(WaitFor([&] { return eb.Held("alpha") == 3; }));
  }
  for (uint64_t r = 4; r <= 8; ++r) ea.AddOwn(r);
  ASSERT_TRUE(WaitFor([&] { return !na.StatsOf("beta").connected; }));
  // alpha keeps trying while beta is down: wait for two more of its messages, so that
  // beta restarts into a backlog of resends.
  const uint64_t sent_while_down = na.StatsOf("beta").messages_sent;
  ASSERT_TRUE(WaitFor([&] { return na.StatsOf("beta").messages_sent >= sent_while_down + 2; }));
  EXPECT_EQ(eb.Held("alpha"), 3u);
  Node nb(b, {AsPeer(a)}, {a.keys.public_key}, &eb);
  ASSERT_TRUE(nb.start_status().ok());
  ASSERT_TRUE(WaitFor([&] { return eb.Held("alpha") == 8; })) << eb.Held("alpha");
  EXPECT_EQ(eb.InboxSize("alpha"), 8u);
  ASSERT_TRUE(WaitFor([&] { return ea.Ack("beta") == 8; }));
  EXPECT_TRUE(na.StatsOf("beta").connected);
}

TEST(PeerLink, PausedLinkSendsNothingAndRefusesUntilResumed) {
  SiteSpec a = MakeSite("alpha"), b = MakeSite("beta");
  MemoryEngine ea("alpha"), eb("beta");
  Node na(a, {AsPeer(b)}, {b.keys.public_key}, &ea);
  Node nb(b, {AsPeer(a)}, {a.keys.public_key}, &eb);
  ea.AddOwn(1);
  eb.AddOwn(1);
  ASSERT_TRUE(WaitFor([&] { return eb.Held("alpha") == 1 && ea.Held("beta") == 1; }));
  // Acks may be held for a while (ack_delay_ms) to ride in the peer's next delta.
  ASSERT_TRUE(WaitFor([&] { return ea.Ack("beta") == 1 && eb.Ack("alpha") == 1; }));
  auto paused = na.Run([](PeerLinks& l) { return l.Pause("beta"); });
  ASSERT_TRUE(paused.ok());
  EXPECT_EQ(*paused, std::vector<std::string>{"beta"});
  for (uint64_t r = 2; r <= 4; ++r) ea.AddOwn(r), eb.AddOwn(r);
  // beta keeps trying; alpha answers Unavailable and keeps nothing. Three refusals: beta
  // sent rounds 2-4 and retried, and none of them was kept.
  ASSERT_TRUE(WaitFor([&] { return na.StatsOf("beta").refused >= 3; }))
      << na.StatsOf("beta").refused;
  EXPECT_EQ(eb.Held("alpha"), 1u);
  EXPECT_EQ(ea.Held("beta"), 1u);
  auto sa = na.StatsOf("beta");
  EXPECT_TRUE(sa.paused);
  EXPECT_FALSE(sa.connected);
  ASSERT_EQ(sa.jobs.size(), 1u);
  EXPECT_EQ(sa.jobs[0].outbox_round - sa.jobs[0].acked_round, 3u);  // lag
  auto sb = nb.StatsOf("alpha");
  EXPECT_NE(sb.last_error.find("paused"), std::string::npos) << sb.last_error;
  EXPECT_FALSE(nb.Run([](PeerLinks& l) { return l.Pause("nosuchsite").ok(); }));

  ASSERT_TRUE(na.Run([](PeerLinks& l) { return l.Resume("beta").ok(); }));
  // beta backs off after refusals; "sync now" there makes it retry at once.
  ASSERT_TRUE(nb.Run([](PeerLinks& l) { return l.SyncNow("").ok(); }));
  ASSERT_TRUE(WaitFor([&] { return eb.Held("alpha") == 4 && ea.Held("beta") == 4; }, 5s));
  EXPECT_FALSE(na.StatsOf("beta").paused);
}

TEST(PeerLink, UnlistedKeyIsRefusedByZap) {
  SiteSpec a = MakeSite("alpha"), b = MakeSite("beta");
  MemoryEngine ea("alpha"), eb("beta");
  ea.AddOwn(1);
  // beta lists alpha as a peer site but alpha's key is not on beta's peer allowlist.
  auto other = GenerateKeyPair();
  ASSERT_TRUE(other.ok());
  Node nb(b, {AsPeer(a)}, {other->public_key}, &eb);
  Node na(a, {AsPeer(b)}, {b.keys.public_key}, &ea);
  // Two refused handshakes: alpha tried again after the first and was refused again.
  ASSERT_TRUE(WaitFor([&] { return na.StatsOf("beta").auth_failures >= 2; }))
      << na.StatsOf("beta").auth_failures;
  EXPECT_EQ(eb.receives(), 0u);
  EXPECT_EQ(eb.Held("alpha"), 0u);
  auto s = na.StatsOf("beta");
  EXPECT_FALSE(s.connected);
  EXPECT_EQ(s.deltas_acked, 0u);
  EXPECT_NE(s.last_error.find("allowlist"), std::string::npos) << s.last_error;
}

// A refused key is not the end: once the peer's operator lists it (here: beta restarts
// with alpha's key allowed), alpha dials again on its own and delivers.
TEST(PeerLink, RefusedSiteDeliversOnceThePeerListsItsKey) {
  SiteSpec a = MakeSite("alpha"), b = MakeSite("beta");
  MemoryEngine ea("alpha"), eb("beta");
  ea.AddOwn(1);
  auto other = GenerateKeyPair();
  ASSERT_TRUE(other.ok());
  Node na(a, {AsPeer(b)}, {b.keys.public_key}, &ea);
  {
    Node nb(b, {AsPeer(a)}, {other->public_key}, &eb);
    ASSERT_TRUE(WaitFor([&] { return na.StatsOf("beta").auth_failures > 0; }));
  }
  Node nb(b, {AsPeer(a)}, {a.keys.public_key}, &eb);
  ASSERT_TRUE(nb.start_status().ok());
  ASSERT_TRUE(WaitFor([&] { return eb.Held("alpha") == 1 && ea.Ack("beta") == 1; }))
      << na.StatsOf("beta").last_error;
  EXPECT_TRUE(na.StatsOf("beta").connected);
}

// Both ends of one pair count the same wire: what one sent, the other received.
void ExpectSameWireBothEnds(const PeerLinkStats& x, const PeerLinkStats& y) {
  EXPECT_EQ(x.wire_bytes_sent, y.wire_bytes_received);
  EXPECT_EQ(x.wire_bytes_received, y.wire_bytes_sent);
  EXPECT_EQ(x.messages_sent, y.messages_received);
  EXPECT_EQ(x.messages_received, y.messages_sent);
  EXPECT_EQ(x.connections, y.connections);
}

TEST(PeerLink, APairSharesOneConnectionAndAcksRideInTheOtherSidesDeltas) {
  SiteSpec a = MakeSite("alpha"), b = MakeSite("beta");
  MemoryEngine ea("alpha"), eb("beta");
  // A resend timer long enough that a slow start never looks like a lost handshake.
  Node na(a, {AsPeer(b)}, {b.keys.public_key}, &ea, 2000, 4000);
  Node nb(b, {AsPeer(a)}, {a.keys.public_key}, &eb, 2000, 4000);
  // Rounds on both sides at the same pace, as two training sites produce them.
  for (uint64_t r = 1; r <= 10; ++r) {
    ea.AddOwn(r);
    eb.AddOwn(r);
    ASSERT_TRUE(WaitFor([&] { return eb.Held("alpha") == r && ea.Held("beta") == r; }));
    std::this_thread::sleep_for(30ms);
  }
  // The last round's acks have no delta to ride in: they go alone after ack_delay_ms.
  ASSERT_TRUE(WaitFor([&] { return ea.Ack("beta") == 10 && eb.Ack("alpha") == 10; }));
  // Both ends have counted every message once nothing is in flight: what one sent, the
  // other received.
  PeerLinkStats sa, sb;
  ASSERT_TRUE(WaitFor([&] {
    sa = na.StatsOf("beta"), sb = nb.StatsOf("alpha");
    return sa.messages_sent == sb.messages_received && sb.messages_sent == sa.messages_received &&
           sa.wire_bytes_sent == sb.wire_bytes_received &&
           sb.wire_bytes_sent == sa.wire_bytes_received;
  })) << sa.messages_sent
      << " sent, " << sb.messages_received << " received";
  EXPECT_TRUE(sa.dials);  // "alpha" < "beta": alpha dials, beta answers on its ROUTER
  EXPECT_FALSE(sb.dials);
  EXPECT_EQ(sa.connections, 1u);
  EXPECT_EQ(sa.deltas_acked, 10u);
  EXPECT_EQ(sb.deltas_acked, 10u);
  EXPECT_EQ(sa.resends, 0u);
  EXPECT_EQ(sb.resends, 0u);
  ExpectSameWireBothEnds(sa, sb);
  // alpha sent one handshake and ten deltas; of its acknowledgements of beta's ten
  // deltas at most a few went as messages of their own (the rest rode in deltas).
  EXPECT_LE(sa.messages_sent, 1u + 10u + 3u) << sa.messages_sent;
  EXPECT_LE(sb.messages_sent, 1u + 10u + 3u) << sb.messages_sent;  // + the hello reply
  // The wire count covers at least the payload plus framing.
  EXPECT_GT(sa.wire_bytes_sent, sa.bytes_sent + 10u * 33u);
}

TEST(PeerLink, ZeroAckDelayAcknowledgesEachDeltaAtOnce) {
  SiteSpec a = MakeSite("alpha"), b = MakeSite("beta");
  MemoryEngine ea("alpha"), eb("beta");
  auto no_delay = [](PeerLinkOptions& o) { o.ack_delay_ms = 0; };
  // A resend timer long enough that a slow start under a sanitizer never looks like a lost
  // handshake (a redial would replace beta's route and fold its acks into fewer messages).
  Node na(a, {AsPeer(b)}, {b.keys.public_key}, &ea, 2000, 4000, no_delay);
  Node nb(b, {AsPeer(a)}, {a.keys.public_key}, &eb, 2000, 4000, no_delay);
  for (uint64_t r = 1; r <= 3; ++r) ea.AddOwn(r);
  // Acked within less than the default delay (5 s), by messages of beta's own.
  ASSERT_TRUE(WaitFor([&] { return ea.Ack("beta") == 3; }, 4s));
  auto sb = nb.StatsOf("alpha");
  EXPECT_GE(sb.messages_sent, 1u + 3u);  // the hello reply and three acks
  EXPECT_EQ(sb.deltas_sent, 0u);
}

TEST(PeerLink, IdleLinkSendsOnlySmallKeepAlivesAndNoHandshakes) {
  SiteSpec a = MakeSite("alpha"), b = MakeSite("beta");
  MemoryEngine ea("alpha"), eb("beta");
  // Keep-alive every backoff_max_ms = 400 ms; a ping counts as lost after resend_ms = 1 s
  // (a sanitized build on a loaded machine can take a few hundred ms to answer).
  Node na(a, {AsPeer(b)}, {b.keys.public_key}, &ea, 1000, 400);
  Node nb(b, {AsPeer(a)}, {a.keys.public_key}, &eb, 1000, 400);
  ea.AddOwn(1);
  ASSERT_TRUE(WaitFor([&] { return ea.Ack("beta") == 1; }));
  auto before_a = na.StatsOf("beta"), before_b = nb.StatsOf("alpha");
  // Five keep-alives, timed: no faster than one per backoff_max_ms.
  const auto idle_start = std::chrono::steady_clock::now();
  ASSERT_TRUE(WaitFor([&] { return na.StatsOf("beta").keepalives >= before_a.keepalives + 5; }));
  const auto idle_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                           std::chrono::steady_clock::now() - idle_start)
                           .count();
  // The last ping's answer is counted on both ends.
  PeerLinkStats after_a, after_b;
  ASSERT_TRUE(WaitFor([&] {
    after_a = na.StatsOf("beta"), after_b = nb.StatsOf("alpha");
    return after_a.wire_bytes_sent == after_b.wire_bytes_received &&
           after_a.wire_bytes_received == after_b.wire_bytes_sent;
  }));
  const uint64_t pings = after_a.keepalives - before_a.keepalives;
  EXPECT_GE(pings, 5u);
  EXPECT_GE(idle_ms, 4 * 400 * 9 / 10) << pings << " pings in " << idle_ms << " ms";
  EXPECT_EQ(after_b.keepalives, 0u);  // the side that dials keeps the connection alive
  EXPECT_EQ(after_a.connections, before_a.connections);  // no new handshake while idle
  EXPECT_EQ(after_a.resends, before_a.resends);
  const uint64_t idle_sent = after_a.wire_bytes_sent - before_a.wire_bytes_sent;
  const uint64_t idle_received = after_a.wire_bytes_received - before_a.wire_bytes_received;
  // A ping and its answer: a few tens of bytes each on the wire.
  EXPECT_LE(idle_sent + idle_received, pings * 200)
      << idle_sent + idle_received << " bytes for " << pings << " pings";
  EXPECT_TRUE(after_a.connected);
  // Both ends saw the same idle traffic.
  EXPECT_EQ(idle_sent, after_b.wire_bytes_received - before_b.wire_bytes_received);
  EXPECT_EQ(idle_received, after_b.wire_bytes_sent - before_b.wire_bytes_sent);
}

TEST(PeerLink, TwoDiallingSidesStillDeliverEveryRoundOnce) {
  SiteSpec a = MakeSite("alpha"), b = MakeSite("beta");
  MemoryEngine ea("alpha"), eb("beta");
  auto always = [](PeerLinkOptions& o) { o.dial = PeerDial::kAlways; };
  Node na(a, {AsPeer(b)}, {b.keys.public_key}, &ea, 2000, 4000, always);
  Node nb(b, {AsPeer(a)}, {a.keys.public_key}, &eb, 2000, 4000, always);
  for (uint64_t r = 1; r <= 6; ++r) ea.AddOwn(r), eb.AddOwn(r);
  ASSERT_TRUE(WaitFor([&] { return eb.Held("alpha") == 6 && ea.Held("beta") == 6; }));
  ASSERT_TRUE(WaitFor([&] { return ea.Ack("beta") == 6 && eb.Ack("alpha") == 6; }));
  EXPECT_EQ(eb.InboxSize("alpha"), 6u);
  EXPECT_EQ(eb.duplicates(), 0u);
  EXPECT_EQ(ea.duplicates(), 0u);
  auto sa = na.StatsOf("beta"), sb = nb.StatsOf("alpha");
  EXPECT_TRUE(sa.dials);
  EXPECT_TRUE(sb.dials);
  EXPECT_EQ(sa.connections, 2u);  // ours and theirs
  ExpectSameWireBothEnds(sa, sb);
}

TEST(PeerLink, ASiteThatNeverDialsIsReachedByOneThatAlwaysDoes) {
  SiteSpec a = MakeSite("alpha"), b = MakeSite("beta");
  MemoryEngine ea("alpha"), eb("beta");
  // alpha would dial by name order; it cannot reach beta, so beta dials.
  Node na(a, {AsPeer(b)}, {b.keys.public_key}, &ea, 300, 1200,
          [](PeerLinkOptions& o) { o.dial = PeerDial::kNever; });
  Node nb(b, {AsPeer(a)}, {a.keys.public_key}, &eb, 300, 1200,
          [](PeerLinkOptions& o) { o.dial = PeerDial::kAlways; });
  for (uint64_t r = 1; r <= 3; ++r) ea.AddOwn(r), eb.AddOwn(r);
  ASSERT_TRUE(WaitFor([&] { return eb.Held("alpha") == 3 && ea.Held("beta") == 3; }));
  auto sa = na.StatsOf("beta"), sb = nb.StatsOf("alpha");
  EXPECT_FALSE(sa.dials);
  EXPECT_TRUE(sb.dials);
  EXPECT_EQ(sa.connections, 1u);
  EXPECT_FALSE(ParsePeerDial("sometimes").ok());
  EXPECT_EQ(*ParsePeerDial("never"), PeerDial::kNever);
}

// A hand-driven peer: a DEALER with a site's keys, sending whatever the test builds.
class RawPeer {
 public:
  RawPeer(const KeyPair& keys, const SiteSpec& server) : sock_(ctx_, zmq::socket_type::dealer) {
    sock_.set(zmq::sockopt::linger, 0);
    sock_.set(zmq::sockopt::rcvtimeo, 5000);
    ConfigureCurveClient(sock_, keys, server.keys.public_key);
    sock_.connect(Endpoint(server.port));
  }
  // Sends the header (or raw bytes when `raw` is set) and payload; returns the reply's status
  // and, if it is a PeerAck, the held round.
  Result<uint64_t> Call(const flatbuffers::FlatBufferBuilder& fbb,
                        const std::vector<std::string>& payload, const std::string* raw = nullptr) {
    std::vector<PayloadRef> refs;
    for (const auto& p : payload) refs.push_back(PayloadRef{p.data(), p.size(), nullptr});
    if (raw != nullptr) {
      sock_.send(zmq::buffer(*raw), zmq::send_flags::none);
    } else {
      ISTHMUS_RETURN_IF_ERROR(SendMessage(sock_, nullptr, fbb, refs));
    }
    // As every receiver does: ReceiveMessage (which aligns the header) after a poll.
    zmq::pollitem_t item{sock_.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(5000)) <= 0) {
      return Status::Timeout("no reply");
    }
    ISTHMUS_ASSIGN_OR_RETURN(Frames reply, ReceiveMessage(sock_, nullptr));
    WireLimits lim;
    ISTHMUS_ASSIGN_OR_RETURN(const wire::Envelope* env, ParseEnvelope(reply.header, lim));
    ISTHMUS_RETURN_IF_ERROR(ErrorFromEnvelope(env));
    if (env->body_type() == wire::Body::PeerAck) return env->body_as_PeerAck()->held_round();
    if (env->body_type() == wire::Body::PeerHelloReply) return uint64_t{0};
    if (env->body_type() == wire::Body::PeerPong) return uint64_t{0};
    return Status::Internal("unexpected reply");
  }

 private:
  zmq::context_t ctx_;
  zmq::socket_t sock_;
};

struct DeltaMsg {
  std::string job = "job", site;
  uint64_t round = 1;
  std::vector<std::string> names = {"a.weight", "b.bias"};
  std::vector<uint32_t> frames = {0, 1};
  std::vector<uint64_t> nbytes;  // default: actual sizes
  std::vector<std::string> payload = {"A:x", "bbbb"};
  std::vector<int64_t> shape = {2};  // of every tensor
  uint32_t schema_version = kSchemaVersion;
};

flatbuffers::FlatBufferBuilder BuildDelta(const DeltaMsg& m) {
  flatbuffers::FlatBufferBuilder fbb;
  std::vector<flatbuffers::Offset<wire::PeerTensor>> metas;
  for (size_t i = 0; i < m.names.size(); ++i) {
    uint64_t n = i < m.nbytes.size()
                     ? m.nbytes[i]
                     : (m.frames[i] < m.payload.size() ? m.payload[m.frames[i]].size() : 0);
    metas.push_back(wire::CreatePeerTensor(fbb, fbb.CreateString(m.names[i]),
                                           fbb.CreateVector(m.shape), m.frames[i], n));
  }
  auto body = wire::CreatePeerDelta(fbb, fbb.CreateString(m.job), fbb.CreateString(m.site), m.round,
                                    7, fbb.CreateVector(metas));
  wire::EnvelopeBuilder env(fbb);
  env.add_schema_version(m.schema_version);
  env.add_request_id(42);
  env.add_body_type(wire::Body::PeerDelta);
  env.add_body(body.Union());
  fbb.Finish(env.Finish(), wire::EnvelopeIdentifier());
  return fbb;
}

class PeerLinkRefusals : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = MakeSite("alpha");
    b_ = MakeSite("beta");
    c_ = MakeSite("gamma");
    // beta accepts alpha and gamma; the peers' own listeners are never started.
    node_ = std::make_unique<Node>(b_, std::vector<PeerLinkSpec>{AsPeer(a_), AsPeer(c_)},
                                   std::vector<std::string>{a_.keys.public_key, c_.keys.public_key},
                                   &eb_);
    ASSERT_TRUE(node_->start_status().ok());
  }
  SiteSpec a_, b_, c_;
  MemoryEngine eb_{"beta"};
  std::unique_ptr<Node> node_;
};

TEST_F(PeerLinkRefusals, DeltaClaimingAnotherSiteIsRefused) {
  RawPeer alpha(a_.keys, b_);
  DeltaMsg m;
  m.site = "gamma";  // alpha's key, gamma's name
  auto r = alpha.Call(BuildDelta(m), m.payload);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kPermissionDenied) << r.status().ToString();
  EXPECT_EQ(eb_.receives(), 0u);
  EXPECT_EQ(eb_.Held("gamma"), 0u);
  EXPECT_EQ(node_->StatsOf("alpha").refused, 1u);
  // The same delta under its own name is taken.
  m.site = "alpha";
  auto ok = alpha.Call(BuildDelta(m), m.payload);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(*ok, 1u);
  EXPECT_EQ(eb_.Held("alpha"), 1u);
}

TEST_F(PeerLinkRefusals, MalformedDeltasAreRefusedWithoutStateChange) {
  RawPeer alpha(a_.keys, b_);
  std::string garbage = "this is not a flatbuffer";
  auto g = alpha.Call(flatbuffers::FlatBufferBuilder(), {}, &garbage);
  EXPECT_EQ(g.status().code(), Code::kInvalidArgument) << g.status().ToString();

  std::vector<std::pair<std::string, DeltaMsg>> cases;
  DeltaMsg base;
  base.site = "alpha";
  {
    DeltaMsg m = base;  // one more frame than tensors
    m.payload.push_back("cc");
    cases.push_back({"extra frame", m});
  }
  {
    DeltaMsg m = base;
    m.nbytes = {3, 999};
    cases.push_back({"nbytes mismatch", m});
  }
  {
    DeltaMsg m = base;
    m.frames = {0, 0};
    cases.push_back({"frame reused", m});
  }
  {
    DeltaMsg m = base;
    m.frames = {0, 7};
    cases.push_back({"frame out of range", m});
  }
  {
    DeltaMsg m = base;
    m.round = 0;
    cases.push_back({"round 0", m});
  }
  {
    DeltaMsg m = base;
    m.names = {"a.weight", "a.weight"};
    cases.push_back({"duplicate name", m});
  }
  {
    DeltaMsg m = base;
    m.payload = {"Xundecodable", "bbbb"};
    cases.push_back({"sink refuses bytes", m});
  }
  {
    DeltaMsg m = base;
    m.job = "nosuchjob";
    cases.push_back({"unknown job", m});
  }
  for (std::vector<int64_t> shape : {std::vector<int64_t>{int64_t{1} << 62},
                                     {int64_t{1} << 31, int64_t{1} << 31},
                                     {int64_t{1} << 61, 2},
                                     {-2}}) {
    DeltaMsg m = base;
    m.shape = shape;
    cases.push_back({"shape " + ::testing::PrintToString(shape), m});
  }
  for (uint32_t version : {0u, 2u, 999u}) {
    DeltaMsg m = base;
    m.schema_version = version;
    cases.push_back({"schema_version " + std::to_string(version), m});
  }
  for (const auto& [what, m] : cases) {
    auto r = alpha.Call(BuildDelta(m), m.payload);
    EXPECT_FALSE(r.ok()) << what;
    if (what.rfind("shape", 0) == 0) {
      EXPECT_NE(r.status().message().find("negative or huge shape"), std::string::npos)
          << what << ": " << r.status().ToString();
    }
    if (what.rfind("schema_version", 0) == 0) {
      EXPECT_NE(r.status().message().find(what + " but this isthmus speaks schema_version 1"),
                std::string::npos)
          << r.status().ToString();
    }
  }
  EXPECT_EQ(eb_.InboxSize("alpha"), 0u);
  EXPECT_EQ(eb_.Held("alpha"), 0u);
  // The link is still usable afterwards.
  auto ok = alpha.Call(BuildDelta(base), base.payload);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(eb_.Held("alpha"), 1u);
}

TEST_F(PeerLinkRefusals, ReplayedDeltaIsAcknowledgedAndIgnored) {
  RawPeer alpha(a_.keys, b_);
  DeltaMsg m;
  m.site = "alpha";
  ASSERT_TRUE(alpha.Call(BuildDelta(m), m.payload).ok());
  auto first = eb_.Received("alpha", 1);
  ASSERT_TRUE(first.has_value());
  // The same bytes again, and a different delta under the same round.
  auto again = alpha.Call(BuildDelta(m), m.payload);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, 1u);
  DeltaMsg forged = m;
  forged.payload = {"A:forged", "zzzz"};
  auto f = alpha.Call(BuildDelta(forged), forged.payload);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(*f, 1u);
  EXPECT_EQ(eb_.InboxSize("alpha"), 1u);
  EXPECT_EQ(eb_.duplicates(), 2u);
  EXPECT_EQ(eb_.Received("alpha", 1)->tensors[0].bytes, first->tensors[0].bytes);
}

// A delta in the packed layout: `sizes` as written (varints), `data` carried in the
// header, `frame_ends` as given (empty: not written), and held acks riding along.
struct PackedMsg {
  std::string job = "job";
  uint64_t round = 1;
  std::string sizes;  // raw bytes of packed_sizes
  std::string data;   // inline frame (empty: none)
  std::vector<uint32_t> frame_ends;
  std::vector<wire::PeerHeld> acks;
  std::vector<std::string> payload;  // frames after `data`
};

std::string Varints(std::initializer_list<uint64_t> values) {
  std::string out;
  for (uint64_t v : values) PutVarint(&out, v);
  return out;
}

// The two tensors MemoryEngine's job holds, "a.weight" then "b.bias" (name order).
PackedMsg GoodPacked() {
  PackedMsg m;
  m.sizes = Varints({3, 4});
  m.data = "A:xbbbb";
  return m;
}

flatbuffers::FlatBufferBuilder BuildPacked(const PackedMsg& m) {
  flatbuffers::FlatBufferBuilder fbb;
  auto sizes = fbb.CreateVector(reinterpret_cast<const uint8_t*>(m.sizes.data()), m.sizes.size());
  auto data = m.data.empty() ? flatbuffers::Offset<flatbuffers::Vector<uint8_t>>()
                             : fbb.CreateVector(reinterpret_cast<const uint8_t*>(m.data.data()),
                                                m.data.size());
  auto ends = m.frame_ends.empty() ? flatbuffers::Offset<flatbuffers::Vector<uint32_t>>()
                                   : fbb.CreateVector(m.frame_ends);
  auto acks = m.acks.empty() ? flatbuffers::Offset<flatbuffers::Vector<const wire::PeerHeld*>>()
                             : fbb.CreateVectorOfStructs(m.acks);
  auto body = wire::CreatePeerDelta(fbb, fbb.CreateString(m.job), 0, m.round, 7, 0, ends, data, 0,
                                    acks, sizes);
  wire::EnvelopeBuilder env(fbb);
  env.add_request_id(43);
  env.add_body_type(wire::Body::PeerDelta);
  env.add_body(body.Union());
  fbb.Finish(env.Finish(), wire::EnvelopeIdentifier());
  return fbb;
}

TEST_F(PeerLinkRefusals, PackedDeltasAreCheckedAgainstTheJobsTensorsBeforeAByteIsRead) {
  RawPeer alpha(a_.keys, b_);
  std::vector<std::pair<std::string, PackedMsg>> cases;
  {
    PackedMsg m = GoodPacked();
    m.sizes = "\x83";  // a varint that never ends
    cases.push_back({"truncated varint", m});
  }
  {
    PackedMsg m = GoodPacked();
    m.sizes = std::string("\x83\x00", 2) + Varints({4});  // overlong encoding of 3
    cases.push_back({"overlong varint", m});
  }
  {
    PackedMsg m = GoodPacked();
    m.sizes = Varints({7});
    cases.push_back({"one tensor short", m});
  }
  {
    PackedMsg m = GoodPacked();
    m.sizes = Varints({3, 4, 0});
    cases.push_back({"one tensor too many", m});
  }
  {
    PackedMsg m = GoodPacked();
    m.sizes = Varints({3, 40});
    cases.push_back({"runs past the frame", m});
  }
  {
    PackedMsg m = GoodPacked();
    m.sizes = Varints({3, 3});
    cases.push_back({"bytes nobody claims", m});
  }
  {
    PackedMsg m = GoodPacked();
    m.payload = {"extra"};
    cases.push_back({"a frame too many", m});
  }
  {
    PackedMsg m = GoodPacked();
    m.frame_ends = {2, 1};
    m.payload = {""};
    cases.push_back({"frame ends out of order", m});
  }
  {
    PackedMsg m = GoodPacked();
    m.sizes = Varints({uint64_t{1} << 40, 4});
    cases.push_back({"huge size", m});
  }
  for (const auto& [what, m] : cases) {
    auto r = alpha.Call(BuildPacked(m), m.payload);
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << what << ": " << r.status().ToString();
  }
  EXPECT_EQ(eb_.receives(), 0u);
  // Acks riding in a delta that name requests beta never sent change nothing.
  PackedMsg ok = GoodPacked();
  ok.acks = {wire::PeerHeld(999, 5, 10), wire::PeerHeld(0, ~uint64_t{0}, ~uint64_t{0})};
  auto r = alpha.Call(BuildPacked(ok), ok.payload);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, 1u);
  auto got = eb_.Received("alpha", 1);
  ASSERT_TRUE(got.has_value());
  ASSERT_EQ(got->tensors.size(), 2u);
  EXPECT_EQ(got->tensors[0].name, "a.weight");
  EXPECT_EQ(got->tensors[0].bytes, "A:x");
  EXPECT_EQ(got->tensors[1].shape, std::vector<int64_t>{8});
  EXPECT_EQ(got->tensors[1].bytes, "bbbb");
  EXPECT_EQ(node_->StatsOf("alpha").deltas_acked, 0u);
  // The same tensors split over the inline frame and a payload frame.
  PackedMsg split = GoodPacked();
  split.round = 2;
  split.data = "A:x";
  split.frame_ends = {1, 2};
  split.payload = {"bbbb"};
  auto r2 = alpha.Call(BuildPacked(split), split.payload);
  ASSERT_TRUE(r2.ok()) << r2.status().ToString();
  EXPECT_EQ(eb_.Received("alpha", 2)->tensors[1].bytes, "bbbb");
}

// A PeerHello from `site` (shard `shard_index`) offering job "job" with `digest` as its
// initial-state digest.
flatbuffers::FlatBufferBuilder PeerHelloMessage(uint64_t id, const std::string& site,
                                                int shard_index, const std::string& digest) {
  flatbuffers::FlatBufferBuilder fbb;
  auto job = wire::CreatePeerJob(fbb, fbb.CreateString("job"), fbb.CreateString(digest), 0);
  auto body = wire::CreatePeerHello(fbb, fbb.CreateString(site), shard_index,
                                    fbb.CreateVector(std::vector{job}));
  wire::EnvelopeBuilder env(fbb);
  env.add_request_id(id);
  env.add_body_type(wire::Body::PeerHello);
  env.add_body(body.Union());
  fbb.Finish(env.Finish(), wire::EnvelopeIdentifier());
  return fbb;
}

flatbuffers::FlatBufferBuilder PeerPingMessage(uint64_t id) {
  flatbuffers::FlatBufferBuilder fbb;
  // Under CURVE the key names the site.
  FinishEnvelope(fbb, id, wire::Body::PeerPing, wire::CreatePeerPing(fbb).Union());
  return fbb;
}

// alpha dials beta (the lower name dials), so beta's rounds to alpha travel on the
// connection alpha's handshake named. A keep-alive on a connection without one (alpha never
// handshook on it, or beta's send on the old one failed and beta dropped it) is answered
// with a request to handshake, not a pong: alpha, idle and hearing pongs, would never
// handshake again, and beta's rounds would never leave (seen once under TSan: a site
// stuck a round behind its peer for the whole wait).
TEST_F(PeerLinkRefusals, AKeepAliveWithoutAHandshakeAsksForOne) {
  RawPeer alpha(a_.keys, b_);
  auto before = alpha.Call(PeerPingMessage(1), {});
  ASSERT_FALSE(before.ok()) << "a pong on a connection beta cannot send on";
  EXPECT_EQ(before.status().code(), Code::kFailedPrecondition) << before.status().ToString();
  EXPECT_NE(before.status().message().find("handshake again"), std::string::npos)
      << before.status().ToString();
  auto hello = alpha.Call(PeerHelloMessage(2, "alpha", 0, "digest-of-job"), {});
  ASSERT_TRUE(hello.ok()) << hello.status().ToString();
  auto after = alpha.Call(PeerPingMessage(3), {});
  EXPECT_TRUE(after.ok()) << after.status().ToString();
}

TEST_F(PeerLinkRefusals, HandshakeReportsHeldRoundsAndRefusesWrongSite) {
  RawPeer gamma(c_.keys, b_);
  // gamma's key claiming to be alpha.
  auto r = gamma.Call(PeerHelloMessage(1, "alpha", 0, "digest-of-job"), {});
  EXPECT_EQ(r.status().code(), Code::kPermissionDenied) << r.status().ToString();

  // Another initial state than this site's.
  auto r2 = gamma.Call(PeerHelloMessage(2, "gamma", 0, "another-initial-state"), {});
  EXPECT_EQ(r2.status().code(), Code::kFailedPrecondition) << r2.status().ToString();

  // The right site and initial state, but from shard 1 to this shard 0: a sync.peers entry
  // pointing at the wrong shard of the peer site.
  auto r3 = gamma.Call(PeerHelloMessage(3, "gamma", 1, "digest-of-job"), {});
  EXPECT_EQ(r3.status().code(), Code::kFailedPrecondition) << r3.status().ToString();
  EXPECT_NE(r3.status().message().find("shard 1"), std::string::npos) << r3.status().ToString();

  // All right: answered with the rounds held.
  auto r4 = gamma.Call(PeerHelloMessage(4, "gamma", 0, "digest-of-job"), {});
  EXPECT_TRUE(r4.ok()) << r4.status().ToString();
}

// Mutated peer messages (header bytes flipped, truncated, frames dropped or added) never
// crash the receiver and never change state unless they still form a valid delta.
TEST(PeerLinkFuzz, MutatedMessagesAreRefusedOrValid) {
  SiteSpec a = MakeSite("alpha"), b = MakeSite("beta");
  MemoryEngine eb("beta");
  zmq::context_t ctx(1);
  PeerLinkOptions o;
  o.site = "beta";
  o.keys = b.keys;
  o.peers = {AsPeer(a)};
  PeerLinks links(ctx, o, &eb, &eb);
  ASSERT_TRUE(links.Start().ok());
  DeltaMsg base;
  base.site = "alpha";
  base.round = 1;
  auto fbb = BuildDelta(base);
  std::string header(reinterpret_cast<const char*>(fbb.GetBufferPointer()), fbb.GetSize());
  // The packed layout too (what links send): sizes as varints, the bytes in the header.
  auto packed_fbb = BuildPacked(GoodPacked());
  std::string packed(reinterpret_cast<const char*>(packed_fbb.GetBufferPointer()),
                     packed_fbb.GetSize());
  uint64_t seed = 12345;
  auto next = [&] {
    return seed = seed * 6364136223846793005ull + 1442695040888963407ull, seed >> 33;
  };
  int accepted = 0;
  for (int iter = 0; iter < 6000; ++iter) {
    const bool is_packed = iter % 2 == 1;
    std::string h = is_packed ? packed : header;
    int kind = static_cast<int>(next() % 4);
    if (kind == 0) {
      for (int k = 0; k < 1 + static_cast<int>(next() % 4); ++k)
        h[next() % h.size()] ^= static_cast<char>(1 + next() % 255);
    } else if (kind == 1) {
      h.resize(next() % h.size());
    } else {
      h[next() % h.size()] = static_cast<char>(next());
    }
    Frames msg;
    msg.header = zmq::message_t(h.data(), h.size());
    size_t frames = kind == 3 ? next() % 4 : is_packed ? 0 : 2;
    for (size_t f = 0; f < frames; ++f) {
      const std::string& p = base.payload[f % base.payload.size()];
      msg.payload.emplace_back(p.data(), p.size());
    }
    flatbuffers::FlatBufferBuilder reply;
    uint64_t held_before = eb.Held("alpha");
    Status s = links.HandlePeerMessage(a.keys.public_key, msg, reply);
    if (s.ok()) {
      ++accepted;
      EXPECT_LE(eb.Held("alpha"), held_before + 1);
    } else {
      EXPECT_EQ(eb.Held("alpha"), held_before);
    }
  }
  // Whatever was accepted was a well-formed delta from alpha; nothing else got in.
  EXPECT_LE(eb.InboxSize("alpha"), static_cast<size_t>(accepted));
  EXPECT_EQ(eb.InboxSize("gamma"), 0u);
  Frames good;
  good.header = zmq::message_t(header.data(), header.size());
  for (const auto& p : base.payload) good.payload.emplace_back(p.data(), p.size());
  flatbuffers::FlatBufferBuilder reply;
  EXPECT_TRUE(links.HandlePeerMessage(a.keys.public_key, good, reply).ok());
  EXPECT_FALSE(links.HandlePeerMessage(b.keys.public_key, good, reply).ok());  // unknown key
}

TEST(PeerSpecParse, ReadsKeyFileAndRejectsBadEntries) {
  auto dir =
      std::filesystem::temp_directory_path() / ("isthmus-peerspec-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto keys = GenerateKeyPair();
  ASSERT_TRUE(keys.ok());
  ASSERT_TRUE(WriteKeyPairFiles((dir / "beta").string(), *keys, true).ok());
  auto spec = ParsePeerLinkSpec("beta=tcp://10.0.0.2:7100=" + (dir / "beta.pub").string());
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  EXPECT_EQ(spec->site, "beta");
  EXPECT_EQ(spec->endpoint, "tcp://10.0.0.2:7100");
  EXPECT_EQ(spec->public_key, keys->public_key);
  EXPECT_FALSE(ParsePeerLinkSpec("beta").ok());
  EXPECT_FALSE(ParsePeerLinkSpec("beta=tcp://x:1").ok());
  EXPECT_FALSE(ParsePeerLinkSpec("beta==" + (dir / "beta.pub").string()).ok());
  EXPECT_FALSE(ParsePeerLinkSpec("beta=tcp://x:1=" + (dir / "missing.pub").string()).ok());
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace isthmus
