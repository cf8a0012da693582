// isthmusctl: the operator's CLI for a site's shards: keys, status, top, jobs, snapshots,
// export, cross-site sync (status, now, pause/resume, verify) and fleet init (ctl_top.cc and
// ctl_fleet.cc; what they share with this file is in ctl_common.h). Every command that talks to
// shards takes the same connection flags; a command addressed to a site acts on all its shards
// (given in shard order with --server). Exit codes: the shared table (common/exit_codes.h); `sync
// verify` exits 1 when digests differ, 3 when a site is no longer a member. docs/CLI.md is the
// reference.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "common/client.h"
#include "common/exit_codes.h"
#include "common/keys.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "common/sharding.h"
#include "common/version.h"
#include "server/ctl/common.h"
#include "server/ctl/fleet.h"
#include "server/ctl/top.h"
#include "server/ctl/verify.h"

namespace isthmus {
namespace {

using json = nlohmann::json;
using ctl::AddConnectionFlags;
using ctl::ConnectAll;
using ctl::Connection;
using ctl::Fail;
using ctl::HumanBytes;
using ctl::Rate;
using ctl::SyncStatusJson;
using ctl::TimeText;

int ExitCode(const Status& s) { return ExitCodeForStatus(s); }

int CmdKeygen(const std::string& out, bool force) {
  auto pair = GenerateKeyPair();
  if (!pair.ok()) return Fail(pair.status());
  if (auto s = WriteKeyPairFiles(out, *pair, force); !s.ok()) return Fail(s);
  std::printf("wrote %s.key (secret, mode 0600) and %s.pub (public)\npublic key: %s\n", out.c_str(),
              out.c_str(), pair->public_key.c_str());
  return 0;
}

int CmdStatus(const Connection& c, bool as_json) {
  auto clients = ConnectAll(c);
  if (!clients.ok()) return Fail(clients.status());
  json out = json::array();
  Status worst;
  for (size_t i = 0; i < clients->size(); ++i) {
    auto st = (*clients)[i]->Stats();
    json row{{"endpoint", c.servers[i]}, {"shard_index", i}};
    if (!st.ok()) {
      row["reachable"] = false;
      row["error"] = st.status().ToString();
      if (worst.ok()) worst = st.status();
    } else {
      row.update(ctl::StatsJson(*st));
      row["reachable"] = true;
    }
    out.push_back(row);
  }
  if (as_json) {
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf("%-4s %-28s %-12s %-9s %9s %7s %10s %10s %10s\n", "#", "ENDPOINT", "SHARD", "STATE",
                "UPTIME", "ERRORS", "IN", "OUT", "DB");
    for (const auto& r : out) {
      if (!r["reachable"].get<bool>()) {
        std::printf("%-4zu %-28s %-12s %-9s %s\n", r["shard_index"].get<size_t>(),
                    r["endpoint"].get<std::string>().c_str(), "-", "DOWN",
                    r["error"].get<std::string>().c_str());
        continue;
      }
      std::printf("%-4zu %-28s %-12s %-9s %8llus %7llu %10s %10s %10s\n",
                  r["shard_index"].get<size_t>(), r["endpoint"].get<std::string>().c_str(),
                  r["shard_id"].get<std::string>().c_str(), "up",
                  (unsigned long long)r["uptime_s"].get<uint64_t>(),
                  (unsigned long long)r["errors"].get<uint64_t>(),
                  HumanBytes(r["bytes_in"].get<uint64_t>()).c_str(),
                  HumanBytes(r["bytes_out"].get<uint64_t>()).c_str(),
                  HumanBytes(r["db_bytes"].get<uint64_t>()).c_str());
      for (const auto& j : r["jobs"]) {
        std::printf(
            "       job %-20s version %-8llu tensors %-6llu %10s pushes %llu (%llu duplicates)\n",
            j["job"].get<std::string>().c_str(), (unsigned long long)j["version"].get<uint64_t>(),
            (unsigned long long)j["tensors"].get<uint64_t>(),
            HumanBytes(j["bytes"].get<uint64_t>()).c_str(),
            (unsigned long long)j["pushes"].get<uint64_t>(),
            (unsigned long long)j["duplicate_pushes"].get<uint64_t>());
      }
    }
  }
  return worst.ok() ? 0 : ExitCode(worst);
}

int CmdJobCreate(const Connection& c, const std::string& job, const std::string& file,
                 std::string base_hash) {
  auto loaded = ReadSafetensors(file);
  if (!loaded.ok()) return Fail(loaded.status());
  if (loaded->tensors.empty())
    return Fail(Status::InvalidArgument("'" + file + "' holds no tensors"));
  if (base_hash.empty()) base_hash = TensorsContentHash(loaded->tensors);
  auto clients = ConnectAll(c);
  if (!clients.ok()) return Fail(clients.status());
  std::vector<TensorSize> sizes;
  for (const auto& t : loaded->tensors) sizes.push_back({t.name, t.data.size() * sizeof(float)});
  auto owner = AssignTensorsToShards(sizes, static_cast<int>(clients->size()));
  for (size_t s = 0; s < clients->size(); ++s) {
    std::vector<TensorView> views;
    for (size_t i = 0; i < loaded->tensors.size(); ++i) {
      const auto& t = loaded->tensors[i];
      if (owner[i] == static_cast<int>(s)) views.push_back({t.name, t.shape, t.data.data()});
    }
    if (views.empty()) continue;
    auto r = (*clients)[s]->CreateJob(job, base_hash, views);
    if (!r.ok()) {
      return Fail(Status(r.status().code(), "shard " + std::to_string(s) + " (" + c.servers[s] +
                                                "): " + r.status().message()));
    }
    std::printf("shard %zu: job '%s' created with %llu tensors (%s)\n", s, job.c_str(),
                (unsigned long long)r->tensor_count, HumanBytes(r->total_bytes).c_str());
  }
  std::printf("base hash %s\n", base_hash.c_str());
  return 0;
}

int CmdJobDescribe(const Connection& c, const std::string& job, bool as_json) {
  auto clients = ConnectAll(c);
  if (!clients.ok()) return Fail(clients.status());
  json out = json::array();
  for (size_t s = 0; s < clients->size(); ++s) {
    auto r = (*clients)[s]->DescribeJob(job);
    if (!r.ok()) {
      if (r.status().code() == Code::kNotFound) continue;  // a shard may own none of it
      return Fail(r.status());
    }
    for (const auto& t : r->tensors) {
      out.push_back({{"shard", s}, {"name", t.name}, {"shape", t.shape}, {"version", t.version}});
    }
    if (!as_json) {
      std::printf(
          "shard %zu: job '%s' version %llu, %zu tensors, %llu pushes, base %s, created %s UTC\n",
          s, job.c_str(), (unsigned long long)r->version, r->tensors.size(),
          (unsigned long long)r->pushes, r->base_hash.c_str(), TimeText(r->created_unix).c_str());
    }
  }
  if (out.empty()) return Fail(Status::NotFound("job '" + job + "' is on no shard"));
  if (as_json) std::printf("%s\n", out.dump(2).c_str());
  return 0;
}

int CmdExport(const Connection& c, const std::string& job, const std::string& out_file) {
  auto clients = ConnectAll(c);
  if (!clients.ok()) return Fail(clients.status());
  std::vector<Tensor> all;
  std::string base_hash;
  uint64_t version = 0;
  for (size_t s = 0; s < clients->size(); ++s) {
    auto d = (*clients)[s]->DescribeJob(job);
    if (!d.ok()) {
      if (d.status().code() == Code::kNotFound) continue;
      return Fail(d.status());
    }
    base_hash = d->base_hash;
    version = std::max(version, d->version);
    auto r = (*clients)[s]->Pull(job);
    if (!r.ok()) return Fail(r.status());
    for (auto& t : r->tensors) all.push_back(std::move(t));
  }
  if (all.empty()) return Fail(Status::NotFound("job '" + job + "' is on no shard"));
  std::map<std::string, std::string> meta{{"isthmus.job", job},
                                          {"isthmus.base_hash", base_hash},
                                          {"isthmus.version", std::to_string(version)}};
  if (auto s = WriteSafetensors(out_file, all, meta); !s.ok()) return Fail(s);
  uint64_t bytes = 0;
  for (const auto& t : all) bytes += t.data.size() * sizeof(float);
  std::printf("exported %zu tensors (%s) of job '%s' to %s\n", all.size(),
              HumanBytes(bytes).c_str(), job.c_str(), out_file.c_str());
  return 0;
}

int CmdSnapshot(const Connection& c, const std::string& action, const std::string& name,
                bool as_json) {
  auto clients = ConnectAll(c);
  if (!clients.ok()) return Fail(clients.status());
  if (action == "list") {
    json out = json::array();
    for (size_t s = 0; s < clients->size(); ++s) {
      auto r = (*clients)[s]->ListSnapshots();
      if (!r.ok()) return Fail(r.status());
      for (const auto& snap : *r) {
        json jobs = json::array();
        for (const auto& j : snap.jobs) jobs.push_back({{"job", j.job}, {"version", j.version}});
        out.push_back({{"shard", s},
                       {"name", snap.name},
                       {"created_unix", snap.created_unix},
                       {"bytes", snap.bytes},
                       {"jobs", jobs}});
        if (!as_json) {
          std::printf("shard %zu  %-24s %s UTC  %10s", s, snap.name.c_str(),
                      TimeText(snap.created_unix).c_str(), HumanBytes(snap.bytes).c_str());
          for (const auto& j : snap.jobs) {
            std::printf("  %s@v%llu", j.job.c_str(), (unsigned long long)j.version);
          }
          std::printf("\n");
        }
      }
    }
    if (as_json) std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  for (size_t s = 0; s < clients->size(); ++s) {
    auto r = action == "create" ? (*clients)[s]->CreateSnapshot(name)
                                : (*clients)[s]->RestoreSnapshot(name);
    if (!r.ok()) {
      return Fail(Status(r.status().code(), "shard " + std::to_string(s) + " (" + c.servers[s] +
                                                "): " + r.status().message()));
    }
    std::printf("shard %zu: snapshot '%s' %s (%s)\n", s, r->name.c_str(),
                action == "create" ? "created" : "restored", HumanBytes(r->bytes).c_str());
  }
  return 0;
}

// --- sync ---------------------------------------------------------------------------------

int CmdSyncStatus(const Connection& c, bool as_json) {
  auto clients = ConnectAll(c);
  if (!clients.ok()) return Fail(clients.status());
  json out = json::array();
  Status worst;
  for (size_t i = 0; i < clients->size(); ++i) {
    auto st = (*clients)[i]->SyncStatus();
    if (!st.ok()) {
      out.push_back(
          {{"endpoint", c.servers[i]}, {"reachable", false}, {"error", st.status().ToString()}});
      if (!as_json) {
        std::printf("shard %zu (%s): %s\n", i, c.servers[i].c_str(),
                    st.status().ToString().c_str());
      }
      if (worst.ok()) worst = st.status();
      continue;
    }
    json row = SyncStatusJson(*st);
    row["endpoint"] = c.servers[i];
    row["reachable"] = true;
    out.push_back(row);
    if (as_json) continue;
    std::printf("shard %zu (%s): site %s, sync %s\n", i, c.servers[i].c_str(),
                st->site.empty() ? "-" : st->site.c_str(), st->enabled ? "on" : "off");
    for (const auto& j : st->jobs) {
      std::printf("  job %-16s local round %llu, committed %llu, limit %llu ahead%s%s%s\n",
                  j.job.c_str(), (unsigned long long)j.local_round,
                  (unsigned long long)j.committed_round, (unsigned long long)j.max_rounds_ahead,
                  ctl::WaitingForWan(j) ? "; workers waiting for the WAN" : "",
                  j.detail.empty() ? "" : "; ", j.detail.c_str());
      std::string members;
      for (const auto& m : j.members) members += (members.empty() ? "" : ",") + m;
      std::printf("  %-20s members %s from round %llu (epoch %llu)", "", members.c_str(),
                  (unsigned long long)j.members_from, (unsigned long long)j.epoch);
      for (const auto& [site, from] : j.removed) {
        std::printf("; %s out from round %llu", site.c_str(), (unsigned long long)from);
      }
      std::printf("\n");
      if (!j.change.empty()) {
        std::printf("  %-20s membership change%s: %s\n", "", j.change_pending ? " under way" : "",
                    j.change.c_str());
      }
    }
    if (st->links.empty()) continue;
    // The wire (everything sent and received for the peer, framing and handshakes
    // included) is the headline; the delta payload and its ratio follow.
    std::printf("  %-12s %-10s %-16s %6s %6s %11s %11s %7s %11s %7s %12s\n", "PEER", "STATE", "JOB",
                "ACKED", "LAG", "WIRE SENT", "WIRE RECV", "WIRE x", "PAYLOAD", "PAYL x",
                "BANDWIDTH");
    for (const auto& l : st->links) {
      // A peer removed from every job here stays in sync.peers but carries nothing: not "down".
      const auto removed = ctl::PeerRemovedFrom(*st, l.site);
      const std::string state = removed       ? "removed (round " + std::to_string(*removed) + ")"
                                : l.paused    ? "paused"
                                : l.connected ? "connected"
                                              : "down";
      char ratio[16], wire_ratio[16];
      std::snprintf(ratio, sizeof ratio, l.compression_ratio > 0 ? "%.1fx" : "-",
                    l.compression_ratio);
      std::snprintf(wire_ratio, sizeof wire_ratio, l.wire_ratio > 0 ? "%.1fx" : "-", l.wire_ratio);
      std::vector<PeerLinkReport::Job> jobs = l.jobs;
      if (jobs.empty()) jobs.push_back({"-", 0, 0, 0});
      for (const auto& j : jobs) {
        std::printf("  %-12s %-10s %-16s %6s %6s %11s %11s %7s %11s %7s %12s\n", l.site.c_str(),
                    state.c_str(), j.job.c_str(),
                    l.jobs.empty() || removed ? "-" : std::to_string(j.acked_round).c_str(),
                    l.jobs.empty() || removed ? "-" : std::to_string(j.lag_rounds).c_str(),
                    HumanBytes(l.wire_bytes_sent).c_str(),
                    HumanBytes(l.wire_bytes_received).c_str(), wire_ratio,
                    HumanBytes(l.bytes_sent).c_str(), ratio, Rate(l.bandwidth_bps).c_str());
      }
      std::printf(
          "  %-12s %s; %llu messages sent, %llu received, %llu connections, "
          "%llu keep-alives, TCP/IP headers ~%s (estimated); last heard %.0f s ago\n",
          "", l.dials ? "we dial" : "peer dials", (unsigned long long)l.messages_sent,
          (unsigned long long)l.messages_received, (unsigned long long)l.connections,
          (unsigned long long)l.keepalives, HumanBytes(l.tcp_bytes_estimate).c_str(),
          l.silent_seconds);
      if (!l.last_error.empty()) std::printf("  %-12s last error: %s\n", "", l.last_error.c_str());
    }
  }
  if (as_json) std::printf("%s\n", out.dump(2).c_str());
  return worst.ok() ? 0 : ExitCode(worst);
}

int CmdSyncControl(const Connection& c, wire::SyncAction action, const std::string& peer) {
  auto clients = ConnectAll(c);
  if (!clients.ok()) return Fail(clients.status());
  const char* verb = action == wire::SyncAction::Now     ? "sync now"
                     : action == wire::SyncAction::Pause ? "paused"
                                                         : "resumed";
  for (size_t i = 0; i < clients->size(); ++i) {
    auto r = (*clients)[i]->SyncControl(action, peer);
    if (!r.ok()) {
      return Fail(Status(r.status().code(), "shard " + std::to_string(i) + " (" + c.servers[i] +
                                                "): " + r.status().message()));
    }
    std::string sites;
    for (const auto& s : *r) sites += (sites.empty() ? "" : ", ") + s;
    std::printf("shard %zu: %s: %s\n", i, verb, sites.empty() ? "(no peer links)" : sites.c_str());
  }
  return 0;
}

// Starts a membership change on every shard of the site (coordinated by each shard with the
// same-numbered shards of the other sites) and waits up to `wait_s` for its outcome.
int CmdMembership(const Connection& c, wire::MembershipAction action, const std::string& site,
                  const std::string& job, int wait_s, uint64_t seconds = 0,
                  bool revoke_key = false) {
  auto clients = ConnectAll(c);
  if (!clients.ok()) return Fail(clients.status());
  std::vector<std::map<std::string, uint64_t>> started(clients->size());
  for (size_t i = 0; i < clients->size(); ++i) {
    auto r = (*clients)[i]->MembershipControl(action, site, job, seconds, revoke_key);
    if (!r.ok()) {
      return Fail(Status(r.status().code(), "shard " + std::to_string(i) + " (" + c.servers[i] +
                                                "): " + r.status().message()));
    }
    started[i] = *r;
  }
  if (action == wire::MembershipAction::Invite) {
    for (size_t i = 0; i < clients->size(); ++i) {
      for (const auto& [j, epoch] : started[i]) {
        std::printf(
            "shard %zu: job %s: site %s may ask this site to join for %llu s (epoch %llu)\n", i,
            j.c_str(), site.c_str(), (unsigned long long)(seconds ? seconds : 3600),
            (unsigned long long)epoch);
      }
    }
    auto st = (*clients)[0]->SyncStatus();
    std::printf("then, on site %s: isthmusctl sync join --from %s -j JOB\n", site.c_str(),
                st.ok() ? st->site.c_str() : "THIS-SITE");
    return 0;
  }
  if (action == wire::MembershipAction::Abandon) {
    for (size_t i = 0; i < clients->size(); ++i) {
      for (const auto& [j, epoch] : started[i]) {
        std::printf("shard %zu: job %s: change abandoned (epoch stays %llu)\n", i, j.c_str(),
                    (unsigned long long)epoch);
      }
    }
    return 0;
  }
  // Outcome per (shard, job): applied once the epoch is reached, refused once nothing is
  // pending below it.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(wait_s);
  std::vector<std::map<std::string, std::string>> outcome(clients->size());
  Status worst;
  bool refused = false;
  for (;;) {
    bool open = false;
    for (size_t i = 0; i < clients->size(); ++i) {
      auto st = (*clients)[i]->SyncStatus();
      if (!st.ok()) {
        open = true;
        continue;
      }
      for (const auto& j : st->jobs) {
        auto it = started[i].find(j.job);
        if (it == started[i].end() || outcome[i].count(j.job)) continue;
        const bool member =
            std::find(j.members.begin(), j.members.end(), st->site) != j.members.end();
        // A join is done once this site is a member at an epoch after the one it held when
        // it asked (a removed site still lists itself in its old membership).
        const bool done = action == wire::MembershipAction::Join
                              ? member && !j.change_pending && j.epoch > it->second
                          : action == wire::MembershipAction::CatchUp
                              ? !j.change_pending && (j.change.rfind("caught up", 0) == 0 ||
                                                      j.change.rfind("nothing to catch up", 0) == 0)
                              : j.epoch >= it->second;
        if (done) {
          outcome[i][j.job] = j.change;  // "applied: ..."
        } else if (!j.change_pending) {
          outcome[i][j.job] = "not applied: " + j.change;
          refused = true;
        } else if (std::chrono::steady_clock::now() >= deadline) {
          outcome[i][j.job] = "still under way after " + std::to_string(wait_s) +
                              " s: " + j.change +
                              " (it goes on: watch isthmusctl sync status, or give it up with "
                              "isthmusctl sync abandon)";
          if (worst.ok()) worst = Status::Unavailable(j.change);
        } else {
          open = true;
        }
      }
    }
    if (!open || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  for (size_t i = 0; i < clients->size(); ++i) {
    for (const auto& [j, epoch] : started[i]) {
      auto it = outcome[i].find(j);
      std::string what = it == outcome[i].end() ? "(shard did not answer)" : it->second;
      if (action == wire::MembershipAction::Join || action == wire::MembershipAction::CatchUp) {
        std::printf("shard %zu: job %s: %s\n", i, j.c_str(), what.c_str());
      } else {
        std::printf("shard %zu: job %s: epoch %llu: %s\n", i, j.c_str(), (unsigned long long)epoch,
                    what.c_str());
      }
      if (it == outcome[i].end() && worst.ok()) worst = Status::Unavailable("no answer");
    }
  }
  if (refused) return kExitRefused;
  return worst.ok() ? 0 : ExitCode(worst);
}

struct SiteArg {
  std::string name;
  std::vector<std::string> endpoints;
  std::vector<std::string> key_files;
};

// "NAME=A,B,C" -> name and list.
Result<std::pair<std::string, std::vector<std::string>>> SplitSiteArg(const std::string& text,
                                                                      const char* what) {
  auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == text.size()) {
    return Status::InvalidArgument(std::string(what) + " '" + text +
                                   "' is not NAME=VALUE[,VALUE...]");
  }
  std::vector<std::string> items;
  std::string rest = text.substr(eq + 1);
  size_t start = 0;
  while (start <= rest.size()) {
    size_t comma = rest.find(',', start);
    std::string item =
        rest.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (item.empty())
      return Status::InvalidArgument(std::string(what) + " '" + text + "' has an empty entry");
    items.push_back(item);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return std::make_pair(text.substr(0, eq), items);
}

// Exit code 0: every shard's committed digests agree on every round all sites hold under one
// membership; 1: a round differs (printed); 3: they agree, but a site is no longer a member of
// a job (removed or left: only rounds before that were compared; printed with the remedy);
// other codes as for every command. The comparison is ctl::CompareDigests (verify.h).
int CmdSyncVerify(const Connection& c, const std::vector<std::string>& site_texts,
                  const std::vector<std::string>& site_key_texts, std::vector<std::string> jobs,
                  bool as_json) {
  std::vector<SiteArg> sites;
  for (const auto& t : site_texts) {
    auto p = SplitSiteArg(t, "--site");
    if (!p.ok()) return Fail(p.status());
    sites.push_back({p->first, p->second, {}});
  }
  if (sites.size() < 2)
    return Fail(Status::InvalidArgument("sync verify needs --site for at least two sites"));
  for (const auto& t : site_key_texts) {
    auto p = SplitSiteArg(t, "--site-key");
    if (!p.ok()) return Fail(p.status());
    auto it = std::find_if(sites.begin(), sites.end(),
                           [&](const SiteArg& s) { return s.name == p->first; });
    if (it == sites.end())
      return Fail(Status::InvalidArgument("--site-key names unknown site '" + p->first + "'"));
    it->key_files = p->second;
  }
  size_t shards = sites[0].endpoints.size();
  for (const auto& s : sites) {
    if (s.endpoints.size() != shards) {
      return Fail(Status::InvalidArgument(
          "site '" + s.name + "' lists " + std::to_string(s.endpoints.size()) +
          " shards but site '" + sites[0].name + "' lists " + std::to_string(shards)));
    }
  }
  // clients[site][shard]
  std::vector<std::vector<std::unique_ptr<ShardClient>>> clients;
  for (const auto& s : sites) {
    Connection sc = c;
    sc.servers = s.endpoints;
    if (!s.key_files.empty()) sc.server_keys = s.key_files;
    auto cl = ConnectAll(sc);
    if (!cl.ok())
      return Fail(Status(cl.status().code(), "site '" + s.name + "': " + cl.status().message()));
    clients.push_back(std::move(*cl));
  }
  json report = json::array();
  bool differ = false, not_member = false;
  for (size_t shard = 0; shard < shards; ++shard) {
    std::vector<std::string> shard_jobs = jobs;
    if (shard_jobs.empty()) {
      auto st = clients[0][shard]->SyncStatus();
      if (!st.ok()) return Fail(st.status());
      for (const auto& j : st->jobs) shard_jobs.push_back(j.job);
    }
    for (const auto& job : shard_jobs) {
      std::vector<DigestsInfo> per_site;
      for (size_t s = 0; s < sites.size(); ++s) {
        auto d = clients[s][shard]->Digests(job, 0);
        if (!d.ok()) {
          return Fail(Status(d.status().code(), "site '" + sites[s].name + "' shard " +
                                                    std::to_string(shard) + ": " +
                                                    d.status().message()));
        }
        per_site.push_back(std::move(*d));
      }
      std::vector<ctl::VerifySite> compared;
      for (size_t s = 0; s < sites.size(); ++s) {
        compared.push_back({sites[s].name, std::move(per_site[s])});
      }
      ctl::VerifyOutcome v = ctl::CompareDigests(shard, job, compared);
      differ |= v.kind == ctl::VerifyOutcome::kDiffer;
      not_member |= v.kind == ctl::VerifyOutcome::kRemoved;
      if (!as_json) {
        for (const auto& line : v.lines) std::printf("%s\n", line.c_str());
      }
      report.push_back(std::move(v.row));
    }
  }
  if (as_json) std::printf("%s\n", report.dump(2).c_str());
  if (differ) return kExitFailure;
  return not_member ? kExitRefused : kExitOk;
}

}  // namespace
}  // namespace isthmus

int main(int argc, char** argv) {
  using namespace isthmus;
  CLI::App app{"isthmusctl: administer the parameter-server shards of an isthmus site"};
  app.footer(ExitCodesFooter());
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("isthmusctl ") + kIsthmusVersion);
  std::string log_level = "warn";
  app.add_option("--log-level", log_level, "log level of the CLI itself")->capture_default_str();
  Connection conn;
  bool as_json = false;

  auto* keygen = app.add_subcommand(
      "keygen", "write a new CURVE key pair: PREFIX.key (secret, 0600) and PREFIX.pub");
  std::string key_out;
  bool force = false;
  keygen->add_option("-o,--out", key_out, "path prefix of the two files")->required();
  keygen->add_flag("--force", force, "overwrite existing files");

  auto* status = app.add_subcommand("status", "show every shard's health, traffic and jobs");
  AddConnectionFlags(status, conn);
  status->add_flag("--json", as_json, "machine-readable output");

  auto* top = app.add_subcommand(
      "top",
      "live view of a site: per shard the rounds, peer links (lag, bandwidth, wire bytes and "
      "their rates) and pushes/s; redrawn on a terminal, plain snapshots otherwise, --json lines");
  AddConnectionFlags(top, conn);
  ctl::TopOptions top_options;
  ctl::AddTopFlags(top, top_options);

  auto* fleet = app.add_subcommand("fleet", "bootstrap a fleet of sites");
  fleet->require_subcommand(1);
  auto* fleet_init = fleet->add_subcommand(
      "init",
      "write every key pair, the allowlist folders, one TOML per shard (consistent shard.index "
      "and sync.peers), a worker TOML and an isthmusctl env file per site, and a summary");
  ctl::FleetOptions fleet_options;
  ctl::AddFleetInitFlags(fleet_init, fleet_options);
  auto* fleet_add_site = fleet->add_subcommand(
      "add-site",
      "add one site to a fleet that fleet init wrote: its own new keys and configs, and its "
      "shards on every existing site's peer allowlists and sync.peers (no existing key changes)");
  ctl::FleetAddOptions fleet_add_options;
  ctl::AddFleetAddSiteFlags(fleet_add_site, fleet_add_options);

  auto* job = app.add_subcommand("job", "create or describe a job");
  job->require_subcommand(1);
  std::string job_name, from_file, base_hash;
  auto* job_create = job->add_subcommand(
      "create", "create a job from a safetensors file of initial tensors, spread over the shards");
  AddConnectionFlags(job_create, conn);
  job_create->add_option("-j,--job", job_name, "job name (1-64 of A-Z a-z 0-9 . _ -)")->required();
  job_create->add_option("-f,--from", from_file, "safetensors file of initial tensors")
      ->required()
      ->check(CLI::ExistingFile);
  job_create->add_option("--base-hash", base_hash,
                         "base model hash workers must match (default: content hash of the file)");
  auto* job_describe = job->add_subcommand("describe", "list a job's tensors and versions");
  AddConnectionFlags(job_describe, conn);
  job_describe->add_option("-j,--job", job_name, "job name")->required();
  job_describe->add_flag("--json", as_json, "machine-readable output");

  auto* snapshot = app.add_subcommand("snapshot", "RocksDB checkpoints of every shard");
  snapshot->require_subcommand(1);
  std::string snap_name;
  auto* snap_create = snapshot->add_subcommand("create", "checkpoint every shard under NAME");
  AddConnectionFlags(snap_create, conn);
  snap_create->add_option("name", snap_name, "snapshot name")->required();
  auto* snap_list = snapshot->add_subcommand("list", "list snapshots on every shard");
  AddConnectionFlags(snap_list, conn);
  snap_list->add_flag("--json", as_json, "machine-readable output");
  auto* snap_restore =
      snapshot->add_subcommand("restore", "replace every shard's state by snapshot NAME");
  AddConnectionFlags(snap_restore, conn);
  snap_restore->add_option("name", snap_name, "snapshot name")->required();

  auto* exp = app.add_subcommand(
      "export", "write a job's current tensors from every shard to one safetensors file");
  AddConnectionFlags(exp, conn);
  std::string out_file;
  exp->add_option("-j,--job", job_name, "job name")->required();
  exp->add_option("-o,--out", out_file, "output .safetensors file")->required();

  auto* sync =
      app.add_subcommand("sync", "cross-site synchronisation: peer links, rounds, digests");
  sync->require_subcommand(1);
  std::string peer_site;
  std::vector<std::string> verify_sites, verify_site_keys, verify_jobs;
  auto* sync_status =
      sync->add_subcommand("status",
                           "per shard: the round protocol and every peer link (connected, acked "
                           "round, lag, bytes, compression, bandwidth)");
  AddConnectionFlags(sync_status, conn);
  sync_status->add_flag("--json", as_json, "machine-readable output");
  auto* sync_now =
      sync->add_subcommand("now", "resend at once what peers lack and reset the backoff");
  AddConnectionFlags(sync_now, conn);
  sync_now->add_option("--peer", peer_site, "only the link to this site (default: every link)");
  auto* sync_pause = sync->add_subcommand(
      "pause", "stop a peer link in both directions (its deltas are answered Unavailable)");
  AddConnectionFlags(sync_pause, conn);
  sync_pause->add_option("--peer", peer_site, "the peer site")->required();
  auto* sync_resume =
      sync->add_subcommand("resume", "restart a paused peer link and send what the peer lacks");
  AddConnectionFlags(sync_resume, conn);
  sync_resume->add_option("--peer", peer_site, "the peer site")->required();
  auto* sync_verify = sync->add_subcommand(
      "verify",
      "compare committed-round digests of same-numbered shards across sites, over the rounds "
      "every site holds under one membership; exit 0 agree, 1 differ, 3 a site is no longer a "
      "member");
  AddConnectionFlags(sync_verify, conn);
  sync_verify
      ->add_option("--site", verify_sites,
                   "NAME=ADMIN_EP[,ADMIN_EP...]: one per site, shard endpoints in shard order")
      ->required();
  sync_verify->add_option(
      "--site-key", verify_site_keys,
      "NAME=PUBFILE[,PUBFILE...]: that site's shard public key(s); default --server-key");
  sync_verify->add_option("-j,--job", verify_jobs,
                          "job(s) to compare (default: every sync job of the first site)");
  sync_verify->add_flag("--json", as_json, "machine-readable output");
  std::string member_job;
  int wait_s = 60;
  auto* sync_remove = sync->add_subcommand(
      "remove",
      "remove a member site from the job(s) from the next round (a dead site); every remaining "
      "site must agree, and is refused when the sites stand at different rounds or epochs");
  AddConnectionFlags(sync_remove, conn);
  sync_remove->add_option("--peer", peer_site, "the site to remove")->required();
  auto* sync_leave = sync->add_subcommand(
      "leave",
      "this site leaves the job(s) (stop its workers and let its rounds commit first); the "
      "remaining sites must agree");
  AddConnectionFlags(sync_leave, conn);
  std::string join_from;
  auto* sync_join = sync->add_subcommand(
      "join",
      "this site joins a running job: a member coordinates its addition, this site takes the "
      "member's committed state, checked against every member's digest, and contributes from "
      "the next round (run before this site's workers start)");
  AddConnectionFlags(sync_join, conn);
  sync_join->add_option("--from", join_from, "the member site to ask")->required();
  auto* sync_catch_up = sync->add_subcommand(
      "catch-up",
      "take a member's committed state when it has committed more rounds than this site (a "
      "dead site delivered its last delta to some sites only; then a removal is refused)");
  AddConnectionFlags(sync_catch_up, conn);
  sync_catch_up->add_option("--from", join_from, "the member site to take the state from")
      ->required();
  sync_catch_up->add_option("-j,--job", member_job, "only this job (default: every sync job)");
  auto* sync_abandon = sync->add_subcommand(
      "abandon",
      "give up the membership change this site coordinates (remove, leave, an addition) or the "
      "join it is making");
  bool revoke_key = false;
  sync_remove->add_flag("--revoke-key", revoke_key,
                        "also stop admitting the site's key on the peer socket at once (until a "
                        "restart: take its key file out of security.peer_keys too)");
  uint64_t invite_s = 3600;
  auto* sync_invite = sync->add_subcommand(
      "invite",
      "let a site join: it may ask this member to coordinate its addition (sync join --from "
      "this site) for the next --for seconds; a join nobody invited is refused");
  AddConnectionFlags(sync_invite, conn);
  sync_invite->add_option("--site", peer_site, "the site that may join")->required();
  sync_invite->add_option("-j,--job", member_job, "only this job (default: every sync job)");
  sync_invite->add_option("--for", invite_s, "seconds the invitation is good for")
      ->check(CLI::Range(uint64_t{1}, uint64_t{30 * 86400}))
      ->capture_default_str();
  AddConnectionFlags(sync_abandon, conn);
  for (auto* cmd : {sync_remove, sync_leave, sync_abandon}) {
    cmd->add_option("-j,--job", member_job, "only this job (default: every sync job)");
  }
  sync_join->add_option("-j,--job", member_job, "the job to join")->required();
  for (auto* cmd : {sync_remove, sync_leave, sync_join, sync_catch_up}) {
    cmd->add_option("--wait", wait_s, "seconds to wait for the outcome (the change goes on after)")
        ->check(CLI::Range(0, 86400))
        ->capture_default_str();
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (auto s = InitLogging("isthmusctl", log_level); !s.ok()) return Fail(s);
  if (*keygen) return CmdKeygen(key_out, force);
  if (*status) return CmdStatus(conn, as_json);
  if (*top) return ctl::CmdTop(conn, top_options, top->count("--timeout-ms") > 0);
  if (*fleet_init) return ctl::CmdFleetInit(fleet_options);
  if (*fleet_add_site) return ctl::CmdFleetAddSite(fleet_add_options);
  if (*job_create) return CmdJobCreate(conn, job_name, from_file, base_hash);
  if (*job_describe) return CmdJobDescribe(conn, job_name, as_json);
  if (*snap_create) return CmdSnapshot(conn, "create", snap_name, as_json);
  if (*snap_list) return CmdSnapshot(conn, "list", snap_name, as_json);
  if (*snap_restore) return CmdSnapshot(conn, "restore", snap_name, as_json);
  if (*exp) return CmdExport(conn, job_name, out_file);
  if (*sync_status) return CmdSyncStatus(conn, as_json);
  if (*sync_now) return CmdSyncControl(conn, wire::SyncAction::Now, peer_site);
  if (*sync_pause) return CmdSyncControl(conn, wire::SyncAction::Pause, peer_site);
  if (*sync_resume) return CmdSyncControl(conn, wire::SyncAction::Resume, peer_site);
  if (*sync_remove) {
    return CmdMembership(conn, wire::MembershipAction::Remove, peer_site, member_job, wait_s, 0,
                         revoke_key);
  }
  if (*sync_invite) {
    return CmdMembership(conn, wire::MembershipAction::Invite, peer_site, member_job, 0, invite_s);
  }
  if (*sync_leave)
    return CmdMembership(conn, wire::MembershipAction::Leave, "", member_job, wait_s);
  if (*sync_catch_up) {
    return CmdMembership(conn, wire::MembershipAction::CatchUp, join_from, member_job, wait_s);
  }
  if (*sync_join) {
    return CmdMembership(conn, wire::MembershipAction::Join, join_from, member_job, wait_s);
  }
  if (*sync_abandon) {
    return CmdMembership(conn, wire::MembershipAction::Abandon, "", member_job, 0);
  }
  if (*sync_verify) {
    return CmdSyncVerify(conn, verify_sites, verify_site_keys, verify_jobs, as_json);
  }
  return 2;
}
