#pragma once

// The Google Benchmark suites' main, through the benchmark harness (kvstash/bench/harness.h):
// Google Benchmark runs the cases (its console lines go to standard error, as progress), and
// each case's counters become the harness's figures: "<case>:<figure>", the median over the
// repetitions (--rounds), with ratios to the machine's limit as medians of each repetition's
// own ratio. The same table or --json as every other kvstash benchmark, on standard output.
//
// Flags of every suite, before Google Benchmark's own (--benchmark_filter=..., ...):
//   --smoke      tiny sizes, so the suite cannot rot (ctest runs it)
//   --rounds N   repetitions of every case (--benchmark_repetitions=N); default 1
//   --json       one JSON object on standard output instead of the table
//   --quiet      no progress (Google Benchmark's console lines) on standard error
//   --help       what every figure means, then Google Benchmark's flags

#include <benchmark/benchmark.h>

#include <optional>
#include <string>
#include <vector>

#include "kvstash/bench/harness.h"

namespace kvstash::bench {

// A counter the suite's cases report, as the harness shows it.
struct CounterSpec {
  std::string counter;  // Google Benchmark's counter ("bytes_per_second", "ns_per_key")
  std::string figure;   // the figure's name; empty: the counter's
  std::string unit;
  Better better = Better::kHigher;
  // Shown value = counter x scale: 1e9 for the seconds per item of a kIsRate|kInvert counter
  // shown in ns, 1e-9 for bytes_per_second shown in GB/s.
  double scale = 1;
  std::string help;
};

struct SuiteSpec {
  std::string name;   // the program: "store_bench"
  std::string title;  // what it measures, against which limit
  std::string usage;  // --help's first paragraph (how the suite is run)
  std::vector<CounterSpec> counters;
  // Ratios between the figures of one case, by figure name; a case with both gets
  // "<case>:<ratio>", the median of each repetition's own ratio. A counter named as a ratio
  // (SetRatioCounters) is not a figure of its own: the harness derives the same value. Counters
  // not listed are shown as they are.
  std::vector<RatioSpec> ratios;
};

// Sets a case's own figure and the limit's, measured in the same iterations, as the counters
// `ratio.figure` and `ratio.limit` (CounterSpecs whose figures keep the counters' names), and
// their ratio (LimitRatio, so 1 is the limit) as the
// counter `ratio.name`: Google Benchmark's own output (its console lines, --benchmark_format)
// then carries the ratio too. No ratio counter when either figure is not positive.
void SetRatioCounters(benchmark::State& state, const RatioSpec& ratio, double figure, double limit,
                      Better better = Better::kHigher);

struct SuiteOptions {
  bool smoke = false;
  int rounds = 1;
  OutputOptions output;
};

// Takes the suite's flags out of argv into *options and hands the rest to Google Benchmark.
// Returns the exit code when the program should end now (0 after --help, 2 for a bad flag),
// else nullopt.
std::optional<int> InitSuite(int argc, char** argv, const SuiteSpec& spec, SuiteOptions* options);

// Runs the registered cases and prints the report. 0, or 1 when a case failed (it skipped with
// an error); timings never do.
int RunSuite(const SuiteSpec& spec, const SuiteOptions& options);

// When the suite cannot run here (no device): says why on standard error and prints an empty
// report ("skipped": why, in JSON) the same way. 0: nothing failed.
int ReportNothing(const SuiteSpec& spec, const SuiteOptions& options, const std::string& why);

}  // namespace kvstash::bench
