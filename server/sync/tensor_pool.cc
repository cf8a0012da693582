#include "server/sync/tensor_pool.h"

#include <algorithm>
#include <utility>

namespace isthmus {

std::shared_ptr<TensorPool> TensorPool::Create(uint64_t limit_bytes) {
  return std::shared_ptr<TensorPool>(new TensorPool(limit_bytes));
}

std::shared_ptr<std::vector<float>> TensorPool::Wrap(std::unique_ptr<std::vector<float>> v) {
  std::weak_ptr<TensorPool> home = weak_from_this();
  return std::shared_ptr<std::vector<float>>(v.release(), [home](std::vector<float>* p) {
    std::unique_ptr<std::vector<float>> owned(p);
    if (auto pool = home.lock()) pool->Give(std::move(owned));
  });
}

std::shared_ptr<std::vector<float>> TensorPool::Take(size_t n) {
  std::unique_ptr<std::vector<float>> v;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++taken_;
    auto it = free_.find(n);
    if (it != free_.end()) {
      v = std::move(it->second);
      free_.erase(it);
      held_bytes_ -= n * sizeof(float);
      ++recycled_;
    }
  }
  if (!v) v = std::make_unique<std::vector<float>>(n);
  return Wrap(std::move(v));
}

std::shared_ptr<std::vector<float>> TensorPool::TakeZeroed(size_t n) {
  auto v = Take(n);
  std::fill(v->begin(), v->end(), 0.0f);
  return v;
}

void TensorPool::Give(std::unique_ptr<std::vector<float>> v) {
  const uint64_t bytes = v->size() * sizeof(float);
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes == 0 || held_bytes_ + bytes > limit_bytes_) return;  // freed as `v` goes
  held_bytes_ += bytes;
  free_.emplace(v->size(), std::move(v));
}

void TensorPool::Reserve(const std::vector<size_t>& sizes) {
  for (size_t n : sizes) Give(std::make_unique<std::vector<float>>(n));  // zeroed: touched
}

void TensorPool::SetLimit(uint64_t limit_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  limit_bytes_ = limit_bytes;
  // Past the new limit, the largest buffers go first.
  while (held_bytes_ > limit_bytes_ && !free_.empty()) {
    auto last = std::prev(free_.end());
    held_bytes_ -= last->first * sizeof(float);
    free_.erase(last);
  }
}

TensorPool::Stats TensorPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {taken_, recycled_, held_bytes_};
}

}  // namespace isthmus
