// `kvstash`: the command-line tool for operators and developers of kvstash.
#include <optional>

#include "commands.h"
#include "kvstash/bench/bench.h"

int main(int argc, char** argv) {
  CLI::App app(
      "kvstash: a distributed KV-cache offload service for LLM inference.\n"
      "Subcommands talk to offload nodes, replay traces and run benchmarks.",
      "kvstash");
  app.require_subcommand(1);
  int exit_code = kvstash::cli::kExitOk;
  kvstash::cli::AddNodeCommands(app, &exit_code);
  kvstash::cli::AddTraceCommand(app, &exit_code);
  kvstash::bench::AddBenchCommand(app, &exit_code);
  // The subcommand runs in its callback, during the parse, and leaves its exit code.
  if (std::optional<int> exit = kvstash::cli::ParseCommandLine(app, argc, argv)) return *exit;
  return exit_code;
}
