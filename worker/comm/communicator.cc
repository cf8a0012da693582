// The host-memory multi-buffer all-reduce shared by communicators whose buffers live in host
// memory: small buffers are packed into one staging buffer per reduction.
#include "worker/comm/communicator.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace isthmus::comm {

Status Communicator::CheckCall(const char* what, const Status& broken, const float* data,
                               size_t count) {
  if (!broken.ok()) {
    return Status::FailedPrecondition(
        std::string(what) + ": communicator broken by an earlier error: " + broken.ToString());
  }
  if (data == nullptr && count > 0) {
    return Status::InvalidArgument(std::string(what) + ": null buffer with " +
                                   std::to_string(count) + " elements");
  }
  return Status::Ok();
}

Status Communicator::AllReduceAverage(std::vector<std::pair<float*, size_t>> buffers) {
  for (const auto& [ptr, count] : buffers) {
    if (ptr == nullptr && count > 0) {
      return Status::InvalidArgument("AllReduceAverage: null buffer with " + std::to_string(count) +
                                     " elements");
    }
  }
  const size_t fusion_floats = std::max<size_t>(1, FusionBytes() / sizeof(float));
  std::vector<float> staging;
  // Buffers [first, last) of the list are packed in staging, `packed` floats in all.
  size_t first = 0;
  size_t packed = 0;
  auto flush = [&](size_t last) -> Status {
    if (packed == 0) return Status::Ok();
    ISTHMUS_RETURN_IF_ERROR(AllReduceAverage(staging.data(), packed));
    size_t offset = 0;
    for (size_t i = first; i < last; ++i) {
      auto [ptr, count] = buffers[i];
      if (count > 0) std::memcpy(ptr, staging.data() + offset, count * sizeof(float));
      offset += count;
    }
    packed = 0;
    return Status::Ok();
  };
  for (size_t i = 0; i < buffers.size(); ++i) {
    auto [ptr, count] = buffers[i];
    if (count >= fusion_floats) {
      // Large enough to be bandwidth-bound on its own: reduce in place, no copy.
      ISTHMUS_RETURN_IF_ERROR(flush(i));
      ISTHMUS_RETURN_IF_ERROR(AllReduceAverage(ptr, count));
      first = i + 1;
      continue;
    }
    if (packed + count > fusion_floats) {
      ISTHMUS_RETURN_IF_ERROR(flush(i));
    }
    if (packed == 0) first = i;
    if (staging.size() < packed + count) staging.resize(fusion_floats);
    if (count > 0) std::memcpy(staging.data() + packed, ptr, count * sizeof(float));
    packed += count;
  }
  return flush(buffers.size());
}

Status Communicator::AllGather(float* data, const std::vector<size_t>& counts) {
  ISTHMUS_RETURN_IF_ERROR(CheckGatherCounts(counts));
  size_t offset = 0;
  for (int r = 0; r < world_size(); ++r) {
    ISTHMUS_RETURN_IF_ERROR(Broadcast(data + offset, counts[r], r));
    offset += counts[r];
  }
  return Status::Ok();
}

Status Communicator::CheckGatherCounts(const std::vector<size_t>& counts) const {
  if (counts.size() != static_cast<size_t>(world_size())) {
    return Status::InvalidArgument("AllGather: " + std::to_string(counts.size()) +
                                   " part sizes for " + std::to_string(world_size()) + " ranks");
  }
  return Status::Ok();
}

}  // namespace isthmus::comm
