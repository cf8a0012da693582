// The GPU implementation of Communicator: NCCL collectives on device memory, one rank per
// GPU. The group meets through the same rendezvous store as Gloo's (rendezvous.h) to share
// NCCL's unique id. Built only when CUDA and NCCL are found; otherwise the factory exists
// but returns kFailedPrecondition, so callers need no #ifdef.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "common/status.h"
#include "worker/comm/communicator.h"

namespace isthmus::comm {

struct NcclOptions {
  int rank = 0;
  int world_size = 1;
  // "file:DIR" or "tcp:HOST:PORT", as for Gloo (see rendezvous.h).
  std::string rendezvous;
  // CUDA device this rank uses; -1 picks rank % (number of visible devices). NCCL allows
  // at most one rank of a group per device.
  int device = -1;
  // Bound on joining the group and on every collective. On expiry the NCCL communicator is
  // aborted and the call returns kTimeout.
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // Job id: separates the keys of jobs (and launches) sharing one rendezvous store.
  std::string prefix = "isthmus";
  // Launch settings every rank must share (AgreeOnSettings), e.g. "--bucket-mb 25"; empty:
  // none are checked.
  std::string settings;
};

// True when this build contains the NCCL implementation.
bool NcclAvailable();

// Joins the group on options.device (made current on the calling thread). All buffers
// passed to the returned communicator are device pointers on that device. Every call is
// synchronous: it returns after the collective completed on the communicator's own stream
// (so results are visible to any later work on the device), or after the timeout.
// The multi-buffer AllReduceAverage launches one NCCL call per buffer inside one NCCL group,
// which NCCL fuses itself; no staging copies.
// Errors: kFailedPrecondition when built without NCCL or no device is present,
// kInvalidArgument for bad options, kTimeout when peers do not join or answer in time,
// kUnavailable / kInternal for NCCL and CUDA failures (message carries NCCL's text).
Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(const NcclOptions& options);

}  // namespace isthmus::comm
