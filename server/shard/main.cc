// isthmus-server: one parameter-server shard, run as a systemd unit. Settings come from a
// TOML file, the environment and flags (server/config/config.h). Exit codes
// (common/exit_codes.h):
//   0 clean shutdown (SIGTERM/SIGINT)     2 bad flags or config (a value out of range,
//   3 key or permission problem             a plain job under sync.site)
//   4 a file the config names is missing  5 cannot bind a socket
//   6 storage damaged or failing (the data dir cannot be written, RocksDB)   1 anything else
#include <csignal>
#include <cstdio>
#include <iostream>

#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include "common/exit_codes.h"
#include "common/log.h"
#include "common/version.h"
#include "server/config/config.h"
#include "server/shard/server.h"

namespace {

isthmus::ShardServer* g_server = nullptr;

void OnSignal(int) {
  if (g_server != nullptr) g_server->RequestStop();  // async-signal-safe (eventfd write)
}

void OnHangup(int) {
  if (g_server != nullptr) g_server->RequestReload();  // async-signal-safe (eventfd write)
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "isthmus-server: a parameter-server shard of an isthmus site.\n"
      "Settings: every key of docs/CONFIG.md is a flag --section.name=VALUE, an\n"
      "environment variable ISTHMUS_SECTION_NAME, or a key in the --config file.\n"
      "Signals: SIGTERM or SIGINT stop it cleanly; SIGHUP reads the allowlists\n"
      "(security.worker_keys, admin_keys, peer_keys) again: added keys are admitted,\n"
      "removed keys refused and their open connections closed, without a restart;\n"
      "it also reads security.secret_key (a new own key is presented from then on)\n"
      "and the sync.peers key files (a peer rotating its key lists two)."};
  app.footer(isthmus::ExitCodesFooter());
  std::string config_file;
  bool print_doc = false, version = false;
  app.add_option("-c,--config", config_file, "TOML config file")->check(CLI::ExistingFile);
  app.add_flag("--print-config-doc", print_doc, "print the settings table (Markdown) and exit");
  app.add_flag("--version", version, "print the version and exit");
  std::map<std::string, std::string> overrides;
  std::vector<std::pair<std::string, std::string>> flag_values;
  flag_values.reserve(isthmus::ServerSettings().size());
  for (const auto& s : isthmus::ServerSettings()) {
    flag_values.emplace_back(s.key, "");
    app.add_option(isthmus::SettingFlag(s.key), flag_values.back().second,
                   s.doc + " [default: " + s.default_value +
                       (s.range.empty() ? "" : "; range: " + s.range) + "]");
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (version) {
    std::printf("isthmus-server %s\n", isthmus::kIsthmusVersion);
    return 0;
  }
  if (print_doc) {
    std::fputs(isthmus::ServerConfigDoc().c_str(), stdout);
    return 0;
  }
  for (size_t i = 0; i < flag_values.size(); ++i) {
    auto* opt = app.get_option(isthmus::SettingFlag(flag_values[i].first));
    if (opt->count() > 0) overrides[flag_values[i].first] = flag_values[i].second;
  }
  auto config = isthmus::LoadServerConfig(config_file, overrides);
  if (!config.ok()) {
    std::fprintf(stderr, "isthmus-server: %s\n", config.status().ToString().c_str());
    return isthmus::kExitUsage;
  }
  if (auto s = isthmus::InitLogging("isthmus-server", config->log_level); !s.ok()) {
    std::fprintf(stderr, "isthmus-server: %s\n", s.ToString().c_str());
    return isthmus::kExitUsage;
  }
  isthmus::ShardServer server(*config);
  g_server = &server;
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  struct sigaction hup {};
  hup.sa_handler = OnHangup;
  sigemptyset(&hup.sa_mask);
  sigaction(SIGHUP, &hup, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
  if (auto s = server.Start(); !s.ok()) {
    spdlog::error("cannot start: {}", s.ToString());
    return isthmus::ExitCodeForStatus(s);
  }
  auto s = server.Run();
  g_server = nullptr;
  if (!s.ok()) {
    spdlog::error("stopped: {}", s.ToString());
    return isthmus::ExitCodeForStatus(s);
  }
  spdlog::info("clean shutdown");
  return 0;
}
