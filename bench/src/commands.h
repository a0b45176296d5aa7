#pragma once

// The subcommands of `kvstash bench`, each in its own file; AddBenchCommand registers them.

#include "CLI/CLI.hpp"

namespace kvstash::bench {

void AddBenchSsdCommand(CLI::App& bench, int* exit_code);
void AddBenchTransportCommand(CLI::App& bench, int* exit_code);
void AddBenchNodeCommand(CLI::App& bench, int* exit_code);
void AddBenchReplayCommand(CLI::App& bench, int* exit_code);
void AddBenchPeerCommand(CLI::App& bench, int* exit_code);
void AddBenchRouteCommand(CLI::App& bench, int* exit_code);

}  // namespace kvstash::bench
