// The round protocol's options (docs/SYNC.md), declared once: the server's settings table
// (config.h) binds its sync.* keys to these fields, and their initial values below are the
// defaults that table prints. The sync engine takes a copy.
//
// Plain data plus two hooks; no storage, no sockets, so isthmusctl can check a shard's
// sync settings exactly as the server would without linking the engine.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"

namespace isthmus {

// Bounds of the options below, declared once: the settings table (config.cc) gives them as
// the settings' ranges and NormalizeSyncOptions checks them for options built in code.
inline constexpr double kMaxOuterLr = 100.0;           // outer_lr in (0, kMaxOuterLr]
inline constexpr uint32_t kMaxFragments = 1024;        // fragments in [1, kMaxFragments]
inline constexpr uint64_t kMaxRoundsAheadLimit = 256;  // max_rounds_ahead in [0, this]
inline constexpr uint64_t kMaxReplayRounds = 256;      // replay_rounds in [0, this]
inline constexpr uint64_t kMaxCheckpointRounds = 256;  // checkpoint_rounds in [1, this]
inline constexpr uint32_t kMaxEncodeThreads = 64;      // encode_threads in [1, this]

struct SyncOptions {
  std::string site;                     // this site's name; required
  std::vector<std::string> peer_sites;  // the other sites; empty = commit on close
  // Codec pipeline text for every tensor (empty: the codec's default pipeline).
  std::string codec;
  // "glob=pipeline" entries (fnmatch globs on tensor names); the first match wins.
  std::vector<std::string> codec_overrides;
  // Adaptive mode: size each round's encoding to the slowest link, within floor/ceiling.
  // On by default: a round uses `codec` while its transfer fits the round's compute time
  // and goes coarser only when it would not (the full model over a slow link).
  bool adaptive = true;
  std::string adaptive_floor;  // coarsest pipeline allowed (empty: the ladder's coarsest)
  // Finest pipeline allowed. Empty: `codec` (and its overrides) whenever its estimated size
  // fits the round's budget, ladder rungs coarser than it otherwise.
  std::string adaptive_ceiling;
  // The share of a round's compute time one round's transfer may take on the slowest link:
  // the rest is left for the commit, the pull and the link's ups and downs (with overlap and
  // K = 1, a round's commit must come back within one round).
  double adaptive_share = 0.8;
  // The link bandwidth, in Mbit/s, a round is sized for while a member peer's link has not
  // been measured yet (a job's first rounds, until a peer acknowledged a delta), instead of
  // sending `codec` whatever its size; 0: `codec` until measured.
  double adaptive_start_mbit = 10;
  double outer_lr = 1.25;
  double outer_momentum = 0.6;
  // Streaming: the job's tensors fall into this many fragments of about equal size
  // (AssignFragments); round r sends fragment (r - 1) % fragments and defers the others
  // (codec "defer": their deltas wait in the error-feedback residual), so each fragment
  // crosses the WAN every `fragments` rounds and a round carries 1/fragments of the model.
  // 1 = every tensor every round.
  uint32_t fragments = 1;
  // K: workers wait while local - committed > K (0: synchronous rounds, each commits first)
  uint64_t max_rounds_ahead = 1;
  // Committed rounds whose encoded deltas (every site's) stay in the store after the commit,
  // so that a worker holding the state of one of them pulls the rounds since as encoded
  // deltas and replays them (docs/SYNC.md, "Pulling by replay"); older ones go. 0: deltas go
  // at the commit (as soon as every peer holds this site's), and a replaying worker pulls
  // the whole state whenever it is a round behind.
  uint64_t replay_rounds = 4;
  // A commit writes the committed state (theta, outer momentum) to the store when this many
  // rounds have committed since it was last written, and a close the error-feedback
  // residuals when this many have closed since; between, every site's deltas since the
  // written state and the staged deltas since the written residuals stay, from which a start
  // rebuilds both (the state checked against each round's digest). 1: every commit and
  // close writes them.
  uint64_t checkpoint_rounds = 4;
  // Hard cap on local - committed (bounds disk and memory); 0 = 4 * K + 8.
  uint64_t hard_cap_rounds = 0;
  // Threads that encode a closing round's tensors (one tensor per thread at a time, the
  // event loop's thread among them); the bytes do not depend on it. The default suits the
  // 2-core development machine.
  uint32_t encode_threads = 2;
  // A membership change this site coordinates that makes no progress (no site agrees, a
  // joining site fetches nothing) for this long is given up, so it does not hold commits.
  uint64_t change_timeout_s = 300;
  // Write the state of a checkpoint commit (sync.checkpoint_rounds) on a thread of its own
  // after the commit is published, instead of in the commit's batch: the commit (and the
  // pulls waiting for it) no longer waits for the 0.7 GB of full mode's theta and momentum
  // to reach the disk. The record names the new state only once its rows are durable; a
  // crash before rebuilds it from the rounds' deltas, as between checkpoints. The server
  // turns it on; engine tests that read the rows right after a commit leave it off.
  bool background_state_writes = false;
  // Clock for round durations (adaptive sizing); tests replace it.
  std::function<std::chrono::steady_clock::time_point()> now = &std::chrono::steady_clock::now;
  // Called (event-loop thread) after a round this site closed has committed, with the
  // seconds from its close to its commit: the wait for every member's delta plus the merge
  // (the commit latency of docs/METRICS.md). Rounds closed before a restart are not timed.
  std::function<void(const std::string& job, uint64_t round, double seconds)> on_commit;
};

// Checks `options` as the engine needs them and fills in what an empty field means: site
// set, it and every peer a valid site name (IsValidSiteName, common/names.h), peers
// distinct from it and from each other, every pipeline parses (codec, overrides, floor,
// ceiling), outer lr in (0, kMaxOuterLr], momentum in [0, 1), fragments in
// [1, kMaxFragments], K at most kMaxRoundsAheadLimit, encode_threads in [1,
// kMaxEncodeThreads]. InvalidArgument naming the setting
// (sync.codec, ...) and what to change.
Status NormalizeSyncOptions(SyncOptions& options);

}  // namespace isthmus
