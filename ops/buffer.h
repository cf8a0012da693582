// Owning handles for backend memory (Buffer) and page-locked host staging memory
// (HostBuffer), so that the model and trainer hold device memory the way they held
// std::vector before: freed when the owner goes, movable, never copied. Also the counter
// backends keep of what their Alloc holds.
#pragma once

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "common/status.h"
#include "ops/ops.h"

namespace isthmus::ops {

// `bytes` of memory from ops.Alloc (kHost false: backend memory) or ops.AllocHost (kHost
// true: page-locked host memory, the side of UploadAsync/DownloadAsync on the host), given
// back when the handle goes. The Ops object must outlive the handle.
template <bool kHost>
class BasicBuffer {
 public:
  BasicBuffer() = default;
  // ResourceExhausted (from the backend, saying how much was asked and is free) when the
  // memory is not there.
  static Result<BasicBuffer> Allocate(Ops& ops, size_t bytes) {
    ISTHMUS_ASSIGN_OR_RETURN(void* p, kHost ? ops.AllocHost(bytes) : ops.Alloc(bytes));
    return BasicBuffer(&ops, p, bytes);
  }
  ~BasicBuffer() { Reset(); }
  BasicBuffer(BasicBuffer&& o) noexcept { *this = std::move(o); }
  BasicBuffer& operator=(BasicBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      std::swap(ops_, o.ops_);
      std::swap(data_, o.data_);
      std::swap(bytes_, o.bytes_);
    }
    return *this;
  }
  BasicBuffer(const BasicBuffer&) = delete;
  BasicBuffer& operator=(const BasicBuffer&) = delete;

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }
  void Reset() {
    if (data_ != nullptr) {
      if (kHost) {
        ops_->FreeHost(data_);
      } else {
        ops_->Free(data_);
      }
    }
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  BasicBuffer(Ops* ops, void* data, size_t bytes) : ops_(ops), data_(data), bytes_(bytes) {}
  Ops* ops_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// What a backend's Alloc holds now and at most (MemoryInfo::allocated, peak_allocated).
// Thread-safe: Memory() may be read from any thread.
class AllocationCounter {
 public:
  void Added(void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    sizes_[p] = bytes;
    allocated_ += bytes;
    peak_ = std::max(peak_, allocated_);
  }
  void Removed(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sizes_.find(p);
    if (it == sizes_.end()) return;
    allocated_ -= it->second;
    sizes_.erase(it);
  }
  // Fills info->allocated and info->peak_allocated.
  void Fill(MemoryInfo* info) const {
    std::lock_guard<std::mutex> lock(mu_);
    info->allocated = allocated_;
    info->peak_allocated = peak_;
  }

 private:
  mutable std::mutex mu_;
  std::unordered_map<void*, size_t> sizes_;
  size_t allocated_ = 0;
  size_t peak_ = 0;
};

using Buffer = BasicBuffer<false>;
using HostBuffer = BasicBuffer<true>;

}  // namespace isthmus::ops
