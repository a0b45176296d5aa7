#include <fmt/format.h>

#include <fstream>
#include <iostream>
#include <memory>
#include <string>

#include "commands.h"
#include "kvstash/store/trace_replay.h"

namespace kvstash::cli {

void AddTraceCommand(CLI::App& app, int* exit_code) {
  auto file = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand(
      "trace",
      "Replay a block-manager policy trace and print one line per operation, to check the "
      "manager (LRU/ARC, two-phase stores, pins, lookups) against a reference transcript. "
      "Exits 2 on a malformed line, naming it.");
  cmd->add_option("file", *file, "Trace file to replay (standard input when omitted or '-')");
  cmd->footer(
      "Trace language: header lines `policy lru|arc`, `capacity N`, optional `threshold N` "
      "and `tracker N`; then operations lookup, prefix, window W, store, commit, abort, load, "
      "unload, touch (each followed by keys), events, state, reset. `#` starts a comment.");
  cmd->callback([file, exit_code] {
    const ErrorReporter errors("kvstash trace");
    std::ifstream stream;
    std::istream* in = &std::cin;
    std::string name = "<stdin>";
    if (!file->empty() && *file != "-") {
      stream.open(*file);
      if (!stream) {
        *exit_code = errors.Fail(kExitFailure, fmt::format("cannot open '{}'", *file));
        return;
      }
      in = &stream;
      name = *file;
    }
    Status status = store::ReplayTrace(*in, std::cout);
    std::cout.flush();
    if (!status.ok()) {
      *exit_code = errors.Fail(ExitCodeFor(status), fmt::format("{}: {}", name, status.message()));
      return;
    }
    *exit_code = kExitOk;
  });
}

}  // namespace kvstash::cli
