// The round protocol options' one check (see sync_options.h).
#include "server/config/sync_options.h"

#include <set>

#include "common/names.h"
#include "ops/codec.h"

namespace isthmus {

Status NormalizeSyncOptions(SyncOptions& options) {
  if (options.site.empty()) return Status::InvalidArgument("sync.site is not set");
  if (!IsValidSiteName(options.site)) {
    return Status::InvalidArgument("sync.site '" + PrintableName(options.site) +
                                   "' is not a site name: " + SiteNameRule());
  }
  std::set<std::string> seen{options.site};
  for (const auto& p : options.peer_sites) {
    if (!IsValidSiteName(p)) {
      return Status::InvalidArgument("peer site '" + PrintableName(p) +
                                     "' (sync.peers) is not a site name: " + SiteNameRule());
    }
    if (!seen.insert(p).second) {
      return Status::InvalidArgument("site '" + p +
                                     "' is listed twice (or is this site) in sync.peers");
    }
  }
  if (!(options.outer_lr > 0 && options.outer_lr <= kMaxOuterLr)) {  // NaN fails too
    return Status::InvalidArgument("sync.outer_lr must be in (0, " +
                                   std::to_string(static_cast<int>(kMaxOuterLr)) + "]");
  }
  if (!(options.outer_momentum >= 0 && options.outer_momentum < 1)) {
    return Status::InvalidArgument("sync.outer_momentum must be in [0, 1)");
  }
  if (!(options.adaptive_share > 0 && options.adaptive_share <= 1)) {
    return Status::InvalidArgument("sync.adaptive_share must be in (0, 1]");
  }
  if (!(options.adaptive_start_mbit >= 0 && options.adaptive_start_mbit <= 1e6)) {
    return Status::InvalidArgument("sync.adaptive_start_mbit must be in [0, 1000000]");
  }
  if (options.fragments < 1 || options.fragments > kMaxFragments) {
    return Status::InvalidArgument("sync.fragments must be in [1, " +
                                   std::to_string(kMaxFragments) + "]");
  }
  if (options.max_rounds_ahead > kMaxRoundsAheadLimit) {
    return Status::InvalidArgument("sync.max_rounds_ahead must be in [0, " +
                                   std::to_string(kMaxRoundsAheadLimit) + "]");
  }
  if (options.replay_rounds > kMaxReplayRounds) {
    return Status::InvalidArgument("sync.replay_rounds must be in [0, " +
                                   std::to_string(kMaxReplayRounds) + "]");
  }
  if (options.checkpoint_rounds < 1 || options.checkpoint_rounds > kMaxCheckpointRounds) {
    return Status::InvalidArgument("sync.checkpoint_rounds must be in [1, " +
                                   std::to_string(kMaxCheckpointRounds) + "]");
  }
  if (options.encode_threads < 1 || options.encode_threads > kMaxEncodeThreads) {
    return Status::InvalidArgument("sync.encode_threads must be in [1, " +
                                   std::to_string(kMaxEncodeThreads) + "]");
  }
  if (options.change_timeout_s < 1 || options.change_timeout_s > 30 * 86400) {
    return Status::InvalidArgument("sync.change_timeout_s must be in [1, 2592000] (seconds)");
  }
  if (options.codec.empty()) options.codec = std::string(codec::kDefaultPipeline);
  std::vector<std::string> texts{options.codec};
  for (const auto& o : options.codec_overrides) {
    auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0) {
      return Status::InvalidArgument("sync.codec_overrides entry '" + o + "' is not GLOB=PIPELINE");
    }
    texts.push_back(o.substr(eq + 1));
  }
  if (options.adaptive_floor.empty()) {
    options.adaptive_floor = codec::ToString(codec::AdaptiveLadder().back());
  }
  texts.push_back(options.adaptive_floor);
  if (!options.adaptive_ceiling.empty()) texts.push_back(options.adaptive_ceiling);
  for (const auto& t : texts) {
    auto p = codec::ParsePipeline(t);
    if (!p.ok()) {
      return Status::InvalidArgument("codec pipeline '" + t + "': " + p.status().message());
    }
  }
  return Status::Ok();
}

}  // namespace isthmus
