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
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

#include "common/durable.h"
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
      << " -f init.safetensors --base-hash HASH\n";
  std::string added, first_site;
  for (const auto& s : plan.sites) {
    if (s.added) added += (added.empty() ? "" : ", ") + s.name;
    if (!s.added && first_site.empty()) first_site = s.name;
  }
  if (!added.empty()) {
    out << "    except on the sites added later (" << added
        << "): once every other site lists them (restarted),\n    they take the running job "
           "with:  isthmusctl sync invite --site SITE on "
        << first_site << ", then  isthmusctl sync join --from " << first_site << " -j "
        << (plan.job.empty() ? kJobPlaceholder : plan.job) << "  on the added site\n";
  }
  out << "  start each site's ranks:  isthmus-worker train --config " << etc
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
    if (s.added) sites.back()["added"] = true;  // by fleet add-site: it joins the jobs
  }
  json settings = json::object();
  for (const auto& [k, v] : plan.settings) settings[k] = v;
  return {{"shards", plan.shards},
          {"sites", sites},
          {"admin_key", "admin/admin.key"},
          {"operator_key", plan.operator_key},
          {"sync_dial", plan.dial},
          {"settings", settings},
          {"job", plan.job}};
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

// --- fleet add-site ---------------------------------------------------------------------

namespace {

// The job name worker.toml holds ("job = \"NAME\""); empty for fleet init's placeholder or
// when it cannot be read (add-site then writes the placeholder too).
std::string JobOfWorkerToml(const fs::path& file) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("job = \"", 0) != 0) continue;
    const auto close = line.find('"', 7);
    if (close == std::string::npos) return "";
    const std::string job = line.substr(7, close - 7);
    return job == kJobPlaceholder || !IsValidName(job) ? "" : job;
  }
  return "";
}

// The --etc (or --data) pattern the fleet's sites follow: `paths[k]` is site k's folder. A
// path component equal to the site's name is {site}; nullopt when the sites follow no one
// pattern (then the new site's folder must be given).
std::optional<std::string> FolderPattern(const std::vector<FleetSite>& sites,
                                         const std::vector<std::string>& paths) {
  std::string pattern;
  std::stringstream in(paths[0]);
  std::string part;
  bool first = true;
  while (std::getline(in, part, '/')) {
    pattern += (first ? "" : "/") + (part == sites[0].name ? std::string("{site}") : part);
    first = false;
  }
  for (size_t k = 0; k < sites.size(); ++k) {
    if (Replace(pattern, "{site}", sites[k].name) != paths[k]) return std::nullopt;
  }
  return pattern;
}

// `toml` (a shard config) with `entry` added to the sync.peers list of its [sync] table, the
// rest of the file as it was (an operator's edits stay). InvalidArgument when the list is not
// laid out as fleet init writes it (one list, opened on the `peers = [` line).
Result<std::string> AddPeerEntry(const std::string& toml, const std::string& entry) {
  std::vector<std::string> lines;
  std::stringstream in(toml);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  std::string table;
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string t = Trim(lines[i]);
    if (t.rfind("[", 0) == 0 && t.rfind("[[", 0) != 0) {
      table = Trim(t.substr(1, t.find(']') - 1));
      continue;
    }
    if (table != "sync" || t.rfind("peers", 0) != 0) continue;
    const std::string rest = Trim(t.substr(5));
    if (rest.rfind("=", 0) != 0 || Trim(rest.substr(1)).rfind("[", 0) != 0) continue;
    const auto open = lines[i].find('[');
    const auto close = lines[i].find(']', open);
    if (close == std::string::npos) {
      // A list over several lines: the entry goes before the line that closes it.
      for (size_t j = i + 1; j < lines.size(); ++j) {
        if (Trim(lines[j]).rfind("]", 0) != 0) continue;
        lines.insert(lines.begin() + static_cast<long>(j), "  " + TomlString(entry) + ",");
        std::string out;
        for (const auto& l : lines) out += l + "\n";
        return out;
      }
      break;
    }
    const std::string inside = Trim(lines[i].substr(open + 1, close - open - 1));
    lines[i] = lines[i].substr(0, open + 1) + (inside.empty() ? "" : inside + ", ") +
               TomlString(entry) + lines[i].substr(close);
    std::string out;
    for (const auto& l : lines) out += l + "\n";
    return out;
  }
  return Status::InvalidArgument("no sync.peers list in its [sync] table");
}

std::string ShardUnits(const FleetSite& s, int shards) {
  std::string out;
  for (int i = 0; i < shards; ++i) out += " isthmus-server@" + ShardName(s, i);
  return out;
}

// What the operator does next, site by site.
std::string AddSiteSteps(const FleetPlan& plan) {
  const size_t k = plan.sites.size() - 1;
  const FleetSite& s = plan.sites[k];
  const fs::path root(plan.out_dir);
  const std::string job = plan.job.empty() ? kJobPlaceholder : plan.job;
  std::ostringstream out;
  out << "isthmus fleet: site " << s.name << " added (" << plan.shards << " shard"
      << (plan.shards > 1 ? "s" : "") << "; isthmusctl fleet add-site). No existing key "
      << "changed.\n\n";
  out << "New site " << s.name << "\n"
      << "  " << (root / s.name).string() << "/  ->  " << s.etc_dir << " on its shard host ("
      << s.host << "); data in " << s.data_dir << "/" << s.name << "-<i>\n"
      << "  ports " << PortList(s, plan.shards, 0) << " workers, " << PortList(s, plan.shards, 1)
      << " admin (127.0.0.1), " << PortList(s, plan.shards, 2) << " peers";
  const auto dialers = DialersOf(plan, k);
  if (dialers.empty()) {
    out << ": no inbound connections (" << s.name << " dials its peers)\n";
  } else {
    std::string from;
    for (size_t t : dialers) {
      from += (from.empty() ? "" : ", ") + plan.sites[t].host + " (" + plan.sites[t].name + ")";
    }
    out << ": open to " << from << "\n";
  }
  out << "\nFirst, every existing site, one at a time (a shard restarts without losing "
         "anything it acknowledged):\n";
  for (size_t t = 0; t < k; ++t) {
    const FleetSite& e = plan.sites[t];
    out << "  site " << e.name << " (" << e.host << "): copy its folder, "
        << (root / e.name).string() << "/, to " << e.etc_dir << " again (new: keys/peers-<i>/"
        << s.name << "-<i>.pub; changed: sync.peers of " << e.name << "-<i>.toml; no key of "
        << e.name << " changed), then\n"
        << "    systemctl restart" << ShardUnits(e, plan.shards) << "\n";
    const auto d = DialersOf(plan, t);
    if (std::find(d.begin(), d.end(), k) != d.end()) {
      out << "    and open its peer ports " << PortList(e, plan.shards, 2) << " to " << s.host
          << " (" << s.name << ")\n";
    }
  }
  out << "Then, on " << s.name << "'s host:\n"
      << "  systemctl start" << ShardUnits(s, plan.shards) << "\n"
      << "  on " << plan.sites[0].name << "'s host:  . " << plan.sites[0].etc_dir
      << "/isthmusctl.env && isthmusctl sync invite --site " << s.name << " -j " << job << "\n"
      << "  then on " << s.name << "'s host:  . " << s.etc_dir
      << "/isthmusctl.env && isthmusctl sync join --from " << plan.sites[0].name << " -j " << job
      << "\n"
      << "    (any member will do for --from, once it invited " << s.name
      << "; a member that does not list " << s.name << " in sync.peers yet refuses the join)\n"
      << "  then start " << s.name << "'s ranks: isthmus-worker train --config " << s.etc_dir
      << "/worker.toml --base base.safetensors --data DIR ...\n"
      << "README.txt and fleet.json describe the fleet with " << s.name << " now.\n";
  return out.str();
}

}  // namespace

Result<FleetPlan> ReadFleet(const std::string& out_dir) {
  const fs::path file = fs::path(out_dir) / "fleet.json";
  std::ifstream in(file);
  if (!in) {
    return Status::NotFound("no fleet.json in '" + out_dir +
                            "': name the folder isthmusctl fleet init wrote (--out)");
  }
  try {
    const json j = json::parse(in);
    FleetPlan plan;
    plan.out_dir = out_dir;
    plan.shards = j.at("shards").get<int>();
    plan.dial = j.value("sync_dial", std::string("auto"));
    plan.operator_key = j.at("operator_key").get<std::string>();
    for (const auto& s : j.at("sites")) {
      FleetSite site;
      site.name = s.at("site").get<std::string>();
      site.host = s.at("host").get<std::string>();
      site.base_port = s.at("base_port").get<int>();
      site.etc_dir = s.at("etc").get<std::string>();
      site.data_dir = s.at("data").get<std::string>();
      site.added = s.value("added", false);
      for (const auto& shard : s.at("shards")) {
        if (!shard.value("metrics_address", json()).is_null()) plan.metrics = true;
      }
      plan.sites.push_back(site);
    }
    const json& settings = j.value("settings", json::object());
    for (const auto& info : ServerSettings()) {  // the server's table order, as PlanFleet
      if (settings.contains(info.key)) {
        plan.settings.emplace_back(info.key, settings.at(info.key).get<std::string>());
      }
    }
    plan.job =
        j.contains("job") && j["job"].is_string()
            ? j["job"].get<std::string>()
            : (plan.sites.empty()
                   ? ""
                   : JobOfWorkerToml(fs::path(out_dir) / plan.sites[0].name / "worker.toml"));
    if (plan.shards < 1 || plan.sites.empty()) {
      return Status::InvalidArgument("'" + file.string() + "' lists no site or no shard");
    }
    return plan;
  } catch (const json::exception& e) {
    return Status::InvalidArgument("'" + file.string() +
                                   "' is not a fleet.json as fleet init writes it: " + e.what());
  }
}

Result<FleetPlan> PlanAddSite(const FleetAddOptions& o) {
  if (o.out_dir.empty()) return Status::InvalidArgument("--out DIR is required");
  ISTHMUS_ASSIGN_OR_RETURN(FleetPlan plan, ReadFleet(o.out_dir));
  const std::string name = Trim(o.site);
  if (!IsValidName(name)) {
    return Status::InvalidArgument("site name '" + name +
                                   "' is not valid: 1-64 of A-Z a-z 0-9 . _ -, not starting "
                                   "with '.' (the server's rule for names)");
  }
  if (name == "admin" || name == "README.txt" || name == "fleet.json") {
    return Status::InvalidArgument("site name '" + name + "' is taken by fleet init's own files");
  }
  for (const auto& s : plan.sites) {
    if (s.name == name) {
      return Status::AlreadyExists(
          "site '" + name + "' is already in the fleet (" + o.out_dir +
          "/fleet.json lists it): nothing was changed. fleet add-site adds a new site; its files "
          "are in " +
          o.out_dir + "/" + name + "/");
    }
  }
  FleetSite site;
  site.name = name;
  site.added = true;
  site.host = o.host.empty() ? kLoopback : o.host;
  if (!IsPlainHost(site.host)) {
    return Status::InvalidArgument("--host " + site.host +
                                   ": the address must be an IP address or host name");
  }
  std::vector<std::string> etcs, datas;
  for (const auto& s : plan.sites) {
    etcs.push_back(s.etc_dir);
    datas.push_back(s.data_dir);
  }
  for (auto [given, paths, out, flag] :
       {std::tuple{&o.etc_dir, &etcs, &site.etc_dir, "--etc"},
        std::tuple{&o.data_dir, &datas, &site.data_dir, "--data"}}) {
    if (!given->empty()) {
      *out = Replace(*given, "{site}", name);
    } else if (auto pattern = FolderPattern(plan.sites, *paths)) {
      *out = Replace(*pattern, "{site}", name);
    } else {
      return Status::InvalidArgument(std::string("the fleet's sites follow no one ") + flag +
                                     " pattern: give the new site's with " + flag + " DIR");
    }
    while (out->size() > 1 && out->back() == '/') out->pop_back();
    if (!IsPlainPath(*out) || (*out)[0] != '/') {
      return Status::InvalidArgument(
          "--etc and --data must be absolute paths (the server reads them from its own working "
          "directory) without spaces, quotes, commas or shell characters: '" +
          *out + "'");
    }
  }
  // Ports: as fleet init lays them out. A given base must not share a port with a site on the
  // same host; without one, the site moves up to the next free hundred.
  site.base_port = kFleetDefaultBasePort;
  if (!o.base_port.empty()) {
    ISTHMUS_ASSIGN_OR_RETURN(site.base_port, ParsePort(o.base_port, "--base-port"));
  }
  const int per_shard = plan.metrics ? 4 : 3;
  for (bool moved = true; moved;) {
    moved = false;
    for (const auto& x : plan.sites) {
      int port = 0;
      if (!SharedPort(x, site, plan.shards, per_shard, &port)) continue;
      if (!o.base_port.empty()) {
        return Status::InvalidArgument("site " + name + " would share port " +
                                       std::to_string(port) + " with site " + x.name + " on host " +
                                       x.host + ": give another --base-port");
      }
      const int top = std::max(x.base_port, site.base_port) + plan.PortSpan();
      site.base_port = (top / 100 + 1) * 100;
      moved = true;
      break;
    }
  }
  if (site.base_port + plan.PortSpan() > 65535) {
    return Status::InvalidArgument(
        "site " + name + ": " + std::to_string(plan.shards) + " shards from base port " +
        std::to_string(site.base_port) + " need ports up to " +
        std::to_string(site.base_port + plan.PortSpan()) + "; give a lower --base-port");
  }
  plan.sites.push_back(site);
  plan.force = o.force;
  return plan;
}

Result<std::string> WriteAddedSite(const FleetPlan& plan) {
  const fs::path root(plan.out_dir);
  const size_t added = plan.sites.size() - 1;
  const FleetSite& s = plan.sites[added];
  const fs::path dir = root / s.name;
  std::error_code ec;
  if (fs::exists(dir, ec) && (!fs::is_directory(dir, ec) || !fs::is_empty(dir, ec)) &&
      !plan.force) {
    return Status::AlreadyExists(
        "'" + dir.string() + "' exists, but fleet.json does not list site " + s.name +
        " (an add-site that did not finish?): nothing was changed; pass --force to replace its "
        "keys/ and files");
  }
  // Everything that can be refused is checked before the existing sites' files change: each
  // existing shard config gets its new sync.peers entry in a file beside it, loaded back with
  // the server's loader, and only renamed over the config once all are good.
  struct Edit {
    fs::path config, staged, pub_from, pub_to;
  };
  std::vector<Edit> edits;
  auto drop_staged = [&] {
    for (const auto& e : edits) fs::remove(e.staged, ec);
  };
  for (size_t t = 0; t < added; ++t) {
    const FleetSite& e = plan.sites[t];
    for (int i = 0; i < plan.shards; ++i) {
      const fs::path config = root / e.name / (ShardName(e, i) + ".toml");
      const std::string entry = PeerEntries(plan, t, i).back();  // the new site comes last
      auto before = LoadServerConfig(config.string(), {});
      auto peers = before.ok() ? ParsePeerSpecs(before->sync_peers)
                               : Result<std::vector<PeerSpec>>(before.status());
      if (!peers.ok()) {
        drop_staged();
        return Status(peers.status().code(),
                      "cannot read " + config.string() + ": " + peers.status().message());
      }
      if (std::any_of(peers->begin(), peers->end(),
                      [&](const PeerSpec& p) { return p.site == s.name; })) {
        drop_staged();
        return Status::FailedPrecondition(
            config.string() + " already names site " + s.name +
            " in sync.peers: nothing was changed; remove that entry (or choose another name)");
      }
      std::vector<std::string> want = before->sync_peers;
      want.push_back(entry);
      std::ifstream in(config);
      const std::string text((std::istreambuf_iterator<char>(in)), {});
      auto edited = AddPeerEntry(text, entry);
      Edit edit{config, config.string() + ".add-site", dir / "keys" / (ShardName(s, i) + ".pub"),
                root / e.name / "keys" / PeersDirName(i) / (ShardName(s, i) + ".pub")};
      Status st = edited.status();
      if (st.ok()) st = WriteText(edit.staged, *edited);
      edits.push_back(edit);
      if (st.ok()) {
        auto after = LoadServerConfig(edit.staged.string(), {});
        st = after.ok() ? ValidateServerConfig(*after) : after.status();
        if (st.ok() && after->sync_peers != want) {
          st = Status::InvalidArgument("its sync.peers did not come out as expected");
        }
      }
      if (!st.ok()) {
        drop_staged();
        return Status::FailedPrecondition(
            "cannot add site " + s.name + " to the sync.peers of " + config.string() + " (" +
            st.message() +
            "): nothing was changed; add this entry to its [sync] peers by hand, "
            "or write the file as fleet init does: " +
            TomlString(entry));
      }
    }
  }
  // The new site's folder, which nobody reads yet: its keys (new), the fleet's admin
  // allowlist (the same admins as the first site), the other sites' shard keys.
  Status st = [&]() -> Status {
    if (plan.force) {
      fs::remove_all(dir / "keys", ec);
      for (const auto& f : fs::directory_iterator(dir, ec)) {
        if (f.path().extension() == ".toml") fs::remove(f.path(), ec);
      }
    }
    const fs::path keys = dir / "keys";
    for (const char* role : {"workers", "admins"}) ISTHMUS_RETURN_IF_ERROR(MakeDirs(keys / role));
    for (int i = 0; i < plan.shards; ++i) {
      ISTHMUS_ASSIGN_OR_RETURN(KeyPair pair, GenerateKeyPair());
      ISTHMUS_RETURN_IF_ERROR(WriteKeyPairFiles((keys / ShardName(s, i)).string(), pair, true));
    }
    ISTHMUS_ASSIGN_OR_RETURN(KeyPair worker, GenerateKeyPair());
    ISTHMUS_RETURN_IF_ERROR(WriteKeyPairFiles((keys / "worker").string(), worker, true));
    ISTHMUS_RETURN_IF_ERROR(CopyPub(keys / "worker.pub", keys / "workers" / "worker.pub"));
    const fs::path admins = root / plan.sites[0].name / "keys" / "admins";
    std::error_code read_ec;
    for (const auto& f : fs::directory_iterator(admins, read_ec)) {
      if (f.path().extension() == ".pub") {
        ISTHMUS_RETURN_IF_ERROR(CopyPub(f.path(), keys / "admins" / f.path().filename()));
      }
    }
    if (read_ec) {
      return Status::IoError("cannot read '" + admins.string() + "': " + read_ec.message());
    }
    for (int i = 0; i < plan.shards; ++i) {
      const fs::path peers = keys / PeersDirName(i);
      ISTHMUS_RETURN_IF_ERROR(MakeDirs(peers));
      for (size_t t = 0; t < added; ++t) {
        const std::string other = ShardName(plan.sites[t], i);
        ISTHMUS_RETURN_IF_ERROR(CopyPub(root / plan.sites[t].name / "keys" / (other + ".pub"),
                                        peers / (other + ".pub")));
      }
      ISTHMUS_RETURN_IF_ERROR(
          WriteText(dir / (ShardName(s, i) + ".toml"), FleetShardToml(plan, added, i)));
    }
    ISTHMUS_RETURN_IF_ERROR(WriteText(dir / "worker.toml", WorkerToml(plan, s)));
    ISTHMUS_RETURN_IF_ERROR(WriteText(dir / "isthmusctl.env", CtlEnv(plan, s)));
    for (int i = 0; i < plan.shards; ++i) {
      const fs::path file = dir / (ShardName(s, i) + ".toml");
      if (auto c = CheckWithServerLoader(file.string(), {}); !c.ok()) {
        return Status::Internal("the server refuses the written " + file.string() + ": " +
                                c.message());
      }
    }
    return Status::Ok();
  }();
  if (!st.ok()) {
    drop_staged();
    return Status(st.code(), st.message() + " (the existing sites' files were not changed; " +
                                 dir.string() + " is incomplete: run again with --force)");
  }
  // Now the existing sites: the new shard keys on their peer allowlists, then their configs.
  for (const auto& e : edits) {
    if (st.ok()) st = CopyPub(e.pub_from, e.pub_to);
  }
  for (const auto& e : edits) {
    if (!st.ok()) break;
    st = RenameDurably(e.staged.string(), e.config.string());
  }
  drop_staged();
  if (!st.ok()) return st;
  const std::string summary = Summary(plan);
  ISTHMUS_RETURN_IF_ERROR(WriteText(root / "README.txt", summary));
  ISTHMUS_RETURN_IF_ERROR(WriteText(root / "fleet.json", FleetJson(plan).dump(2) + "\n"));
  return AddSiteSteps(plan);
}

void AddFleetAddSiteFlags(CLI::App* cmd, FleetAddOptions& o) {
  cmd->add_option("--out", o.out_dir, "the fleet's folder, as fleet init wrote it (fleet.json)")
      ->required();
  cmd->add_option("--site", o.site, "the new site's name")->required();
  cmd->add_option("--host", o.host,
                  "address of the new site's shard host (its worker and peer sockets bind to it; "
                  "the other sites dial it); default 127.0.0.1");
  cmd->add_option(
      "--base-port", o.base_port,
      "PORT: its shard i listens on base+10i (workers), base+10i+1 (admin, 127.0.0.1) "
      "and base+10i+2 (peers); default 7100, or the next free hundred on a shared host");
  cmd->add_option("--etc", o.etc_dir,
                  "where its folder will be on its hosts (default: as the fleet's other sites)");
  cmd->add_option("--data", o.data_dir,
                  "where its shards keep their data (default: as the fleet's other sites)");
  cmd->add_flag("--force", o.force,
                "replace the new site's folder left by an add-site that did not finish");
  cmd->footer(
      "Adds OUT/SITE/ (new keys, SITE-i.toml, worker.toml, isthmusctl.env), the new shard keys to "
      "every existing site's keys/peers-i/ and the new site to their SITE-i.toml sync.peers (no "
      "existing key changes; the rest of each file stays as it is), and rewrites README.txt and "
      "fleet.json; prints what each site does next. Exit 1 when the site is already in the fleet "
      "or a config cannot be edited (nothing is changed), 2 for bad options, 4 without "
      "OUT/fleet.json, 6 when a file cannot be written. docs/CLI.md, \"fleet add-site\"; "
      "walk-through: docs/DEPLOY.md, \"Adding a site\".\n" +
      ExitCodesFooter());
}

int CmdFleetAddSite(const FleetAddOptions& o) {
  auto plan = PlanAddSite(o);
  if (!plan.ok()) return Fail(plan.status());
  auto steps = WriteAddedSite(*plan);
  if (!steps.ok()) return Fail(steps.status());
  std::fputs(steps->c_str(), stdout);
  return 0;
}

}  // namespace isthmus::ctl
