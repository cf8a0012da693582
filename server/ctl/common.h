// What isthmusctl's commands share (ctl/main.cc, top.cc, fleet.cc): the
// connection flags every shard command takes and the clients made from them, error
// reporting with the shared exit codes, number formatting, and the JSON objects that
// `status --json`, `sync status --json` and `top --json` print (one builder each, so the
// three stay the same). Single-threaded like the CLI itself.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/client.h"
#include "common/status.h"

namespace isthmus::ctl {

// The connection flags (docs/CLI.md, "Connection flags"): a site's shard admin endpoints in
// shard order, their public keys and this admin's key pair.
struct Connection {
  std::vector<std::string> servers;
  std::vector<std::string> server_keys;
  std::string key_file;
  bool insecure = false;
  int timeout_ms = 30000;
  int retries = 1;  // extra attempts after a timeout (top uses 0: it asks again next refresh)
};

// Adds -s/--server, --server-key, -k/--key (with their ISTHMUS_CTL_* environment
// variables), --insecure-plaintext and --timeout-ms to `cmd`, bound to `c`.
void AddConnectionFlags(CLI::App* cmd, Connection& c);

// One client per --server, in order. InvalidArgument (saying which flag to pass) when no
// server or no key is given; the key loaders' errors otherwise. ZeroMQ connects lazily: a
// shard that is down shows up as a Timeout on the first request, not here.
Result<std::vector<std::unique_ptr<ShardClient>>> ConnectAll(const Connection& c);

// Prints "isthmusctl: <status>" to stderr and returns its exit code (common/exit_codes.h).
int Fail(const Status& s);

// "1.5 MiB"; "12 B" below 1 KiB.
std::string HumanBytes(uint64_t bytes);
// "1.5 MiB/s"; "-" when not positive.
std::string Rate(double bytes_per_second);
// "2024-05-01 12:00:00" (UTC).
std::string TimeText(uint64_t unix_s);

// A shard's Stats as `isthmusctl status --json` prints it: shard_id, version, uptime_s,
// requests, errors, bytes_in, bytes_out, db_bytes, jobs [{job, version, tensors, bytes,
// pushes, duplicate_pushes}].
nlohmann::json StatsJson(const ShardStats& st);

// A shard's SyncStatus as `isthmusctl sync status --json` prints it: site, shard_index,
// enabled, refused_unknown, links [... silent_s, removed_from_round], jobs [... pipelines,
// held, waiting_for_wan].
nlohmann::json SyncStatusJson(const SyncStatusInfo& st);

// The round from which peer `site` merges into none of the jobs this shard syncs: it is a
// member of none of them and was removed from (or left) at least one; the latest such round.
// nullopt while it is a member of some job, when no job names it, or while a job's membership
// is not known here yet (being joined). `sync status` and `top` show such a link as
// "removed (round N)" instead of "down": the site's link stays in sync.peers but carries
// nothing any more.
std::optional<uint64_t> PeerRemovedFrom(const SyncStatusInfo& st, const std::string& site);

// Whether the site's workers wait for the WAN on job `j`: it is more than max_rounds_ahead
// rounds ahead of its last commit (local - committed > K), as workers check before a round.
bool WaitingForWan(const SyncJobReport& j);

}  // namespace isthmus::ctl
