// Who takes part in a sync job, and how that changes (docs/SYNC.md, "Membership"). A job's
// membership is committed state (storage/records.h: Membership, in the SyncRecord),
// changed only at a round boundary by a change every site of the new set agreed to, in two
// phases over the peer links: prepare, then apply. This file holds the protocol's messages
// and the MembershipProtocol, which owns everything about a change that is not a round:
// the votes a coordinator collects, a planned leave draining, a site joining (asking,
// fetching a member's state, checking it against every member's digest), a member
// catching up, and the note an operator reads in `isthmusctl sync status`.
//
// The round engine (sync_engine.h) owns the rounds and the store; the protocol reads the
// job's durable record and asks the engine for the few writes that touch rounds through
// MembershipHost. So a change's rules live here, and a round's arithmetic there.
//
// Threads: one thread (the shard's event loop) calls everything; nothing is locked.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "server/storage/records.h"

namespace isthmus {

// One membership request between two sites' shards, for one job. kPrepare: the coordinator
// asks a site of the new membership to agree (and hold its commits at the boundary until the
// outcome is known). kQuery: a site that agreed asks the coordinator for the outcome.
// A joining site (not yet holding the job) sends: kJoin, asking a member to coordinate its
// addition (`change.next.sites` = the joining site); kFetch, asking the coordinator for the
// committed state the addition starts from; kDigest, asking any member for its digest of
// that round. A member catching up sends kFetch with its current membership.
enum class MembershipStep { kPrepare, kQuery, kJoin, kFetch, kDigest };
struct MembershipRequest {
  std::string job;
  MembershipStep step = MembershipStep::kPrepare;
  MembershipChange change;
};

// kPrepared: agreed, and holding. kApplied: the change is in effect there. kPending: (to a
// query) not decided yet. kRefused: no, for `reason`; nothing changed there. kAbandoned: (to a
// query) the coordinator gave the change up.
enum class MembershipVote { kPrepared, kApplied, kPending, kRefused, kAbandoned };

// A job's committed state at one round, as a member hands it to a joining site.
struct ImageTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::shared_ptr<const std::vector<float>> theta;
  std::shared_ptr<const std::vector<float>> momentum;  // null when no momentum is kept
};
struct JobImage {
  uint64_t round = 0;    // the committed round
  std::string digest;    // its digest, as the member stores it
  Membership members;    // the membership that round was committed under
  uint64_t version = 0;  // the member's served version
  std::string base_hash;
  std::vector<ImageTensor> tensors;  // name order
};

struct MembershipAnswer {
  MembershipVote vote = MembershipVote::kRefused;
  std::string reason;
  std::string digest = {};                          // kDigest: the round's digest
  std::shared_ptr<const JobImage> image = nullptr;  // kFetch
  uint64_t committed = 0;  // the answering site's last committed round of the job (0: unknown)
};
const char* MembershipVoteName(MembershipVote v);
const char* MembershipStepName(MembershipStep s);

// Why `site` may not take part in job `job` whose record is `r` (removed, or never a
// member); empty if it may. `own_site` words the message for this site.
std::string NonMemberReason(const std::string& job, const SyncRecord& r, const std::string& site,
                            const std::string& own_site);

// What the protocol needs of the round engine: the job's durable record, and the writes
// that touch rounds. Each write is one store batch; memory follows only after it succeeded.
class MembershipHost {
 public:
  virtual ~MembershipHost() = default;
  // The jobs held here, in name order.
  virtual std::vector<std::string> Jobs() const = 0;
  // The job's durable record as held here; null when this shard does not hold the job. The
  // pointer stays valid until the job is forgotten (a restore), and follows every write.
  virtual const SyncRecord* Record(const std::string& job) const = 0;
  // Records `pending` as the job's pending change (or none).
  virtual Status WritePending(const std::string& job,
                              const std::optional<MembershipChange>& pending) = 0;
  // The pending change takes effect: `next` (the record with the new membership) in one
  // batch with the deletion of every delta held from the sites in `gone`.
  virtual Status ApplyMembership(const std::string& job, const SyncRecord& next,
                                 const std::vector<std::string>& gone) = 0;
  // Commits whatever rounds the record now allows (a change that held them went away).
  virtual Status CommitReady(const std::string& job) = 0;
  // The job's committed state, for a joining or catching-up site.
  virtual Result<std::shared_ptr<const JobImage>> Image(const std::string& job) const = 0;
  // The stored digest of committed round `round`; nullopt when none is stored.
  virtual Result<std::optional<std::string>> Digest(const std::string& job,
                                                    uint64_t round) const = 0;
  // Creates the job from a verified image, with `change` (this site's addition) pending.
  virtual Status InstallImage(const std::string& job, const JobImage& image,
                              const MembershipChange& change) = 0;
  // Takes a verified image of the same membership, further on, as the job's committed
  // state; an error (nothing changed) when its tensors are not the job's.
  virtual Status AdoptImage(const std::string& job, const JobImage& image) = 0;
};

// What `isthmusctl sync status` shows of a job's membership here.
struct MembershipStatus {
  std::optional<MembershipChange> pending;  // agreed to or coordinated here
  std::string note;                         // the last change's outcome, or what it waits for
  bool catching_up = false;                 // asking a member for its committed state
  bool draining = false;                    // leaving once this site's last round commits
};

class MembershipProtocol {
 public:
  // `site`: this site; `peer_sites`: the sites with a sync.peers entry here (only they can
  // be asked to agree); `keeps_momentum`: whether this site's outer optimiser keeps momentum
  // (a joining site's image must match); `change_timeout`: how long a change this site
  // coordinates, or a join it makes, may go without progress (ExpireStalled); `now`: the
  // clock. `host` is not owned and outlives this object.
  using Clock = std::chrono::steady_clock;
  MembershipProtocol(std::string site, std::vector<std::string> peer_sites, bool keeps_momentum,
                     std::chrono::seconds change_timeout, std::function<Clock::time_point()> now,
                     MembershipHost* host);

  // Forgets everything held in memory (after a snapshot restore).
  void Reset();

  // Starts the removal of `site` from `job`, this site coordinating it; `site` = this site is
  // a planned leave. The change takes effect from round committed + 1 once every site of the
  // new membership has agreed over the peer links (at once when no other site is left). A
  // leave while this site's own rounds are not all committed drains first: no new rounds are
  // taken (the one being pushed may finish), and the leave is proposed once they have
  // committed (the returned change's from_round is then 0). FailedPrecondition, saying what
  // to do, when it cannot start: not a member, another change under way, a remaining site
  // with no sync.peers entry.
  Result<MembershipChange> ProposeRemoval(const std::string& job, const std::string& site);
  // Gives up the change this site coordinates, a draining leave, or the join this site is
  // making (the sites that agreed learn it when they ask). FailedPrecondition when there is
  // none, or another site coordinates it.
  Status AbandonChange(const std::string& job);
  // An operator's consent on this member: site `site` (one with a sync.peers entry here, not
  // a member) may ask this site to coordinate its addition to `job` during `valid_for`. A
  // join request without one is refused, so a site nobody invited (one removed, whose key is
  // still allowed) cannot make the members hold their commits. The invitation lives in
  // memory (a restart forgets it) and is used up when the addition applies.
  Status Invite(const std::string& job, const std::string& site, std::chrono::seconds valid_for);
  // Gives up what has made no progress for the change timeout: a change this site
  // coordinates (no vote, no fetch), a join this site makes (no answer). Called about once
  // a second.
  void ExpireStalled();
  // The automatic removal policy (sync.remove_silent_after_s), looked at about once a
  // second: `silent` are the peers that have sent nothing for the configured time. With
  // three or more members, when the other members are a majority and this site is the
  // first-named of them, starts removing the silent members (as ProposeRemoval; one change
  // at a time per job). Returns whether it did; why not shows in the job's status.
  // A change this site coordinates is given up (nothing held any more) when it can no longer
  // succeed or should not: it needs the agreement of a site that is silent itself, or it is
  // an automatic removal of a site that has been heard from again (slow, not gone). After a
  // refusal from a member that has committed further, no removal is proposed until this
  // site has caught up with that member (it asks it for its state: StartCatchUp), so the next
  // proposal starts from the survivors' highest committed round.
  Result<bool> ProposeSilentRemoval(const std::string& job, const std::set<std::string>& silent);
  // Joining (this site does not hold `job` yet): asks member `from` to coordinate this
  // site's addition, fetches the committed state the addition starts from, checks it against
  // the digests every member reports, creates the job from it (MembershipHost::InstallImage)
  // and then agrees to the addition like any other site. Progress shows in StatusOf. NotFound
  // when `from` has no sync.peers entry, FailedPrecondition when this site is a member of the
  // job already. A site that was removed (its record says so, or a member told it) joins
  // again the same way: its old state of the job is replaced by the member's.
  Status StartJoin(const std::string& job, const std::string& from);
  // Catching up (a member that has committed fewer rounds than another, typically because a
  // site died after delivering its last delta to some members only): asks member `from` for
  // its committed state and, if it is further on, under the same membership and hashes to
  // its digest, takes it as this site's committed state (MembershipHost::AdoptImage).
  Status StartCatchUp(const std::string& job, const std::string& from);

  // Whether this site is leaving `job` and takes no new rounds.
  bool Draining(const std::string& job) const;
  // The round engine committed rounds of `job` (or closed none): a draining leave whose
  // rounds have all committed is proposed now.
  void OnRoundsCommitted(const std::string& job);
  // What status shows: of a held job, or of one being joined (nullopt: neither).
  std::optional<MembershipStatus> StatusOf(const std::string& job) const;
  // Jobs being joined (not held yet); `failed` includes those whose join failed.
  std::vector<std::string> JoiningJobs(bool failed) const;

  // The peer links' side (peer_io.h): requests to send to `peer`, the answers to them,
  // and the requests that arrive.
  std::vector<MembershipRequest> Requests(const std::string& peer);
  void OnAnswer(const std::string& peer, const MembershipRequest& request,
                const MembershipAnswer& answer);
  MembershipAnswer OnRequest(const std::string& from, const MembershipRequest& request);
  // The first round of this site's deltas of `job` that `peer` merges; 0 when none goes to it.
  uint64_t FirstRoundTo(const std::string& peer, const std::string& job) const;
  // Why a handshake of `site` about `job` is refused (it was removed from the job), or empty.
  std::string RefusesPeer(const std::string& site, const std::string& job) const;
  // The round from which `site` is no longer merged in `job` here (0: a member, or unknown).
  uint64_t RemovedFrom(const std::string& site, const std::string& job) const;
  // Member `peer` says this site was removed from `job` from round `removed_from` (a
  // change this site never saw: it was dead or cut off). Kept in memory: this site's workers
  // are refused (RemovedNotice) until it joins again.
  void OnRemovedNotice(const std::string& peer, const std::string& job, uint64_t removed_from);
  // What a member said about this site's removal from `job` (empty: nothing), with what to
  // do; also when this site's own record says it is no longer a member.
  std::string RemovedNotice(const std::string& job) const;

 private:
  // Memory-only state of a held job.
  struct JobState {
    std::set<std::string> votes;  // the change this site coordinates: who agreed
    std::string note;             // the last change's outcome, for status
    // Sites whose addition was given up here, and why (told at their next join request).
    std::map<std::string, std::string> join_refusals;
    bool draining = false;
    std::string catching_up_from;     // empty: not catching up
    bool automatic = false;           // the pending change was proposed by the silence policy
    Clock::time_point progress_at{};  // last progress of the change coordinated here
    std::string removed_notice;       // a member said this site was removed (OnRemovedNotice)
    // After a refusal by a site that had committed round N: no automatic proposal until this
    // site has committed N too.
    uint64_t wait_for_round = 0;
  };
  // A joining site's progress (memory only: an interrupted join is started again).
  struct Joining {
    std::string from;
    std::optional<MembershipChange> change;      // the addition `from` proposed
    std::shared_ptr<const JobImage> image;       // the state that addition starts from
    std::map<std::string, std::string> digests;  // member -> its digest of image->round
    std::string note;
    bool failed = false;
    Clock::time_point progress_at{};
    int restarts = 0;  // times the join was asked again after its coordinator gave it up
  };

  bool Configured(const std::string& site) const;
  std::vector<std::string> MemberPeers(const SyncRecord& r) const;
  // Records `change` as pending (one write), and applies it at once when this site
  // coordinates it and is its only site.
  Status StartChange(const std::string& job, JobState& js, const MembershipChange& change);
  // Forgets the pending change (durably), noting `why`; commits held for it go ahead. A site
  // whose addition it was is told `why` at its next join request, unless `transient` (the
  // sites stood at different rounds for a moment: a new request is proposed afresh).
  Status DropChange(const std::string& job, JobState& js, const std::string& why,
                    bool transient = false);
  // The pending change takes effect.
  Status ApplyChange(const std::string& job, JobState& js);
  // Why a prepare of `change` from `from` is refused here (empty: it can be agreed to).
  std::string PrepareRefusal(const SyncRecord& r, const std::string& from,
                             const MembershipChange& change) const;
  // Starts adding `site`, this site coordinating (a joining site asked for it).
  Result<MembershipChange> ProposeAddition(const std::string& job, JobState& js,
                                           const std::string& site);
  MembershipAnswer OnJoiningRequest(const std::string& from, const MembershipRequest& req);
  void OnJoiningAnswer(const std::string& peer, const MembershipRequest& req,
                       const MembershipAnswer& answer);
  void OnCatchUpAnswer(const std::string& job, JobState& js, const std::string& peer,
                       const MembershipAnswer& answer);
  // Checks an image against its own digest and the change; empty when it fits.
  std::string ImageProblem(const Joining& jn, const JobImage& image) const;
  // Creates the job from a verified image, with the addition pending.
  Status InstallJoined(const std::string& job, Joining& jn);

  std::string site_;
  std::vector<std::string> peer_sites_;
  bool keeps_momentum_;
  std::chrono::seconds change_timeout_;
  std::function<Clock::time_point()> now_;
  MembershipHost* host_;
  std::map<std::string, JobState> jobs_;
  std::map<std::string, Joining> joining_;
  // job -> invited site -> until when its join request is taken (Invite).
  std::map<std::string, std::map<std::string, Clock::time_point>> invited_;
};

}  // namespace isthmus
