// bench_wan_load: a synthetic site (bench/wan/wan_load.h) for the WAN benchmark. It
// replays real recorded round deltas into a site's real shards at a GPU-like pace, ending
// its rounds through the product's round driver (with --overlap in the background), and
// prints, per round, how long it computed (emulated), how long the round boundary held the
// training loop, and the round's push, WAN wait and pull, then the computing share of wall
// time and the utilisation. Not a worker: it trains nothing.
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
  int steps_per_round = 30;
  int merge_after_steps = -1;
  bool merge_wait = false;
  bool overlap = false;
  bool pull_by_replay = false;
  int encode_threads = 0;
  int pass_threads = 0;
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
  app.add_flag("--overlap,!--no-overlap", overlap,
               "end rounds in the background while the next round computes (isthmus-worker "
               "--overlap)")
      ->capture_default_str();
  app.add_flag("--pull-by-replay,!--no-pull-by-replay", pull_by_replay,
               "pull rounds as encoded deltas and replay them here (isthmus-worker "
               "--pull-by-replay) instead of pulling every tensor")
      ->capture_default_str();
  app.add_option("--encode-threads", encode_threads,
                 "encode the deltas here with error feedback on this many threads and push the "
                 "encoded bytes (deltas encoded by the worker); 0: push fp32 deltas")
      ->capture_default_str();
  app.add_option("--pass-threads", pass_threads,
                 "threads of the round boundary's snapshot and merge over the live weights "
                 "(host memory here, where a GPU worker's are device passes); 0: one per core")
      ->capture_default_str();
  app.add_option("--steps-per-round", steps_per_round,
                 "emulated steps per round: the step boundaries a finished round is merged at")
      ->capture_default_str();
  app.add_option("--merge-after-steps", merge_after_steps,
                 "with --overlap: merge no earlier than this many steps into the next round, "
                 "then as soon as the round in flight is done (default: a tenth of "
                 "--steps-per-round, as isthmus-worker; 0: as soon as it is done)");
  app.add_flag("--merge-wait", merge_wait,
               "with --overlap: merge at exactly the --merge-after-steps step, waiting "
               "there if need be (isthmus-worker --merge-wait)");
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
  isthmus::SiteOptions site_options;
  site_options.job = job;
  site_options.servers = servers;
  site_options.client_keys = *keys;
  site_options.timeout_ms = timeout_ms;
  site_options.client_name = client_name;
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
    site_options.server_public_keys.push_back(*pub);
  }
  auto deltas = wanload::LoadRecordedDeltas(deltas_dir, max_recorded);
  if (!deltas.ok()) {
    std::fprintf(stderr, "bench_wan_load: %s\n", deltas.status().ToString().c_str());
    return 2;
  }
  std::printf(
      "bench_wan_load (synthetic site %s): %zu recorded rounds of %llu values, %d rounds "
      "of %.2f s in %d steps, %zu shard(s), overlap %s, pull by replay %s, encode here %s\n",
      client_name.c_str(), deltas->rounds.size(), static_cast<unsigned long long>(deltas->numel),
      rounds, round_seconds, steps_per_round, servers.size(), overlap ? "on" : "off",
      pull_by_replay ? "on" : "off",
      encode_threads > 0 ? (std::to_string(encode_threads) + " thread(s)").c_str() : "off");
  std::fflush(stdout);
  wanload::SiteOptions so;
  so.job = job;
  so.client_name = client_name;
  so.round_seconds = round_seconds;
  so.rounds = rounds;
  so.poll_ms = poll_ms;
  so.overlap = overlap;
  so.pull_by_replay = pull_by_replay;
  so.encode_threads = encode_threads;
  so.pass_threads = pass_threads;
  so.steps_per_round = steps_per_round;
  so.merge = MergePolicy{merge_after_steps, merge_wait};
  wanload::SyntheticSite site(
      servers.size(), [&](size_t s) { return ShardClient::Connect(options[s]); },
      [&] { return SiteClient::Connect(site_options); }, so);
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
  std::printf(
      "round  compute s  boundary s  blocked s  push s  wait s  pull s  commit latency s  "
      "wall s\n");
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& t : *timings) {
    std::printf("%5llu  %9.3f  %10.3f  %9.3f  %6.3f  %6.3f  %6.3f  %16.3f  %6.3f\n",
                static_cast<unsigned long long>(t.round), t.compute_s, t.boundary_s, t.blocked_s,
                t.push_s, t.wait_s, t.pull_s, t.commit_latency_s, t.wall_s);
    rows.push_back({{"round", t.round},
                    {"compute_s", t.compute_s},
                    {"boundary_s", t.boundary_s},
                    {"blocked_s", t.blocked_s},
                    {"blocked_wan_s", t.blocked_wan_s},
                    {"push_s", t.push_s},
                    {"wait_s", t.wait_s},
                    {"pull_s", t.pull_s},
                    {"wall_s", t.wall_s},
                    {"commit_latency_s", t.commit_latency_s}});
  }
  auto sum = wanload::Summarize(*timings, static_cast<size_t>(std::max(0, skip)));
  std::printf(
      "rounds %zu-%zu: computing %.1f%% of wall time (%.1f s of %.1f s), utilisation %.1f%% "
      "(not waiting for the WAN); round boundary %.2f s (blocked %.2f s, of which on the WAN "
      "%.2f s); push %.2f s, WAN wait %.2f s (in %zu rounds), pull %.2f s%s; commit "
      "latency mean %.2f s, max %.2f s; last round drained in %.2f s\n",
      static_cast<size_t>(skip) + 1, timings->size(), 100 * sum.compute_fraction, sum.compute_s,
      sum.wall_s, 100 * sum.utilisation, sum.boundary_s, sum.blocked_s, sum.blocked_wan_s,
      sum.push_s, sum.wait_s, sum.rounds_waited, sum.pull_s, overlap ? " (in the background)" : "",
      sum.mean_commit_latency_s, sum.max_commit_latency_s, site.drain_s());
  if (const auto* rs = site.replay_stats()) {
    std::printf(
        "pulls by replay: %llu (%llu of the whole state), %llu rounds replayed, %llu digest "
        "mismatches, checked %llu times by the fast check and %llu by the digest, %.1f MB "
        "received; request %.2f s, replay (with the check) %.2f s, "
        "serve %.2f s in all (%llu served with this site's uncommitted rounds on a copy)\n",
        static_cast<unsigned long long>(rs->pulls),
        static_cast<unsigned long long>(rs->whole_pulls),
        static_cast<unsigned long long>(rs->rounds_replayed),
        static_cast<unsigned long long>(rs->digest_mismatches),
        static_cast<unsigned long long>(rs->fast_checks),
        static_cast<unsigned long long>(rs->digest_checks), rs->payload_bytes / 1e6, rs->request_s,
        rs->replay_s, rs->serve_s, static_cast<unsigned long long>(rs->view_pulls));
  }
  std::printf("pushed %.1f MB for %.1f MB of fp32 deltas (%s)\n", site.site()->pushed_bytes() / 1e6,
              site.site()->pushed_raw_bytes() / 1e6, encode_threads > 0 ? "encoded here" : "fp32");
  if (!json_path.empty()) {
    nlohmann::json j = {{"site", client_name},
                        {"round_seconds", round_seconds},
                        {"overlap", overlap},
                        {"pull_by_replay", pull_by_replay},
                        {"encode_threads", encode_threads},
                        {"pushed_bytes", site.site()->pushed_bytes()},
                        {"pushed_raw_bytes", site.site()->pushed_raw_bytes()},
                        {"steps_per_round", steps_per_round},
                        {"drain_s", site.drain_s()},
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
                          {"boundary_s", sum.boundary_s},
                          {"blocked_s", sum.blocked_s},
                          {"blocked_wan_s", sum.blocked_wan_s},
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
