// Sets up spdlog for daemons and tools alike: stderr only, level by name.
#include "common/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

namespace isthmus {

Status InitLogging(const std::string& program, const std::string& level) {
  auto lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    return Status::InvalidArgument("unknown log level '" + level +
                                   "' (use trace, debug, info, warn, error or off)");
  }
  auto logger = spdlog::stderr_color_mt(program);
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %n %^%l%$ %v");
  logger->set_level(lvl);
  spdlog::set_default_logger(logger);
  return Status::Ok();
}

}  // namespace isthmus
