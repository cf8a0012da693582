// The seam between a shard's round protocol (sync_engine.h: what is held, what
// commits) and its cross-site links (peer_link.h: sockets, resends, acks,
// bandwidth). The engine owns the durable outbox and inbox; links only move bytes and
// report acknowledgements, so either side can be tested alone.
//
// Threads: both sides run on the shard's event-loop thread; nothing here is locked.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "server/storage/records.h"
#include "server/sync/membership.h"

namespace isthmus {

// EncodedTensor and EncodedDelta, what crosses the WAN, are persisted records too:
// storage/records.h.

// What links read from the engine: this site's own deltas, durable in its outbox.
class DeltaSource {
 public:
  virtual ~DeltaSource() = default;
  // Jobs that take part in cross-site sync on this shard.
  virtual std::vector<std::string> SyncJobs() const = 0;
  // Highest round of this site's own deltas in the outbox for `job` (0: none yet).
  virtual uint64_t OutboxHighRound(const std::string& job) const = 0;
  // This site's delta for `round`, or NotFound if it was never produced or has been
  // garbage-collected (every peer acknowledged it and the round committed).
  virtual Result<std::shared_ptr<const EncodedDelta>> OutboxDelta(const std::string& job,
                                                                  uint64_t round) = 0;
  // A peer acknowledged holding every round of ours up to `held_round`; lets the engine
  // drop outbox entries all peers hold and report lag.
  virtual void OnPeerAck(const std::string& peer_site, const std::string& job,
                         uint64_t held_round) = 0;
  // The link's measured throughput towards `peer_site` (bytes of delta per second of
  // transfer, smoothed); the engine's adaptive codec sizes the next rounds to fit it.
  virtual void OnLinkBandwidth(const std::string& peer_site, double bytes_per_second) = 0;
  // The first round of this site's deltas of `job` that `peer_site` merges; 0 when none
  // goes to it (it is not a member, or this site is not). A site that joined at round r
  // starts from r: it holds the state of the rounds before.
  virtual uint64_t FirstRoundTo(const std::string& peer_site, const std::string& job) const = 0;
  // Membership requests this site has for `peer_site` now (a change it coordinates, or the
  // outcome of one it agreed to); the link sends them and hands back the answers.
  virtual std::vector<MembershipRequest> MembershipRequests(const std::string& peer_site) = 0;
  virtual void OnMembershipAnswer(const std::string& peer_site, const MembershipRequest& request,
                                  const MembershipAnswer& answer) = 0;
  // `peer_site` holds that this site is no longer a member of `job` from round
  // `removed_from` on (its handshake said so): this site takes no more rounds of it until
  // it joins again.
  virtual void OnRemovedNotice(const std::string& peer_site, const std::string& job,
                               uint64_t removed_from) = 0;
};

// What links hand to the engine: deltas received from peers.
class DeltaSink {
 public:
  virtual ~DeltaSink() = default;
  // Persists `delta` (from authenticated peer site `from_site`, which must equal
  // delta.site) before returning. A duplicate (already held or already committed) is
  // ignored and is not an error. Malformed input (unknown job, wrong tensor set or shape,
  // undecodable bytes, round too far ahead) returns an error and changes nothing.
  // On success returns the highest round r such that every round 1..r from that site is
  // held or committed: the acknowledgement to send back.
  virtual Result<uint64_t> ReceiveDelta(const std::string& from_site,
                                        const EncodedDelta& delta) = 0;
  // The same acknowledgement value without receiving anything (for handshakes).
  virtual uint64_t HeldFrom(const std::string& site, const std::string& job) const = 0;
  // The names and shapes of `job`'s tensors on this shard, sorted by name: the order of
  // a packed delta's tensors (PeerDelta.sizes). NotFound for a job not synced here.
  virtual Result<std::vector<std::pair<std::string, std::vector<int64_t>>>> JobTensors(
      const std::string& job) const = 0;
  // A membership request from authenticated peer `from_site`, answered from (and, for an
  // accepted prepare, recorded in) durable state.
  virtual MembershipAnswer OnMembershipRequest(const std::string& from_site,
                                               const MembershipRequest& request) = 0;
  // Why a handshake of `site` about `job` is refused (this site is not a member), or empty.
  virtual std::string RefusesPeer(const std::string& site, const std::string& job) const = 0;
  // The round from which `site` is no longer merged in `job` here (it was removed or left;
  // 0: it is a member, or the job is not held). The link tells the site so in handshakes
  // instead of refusing it, so it can learn it and ask to join again.
  virtual uint64_t RemovedFrom(const std::string& site, const std::string& job) const = 0;
};

}  // namespace isthmus
