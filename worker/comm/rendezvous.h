// Rendezvous: how the ranks of a group find each other before they can talk. A small
// key-value store that every rank can reach, either a shared directory ("file:DIR", Gloo's
// FileStore) or a TCP server run by rank 0 ("tcp:HOST:PORT", written here because the
// Debian build of Gloo ships no TCP store, only file, in-process hash and Redis stores).
// Both communicators (Gloo's address exchange, NCCL's unique id) go through it.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace gloo::rendezvous {
class Store;
}

namespace isthmus::comm {

class PollableStore;  // rendezvous.cc: a store whose waits are timed by us

// A parsed rendezvous address.
struct RendezvousSpec {
  enum class Kind { kFile, kTcp };
  Kind kind = Kind::kFile;
  std::string dir;   // kFile: directory shared by all ranks (must exist)
  std::string host;  // kTcp: where rank 0 serves the store
  uint16_t port = 0;
};

// Parses "file:DIR" or "tcp:HOST:PORT" (HOST may be a bracketed IPv6 address).
Result<RendezvousSpec> ParseRendezvous(std::string_view spec);

// The key-value server behind "tcp:HOST:PORT". One thread ("comm-store") serves any number
// of clients; keys live in memory only. The protocol trusts its clients (it is meant for a
// site's private network, used for a few seconds at start-up) but bounds every frame, so a
// stray connection cannot make it allocate without limit.
class TcpStoreServer {
 public:
  // Binds host:port (port 0 picks a free port, see port()) and starts serving.
  static Result<std::unique_ptr<TcpStoreServer>> Start(const std::string& host, uint16_t port);
  // Stops the thread and closes every connection.
  ~TcpStoreServer();

  uint16_t port() const { return port_; }

 private:
  TcpStoreServer() = default;
  void Serve();

  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd that tells Serve() to stop
  uint16_t port_ = 0;
  struct Thread;
  std::unique_ptr<Thread> thread_;
};

// Everything a group needs from its rendezvous, scoped to one job: keys carry the job's
// prefix, and every wait gives up after the job's timeout.
//
// Thread-safety: one thread at a time. The store() object follows Gloo's contract (it
// throws gloo::IoException on timeout or I/O failure) because Gloo calls it; isthmus code
// uses Set/Get, which return Status.
class Rendezvous {
 public:
  // Opens the store named by `spec` for `rank`. For "tcp:" specs rank 0 starts the server
  // and every rank (0 included) connects to it as a client, retrying until `timeout`. Keys
  // left in a reused file store by an earlier launch under the same prefix would be read
  // as current: call AgreeOnLaunch before any other key.
  static Result<std::unique_ptr<Rendezvous>> Open(const std::string& spec, int rank,
                                                  const std::string& prefix,
                                                  std::chrono::milliseconds timeout);
  // Makes every later key of this launch its own: rank 0 draws a launch id and hands it to
  // each rank in answer to a fresh random nonce that rank wrote, and each rank confirms it,
  // so an answer, a nonce or a confirmation an earlier launch left in the store is never
  // taken for this launch's; from then on keys carry the launch id. Every rank of the group
  // must call it once, first. kTimeout, naming the ranks not heard from, when a rank does
  // not join within the timeout.
  Status AgreeOnLaunch(int rank, int world_size);
  // The launch id AgreeOnLaunch agreed on (empty before).
  const std::string& launch_id() const { return launch_id_; }
  ~Rendezvous();

  Status Set(const std::string& key, const std::vector<char>& value);
  // Waits up to the timeout for `key` to be set, then returns its value.
  Result<std::vector<char>> Get(const std::string& key);

  // The prefixed, time-bounded store in Gloo's interface. Valid while this object lives.
  gloo::rendezvous::Store& store();

  // Rank 0 of a "tcp:" rendezvous: stops serving. Call only once every rank is known to be
  // done with the store (after a barrier); later Set/Get on any rank fail.
  void StopServing();

 private:
  Rendezvous() = default;

  std::unique_ptr<TcpStoreServer> server_;
  std::unique_ptr<PollableStore> base_;
  std::unique_ptr<gloo::rendezvous::Store> scoped_;
  std::string prefix_;
  std::chrono::milliseconds timeout_{0};
  std::string launch_id_;
};

// Checks that every rank of the group joined with the same `kind` (e.g. "gloo (--device
// cpu)" or "nccl (--device cuda)"), before the group's own rendezvous: each rank writes its
// kind and reads everyone else's. FailedPrecondition naming both sides when they differ,
// so that a GPU rank and a CPU rank of one site fail at once and say why instead of
// waiting for keys the other kind never writes; kTimeout when a rank never joins.
Status AgreeOnKind(Rendezvous& rendezvous, int rank, int world_size, const std::string& kind);

// Checks that every rank of the group was launched with the same `settings`, the text of
// the launch settings that shape the collectives (e.g. "--bucket-mb 25"): ranks that
// bucket their gradients differently would run different collectives and end in a timeout
// or in garbage. FailedPrecondition naming both ranks and both values, before any
// collective starts.
Status AgreeOnSettings(Rendezvous& rendezvous, int rank, int world_size,
                       const std::string& settings);

// Checks that no two ranks of the group hold the same `device` (e.g. "host/GPU-uuid"):
// each rank writes its own and reads everyone else's. FailedPrecondition naming both
// ranks and the device when two share one, before any collective starts (NCCL would stop
// with "Duplicate GPU detected" or hang).
Status AgreeOnDistinctDevices(Rendezvous& rendezvous, int rank, int world_size,
                              const std::string& device);

// Converts an exception thrown by Gloo (or by a store on Gloo's behalf) into a Status:
// timeouts become kTimeout, other I/O failures kUnavailable, anything else kInternal.
// `what` names the operation, e.g. "allreduce".
Status StatusFromGlooException(std::string_view what, const std::exception& e);

}  // namespace isthmus::comm
