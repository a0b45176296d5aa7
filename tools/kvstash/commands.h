// Subcommands of the `kvstash` tool. Each Add* registers its subcommand with the app and
// returns the exit code slot the subcommand's callback fills.
#pragma once

#include "CLI/CLI.hpp"
#include "kvstash/common/cli.h"

namespace kvstash::cli {

// `kvstash put|get|lookup|touch|stats --node HOST:PORT ...`.
void AddNodeCommands(CLI::App& app, int* exit_code);

// `kvstash trace [FILE]`.
void AddTraceCommand(CLI::App& app, int* exit_code);

}  // namespace kvstash::cli
