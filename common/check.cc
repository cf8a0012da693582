// Release-build invariant checks and Status-returning number parsing (see check.h).
#include "common/check.h"

#include <charconv>
#include <cstdio>
#include <cstdlib>

namespace isthmus {

void CheckFailed(const char* file, int line, const char* condition, const std::string& message) {
  std::fprintf(stderr, "isthmus: %s:%d: check failed: %s: %s\n", file, line, condition,
               message.c_str());
  std::fflush(stderr);
  std::abort();
}

namespace {
template <typename T>
Result<T> ParseNumber(std::string_view text, const std::string& what) {
  T value{};
  const char* end = text.data() + text.size();
  auto [at, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || at != end) {
    return Status::InvalidArgument(what + ": \"" + std::string(text.substr(0, 40)) + "\" is not " +
                                   (std::is_signed_v<T> ? "an integer" : "a non-negative integer") +
                                   " in range");
  }
  return value;
}
}  // namespace

Result<int64_t> ParseInt64(std::string_view text, const std::string& what) {
  return ParseNumber<int64_t>(text, what);
}
Result<uint64_t> ParseUint64(std::string_view text, const std::string& what) {
  return ParseNumber<uint64_t>(text, what);
}

}  // namespace isthmus
