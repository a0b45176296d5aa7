#pragma once

// `kvstash-engine bench`: prefill and decode tokens/s against this machine's own one-thread
// MatMul rate, in paired rounds through kvstash's benchmark harness (kvstash/bench/harness.h).

#include <cstddef>

#include "CLI/CLI.hpp"
#include "cli_common.h"
#include "kvstash/bench/harness.h"

namespace kvstash::engine::cli {

struct BenchFlags {
  ModelFlags model;
  size_t batch = 8;
  size_t prompt_len = 512;
  size_t decode_tokens = 64;
  int rounds = 3;
  bench::OutputOptions output;
};

// Registers the `bench` subcommand of `app`, its flags into *flags (which must outlive parsing).
CLI::App* AddBenchCommand(CLI::App& app, BenchFlags* flags);

// Runs it: the table or JSON on standard output; the exit code.
int RunBench(const BenchFlags& flags);

}  // namespace kvstash::engine::cli
