// Runs one site's single shard as a real isthmus-server process for the multi-site tests:
// its own keys, ports (worker, admin, peer) and TOML config naming the other sites as
// peers, so several sites can run side by side on loopback with CURVE. Starting,
// stopping and clients come from ServerProcess.
#pragma once

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "tests/integration/server_process.h"

namespace isthmus::testing {

class SiteProcess : public ServerProcess {
 public:
  SiteProcess(std::string site, const std::filesystem::path& root)
      : ServerProcess(root / site, site, /*owns_dir=*/false), site_(std::move(site)) {
    peer_port_ = FreePort();
  }

  // Writes the config: every site in `all` other than this one is a peer. `extra_sync` is
  // added to the [sync] table (e.g. "outer_momentum = 0.9"). Sites named in `unlisted`
  // stay peers but their keys are left off security.peer_keys.
  void Configure(const std::vector<SiteProcess*>& all, const std::string& extra_sync = "",
                 const std::set<std::string>& unlisted = {}) {
    std::ofstream out(dir() / "server.toml");
    WriteBaseConfig(out, site_ + "-" + std::to_string(shard_index_), peer_port_, shard_index_);
    out << "peer_keys = [";
    bool first = true;
    for (auto* s : all) {
      if (s == this || unlisted.count(s->site_)) continue;
      out << (first ? "" : ", ") << "\"" << (s->dir() / "server.pub").string() << "\"";
      first = false;
    }
    out << "]\n[sync]\nsite = \"" << site_ << "\"\npeers = [";
    first = true;
    for (auto* s : all) {
      if (s == this) continue;
      out << (first ? "" : ", ") << "\"" << s->site_ << "=" << s->At(s->peer_port_) << "="
          << (s->dir() / "server.pub").string() << "\"";
      first = false;
    }
    out << "]\nresend_ms = 300\nbackoff_max_ms = 1500\n" << extra_sync << "\n";
  }

  // shard.index written by Configure (default 0: every site's only shard).
  void set_shard_index(int index) { shard_index_ = index; }
  const std::string& site() const { return site_; }
  std::string admin_endpoint() const { return At(admin_port()); }
  std::string worker_endpoint() const { return At(worker_port()); }
  std::string peer_endpoint() const { return At(peer_port_); }

 private:
  std::string site_;
  int peer_port_ = 0;
  int shard_index_ = 0;
};

}  // namespace isthmus::testing
