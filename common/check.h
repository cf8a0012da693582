// Invariant checks that stay in release builds, and parsing of numbers from stored or
// received text that returns a Status instead of throwing.
//
// ISTHMUS_CHECK(cond, message) guards memory and state: when `cond` is false it prints
// "isthmus: FILE:LINE: check failed: COND: MESSAGE" on stderr and aborts. Use it where
// going on would read or write out of bounds or corrupt state (a bug in isthmus), never
// for bad input, which gets a Status. NDEBUG does not remove it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace isthmus {

[[noreturn]] void CheckFailed(const char* file, int line, const char* condition,
                              const std::string& message);

// The decimal integer that is all of `text` (optional leading '-' for ParseInt64);
// InvalidArgument naming `what` otherwise (empty, other characters, out of range).
Result<int64_t> ParseInt64(std::string_view text, const std::string& what);
Result<uint64_t> ParseUint64(std::string_view text, const std::string& what);

}  // namespace isthmus

#define ISTHMUS_CHECK(cond, message)                                           \
  do {                                                                         \
    if (!(cond)) ::isthmus::CheckFailed(__FILE__, __LINE__, #cond, (message)); \
  } while (0)
