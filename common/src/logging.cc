#include "kvstash/common/logging.h"

#include <string>

#include "spdlog/sinks/stdout_color_sinks.h"

namespace kvstash {

namespace internal {
spdlog::logger* Logger() {
  static spdlog::logger* const logger = [] {
    auto created = spdlog::stderr_color_mt("kvstash");
    created->set_level(spdlog::get_level());
    return created.get();  // the registry keeps it alive
  }();
  return logger;
}
}  // namespace internal

Status SetLogLevel(std::string_view level) {
  spdlog::level::level_enum parsed = spdlog::level::from_str(std::string(level));
  // from_str maps unknown names to `off`; only accept "off" when it was asked for.
  if (parsed == spdlog::level::off && level != "off") {
    return InvalidArgumentError(
        "unknown log level '{}' (expected trace, debug, info, warn, error, critical or off)",
        level);
  }
  spdlog::set_level(parsed);
  internal::Logger()->set_level(parsed);
  return Status::OK();
}

}  // namespace kvstash
