// Buffers for the tensors a commit makes, recycled. A commit writes every value of its new
// theta and momentum (and of each tensor's merge), so a buffer that an older state has let
// go (no pull reply, view or state write holds it any more) can serve the next commit in
// place of fresh pages, which the kernel must fault in and zero: in full mode 683 MB a
// commit, most of it the 154 MB tensors that glibc maps afresh for every allocation
// (docs/SYNC.md, "Commit rule").
//
// Threads: any. A buffer comes back when its last reference goes, on whichever thread
// drops it (a reply's sender, a state write's thread); the pool locks around its list.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace isthmus {

class TensorPool : public std::enable_shared_from_this<TensorPool> {
 public:
  struct Stats {
    uint64_t taken = 0;     // buffers handed out
    uint64_t recycled = 0;  // of those, buffers that came back from an older state
    uint64_t held_bytes = 0;
  };

  // Holds at most `limit_bytes` of returned buffers; one beyond that is freed.
  static std::shared_ptr<TensorPool> Create(uint64_t limit_bytes);

  // A buffer of n floats whose values are unspecified: the caller writes every one. When
  // its last reference goes it comes back here, or is freed when the pool is full or gone.
  std::shared_ptr<std::vector<float>> Take(size_t n);
  // The same, every value 0.
  std::shared_ptr<std::vector<float>> TakeZeroed(size_t n);
  // Puts buffers of these sizes in the pool now, their pages touched, so that the first
  // commits take no fresh memory; counts against the limit like any returned buffer.
  void Reserve(const std::vector<size_t>& sizes);
  void SetLimit(uint64_t limit_bytes);
  Stats stats() const;

 private:
  explicit TensorPool(uint64_t limit_bytes) : limit_bytes_(limit_bytes) {}
  void Give(std::unique_ptr<std::vector<float>> v);
  std::shared_ptr<std::vector<float>> Wrap(std::unique_ptr<std::vector<float>> v);

  mutable std::mutex mu_;
  std::multimap<size_t, std::unique_ptr<std::vector<float>>> free_;  // by size
  uint64_t limit_bytes_;
  uint64_t held_bytes_ = 0;
  uint64_t taken_ = 0;
  uint64_t recycled_ = 0;
};

}  // namespace isthmus
