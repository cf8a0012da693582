// The CPU implementation of Communicator: Gloo collectives over its TCP transport, for
// worker ranks without a GPU (and for every test of the communication logic, which runs N
// ranks as threads of one process over loopback).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "common/status.h"
#include "worker/comm/communicator.h"

namespace isthmus::comm {

struct GlooOptions {
  int rank = 0;
  int world_size = 1;
  // Where ranks meet: "file:DIR" (a directory every rank can see, e.g. on a shared file
  // system) or "tcp:HOST:PORT" (rank 0 serves a small store there for the duration of the
  // rendezvous). See rendezvous.h.
  std::string rendezvous;
  // Address this rank's data connections bind to and advertise to peers. Must be reachable
  // from every other rank.
  std::string host = "127.0.0.1";
  // When non-empty, bind to this network interface (e.g. "eth0") instead of `host`.
  std::string iface;
  // Bound on the rendezvous and on every collective; a peer that does not answer within it
  // turns the call into Code::kTimeout.
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // Job id: separates the keys of jobs (and launches) sharing one rendezvous store.
  std::string prefix = "isthmus";
  // Launch settings every rank must share (AgreeOnSettings), e.g. "--bucket-mb 25"; empty:
  // none are checked.
  std::string settings;
  // Buffers smaller than this are packed together by the multi-buffer AllReduceAverage.
  size_t fusion_bytes = kDefaultFusionBytes;
};

// Joins the group described by `options`: blocks until all world_size ranks have reached
// the rendezvous and connected to each other (or returns kTimeout after options.timeout).
// Errors: kInvalidArgument for bad options, kNotFound for a missing rendezvous directory,
// kTimeout / kUnavailable when peers cannot be reached. The communicator owns its sockets
// and Gloo's network thread; it is destroyed by its owner like any unique_ptr.
Result<std::unique_ptr<Communicator>> CreateGlooCommunicator(const GlooOptions& options);

}  // namespace isthmus::comm
