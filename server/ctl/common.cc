// The pieces every isthmusctl command shares (common.h): connection flags and
// clients, error reporting, formatting, and the status / sync status JSON objects.
#include "server/ctl/common.h"

#include <algorithm>
#include <cstdio>
#include <ctime>

#include "common/exit_codes.h"
#include "common/keys.h"

namespace isthmus::ctl {

using json = nlohmann::json;

void AddConnectionFlags(CLI::App* cmd, Connection& c) {
  cmd->add_option("-s,--server", c.servers,
                  "admin endpoint of a shard, e.g. tcp://127.0.0.1:7101; repeat once per shard, in "
                  "shard order")
      ->envname("ISTHMUS_CTL_SERVERS")
      ->delimiter(',');
  cmd->add_option("--server-key", c.server_keys,
                  "the shard's public key file (.pub); once for all shards or once per --server")
      ->envname("ISTHMUS_CTL_SERVER_KEYS")
      ->delimiter(',');
  cmd->add_option("-k,--key", c.key_file, "this admin's key pair file (.key, mode 0600)")
      ->envname("ISTHMUS_CTL_KEY");
  cmd->add_flag("--insecure-plaintext", c.insecure,
                "talk without CURVE to a server started with security.insecure_plaintext");
  cmd->add_option("--timeout-ms", c.timeout_ms, "per-request timeout (1 to 3600000)")
      ->check(CLI::Range(1, 3600000))
      ->capture_default_str();
}

Result<std::vector<std::unique_ptr<ShardClient>>> ConnectAll(const Connection& c) {
  if (c.servers.empty()) {
    return Status::InvalidArgument(
        "no shard given: pass --server tcp://HOST:ADMIN_PORT (once per shard, in shard order)");
  }
  ClientOptions base;
  base.insecure_plaintext = c.insecure;
  base.timeout_ms = c.timeout_ms;
  base.retries = c.retries;
  if (!c.insecure) {
    if (c.key_file.empty()) {
      return Status::InvalidArgument(
          "no admin key: pass --key ADMIN.key (make one with isthmusctl keygen)");
    }
    ISTHMUS_ASSIGN_OR_RETURN(base.client_keys, LoadKeyPairFile(c.key_file));
    if (c.server_keys.size() != 1 && c.server_keys.size() != c.servers.size()) {
      return Status::InvalidArgument(
          "pass --server-key once (all shards share a key) or once per --server");
    }
  }
  std::vector<std::unique_ptr<ShardClient>> clients;
  for (size_t i = 0; i < c.servers.size(); ++i) {
    ClientOptions o = base;
    o.endpoint = c.servers[i];
    if (!c.insecure) {
      o.server_key_file = c.server_keys[c.server_keys.size() == 1 ? 0 : i];
    }
    ISTHMUS_ASSIGN_OR_RETURN(auto client, ShardClient::Connect(o));
    clients.push_back(std::move(client));
  }
  return clients;
}

int Fail(const Status& s) {
  std::fprintf(stderr, "isthmusctl: %s\n", s.ToString().c_str());
  return ExitCodeForStatus(s);
}

std::string HumanBytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

std::string Rate(double bytes_per_second) {
  if (bytes_per_second <= 0) return "-";
  return HumanBytes(static_cast<uint64_t>(bytes_per_second)) + "/s";
}

std::string TimeText(uint64_t unix_s) {
  std::time_t t = static_cast<std::time_t>(unix_s);
  char buf[32];
  std::tm tm{};
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", gmtime_r(&t, &tm));
  return buf;
}

json StatsJson(const ShardStats& st) {
  json jobs = json::array();
  for (const auto& j : st.jobs) {
    jobs.push_back({{"job", j.job},
                    {"version", j.version},
                    {"tensors", j.tensor_count},
                    {"bytes", j.total_bytes},
                    {"pushes", j.pushes},
                    {"duplicate_pushes", j.duplicate_pushes}});
  }
  return {{"shard_id", st.shard_id},
          {"version", st.server_version},
          {"uptime_s", st.uptime_s},
          {"requests", st.requests},
          {"errors", st.errors},
          {"bytes_in", st.bytes_in},
          {"bytes_out", st.bytes_out},
          {"db_bytes", st.db_bytes},
          {"jobs", jobs},
          {"last_error", st.last_error.empty() ? json(nullptr) : json(st.last_error)},
          {"last_error_age_s", st.last_error.empty() ? json(nullptr) : json(st.last_error_age_s)}};
}

json SyncStatusJson(const SyncStatusInfo& st) {
  json links = json::array();
  for (const auto& l : st.links) {
    json jobs = json::array();
    for (const auto& j : l.jobs) {
      jobs.push_back({{"job", j.job},
                      {"acked_round", j.acked_round},
                      {"outbox_round", j.outbox_round},
                      {"lag_rounds", j.lag_rounds}});
    }
    links.push_back({{"site", l.site},
                     {"endpoint", l.endpoint},
                     {"connected", l.connected},
                     {"paused", l.paused},
                     {"last_error", l.last_error},
                     {"jobs", jobs},
                     {"bytes_sent", l.bytes_sent},
                     {"bytes_received", l.bytes_received},
                     {"raw_bytes_sent", l.raw_bytes_sent},
                     {"compression_ratio", l.compression_ratio},
                     {"bandwidth_bps", l.bandwidth_bps},
                     {"deltas_sent", l.deltas_sent},
                     {"deltas_acked", l.deltas_acked},
                     {"resends", l.resends},
                     {"auth_failures", l.auth_failures},
                     {"refused", l.refused},
                     {"wire_bytes_sent", l.wire_bytes_sent},
                     {"wire_bytes_received", l.wire_bytes_received},
                     {"tcp_bytes_estimate", l.tcp_bytes_estimate},
                     {"wire_ratio", l.wire_ratio},
                     {"messages_sent", l.messages_sent},
                     {"messages_received", l.messages_received},
                     {"connections", l.connections},
                     {"keepalives", l.keepalives},
                     {"dials", l.dials},
                     {"silent_s", l.silent_seconds}});
    const auto removed = PeerRemovedFrom(st, l.site);
    links.back()["removed_from_round"] = removed ? json(*removed) : json(nullptr);
  }
  json jobs = json::array();
  for (const auto& j : st.jobs) {
    jobs.push_back({{"job", j.job},
                    {"local_round", j.local_round},
                    {"committed_round", j.committed_round},
                    {"max_rounds_ahead", j.max_rounds_ahead},
                    {"detail", j.detail},
                    {"epoch", j.epoch},
                    {"members", j.members},
                    {"members_from", j.members_from},
                    {"removed", j.removed},
                    {"change", j.change},
                    {"change_pending", j.change_pending},
                    {"pipelines", j.pipelines},
                    {"held", j.held},
                    {"waiting_for_wan", WaitingForWan(j)},
                    {"round_work_pending", j.round_work_pending},
                    {"round_work_failures", j.round_work_failures},
                    {"round_work_error", j.round_work_error}});
  }
  return {{"site", st.site},       {"shard_index", st.shard_index},
          {"enabled", st.enabled}, {"refused_unknown", st.refused_unknown},
          {"links", links},        {"jobs", jobs}};
}

std::optional<uint64_t> PeerRemovedFrom(const SyncStatusInfo& st, const std::string& site) {
  std::optional<uint64_t> from;
  for (const auto& j : st.jobs) {
    if (j.members.empty()) return std::nullopt;  // being joined: not known yet
    if (std::find(j.members.begin(), j.members.end(), site) != j.members.end()) {
      return std::nullopt;
    }
    auto it = j.removed.find(site);
    if (it != j.removed.end()) from = std::max(from.value_or(0), it->second);
  }
  return from;
}

bool WaitingForWan(const SyncJobReport& j) {
  return j.local_round > j.committed_round &&
         j.local_round - j.committed_round > j.max_rounds_ahead;
}

}  // namespace isthmus::ctl
