// The stored tensor record (see records.h).
#include "server/records.h"

#include <nlohmann/json.hpp>

#include "common/tensor.h"

namespace isthmus {

std::string EncodeTensorRecord(const TensorRecord& record) {
  return nlohmann::json{{"shape", record.shape}, {"version", record.version}}.dump();
}

Result<TensorRecord> DecodeTensorRecord(std::string_view text, const std::string& what) {
  const auto rec = nlohmann::json::parse(text, nullptr, false);
  TensorRecord out;
  bool ok = rec.is_object() && rec.contains("shape") && rec["shape"].is_array() &&
            (!rec.contains("version") || rec["version"].is_number_unsigned());
  for (const auto& d : ok ? rec["shape"] : nlohmann::json::array()) {
    ok = ok && d.is_number_integer();
    if (ok) out.shape.push_back(d.get<int64_t>());
  }
  if (!ok || NumElements(out.shape) < 0) return Status::Corruption(what + " is bad");
  if (rec.contains("version")) out.version = rec["version"].get<uint64_t>();
  return out;
}

}  // namespace isthmus
