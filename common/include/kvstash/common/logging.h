// Logging through spdlog. One process-wide logger writing to stderr; log an error once, where it
// is first classified, with the values involved.
//
//   KVSTASH_LOG_WARN("refused store of {} blocks: {}", n, status.ToString());
#pragma once

#include <string_view>

#include "kvstash/common/status.h"
#include "spdlog/spdlog.h"

namespace kvstash {

// Sets the level of the process logger: trace, debug, info, warn, error, critical or off.
// Returns InvalidArgument for any other name. Thread-safe.
Status SetLogLevel(std::string_view level);

namespace internal {
// The process logger (stderr; standard output belongs to the tools' results). Thread-safe.
spdlog::logger* Logger();
}  // namespace internal

}  // namespace kvstash

#define KVSTASH_LOG_TRACE(...) SPDLOG_LOGGER_TRACE(::kvstash::internal::Logger(), __VA_ARGS__)
#define KVSTASH_LOG_DEBUG(...) SPDLOG_LOGGER_DEBUG(::kvstash::internal::Logger(), __VA_ARGS__)
#define KVSTASH_LOG_INFO(...) SPDLOG_LOGGER_INFO(::kvstash::internal::Logger(), __VA_ARGS__)
#define KVSTASH_LOG_WARN(...) SPDLOG_LOGGER_WARN(::kvstash::internal::Logger(), __VA_ARGS__)
#define KVSTASH_LOG_ERROR(...) SPDLOG_LOGGER_ERROR(::kvstash::internal::Logger(), __VA_ARGS__)
