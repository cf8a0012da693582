// The in-site communicator: the one seam through which worker ranks of a site average their
// gradients every step. Two implementations sit behind it, Gloo over TCP for CPU ranks
// (gloo_communicator.h) and NCCL for GPU ranks (nccl_communicator.h); training code and
// tests see only this interface.
#pragma once

#include <chrono>
#include <cstddef>
#include <utility>
#include <vector>

#include "common/status.h"

namespace isthmus::comm {

// Collectives whose peers do not answer within this long fail with Code::kTimeout unless the
// factory is given another timeout.
inline constexpr std::chrono::milliseconds kDefaultTimeout{30'000};

// The multi-buffer all-reduce packs buffers smaller than this many bytes into one reduction.
inline constexpr size_t kDefaultFusionBytes = size_t{4} << 20;

// A group of `world_size()` ranks that run collectives together.
//
// Contract shared by every implementation:
//  - Collective: every rank of the group calls the same operations, in the same order, with
//    the same counts (and the same root). A mismatch is not detected; it ends in a timeout
//    or in garbage.
//  - Threads: a communicator belongs to one thread at a time. Calls on one communicator
//    must not overlap; distinct communicators may be used from distinct threads. Each rank
//    owns its own communicator object (ranks in one process, as in the tests, each create
//    their own).
//  - Memory: buffers are borrowed for the duration of the call only and written in place.
//    Which memory they live in is the implementation's business (host memory for Gloo,
//    device memory for NCCL).
//  - Failure: no call blocks forever. A peer that died, never joined or stopped calling
//    makes the call return Code::kTimeout within the configured timeout (or
//    Code::kUnavailable when the connection broke first). After any non-OK Status from a
//    collective the communicator is broken: the group may be inconsistent, so every later
//    call returns Code::kFailedPrecondition. Destroy it and create a new group.
//  - Determinism: on success, every rank holds bitwise identical results (the reduction is
//    computed once per element and then distributed), so replicas never drift apart.
class Communicator {
 public:
  virtual ~Communicator() = default;

  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // This rank's index in [0, world_size()).
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // data[i] becomes the sum over ranks of data[i]. count may be 0 (then nothing happens and
  // no peer is contacted, so all ranks must agree on 0).
  virtual Status AllReduceSum(float* data, size_t count) = 0;

  // data[i] becomes (sum over ranks of data[i]) / world_size().
  virtual Status AllReduceAverage(float* data, size_t count) = 0;

  // Averages every buffer of the list, as if AllReduceAverage were called on each, but packs
  // buffers smaller than the fusion size into few reductions (gradients come as many small
  // tensors, and per-call latency dominates them). Every rank passes the same list of
  // counts in the same order. The default implementation stages through host memory, so it
  // is valid only for implementations whose buffers are host memory; the NCCL one overrides
  // it. The sum order of a fused element may differ from the unfused call's, so the results
  // may differ from one-by-one calls in the last bit, but they are identical on all ranks.
  virtual Status AllReduceAverage(std::vector<std::pair<float*, size_t>> buffers);

  // As AllReduceAverage(data, count) with half the bytes on the wire: the values travel as
  // bf16 (each rank's rounded to nearest-even), partial sums are formed in fp32 and rounded
  // to bf16 between hops, and the sum comes back as fp32 divided by world_size(). Identical
  // on all ranks; within bf16 rounding of the fp32 average (a relative 2^-8 per addition).
  // One rank: data is left as it is.
  virtual Status AllReduceAverageBf16(float* data, size_t count) = 0;

  // Copies root's data[0, count) into every other rank's data. root in [0, world_size()).
  virtual Status Broadcast(float* data, size_t count, int root) = 0;

  // Each rank's part of `data` to every rank, in place: data holds world_size() parts one
  // after the other, part r being counts[r] elements (a count may be 0); every rank passes
  // the same counts. Rank r's part is its input; on return every part holds its owner's
  // values, bit for bit (the optimizer-state shards' updated parameters, ZeRO-1). The
  // default broadcasts each part from its owner in turn; NCCL groups those broadcasts.
  // InvalidArgument when counts has not world_size() entries.
  virtual Status AllGather(float* data, const std::vector<size_t>& counts);

  // Returns once every rank has entered Barrier (or on timeout).
  virtual Status Barrier() = 0;

 protected:
  Communicator() = default;

  // Bytes up to which the default multi-buffer all-reduce packs buffers together.
  virtual size_t FusionBytes() const { return kDefaultFusionBytes; }

  // The checks every implementation makes before collective `what` on `count` elements at
  // `data`: FailedPrecondition once `broken` (the error that broke the group) is set,
  // InvalidArgument for a null buffer with elements.
  static Status CheckCall(const char* what, const Status& broken, const float* data, size_t count);
  // InvalidArgument unless there is one AllGather part size per rank.
  Status CheckGatherCounts(const std::vector<size_t>& counts) const;
};

}  // namespace isthmus::comm
