// The isthmus-server process body: binds the worker and admin sockets (CURVE with ZAP
// allowlists unless insecure), runs the single event-loop thread that feeds requests to
// the Shard, and stops cleanly when asked. Kept apart from main() so that one process can
// host a server for tests and benchmarks.
//
// Threads: Run() is the event loop ("shard" thread, the caller's); ZeroMQ adds its I/O
// threads and the ZAP handler one more. RequestStop() and RequestReload() are
// async-signal-safe and may be called from any thread or a signal handler.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "common/status.h"
#include "server/config/config.h"

namespace isthmus {

class ShardServer {
 public:
  explicit ShardServer(ServerConfig config);
  ~ShardServer();

  // Opens storage, loads keys, binds sockets. Errors say which setting to fix.
  Status Start();
  // Serves until RequestStop(); returns OK after a clean shutdown.
  Status Run();
  // Async-signal-safe: wakes the loop, which finishes the request in hand and returns.
  void RequestStop();
  // Async-signal-safe (SIGHUP): the loop reads the allowlists (security.worker_keys,
  // admin_keys, peer_keys) again from their key files, between two requests. Added keys
  // are admitted from their next handshake; removed ones are refused at once and their open
  // connections closed (docs/OPERATIONS.md, "Rotating and revoking keys").
  void RequestReload();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The data-dir layout: <data_dir>/db is the live RocksDB, <data_dir>/snapshots holds
// checkpoints. Finishes a restore interrupted by a crash (see server.cc).
std::string LiveDbDir(const std::string& data_dir);
std::string SnapshotDir(const std::string& data_dir);

}  // namespace isthmus
