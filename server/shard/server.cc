// Sockets, signals and the event loop around the Shard, and the crash-safe swap of the
// live database for a snapshot's files.
#include "server/shard/server.h"

#include <fcntl.h>
#include <pwd.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <zmq.hpp>

#include "common/durable.h"
#include "common/keys.h"
#include "common/metrics.h"
#include "common/transport.h"
#include "common/version.h"
#include "common/wire.h"
#include "server/shard/shard.h"
#include "server/storage/store.h"
#include "server/sync/peer_link.h"

namespace isthmus {
namespace {

namespace fs = std::filesystem;

// Restore swaps folders in three renames: copy -> db.restore, db -> db.old,
// db.restore -> db, then removes db.old. A crash between any two steps is finished here.
Status RecoverInterruptedRestore(const std::string& data_dir) {
  fs::path db = LiveDbDir(data_dir), restore = db.string() + ".restore", old = db.string() + ".old";
  std::error_code ec;
  if (!fs::exists(db, ec) && fs::exists(restore, ec)) {
    spdlog::warn("finishing a snapshot restore interrupted by a crash");
    if (Status s = RenameDurably(restore.string(), db.string()); !s.ok()) {
      return Status(s.code(), "cannot finish interrupted restore: " + s.message());
    }
  }
  if (fs::exists(db, ec)) {
    fs::remove_all(restore, ec);
    fs::remove_all(old, ec);
  } else if (fs::exists(old, ec)) {
    fs::rename(old, db, ec);  // crashed before the copy was complete: keep the old state
  }
  return Status::Ok();
}

// The name of the user this process runs as (its uid without one).
std::string ThisUser() {
  const uid_t uid = ::geteuid();
  if (const passwd* pw = ::getpwuid(uid); pw != nullptr) return pw->pw_name;
  return std::to_string(uid);
}

// Creates shard.data_dir when missing and checks that this process may write it, so that a
// folder of another user is reported as such (IoError, exit 6) before RocksDB tries.
Status PrepareDataDir(const std::string& data_dir) {
  auto refuse = [&](const std::string& doing, int err) {
    std::string msg =
        "cannot " + doing + " shard.data_dir '" + data_dir + "': " + std::strerror(err);
    if (err == EACCES || err == EPERM || err == EROFS) {
      msg += err == EROFS ? " (a read-only file system: pick a folder on a writable one, e.g. "
                            "under /var/lib/isthmus)"
                          : " (this server runs as user '" + ThisUser() +
                                "': chown the folder to that user, chown -R " + ThisUser() + ": " +
                                data_dir + ", or pick another folder)";
    }
    return Status::IoError(msg);
  };
  std::error_code ec;
  if (!fs::exists(data_dir, ec)) {
    // Created with its name durable: a data dir lost to a power loss takes every push.
    Status made = CreateDirectoriesDurably(data_dir);
    if (!made.ok()) {
      fs::create_directories(data_dir, ec);
      if (ec) return refuse("create", ec.value());
      return made;
    }
  }
  if (!fs::is_directory(data_dir, ec)) return refuse("use", ENOTDIR);
  if (::access(data_dir.c_str(), R_OK | W_OK | X_OK) != 0) return refuse("write", errno);
  return Status::Ok();
}

Status ReplaceDbFiles(const std::string& data_dir, const std::string& checkpoint) {
  fs::path db = LiveDbDir(data_dir), restore = db.string() + ".restore", old = db.string() + ".old";
  std::error_code ec;
  fs::remove_all(restore, ec);
  fs::copy(checkpoint, restore, fs::copy_options::recursive, ec);
  if (ec) {
    fs::remove_all(restore, ec);
    return Status::IoError("cannot copy snapshot files: " + ec.message());
  }
  // The copy whole on disk before the swap, and each rename durable before the next: a
  // power loss at any point leaves the old database, or the copy, whole under one of the
  // names RecoverInterruptedRestore finishes from.
  if (Status s = SyncTree(restore.string()); !s.ok()) {
    fs::remove_all(restore, ec);
    return Status(s.code(), "cannot make the snapshot's copy durable: " + s.message());
  }
  if (Status s = RenameDurably(db.string(), old.string()); !s.ok()) {
    return Status(s.code(), "cannot move the live database aside: " + s.message());
  }
  if (Status s = RenameDurably(restore.string(), db.string()); !s.ok()) {
    fs::rename(old, db, ec);
    return Status(s.code(), "cannot move the snapshot into place: " + s.message());
  }
  fs::remove_all(old, ec);
  return Status::Ok();
}

std::string EngineDetail(const SyncJobStatus& j) {
  std::string d;
  if (j.staged_round > 0) {
    d += "pushing round " + std::to_string(j.staged_round) + " (" +
         std::to_string(j.staged_tensors) + "/" + std::to_string(j.tensor_count) + " tensors)";
  }
  std::string held;
  for (const auto& [site, r] : j.held)
    held += (held.empty() ? "" : " ") + site + "=" + std::to_string(r);
  if (!held.empty()) d += std::string(d.empty() ? "" : "; ") + "held " + held;
  std::string pipes;
  for (const auto& [p, n] : j.pipelines) {
    pipes += (pipes.empty() ? "" : ", ") + p + " (" + std::to_string(n) + " tensors)";
  }
  if (!pipes.empty()) d += std::string(d.empty() ? "" : "; ") + "codec " + pipes;
  if (j.compression_ratio > 0) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "; ratio %.1fx", j.compression_ratio);
    d += buf;
  }
  return d;
}

Status DoSyncStatus(uint64_t id, const ServerConfig& c, SyncEngine* engine, PeerLinks* links,
                    Reply& reply) {
  auto& fbb = reply.header;
  std::vector<flatbuffers::Offset<wire::PeerLinkInfo>> link_infos;
  if (links != nullptr) {
    for (const auto& st : links->Stats()) {
      std::vector<flatbuffers::Offset<wire::PeerLinkJob>> jobs;
      for (const auto& j : st.jobs) {
        uint64_t lag = j.outbox_round > j.acked_round ? j.outbox_round - j.acked_round : 0;
        jobs.push_back(wire::CreatePeerLinkJob(fbb, fbb.CreateString(j.job), j.acked_round,
                                               j.outbox_round, lag));
      }
      link_infos.push_back(wire::CreatePeerLinkInfo(
          fbb, fbb.CreateString(st.site), fbb.CreateString(st.endpoint), st.connected, st.paused,
          fbb.CreateString(st.last_error), fbb.CreateVector(jobs), st.bytes_sent, st.bytes_received,
          st.raw_bytes_sent, st.CompressionRatio(), st.bandwidth_bps, st.deltas_sent,
          st.deltas_acked, st.resends, st.auth_failures, st.refused, st.wire_bytes_sent,
          st.wire_bytes_received, st.tcp_bytes_estimate, st.WireRatio(), st.messages_sent,
          st.messages_received, st.connections, st.keepalives, st.dials, st.silent_seconds));
    }
  }
  std::vector<flatbuffers::Offset<wire::SyncJobState>> job_states;
  if (engine != nullptr) {
    for (const auto& job : engine->StatusJobs()) {
      auto js = engine->JobStatus(job);
      if (!js.ok()) continue;
      std::vector<flatbuffers::Offset<flatbuffers::String>> members;
      for (const auto& m : js->members.sites) members.push_back(fbb.CreateString(m));
      std::vector<flatbuffers::Offset<wire::RemovedSite>> removed;
      for (const auto& [site, from] : js->removed) {
        removed.push_back(wire::CreateRemovedSite(fbb, fbb.CreateString(site), from));
      }
      auto state = wire::CreateMembershipState(fbb, js->members.epoch, fbb.CreateVector(members),
                                               js->members.from_round);
      std::vector<flatbuffers::Offset<wire::PipelineUse>> pipelines;
      for (const auto& [p, n] : js->pipelines) {
        pipelines.push_back(wire::CreatePipelineUse(fbb, fbb.CreateString(p), n));
      }
      std::vector<flatbuffers::Offset<wire::SiteRound>> held;
      for (const auto& [site, r] : js->held) {
        held.push_back(wire::CreateSiteRound(fbb, fbb.CreateString(site), r));
      }
      job_states.push_back(wire::CreateSyncJobState(
          fbb, fbb.CreateString(job), js->local_round, js->committed_round,
          engine->max_rounds_ahead(), fbb.CreateString(EngineDetail(*js)), state,
          fbb.CreateVector(removed), fbb.CreateString(js->change_note),
          js->pending.has_value() || js->catching_up || js->draining, fbb.CreateVector(pipelines),
          fbb.CreateVector(held), js->round_work_pending, js->round_work_failures,
          fbb.CreateString(js->round_work_error)));
    }
  }
  auto body = wire::CreateSyncStatusReply(
      fbb, fbb.CreateString(c.sync.site), static_cast<int>(c.shard_index), engine != nullptr,
      fbb.CreateVector(link_infos), fbb.CreateVector(job_states),
      links != nullptr ? links->refused_unknown() : 0);
  FinishEnvelope(reply.header, id, wire::Body::SyncStatusReply, body.Union());
  return Status::Ok();
}

Status DoSyncControl(const wire::SyncControl* req, uint64_t id, PeerLinks* links, Reply& reply) {
  std::string peer = req->peer() ? req->peer()->str() : "";
  std::vector<std::string> sites;
  if (links == nullptr) {
    if (!peer.empty())
      return Status::NotFound("no peer link to site '" + peer + "' (sync.peers is empty)");
  } else {
    Result<std::vector<std::string>> r = Status::InvalidArgument("unknown sync action");
    switch (req->action()) {
      case wire::SyncAction::Now:
        r = links->SyncNow(peer);
        break;
      case wire::SyncAction::Pause:
        r = links->Pause(peer);
        break;
      case wire::SyncAction::Resume:
        r = links->Resume(peer);
        break;
      default:
        break;
    }
    if (!r.ok()) return r.status();
    sites = *r;
    spdlog::info("sync {} for {}", wire::EnumNameSyncAction(req->action()),
                 peer.empty() ? std::string("every link") : "site " + peer);
  }
  auto& fbb = reply.header;
  std::vector<flatbuffers::Offset<flatbuffers::String>> names;
  for (const auto& s : sites) names.push_back(fbb.CreateString(s));
  auto body = wire::CreateSyncControlReply(fbb, fbb.CreateVector(names));
  FinishEnvelope(reply.header, id, wire::Body::SyncControlReply, body.Union());
  return Status::Ok();
}

Status DoDigests(const wire::DigestsRequest* req, uint64_t id, const ServerConfig& c,
                 SyncEngine* engine, Reply& reply) {
  if (engine == nullptr) {
    return Status::FailedPrecondition("this shard does not sync (set sync.site to turn it on)");
  }
  std::string job = req->job()->str();
  ISTHMUS_ASSIGN_OR_RETURN(auto digests, engine->Digests(job, req->from_round(), UINT64_MAX));
  // The membership too: digests of sites that no longer merge the same rounds, or of rounds a
  // joined site never held, are not for comparing (isthmusctl sync verify).
  ISTHMUS_ASSIGN_OR_RETURN(SyncJobStatus js, engine->JobStatus(job));
  auto& fbb = reply.header;
  std::vector<flatbuffers::Offset<wire::RoundDigest>> out;
  for (const auto& [round, digest] : digests) {
    out.push_back(wire::CreateRoundDigest(fbb, round, fbb.CreateString(digest)));
  }
  std::vector<flatbuffers::Offset<flatbuffers::String>> members;
  for (const auto& m : js.members.sites) members.push_back(fbb.CreateString(m));
  auto state = wire::CreateMembershipState(fbb, js.members.epoch, fbb.CreateVector(members),
                                           js.members.from_round);
  std::vector<flatbuffers::Offset<wire::RemovedSite>> removed;
  for (const auto& [site, from] : js.removed) {
    removed.push_back(wire::CreateRemovedSite(fbb, fbb.CreateString(site), from));
  }
  std::vector<flatbuffers::Offset<wire::SiteRound>> joined;
  for (const auto& [site, from] : js.joined) {
    joined.push_back(wire::CreateSiteRound(fbb, fbb.CreateString(site), from));
  }
  auto body = wire::CreateDigestsReply(fbb, fbb.CreateString(job), engine->CommittedRound(job),
                                       fbb.CreateVector(out), fbb.CreateString(c.sync.site), state,
                                       fbb.CreateVector(removed), fbb.CreateVector(joined));
  FinishEnvelope(reply.header, id, wire::Body::DigestsReply, body.Union());
  return Status::Ok();
}

Status DoMembershipControl(const wire::MembershipControl* req, uint64_t id, SyncEngine* engine,
                           const ServerConfig& c,
                           const std::function<Status(const std::string&)>& revoke, Reply& reply) {
  if (engine == nullptr) {
    return Status::FailedPrecondition("this shard does not sync (set sync.site to turn it on)");
  }
  std::vector<std::string> jobs;
  if (req->action() == wire::MembershipAction::Invite) {
    if (req->site() == nullptr || req->site()->size() == 0) {
      return Status::InvalidArgument("name the site to invite (--site)");
    }
    const uint64_t seconds = req->seconds() > 0 ? req->seconds() : 3600;
    if (seconds > 30 * 86400) {
      return Status::InvalidArgument("an invitation lasts at most 30 days (--for)");
    }
    std::vector<std::string> targets;
    if (req->job() != nullptr && req->job()->size() > 0) {
      targets.push_back(req->job()->str());
    } else {
      for (const auto& j : engine->SyncJobs()) {
        if (engine->HasJob(j)) targets.push_back(j);
      }
    }
    if (targets.empty()) return Status::NotFound("no job syncs on this shard");
    auto& fbb = reply.header;
    std::vector<flatbuffers::Offset<flatbuffers::String>> names;
    std::vector<uint64_t> epochs;
    for (const auto& j : targets) {
      ISTHMUS_RETURN_IF_ERROR(engine->membership().Invite(
          j, req->site()->str(), std::chrono::seconds(static_cast<int64_t>(seconds))));
      names.push_back(fbb.CreateString(j));
      ISTHMUS_ASSIGN_OR_RETURN(Membership m, engine->Members(j));
      epochs.push_back(m.epoch);
    }
    auto body =
        wire::CreateMembershipControlReply(fbb, fbb.CreateVector(names), fbb.CreateVector(epochs));
    FinishEnvelope(reply.header, id, wire::Body::MembershipControlReply, body.Union());
    return Status::Ok();
  }
  if (req->action() == wire::MembershipAction::CatchUp) {
    if (req->site() == nullptr || req->site()->size() == 0) {
      return Status::InvalidArgument("name the member to catch up from (--from)");
    }
    std::vector<std::string> targets;
    if (req->job() != nullptr && req->job()->size() > 0) {
      targets.push_back(req->job()->str());
    } else {
      for (const auto& j : engine->SyncJobs()) {
        if (engine->HasJob(j)) targets.push_back(j);
      }
    }
    auto& fbb = reply.header;
    std::vector<flatbuffers::Offset<flatbuffers::String>> names;
    std::vector<uint64_t> rounds;
    for (const auto& j : targets) {
      ISTHMUS_RETURN_IF_ERROR(engine->membership().StartCatchUp(j, req->site()->str()));
      names.push_back(fbb.CreateString(j));
      rounds.push_back(engine->CommittedRound(j));
    }
    auto body =
        wire::CreateMembershipControlReply(fbb, fbb.CreateVector(names), fbb.CreateVector(rounds));
    FinishEnvelope(reply.header, id, wire::Body::MembershipControlReply, body.Union());
    return Status::Ok();
  }
  if (req->action() == wire::MembershipAction::Join) {
    if (req->job() == nullptr || req->job()->size() == 0 || req->site() == nullptr ||
        req->site()->size() == 0) {
      return Status::InvalidArgument("a join names the job (-j) and the member to ask (--from)");
    }
    ISTHMUS_RETURN_IF_ERROR(engine->membership().StartJoin(req->job()->str(), req->site()->str()));
    auto& fbb = reply.header;
    std::vector<flatbuffers::Offset<flatbuffers::String>> names{
        fbb.CreateString(req->job()->str())};
    // The epoch this site holds now (0: none; a removed site's is older than any it can join
    // at): the join is done once the site is a member at a later epoch.
    auto held = engine->JobStatus(req->job()->str());
    std::vector<uint64_t> epochs{held.ok() ? held->members.epoch : 0};
    auto body =
        wire::CreateMembershipControlReply(fbb, fbb.CreateVector(names), fbb.CreateVector(epochs));
    FinishEnvelope(reply.header, id, wire::Body::MembershipControlReply, body.Union());
    return Status::Ok();
  }
  if (req->job() != nullptr && req->job()->size() > 0) {
    jobs.push_back(req->job()->str());
  } else {
    jobs = engine->SyncJobs();
  }
  if (jobs.empty()) return Status::NotFound("no job syncs on this shard");
  const std::string site = req->action() == wire::MembershipAction::Leave
                               ? c.sync.site
                               : (req->site() ? req->site()->str() : std::string());
  if (req->action() == wire::MembershipAction::Remove && (site.empty() || site == c.sync.site)) {
    return Status::InvalidArgument(
        "name the site to remove (--peer); for this site to leave, use isthmusctl sync leave");
  }
  std::vector<uint64_t> epochs;
  for (const auto& job : jobs) {
    if (req->action() == wire::MembershipAction::Abandon) {
      ISTHMUS_RETURN_IF_ERROR(engine->membership().AbandonChange(job));
      ISTHMUS_ASSIGN_OR_RETURN(Membership m, engine->Members(job));
      epochs.push_back(m.epoch);
    } else {
      ISTHMUS_ASSIGN_OR_RETURN(MembershipChange change,
                               engine->membership().ProposeRemoval(job, site));
      epochs.push_back(change.next.epoch);
    }
  }
  if (req->action() == wire::MembershipAction::Remove && req->revoke_key()) {
    ISTHMUS_RETURN_IF_ERROR(revoke(site));
  }
  auto& fbb = reply.header;
  std::vector<flatbuffers::Offset<flatbuffers::String>> names;
  for (const auto& j : jobs) names.push_back(fbb.CreateString(j));
  auto body =
      wire::CreateMembershipControlReply(fbb, fbb.CreateVector(names), fbb.CreateVector(epochs));
  FinishEnvelope(reply.header, id, wire::Body::MembershipControlReply, body.Union());
  return Status::Ok();
}

// Looked at once a second: membership changes that made no progress are given up
// (sync.change_timeout_s), and the automatic removal policy (sync.remove_silent_after_s)
// is offered the member peers silent for that long; the protocol decides (docs/SYNC.md).
void CheckSilentPeers(const ServerConfig& c, SyncEngine* engine, PeerLinks* links,
                      std::chrono::steady_clock::time_point& next_check) {
  const auto now = std::chrono::steady_clock::now();
  if (engine == nullptr || now < next_check) return;
  next_check = now + std::chrono::seconds(1);
  engine->membership().ExpireStalled();  // changes and joins that made no progress
  if (c.sync_remove_silent_after_s <= 0) return;
  std::set<std::string> silent;
  for (const auto& st : links->Stats()) {
    if (st.silent_seconds >= static_cast<double>(c.sync_remove_silent_after_s)) {
      silent.insert(st.site);
    }
  }
  if (silent.empty()) return;
  for (const auto& job : engine->SyncJobs()) {
    if (!engine->HasJob(job)) continue;
    auto r = engine->membership().ProposeSilentRemoval(job, silent);
    if (!r.ok()) spdlog::warn("job '{}': automatic removal: {}", job, r.status().ToString());
  }
}

// Admin requests about cross-site sync are answered here, beside the shard, because they
// need the links. nullopt for every other message.
std::optional<Reply> HandleSyncAdmin(const Frames& msg, const WireLimits& limits,
                                     const ServerConfig& c, Shard* shard, PeerLinks* links,
                                     const std::function<Status(const std::string&)>& revoke) {
  auto env_or = ParseEnvelope(msg.header, limits);
  if (!env_or.ok()) return std::nullopt;
  const wire::Envelope* env = *env_or;
  SyncEngine* engine = shard->sync();
  const auto t0 = std::chrono::steady_clock::now();
  Reply reply;
  Status s;
  switch (env->body_type()) {
    case wire::Body::SyncStatusRequest:
      s = DoSyncStatus(env->request_id(), c, engine, links, reply);
      break;
    case wire::Body::SyncControl:
      s = DoSyncControl(env->body_as_SyncControl(), env->request_id(), links, reply);
      break;
    case wire::Body::DigestsRequest:
      s = DoDigests(env->body_as_DigestsRequest(), env->request_id(), c, engine, reply);
      break;
    case wire::Body::MembershipControl:
      s = DoMembershipControl(env->body_as_MembershipControl(), env->request_id(), engine, c,
                              revoke, reply);
      break;
    default:
      return std::nullopt;
  }
  if (!s.ok()) {
    reply.header.Clear();
    BuildErrorReply(reply.header, env->request_id(), s);
    reply.is_error = true;
  }
  shard->RecordRequest(
      wire::Role::Admin, OpName(env->body_type()), s.code(),
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return reply;
}

// Hands metrics scrapes from the HTTP thread to the event loop, which owns every state
// they read (shard, engine, links), and the rendered text back.
class MetricsBridge {
 public:
  MetricsBridge() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}
  ~MetricsBridge() {
    if (fd_ >= 0) ::close(fd_);
  }
  int fd() const { return fd_; }

  // HTTP thread: queues a scrape, wakes the loop and waits up to `timeout` for the text.
  Result<std::string> Request(std::chrono::milliseconds timeout) {
    auto pending = std::make_shared<std::promise<Result<std::string>>>();
    auto answer = pending->get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return Status::Unavailable("the shard is shutting down");
      queue_.push_back(pending);
    }
    uint64_t one = 1;
    ssize_t ignored = ::write(fd_, &one, sizeof one);
    (void)ignored;
    if (answer.wait_for(timeout) != std::future_status::ready) {
      return Status::Timeout("the shard's event loop did not answer within " +
                             std::to_string(timeout.count()) + " ms (a long request in hand?)");
    }
    return answer.get();
  }
  // Event-loop thread: renders once for every scrape waiting.
  void Serve(const std::function<std::string()>& render) {
    uint64_t n = 0;
    ssize_t ignored = ::read(fd_, &n, sizeof n);
    (void)ignored;
    std::deque<std::shared_ptr<std::promise<Result<std::string>>>> waiting;
    {
      std::lock_guard<std::mutex> lock(mu_);
      waiting.swap(queue_);
    }
    if (waiting.empty()) return;
    const std::string text = render();
    for (auto& p : waiting) p->set_value(text);
  }
  // Event-loop thread, when it stops: answers every waiting and later scrape Unavailable.
  void Close() {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    for (auto& p : queue_) p->set_value(Status::Unavailable("the shard is shutting down"));
    queue_.clear();
  }

 private:
  const int fd_;
  std::mutex mu_;
  bool closed_ = false;                                                   // guarded by mu_
  std::deque<std::shared_ptr<std::promise<Result<std::string>>>> queue_;  // guarded by mu_
};

// The cross-site part of the metrics: the engine's jobs and the peer links.
void WriteSyncMetrics(metrics::TextWriter& w, SyncEngine* engine, PeerLinks* links,
                      const std::map<std::string, metrics::Histogram>& commit_seconds) {
  using metrics::Type;
  if (engine != nullptr) {
    std::vector<SyncJobStatus> jobs;
    for (const auto& job : engine->StatusJobs()) {
      auto js = engine->JobStatus(job);
      if (js.ok()) jobs.push_back(std::move(*js));
    }
    auto per_job = [&](const char* name, Type type, const char* help, auto value) {
      w.Begin(name, type, help);
      for (const auto& j : jobs) w.Sample({{"job", j.job}}, static_cast<double>(value(j)));
    };
    per_job("isthmus_sync_local_round", Type::kGauge, "The last round this site closed.",
            [](const SyncJobStatus& j) { return j.local_round; });
    per_job("isthmus_sync_committed_round", Type::kGauge, "The last round committed on this shard.",
            [](const SyncJobStatus& j) { return j.committed_round; });
    per_job("isthmus_sync_rounds_ahead", Type::kGauge,
            "Rounds this site has closed beyond the last commit (workers wait past "
            "sync.max_rounds_ahead).",
            [](const SyncJobStatus& j) {
              return j.local_round > j.committed_round ? j.local_round - j.committed_round : 0;
            });
    per_job("isthmus_sync_membership_epoch", Type::kGauge,
            "The job's membership epoch (0 for the sites it started with, +1 per change).",
            [](const SyncJobStatus& j) { return j.members.epoch; });
    per_job("isthmus_sync_members", Type::kGauge, "Member sites of the job.",
            [](const SyncJobStatus& j) { return j.members.sites.size(); });
    per_job("isthmus_sync_membership_change_pending", Type::kGauge,
            "1 while a membership change, join or catch-up is under way here.",
            [](const SyncJobStatus& j) {
              return j.pending.has_value() || j.catching_up || j.draining ? 1 : 0;
            });
    per_job("isthmus_sync_round_work_pending", Type::kGauge,
            "1 while round work left after a reply (a round's close, commits) waits to run or "
            "to be retried after a failure.",
            [](const SyncJobStatus& j) { return j.round_work_pending ? 1 : 0; });
    per_job("isthmus_sync_round_work_failures_total", Type::kCounter,
            "Failures of round work run after a reply (each is logged and retried with "
            "backoff) since the server started.",
            [](const SyncJobStatus& j) { return j.round_work_failures; });
    per_job("isthmus_sync_encoded_bytes_total", Type::kCounter,
            "Encoded bytes of this site's round deltas (the payload each peer is sent).",
            [](const SyncJobStatus& j) { return j.bytes_encoded; });
    per_job("isthmus_sync_raw_bytes_total", Type::kCounter,
            "The same round deltas as fp32 (what dense deltas would take).",
            [](const SyncJobStatus& j) { return j.raw_bytes; });
    w.Begin("isthmus_sync_codec_tensors", Type::kGauge,
            "Tensors each codec pipeline encoded in the last round this site closed (adaptive "
            "mode may change the pipeline every round).");
    for (const auto& j : jobs) {
      for (const auto& [p, n] : j.pipelines) {
        w.Sample({{"job", j.job}, {"pipeline", p}}, static_cast<double>(n));
      }
    }
    w.Begin("isthmus_sync_held_round", Type::kGauge,
            "Per member site: the highest round of its deltas held or committed here.");
    for (const auto& j : jobs) {
      for (const auto& [site, r] : j.held) {
        w.Sample({{"job", j.job}, {"site", site}}, static_cast<double>(r));
      }
    }
    w.Begin("isthmus_sync_commit_duration_seconds", Type::kHistogram,
            "From this site closing a round (its workers' last push) to the round's commit: the "
            "wait for every member's delta plus the merge.");
    for (const auto& [job, h] : commit_seconds) h.Write(w, {{"job", job}});
  }
  if (links == nullptr) return;
  const auto stats = links->Stats();
  auto per_link = [&](const char* name, Type type, const char* help, auto value) {
    w.Begin(name, type, help);
    for (const auto& l : stats) w.Sample({{"peer", l.site}}, static_cast<double>(value(l)));
  };
  using L = PeerLinkStats;
  per_link("isthmus_peer_connected", Type::kGauge,
           "1 while the link's transport is up and its handshake answered.",
           [](const L& l) { return l.connected ? 1 : 0; });
  per_link("isthmus_peer_paused", Type::kGauge,
           "1 while the link is paused (isthmusctl sync pause).",
           [](const L& l) { return l.paused ? 1 : 0; });
  per_link("isthmus_peer_wire_sent_bytes_total", Type::kCounter,
           "Bytes sent to the peer on the wire: every message with ZeroMQ framing and CURVE boxes, "
           "and the connections' handshakes (TCP/IP headers not included).",
           [](const L& l) { return l.wire_bytes_sent; });
  per_link(
      "isthmus_peer_wire_received_bytes_total", Type::kCounter,
      "Bytes received from the peer on the wire, counted as isthmus_peer_wire_sent_bytes_total.",
      [](const L& l) { return l.wire_bytes_received; });
  per_link("isthmus_peer_tcpip_header_bytes_estimated_total", Type::kCounter,
           "TCP/IP header bytes of the link in both directions, estimated from the segments its "
           "messages need (not counted).",
           [](const L& l) { return l.tcp_bytes_estimate; });
  per_link("isthmus_peer_payload_sent_bytes_total", Type::kCounter,
           "Encoded delta bytes sent to the peer (resends included): the payload inside the wire "
           "bytes.",
           [](const L& l) { return l.bytes_sent; });
  per_link("isthmus_peer_payload_received_bytes_total", Type::kCounter,
           "Encoded delta bytes received from the peer.",
           [](const L& l) { return l.bytes_received; });
  per_link("isthmus_peer_payload_raw_bytes_total", Type::kCounter,
           "fp32 bytes of the deltas sent to the peer (what dense deltas would have taken).",
           [](const L& l) { return l.raw_bytes_sent; });
  per_link("isthmus_peer_messages_sent_total", Type::kCounter, "Messages sent to the peer.",
           [](const L& l) { return l.messages_sent; });
  per_link("isthmus_peer_messages_received_total", Type::kCounter,
           "Messages received from the peer.", [](const L& l) { return l.messages_received; });
  per_link("isthmus_peer_deltas_sent_total", Type::kCounter,
           "Round deltas sent to the peer, resends included.",
           [](const L& l) { return l.deltas_sent; });
  per_link("isthmus_peer_deltas_acked_total", Type::kCounter, "Round deltas the peer acknowledged.",
           [](const L& l) { return l.deltas_acked; });
  per_link("isthmus_peer_deltas_resent_total", Type::kCounter,
           "Round deltas sent again (after a timeout, a reconnect or a restart).",
           [](const L& l) { return l.resends; });
  per_link("isthmus_peer_keepalives_total", Type::kCounter, "Keep-alive pings sent while idle.",
           [](const L& l) { return l.keepalives; });
  per_link("isthmus_peer_connections_total", Type::kCounter,
           "Connection handshakes on the link, this side's and the peer's.",
           [](const L& l) { return l.connections; });
  per_link("isthmus_peer_auth_failures_total", Type::kCounter,
           "Times the peer refused this shard's CURVE key.",
           [](const L& l) { return l.auth_failures; });
  per_link("isthmus_peer_refused_messages_total", Type::kCounter,
           "Messages from the peer this shard refused (malformed, wrong site, ...).",
           [](const L& l) { return l.refused; });
  per_link("isthmus_peer_bandwidth_bytes_per_second", Type::kGauge,
           "The link's measured bandwidth (from acknowledged deltas; 0 before a measurement).",
           [](const L& l) { return l.bandwidth_bps; });
  per_link("isthmus_peer_silent_seconds", Type::kGauge,
           "Seconds since the last message from the peer.",
           [](const L& l) { return l.silent_seconds; });
  w.Begin("isthmus_peer_acked_round", Type::kGauge,
          "The highest round of ours the peer holds with every round before it.");
  for (const auto& l : stats) {
    for (const auto& j : l.jobs) {
      w.Sample({{"peer", l.site}, {"job", j.job}}, static_cast<double>(j.acked_round));
    }
  }
  w.Begin("isthmus_peer_lag_rounds", Type::kGauge,
          "Rounds of ours the peer has not acknowledged yet (our highest round minus its acked "
          "round).");
  for (const auto& l : stats) {
    for (const auto& j : l.jobs) {
      w.Sample(
          {{"peer", l.site}, {"job", j.job}},
          static_cast<double>(j.outbox_round > j.acked_round ? j.outbox_round - j.acked_round : 0));
    }
  }
  w.Single("isthmus_peer_refused_unknown_total", Type::kCounter,
           "Peer messages refused before a site could be named (bad handshake, unknown site).",
           static_cast<double>(links->refused_unknown()));
}

// The three allowlists as the key files under security.*_keys name them now.
struct Allowlists {
  std::vector<std::string> worker, admin, peer;
};
Result<Allowlists> LoadAllowlists(const ServerConfig& c) {
  const AllowlistCheck workers{"security.worker_keys", "workers", true};
  const AllowlistCheck admins{"security.admin_keys", "operators", true};
  // A site without peers yet (fleet init's one-site fleet) has an empty peer folder.
  const AllowlistCheck peers{"security.peer_keys", "peer shards of sync.peers",
                             !c.sync_peers.empty()};
  Allowlists a;
  ISTHMUS_ASSIGN_OR_RETURN(a.worker, LoadPublicKeys(c.worker_keys, workers));
  ISTHMUS_ASSIGN_OR_RETURN(a.admin, LoadPublicKeys(c.admin_keys, admins));
  ISTHMUS_ASSIGN_OR_RETURN(a.peer, LoadPublicKeys(c.peer_keys, peers));
  return a;
}

}  // namespace

std::string LiveDbDir(const std::string& data_dir) { return (fs::path(data_dir) / "db").string(); }
std::string SnapshotDir(const std::string& data_dir) {
  return (fs::path(data_dir) / "snapshots").string();
}

struct ShardServer::Impl {
  ServerConfig config;
  int wake_fd = -1;
  int reload_fd = -1;  // RequestReload (SIGHUP): the allowlists are read again
  KeyPair server_keys;
  std::unique_ptr<zmq::context_t> ctx;
  std::unique_ptr<ZapHandler> zap;
  std::unique_ptr<zmq::socket_t> worker, admin;
  std::unique_ptr<Shard> shard;
  std::unique_ptr<PeerLinks> links;  // null unless the shard syncs with peer sites
  WireLimits limits;
  // Metrics (listen.metrics): the endpoint's thread asks the loop through the bridge.
  MetricsBridge metrics_bridge;
  std::unique_ptr<metrics::MetricsEndpoint> metrics_endpoint;
  std::map<std::string, metrics::Histogram> commit_seconds;  // per job; event-loop thread
  // ISTHMUS_SERVER_FAULT_HANG_AFTER_PUSH_REPLY (tests, docs/TESTING.md): once the reply of a
  // push that left its round's close has been sent, the loop stops before the close and
  // waits to be killed (the reply still leaves: ZeroMQ's I/O threads run on).
  bool hang_after_push_reply = false;
  double started_unix = 0;
  std::string RenderMetrics();
  // Stops admitting peer site `site`'s key on the peer socket (sync remove --revoke-key) and
  // pauses its link; until the next restart (the operator also takes its key file out of
  // security.peer_keys).
  Status RevokePeer(const std::string& site, PeerLinks* links);
  // Binds a ROUTER socket for `domain` (CURVE unless insecure) to `endpoint`.
  Status BindSocket(const std::string& endpoint, const char* domain,
                    std::unique_ptr<zmq::socket_t>& out);
  // The allowlists read again from their key files (SIGHUP): an added key is admitted from
  // its next handshake; a removed worker or admin key is refused at once, and the socket
  // it came in on is bound anew so that its open connections close (every other client
  // reconnects within its reconnect interval and retries); a removed peer key is revoked
  // as `sync remove --revoke-key` does. An unreadable key file keeps the old lists.
  void ReloadKeys(PeerLinks* links);
  // Binds the worker or admin socket anew on the port it has (the endpoint as bound, so a
  // port 0 keeps the port it was given): its open connections close. False (logged) when
  // the port could not be had again within 10 s.
  bool Rebind(const char* domain, std::unique_ptr<zmq::socket_t>& socket);
  void StopFromLoop();
};

Status ShardServer::Impl::RevokePeer(const std::string& site, PeerLinks* links) {
  const auto peers = links != nullptr ? links->PeerKeys() : decltype(links->PeerKeys()){};
  auto it = peers.find(site);
  if (it == peers.end()) {
    return Status::NotFound("site '" + site + "' has no sync.peers entry here: no key to revoke");
  }
  bool was = false;
  for (const auto& key : it->second) was = (zap != nullptr && zap->Revoke(kDomainPeer, key)) || was;
  (void)links->Pause(site);
  spdlog::warn(
      "site {}: its key {} is no longer admitted on the peer socket{}; take its key file "
      "out of security.peer_keys too, or a restart admits it again",
      site, it->second.front().substr(0, 8), was ? "" : " (it was not on the allowlist)");
  return Status::Ok();
}

Status ShardServer::Impl::BindSocket(const std::string& endpoint, const char* domain,
                                     std::unique_ptr<zmq::socket_t>& out) {
  const auto& c = config;
  try {
    out = std::make_unique<zmq::socket_t>(*ctx, zmq::socket_type::router);
    out->set(zmq::sockopt::linger, 0);
    out->set(zmq::sockopt::sndhwm, 0);
    out->set(zmq::sockopt::rcvhwm, 0);
    // A frame beyond this drops the connection before it is buffered whole; smaller
    // excesses are answered with ResourceExhausted by the shard.
    out->set(zmq::sockopt::maxmsgsize, c.max_message_bytes + c.max_header_bytes);
    if (!c.insecure_plaintext) ConfigureCurveServer(*out, server_keys, domain);
    out->bind(endpoint);
  } catch (const zmq::error_t& e) {
    return Status::Unavailable("cannot bind " + std::string(domain) + " socket to '" + endpoint +
                               "': " + e.what() + " (is the port in use? set listen." + domain +
                               ")");
  }
  return Status::Ok();
}

void ShardServer::Impl::StopFromLoop() {
  uint64_t one = 1;
  ssize_t ignored = ::write(wake_fd, &one, sizeof one);
  (void)ignored;
}

bool ShardServer::Impl::Rebind(const char* domain, std::unique_ptr<zmq::socket_t>& socket) {
  const std::string endpoint = socket->get(zmq::sockopt::last_endpoint);
  socket->set(zmq::sockopt::linger, 1000);  // replies already queued still leave
  socket.reset();
  // ZeroMQ closes the old listener on its own threads, a moment later: until then the
  // port is in use, so the bind is retried for a bounded time.
  Status s;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!(s = BindSocket(endpoint, domain, socket)).ok() &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!s.ok()) spdlog::error("reload: {}; stopping", s.ToString());
  return s.ok();
}

void ShardServer::Impl::ReloadKeys(PeerLinks* links) {
  if (config.insecure_plaintext || zap == nullptr) {
    spdlog::warn("reload: security.insecure_plaintext is set, there are no keys to reload");
    return;
  }
  auto lists = LoadAllowlists(config);
  if (!lists.ok()) {
    spdlog::error("reload: {}; the allowlists stay as they were", lists.status().ToString());
    return;
  }
  // This site's own key (security.secret_key): a new pair is presented from now on.
  bool own_changed = false;
  if (auto own = LoadKeyPairFile(config.secret_key); !own.ok()) {
    spdlog::error("reload: {}; this shard keeps its key", own.status().ToString());
  } else if (own->public_key != server_keys.public_key) {
    spdlog::info("reload: this shard's own key changes from {} to {}",
                 server_keys.public_key.substr(0, 8), own->public_key.substr(0, 8));
    server_keys = *own;
    own_changed = true;
  }
  // The peers' keys (their sync.peers key files): a peer rotating its key lists two.
  if (links != nullptr) links->ReloadPeerKeys();
  struct Domain {
    const char* name;
    const std::vector<std::string>* keys;
    std::unique_ptr<zmq::socket_t>* socket;  // null: the peer socket (PeerLinks')
  };
  const Domain domains[] = {{kDomainWorker, &lists->worker, &worker},
                            {kDomainAdmin, &lists->admin, &admin},
                            {kDomainPeer, &lists->peer, nullptr}};
  for (const auto& d : domains) {
    const std::vector<std::string> removed = zap->SetAllowlist(d.name, *d.keys);
    spdlog::info("reload: {} {} key(s) allowed, {} removed", d.keys->size(), d.name,
                 removed.size());
    if (d.socket == nullptr) {
      // A removed key its site's sync.peers file still lists revokes the site; a key the
      // file no longer lists is an old key after a rotation, and goes alone.
      if (links == nullptr) continue;  // no sync.peers: no site to revoke
      const auto peer_keys = links->PeerKeys();
      for (const auto& key : removed) {
        for (const auto& [site, keys] : peer_keys) {
          if (std::find(keys.begin(), keys.end(), key) != keys.end()) (void)RevokePeer(site, links);
        }
      }
      continue;
    }
    // Connections that were admitted stay open until their socket goes; a new own key
    // needs the socket bound anew too.
    if (removed.empty() && !own_changed) continue;
    if (!Rebind(d.name, *d.socket)) return StopFromLoop();
    for (const auto& key : removed) {
      spdlog::warn("reload: {} key {} revoked: its connections are closed", d.name,
                   key.substr(0, 8));
    }
  }
  if (own_changed && links != nullptr) {
    if (Status st = links->SetOwnKeys(server_keys); !st.ok()) {
      spdlog::error("reload: {}; stopping", st.ToString());
      return StopFromLoop();
    }
    spdlog::info(
        "reload: the worker, admin and peer sockets present the new key; peers dial "
        "again with it");
  }
}

std::string ShardServer::Impl::RenderMetrics() {
  using metrics::Type;
  metrics::TextWriter w;
  w.Begin("isthmus_server_info", Type::kGauge,
          "Constant 1, labelled with the server's version, shard id, site and shard index.");
  w.Sample({{"version", kIsthmusVersion},
            {"shard", config.shard_id},
            {"site", config.sync.site},
            {"shard_index", std::to_string(config.shard_index)}},
           1);
  w.Single("process_start_time_seconds", Type::kGauge,
           "Start time of the process since the Unix epoch, in seconds.", started_unix);
  shard->WriteMetrics(w);
  uint64_t peer_in = 0, peer_out = 0;
  if (links) {
    for (const auto& l : links->Stats()) {
      peer_in += l.wire_bytes_received;
      peer_out += l.wire_bytes_sent;
    }
  }
  w.Begin("isthmus_socket_received_bytes_total", Type::kCounter,
          "Bytes received per socket: requests on the worker and admin sockets (headers and "
          "payload), wire bytes on the peer links.");
  for (const auto& [role, b] : shard->socket_bytes()) w.Sample({{"socket", role}}, b.first);
  if (links) w.Sample({{"socket", "peer"}}, static_cast<double>(peer_in));
  w.Begin("isthmus_socket_sent_bytes_total", Type::kCounter,
          "Bytes sent per socket, counted as isthmus_socket_received_bytes_total.");
  for (const auto& [role, b] : shard->socket_bytes()) w.Sample({{"socket", role}}, b.second);
  if (links) w.Sample({{"socket", "peer"}}, static_cast<double>(peer_out));
  WriteSyncMetrics(w, shard->sync(), links.get(), commit_seconds);
  return w.Take();
}

ShardServer::ShardServer(ServerConfig config) : impl_(std::make_unique<Impl>()) {
  impl_->config = std::move(config);
  impl_->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  impl_->reload_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
}

ShardServer::~ShardServer() {
  impl_->metrics_bridge.Close();
  impl_->metrics_endpoint.reset();
  impl_->links.reset();
  impl_->worker.reset();
  impl_->admin.reset();
  if (impl_->zap) impl_->zap->Stop();
  if (impl_->ctx) impl_->ctx->close();
  impl_->shard.reset();
  if (impl_->wake_fd >= 0) ::close(impl_->wake_fd);
  if (impl_->reload_fd >= 0) ::close(impl_->reload_fd);
}

void ShardServer::RequestStop() {
  uint64_t one = 1;
  ssize_t ignored = ::write(impl_->wake_fd, &one, sizeof one);
  (void)ignored;
}

void ShardServer::RequestReload() {
  uint64_t one = 1;
  ssize_t ignored = ::write(impl_->reload_fd, &one, sizeof one);
  (void)ignored;
}

Status ShardServer::Start() {
  auto& c = impl_->config;
  ISTHMUS_RETURN_IF_ERROR(ValidateServerConfig(c));
  if (impl_->wake_fd < 0 || impl_->reload_fd < 0) return Status::Internal("eventfd failed");
  // Keys and allowlists before the data dir: a refusal here touches no stored state.
  KeyPair& server_keys = impl_->server_keys;
  Allowlists allow;
  if (c.insecure_plaintext) {
    spdlog::warn(
        "security.insecure_plaintext is set: NO encryption and NO authentication on {} and {}",
        c.listen_worker, c.listen_admin);
  } else {
    ISTHMUS_ASSIGN_OR_RETURN(server_keys, LoadKeyPairFile(c.secret_key));
    ISTHMUS_ASSIGN_OR_RETURN(allow, LoadAllowlists(c));
    if (allow.admin.empty()) {
      spdlog::warn("no admin keys configured (security.admin_keys): isthmusctl cannot connect");
    }
  }
  ISTHMUS_RETURN_IF_ERROR(PrepareDataDir(c.data_dir));
  ISTHMUS_RETURN_IF_ERROR(RecoverInterruptedRestore(c.data_dir));

  WireLimits limits;
  limits.max_payload_bytes = static_cast<uint64_t>(c.max_message_bytes);
  limits.max_header_bytes = static_cast<size_t>(c.max_header_bytes);
  limits.max_tensors = static_cast<uint32_t>(c.max_tensors);

  ShardOptions opts;
  opts.shard_id = c.shard_id;
  opts.convert_plain_jobs = c.sync_convert_plain_jobs;
  opts.defer_round_work = true;  // Run() does it right after each reply
  impl_->hang_after_push_reply =
      std::getenv("ISTHMUS_SERVER_FAULT_HANG_AFTER_PUSH_REPLY") != nullptr;
  opts.snapshot_dir = SnapshotDir(c.data_dir);
  opts.limits = limits;
  impl_->limits = limits;
  opts.dedup_window = static_cast<uint64_t>(c.dedup_window);
  opts.push_part_bytes = static_cast<uint64_t>(c.push_part_bytes);
  opts.synced_push_part_bytes = static_cast<uint64_t>(c.synced_push_part_bytes);
  StoreOptions store_opts;
  store_opts.sync_writes = c.sync_writes;
  store_opts.direct_slot_writes = c.direct_writes;
  store_opts.min_free_bytes = static_cast<uint64_t>(std::max<int64_t>(c.min_free_bytes, 0));
  std::string db_dir = LiveDbDir(c.data_dir);
  opts.open_store = [db_dir, store_opts]() { return OpenRocksStore(db_dir, store_opts); };
  std::string data_dir = c.data_dir;
  opts.replace_store_files = [data_dir](const std::string& cp) {
    return ReplaceDbFiles(data_dir, cp);
  };
  std::vector<PeerLinkSpec> peers;
  if (!c.sync.site.empty()) {
    ISTHMUS_ASSIGN_OR_RETURN(peers, ParsePeerLinkSpecs(c.sync_peers));
    opts.sync = SyncOptionsFrom(c);
    opts.sync->background_state_writes = true;  // applied by the loop's RunDeferred
    Impl* impl = impl_.get();
    opts.sync->on_commit = [impl](const std::string& job, uint64_t, double seconds) {
      auto it = impl->commit_seconds.find(job);
      if (it == impl->commit_seconds.end()) {
        it = impl->commit_seconds.emplace(job, metrics::Histogram(metrics::LatencyBuckets())).first;
      }
      it->second.Observe(seconds);
    };
  }
  ISTHMUS_ASSIGN_OR_RETURN(impl_->shard, Shard::Open(opts));

  impl_->ctx = std::make_unique<zmq::context_t>(static_cast<int>(c.io_threads));
  if (!c.insecure_plaintext) {
    impl_->zap = std::make_unique<ZapHandler>(*impl_->ctx);
    impl_->zap->SetAllowlist(kDomainWorker, allow.worker);
    impl_->zap->SetAllowlist(kDomainAdmin, allow.admin);
    impl_->zap->SetAllowlist(kDomainPeer, allow.peer);
    ISTHMUS_RETURN_IF_ERROR(impl_->zap->Start());
    spdlog::info("allowlists: {} worker key(s), {} admin key(s), {} peer key(s)",
                 allow.worker.size(), allow.admin.size(), allow.peer.size());
  }
  ISTHMUS_RETURN_IF_ERROR(impl_->BindSocket(c.listen_worker, kDomainWorker, impl_->worker));
  ISTHMUS_RETURN_IF_ERROR(impl_->BindSocket(c.listen_admin, kDomainAdmin, impl_->admin));
  if (SyncEngine* engine = impl_->shard->sync(); engine != nullptr && !peers.empty()) {
    if (c.listen_peer.empty()) {
      return Status::InvalidArgument(
          "sync.peers is set but listen.peer is not: peers cannot reach this shard");
    }
    PeerLinkOptions lo;
    lo.site = c.sync.site;
    lo.shard_index = static_cast<int>(c.shard_index);
    lo.listen_endpoint = c.listen_peer;
    lo.keys = server_keys;
    lo.insecure_plaintext = c.insecure_plaintext;
    lo.peers = peers;
    ISTHMUS_ASSIGN_OR_RETURN(lo.dial, ParsePeerDial(c.sync_dial));
    lo.resend_ms = static_cast<int>(c.sync_resend_ms);
    lo.ack_delay_ms = static_cast<int>(c.sync_ack_delay_ms);
    lo.backoff_max_ms = static_cast<int>(c.sync_backoff_max_ms);
    lo.limits = limits;
    lo.initial_digest = [engine](const std::string& job) {
      auto d = engine->Digests(job, 0, 1);
      return d.ok() && !d->empty() && d->front().first == 0 ? d->front().second : std::string();
    };
    impl_->links = std::make_unique<PeerLinks>(*impl_->ctx, lo, engine, engine);
    ISTHMUS_RETURN_IF_ERROR(impl_->links->Start());
    spdlog::info("site {}: peer links to {} site(s), peers connect on {}", c.sync.site,
                 peers.size(), c.listen_peer);
  }
  impl_->started_unix =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  if (!c.listen_metrics.empty()) {
    MetricsBridge* bridge = &impl_->metrics_bridge;
    ISTHMUS_ASSIGN_OR_RETURN(
        impl_->metrics_endpoint,
        metrics::MetricsEndpoint::Start(c.listen_metrics, "listen.metrics", [bridge]() {
          return bridge->Request(std::chrono::milliseconds(10000));
        }));
    spdlog::info("metrics at http://{}:{}/metrics",
                 c.listen_metrics.substr(0, c.listen_metrics.rfind(':')),
                 impl_->metrics_endpoint->port());
  }
  spdlog::info("shard {} serving workers on {} and admins on {} ({})", c.shard_id, c.listen_worker,
               c.listen_admin, c.insecure_plaintext ? "PLAINTEXT" : "CURVE");
  return Status::Ok();
}

Status ShardServer::Run() {
  if (!impl_->shard) return Status::FailedPrecondition("Start() first");
  const wire::Role roles[2] = {wire::Role::Worker, wire::Role::Admin};
  PeerLinks* links = impl_->links.get();
  std::vector<zmq::pollitem_t> items;
  auto next_silence_check = std::chrono::steady_clock::now();
  // Scrapes still waiting when the loop stops are answered Unavailable.
  struct CloseBridge {
    MetricsBridge& bridge;
    ~CloseBridge() { bridge.Close(); }
  } close_bridge{impl_->metrics_bridge};
  constexpr size_t kFixedItems = 5;
  while (true) {
    // ReloadKeys may bind a socket anew: take them afresh each time round.
    zmq::socket_t* sockets[2] = {impl_->worker.get(), impl_->admin.get()};
    // The peer links' sockets follow the fixed items; their timer bounds the wait.
    items.assign(kFixedItems + (links ? links->PollItemCount() : 0), zmq::pollitem_t{});
    items[0] = {sockets[0]->handle(), 0, ZMQ_POLLIN, 0};
    items[1] = {sockets[1]->handle(), 0, ZMQ_POLLIN, 0};
    items[2] = {nullptr, impl_->wake_fd, ZMQ_POLLIN, 0};
    items[3] = {nullptr, impl_->metrics_bridge.fd(), ZMQ_POLLIN, 0};
    items[4] = {nullptr, impl_->reload_fd, ZMQ_POLLIN, 0};
    if (links) links->FillPollItems(items.data() + kFixedItems);
    // Round work that failed after a reply (say the disk was full) is retried on a timer.
    int timeout_ms = links ? links->NextTimeoutMs() : -1;
    if (const int retry = impl_->shard->DeferredRetryMs(); retry >= 0) {
      timeout_ms = timeout_ms < 0 ? retry : std::min(timeout_ms, retry);
    }
    try {
      zmq::poll(items.data(), items.size(), std::chrono::milliseconds(timeout_ms));
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;
      return Status::Internal(std::string("poll failed: ") + e.what());
    }
    if (items[2].revents & ZMQ_POLLIN) {
      spdlog::info("stop requested; shutting down");
      // A state write under way is finished, so a clean stop leaves the state written.
      if (auto* sync = impl_->shard->sync(); sync != nullptr) (void)sync->FinishStateWrites();
      return Status::Ok();
    }
    if (items[3].revents & ZMQ_POLLIN) {
      impl_->metrics_bridge.Serve([this] { return impl_->RenderMetrics(); });
    }
    if (items[4].revents & ZMQ_POLLIN) {
      uint64_t n = 0;
      ssize_t ignored = ::read(impl_->reload_fd, &n, sizeof n);
      (void)ignored;
      impl_->ReloadKeys(links);
      continue;  // the sockets may be new: poll them again
    }
    for (int i = 0; i < 2; ++i) {
      if (!(items[i].revents & ZMQ_POLLIN)) continue;
      // Drain what is queued, a bounded number at a time, so neither socket starves.
      for (int n = 0; n < 64; ++n) {
        zmq::message_t routing_id;
        auto msg = ReceiveMessage(*sockets[i], &routing_id);
        if (!msg.ok()) {
          if (msg.status().code() == Code::kTimeout) break;
          spdlog::warn("dropped a message on the {} socket: {}", wire::EnumNameRole(roles[i]),
                       msg.status().ToString());
          continue;
        }
        // Owned, so that a push's deltas can outlive this iteration (until the round's
        // deferred close) without a copy.
        auto request = std::make_shared<Frames>(std::move(*msg));
        std::optional<Reply> sync_reply;
        if (roles[i] == wire::Role::Admin) {
          sync_reply = HandleSyncAdmin(
              *request, impl_->limits, impl_->config, impl_->shard.get(), links,
              [this, links](const std::string& site) { return impl_->RevokePeer(site, links); });
        }
        Reply reply = sync_reply ? std::move(*sync_reply)
                                 : impl_->shard->Handle(roles[i], *request, request,
                                                        std::string_view(routing_id.data<char>(),
                                                                         routing_id.size()));
        uint64_t out_bytes = reply.header.GetSize();
        for (const auto& p : reply.payload) out_bytes += p.size;
        impl_->shard->CountBytes(roles[i], request->header.size() + request->PayloadBytes(),
                                 out_bytes);
        if (reply.send) {
          Status s = SendMessage(*sockets[i], &routing_id, reply.header, reply.payload);
          if (!s.ok()) spdlog::warn("could not send a reply: {}", s.ToString());
        }
        request.reset();
        if (impl_->hang_after_push_reply && roles[i] == wire::Role::Worker &&
            impl_->shard->DeferredRetryMs() == 0) {
          // Fault injection for tests: the push is acknowledged, its round not closed; the
          // test kills the process (SIGKILL) once it has the reply, so no sleep decides
          // whether the reply got out.
          spdlog::error("ISTHMUS_SERVER_FAULT_HANG_AFTER_PUSH_REPLY: stopped before the close");
          spdlog::default_logger()->flush();
          for (;;) ::pause();
        }
        // The reply is on its way: now the round work it left (the close of a round the push
        // completed, the commits), before the next request is read. Failures are logged and
        // retried by the engine.
        (void)impl_->shard->RunDeferred();
      }
    }
    if (links) links->OnPoll(items.data() + kFixedItems);
    // Commits that peers' deltas made possible (received and acknowledged above), and work
    // to retry.
    (void)impl_->shard->RunDeferred();
    if (links) {
      // After worker pushes too: a round closed just now goes out at once.
      links->Tick();
      CheckSilentPeers(impl_->config, impl_->shard->sync(), links, next_silence_check);
    }
  }
}

}  // namespace isthmus
