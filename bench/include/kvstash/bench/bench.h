#pragma once

// `kvstash bench`: the benchmarks an operator runs against this machine's own limits, each
// printing its figures next to the limit measured in the same run (a table, or --json).

#include "CLI/CLI.hpp"

namespace kvstash::bench {

// Registers `bench` and its subcommands (ssd, transport, node, replay, peer, route) with `app`; the
// chosen one's exit code goes to *exit_code.
void AddBenchCommand(CLI::App& app, int* exit_code);

}  // namespace kvstash::bench
