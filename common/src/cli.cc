#include "kvstash/common/cli.h"

#include <fmt/format.h>

#include <cstdio>

namespace kvstash::cli {

int ExitCodeFor(const Status& status) {
  return status.code() == StatusCode::kInvalidArgument ? kExitUsage : kExitFailure;
}

int ErrorReporter::Fail(int code, std::string_view message) const {
  const std::string line = fmt::format("{}: {}\n", name_, message);
  std::fwrite(line.data(), 1, line.size(), stderr);
  return code;
}

int ErrorReporter::Fail(const Status& status) const {
  return Fail(ExitCodeFor(status), status.message());
}

}  // namespace kvstash::cli
