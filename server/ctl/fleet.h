// `isthmusctl fleet init`: writes everything a fleet of sites needs before its shards can
// start: every CURVE key pair, the per-role allowlist folders, one isthmus-server TOML per
// shard with consistent shard.index and sync.peers, a worker TOML and an isthmusctl env file
// per site, and a summary (README.txt, fleet.json) saying which folder goes where and which
// ports to open. PlanFleet checks the options and writes nothing; WriteFleet writes a plan.
// `fleet add-site` reads the plan back from fleet.json and adds one site to it without
// touching any existing key (PlanAddSite, WriteAddedSite).
// docs/CLI.md ("fleet init", "fleet add-site") and docs/DEPLOY.md ("Bootstrap a fleet",
// "Adding a site") are the reference.
//
// Layout of OUT (one folder per site, meant to become /etc/isthmus on its shard host):
//   OUT/README.txt, OUT/fleet.json           the summary
//   OUT/admin/admin.key, admin.pub           the operator's admin key pair (not for /etc)
//   OUT/SITE/SITE-I.toml                     shard I (isthmus-server@SITE-I reads it)
//   OUT/SITE/worker.toml                     isthmus-worker train --config
//   OUT/SITE/isthmusctl.env                  ISTHMUS_CTL_SERVERS, _SERVER_KEYS, _KEY
//   OUT/SITE/keys/SITE-I.key, .pub           shard key pairs (.key mode 0600)
//   OUT/SITE/keys/worker.key, .pub           the key pair of the site's worker ranks
//   OUT/SITE/keys/workers/, admins/, peers-I/  allowlists: *.pub only
// Shard I of a site listens on base+10I (workers), base+10I+1 (admin, 127.0.0.1 only),
// base+10I+2 (peers) and, with --metrics, base+10I+3 (Prometheus, 127.0.0.1 only).
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace isthmus::ctl {

inline constexpr int kFleetDefaultBasePort = 7100;
inline constexpr int kFleetPortsPerShard = 10;  // shard I: base + 10 I + {0, 1, 2}

struct FleetOptions {
  std::vector<std::string> sites;        // --sites A,B
  int shards = 0;                        // --shards N, per site
  std::string out_dir;                   // --out DIR
  std::vector<std::string> hosts;        // --host SITE=ADDR (default 127.0.0.1)
  std::vector<std::string> base_ports;   // --base-port PORT or SITE=PORT
  std::string etc_dir = "/etc/isthmus";  // {site} is replaced by the site's name
  std::string data_dir = "/var/lib/isthmus";
  std::vector<std::string> settings;  // --set KEY=VALUE, into every shard TOML
  // Where the admin key pair file will be on the machine that runs isthmusctl (written into
  // the env files; $HOME is expanded when the file is sourced).
  std::string operator_key = "$HOME/.config/isthmus/admin.key";
  std::string job;       // the job name for worker.toml; empty: a placeholder
  bool metrics = false;  // listen.metrics on 127.0.0.1:base+10i+3
  bool force = false;
};

struct FleetSite {
  std::string name;
  std::string host;  // address its worker and peer sockets bind to and peers dial
  int base_port = 0;
  std::string etc_dir;   // {site} replaced
  std::string data_dir;  // {site} replaced
  bool added = false;    // by fleet add-site: it joins the running jobs instead of creating them
  int WorkerPort(int shard) const { return base_port + kFleetPortsPerShard * shard; }
  int AdminPort(int shard) const { return WorkerPort(shard) + 1; }
  int PeerPort(int shard) const { return WorkerPort(shard) + 2; }
  int MetricsPort(int shard) const { return WorkerPort(shard) + 3; }
};

struct FleetPlan {
  std::vector<FleetSite> sites;  // in --sites order
  int shards = 0;
  std::string out_dir;
  // --set settings in the server's table order: key -> TOML value text.
  std::vector<std::pair<std::string, std::string>> settings;
  std::string dial = "auto";  // sync.dial of every shard
  std::string operator_key;
  std::string job;
  bool metrics = false;
  bool force = false;
  // The last port a site's shards use, from base.
  int PortSpan() const { return kFleetPortsPerShard * (shards - 1) + (metrics ? 3 : 2); }
};

// Checks the options against the server's rules (site names, settings table and
// validation, the codec pipelines) and lays out hosts and ports. InvalidArgument saying
// what to change; nothing is written.
Result<FleetPlan> PlanFleet(const FleetOptions& options);

// The isthmus-server TOML of shard `shard` of plan.sites[site].
std::string FleetShardToml(const FleetPlan& plan, size_t site, int shard);

// Writes the plan into plan.out_dir (see the layout above) and returns the summary, also
// written as README.txt. AlreadyExists when the folder is not empty and !plan.force; with
// force, the sites' keys/ folders and admin/ are replaced (no stale key stays on an
// allowlist) and the other files overwritten. Every shard TOML is loaded back with the
// server's config loader before it returns.
Result<std::string> WriteFleet(const FleetPlan& plan);

// Adds fleet init's flags to `cmd`, bound to `o`.
void AddFleetInitFlags(CLI::App* cmd, FleetOptions& o);

// PlanFleet + WriteFleet, printing the summary. Exit codes: 0; 2 bad options; 1 when OUT is
// not empty (without --force) or a file cannot be written.
int CmdFleetInit(const FleetOptions& o);

// `isthmusctl fleet add-site`: one more site in a fleet fleet init wrote, with keys of its own
// and no existing key changed (docs/DEPLOY.md, "Adding a site").
struct FleetAddOptions {
  std::string out_dir;    // --out DIR: the folder fleet init wrote (its fleet.json)
  std::string site;       // --site NAME
  std::string host;       // --host ADDR (default 127.0.0.1)
  std::string base_port;  // --base-port PORT (default: as fleet init lays ports out)
  std::string etc_dir;    // --etc, --data: default the pattern the fleet's sites follow
  std::string data_dir;
  bool force = false;  // replace the folder of an add-site that did not finish
};

// The plan fleet init recorded in OUT/fleet.json (sites, hosts, ports, folders, settings,
// sync.dial, the operator key, metrics, the job). NotFound without the file, InvalidArgument
// for one that is not fleet init's.
Result<FleetPlan> ReadFleet(const std::string& out_dir);

// The fleet's plan with the new site last, checked as PlanFleet checks (name, host, folders,
// ports). AlreadyExists when the fleet has the site already; nothing is written.
Result<FleetPlan> PlanAddSite(const FleetAddOptions& o);

// Writes the last site of `plan` (from PlanAddSite) into plan.out_dir: its folder as fleet
// init writes a site's (new shard and worker key pairs, the first site's admin allowlist, the
// other sites' shard keys on its peer allowlists, configs), each existing site's new peer key
// (keys/peers-I/NEW-I.pub) and sync.peers entry (added to the file as it is: an operator's
// edits stay), then README.txt and fleet.json. Every config is loaded back with the server's
// loader, and the existing sites' files change only once everything else is written and
// checked (AlreadyExists for a leftover folder without plan.force, FailedPrecondition for a
// config it cannot edit: nothing changed). Returns what each site does next.
Result<std::string> WriteAddedSite(const FleetPlan& plan);

void AddFleetAddSiteFlags(CLI::App* cmd, FleetAddOptions& o);

// PlanAddSite + WriteAddedSite, printing the steps. Exit codes: 0; 1 the site exists or a
// config cannot be edited; 2 bad options; 4 no fleet.json; 6 a file cannot be written.
int CmdFleetAddSite(const FleetAddOptions& o);

}  // namespace isthmus::ctl
