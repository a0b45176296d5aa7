// `kvstash`: the command-line tool for operators and developers of kvstash.
#include <iostream>

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
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kvstash::cli::kExitUsage;
  }
  return exit_code;
}
