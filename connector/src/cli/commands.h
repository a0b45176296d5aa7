// Subcommands of the `kvstash` tool. Each Add* registers its subcommand with the app and
// returns the exit code slot the subcommand's callback fills.
#pragma once

#include "CLI/CLI.hpp"

namespace kvstash::cli {

// Exit codes shared by every subcommand.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;  // the operation failed (I/O, unreachable node, ...)
inline constexpr int kExitUsage = 2;    // bad arguments or malformed input

// `kvstash put|get|lookup|touch|stats --node HOST:PORT ...`.
void AddNodeCommands(CLI::App& app, int* exit_code);

// `kvstash trace [FILE]`.
void AddTraceCommand(CLI::App& app, int* exit_code);

// `kvstash bench ssd ...`; `bench` is the parent of every benchmark subcommand.
void AddBenchCommand(CLI::App& app, int* exit_code);

// `kvstash bench node ...`, a subcommand of `bench` (AddBenchCommand registers it).
void AddBenchNodeCommand(CLI::App& bench, int* exit_code);

// `kvstash bench replay ...`, a subcommand of `bench` (AddBenchCommand registers it).
void AddBenchReplayCommand(CLI::App& bench, int* exit_code);

// `kvstash bench transport ...`, a subcommand of `bench` (AddBenchCommand registers it).
void AddBenchTransportCommand(CLI::App& bench, int* exit_code);

}  // namespace kvstash::cli
