#include "kvstash/common/cli.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
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

std::optional<int> ParseCommandLine(CLI::App& app, int argc, const char* const* argv) {
  try {
    app.parse(argc, argv);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    // --help (and --help-all) are ParseErrors that exit 0: CLI11 prints the help asked for.
    if (e.get_exit_code() == 0) {
      app.exit(e);
      return kExitOk;
    }
    // The command whose flags were wrong, subcommands included: where --help says more.
    std::string command = app.get_name();
    for (const CLI::App* at = &app; !at->get_subcommands().empty();) {
      at = at->get_subcommands().front();
      command += " " + at->get_name();
    }
    return ErrorReporter(app.get_name())
        .Fail(kExitUsage, fmt::format("{} (see {} --help)", e.what(), command));
  }
}

}  // namespace kvstash::cli
