// `isthmusctl top`: a live view of one site's shards (rounds, peer links, bandwidth,
// pushes/s). Each refresh asks every shard for Stats and SyncStatus; rates come from the
// difference with the previous refresh. The pure parts (rates, the JSON object, the text
// view) are separate from the loop so tests can feed them samples. docs/CLI.md, "top".
#pragma once

#include <CLI/CLI.hpp>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/client.h"
#include "common/status.h"
#include "server/ctl/common.h"

namespace isthmus::ctl {

struct TopOptions {
  double interval_s = 2;  // seconds between refreshes
  int count = 0;          // refreshes; 0: until SIGINT/SIGTERM
  bool json = false;      // one JSON object per refresh, one per line
};

// What one shard answered in one refresh.
struct ShardSample {
  std::string endpoint;
  Status status;                       // not ok: the shard is DOWN (the first failed call)
  std::optional<ShardStats> stats;     // absent when Stats failed
  std::optional<SyncStatusInfo> sync;  // absent when Stats or SyncStatus failed
  double at_s = 0;                     // steady-clock seconds when it answered
};

struct TopSample {
  double unix_time = 0;  // wall clock at the start of the refresh
  std::vector<ShardSample> shards;
};

// Rates of one shard between two samples; nullopt where there is no previous sample of
// that shard, or its counters went backwards (a restart, a snapshot restore).
struct ShardRates {
  std::optional<double> pushes_per_s;                       // every job's pushes together
  std::map<std::string, std::optional<double>> job_pushes;  // job -> pushes/s
  struct Link {
    std::optional<double> sent_per_s, received_per_s;  // wire bytes per second
  };
  std::map<std::string, Link> links;  // peer site -> rates (every link of `now`)
};
ShardRates RatesOf(const ShardSample& now, const ShardSample* prev);

// The JSON object of one refresh (docs/CLI.md, "top"): {time, interval_s, elapsed_s,
// shards: [{shard, endpoint, reachable, error?, stats, sync, rates}]}. `prev` is the
// previous refresh (null for the first).
nlohmann::json TopJson(const TopSample& now, const TopSample* prev, double interval_s);

// The text view of one refresh, one string per line (no newlines), each within 120
// columns. The first line is the timestamp line.
std::vector<std::string> TopText(const TopSample& now, const TopSample* prev, double interval_s);

// Adds --interval, --count and --json to `cmd`.
void AddTopFlags(CLI::App* cmd, TopOptions& o);

// Runs the view on stdout. `timeout_given`: --timeout-ms was passed (else a request waits
// max(2 s, interval) so that a DOWN shard does not stall the view). Exit code: 0 when
// stopped by SIGINT/SIGTERM; after --count refreshes, that of the last refresh (0, or the
// first unreachable shard's code as for `status`); usage and key errors as every command.
int CmdTop(Connection c, const TopOptions& o, bool timeout_given);

}  // namespace isthmus::ctl
