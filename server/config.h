// Every tunable of isthmus-server, declared once (key, default, one line of
// documentation). A setting's TOML key, command-line flag and environment variable map
// onto it one to one:
//   TOML  [storage] sync_writes = true
//   flag  --storage.sync_writes=true
//   env   ISTHMUS_STORAGE_SYNC_WRITES=true
// Precedence: default < config file < environment < flag. docs/CONFIG.md is generated
// from this table (`isthmus-server --print-config-doc`) and a test keeps them in step.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "server/sync_engine.h"

namespace isthmus {

struct ServerConfig {
  std::string shard_id;
  int64_t shard_index = -1;  // position in the site's shard list; -1: not checked
  std::string data_dir;
  std::string listen_worker;
  std::string listen_admin;
  std::string listen_metrics;  // HOST:PORT of the Prometheus endpoint; empty: off
  std::string secret_key;
  std::vector<std::string> worker_keys;
  std::vector<std::string> admin_keys;
  std::vector<std::string> peer_keys;
  bool insecure_plaintext = false;
  int64_t max_message_bytes = 0;
  int64_t max_header_bytes = 0;
  int64_t max_tensors = 0;
  bool sync_writes = true;
  int64_t dedup_window = 0;
  int64_t io_threads = 0;
  std::string log_level;
  // Cross-site sync (docs/SYNC.md).
  std::string listen_peer;
  std::string sync_site;
  std::vector<std::string> sync_peers;  // "SITE=ENDPOINT=PUBKEYFILE"
  std::string sync_codec;
  std::vector<std::string> sync_codec_overrides;  // "GLOB=PIPELINE"
  bool sync_adaptive = false;
  std::string sync_adaptive_floor;
  std::string sync_adaptive_ceiling;
  double sync_outer_lr = 1.0;
  double sync_outer_momentum = 0.0;
  int64_t sync_fragments = 1;
  int64_t sync_max_rounds_ahead = 2;
  std::string sync_dial = "auto";  // auto | always | never (server/peer_link.h, PeerDial)
  int64_t sync_ack_delay_ms = 5000;
  int64_t sync_remove_silent_after_s = 0;
  int64_t sync_resend_ms = 2000;
  int64_t sync_backoff_max_ms = 10000;
};

// One entry of sync.peers: the same-numbered shard of another site.
struct PeerSpec {
  std::string site;
  std::string endpoint;
  std::string public_key_file;
};

// Parses "SITE=ENDPOINT=PUBKEYFILE" entries (split at the first two '='). InvalidArgument
// naming the entry when a part is empty or a site repeats.
Result<std::vector<PeerSpec>> ParsePeerSpecs(const std::vector<std::string>& entries);

enum class SettingType { kString, kStringList, kBool, kInt, kDouble };

struct SettingInfo {
  std::string key;  // "section.name"
  SettingType type;
  std::string default_value;  // as text; lists comma-separated
  std::string doc;
};

// The table of settings, in documentation order.
const std::vector<SettingInfo>& ServerSettings();

// Flag name and environment variable of a key.
std::string SettingFlag(const std::string& key);
std::string SettingEnv(const std::string& key);

// Builds the config: defaults, then `config_file` (TOML; empty = none), then environment,
// then `overrides` (key -> text value, from flags). Unknown keys in the file are errors.
Result<ServerConfig> LoadServerConfig(const std::string& config_file,
                                      const std::map<std::string, std::string>& overrides);

// Checks required settings and combinations; says what to set.
Status ValidateServerConfig(const ServerConfig& config);

// The round-protocol options of a validated config; nullopt when sync is off
// (sync.site empty).
std::optional<SyncOptions> SyncOptionsFrom(const ServerConfig& config);

// Markdown table of every setting (docs/CONFIG.md).
std::string ServerConfigDoc();

}  // namespace isthmus
