// Bucketed gradient all-reduce on a thread of its own (see the header).
#include "worker/comm/bucketed_all_reduce.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace isthmus::comm {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Status ReduceGradient(Communicator& comm, float* grads, size_t from, size_t to, size_t count,
                      bool bf16) {
  if (!bf16) return comm.AllReduceAverage(grads + from, to - from);
  const bool tail = to == count && to > from;
  const size_t end = tail ? to - 1 : to;
  if (end > from) ISTHMUS_RETURN_IF_ERROR(comm.AllReduceAverageBf16(grads + from, end - from));
  if (tail) return comm.AllReduceAverage(grads + count - 1, 1);
  return Status::Ok();
}

BucketedAllReduce::BucketedAllReduce(Communicator& comm, size_t bucket_bytes, bool bf16)
    : comm_(comm),
      bucket_elems_(std::max<size_t>(1, bucket_bytes / sizeof(float))),
      bf16_(bf16),
      thread_([this] { Loop(); }) {}

BucketedAllReduce::~BucketedAllReduce() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void BucketedAllReduce::Begin(float* grads, size_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  grads_ = grads;
  count_ = count;
  open_to_ = count;
  error_ = Status::Ok();
  step_ = BucketStats{};
}

void BucketedAllReduce::Final(size_t from, std::function<Status()> wait) {
  // The pieces come in the backend's order, so the latest wait covers every earlier piece.
  if (from >= open_to_ || (open_to_ - from < bucket_elems_ && from != 0)) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({from, open_to_, std::move(wait)});
    ++in_flight_;
  }
  open_to_ = from;
  wake_.notify_one();
}

Status BucketedAllReduce::End() {
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [this] { return in_flight_ == 0; });
  step_.exposed_seconds = SecondsSince(t0);
  last_ = step_;
  if (error_.ok() && open_to_ != 0) {
    return Status::Internal("gradient all-reduce: the backward handed over only [" +
                            std::to_string(open_to_) + ", " + std::to_string(count_) +
                            ") of the gradient");
  }
  return error_;
}

void BucketedAllReduce::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ with nothing left
    Bucket b = std::move(queue_.front());
    queue_.pop_front();
    const bool skip = !error_.ok();  // after a failure the group is broken: no more calls
    float* grads = grads_;
    const size_t count = count_;
    lock.unlock();
    Status st;
    double seconds = 0.0;
    if (!skip) {
      st = b.wait();
      const auto t0 = std::chrono::steady_clock::now();
      if (st.ok()) st = ReduceGradient(comm_, grads, b.from, b.to, count, bf16_);
      seconds = SecondsSince(t0);
    }
    b.wait = nullptr;  // releases the mark (a CUDA event) on this thread
    lock.lock();
    if (!st.ok() && error_.ok()) error_ = st;
    if (!skip) {
      ++step_.buckets;
      step_.reduce_seconds += seconds;
    }
    if (--in_flight_ == 0) done_.notify_all();
  }
}

}  // namespace isthmus::comm
