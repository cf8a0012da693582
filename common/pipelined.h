// Two passes over a sequence of large items, the second overlapping the first: produce(i)
// runs for i = 0, 1, ... in order on the calling thread while consume(i) runs on a helper
// thread, in order, as soon as produce(i) has returned. A commit's outer step and the
// digest of its result (docs/SYNC.md, "Commit rule") take about the longer pass's time
// instead of the sum of both on a host with a core to spare, with the same result as the
// two passes one after the other.
//
// produce stays on the caller's thread because it allocates: glibc serves a second thread
// from another malloc arena, which it trims as buffers are freed, so every commit would
// fault its hundreds of MB in again (bench_commit, GPT-2 small in full mode: with the step
// on the helper the pipelined commit took 2.3x the passes' time in turn; with it here,
// 0.63-0.74x).
//
// Threads: consume runs on one helper thread, one call at a time. consume(j) and
// produce(i) for i > j run at the same time: they must not touch the same data, except
// what produce(j) finished writing (the hand-over orders those writes before consume(j)).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>

#include "common/status.h"

namespace isthmus {

// Returns the first failure of produce, after which neither produce nor consume is called
// for any later index (nor consume for the failed one); OK once every index was consumed.
// With one item or one CPU, both passes run here, one item at a time.
inline Status Pipelined(size_t n, const std::function<Status(size_t)>& produce,
                        const std::function<void(size_t)>& consume) {
  if (n < 2 || std::thread::hardware_concurrency() < 2) {
    for (size_t i = 0; i < n; ++i) {
      ISTHMUS_RETURN_IF_ERROR(produce(i));
      consume(i);
    }
    return Status::Ok();
  }
  std::mutex m;
  std::condition_variable cv;
  size_t produced = 0;   // produce(0 .. produced-1) returned OK
  bool stopped = false;  // produce(produced) failed
  std::thread helper([&] {
    for (size_t i = 0; i < n; ++i) {
      std::unique_lock lk(m);
      cv.wait(lk, [&] { return produced > i || stopped; });
      if (produced <= i) return;  // produce(i) failed
      lk.unlock();
      consume(i);
    }
  });
  auto hand_over = [&](bool ok, size_t i) {
    {
      std::lock_guard lk(m);
      if (ok) {
        produced = i + 1;
      } else {
        stopped = true;
      }
    }
    cv.notify_one();
  };
  Status failed;
  try {
    for (size_t i = 0; i < n && failed.ok(); ++i) {
      failed = produce(i);
      hand_over(failed.ok(), i);
    }
  } catch (...) {  // e.g. std::bad_alloc: the helper stops before it goes up the stack
    hand_over(false, 0);
    helper.join();
    throw;
  }
  helper.join();
  return failed;
}

}  // namespace isthmus
