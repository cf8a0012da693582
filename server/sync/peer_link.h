// Cross-site peer links of one shard. Each pair of sites shares one connection per shard
// pair, carrying both directions: one side dials a DEALER (CURVE client) to the other's
// `listen.peer` ROUTER, which answers and sends its own deltas back over that connection
// (PeerLinkOptions::dial says which side dials). Links only move bytes: what to send comes
// from a DeltaSource, what arrives goes to a DeltaSink (peer_io.h); the engine
// behind them owns durability and commits.
//
// Threads: everything runs on one thread (the shard's event loop), which owns the sockets.
// Nothing here locks; Stats() and the control calls must be made on that thread too.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "common/keys.h"
#include "common/status.h"
#include "common/wire.h"
#include "server/sync/peer_io.h"

namespace isthmus {

// One entry of `sync.peers`: the peer site's name, the endpoint of its same-numbered
// shard's `listen.peer` socket, and its public key (Z85).
struct PeerLinkSpec {
  std::string site;
  std::string endpoint;
  std::string public_key;  // the key dialled with (the file's first, until a handshake fails)
  // Every key the file lists: two while the peer rotates its own key (keys.h,
  // LoadPublicKeyList); all are the peer's on the ROUTER. The file is read again by
  // ReloadPeerKeys.
  std::vector<std::string> public_keys;
  std::string key_file;
};

// Parses "SITE=ENDPOINT=PUBKEYFILE" (split at the first two '=') and reads the public key file.
// Errors name the entry and say what is wrong (InvalidArgument for the text, the key loader's error
// for the file).
Result<PeerLinkSpec> ParsePeerLinkSpec(const std::string& text);
Result<std::vector<PeerLinkSpec>> ParsePeerLinkSpecs(const std::vector<std::string>& texts);

// Which side of a pair opens the connection (sync.dial). kAuto: the site whose name sorts
// first dials and the other waits on listen.peer, so a pair shares one connection (one
// handshake, and each side's TCP acknowledgements ride on the other's data). kAlways: this
// site dials every peer (where the peer cannot reach us); kNever: it only waits (where we
// cannot reach the peer). Two dialling sides work too, over two connections.
enum class PeerDial { kAuto, kAlways, kNever };
Result<PeerDial> ParsePeerDial(const std::string& text);

struct PeerLinkOptions {
  std::string site;  // this site's name (sync.site)
  PeerDial dial = PeerDial::kAuto;
  int shard_index = -1;             // this shard's index; -1 = unknown (not checked)
  std::string listen_endpoint;      // listen.peer; empty = do not receive
  KeyPair keys;                     // this server's key pair (CURVE client and server)
  bool insecure_plaintext = false;  // no CURVE: the sender's claimed site is trusted
  std::vector<PeerLinkSpec> peers;
  int resend_ms = 2000;        // no reply for this long: reconnect and resend
  int backoff_max_ms = 10000;  // cap of the doubling resend / retry interval; also the
                               // keep-alive interval of an idle link
  int window = 4;              // deltas in flight per link
  // How long the peer may hold its acknowledgement of one of our deltas to carry it inside
  // its own next delta instead of a message of its own (sync.ack_delay_ms; 0 = at once).
  // Also added to the time our deltas in flight may go unanswered.
  int ack_delay_ms = 5000;
  WireLimits limits;            // applied to received peer messages
  double bandwidth_ewma = 0.3;  // weight of a new bandwidth sample (BandwidthMeter)
  // Bandwidth assumed when there is no estimate yet (or a lower one) when sizing how long
  // the bytes in flight may take; see InFlightBudgetMs.
  double min_bandwidth_bps = 16384;
  // Fewest bytes one bandwidth sample covers: smaller transfers ride on the shaper's burst
  // and the TCP window and say nothing about the sustained rate.
  uint64_t min_sample_bytes = 16 * 1024;
  // Digest of a job's initial state, compared in the handshake (empty = not compared).
  std::function<std::string(const std::string& job)> initial_digest;
};

// A snapshot of one link, for `isthmusctl sync status`.
struct PeerLinkStats {
  struct Job {
    std::string job;
    uint64_t acked_round = 0;   // the peer holds every round of ours up to this one
    uint64_t outbox_round = 0;  // our highest round (lag = outbox_round - acked_round)
  };
  std::string site;
  std::string endpoint;
  bool dials = false;      // this side opened the connection (else the peer dials us)
  bool connected = false;  // transport up and the handshake answered
  bool paused = false;
  std::string last_error;
  std::vector<Job> jobs;
  uint64_t bytes_sent = 0, bytes_received = 0, raw_bytes_sent = 0;  // delta payload
  uint64_t deltas_sent = 0, deltas_acked = 0, resends = 0;
  uint64_t auth_failures = 0;  // the peer refused our key
  uint64_t refused = 0;        // messages from this peer that we refused
  double bandwidth_bps = 0;    // BandwidthMeter's estimate
  // The wire: every message this site sent to / received from the peer on the pair's
  // connection(s), with ZeroMQ's framing and CURVE's boxes, plus the handshakes of every
  // connection; TCP/IP headers estimated (common/wire.h).
  uint64_t wire_bytes_sent = 0, wire_bytes_received = 0, tcp_bytes_estimate = 0;
  uint64_t messages_sent = 0, messages_received = 0;
  uint64_t connections = 0;   // handshakes, ours and the peer's
  uint64_t keepalives = 0;    // pings sent while idle
  double silent_seconds = 0;  // since the last message from the peer (or since start)
  double CompressionRatio() const {
    return bytes_sent == 0 ? 0.0 : static_cast<double>(raw_bytes_sent) / bytes_sent;
  }
  // fp32 bytes of the deltas sent per wire byte sent: the ratio that counts.
  double WireRatio() const {
    return wire_bytes_sent == 0 ? 0.0 : static_cast<double>(raw_bytes_sent) / wire_bytes_sent;
  }
};

// How long requests in flight on a link may go without any answer (counted from the
// later of the last answer and the oldest send) before the link counts as dead:
// timeout_ms + 2 x the time the bytes in flight need at max(bandwidth_bps,
// min_bandwidth_bps). A slow but healthy link is thus never timed out while it drains
// its queue, and a silent one is still caught timeout_ms after the expected transfer.
int64_t InFlightBudgetMs(int64_t timeout_ms, uint64_t bytes_in_flight, double bandwidth_bps,
                         double min_bandwidth_bps);

// Turns the acks of one link into a bandwidth estimate (bytes per second). A delta
// occupies the link from max(its send time, the previous answer) to its ack, so pipelined
// deltas are not charged for the time they queued behind others. Consecutive deltas of
// one busy period are pooled until they cover min_sample_bytes (a period that ends short
// is dropped: tiny transfers pass on the shaper's burst), and a delta that was sent
// before (a resend) voids the pool, since its ack may answer an earlier copy. The
// estimate is (decayed sum of pooled bytes) / (decayed sum of their busy time), the past
// sums decaying by (1 - weight) per pool: a ratio of sums, so an ack read late (the event
// loop was busy) mostly moves time between neighbouring pools instead of inflating the
// figure the way one short pool's rate would. Not thread-safe.
class BandwidthMeter {
 public:
  using Clock = std::chrono::steady_clock;
  BandwidthMeter(uint64_t min_sample_bytes, double weight)
      : min_sample_bytes_(min_sample_bytes), weight_(weight) {}
  // One delta of `bytes` sent at `sent` and acknowledged at `acked`. Returns the new
  // estimate when a pool completed, nullopt otherwise.
  std::optional<double> OnAck(Clock::time_point sent, Clock::time_point acked, uint64_t bytes,
                              bool resent);
  // Any other answer (a handshake reply): the link carried no delta bytes until `at`.
  void OnOtherReply(Clock::time_point at);
  // A new connection: forget the pool (not the estimate); the link is free from `at`.
  void Restart(Clock::time_point at);

 private:
  uint64_t min_sample_bytes_;
  double weight_;
  Clock::time_point last_answer_{};  // when the link last finished a transfer
  Clock::time_point pool_start_{};
  uint64_t pool_bytes_ = 0;
  double sum_bytes_ = 0, sum_seconds_ = 0;
};

class PeerLinks {
 public:
  // `source` and `sink` are not owned and must outlive this object; `ctx` too. The ZAP
  // handler of `ctx` must admit the peers' keys in domain "peer" (unless insecure).
  PeerLinks(zmq::context_t& ctx, PeerLinkOptions options, DeltaSource* source, DeltaSink* sink);
  ~PeerLinks();
  PeerLinks(const PeerLinks&) = delete;
  PeerLinks& operator=(const PeerLinks&) = delete;

  // Binds the peer ROUTER and connects a DEALER to every peer this side dials. Unavailable if the
  // endpoint cannot be bound; InvalidArgument for a bad peer list (duplicate site or key, own
  // site).
  Status Start();

  // Poll-loop integration: the caller polls PollItemCount() items that FillPollItems()
  // wrote (their order is fixed until the next FillPollItems), then calls OnPoll() with
  // the results, and Tick() after every wake-up. NextTimeoutMs() bounds the poll wait.
  size_t PollItemCount() const;
  void FillPollItems(zmq::pollitem_t* items);
  void OnPoll(const zmq::pollitem_t* items);
  void Tick();
  int NextTimeoutMs() const;
  // The same three steps on this object's sockets alone, waiting at most max_wait_ms.
  void PollOnce(int max_wait_ms);

  // Control. `site` empty means every link; NotFound for an unknown site. SyncNow resends
  // everything the peer lacks at once and resets the backoff. A paused link sends nothing
  // and the deltas and handshakes its peer sends are answered Unavailable.
  Result<std::vector<std::string>> SyncNow(const std::string& site);
  Result<std::vector<std::string>> Pause(const std::string& site);
  Result<std::vector<std::string>> Resume(const std::string& site);

  // Key rotation without a restart (SIGHUP, docs/DEPLOY.md). ReloadPeerKeys reads every
  // sync.peers key file again (a file that cannot be read keeps its keys); a link dialling
  // with a key no longer listed dials again with the first listed. SetOwnKeys takes this site's new
  // key pair: the ROUTER is bound anew with it (retried for up to 10 s while ZeroMQ releases the
  // port; Unavailable after) and every link this side dials connects again presenting it.
  void ReloadPeerKeys();
  Status SetOwnKeys(const KeyPair& keys);
  // Each peer site's keys as its sync.peers file lists them (as last read).
  std::map<std::string, std::vector<std::string>> PeerKeys() const;

  std::vector<PeerLinkStats> Stats() const;
  // Peer messages refused before a configured site could be named (no or unknown key).
  uint64_t refused_unknown() const { return refused_unknown_; }
  const PeerLinkOptions& options() const { return options_; }

  // Handles one message received on the peer ROUTER; `user_id` is the authenticated
  // public key (empty when insecure). Returns the reply to send. Exposed for tests.
  Status HandlePeerMessage(const std::string& user_id, const Frames& msg,
                           flatbuffers::FlatBufferBuilder& reply);

 private:
  struct Link;
  using Clock = std::chrono::steady_clock;

  // Binds the peer ROUTER to `endpoint` with this site's key (Unavailable if it cannot).
  Status BindRouter(const std::string& endpoint);
  Status OpenDealer(Link& link);
  void CloseDealer(Link& link);
  // Whether the link has a connection to send on: its DEALER, or the peer's connection to
  // our ROUTER (learnt from the peer's handshake).
  bool CanSend(const Link& link) const;
  static std::string KeyHint(const Link& link);
  // Sends a request or reply to the link's peer on whichever connection the link uses, and
  // counts it. An accepted connection that has gone is forgotten (Unavailable).
  Status Transmit(Link& link, const flatbuffers::FlatBufferBuilder& header,
                  const std::vector<PayloadRef>& payload);
  void SendHello(Link& link);
  void SendPing(Link& link);
  // Sends the engine's next membership request for this peer (one in flight at a time, a
  // look per resend interval).
  void SendMembership(Link& link, Clock::time_point now);
  Status HandleMembership(Link& from, const wire::PeerMembership* req, uint64_t id,
                          flatbuffers::FlatBufferBuilder& reply);
  void Pump(Link& link);
  void Reset(Link& link, const std::string& why, bool reopen);
  void OnDealerReadable(Link& link);
  void OnMonitorReadable(Link& link);
  void OnRouterReadable();
  // A reply from the link's peer to one of our requests.
  void OnReply(Link& link, const wire::Envelope* env, const Frames& msg);
  // The peer holds every round up to `held` of the delta `request_id`, as of `at`.
  void OnAcked(Link& link, uint64_t request_id, uint64_t held, Clock::time_point at);
  // Sends the acknowledgements the link has held past their time as messages of their own.
  void FlushAcks(Link& link, bool all);
  // Answers a request from a peer on `socket` (routing_id: the ROUTER's connection, null
  // on a DEALER; env: the message's header as the caller parsed it; request_id: the id it
  // carried, 0 if it did not verify, echoed in a refusal). Returns the link it came from,
  // null if none could be named.
  Link* Answer(zmq::socket_t& socket, const zmq::message_t* routing_id, const std::string& user_id,
               const Result<const wire::Envelope*>& env, uint64_t request_id, const Frames& msg);
  int CurrentTimeoutMs(const Link& link) const;
  // When the requests in flight count as lost; time_point::max() when none is.
  Clock::time_point Deadline(const Link& link) const;
  Link* FindLink(const std::string& site);
  Result<std::vector<Link*>> Select(const std::string& site);

  // `connection`: the ROUTER routing id the message came on (null: a DEALER, or a test).
  Status HandlePeerMessage(const std::string& user_id, const Result<const wire::Envelope*>& env,
                           const Frames& msg, flatbuffers::FlatBufferBuilder& reply,
                           Link** from_out, const std::string* connection);
  Status HandleHello(Link& from, const wire::PeerHello* hello, uint64_t id,
                     flatbuffers::FlatBufferBuilder& reply, const std::string* connection);
  // Takes the peer's acknowledgements from a handshake (job -> held round) and marks the
  // link ready. `fresh`: a new start, everything above them is sent again; otherwise (a
  // job probe on a working connection) what is in flight stays.
  void Adopt(Link& link, const std::map<std::string, uint64_t>& held, bool fresh);
  // Wire accounting (PeerLinkStats' wire fields).
  void CountSent(Link& link, const flatbuffers::FlatBufferBuilder& header,
                 const std::vector<PayloadRef>& payload);
  void CountReceived(Link& link, const Frames& msg);
  void CountConnection(Link& link, bool client_side);
  Status HandleDelta(Link& from, const wire::PeerDelta* delta, const Frames& msg, uint64_t id,
                     flatbuffers::FlatBufferBuilder& reply);
  Status UnlistDelta(const wire::PeerDelta* req, const Frames& msg, EncodedDelta* delta) const;
  Status UnpackDelta(const wire::PeerDelta* req, const Frames& msg, EncodedDelta* delta) const;

  zmq::context_t& ctx_;
  PeerLinkOptions options_;
  DeltaSource* source_;
  DeltaSink* sink_;
  std::unique_ptr<zmq::socket_t> router_;
  std::vector<std::unique_ptr<Link>> links_;
  std::map<std::string, Link*> by_key_;  // public key -> link
  uint64_t refused_unknown_ = 0;
  uint64_t monitor_seq_ = 0;
  // Payload frames of the reply being built (a job image for a joining site).
  std::vector<PayloadRef> reply_payload_;
  std::vector<int> poll_map_;  // poll item -> (link index * 2 + 0 dealer / 1 monitor), -1 router
};

}  // namespace isthmus
