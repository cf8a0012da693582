// Work shared out among threads: each index of [0, n) once, the next free index taken by
// whichever thread finishes first (the codec's tensors, the round driver's chunks).
#pragma once

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace isthmus {

// Calls fn(i) for every i in [0, n) on up to `threads` threads: the caller's, and helpers
// named `name` (at most 15 characters) that live only for this call. Returns once every
// call has returned; fn must be safe to call from several threads at once.
template <typename Fn>
void ForEachIndex(size_t n, size_t threads, const char* name, const Fn& fn) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  const size_t helpers = n < 2 || threads < 2 ? 0 : std::min(threads, n) - 1;
  std::vector<std::thread> pool;
  pool.reserve(helpers);
  for (size_t h = 0; h < helpers; ++h) {
    pool.emplace_back([&work, name] {
      pthread_setname_np(pthread_self(), name);
      work();
    });
  }
  work();
  for (auto& th : pool) th.join();
}

}  // namespace isthmus
