// Logging: spdlog to stderr (the journal adds timestamps under systemd, so the pattern is
// short). One call at start-up sets the level; everything else uses spdlog's free
// functions (spdlog::info, spdlog::warn, ...), which are thread-safe.
#pragma once

#include <string>

#include "common/status.h"

namespace isthmus {

// Sets the global logger to stderr with `level` ("trace", "debug", "info", "warn",
// "error", "off"). `program` prefixes every line.
Status InitLogging(const std::string& program, const std::string& level);

}  // namespace isthmus
