#include "kvstash/bench/bench.h"

#include "commands.h"

namespace kvstash::bench {

void AddBenchCommand(CLI::App& app, int* exit_code) {
  CLI::App* bench = app.add_subcommand(
      "bench",
      "Measure a component against the machine's own limit in the same run and print the ratio.");
  bench->require_subcommand(1);
  AddBenchSsdCommand(*bench, exit_code);
  AddBenchTransportCommand(*bench, exit_code);
  AddBenchNodeCommand(*bench, exit_code);
  AddBenchReplayCommand(*bench, exit_code);
  AddBenchPeerCommand(*bench, exit_code);
  AddBenchRouteCommand(*bench, exit_code);
}

}  // namespace kvstash::bench
