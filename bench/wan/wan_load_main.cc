// bench_wan_load: a synthetic site (bench/wan/wan_load.h) for the WAN benchmark. It
// replays real recorded round deltas into a site's real shards at a GPU-like pace and
// prints, per round, how long it computed (emulated), pushed, waited for the WAN and
// pulled, then the utilisation. Not a worker: it trains nothing.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "bench/wan/wan_load.h"
#include "common/keys.h"

int main(int argc, char** argv) {
  using namespace isthmus;
  CLI::App app{
      "bench_wan_load: a SYNTHETIC site: replays recorded round deltas (bench/wan/record.sh) "
      "into real shards every --round-seconds (standing for a GPU's inner steps) and measures "
      "push, WAN wait and pull time per round"};
  std::vector<std::string> servers, server_keys;
  std::string job, key_path, client_name = "site", deltas_dir, json_path;
  double round_seconds = 3.0;
  int rounds = 10, skip = 2, max_recorded = 0, poll_ms = 50, timeout_ms = 120000;
  app.add_option("--job", job, "job on the shards")->required();
  app.add_option("--server", servers, "shard worker endpoint, in shard order")->required();
  app.add_option("--server-key", server_keys, "shard public key file (one, or one per --server)")
      ->required();
  app.add_option("--key", key_path, "this worker's key pair file")->required();
  app.add_option("--client-name", client_name, "site name in idempotency keys")
      ->capture_default_str();
  app.add_option("--deltas", deltas_dir, "folder of round-R.safetensors (bench/wan/record.sh)")
      ->required();
  app.add_option("--max-recorded", max_recorded,
                 "replay at most this many recorded rounds (0: all)")
      ->capture_default_str();
  app.add_option("--round-seconds", round_seconds, "emulated compute time per round")
      ->capture_default_str();
  app.add_option("--rounds", rounds, "rounds to run")->capture_default_str();
  app.add_option("--skip", skip, "first rounds left out of the summary (start-up)")
      ->capture_default_str();
  app.add_option("--poll-ms", poll_ms, "how often a waiting site asks the shards")
      ->capture_default_str();
  app.add_option("--request-timeout-ms", timeout_ms, "per shard request attempt")
      ->capture_default_str();
  app.add_option("--json", json_path, "write per-round timings and the summary here");
  CLI11_PARSE(app, argc, argv);

  if (server_keys.size() != 1 && server_keys.size() != servers.size()) {
    std::fprintf(stderr, "bench_wan_load: give one --server-key, or one per --server\n");
    return 2;
  }
  auto keys = LoadKeyPairFile(key_path);
  if (!keys.ok()) {
    std::fprintf(stderr, "bench_wan_load: %s\n", keys.status().ToString().c_str());
    return 2;
  }
  std::vector<ClientOptions> options;
  for (size_t i = 0; i < servers.size(); ++i) {
    auto pub = LoadPublicKeyFile(server_keys[server_keys.size() == 1 ? 0 : i]);
    if (!pub.ok()) {
      std::fprintf(stderr, "bench_wan_load: %s\n", pub.status().ToString().c_str());
      return 2;
    }
    ClientOptions o;
    o.endpoint = servers[i];
    o.server_public_key = *pub;
    o.client_keys = *keys;
    o.timeout_ms = timeout_ms;
    options.push_back(o);
  }
  auto deltas = wanload::LoadRecordedDeltas(deltas_dir, max_recorded);
  if (!deltas.ok()) {
    std::fprintf(stderr, "bench_wan_load: %s\n", deltas.status().ToString().c_str());
    return 2;
  }
  std::printf(
      "bench_wan_load (synthetic site %s): %zu recorded rounds of %llu values, %d rounds "
      "of %.2f s, %zu shard(s)\n",
      client_name.c_str(), deltas->rounds.size(), static_cast<unsigned long long>(deltas->numel),
      rounds, round_seconds, servers.size());
  std::fflush(stdout);
  wanload::SiteOptions so;
  so.job = job;
  so.client_name = client_name;
  so.round_seconds = round_seconds;
  so.rounds = rounds;
  so.poll_ms = poll_ms;
  wanload::SyntheticSite site(
      servers.size(), [&](size_t s) { return ShardClient::Connect(options[s]); }, so);
  Status s = site.Prepare(*deltas);
  if (!s.ok()) {
    std::fprintf(stderr, "bench_wan_load: %s\n", s.ToString().c_str());
    return 1;
  }
  auto timings = site.Run(*deltas);
  if (!timings.ok()) {
    std::fprintf(stderr, "bench_wan_load: %s\n", timings.status().ToString().c_str());
    return 1;
  }
  std::printf("round  compute s  push s  wait s  pull s  commit latency s\n");
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& t : *timings) {
    std::printf("%5llu  %9.3f  %6.3f  %6.3f  %6.3f  %16.3f\n",
                static_cast<unsigned long long>(t.round), t.compute_s, t.push_s, t.wait_s, t.pull_s,
                t.commit_latency_s);
    rows.push_back({{"round", t.round},
                    {"compute_s", t.compute_s},
                    {"push_s", t.push_s},
                    {"wait_s", t.wait_s},
                    {"pull_s", t.pull_s},
                    {"commit_latency_s", t.commit_latency_s}});
  }
  auto sum = wanload::Summarize(*timings, static_cast<size_t>(std::max(0, skip)));
  std::printf(
      "rounds %zu-%zu: utilisation %.1f%% (not waiting for the WAN), computing %.1f%% "
      "(%.1f s of %.1f s); push %.2f s, WAN wait %.2f s (in %zu rounds), pull %.2f s; "
      "commit latency mean %.2f s, max %.2f s\n",
      static_cast<size_t>(skip) + 1, timings->size(), 100 * sum.utilisation,
      100 * sum.compute_fraction, sum.compute_s, sum.wall_s, sum.push_s, sum.wait_s,
      sum.rounds_waited, sum.pull_s, sum.mean_commit_latency_s, sum.max_commit_latency_s);
  if (!json_path.empty()) {
    nlohmann::json j = {{"site", client_name},
                        {"round_seconds", round_seconds},
                        {"numel", deltas->numel},
                        {"rounds", rows},
                        {"summary",
                         {{"skip", skip},
                          {"rounds", sum.rounds},
                          {"wall_s", sum.wall_s},
                          {"compute_s", sum.compute_s},
                          {"push_s", sum.push_s},
                          {"wait_s", sum.wait_s},
                          {"pull_s", sum.pull_s},
                          {"utilisation", sum.utilisation},
                          {"compute_fraction", sum.compute_fraction},
                          {"wait_fraction", sum.wait_fraction},
                          {"rounds_waited", sum.rounds_waited},
                          {"mean_commit_latency_s", sum.mean_commit_latency_s},
                          {"max_commit_latency_s", sum.max_commit_latency_s}}}};
    std::ofstream(json_path) << j.dump(2) << "\n";
  }
  return 0;
}
