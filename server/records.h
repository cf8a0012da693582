// The shard's stored tensor record (column kTensorMeta: "job \0 tensor" -> this record),
// with its one writer and its one reader. Used by the plain push path, job creation and
// the sync engine's commits alike.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace isthmus {

struct TensorRecord {
  std::vector<int64_t> shape;
  uint64_t version = 0;  // the job version at which the tensor last changed
};

// JSON: {"shape": [...], "version": N}.
std::string EncodeTensorRecord(const TensorRecord& record);
// Corruption naming `what` for anything but that: not JSON, a shape that is not an array
// of integers or whose element count is negative or huge, a version that is not an
// unsigned integer (a record without a version reads as version 0).
Result<TensorRecord> DecodeTensorRecord(std::string_view text, const std::string& what);

}  // namespace isthmus
