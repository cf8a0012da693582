// The isthmus release version, reported by --version, hello replies and stats.
#pragma once

namespace isthmus {
inline constexpr const char* kIsthmusVersion = "0.1.0";
}  // namespace isthmus
