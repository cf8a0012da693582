// Every tunable of isthmus-server, declared once: a field of ServerConfig below, whose
// initial value is its default, bound in config.cc's table to its key, type, range and one
// line of documentation. A setting's TOML key, command-line flag and environment variable
// map onto it one to one:
//   TOML  [storage] sync_writes = true
//   flag  --storage.sync_writes=true
//   env   ISTHMUS_STORAGE_SYNC_WRITES=true
// Precedence: default < config file < environment < flag. docs/CONFIG.md is generated
// from the table (`isthmus-server --print-config-doc`) and a test keeps them in step.
//
// This library needs no database and no sockets: isthmusctl links it to check a shard's
// configuration exactly as the server does (fleet init).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "server/config/sync_options.h"

namespace isthmus {

struct ServerConfig {
  std::string shard_id = "shard0";
  int64_t shard_index = -1;  // position in the site's shard list; -1: not checked
  std::string data_dir;
  std::string listen_worker = "tcp://127.0.0.1:7100";
  std::string listen_admin = "tcp://127.0.0.1:7101";
  std::string listen_metrics;  // HOST:PORT of the Prometheus endpoint; empty: off
  std::string secret_key;
  std::vector<std::string> worker_keys;
  std::vector<std::string> admin_keys;
  std::vector<std::string> peer_keys;
  bool insecure_plaintext = false;
  int64_t max_message_bytes = int64_t{1} << 30;
  int64_t max_header_bytes = int64_t{1} << 20;
  int64_t max_tensors = 100000;
  bool sync_writes = true;
  bool direct_writes = true;
  int64_t dedup_window = 65536;
  int64_t push_part_bytes = int64_t{1} << 20;
  int64_t synced_push_part_bytes = 0;
  int64_t min_free_bytes = int64_t{64} << 20;
  int64_t io_threads = 2;
  std::string log_level = "info";
  // Cross-site sync (docs/SYNC.md). The round protocol's own options; sync.site turns it
  // on. `sync.peer_sites` is not a setting: it is filled from sync_peers.
  std::string listen_peer;
  SyncOptions sync;
  std::vector<std::string> sync_peers;  // "SITE=ENDPOINT=PUBKEYFILE"
  // The peer links' timing (server/sync/peer_link.h, PeerLinkOptions).
  std::string sync_dial = "auto";  // auto | always | never (PeerDial)
  int64_t sync_ack_delay_ms = 5000;
  int64_t sync_remove_silent_after_s = 0;
  int64_t sync_resend_ms = 2000;
  int64_t sync_backoff_max_ms = 10000;
  // Attach jobs created without sync.site at this start (docs/SYNC.md); false: refuse to
  // start while such a job exists.
  bool sync_convert_plain_jobs = false;
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
  std::string default_value;  // as text (from ServerConfig's initial values); lists comma-separated
  std::string doc;
  // The values a number may take, as the docs print it ("[1, 64]", "(0, 100]"); empty for
  // settings without a range. The loader refuses a value outside it, naming the key, the
  // range and where the value came from (config file, environment variable or flag).
  std::string range;
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

// Checks every setting's range (as the loader does), the names (shard.id, sync.site and the
// sites of sync.peers: common/names.h), the endpoints (listen.worker, listen.admin,
// listen.peer, sync.peers: tcp://HOST:PORT with PORT 1-65535, or ipc://PATH), required
// settings and combinations, including the round protocol's options as the sync engine
// will (NormalizeSyncOptions); says what to set.
Status ValidateServerConfig(const ServerConfig& config);

// The round-protocol options of a validated config, peers filled in and normalised;
// nullopt when sync is off (sync.site empty).
std::optional<SyncOptions> SyncOptionsFrom(const ServerConfig& config);

// Markdown table of every setting (docs/CONFIG.md).
std::string ServerConfigDoc();

}  // namespace isthmus
