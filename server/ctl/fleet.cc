// isthmusctl fleet init: the keys, allowlists and configs of a fleet, written so that each
// site's folder can be copied to /etc/isthmus on its shard host and started with systemd.
// The settings are checked with the server's own table, loader and validation, so a file
// this writes is one the server accepts.
#include "server/ctl/fleet.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "common/exit_codes.h"
#include "common/keys.h"
#include "common/names.h"
#include "server/config/config.h"
#include "server/ctl/common.h"

namespace isthmus::ctl {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kLoopback = "127.0.0.1";
constexpr const char* kJobPlaceholder = "JOB";

// Settings fleet init writes itself, per shard.
const std::set<std::string>& ManagedSettings() {
  static const std::set<std::string> kManaged = {"shard.id",
                                                 "shard.index",
                                                 "shard.data_dir",
                                                 "listen.worker",
                                                 "listen.admin",
                                                 "listen.peer",
                                                 "security.secret_key",
                                                 "security.worker_keys",
                                                 "security.admin_keys",
                                                 "security.peer_keys",
                                                 "sync.site",
                                                 "sync.peers"};
  return kManaged;
}

std::string Trim(const std::string& s) {
  const auto a = s.find_first_not_of(" \t");
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(" \t") - a + 1);
}

std::vector<std::string> SplitComma(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!Trim(item).empty()) out.push_back(Trim(item));
  }
  return out;
}

std::string TomlString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned char>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string TomlList(const std::vector<std::string>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + TomlString(items[i]);
  return out + "]";
}

std::string Replace(std::string text, const std::string& from, const std::string& to) {
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
    text.replace(at, from.size(), to);
  }
  return text;
}

// Paths go into TOML strings, comma-separated environment variables and shell lines: keep
// them to characters none of those treats specially.
bool IsPlainPath(const std::string& p) {
  if (p.empty()) return false;
  for (char c : p) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x21 || u == 0x7f || c == '"' || c == '\'' || c == '\\' || c == '`' || c == '$' ||
        c == ',' || c == ';' || c == '&' || c == '|' || c == '<' || c == '>' || c == '*' ||
        c == '?') {
      return false;
    }
  }
  return true;
}

// An IP address or host name: letters, digits, '.', '-', ':' (IPv6).
bool IsPlainHost(const std::string& h) {
  if (h.empty() || h.size() > 253) return false;
  return std::all_of(h.begin(), h.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == ':';
  });
}

std::string Endpoint(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos;
  return "tcp://" + (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

Result<std::pair<std::string, std::string>> SplitSetting(const std::string& text,
                                                         const char* flag) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0) {
    return Status::InvalidArgument(std::string(flag) + " '" + text + "' is not NAME=VALUE");
  }
  return std::make_pair(text.substr(0, eq), text.substr(eq + 1));
}

Result<int> ParsePort(const std::string& text, const std::string& what) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < 1 || v > 65535) {
    return Status::InvalidArgument(what + " '" + text + "' is not a port (1-65535)");
  }
  return static_cast<int>(v);
}

// The TOML value text of `value` for a setting of type `type`, checked as the loader would.
Result<std::string> TomlValue(const SettingInfo& info, const std::string& value) {
  const std::string where = "--set " + info.key + "=" + value;
  switch (info.type) {
    case SettingType::kString:
      return TomlString(value);
    case SettingType::kStringList:
      return TomlList(SplitComma(value));
    case SettingType::kBool:
      if (value == "true" || value == "1" || value == "yes") return std::string("true");
      if (value == "false" || value == "0" || value == "no") return std::string("false");
      return Status::InvalidArgument(where + ": " + info.key + " is true or false");
    case SettingType::kInt: {
      char* end = nullptr;
      errno = 0;
      const long long v = std::strtoll(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || errno == ERANGE) {
        return Status::InvalidArgument(where + ": " + info.key + " is an integer" +
                                       (info.range.empty() ? "" : " in " + info.range));
      }
      return std::to_string(v);
    }
    case SettingType::kDouble: {
      char* end = nullptr;
      const double v = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !std::isfinite(v)) {
        return Status::InvalidArgument(where + ": " + info.key + " is a number");
      }
      // The shortest text that reads back as v: "0.1", "1e-05", "3" (TOML's own forms; the
      // loader takes an integer for a number setting).
      char buf[64];
      const auto r = std::to_chars(buf, buf + sizeof buf, v);
      return std::string(buf, r.ptr);
    }
  }
  return Status::Internal("unknown setting type");
}

std::string Section(const std::string& key) { return key.substr(0, key.find('.')); }
std::string Name(const std::string& key) { return key.substr(key.find('.') + 1); }

std::string MetricsAddress(const FleetSite& s, int shard) {
  return std::string(kLoopback) + ":" + std::to_string(s.MetricsPort(shard));
}

std::string ShardName(const FleetSite& s, int shard) {
  return s.name + "-" + std::to_string(shard);
}
std::string KeysDir(const FleetSite& s) { return s.etc_dir + "/keys"; }
std::string PeersDirName(int shard) { return "peers-" + std::to_string(shard); }

// The sync.peers entries of shard `shard` of plan.sites[site]: the same-numbered shard of
// every other site, with its public key in this site's peer allowlist folder.
std::vector<std::string> PeerEntries(const FleetPlan& plan, size_t site, int shard) {
  std::vector<std::string> out;
  const FleetSite& me = plan.sites[site];
  for (size_t t = 0; t < plan.sites.size(); ++t) {
    if (t == site) continue;
    const FleetSite& other = plan.sites[t];
    out.push_back(other.name + "=" + Endpoint(other.host, other.PeerPort(shard)) + "=" +
                  KeysDir(me) + "/" + PeersDirName(shard) + "/" + ShardName(other, shard) + ".pub");
  }
  return out;
}

// True when sites x and y are on one host and some port of theirs (the first `per_shard` of
// each shard's) is the same (*port).
bool SharedPort(const FleetSite& x, const FleetSite& y, int shards, int per_shard, int* port) {
  if (x.host != y.host) return false;
  std::set<int> xs;
  for (int i = 0; i < shards; ++i) {
    for (int k = 0; k < per_shard; ++k) xs.insert(x.WorkerPort(i) + k);
  }
  for (int i = 0; i < shards; ++i) {
    for (int k = 0; k < per_shard; ++k) {
      if (xs.count(y.WorkerPort(i) + k)) {
        *port = y.WorkerPort(i) + k;
        return true;
      }
    }
  }
  return false;
}

// The sites that dial `site` (its peer sockets must be reachable from their hosts).
std::vector<size_t> DialersOf(const FleetPlan& plan, size_t site) {
  std::vector<size_t> out;
  for (size_t t = 0; t < plan.sites.size(); ++t) {
    if (t == site) continue;
    if (plan.dial == "always" ||
        (plan.dial == "auto" && plan.sites[t].name < plan.sites[site].name)) {
      out.push_back(t);
    }
  }
  return out;
}

std::string PortList(const FleetSite& s, int shards, int offset) {
  std::string out;
  for (int i = 0; i < shards; ++i) {
    out += (i ? "," : "") + std::to_string(s.WorkerPort(i) + offset);
  }
  return out;
}

// The shell value of the operator key path: "$HOME/..." stays expandable.
std::string ShellPathValue(const std::string& path) { return "\"" + path + "\""; }

std::string WorkerToml(const FleetPlan& plan, const FleetSite& s) {
  std::vector<std::string> servers, keys;
  for (int i = 0; i < plan.shards; ++i) {
    servers.push_back(Endpoint(s.host, s.WorkerPort(i)));
    keys.push_back(KeysDir(s) + "/" + ShardName(s, i) + ".pub");
  }
  std::ostringstream out;
  out << "# isthmus-worker settings of site " << s.name
      << "'s ranks, written by isthmusctl fleet init.\n"
      << "#   isthmus-worker train --config " << s.etc_dir << "/worker.toml --data DIR \\\n"
      << "#       --rank R --world-size N --rendezvous tcp:HOST:PORT --max-rounds N\n"
      << "# Keys are the flag names (docs/WORKER.md); a flag on the command line wins.\n";
  if (plan.job.empty()) {
    out << "job = " << TomlString(kJobPlaceholder)
        << "  # placeholder: the name given to isthmusctl job create -j\n";
  } else {
    out << "job = " << TomlString(plan.job) << "\n";
  }
  out << "client-name = " << TomlString(s.name) << "\n"
      << "server = " << TomlList(servers) << "  # shard order\n"
      << "server-key = " << TomlList(keys) << "\n"
      << "key = " << TomlString(KeysDir(s) + "/worker.key") << "\n";
  return out.str();
}

std::string CtlEnv(const FleetPlan& plan, const FleetSite& s) {
  std::string servers, keys;
  for (int i = 0; i < plan.shards; ++i) {
    servers += (i ? "," : "") + Endpoint(kLoopback, s.AdminPort(i));
    keys += (i ? "," : "") + KeysDir(s) + "/" + ShardName(s, i) + ".pub";
  }
  std::ostringstream out;
  out << "# isthmusctl settings for site " << s.name
      << " (written by isthmusctl fleet init). On its shard host:\n"
      << "#   . " << s.etc_dir << "/isthmusctl.env && isthmusctl status\n"
      << "# The admin sockets listen on 127.0.0.1 only; ISTHMUS_CTL_KEY is the operator's admin "
         "key.\n"
      << "export ISTHMUS_CTL_SERVERS=\"" << servers << "\"\n"
      << "export ISTHMUS_CTL_SERVER_KEYS=\"" << keys << "\"\n"
      << "export ISTHMUS_CTL_KEY=" << ShellPathValue(plan.operator_key) << "\n";
  return out.str();
}

Status WriteText(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return Status::IoError("cannot write '" + path.string() + "'");
  return Status::Ok();
}

Status MakeDirs(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::IoError("cannot create '" + dir.string() + "': " + ec.message());
  return Status::Ok();
}

Status CopyPub(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
  if (ec) return Status::IoError("cannot copy '" + from.string() + "': " + ec.message());
  fs::permissions(to,
                  fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                      fs::perms::others_read,
                  ec);
  return Status::Ok();
}

// Loads `path` as isthmus-server would and checks it as it would at start.
Status CheckWithServerLoader(const std::string& path,
                             const std::map<std::string, std::string>& overrides) {
  ISTHMUS_ASSIGN_OR_RETURN(ServerConfig cfg, LoadServerConfig(path, overrides));
  return ValidateServerConfig(cfg);  // the sync options as the engine checks them, too
}

std::string Summary(const FleetPlan& plan) {
  std::ostringstream out;
  std::string names;
  for (const auto& s : plan.sites) names += (names.empty() ? "" : ", ") + s.name;
  const fs::path root(plan.out_dir);
  const bool one_etc = std::all_of(plan.sites.begin(), plan.sites.end(), [&](const FleetSite& s) {
    return s.etc_dir == plan.sites[0].etc_dir;
  });
  const std::string etc = one_etc ? plan.sites[0].etc_dir : "<etc>";
  out << "isthmus fleet: site" << (plan.sites.size() > 1 ? "s " : " ") << names << "; "
      << plan.shards << " shard" << (plan.shards > 1 ? "s" : "")
      << " per site (isthmusctl fleet init)\n\n";
  out << "Folders\n";
  for (const auto& s : plan.sites) {
    out << "  " << (root / s.name).string() << "/  ->  " << s.etc_dir << " on site " << s.name
        << "'s shard host (" << s.host << "); data in " << s.data_dir << "/" << s.name << "-<i>\n";
  }
  out << "  Worker nodes need only worker.toml, keys/worker.key and keys/<site>-<i>.pub of their "
         "site's folder,\n  at the same paths. Key pair files (*.key) must stay mode 0600, owned "
         "by the user that reads them\n  (isthmus for the shards: chown isthmus: "
      << etc << "/keys/*.key).\n";
  out << "  " << (root / "admin" / "admin.key").string()
      << " is the operator's admin key: it belongs on the operator's machine\n  (at "
      << plan.operator_key
      << ", which the isthmusctl.env files name), not in /etc/isthmus.\n  Its public half is on "
         "every site's admin allowlist (keys/admins/).\n\n";
  out << "Ports (TCP; shard i: base+10i workers, base+10i+1 admin on 127.0.0.1, base+10i+2 peers"
      << (plan.metrics ? ", base+10i+3 metrics on 127.0.0.1" : "") << ")\n";
  for (size_t k = 0; k < plan.sites.size(); ++k) {
    const auto& s = plan.sites[k];
    out << "  site " << s.name << ", host " << s.host << ", base " << s.base_port << ":\n";
    out << "    " << PortList(s, plan.shards, 0) << "  workers: open to site " << s.name
        << "'s worker nodes\n";
    out << "    " << PortList(s, plan.shards, 1)
        << "  admin: 127.0.0.1 only (isthmusctl on the host, or an ssh tunnel)\n";
    if (plan.metrics) {
      out << "    " << PortList(s, plan.shards, 3)
          << "  metrics: 127.0.0.1 only (Prometheus /metrics; scrape through an agent on the "
             "host)\n";
    }
    const auto dialers = DialersOf(plan, k);
    if (plan.sites.size() == 1) {
      out << "    " << PortList(s, plan.shards, 2) << "  peers: no other site yet\n";
    } else if (dialers.empty()) {
      out << "    " << PortList(s, plan.shards, 2) << "  peers: no inbound connections (" << s.name
          << " dials its peers: sync.dial " << plan.dial << ")\n";
    } else {
      std::string from;
      for (size_t t : dialers) {
        from += (from.empty() ? "" : ", ") + plan.sites[t].host + " (" + plan.sites[t].name + ")";
      }
      out << "    " << PortList(s, plan.shards, 2) << "  peers: open to " << from << "\n";
    }
  }
  out << "\nThen\n";
  for (const auto& s : plan.sites) {
    out << "  on " << s.name << "'s host: systemctl start";
    for (int i = 0; i < plan.shards; ++i) out << " isthmus-server@" << ShardName(s, i);
    out << "\n";
  }
  out << "  check a site:  . " << etc << "/isthmusctl.env && isthmusctl status\n"
      << "  create the job on every site from the same files (isthmus-worker init --write-base "
         "base.safetensors\n    --out init.safetensors prints HASH):  isthmusctl job create -j "
      << (plan.job.empty() ? kJobPlaceholder : plan.job)
      << " -f init.safetensors --base-hash HASH\n"
      << "  start each site's ranks:  isthmus-worker train --config " << etc
      << "/worker.toml --base base.safetensors --data DIR\n    --rank R --world-size N ...\n"
      << "  watch:  isthmusctl top\n";
  if (plan.sites.size() > 1) {
    out << "  sites agree (from a machine that reaches every site's admin port, e.g. through\n"
        << "  ssh -N -L PORT:127.0.0.1:PORT HOST per port, which needs distinct ports per site):\n"
        << "    isthmusctl sync verify -k " << (root / "admin" / "admin.key").string();
    for (const auto& s : plan.sites) {
      std::string eps, keys;
      for (int i = 0; i < plan.shards; ++i) {
        eps += (i ? "," : "") + Endpoint(kLoopback, s.AdminPort(i));
        keys += (i ? "," : "") + (root / s.name / "keys" / (ShardName(s, i) + ".pub")).string();
      }
      out << " \\\n      --site " << s.name << "=" << eps << " --site-key " << s.name << "="
          << keys;
    }
    out << "\n";
  }
  return out.str();
}

json FleetJson(const FleetPlan& plan) {
  json sites = json::array();
  for (size_t k = 0; k < plan.sites.size(); ++k) {
    const auto& s = plan.sites[k];
    json shards = json::array();
    for (int i = 0; i < plan.shards; ++i) {
      shards.push_back(
          {{"index", i},
           {"id", ShardName(s, i)},
           {"config", s.name + "/" + ShardName(s, i) + ".toml"},
           {"unit", "isthmus-server@" + ShardName(s, i)},
           {"worker_endpoint", Endpoint(s.host, s.WorkerPort(i))},
           {"admin_endpoint", Endpoint(kLoopback, s.AdminPort(i))},
           {"peer_endpoint", Endpoint(s.host, s.PeerPort(i))},
           {"metrics_address", plan.metrics ? json(MetricsAddress(s, i)) : json(nullptr)},
           {"public_key", s.name + "/keys/" + ShardName(s, i) + ".pub"}});
    }
    json dialers = json::array();
    for (size_t t : DialersOf(plan, k)) dialers.push_back(plan.sites[t].name);
    sites.push_back({{"site", s.name},
                     {"host", s.host},
                     {"base_port", s.base_port},
                     {"folder", s.name},
                     {"etc", s.etc_dir},
                     {"data", s.data_dir},
                     {"worker_config", s.name + "/worker.toml"},
                     {"ctl_env", s.name + "/isthmusctl.env"},
                     {"peer_dialled_by", dialers},
                     {"shards", shards}});
  }
  json settings = json::object();
  for (const auto& [k, v] : plan.settings) settings[k] = v;
  return {{"shards", plan.shards},          {"sites", sites},
          {"admin_key", "admin/admin.key"}, {"operator_key", plan.operator_key},
          {"sync_dial", plan.dial},         {"settings", settings}};
}

}  // namespace

Result<FleetPlan> PlanFleet(const FleetOptions& o) {
  FleetPlan plan;
  plan.out_dir = o.out_dir;
  plan.shards = o.shards;
  plan.force = o.force;
  plan.job = o.job;
  plan.operator_key = o.operator_key;
  plan.metrics = o.metrics;
  if (o.out_dir.empty()) return Status::InvalidArgument("--out DIR is required");
  if (o.sites.empty()) return Status::InvalidArgument("--sites lists no site (e.g. --sites A,B)");
  if (o.shards < 1 || o.shards > 1000) {
    return Status::InvalidArgument("--shards must be in [1, 1000], not " +
                                   std::to_string(o.shards));
  }
  if (!o.job.empty() && !IsValidName(o.job)) {
    return Status::InvalidArgument("--job '" + o.job +
                                   "' is not a job name (1-64 of A-Z a-z 0-9 . _ -, not starting "
                                   "with '.')");
  }
  const bool home_key = o.operator_key.rfind("$HOME/", 0) == 0;
  if (!IsPlainPath(home_key ? o.operator_key.substr(6) : o.operator_key) ||
      (!home_key && o.operator_key[0] != '/')) {
    return Status::InvalidArgument("--operator-key '" + o.operator_key +
                                   "' must be an absolute path or start with $HOME/, without "
                                   "spaces, quotes or shell characters");
  }
  std::set<std::string> seen;
  for (const auto& raw : o.sites) {
    const std::string name = Trim(raw);
    if (!IsValidSiteName(name)) {
      return Status::InvalidArgument("site name '" + PrintableName(name) + "' is not valid: " +
                                     SiteNameRule() + " (the server's rule for sync.site)");
    }
    if (name == "admin" || name == "README.txt" || name == "fleet.json") {
      return Status::InvalidArgument("site name '" + name + "' is taken by fleet init's own files");
    }
    if (!seen.insert(name).second) {
      return Status::InvalidArgument("site '" + name + "' is listed twice in --sites");
    }
    FleetSite s;
    s.name = name;
    s.host = kLoopback;
    s.base_port = kFleetDefaultBasePort;
    plan.sites.push_back(s);
  }
  auto find_site = [&](const std::string& name, const char* flag) -> Result<FleetSite*> {
    for (auto& s : plan.sites) {
      if (s.name == name) return &s;
    }
    return Status::InvalidArgument(std::string(flag) + " names site '" + name +
                                   "', which --sites does not list");
  };
  std::set<std::string> hosts_given;
  for (const auto& h : o.hosts) {
    ISTHMUS_ASSIGN_OR_RETURN(auto kv, SplitSetting(h, "--host"));
    ISTHMUS_ASSIGN_OR_RETURN(FleetSite * s, find_site(kv.first, "--host"));
    if (!hosts_given.insert(kv.first).second) {
      return Status::InvalidArgument("--host gives site '" + kv.first + "' twice");
    }
    if (!IsPlainHost(kv.second)) {
      return Status::InvalidArgument("--host " + h +
                                     ": the address must be an IP address or host name");
    }
    s->host = kv.second;
  }
  // A bare PORT sets every site's base; SITE=PORT one site's (whatever the order).
  std::set<std::string> ports_given;
  bool default_given = false;
  for (const auto& p : o.base_ports) {
    if (p.find('=') == std::string::npos) {
      if (default_given) return Status::InvalidArgument("--base-port PORT is given twice");
      default_given = true;
      ISTHMUS_ASSIGN_OR_RETURN(int port, ParsePort(p, "--base-port"));
      for (auto& s : plan.sites) {
        if (!ports_given.count(s.name)) s.base_port = port;
      }
      continue;
    }
    ISTHMUS_ASSIGN_OR_RETURN(auto kv, SplitSetting(p, "--base-port"));
    ISTHMUS_ASSIGN_OR_RETURN(FleetSite * s, find_site(kv.first, "--base-port"));
    if (!ports_given.insert(kv.first).second) {
      return Status::InvalidArgument("--base-port gives site '" + kv.first + "' twice");
    }
    ISTHMUS_ASSIGN_OR_RETURN(s->base_port, ParsePort(kv.second, "--base-port " + p));
  }
  for (auto& s : plan.sites) {
    s.etc_dir = Replace(o.etc_dir, "{site}", s.name);
    s.data_dir = Replace(o.data_dir, "{site}", s.name);
    while (s.etc_dir.size() > 1 && s.etc_dir.back() == '/') s.etc_dir.pop_back();
    while (s.data_dir.size() > 1 && s.data_dir.back() == '/') s.data_dir.pop_back();
    for (const auto* d : {&s.etc_dir, &s.data_dir}) {
      if (!IsPlainPath(*d) || (*d)[0] != '/') {
        return Status::InvalidArgument(
            "--etc and --data must be absolute paths (the server reads them from its own working "
            "directory) without spaces, quotes, commas or shell characters: '" +
            *d + "'");
      }
    }
  }
  // Sites on one host must not share a port: a site without its own SITE=PORT moves up to
  // the next free hundred; explicit bases that collide are refused.
  for (size_t b = 0; b < plan.sites.size(); ++b) {
    FleetSite& y = plan.sites[b];
    for (bool moved = true; moved;) {
      moved = false;
      for (size_t a = 0; a < b && !moved; ++a) {
        const FleetSite& x = plan.sites[a];
        int port = 0;
        if (!SharedPort(x, y, plan.shards, plan.metrics ? 4 : 3, &port)) continue;
        if (ports_given.count(y.name)) {
          return Status::InvalidArgument("sites " + x.name + " and " + y.name +
                                         " are both on host " + x.host + " and would share port " +
                                         std::to_string(port) + ": give " + y.name +
                                         " another --base-port");
        }
        const int top = std::max(x.base_port, y.base_port) + plan.PortSpan();
        y.base_port = (top / 100 + 1) * 100;
        moved = true;
      }
    }
  }
  for (auto& s : plan.sites) {
    const int last = s.base_port + plan.PortSpan();
    if (last > 65535) {
      return Status::InvalidArgument("site " + s.name + ": " + std::to_string(plan.shards) +
                                     " shards from base port " + std::to_string(s.base_port) +
                                     " need ports up to " + std::to_string(last) +
                                     "; give a lower --base-port");
    }
  }
  // --set: known settings only, not the ones written per shard, each once, typed.
  std::map<std::string, std::string> given;
  for (const auto& text : o.settings) {
    ISTHMUS_ASSIGN_OR_RETURN(auto kv, SplitSetting(text, "--set"));
    const auto& table = ServerSettings();
    auto it = std::find_if(table.begin(), table.end(),
                           [&](const SettingInfo& s) { return s.key == kv.first; });
    if (it == table.end()) {
      return Status::InvalidArgument("--set " + text + ": unknown setting '" + kv.first +
                                     "' (docs/CONFIG.md and isthmus-server --print-config-doc "
                                     "list them)");
    }
    if (ManagedSettings().count(kv.first) || Section(kv.first) == "listen") {
      return Status::InvalidArgument("--set " + text + ": fleet init writes " + kv.first +
                                     " itself, per shard (--host, --base-port, --etc, --data); "
                                     "edit a shard's file afterwards for anything else");
    }
    if (kv.first == "security.insecure_plaintext") {
      return Status::InvalidArgument("--set " + text +
                                     ": fleet init writes CURVE fleets (keys and allowlists)");
    }
    if (!given.emplace(kv.first, kv.second).second) {
      return Status::InvalidArgument("--set gives " + kv.first + " twice");
    }
  }
  for (const auto& info : ServerSettings()) {
    auto it = given.find(info.key);
    if (it == given.end()) continue;
    ISTHMUS_ASSIGN_OR_RETURN(std::string value, TomlValue(info, it->second));
    plan.settings.emplace_back(info.key, value);
  }
  if (auto it = given.find("sync.dial"); it != given.end()) plan.dial = it->second;
  if (plan.dial == "never" && plan.sites.size() > 1) {
    return Status::InvalidArgument(
        "--set sync.dial=never on every shard: no site would dial, so no link could form");
  }
  // Every --set value as the server would take it, with the per-shard settings of the first
  // shard: bad values (a codec pipeline, a range) are refused here, before anything is written.
  std::map<std::string, std::string> overrides = given;
  const FleetSite& first = plan.sites[0];
  overrides["shard.id"] = ShardName(first, 0);
  overrides["shard.index"] = "0";
  overrides["shard.data_dir"] = first.data_dir + "/" + ShardName(first, 0);
  overrides["listen.worker"] = Endpoint(first.host, first.WorkerPort(0));
  overrides["listen.admin"] = Endpoint(kLoopback, first.AdminPort(0));
  overrides["listen.peer"] = Endpoint(first.host, first.PeerPort(0));
  if (plan.metrics) overrides["listen.metrics"] = MetricsAddress(first, 0);
  overrides["security.secret_key"] = KeysDir(first) + "/" + ShardName(first, 0) + ".key";
  overrides["sync.site"] = first.name;
  std::string peers;
  for (const auto& e : PeerEntries(plan, 0, 0)) peers += (peers.empty() ? "" : ",") + e;
  overrides["sync.peers"] = peers;
  if (auto s = CheckWithServerLoader("", overrides); !s.ok()) {
    return Status::InvalidArgument("the server would refuse these settings: " + s.message());
  }
  return plan;
}

std::string FleetShardToml(const FleetPlan& plan, size_t site, int shard) {
  const FleetSite& s = plan.sites[site];
  const std::string name = ShardName(s, shard);
  std::map<std::string, std::vector<std::string>> extra;  // section -> "name = value" lines
  for (const auto& [key, value] : plan.settings) {
    extra[Section(key)].push_back(Name(key) + " = " + value);
  }
  std::ostringstream out;
  out << "# isthmus-server config of shard " << shard << " of site " << s.name
      << ", written by isthmusctl fleet init.\n"
      << "# systemctl start isthmus-server@" << name << " reads " << s.etc_dir << "/" << name
      << ".toml (docs/CONFIG.md lists every setting).\n"
      << "[shard]\n"
      << "id = " << TomlString(name) << "\n"
      << "index = " << shard << "\n"
      << "data_dir = " << TomlString(s.data_dir + "/" + name) << "\n";
  for (const auto& l : extra["shard"]) out << l << "\n";
  out << "\n[listen]\n"
      << "worker = " << TomlString(Endpoint(s.host, s.WorkerPort(shard)))
      << "  # the site's worker ranks\n"
      << "admin = " << TomlString(Endpoint(kLoopback, s.AdminPort(shard)))
      << "  # isthmusctl on this host\n"
      << "peer = " << TomlString(Endpoint(s.host, s.PeerPort(shard))) << "  # shard " << shard
      << " of the other sites\n";
  if (plan.metrics) {
    out << "metrics = " << TomlString(MetricsAddress(s, shard))
        << "  # Prometheus /metrics, plain HTTP: loopback only\n";
  }
  out << "\n[security]\n"
      << "secret_key = " << TomlString(KeysDir(s) + "/" + name + ".key") << "\n"
      << "worker_keys = " << TomlList({KeysDir(s) + "/workers"}) << "\n"
      << "admin_keys = " << TomlList({KeysDir(s) + "/admins"}) << "\n"
      << "peer_keys = " << TomlList({KeysDir(s) + "/" + PeersDirName(shard)}) << "\n";
  for (const auto& l : extra["security"]) out << l << "\n";
  out << "\n[sync]\n"
      << "site = " << TomlString(s.name) << "\n"
      << "peers = [";
  const auto peers = PeerEntries(plan, site, shard);
  for (size_t i = 0; i < peers.size(); ++i) out << "\n  " << TomlString(peers[i]) << ",";
  out << (peers.empty() ? "]\n" : "\n]\n");
  for (const auto& l : extra["sync"]) out << l << "\n";
  std::set<std::string> done = {"shard", "listen", "security", "sync"};
  for (const auto& info : ServerSettings()) {
    const std::string sec = Section(info.key);
    if (done.count(sec) || !extra.count(sec)) continue;
    done.insert(sec);
    out << "\n[" << sec << "]\n";
    for (const auto& l : extra[sec]) out << l << "\n";
  }
  return out.str();
}

Result<std::string> WriteFleet(const FleetPlan& plan) {
  const fs::path root(plan.out_dir);
  std::error_code ec;
  if (fs::exists(root, ec) && !fs::is_directory(root, ec)) {
    return Status::AlreadyExists("'" + plan.out_dir + "' exists and is not a folder");
  }
  if (fs::is_directory(root, ec) && !fs::is_empty(root, ec)) {
    if (!plan.force) {
      return Status::AlreadyExists(
          "'" + plan.out_dir +
          "' is not empty: fleet init writes a new fleet (new keys) into an empty folder; pass "
          "--force to replace the fleet's files there");
    }
    // No key of an earlier run may stay on an allowlist.
    fs::remove_all(root / "admin", ec);
    for (const auto& s : plan.sites) {
      fs::remove_all(root / s.name / "keys", ec);
      // Shard configs of an earlier run with more shards.
      for (const auto& e : fs::directory_iterator(root / s.name, ec)) {
        const std::string f = e.path().filename().string();
        const std::string prefix = s.name + "-";
        if (f.size() > prefix.size() + 5 && f.rfind(prefix, 0) == 0 &&
            e.path().extension() == ".toml" &&
            std::all_of(f.begin() + prefix.size(), f.end() - 5, ::isdigit)) {
          fs::remove(e.path(), ec);
        }
      }
    }
  }
  ISTHMUS_RETURN_IF_ERROR(MakeDirs(root / "admin"));
  ISTHMUS_ASSIGN_OR_RETURN(KeyPair admin, GenerateKeyPair());
  const fs::path admin_prefix = root / "admin" / "admin";
  ISTHMUS_RETURN_IF_ERROR(WriteKeyPairFiles(admin_prefix.string(), admin, plan.force));

  // Every shard's key pair first: each site's peer allowlists need the others'.
  std::vector<std::vector<KeyPair>> shard_keys(plan.sites.size());
  for (size_t k = 0; k < plan.sites.size(); ++k) {
    const fs::path keys = root / plan.sites[k].name / "keys";
    ISTHMUS_RETURN_IF_ERROR(MakeDirs(keys));
    for (int i = 0; i < plan.shards; ++i) {
      ISTHMUS_ASSIGN_OR_RETURN(KeyPair pair, GenerateKeyPair());
      ISTHMUS_RETURN_IF_ERROR(
          WriteKeyPairFiles((keys / ShardName(plan.sites[k], i)).string(), pair, plan.force));
      shard_keys[k].push_back(pair);
    }
  }
  for (size_t k = 0; k < plan.sites.size(); ++k) {
    const FleetSite& s = plan.sites[k];
    const fs::path dir = root / s.name;
    const fs::path keys = dir / "keys";
    for (const char* role : {"workers", "admins"}) ISTHMUS_RETURN_IF_ERROR(MakeDirs(keys / role));
    ISTHMUS_ASSIGN_OR_RETURN(KeyPair worker, GenerateKeyPair());
    ISTHMUS_RETURN_IF_ERROR(WriteKeyPairFiles((keys / "worker").string(), worker, plan.force));
    ISTHMUS_RETURN_IF_ERROR(CopyPub(keys / "worker.pub", keys / "workers" / "worker.pub"));
    ISTHMUS_RETURN_IF_ERROR(CopyPub(admin_prefix.string() + ".pub", keys / "admins" / "admin.pub"));
    for (int i = 0; i < plan.shards; ++i) {
      const fs::path peers = keys / PeersDirName(i);
      ISTHMUS_RETURN_IF_ERROR(MakeDirs(peers));
      for (size_t t = 0; t < plan.sites.size(); ++t) {
        if (t == k) continue;
        const std::string other = ShardName(plan.sites[t], i);
        ISTHMUS_RETURN_IF_ERROR(CopyPub(root / plan.sites[t].name / "keys" / (other + ".pub"),
                                        peers / (other + ".pub")));
      }
      ISTHMUS_RETURN_IF_ERROR(
          WriteText(dir / (ShardName(s, i) + ".toml"), FleetShardToml(plan, k, i)));
    }
    ISTHMUS_RETURN_IF_ERROR(WriteText(dir / "worker.toml", WorkerToml(plan, s)));
    ISTHMUS_RETURN_IF_ERROR(WriteText(dir / "isthmusctl.env", CtlEnv(plan, s)));
  }
  // What was written is what the server will read.
  for (const auto& s : plan.sites) {
    for (int i = 0; i < plan.shards; ++i) {
      const fs::path file = root / s.name / (ShardName(s, i) + ".toml");
      if (auto st = CheckWithServerLoader(file.string(), {}); !st.ok()) {
        return Status::Internal("the server refuses the written " + file.string() + ": " +
                                st.message());
      }
    }
  }
  const std::string summary = Summary(plan);
  ISTHMUS_RETURN_IF_ERROR(WriteText(root / "README.txt", summary));
  ISTHMUS_RETURN_IF_ERROR(WriteText(root / "fleet.json", FleetJson(plan).dump(2) + "\n"));
  return summary;
}

void AddFleetInitFlags(CLI::App* cmd, FleetOptions& o) {
  cmd->add_option("--sites", o.sites, "site names, comma-separated (e.g. A,B)")
      ->required()
      ->delimiter(',');
  cmd->add_option("--shards", o.shards, "parameter-server shards per site")->required();
  cmd->add_option("--out", o.out_dir, "output folder: one folder per site, plus admin/")
      ->required();
  cmd->add_option("--host", o.hosts,
                  "SITE=ADDR: address of SITE's shard host (its worker and peer sockets bind to "
                  "it; the other sites dial it); repeat per site; default 127.0.0.1");
  cmd->add_option("--base-port", o.base_ports,
                  "PORT or SITE=PORT: shard i listens on base+10i (workers), base+10i+1 (admin, "
                  "127.0.0.1) and base+10i+2 (peers); default 7100");
  cmd->add_option("--etc", o.etc_dir,
                  "where a site's folder will be on its hosts ({site}: the site's name)")
      ->capture_default_str();
  cmd->add_option("--data", o.data_dir,
                  "where its shards keep their data (shard.data_dir = DATA/SITE-i; {site} as for "
                  "--etc)")
      ->capture_default_str();
  cmd->add_option("--set", o.settings,
                  "KEY=VALUE: a server setting written into every shard's TOML (e.g. "
                  "sync.codec=int8+zstd); checked against the server's settings table");
  cmd->add_option("--operator-key", o.operator_key,
                  "path of the admin key pair file on the machine that runs isthmusctl, written "
                  "into the isthmusctl.env files")
      ->capture_default_str();
  cmd->add_option("--job", o.job, "the job name for worker.toml (default: a placeholder, JOB)");
  cmd->add_flag("--metrics", o.metrics,
                "each shard serves Prometheus metrics (listen.metrics) on 127.0.0.1:base+10i+3");
  cmd->add_flag("--force", o.force,
                "write into a non-empty --out (replaces the sites' keys/ and admin/: new keys)");
  cmd->footer(
      "Writes OUT/SITE/ (SITE-i.toml, worker.toml, isthmusctl.env, keys/), OUT/admin/admin.key "
      "and OUT/README.txt + fleet.json (where each folder goes, which ports to open). Exit 1 when "
      "OUT is not empty (without --force), 2 for bad options, 6 when a file cannot be written. "
      "docs/CLI.md, \"fleet init\"; walk-through: docs/DEPLOY.md.\n" +
      ExitCodesFooter());
}

int CmdFleetInit(const FleetOptions& o) {
  auto plan = PlanFleet(o);
  if (!plan.ok()) return Fail(plan.status());
  auto summary = WriteFleet(*plan);
  if (!summary.ok()) return Fail(summary.status());
  std::fputs(summary->c_str(), stdout);
  std::printf("\n(written to %s/README.txt and %s/fleet.json)\n", o.out_dir.c_str(),
              o.out_dir.c_str());
  return 0;
}

}  // namespace isthmus::ctl
