// The gradient all-reduce of a site in buckets that start while the backward still runs,
// as PyTorch DDP does: the trainer hands over each piece of the flat gradient as it becomes
// final (GradientSink), pieces gather into a bucket until it holds bucket_bytes, and a
// thread of the communicator's own averages each full bucket across the ranks while the
// training thread enqueues the rest of the backward. The buckets follow from the model's
// layout and the bucket size alone, so every rank reduces the same ranges in the same
// order (the communicator's contract). On CUDA each piece's wait is an event on the
// compute stream (Ops::Mark), so the reducing thread sleeps until the kernels that wrote
// the bucket have run; the training thread never waits for the network before End().
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "common/gradient_sink.h"
#include "common/status.h"
#include "worker/comm/communicator.h"

namespace isthmus::comm {

// What the last step's reduction cost.
struct BucketStats {
  int buckets = 0;               // reductions
  double reduce_seconds = 0.0;   // wall time the reductions took on the reducing thread
  double exposed_seconds = 0.0;  // wall time End() waited for them: the part the backward
                                 // did not hide (on the CPU; on a GPU it also holds the
                                 // backward's kernels still queued when End() was called)
};

// Averages grads[from, to) of a gradient of `count` floats over `comm`'s ranks, in fp32, or
// with `bf16` in bf16 except the gradient's last float (the trainer's control value, an
// exact small integer code), which then takes one more fp32 all-reduce of its own.
Status ReduceGradient(Communicator& comm, float* grads, size_t from, size_t to, size_t count,
                      bool bf16);

class BucketedAllReduce final : public GradientSink {
 public:
  // The bucket size a site gets unless told otherwise (PyTorch DDP's default, 25 MiB).
  static constexpr size_t kDefaultBucketBytes = size_t{25} << 20;

  // Averages gradients over `comm`'s ranks, in buckets of at least `bucket_bytes` (> 0; a
  // bucket closes at the first piece that makes it that large, and the last one takes what
  // is left). `comm` must outlive this object and is used only by its thread between
  // Begin and End; the caller runs no collective of its own on it meanwhile. With `bf16`
  // the buckets travel in bf16 (Communicator::AllReduceAverageBf16), except the
  // gradient's last float, the trainer's control value, which must stay exact and is
  // averaged in fp32 (ReduceGradient).
  BucketedAllReduce(Communicator& comm, size_t bucket_bytes, bool bf16 = false);
  ~BucketedAllReduce() override;

  BucketedAllReduce(const BucketedAllReduce&) = delete;
  BucketedAllReduce& operator=(const BucketedAllReduce&) = delete;

  void Begin(float* grads, size_t count) override;
  void Final(size_t from, std::function<Status()> wait) override;
  Status End() override;

  const BucketStats& last() const { return last_; }

 private:
  struct Bucket {
    size_t from = 0, to = 0;
    std::function<Status()> wait;
  };
  void Loop();

  Communicator& comm_;
  const size_t bucket_elems_;
  const bool bf16_;
  float* grads_ = nullptr;
  size_t count_ = 0;
  size_t open_to_ = 0;  // end of the final elements not yet in a bucket

  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::deque<Bucket> queue_;  // guarded by mu_
  int in_flight_ = 0;         // buckets queued or running; guarded by mu_
  bool stop_ = false;         // guarded by mu_
  Status error_;              // the first failure of the step; guarded by mu_
  BucketStats step_;          // guarded by mu_
  BucketStats last_;          // the training thread's copy after End
  std::thread thread_;
};

}  // namespace isthmus::comm
