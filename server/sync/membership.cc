// The membership protocol (see membership.h): proposals, votes, applying and dropping
// changes, joining and catching up. Every durable step goes through MembershipHost.
#include "server/sync/membership.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>

#include "common/check.h"
#include "server/sync/digest.h"

namespace isthmus {

const char* MembershipStepName(MembershipStep s) {
  static constexpr const char* kNames[] = {"prepare", "query", "join", "fetch", "digest"};
  const auto i = static_cast<size_t>(s);
  return i < std::size(kNames) ? kNames[i] : "?";
}

const char* MembershipVoteName(MembershipVote v) {
  static constexpr const char* kNames[] = {"prepared", "applied", "pending", "refused",
                                           "abandoned"};
  const auto i = static_cast<size_t>(v);
  return i < std::size(kNames) ? kNames[i] : "?";
}

std::string NonMemberReason(const std::string& job, const SyncRecord& r, const std::string& site,
                            const std::string& own_site) {
  if (r.members.Has(site)) return "";
  const std::string who = site == own_site ? "this site (" + site + ")" : "site " + site;
  auto it = r.removed.find(site);
  if (it != r.removed.end()) {
    return who + " is no longer a member of job '" + job + "': it left or was removed from round " +
           std::to_string(it->second) + " (epoch " + std::to_string(r.members.epoch) +
           ", members " + r.members.SiteList() + "); it must join again";
  }
  return who + " is not a member of job '" + job + "' (members " + r.members.SiteList() +
         ", epoch " + std::to_string(r.members.epoch) + ")";
}

MembershipProtocol::MembershipProtocol(std::string site, std::vector<std::string> peer_sites,
                                       bool keeps_momentum, std::chrono::seconds change_timeout,
                                       std::function<Clock::time_point()> now, MembershipHost* host)
    : site_(std::move(site)),
      peer_sites_(std::move(peer_sites)),
      keeps_momentum_(keeps_momentum),
      change_timeout_(change_timeout),
      now_(std::move(now)),
      host_(host) {}

void MembershipProtocol::Reset() {
  jobs_.clear();
  joining_.clear();
  invited_.clear();
}

bool MembershipProtocol::Configured(const std::string& site) const {
  return site == site_ ||
         std::find(peer_sites_.begin(), peer_sites_.end(), site) != peer_sites_.end();
}

std::vector<std::string> MembershipProtocol::MemberPeers(const SyncRecord& r) const {
  std::vector<std::string> out;
  for (const auto& s : r.members.sites) {
    if (s != site_) out.push_back(s);
  }
  return out;
}

namespace {

Result<const SyncRecord*> Held(const MembershipHost& host, const std::string& job) {
  const SyncRecord* r = host.Record(job);
  if (r == nullptr) return Status::NotFound("job '" + job + "' does not sync on this shard");
  return r;
}

}  // namespace

// ---- removal and leaving --------------------------------------------------------------

Result<MembershipChange> MembershipProtocol::ProposeRemoval(const std::string& name,
                                                            const std::string& site) {
  ISTHMUS_ASSIGN_OR_RETURN(const SyncRecord* r, Held(*host_, name));
  JobState& js = jobs_[name];
  if (std::string why = NonMemberReason(name, *r, site_, site_); !why.empty()) {
    return Status::FailedPrecondition(why);
  }
  if (!r->members.Has(site)) {
    return Status::FailedPrecondition("site " + site + " is not a member of job '" + name +
                                      "' (members " + r->members.SiteList() + ")");
  }
  if (r->pending) {
    if (r->pending->coordinator == site_ && !r->pending->next.Has(site)) {
      return *r->pending;  // the same change, still under way: asking again is harmless
    }
    return Status::FailedPrecondition("job '" + name + "': a membership change is under way (" +
                                      r->pending->Describe(r->members) +
                                      "); wait for its outcome or abandon it where it started");
  }
  MembershipChange change;
  change.coordinator = site_;
  change.next.epoch = r->members.epoch + 1;
  change.next.from_round = r->committed + 1;
  for (const auto& s : r->members.sites) {
    if (s != site) change.next.sites.push_back(s);
  }
  if (change.next.sites.empty()) {
    return Status::FailedPrecondition("job '" + name + "' has no other member");
  }
  for (const auto& s : change.next.sites) {
    if (!Configured(s)) {
      return Status::FailedPrecondition("site " + s +
                                        " stays a member but has no sync.peers entry here: "
                                        "it cannot be asked to agree");
    }
  }
  if (site == site_ && (r->staged_round != 0 || r->local != r->committed)) {
    // A planned leave drains first: no new rounds; the one being pushed may finish; the
    // leave is proposed once every round of this site has committed (OnRoundsCommitted).
    js.draining = true;
    js.note = "leaving: taking no new rounds, waiting until round " +
              std::to_string(r->staged_round ? r->staged_round : r->local) +
              " has committed (committed " + std::to_string(r->committed) + ")";
    spdlog::info("job '{}': {}", name, js.note);
    change.next.from_round = 0;  // decided when the leave is proposed
    return change;
  }
  spdlog::info("job '{}': proposing to {}", name, change.Describe(r->members));
  ISTHMUS_RETURN_IF_ERROR(StartChange(name, js, change));
  return change;
}

bool MembershipProtocol::Draining(const std::string& job) const {
  auto it = jobs_.find(job);
  return it != jobs_.end() && it->second.draining;
}

void MembershipProtocol::OnRoundsCommitted(const std::string& name) {
  auto it = jobs_.find(name);
  const SyncRecord* r = host_->Record(name);
  if (it == jobs_.end() || r == nullptr || !it->second.draining) return;
  // A draining leave goes ahead once this site's last round has committed.
  if (!r->pending && r->staged_round == 0 && r->local == r->committed && r->members.Has(site_)) {
    it->second.draining = false;
    auto proposed = ProposeRemoval(name, site_);
    if (!proposed.ok()) it->second.note = "leave not started: " + proposed.status().message();
  }
}

Status MembershipProtocol::StartChange(const std::string& name, JobState& js,
                                       const MembershipChange& change) {
  ISTHMUS_RETURN_IF_ERROR(host_->WritePending(name, change));
  js.votes.clear();
  js.note.clear();
  js.automatic = false;
  js.progress_at = now_();
  if (change.coordinator == site_ && change.next.sites == std::vector<std::string>{site_}) {
    return ApplyChange(name, js);  // nobody else to ask
  }
  return Status::Ok();
}

Result<bool> MembershipProtocol::ProposeSilentRemoval(const std::string& name,
                                                      const std::set<std::string>& silent) {
  ISTHMUS_ASSIGN_OR_RETURN(const SyncRecord* r, Held(*host_, name));
  JobState& js = jobs_[name];
  if (!r->members.Has(site_)) return false;
  if (r->pending) {
    if (r->pending->coordinator != site_) return false;
    for (const auto& s : r->members.sites) {
      if (js.automatic && s != site_ && !r->pending->next.Has(s) && !silent.count(s)) {
        ISTHMUS_RETURN_IF_ERROR(DropChange(
            name, js,
            "automatic removal given up: site " + s + " was heard from again (slow, not gone)"));
        return false;
      }
    }
    for (const auto& p : r->pending->next.sites) {
      if (p != site_ && !js.votes.count(p) && silent.count(p)) {
        ISTHMUS_RETURN_IF_ERROR(DropChange(name, js,
                                           "given up: it needs the agreement of site " + p +
                                               ", which is silent too (" +
                                               r->pending->Describe(r->members) + ")"));
        return false;
      }
    }
    return false;
  }
  std::vector<std::string> gone, remaining;
  for (const auto& s : r->members.sites) {
    (s != site_ && silent.count(s) ? gone : remaining).push_back(s);
  }
  if (gone.empty()) return false;
  std::string who;
  for (const auto& s : gone) who += (who.empty() ? "" : ",") + s;
  if (r->members.sites.size() < 3) {
    js.note = "silent: " + who + "; with two sites nothing is removed automatically";
    return false;
  }
  if (2 * remaining.size() <= r->members.sites.size()) {
    js.note = "silent: " + who + "; the others are no majority of " + r->members.SiteList() +
              ", so nothing is removed automatically";
    return false;
  }
  if (remaining.front() != site_) return false;  // the first-named remaining proposes
  if (r->committed < js.wait_for_round) {
    js.note =
        "silent: " + who + "; not proposing a removal before this site has committed round " +
        std::to_string(js.wait_for_round) + " as the other members have" +
        (js.catching_up_from.empty() ? std::string()
                                     : " (catching up from site " + js.catching_up_from + ")");
    return false;
  }
  MembershipChange change;
  change.coordinator = site_;
  change.next.epoch = r->members.epoch + 1;
  change.next.from_round = r->committed + 1;
  change.next.sites = remaining;
  for (const auto& s : remaining) {
    if (!Configured(s)) return false;
  }
  spdlog::warn("job '{}': {} silent past sync.remove_silent_after_s: proposing to {}", name, who,
               change.Describe(r->members));
  ISTHMUS_RETURN_IF_ERROR(StartChange(name, js, change));
  js.automatic = true;
  return true;
}

Status MembershipProtocol::Invite(const std::string& name, const std::string& site,
                                  std::chrono::seconds valid_for) {
  ISTHMUS_ASSIGN_OR_RETURN(const SyncRecord* r, Held(*host_, name));
  if (std::string why = NonMemberReason(name, *r, site_, site_); !why.empty()) {
    return Status::FailedPrecondition(why + ": only a member can invite a site");
  }
  if (r->members.Has(site)) {
    return Status::FailedPrecondition("site " + site + " is a member of job '" + name +
                                      "' already (members " + r->members.SiteList() + ")");
  }
  if (site == site_ || !Configured(site)) {
    return Status::NotFound("site '" + site +
                            "' has no sync.peers entry here: add it (sync.peers "
                            "and security.peer_keys) and restart this shard, then invite it");
  }
  invited_[name][site] = now_() + valid_for;
  jobs_[name].join_refusals.erase(site);
  spdlog::info("job '{}': site {} is invited to join for {} s", name, site, valid_for.count());
  return Status::Ok();
}

void MembershipProtocol::ExpireStalled() {
  const auto now = now_();
  for (const auto& name : host_->Jobs()) {
    const SyncRecord* r = host_->Record(name);
    if (r == nullptr || !r->pending || r->pending->coordinator != site_) continue;
    JobState& js = jobs_[name];
    if (js.progress_at == Clock::time_point{}) js.progress_at = now;  // first look since start
    if (now - js.progress_at < change_timeout_) continue;
    std::string waiting;
    for (const auto& p : r->pending->next.sites) {
      if (p != site_ && !js.votes.count(p)) waiting += (waiting.empty() ? "" : ",") + p;
    }
    const std::string why = "given up: no progress for " + std::to_string(change_timeout_.count()) +
                            " s (sync.change_timeout_s)" +
                            (waiting.empty() ? std::string() : ", waiting for " + waiting) + ": " +
                            r->pending->Describe(r->members);
    if (Status s = DropChange(name, js, why); !s.ok()) {
      spdlog::warn("job '{}': cannot give up a stalled change: {}", name, s.ToString());
    }
  }
  for (auto& [name, jn] : joining_) {
    if (jn.failed) continue;
    if (jn.progress_at == Clock::time_point{}) jn.progress_at = now;
    if (now - jn.progress_at < change_timeout_) continue;
    jn.failed = true;
    jn.note = "join failed: no progress for " + std::to_string(change_timeout_.count()) +
              " s (sync.change_timeout_s) asking site " + jn.from + "; check that site " + jn.from +
              " invited this site (isthmusctl sync invite) "
              "and that the links to the members are up, then run sync join again";
    spdlog::warn("job '{}': {}", name, jn.note);
  }
}

Status MembershipProtocol::AbandonChange(const std::string& name) {
  if (auto jt = joining_.find(name); jt != joining_.end() && !jt->second.failed) {
    // A join this site makes: the coordinator gives the addition up by itself (no one asks).
    joining_.erase(jt);
    spdlog::info("job '{}': join abandoned by the operator", name);
    return Status::Ok();
  }
  ISTHMUS_ASSIGN_OR_RETURN(const SyncRecord* r, Held(*host_, name));
  JobState& js = jobs_[name];
  if (js.draining && !r->pending) {
    js.draining = false;
    js.note = "leave abandoned by the operator: this site takes rounds again";
    return Status::Ok();
  }
  js.draining = false;
  if (!r->pending) {
    return Status::FailedPrecondition("job '" + name + "': no membership change is under way");
  }
  if (r->pending->coordinator != site_) {
    return Status::FailedPrecondition("job '" + name + "': the change is coordinated by site " +
                                      r->pending->coordinator +
                                      "; abandon it there (this site learns the outcome from it)");
  }
  return DropChange(name, js, "abandoned by the operator: " + r->pending->Describe(r->members));
}

Status MembershipProtocol::DropChange(const std::string& name, JobState& js, const std::string& why,
                                      bool transient) {
  const SyncRecord* r = host_->Record(name);
  ISTHMUS_CHECK(r != nullptr && r->pending.has_value(), "DropChange without a pending change");
  const MembershipChange change = *r->pending;
  ISTHMUS_RETURN_IF_ERROR(host_->WritePending(name, std::nullopt));
  // A site whose addition was given up is told why at its next join request, however the
  // messages interleaved (it may never have seen this proposal).
  for (const auto& s : change.next.sites) {
    if (!r->members.Has(s) && !transient) js.join_refusals[s] = why;
  }
  js.votes.clear();
  js.note = why;
  spdlog::warn("job '{}': membership change {}", name, why);
  return host_->CommitReady(name);  // commits held for the change may go ahead
}

Status MembershipProtocol::ApplyChange(const std::string& name, JobState& js) {
  const SyncRecord* r = host_->Record(name);
  ISTHMUS_CHECK(r != nullptr && r->pending.has_value(), "ApplyChange without a pending change");
  const MembershipChange change = *r->pending;
  SyncRecord next = *r;
  next.members = change.next;
  next.pending.reset();
  next.version = r->version + 1;
  std::vector<std::string> gone;
  for (const auto& s : r->members.sites) {
    if (change.next.Has(s)) continue;
    gone.push_back(s);
    next.removed[s] = change.next.from_round;
    next.acked.erase(s);
  }
  for (const auto& s : change.next.sites) {
    if (r->members.Has(s)) continue;
    // An added site holds the state of every round before its first: it needs none of them.
    next.removed.erase(s);
    next.joined[s] = change.next.from_round;
    if (s != site_) next.acked[s] = std::max(next.acked[s], change.next.from_round - 1);
  }
  const std::string what = change.Describe(r->members);
  ISTHMUS_RETURN_IF_ERROR(host_->ApplyMembership(name, next, gone));
  for (const auto& s : change.next.sites) invited_[name].erase(s);  // used up
  js.votes.clear();
  js.note = "applied: " + what;
  joining_.erase(name);  // a join this site asked for earlier and that failed is old news
  spdlog::info("job '{}': membership changed: {}", name, what);
  return host_->CommitReady(name);
}

std::string MembershipProtocol::PrepareRefusal(const SyncRecord& r, const std::string& from,
                                               const MembershipChange& c) const {
  const std::string here = "site " + site_;
  if (c.coordinator != from) {
    return "site " + from + " sent a change coordinated by " + c.coordinator;
  }
  if (!r.members.Has(from)) return "site " + from + " is not a member here";
  if (!c.next.Has(site_)) return here + " is not in the proposed membership";
  if (c.next.epoch != r.members.epoch + 1) {
    return here + " is at membership epoch " + std::to_string(r.members.epoch) + " (members " +
           r.members.SiteList() + "), the change needs epoch " + std::to_string(c.next.epoch - 1) +
           ": the sites disagree on the membership";
  }
  const bool addition = std::any_of(c.next.sites.begin(), c.next.sites.end(),
                                    [&](const std::string& s) { return !r.members.Has(s); });
  if (c.next.from_round != r.committed + 1 && addition) {
    return here + " has committed round " + std::to_string(r.committed) + ", site " +
           c.coordinator + " round " + std::to_string(c.next.from_round - 1) +
           ": rounds went on while the addition was being agreed; the joining site asks again";
  }
  if (c.next.from_round != r.committed + 1) {
    return here + " has committed round " + std::to_string(r.committed) + ", site " +
           c.coordinator + " round " + std::to_string(c.next.from_round - 1) +
           ": the sites disagree on rounds, so they would not merge the same deltas (run "
           "isthmusctl sync catch-up --from " +
           (r.committed < c.next.from_round - 1 ? c.coordinator + " on site " + site_
                                                : site_ + " on site " + c.coordinator) +
           ", then try again)";
  }
  std::vector<std::string> gone, added;
  for (const auto& s : r.members.sites) {
    if (!c.next.Has(s)) gone.push_back(s);
  }
  for (const auto& s : c.next.sites) {
    if (!r.members.Has(s)) added.push_back(s);
  }
  if (gone.empty() == added.empty() || added.size() > 1) {
    return "the change is neither a removal nor the addition of one site to " +
           r.members.SiteList();
  }
  if (!added.empty() && !Configured(added[0])) {
    return "site " + added[0] + " has no sync.peers entry at " + here +
           ": add it (sync.peers and security.peer_keys) and restart this shard before it joins";
  }
  return "";
}

// ---- the peer links' side -------------------------------------------------------------

MembershipAnswer MembershipProtocol::OnRequest(const std::string& from,
                                               const MembershipRequest& req) {
  const SyncRecord* r = host_->Record(req.job);
  if (auto jt = joining_.find(req.job);
      jt != joining_.end() && (r == nullptr || !jt->second.failed)) {
    return OnJoiningRequest(from, req);
  }
  if (r == nullptr) {
    return {MembershipVote::kRefused, "job '" + req.job + "' does not sync on this shard"};
  }
  JobState& js = jobs_[req.job];
  const MembershipChange& c = req.change;
  if (req.step == MembershipStep::kJoin) {
    if (std::string why = NonMemberReason(req.job, *r, site_, site_); !why.empty()) {
      return {MembershipVote::kRefused, why};
    }
    if (auto it = js.join_refusals.find(from); it != js.join_refusals.end() && !r->pending) {
      std::string why = "its addition was given up: " + it->second;
      js.join_refusals.erase(it);  // a later join is proposed afresh
      return {MembershipVote::kRefused, why};
    }
    if (r->members.Has(from)) {
      return {MembershipVote::kRefused, "site " + from + " is already a member of job '" + req.job +
                                            "' (epoch " + std::to_string(r->members.epoch) + ")"};
    }
    if (r->pending) {
      if (r->pending->coordinator == site_ && r->pending->next.Has(from)) {
        return {MembershipVote::kPending, r->pending->Describe(r->members)};
      }
      return {MembershipVote::kRefused, "another change is under way at site " + site_ + ": " +
                                            r->pending->Describe(r->members)};
    }
    auto inv = invited_[req.job].find(from);
    if (inv == invited_[req.job].end() || now_() > inv->second) {
      const bool expired = inv != invited_[req.job].end();
      if (expired) invited_[req.job].erase(inv);
      return {MembershipVote::kRefused,
              "site " + from +
                  (expired ? "'s invitation to job '" + req.job + "' has expired"
                           : " is not invited to join job '" + req.job + "'") +
                  " at site " + site_ + ": an operator of site " + site_ +
                  " runs `isthmusctl sync invite --site " + from + " -j " + req.job +
                  "`, then the join is started again"};
    }
    if (r->committed < js.wait_for_round) {
      // A member that refused the last proposal had committed further: propose once this
      // site stands there too, or the same refusal comes back.
      return {MembershipVote::kPending, "site " + site_ + " commits round " +
                                            std::to_string(js.wait_for_round) +
                                            " first, then proposes the addition"};
    }
    const Membership before = r->members;
    auto added = ProposeAddition(req.job, js, from);
    if (!added.ok()) return {MembershipVote::kRefused, added.status().message()};
    return {MembershipVote::kPending, added->Describe(before)};
  }
  if (req.step == MembershipStep::kFetch && r->members.Has(from) && r->members.Has(site_) &&
      c.coordinator == site_ && c.next == r->members) {
    // A member catching up: this site's committed state as it stands.
    auto image = host_->Image(req.job);
    if (!image.ok()) return {MembershipVote::kRefused, image.status().ToString()};
    return {MembershipVote::kPrepared, "", (*image)->digest, *image};
  }
  if (req.step == MembershipStep::kFetch) {
    if (!r->pending || !(*r->pending == c) || c.coordinator != site_ || !c.next.Has(from)) {
      // Given up since the joining site was prepared (a member had committed further, found
      // by the nemesis across sites): abandoned, so that it asks again, as after a prepare.
      return {r->members.Has(from) ? MembershipVote::kRefused : MembershipVote::kAbandoned,
              "no addition of site " + from + " is under way at site " + site_ +
                  (js.note.empty() ? std::string() : " (" + js.note + ")")};
    }
    js.progress_at = now_();  // the joining site is fetching
    auto image = host_->Image(req.job);
    if (!image.ok()) return {MembershipVote::kRefused, image.status().ToString()};
    return {MembershipVote::kPrepared, "", (*image)->digest, *image};
  }
  if (req.step == MembershipStep::kDigest) {
    const uint64_t round = c.next.from_round == 0 ? 0 : c.next.from_round - 1;
    if (r->committed < round) {
      return {MembershipVote::kPending,
              "round " + std::to_string(round) + " is not committed here"};
    }
    auto d = host_->Digest(req.job, round);
    if (!d.ok() || !*d) {
      return {MembershipVote::kRefused, "no digest of round " + std::to_string(round) + " here"};
    }
    return {MembershipVote::kPrepared, "", **d, nullptr};
  }
  if (req.step == MembershipStep::kQuery) {
    if (c.coordinator != site_) {
      return {MembershipVote::kRefused, "site " + site_ + " does not coordinate it"};
    }
    if (r->pending && *r->pending == c) return {MembershipVote::kPending, ""};
    if (r->members == c.next || r->members.epoch > c.next.epoch) {
      return {MembershipVote::kApplied, ""};
    }
    return {MembershipVote::kAbandoned, js.note};
  }
  if (r->members == c.next) return {MembershipVote::kApplied, ""};  // a retry: already in effect
  if (r->pending) {
    if (*r->pending == c) return {MembershipVote::kPrepared, ""};
    return {MembershipVote::kRefused, "another change is under way at site " + site_ + ": " +
                                          r->pending->Describe(r->members)};
  }
  // A planned leave (the coordinator removes itself, and nobody joins) proposed right after
  // the coordinator committed a round this site has not committed yet: that round's deltas
  // are on their way (the leaving site is alive and sent its own), so this site waits for
  // it instead of refusing, and the coordinator asks again. (Refusing dropped the leave for
  // good: a draining site commits nothing more that would propose it again.)
  const bool planned_leave = c.coordinator == from && !c.next.Has(from) &&
                             c.next.epoch == r->members.epoch + 1 &&
                             std::all_of(c.next.sites.begin(), c.next.sites.end(),
                                         [&](const std::string& s) { return r->members.Has(s); });
  if (planned_leave && r->committed + 1 < c.next.from_round) {
    return {MembershipVote::kPending,
            "round " + std::to_string(c.next.from_round - 1) + " is not committed here yet"};
  }
  if (std::string why = PrepareRefusal(*r, from, c); !why.empty()) {
    spdlog::warn("job '{}': refused {}: {}", req.job, c.Describe(r->members), why);
    MembershipAnswer refused{MembershipVote::kRefused, why};
    refused.committed = r->committed;  // lets a coordinator that is behind catch up
    return refused;
  }
  const std::string what = c.Describe(r->members);
  if (Status s = StartChange(req.job, js, c); !s.ok()) {
    return {MembershipVote::kRefused, "cannot record the change here: " + s.ToString()};
  }
  spdlog::info("job '{}': agreed to {}", req.job, what);
  return {MembershipVote::kPrepared, ""};
}

std::vector<MembershipRequest> MembershipProtocol::Requests(const std::string& peer) {
  std::vector<MembershipRequest> out;
  for (const auto& [name, js] : jobs_) {
    const SyncRecord* r = host_->Record(name);
    if (r != nullptr && !js.catching_up_from.empty() && peer == js.catching_up_from) {
      out.push_back({name, MembershipStep::kFetch, {r->members, js.catching_up_from}});
    }
  }
  for (const auto& [name, jn] : joining_) {
    if (jn.failed) continue;
    if (!jn.change) {
      if (peer == jn.from) {
        out.push_back({name, MembershipStep::kJoin, {{0, {site_}, 0}, jn.from}});
      }
    } else if (!jn.image) {
      if (peer == jn.from) out.push_back({name, MembershipStep::kFetch, *jn.change});
    } else if (peer == jn.from) {
      // The state is here and the members' digests are being asked for. The coordinator may
      // have given the addition up since it sent the state (a member refused it), and such a
      // member never answers this site: ask the coordinator how the change stands meanwhile.
      out.push_back({name, MembershipStep::kQuery, *jn.change});
    } else if (jn.image->members.Has(peer) && !jn.digests.count(peer)) {
      out.push_back({name, MembershipStep::kDigest, *jn.change});
    }
  }
  for (const auto& name : host_->Jobs()) {
    const SyncRecord* r = host_->Record(name);
    if (r == nullptr || !r->pending) continue;
    const MembershipChange& c = *r->pending;
    if (c.coordinator == site_) {
      auto js = jobs_.find(name);
      if (peer != site_ && c.next.Has(peer) &&
          (js == jobs_.end() || !js->second.votes.count(peer))) {
        out.push_back({name, MembershipStep::kPrepare, c});
      }
    } else if (peer == c.coordinator) {
      out.push_back({name, MembershipStep::kQuery, c});
    }
  }
  return out;
}

void MembershipProtocol::OnAnswer(const std::string& peer, const MembershipRequest& req,
                                  const MembershipAnswer& answer) {
  const SyncRecord* r = host_->Record(req.job);
  if (auto jt = joining_.find(req.job);
      r == nullptr || (jt != joining_.end() && !jt->second.failed)) {
    OnJoiningAnswer(peer, req, answer);
    return;
  }
  JobState& js = jobs_[req.job];
  if (req.step == MembershipStep::kFetch) {
    OnCatchUpAnswer(req.job, js, peer, answer);
    return;
  }
  if (!r->pending || !(*r->pending == req.change)) return;  // an answer about an older change
  Status s;
  if (req.step == MembershipStep::kPrepare) {
    if (answer.vote == MembershipVote::kPrepared || answer.vote == MembershipVote::kApplied) {
      if (js.votes.insert(peer).second) js.progress_at = now_();
      bool all = true;
      for (const auto& p : r->pending->next.sites) all &= p == site_ || js.votes.count(p);
      if (all && std::getenv("ISTHMUS_SERVER_FAULT_CRASH_BEFORE_APPLY") != nullptr) {
        // Fault injection for tests (docs/TESTING.md): every site agreed, nothing applied yet.
        spdlog::error("ISTHMUS_SERVER_FAULT_CRASH_BEFORE_APPLY: exiting before the change applies");
        std::_Exit(137);
      }
      if (all) s = ApplyChange(req.job, js);
    } else if (answer.vote == MembershipVote::kRefused) {
      const bool automatic = js.automatic;
      const uint64_t committed = r->committed;
      // The sites stood at different rounds for a moment (commits went on between the
      // proposal and this prepare): a joining site asks again and gets a fresh proposal.
      const bool transient = answer.committed != 0 && answer.committed != committed;
      s = DropChange(req.job, js, "refused by site " + peer + ": " + answer.reason, transient);
      if (s.ok() && answer.committed > committed) {
        // The refusing member has committed further: whatever is proposed next must start
        // from its round, so this site takes its state first when the policy proposed.
        js.wait_for_round = answer.committed;
        if (automatic && js.catching_up_from.empty()) {
          if (Status c = StartCatchUp(req.job, peer); !c.ok()) {
            spdlog::warn("job '{}': cannot catch up from site {}: {}", req.job, peer, c.ToString());
          }
        }
      }
    }
  } else if (answer.vote == MembershipVote::kApplied) {
    s = ApplyChange(req.job, js);
  } else if (answer.vote == MembershipVote::kAbandoned || answer.vote == MembershipVote::kRefused) {
    s = DropChange(req.job, js,
                   "abandoned by its coordinator " + peer +
                       (answer.reason.empty() ? std::string() : " (" + answer.reason + ")"));
  }
  if (!s.ok()) spdlog::warn("job '{}': membership change: {}", req.job, s.ToString());
}

uint64_t MembershipProtocol::FirstRoundTo(const std::string& peer, const std::string& job) const {
  const SyncRecord* r = host_->Record(job);
  if (r == nullptr || !r->members.Has(site_) || !r->members.Has(peer)) return 0;
  auto joined = r->joined.find(peer);
  uint64_t first = joined == r->joined.end() ? 1 : joined->second;
  // A site that joined (or joined again) holds no rounds of its own before its first: a
  // link that knew the job from before must not wait for them.
  if (auto self = r->joined.find(site_); self != r->joined.end()) {
    first = std::max(first, self->second);
  }
  return first;
}

std::string MembershipProtocol::RefusesPeer(const std::string& site, const std::string& job) const {
  const SyncRecord* r = host_->Record(job);
  if (r == nullptr) return "";
  if (!r->members.Has(site_)) {
    // Joined and agreed, waiting for the addition to apply: the links must work.
    if (r->pending && r->pending->next.Has(site_)) return "";
    return NonMemberReason(job, *r, site_, site_);
  }
  return r->removed.count(site) ? NonMemberReason(job, *r, site, site_) : "";
}

uint64_t MembershipProtocol::RemovedFrom(const std::string& site, const std::string& job) const {
  const SyncRecord* r = host_->Record(job);
  if (r == nullptr || r->members.Has(site)) return 0;
  auto it = r->removed.find(site);
  return it == r->removed.end() ? 0 : it->second;
}

void MembershipProtocol::OnRemovedNotice(const std::string& peer, const std::string& job,
                                         uint64_t removed_from) {
  const SyncRecord* r = host_->Record(job);
  if (r == nullptr || !r->members.Has(site_) || !r->members.Has(peer)) return;
  // A removal from before the membership this site holds is stale: the peer answered before
  // it applied the change that counted this site in again (a join), and the answer was read
  // after this site installed it. Taking it would stop the rejoined site's workers.
  if (removed_from < r->members.from_round) return;
  JobState& js = jobs_[job];
  std::string notice = "site " + peer + " no longer counts this site (" + site_ + ") in job '" +
                       job + "': it was removed from round " + std::to_string(removed_from) +
                       " while this site was away; it takes no more rounds. To take part again: an "
                       "operator of a member runs `isthmusctl sync invite --site " +
                       site_ + "`, then `isthmusctl sync join --from MEMBER -j " + job + "` here";
  if (notice != js.removed_notice) spdlog::warn("job '{}': {}", job, notice);
  js.removed_notice = std::move(notice);
}

std::string MembershipProtocol::RemovedNotice(const std::string& job) const {
  if (auto it = jobs_.find(job); it != jobs_.end() && !it->second.removed_notice.empty()) {
    return it->second.removed_notice;
  }
  const SyncRecord* r = host_->Record(job);
  if (r != nullptr && !r->members.Has(site_) && r->removed.count(site_)) {
    return NonMemberReason(job, *r, site_, site_) +
           " (an operator of a member runs `isthmusctl sync invite --site " + site_ +
           "`, then `isthmusctl sync join --from MEMBER -j " + job + "` here)";
  }
  return "";
}

std::optional<MembershipStatus> MembershipProtocol::StatusOf(const std::string& name) const {
  const SyncRecord* r = host_->Record(name);
  if (auto jt = joining_.find(name); jt != joining_.end() && (r == nullptr || !jt->second.failed)) {
    MembershipStatus s;
    s.note = jt->second.note;
    if (!jt->second.failed) {
      s.pending = jt->second.change.value_or(MembershipChange{{}, jt->second.from});
    }
    return s;
  }
  if (r == nullptr) return std::nullopt;
  MembershipStatus s;
  auto it = jobs_.find(name);
  if (it != jobs_.end()) {
    s.note = it->second.note;
    s.catching_up = !it->second.catching_up_from.empty();
    s.draining = it->second.draining;
  }
  s.pending = r->pending;
  if (r->pending && r->pending->coordinator == site_) {
    std::string waiting;
    for (const auto& p : r->pending->next.sites) {
      if (p != site_ && (it == jobs_.end() || !it->second.votes.count(p))) {
        waiting += (waiting.empty() ? "" : ",") + p;
      }
    }
    s.note = "waiting for " + (waiting.empty() ? std::string("nobody") : waiting) +
             " to agree: " + r->pending->Describe(r->members);
  } else if (r->pending) {
    s.note = "agreed, waiting for the outcome from " + r->pending->coordinator + ": " +
             r->pending->Describe(r->members);
  } else if (auto jt = joining_.find(name); jt != joining_.end()) {
    s.note = jt->second.note;  // a join this site asked for failed: say why
  } else if (it != jobs_.end() && !it->second.removed_notice.empty()) {
    s.note = it->second.removed_notice;
  }
  return s;
}

std::vector<std::string> MembershipProtocol::JoiningJobs(bool failed) const {
  std::vector<std::string> out;
  for (const auto& [name, jn] : joining_) {
    if (failed || !jn.failed) out.push_back(name);
  }
  return out;
}

// ---- joining --------------------------------------------------------------------------

Result<MembershipChange> MembershipProtocol::ProposeAddition(const std::string& name, JobState& js,
                                                             const std::string& site) {
  const SyncRecord* r = host_->Record(name);
  MembershipChange change;
  change.coordinator = site_;
  change.next = r->members;
  change.next.sites.push_back(site);
  std::sort(change.next.sites.begin(), change.next.sites.end());
  change.next.epoch = r->members.epoch + 1;
  change.next.from_round = r->committed + 1;
  for (const auto& s : change.next.sites) {
    if (!Configured(s)) {
      return Status::FailedPrecondition("site " + s + " has no sync.peers entry at site " + site_ +
                                        ": it cannot be asked to agree");
    }
  }
  spdlog::info("job '{}': site {} asks to join: proposing to {}", name, site,
               change.Describe(r->members));
  ISTHMUS_RETURN_IF_ERROR(StartChange(name, js, change));
  return change;
}

Status MembershipProtocol::StartJoin(const std::string& name, const std::string& from) {
  if (const SyncRecord* r = host_->Record(name)) {
    // A site that has committed rounds with `from` may have been removed while it was away
    // and not heard it yet (no member's handshake since its restart): `from` decides, and
    // refuses a member. A job this site only created (no round committed) is refused here.
    const bool may_be_removed = r->committed > 0 && r->members.Has(from);
    if (r->members.Has(site_) && RemovedNotice(name).empty() && !may_be_removed) {
      return Status::FailedPrecondition("job '" + name + "' already syncs on this shard (members " +
                                        r->members.SiteList() +
                                        "): a site joins a job it is not a member of");
    }
    // A removed site joins again: its state is replaced once the members' state is checked.
  }
  if (from == site_ || !Configured(from)) {
    return Status::NotFound("site '" + from + "' has no sync.peers entry here");
  }
  auto it = joining_.find(name);
  if (it != joining_.end() && !it->second.failed && it->second.from == from) {
    return Status::Ok();  // under way
  }
  Joining jn;
  jn.from = from;
  jn.note = "joining: asking site " + from + " to add this site";
  joining_[name] = std::move(jn);
  spdlog::info("job '{}': joining, asking site {} to coordinate", name, from);
  return Status::Ok();
}

MembershipAnswer MembershipProtocol::OnJoiningRequest(const std::string& from,
                                                      const MembershipRequest& req) {
  Joining& jn = joining_.at(req.job);
  const MembershipChange& c = req.change;
  if (jn.failed || req.step != MembershipStep::kPrepare || from != jn.from ||
      c.coordinator != from || !c.next.Has(site_)) {
    return {MembershipVote::kRefused, "site " + site_ + " does not hold job '" + req.job +
                                          "' yet and is not joining it through site " + from};
  }
  if (!jn.change || !(*jn.change == c)) {
    jn.change = c;
    jn.image.reset();
    jn.digests.clear();
  }
  if (!jn.image) {
    jn.note = "joining: fetching the state of round " + std::to_string(c.next.from_round - 1) +
              " from site " + from;
  }
  return {MembershipVote::kPending, jn.note};
}

std::string MembershipProtocol::ImageProblem(const Joining& jn, const JobImage& image) const {
  const MembershipChange& c = *jn.change;
  Membership expect = image.members;
  expect.sites.push_back(site_);
  std::sort(expect.sites.begin(), expect.sites.end());
  if (image.round + 1 != c.next.from_round || image.members.epoch + 1 != c.next.epoch ||
      expect.sites != c.next.sites || image.members.Has(site_)) {
    return "the state of round " + std::to_string(image.round) + " does not fit the addition (" +
           c.Describe(image.members) + ")";
  }
  if (image.tensors.empty()) return "the state has no tensors";
  for (const auto& t : image.tensors) {
    if (static_cast<bool>(t.momentum) != keeps_momentum_) {
      return "site " + jn.from +
             " keeps outer momentum and this site does not, or the reverse "
             "(sync.outer_momentum must be the same on every site)";
    }
  }
  const std::string digest = ImageDigest(image);
  if (digest != image.digest) {
    return "the state from site " + jn.from + " hashes to " + digest.substr(0, 16) +
           ", not to its digest " + image.digest.substr(0, 16);
  }
  return "";
}

void MembershipProtocol::OnJoiningAnswer(const std::string& peer, const MembershipRequest& req,
                                         const MembershipAnswer& answer) {
  auto jt = joining_.find(req.job);
  if (jt == joining_.end() || jt->second.failed) return;
  Joining& jn = jt->second;
  auto fail = [&](const std::string& why) {
    jn.failed = true;
    jn.note = "join failed: " + why;
    spdlog::warn("job '{}': {}", req.job, jn.note);
  };
  if (answer.vote == MembershipVote::kRefused || answer.vote == MembershipVote::kAbandoned) {
    if (req.step == MembershipStep::kDigest && jn.image && !jn.image->members.Has(peer)) return;
    if (answer.vote == MembershipVote::kAbandoned && peer == jn.from && jn.restarts < 10) {
      // The coordinator gave this addition up (often: the members' rounds moved on while it
      // was being agreed). Ask again; a refusal that lasts comes back as the answer to the
      // join request itself, and ends the join with its reason.
      ++jn.restarts;
      jn.change.reset();
      jn.image.reset();
      jn.digests.clear();
      jn.note = "joining: site " + peer + " gave the addition up (" + answer.reason +
                "); asking it again";
      spdlog::info("job '{}': {}", req.job, jn.note);
      return;
    }
    return fail("site " + peer + " refused: " + answer.reason);
  }
  jn.progress_at = now_();  // an answer, whatever it says
  if (req.step == MembershipStep::kFetch && answer.image && jn.change && *jn.change == req.change &&
      !jn.image) {
    if (std::string why = ImageProblem(jn, *answer.image); !why.empty()) return fail(why);
    jn.image = answer.image;
    jn.digests[peer] = answer.image->digest;
    jn.note = "joining: checking the state of round " + std::to_string(jn.image->round) +
              " against the members' digests";
  } else if (req.step == MembershipStep::kDigest && jn.image && jn.change &&
             *jn.change == req.change && answer.vote == MembershipVote::kPrepared) {
    jn.digests[peer] = answer.digest;
  }
  if (!jn.image) return;
  for (const auto& m : jn.image->members.sites) {
    auto d = jn.digests.find(m);
    if (d == jn.digests.end()) return;  // still asking
    if (d->second != jn.image->digest) {
      return fail("site " + m + " reports digest " + d->second.substr(0, 16) + " for round " +
                  std::to_string(jn.image->round) + ", site " + jn.from + " " +
                  jn.image->digest.substr(0, 16) + ": the members disagree");
    }
  }
  if (Status s = InstallJoined(req.job, jn); !s.ok()) {
    fail("cannot create the job: " + s.ToString());
  }
}

Status MembershipProtocol::InstallJoined(const std::string& name, Joining& jn) {
  const JobImage& image = *jn.image;
  ISTHMUS_RETURN_IF_ERROR(host_->InstallImage(name, image, *jn.change));
  std::string members;
  for (const auto& [site, _] : jn.digests) members += (members.empty() ? "" : ",") + site;
  JobState& js = jobs_[name];
  js = JobState{};
  js.note = "joined at round " + std::to_string(image.round) + " with the state of site " +
            jn.from + ", digest " + image.digest.substr(0, 16) + " confirmed by " + members;
  spdlog::info("job '{}': {}", name, js.note);
  joining_.erase(name);
  return Status::Ok();
}

// ---- catching up ----------------------------------------------------------------------

Status MembershipProtocol::StartCatchUp(const std::string& name, const std::string& from) {
  ISTHMUS_ASSIGN_OR_RETURN(const SyncRecord* r, Held(*host_, name));
  if (std::string why = NonMemberReason(name, *r, site_, site_); !why.empty()) {
    return Status::FailedPrecondition(why);
  }
  if (from == site_ || !r->members.Has(from)) {
    return Status::FailedPrecondition("site " + from + " is not another member of job '" + name +
                                      "' (members " + r->members.SiteList() + ")");
  }
  if (r->pending) {
    return Status::FailedPrecondition("job '" + name + "': a membership change is under way (" +
                                      r->pending->Describe(r->members) + ")");
  }
  JobState& js = jobs_[name];
  js.catching_up_from = from;
  js.note = "catching up: asking site " + from + " for its committed state";
  spdlog::info("job '{}': catching up from site {}", name, from);
  return Status::Ok();
}

void MembershipProtocol::OnCatchUpAnswer(const std::string& name, JobState& js,
                                         const std::string& peer, const MembershipAnswer& answer) {
  if (js.catching_up_from.empty() || js.catching_up_from != peer) return;
  js.catching_up_from.clear();
  auto fail = [&](const std::string& why) {
    js.note = "catch-up failed: " + why;
    spdlog::warn("job '{}': {}", name, js.note);
  };
  if (answer.vote != MembershipVote::kPrepared || !answer.image) {
    return fail("site " + peer + " refused: " + answer.reason);
  }
  const SyncRecord* r = host_->Record(name);
  const JobImage& image = *answer.image;
  if (image.members != r->members) {
    return fail("site " + peer + " is at epoch " + std::to_string(image.members.epoch) +
                " (members " + image.members.SiteList() + "), this site at epoch " +
                std::to_string(r->members.epoch));
  }
  if (r->pending) return fail("a membership change started meanwhile");
  if (image.round <= r->committed) {
    js.note = "nothing to catch up: site " + peer + " has committed round " +
              std::to_string(image.round) + ", this site round " + std::to_string(r->committed);
    return;
  }
  for (const auto& t : image.tensors) {
    if (static_cast<bool>(t.momentum) != keeps_momentum_) {
      return fail("sync.outer_momentum differs between this site and site " + peer);
    }
  }
  if (ImageDigest(image) != image.digest) {
    return fail("the state from site " + peer + " does not hash to its digest");
  }
  const uint64_t before = r->committed;
  if (Status s = host_->AdoptImage(name, image); !s.ok()) return fail(s.message());
  js.note = "caught up from round " + std::to_string(before) + " to round " +
            std::to_string(image.round) + " with the state of site " + peer + " (digest " +
            image.digest.substr(0, 16) + ")";
  spdlog::info("job '{}': {}", name, js.note);
  if (Status s = host_->CommitReady(name); !s.ok())
    spdlog::warn("job '{}': {}", name, s.ToString());
}

}  // namespace isthmus
