// The settings table and the loaders that map TOML keys, flags and environment variables
// onto it.
#include "server/config/config.h"

#include <toml.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <concepts>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <set>
#include <sstream>
#include <string_view>
#include <type_traits>
#include <utility>

#include "common/check.h"
#include "common/metrics.h"
#include "common/names.h"

namespace isthmus {
namespace {

// The values a numeric setting may take: both bounds included unless marked open. Bounds
// are doubles; every bound below is exact in a double (at most 2^53).
struct Range {
  double min;
  double max;
  bool min_open = false;  // (min, ...: min itself is refused
  bool max_open = false;  // ..., max): max itself is refused
};

// A setting bound to its ServerConfig field. Bind() takes the field as a generic lambda
// ([](auto& c) -> auto& { return c.x; }), so one accessor serves reads (the default's text,
// from ServerConfig{}) and writes (parsing a value), and the field's type picks the parser.
// A numeric setting may have a Range: values from the file, the environment and flags are
// checked against it as they are parsed (naming where they came from), and
// ValidateServerConfig checks it again for configs built in code.
struct Binding {
  SettingInfo info;
  std::function<Status(ServerConfig&, const std::string& text, const std::string& origin)> set;
  std::function<std::string(const ServerConfig&)> text;
  std::function<Status(const ServerConfig&)> check;  // the range; Ok without one
};

std::vector<std::string> SplitList(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    auto a = item.find_first_not_of(" \t");
    auto b = item.find_last_not_of(" \t");
    if (a != std::string::npos) out.push_back(item.substr(a, b - a + 1));
  }
  return out;
}

std::string ToText(const std::string& v) { return v; }
std::string ToText(const std::vector<std::string>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + v[i];
  return out;
}
std::string ToText(bool v) { return v ? "true" : "false"; }
// The shortest text that reads back as `v` (0.6, not 0.59999999999999998).
std::string ToText(double v) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  std::string s = ec == std::errc() ? std::string(buf, end) : std::to_string(v);
  if (s.find_first_of(".e") == std::string::npos && std::isfinite(v)) s += ".0";
  return s;
}
template <std::integral T>
std::string ToText(T v) {
  return std::to_string(v);
}

template <typename T>
constexpr SettingType TypeOf() {
  if constexpr (std::is_same_v<T, std::string>) return SettingType::kString;
  if constexpr (std::is_same_v<T, std::vector<std::string>>) return SettingType::kStringList;
  if constexpr (std::is_same_v<T, bool>) return SettingType::kBool;
  if constexpr (std::is_same_v<T, double>) return SettingType::kDouble;
  return SettingType::kInt;
}

Status Parse(const std::string& text, std::string& out, const std::string&, const std::string&) {
  out = text;
  return Status::Ok();
}
Status Parse(const std::string& text, std::vector<std::string>& out, const std::string&,
             const std::string&) {
  out = SplitList(text);
  return Status::Ok();
}
Status Parse(const std::string& text, bool& out, const std::string& key,
             const std::string& origin) {
  if (text == "true" || text == "1" || text == "yes") {
    out = true;
  } else if (text == "false" || text == "0" || text == "no") {
    out = false;
  } else {
    return Status::InvalidArgument(origin + ": " + key + " must be true or false, not '" + text +
                                   "'");
  }
  return Status::Ok();
}
Status Parse(const std::string& text, double& out, const std::string& key,
             const std::string& origin) {
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(v)) {
    return Status::InvalidArgument(origin + ": " + key + " must be a number, not '" + text + "'");
  }
  out = v;
  return Status::Ok();
}
template <std::integral T>
Status Parse(const std::string& text, T& out, const std::string& key, const std::string& origin) {
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE) {
    return Status::InvalidArgument(origin + ": " + key + " must be an integer, not '" + text + "'");
  }
  if (!std::in_range<T>(v)) {
    return Status::InvalidArgument(origin + ": " + key + " must be an integer in [" +
                                   std::to_string(std::numeric_limits<T>::min()) + ", " +
                                   std::to_string(std::numeric_limits<T>::max()) + "], not '" +
                                   text + "'");
  }
  out = static_cast<T>(v);
  return Status::Ok();
}

// A bound as the docs print it: integers in full, other numbers in their shortest form.
std::string BoundText(double v) {
  if (v == std::floor(v) && std::fabs(v) <= 9007199254740992.0) {
    return std::to_string(static_cast<int64_t>(v));
  }
  std::ostringstream os;
  os << v;
  return os.str();
}

std::string RangeText(const Range& r) {
  return std::string(r.min_open ? "(" : "[") + BoundText(r.min) + ", " + BoundText(r.max) +
         (r.max_open ? ")" : "]");
}

bool InRange(double v, const Range& r) {
  return (r.min_open ? v > r.min : v >= r.min) && (r.max_open ? v < r.max : v <= r.max);
}

template <typename T>
using FieldType = std::decay_t<decltype(std::declval<T>()(std::declval<ServerConfig&>()))>;

template <typename F>
Binding Bind(std::string key, F field, std::string doc) {
  using T = FieldType<F>;
  Binding b;
  const ServerConfig defaults;
  b.info = SettingInfo{key, TypeOf<T>(), ToText(field(defaults)), std::move(doc), ""};
  b.set = [field, key](ServerConfig& c, const std::string& text, const std::string& origin) {
    return Parse(text, field(c), key, origin);
  };
  b.text = [field](const ServerConfig& c) { return ToText(field(c)); };
  b.check = [](const ServerConfig&) { return Status::Ok(); };
  return b;
}

// A numeric setting with the values it may take.
template <typename F>
requires(std::is_arithmetic_v<FieldType<F>> && !std::is_same_v<FieldType<F>, bool>) Binding
    Bind(std::string key, F field, std::string doc, Range range) {
  Binding b = Bind(key, field, std::move(doc));
  b.info.range = RangeText(range);
  b.set = [field, key, range](ServerConfig& c, const std::string& text,
                              const std::string& origin) -> Status {
    const auto refuse = [&] {
      return Status::InvalidArgument(origin + ": " + key + " must be in " + RangeText(range) +
                                     ", not '" + text + "'");
    };
    if (Status parsed = Parse(text, field(c), key, origin); !parsed.ok()) {
      // An integer too large for the field is out of range, not malformed.
      const size_t digits = text.find_first_not_of('-') == 1 ? 1 : 0;
      const bool integer =
          text.size() > digits && text.find_first_not_of("0123456789", digits) == std::string::npos;
      return integer ? refuse() : parsed;
    }
    if (!InRange(static_cast<double>(field(c)), range)) return refuse();
    return Status::Ok();
  };
  b.check = [field, key, range](const ServerConfig& c) -> Status {
    if (!InRange(static_cast<double>(field(c)), range)) {
      return Status::InvalidArgument(key + " is " + ToText(field(c)) + "; it must be in " +
                                     RangeText(range));
    }
    return Status::Ok();
  };
  const ServerConfig defaults;
  ISTHMUS_CHECK(InRange(static_cast<double>(field(defaults)), range),
                "the default of " + key + " is outside its range");
  return b;
}

const std::vector<Binding>& Bindings() {
  static const std::vector<Binding> kBindings = {
      Bind(
          "shard.id", [](auto& c) -> auto& { return c.shard_id; },
          "Name of this shard in logs and status (e.g. siteA-0): 1-128 characters of A-Z a-z 0-9 "
          ". _ -, not starting with '.'."),
      Bind(
          "shard.index", [](auto& c) -> auto& { return c.shard_index; },
          "This shard's position (0, 1, ...) in its site's shard list. When set, a peer link whose "
          "other end reports a different index is refused at the handshake (a sync.peers entry "
          "that "
          "points at the wrong shard). -1: not checked.",
          Range{-1, 65535}),
      Bind(
          "shard.data_dir", [](auto& c) -> auto& { return c.data_dir; },
          "Folder for the RocksDB database (db/) and snapshots (snapshots/). Required."),
      Bind(
          "listen.worker", [](auto& c) -> auto& { return c.listen_worker; },
          "ZeroMQ endpoint for workers (pull, push, hello): tcp://HOST:PORT (PORT 1-65535; HOST an "
          "address, a name, [IPv6] or * for every interface) or ipc://PATH."),
      Bind(
          "listen.admin", [](auto& c) -> auto& { return c.listen_admin; },
          "ZeroMQ endpoint for isthmusctl (jobs, stats, snapshots, export), as listen.worker."),
      Bind(
          "listen.metrics", [](auto& c) -> auto& { return c.listen_metrics; },
          "HOST:PORT where Prometheus metrics are served over plain HTTP at /metrics (docs/"
          "METRICS.md). Empty: off. Unauthenticated and unencrypted: bind it to loopback or a "
          "monitoring network only."),
      Bind(
          "security.secret_key", [](auto& c) -> auto& { return c.secret_key; },
          "This server's key pair file (mode 0600; make one with isthmusctl keygen). Required "
          "unless "
          "insecure_plaintext."),
      Bind(
          "security.worker_keys", [](auto& c) -> auto& { return c.worker_keys; },
          "Public key files or folders of *.pub files allowed on the worker socket."),
      Bind(
          "security.admin_keys", [](auto& c) -> auto& { return c.admin_keys; },
          "Public key files or folders allowed on the admin socket."),
      Bind(
          "security.peer_keys", [](auto& c) -> auto& { return c.peer_keys; },
          "Public key files or folders of peer shards (cross-site links)."),
      Bind(
          "security.insecure_plaintext", [](auto& c) -> auto& { return c.insecure_plaintext; },
          "Disable CURVE: no encryption, no authentication. For local benchmarks only; prints a "
          "warning."),
      Bind(
          "limits.max_message_bytes", [](auto& c) -> auto& { return c.max_message_bytes; },
          "Largest payload of one request or reply (bytes); larger requests get "
          "ResourceExhausted. Each socket's ZeroMQ maxmsgsize is this plus "
          "limits.max_header_bytes.",
          Range{1024, 1099511627776.0}),
      Bind(
          "limits.max_header_bytes", [](auto& c) -> auto& { return c.max_header_bytes; },
          "Largest header frame (bytes).", Range{1024, 1073741824}),
      Bind(
          "limits.max_tensors", [](auto& c) -> auto& { return c.max_tensors; },
          "Most tensors in one request.", Range{1, 16777216}),
      Bind(
          "storage.sync_writes", [](auto& c) -> auto& { return c.sync_writes; },
          "fsync RocksDB's write-ahead log before acknowledging a change. false: acknowledged "
          "changes survive a process crash but not a power loss."),
      Bind(
          "storage.direct_writes", [](auto& c) -> auto& { return c.direct_writes; },
          "With sync_writes, write large values' files (a full-mode checkpoint, large deltas) "
          "with O_DIRECT, past the page cache: no copy of every page into the kernel's cache, "
          "and here about three times the disk's buffered-and-synced rate (docs/ARCHITECTURE.md, "
          "Storage layout). A file system that refuses O_DIRECT gets buffered writes by itself. "
          "false: "
          "always through the page cache, synced the same way."),
      Bind(
          "storage.dedup_window", [](auto& c) -> auto& { return c.dedup_window; },
          "Idempotency keys remembered per job; a retry older than this many pushes is applied "
          "again.",
          Range{1, 4294967296.0}),
      Bind(
          "storage.push_part_bytes", [](auto& c) -> auto& { return c.push_part_bytes; },
          "Workers push a tensor of twice this many bytes or more to a job that does not sync "
          "across sites in parts of this size: the sender's encryption, the transfer, the "
          "receiver's decryption and the shard's sums and disk write overlap instead of "
          "following each other (docs/ARCHITECTURE.md, Wire protocol). 0: every push comes "
          "whole.",
          Range{0, 1073741824.0}),
      Bind(
          "storage.synced_push_part_bytes",
          [](auto& c) -> auto& { return c.synced_push_part_bytes; },
          "As storage.push_part_bytes, for a job that syncs across sites: the shard gathers the "
          "parts and hands the push to the round protocol at the last one. Off by default: on "
          "a full-mode round of GPT-2-small's size it did not help on 2 cores "
          "(docs/BENCHMARKS.md, section 1, Pushes in parts). 0: every push comes whole.",
          Range{0, 1073741824.0}),
      Bind(
          "storage.min_free_bytes", [](auto& c) -> auto& { return c.min_free_bytes; },
          "Free space the shard keeps on its data disk: a write that would leave less is refused "
          "(ResourceExhausted, counted in isthmus_store_write_refusals_total) instead of filling "
          "the disk, and a shard that starts with less opens its store read-only, serves pulls, "
          "and takes writes again by itself once space returns. Keep it above what RocksDB may "
          "flush at once: raise it to about a round's writes for full-model jobs (~700 MB for "
          "GPT-2-small's size). 0: no reserve.",
          Range{0, 1099511627776.0}),
      Bind(
          "runtime.io_threads", [](auto& c) -> auto& { return c.io_threads; },
          "ZeroMQ I/O threads (CURVE encryption runs on them).", Range{1, 64}),
      Bind(
          "log.level", [](auto& c) -> auto& { return c.log_level; },
          "trace, debug, info, warn, error or off."),
      Bind(
          "listen.peer", [](auto& c) -> auto& { return c.listen_peer; },
          "ZeroMQ endpoint for peer shards of other sites (cross-site sync), as listen.worker. "
          "Empty: no peer socket."),
      Bind(
          "sync.site", [](auto& c) -> auto& { return c.sync.site; },
          "This site's name (e.g. siteA): 1-64 characters of A-Z a-z 0-9 . _ -, not starting "
          "with '.'. Setting it turns on the round protocol (docs/SYNC.md); required when "
          "sync.peers is set."),
      Bind(
          "sync.peers", [](auto& c) -> auto& { return c.sync_peers; },
          "Peer shards, each SITE=ENDPOINT=PUBKEYFILE: the same-numbered shard of another site "
          "(SITE a site name as sync.site, ENDPOINT tcp://HOST:PORT or ipc://PATH)."),
      Bind(
          "sync.codec", [](auto& c) -> auto& { return c.sync.codec; },
          "Codec pipeline for round deltas (ops/codec.h syntax, e.g. topk:0.05+int4+zstd). Empty: "
          "int2:256+zstd (2-bit values, one scale per 256; docs/SYNC.md, \"Defaults\"). With "
          "sync.adaptive it is the finest pipeline a round uses."),
      Bind(
          "sync.codec_overrides", [](auto& c) -> auto& { return c.sync.codec_overrides; },
          "Per-tensor pipelines, each GLOB=PIPELINE on tensor names; the first match wins."),
      Bind(
          "sync.adaptive", [](auto& c) -> auto& { return c.sync.adaptive; },
          "Keep one round's transfer within one round's compute time on the slowest link: a round "
          "uses sync.codec while its size fits and a coarser pipeline of the adaptive ladder when "
          "it would not (docs/CODECS.md)."),
      Bind(
          "sync.adaptive_floor", [](auto& c) -> auto& { return c.sync.adaptive_floor; },
          "Coarsest pipeline adaptive mode may use. Empty: the ladder's coarsest, "
          "topk:0.001+int2+zstd."),
      Bind(
          "sync.adaptive_ceiling", [](auto& c) -> auto& { return c.sync.adaptive_ceiling; },
          "Finest pipeline adaptive mode may use, chosen from the ladder by size (e.g. dense). "
          "Empty: sync.codec and sync.codec_overrides as set, whenever they fit."),
      Bind(
          "sync.adaptive_share", [](auto& c) -> auto& { return c.sync.adaptive_share; },
          "With sync.adaptive: the share of a round's compute time that one round's transfer may "
          "take on the slowest link; the rest is left for the commit, the pull and the link's "
          "ups and downs (docs/SYNC.md, \"Adaptive sizing\").",
          Range{0, 1, true}),
      Bind(
          "sync.adaptive_start_mbit", [](auto& c) -> auto& { return c.sync.adaptive_start_mbit; },
          "With sync.adaptive: the site's WAN uplink in Mbit/s, shared evenly by the member "
          "peers' links, that a round is sized for until the link to every member peer has been "
          "measured (a job's first rounds), so they do not send sync.codec whatever its size "
          "(22 MB for GPT-2 small in full mode); 0: sync.codec until measured (docs/SYNC.md, "
          "\"Adaptive sizing\").",
          Range{0, 1e6}),
      Bind(
          "sync.outer_lr", [](auto& c) -> auto& { return c.sync.outer_lr; },
          "Outer learning rate applied to the merged round delta.", Range{0, kMaxOuterLr, true}),
      Bind(
          "sync.outer_momentum", [](auto& c) -> auto& { return c.sync.outer_momentum; },
          "Outer Nesterov momentum in [0, 1); 0: plain averaging. The default, with outer_lr "
          "1.25, is the best point of the loss-versus-bytes study (docs/BENCHMARKS.md, section "
          "8). Every site of a job must use the same value.",
          Range{0, 1, false, true}),
      Bind(
          "sync.fragments", [](auto& c) -> auto& { return c.sync.fragments; },
          "Stream the model in this many fragments of about equal size: round r sends fragment "
          "(r-1) "
          "mod N and the others wait in the error-feedback residual, so a round carries 1/N of the "
          "model (1: every tensor every round; all sites should agree).",
          Range{1, kMaxFragments}),
      Bind(
          "sync.max_rounds_ahead", [](auto& c) -> auto& { return c.sync.max_rounds_ahead; },
          "K: workers wait while their site is more than K rounds ahead of the last committed "
          "round. "
          "0: synchronous rounds (workers wait until each round has committed before the next, as "
          "DiLoCo does); larger K overlaps the WAN with compute.",
          Range{0, kMaxRoundsAheadLimit}),
      Bind(
          "sync.replay_rounds", [](auto& c) -> auto& { return c.sync.replay_rounds; },
          "Committed rounds whose encoded deltas stay after the commit, so that workers pull "
          "the rounds since the state they hold as encoded deltas and replay them instead of "
          "pulling every tensor (docs/SYNC.md, Pulling by replay). 0: a replaying worker "
          "pulls the whole state whenever it is a round behind.",
          Range{0, kMaxReplayRounds}),
      Bind(
          "sync.checkpoint_rounds", [](auto& c) -> auto& { return c.sync.checkpoint_rounds; },
          "A commit writes the committed state (tensors and outer momentum) to the store once "
          "this many rounds have committed since it was last written, and a close the "
          "error-feedback residuals once this many rounds have closed; between, the rounds' "
          "deltas and staged deltas stay, from which a start rebuilds both, checked against "
          "each round's digest (docs/SYNC.md, Checkpointed state). 1: every commit and close "
          "writes them.",
          Range{1, kMaxCheckpointRounds}),
      Bind(
          "sync.encode_threads", [](auto& c) -> auto& { return c.sync.encode_threads; },
          "Threads that encode a closing round's tensors with error feedback (top-k, "
          "quantisation, zstd), one tensor per thread at a time, the shard's loop among them. "
          "The encoded bytes are the same for any value.",
          Range{1, kMaxEncodeThreads}),
      Bind(
          "sync.change_timeout_s", [](auto& c) -> auto& { return c.sync.change_timeout_s; },
          "A membership change this site coordinates (a removal, a leave, a site's addition) is "
          "given up when it makes no progress for this many seconds: no site it asks agrees, a "
          "joining site fetches nothing. It holds this site's commits meanwhile (docs/SYNC.md, "
          "Membership).",
          Range{1, 2592000}),
      Bind(
          "sync.dial", [](auto& c) -> auto& { return c.sync_dial; },
          "Which side of each peer pair opens the one connection they share: auto (the site whose "
          "name sorts first), always (this site dials every peer: the peers cannot reach it), "
          "never "
          "(it only listens: it cannot reach them)."),
      Bind(
          "sync.ack_delay_ms", [](auto& c) -> auto& { return c.sync_ack_delay_ms; },
          "How long a peer may hold its acknowledgement of this site's delta to carry it in its "
          "own "
          "next delta instead of a message of its own (0: acknowledge at once). Also added to the "
          "time before an unacknowledged delta is sent again.",
          Range{0, 60000}),
      Bind(
          "sync.remove_silent_after_s",
          [](auto& c) -> auto& { return c.sync_remove_silent_after_s; },
          "Automatic removal, for jobs of three or more member sites: when members have sent "
          "nothing for this many seconds, the first-named of the other members proposes removing "
          "them from the next round; the change needs the remaining members to be a majority and "
          "every one of them to agree (docs/SYNC.md, Membership). At least twice "
          "sync.backoff_max_ms (a live idle peer is heard once per keep-alive interval). 0: "
          "never. Two sites are never removed automatically.",
          Range{0, 2592000}),
      Bind(
          "sync.resend_ms", [](auto& c) -> auto& { return c.sync_resend_ms; },
          "Resend unacknowledged deltas to a peer after this many milliseconds.",
          Range{10, 3600000}),
      Bind(
          "sync.backoff_max_ms", [](auto& c) -> auto& { return c.sync_backoff_max_ms; },
          "Longest wait between reconnection attempts to a peer (milliseconds); also how often an "
          "idle peer link sends its keep-alive.",
          Range{10, 3600000}),
      Bind(
          "sync.convert_plain_jobs", [](auto& c) -> auto& { return c.sync_convert_plain_jobs; },
          "Turn the jobs this shard holds that were created without sync.site (plain jobs) into "
          "jobs of the round protocol at this start: their current tensors become round 0. "
          "false: a shard with sync.site that finds such a job refuses to start (exit 2) and names "
          "it (docs/SYNC.md, \"Jobs created without sync\"). A converted job stays converted."),
  };
  return kBindings;
}

const Binding* FindBinding(const std::string& key) {
  for (const auto& b : Bindings()) {
    if (b.info.key == key) return &b;
  }
  return nullptr;
}

}  // namespace

const std::vector<SettingInfo>& ServerSettings() {
  static const std::vector<SettingInfo> kInfos = [] {
    std::vector<SettingInfo> v;
    for (const auto& b : Bindings()) v.push_back(b.info);
    return v;
  }();
  return kInfos;
}

std::string SettingFlag(const std::string& key) { return "--" + key; }

std::string SettingEnv(const std::string& key) {
  std::string env = "ISTHMUS_";
  for (char c : key) env.push_back(c == '.' ? '_' : static_cast<char>(std::toupper(c)));
  return env;
}

namespace {

// Offset of the first byte that does not belong to a well-formed UTF-8 sequence (no
// overlong forms, surrogates or code points above U+10FFFF), or npos.
size_t FirstInvalidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return i;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t k = 1; k < n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 0x2) return i;
      cp = (cp << 6) | (cc & 0x3F);
    }
    const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += n;
  }
  return std::string_view::npos;
}

// Calls on_bare(i) for every index of TOML `text` outside strings and comments.
template <typename F>
void VisitBare(std::string_view text, F&& on_bare) {
  char quote = 0;
  bool comment = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (comment) {
      comment = c != '\n';
    } else if (quote != 0) {
      if (c == '\\' && quote == '"') {
        ++i;  // an escaped character
      } else if (c == quote) {
        quote = 0;
      }
    } else if (c == '"' || c == '\'') {
      quote = c;
    } else if (c == '#') {
      comment = true;
    } else {
      on_bare(i);
    }
  }
}

// The deepest nesting of arrays and inline tables in TOML `text` (brackets and braces
// outside strings and comments). toml11 parses nesting by recursion.
int NestingDepth(std::string_view text) {
  int depth = 0, deepest = 0;
  VisitBare(text, [&](size_t i) {
    if (text[i] == '[' || text[i] == '{') {
      deepest = std::max(deepest, ++depth);
    } else if ((text[i] == ']' || text[i] == '}') && depth > 0) {
      --depth;
    }
  });
  return deepest;
}

// Offset of the first binary integer literal (0b...) of more than 62 digits, or npos.
size_t FirstLongBinaryInteger(std::string_view text) {
  size_t found = std::string::npos;
  VisitBare(text, [&](size_t i) {
    if (found != std::string::npos || text[i] != '0' || i + 1 >= text.size() ||
        text[i + 1] != 'b') {
      return;
    }
    if (i > 0 && (std::isalnum(static_cast<unsigned char>(text[i - 1])) || text[i - 1] == '_' ||
                  text[i - 1] == '-' || text[i - 1] == '.')) {
      return;  // inside a bare key or another token
    }
    size_t digits = 0;
    for (size_t j = i + 2; j < text.size() && (text[j] == '0' || text[j] == '1' || text[j] == '_');
         ++j) {
      digits += text[j] != '_';
    }
    if (digits > 62) found = i;
  });
  return found;
}

}  // namespace

Result<ServerConfig> LoadServerConfig(const std::string& config_file,
                                      const std::map<std::string, std::string>& overrides) {
  ServerConfig cfg;  // the defaults
  if (!config_file.empty()) {
    std::ifstream in(config_file, std::ios::binary);
    if (!in) return Status::InvalidArgument("cannot read config file '" + config_file + "'");
    std::string text((std::istreambuf_iterator<char>(in)), {});
    // TOML is UTF-8; toml11 reads past the end of some invalid sequences (found by
    // fuzzing), so they never reach it.
    if (const size_t bad = FirstInvalidUtf8(text); bad != std::string::npos) {
      return Status::InvalidArgument("config file '" + config_file + "' is not valid UTF-8 (byte " +
                                     std::to_string(bad) + ")");
    }
    // toml11 recurses once per nesting level: deep nesting (found by fuzzing) overflows the
    // stack. No setting nests more than two levels.
    constexpr int kMaxNesting = 32;
    if (NestingDepth(text) > kMaxNesting) {
      return Status::InvalidArgument("config file '" + config_file + "' nests arrays or tables " +
                                     "deeper than " + std::to_string(kMaxNesting) + " levels");
    }
    // toml11 doubles a signed 64-bit place value per binary digit: 63 or more digits
    // overflow it (found by fuzzing).
    if (const size_t at = FirstLongBinaryInteger(text); at != std::string::npos) {
      return Status::InvalidArgument("config file '" + config_file +
                                     "' has a binary integer of more than 62 digits (byte " +
                                     std::to_string(at) + ")");
    }
    toml::value root;
    try {
      std::istringstream is(text);
      root = toml::parse(is, config_file);
    } catch (const std::exception& e) {
      return Status::InvalidArgument("cannot read config file '" + config_file + "': " + e.what());
    }
    if (!root.is_table()) return Status::InvalidArgument("config file is not a TOML table");
    for (const auto& [section, table] : root.as_table()) {
      if (!table.is_table()) {
        return Status::InvalidArgument(config_file + ": top-level key '" + section +
                                       "' must be a [section]");
      }
      for (const auto& [name, value] : table.as_table()) {
        std::string key = section + "." + name;
        const Binding* b = FindBinding(key);
        if (b == nullptr) {
          return Status::InvalidArgument(config_file + ": unknown setting '" + key +
                                         "' (see docs/CONFIG.md)");
        }
        std::string text;
        try {
          switch (b->info.type) {
            case SettingType::kString:
              text = toml::get<std::string>(value);
              break;
            case SettingType::kBool:
              text = toml::get<bool>(value) ? "true" : "false";
              break;
            case SettingType::kInt:
              text = std::to_string(toml::get<int64_t>(value));
              break;
            case SettingType::kDouble:
              text = ToText(value.is_integer() ? static_cast<double>(toml::get<int64_t>(value))
                                               : toml::get<double>(value));
              break;
            case SettingType::kStringList: {
              auto items = toml::get<std::vector<std::string>>(value);
              for (size_t i = 0; i < items.size(); ++i) text += (i ? "," : "") + items[i];
              break;
            }
          }
        } catch (const std::exception&) {
          return Status::InvalidArgument(config_file + ": setting '" + key +
                                         "' has the wrong type");
        }
        ISTHMUS_RETURN_IF_ERROR(b->set(cfg, text, config_file));
      }
    }
  }
  for (const auto& b : Bindings()) {
    if (const char* v = std::getenv(SettingEnv(b.info.key).c_str())) {
      ISTHMUS_RETURN_IF_ERROR(b.set(cfg, v, SettingEnv(b.info.key)));
    }
  }
  for (const auto& [key, text] : overrides) {
    const Binding* b = FindBinding(key);
    if (b == nullptr) return Status::InvalidArgument("unknown setting '" + key + "'");
    ISTHMUS_RETURN_IF_ERROR(b->set(cfg, text, SettingFlag(key)));
  }
  return cfg;
}

namespace {

// tcp://HOST:PORT with PORT in 1-65535 and HOST non-empty (an address, a name, [IPv6] or
// *), or ipc://PATH. inproc:// reaches only sockets of the same process: not a server's.
Status CheckEndpoint(const std::string& endpoint, const std::string& what) {
  auto bad = [&](const std::string& why) {
    return Status::InvalidArgument(
        what + " '" + PrintableName(endpoint) + "': " + why +
        " (expected tcp://HOST:PORT with PORT 1-65535, e.g. tcp://10.0.0.1:7100, or ipc://PATH)");
  };
  for (char ch : endpoint) {
    if (static_cast<unsigned char>(ch) <= 0x20 || ch == 0x7f) {
      return bad("it holds a space or a control character");
    }
  }
  if (endpoint.rfind("ipc://", 0) == 0) {
    if (endpoint.size() == 6) return bad("no path");
    return Status::Ok();
  }
  if (endpoint.rfind("tcp://", 0) != 0) return bad("not a tcp:// or ipc:// endpoint");
  const std::string rest = endpoint.substr(6);
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0) return bad("no HOST:PORT");
  const std::string host = rest.substr(0, colon), port = rest.substr(colon + 1);
  if (host.front() == '[' ? host.back() != ']' || host.size() < 3
                          : host.find_first_of("[]:") != std::string::npos) {
    return bad("an IPv6 host needs brackets, e.g. tcp://[::1]:7100");
  }
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string::npos) {
    return bad("the port '" + port + "' is not a number");
  }
  if (const int p = std::stoi(port); p < 1 || p > 65535) {
    return bad("the port " + port + " is not in 1-65535");
  }
  return Status::Ok();
}

}  // namespace

Status ValidateServerConfig(const ServerConfig& c) {
  for (const auto& b : Bindings()) ISTHMUS_RETURN_IF_ERROR(b.check(c));
  if (!IsValidShardId(c.shard_id)) {
    return Status::InvalidArgument("shard.id '" + PrintableName(c.shard_id) +
                                   "' is not a shard id: " + ShardIdRule());
  }
  if (c.data_dir.empty()) {
    return Status::InvalidArgument(
        "shard.data_dir is not set (use --shard.data_dir=DIR or [shard] data_dir in the config "
        "file)");
  }
  if (!c.insecure_plaintext && c.secret_key.empty()) {
    return Status::InvalidArgument(
        "security.secret_key is not set: make a key pair with `isthmusctl keygen --out PREFIX` and "
        "pass --security.secret_key=PREFIX.key (or --security.insecure_plaintext=true for a local "
        "test)");
  }
  if (c.listen_worker.empty() || c.listen_admin.empty()) {
    return Status::InvalidArgument("listen.worker and listen.admin must both be set");
  }
  ISTHMUS_RETURN_IF_ERROR(CheckEndpoint(c.listen_worker, "listen.worker"));
  ISTHMUS_RETURN_IF_ERROR(CheckEndpoint(c.listen_admin, "listen.admin"));
  if (!c.listen_peer.empty()) ISTHMUS_RETURN_IF_ERROR(CheckEndpoint(c.listen_peer, "listen.peer"));
  if (!c.sync_peers.empty() && c.sync.site.empty()) {
    return Status::InvalidArgument(
        "sync.peers is set but sync.site is not: name this site (--sync.site=NAME)");
  }
  ISTHMUS_ASSIGN_OR_RETURN(auto peers, ParsePeerSpecs(c.sync_peers));
  for (const auto& p : peers) {
    if (p.site == c.sync.site) {
      return Status::InvalidArgument("sync.peers names this site (" + p.site + ") as a peer");
    }
    ISTHMUS_RETURN_IF_ERROR(
        CheckEndpoint(p.endpoint, "sync.peers entry for site '" + PrintableName(p.site) + "':"));
  }
  if (c.sync_dial != "auto" && c.sync_dial != "always" && c.sync_dial != "never") {
    return Status::InvalidArgument("sync.dial is '" + c.sync_dial + "'; use auto, always or never");
  }
  if (c.sync_remove_silent_after_s > 0 &&
      c.sync_remove_silent_after_s * 1000 < 2 * c.sync_backoff_max_ms) {
    return Status::InvalidArgument(
        "sync.remove_silent_after_s must be at least twice sync.backoff_max_ms (" +
        std::to_string(c.sync_backoff_max_ms) +
        " ms): a live but idle peer is heard only once per keep-alive interval");
  }
  if (!c.listen_metrics.empty()) {
    auto hp = metrics::ParseHostPort(c.listen_metrics, "listen.metrics");
    if (!hp.ok()) return hp.status();
  }
  if (auto sync = SyncOptionsFrom(c)) {
    // The engine's own check, so that isthmusctl refuses what the server would.
    ISTHMUS_RETURN_IF_ERROR(NormalizeSyncOptions(*sync));
  }
  return Status::Ok();
}

Result<std::vector<PeerSpec>> ParsePeerSpecs(const std::vector<std::string>& entries) {
  std::vector<PeerSpec> out;
  std::set<std::string> sites;
  for (const auto& e : entries) {
    auto a = e.find('=');
    auto b = a == std::string::npos ? a : e.find('=', a + 1);
    if (b == std::string::npos || a == 0 || b == a + 1 || b + 1 == e.size()) {
      return Status::InvalidArgument("sync.peers entry '" + e +
                                     "' is not SITE=ENDPOINT=PUBKEYFILE");
    }
    PeerSpec p{e.substr(0, a), e.substr(a + 1, b - a - 1), e.substr(b + 1)};
    if (!sites.insert(p.site).second) {
      return Status::InvalidArgument("sync.peers names site '" + p.site + "' twice");
    }
    out.push_back(std::move(p));
  }
  return out;
}

std::optional<SyncOptions> SyncOptionsFrom(const ServerConfig& c) {
  if (c.sync.site.empty()) return std::nullopt;
  SyncOptions o = c.sync;
  o.peer_sites.clear();
  auto peers = ParsePeerSpecs(c.sync_peers);
  if (peers.ok()) {
    for (const auto& p : *peers) o.peer_sites.push_back(p.site);
  }
  return o;
}

std::string ServerConfigDoc() {
  std::ostringstream out;
  out << "| key (TOML `[section] name`) | flag | environment | type | default | range | meaning "
         "|\n";
  out << "|---|---|---|---|---|---|---|\n";
  for (const auto& s : ServerSettings()) {
    const char* type = s.type == SettingType::kString       ? "string"
                       : s.type == SettingType::kStringList ? "list of strings"
                       : s.type == SettingType::kBool       ? "bool"
                       : s.type == SettingType::kDouble     ? "number"
                                                            : "integer";
    out << "| `" << s.key << "` | `" << SettingFlag(s.key) << "` | `" << SettingEnv(s.key) << "` | "
        << type << " | `" << s.default_value << "` | " << s.range << " | " << s.doc << " |\n";
  }
  return out.str();
}

}  // namespace isthmus
