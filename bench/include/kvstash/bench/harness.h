// The one benchmark harness every kvstash benchmark goes through (`kvstash bench
// ssd|transport|node|replay`, `kvstash-engine bench`, the Google Benchmark suites):
//
//   BenchSpec  what the bench reports: its figures (unit, which way is better, meaning) and its
//              ratios (a figure over the machine's own limit measured in the same run);
//   RunRounds  paired rounds: in each, the bench's side and the limit's side back to back,
//              alternating which goes first, so the machine's drift weighs on both;
//   Report     the rounds, plus the bench's settings and outcomes: each figure's median over
//              the rounds and each ratio as the median of the rounds' own ratios;
//   Print      the report as an aligned table or as one JSON object (--json), the same shape
//              for every bench;
//   Progress   lines on standard error for long runs, never on standard output.
//
// The JSON object, keys in this order:
//   "bench"        the bench's name ("ssd", "transport", ...);
//   settings and outcomes under the bench's own keys, in the order the bench sets them;
//   "rounds"       the number of rounds;
//   each figure    its median over the rounds that measured it (null if none did);
//   each ratio     the median of the rounds' ratios (null if no round had both figures);
//   "per_round"    {"order": ["kvstash,fio", ...] (which side ran first; benches with a limit
//                  side only), each figure and ratio: [one value or null per round]};
//   "rounds_<f>"   per-round arrays at the top level as well, for benches whose readers use them
//                  (BenchSpec::flat_round_keys; `kvstash bench transport`);
//   "figures"      {name: {"unit", "better": "higher"|"lower", and for a ratio "of" and "to"}}.
// Timings never decide a test: tests assert the shape and the arithmetic, not the numbers.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "kvstash/common/byte_units.h"
#include "kvstash/common/cli.h"
#include "kvstash/common/status.h"
#include "nlohmann/json.hpp"

namespace kvstash::bench {

using cli::kExitFailure;
using cli::kExitOk;
using cli::kExitUsage;

// Ordered, so a report's JSON lists its keys in the order documented above.
using Json = nlohmann::ordered_json;

// ---- measuring -------------------------------------------------------------------------------

// GB/s (1e9 bytes/s) for `bytes` moved in `elapsed`; 0 for an empty interval.
double Gbps(uint64_t bytes, std::chrono::steady_clock::duration elapsed);

// This machine's own limit for moving blocks through memory: GB/s of one thread copying
// `block_bytes` blocks into the slots of a region of `working_set_bytes` (at most 1 GiB), in a
// scattered order, as a node's tier receives them. The median of `rounds` rounds.
double CopyLimitGbps(size_t block_bytes, size_t working_set_bytes, int rounds = 5);

// The median; the mean of the middle two for an even count. Preconditions: !values.empty().
double Median(std::vector<double> values);

// The value at rank ceil(p/100 * n) of the sorted values (nearest-rank percentile), for p in
// (0, 100]; nullopt for no values.
std::optional<double> Percentile(std::vector<double> values, double p);

enum class Better : uint8_t { kHigher, kLower };

// A figure over the machine's limit oriented so that 1 is the limit and higher is better:
// figure / limit when the figure's higher is better (throughput), limit / figure when lower is
// (latency). nullopt unless both are positive: a limit measured as 0 GB/s or 0 us is a failed
// measurement, not a ratio of 0 or infinity.
std::optional<double> LimitRatio(double figure, double limit, Better better);

// ---- describing a bench ----------------------------------------------------------------------

// The most rounds a bench runs (--rounds).
inline constexpr int kMaxRounds = 1000;

// One figure a bench reports: measured once per round, reported as the median over rounds.
struct FigureSpec {
  std::string name;  // its JSON key and table row: "write_gbps"
  std::string unit;  // "GB/s", "us", "tokens/s"; empty for a plain number
  Better better = Better::kHigher;
  std::string help;  // what it is, for --help
};

// A figure over the machine's limit, both measured in the same round, oriented as LimitRatio.
// Both figures are better the same way.
struct RatioSpec {
  std::string name;            // its JSON key and table row: "write_ratio"
  std::string figure;          // the bench's figure
  std::string limit;           // the limit's figure
  std::string help;            // for --help; what is compared with what is said already
  std::optional<double> goal;  // shown in the table when the ratio falls below it
};

// What a bench reports (its configuration for the harness). Report::Create checks it: names
// unique across figures and ratios and none a key of the harness, ratios between figures of
// the spec.
struct BenchSpec {
  std::string name;     // JSON "bench": "ssd"
  std::string command;  // "kvstash bench ssd": the table's first line, progress lines
  std::string title;    // one line: what it measures, against which limit
  // The two sides of a paired round, for "kvstash first" / "fio first"; an empty limit: the
  // bench pairs inside each round itself (the Google Benchmark suites), and no order is shown.
  std::string subject = "kvstash";
  std::string limit;
  std::vector<FigureSpec> figures;
  std::vector<RatioSpec> ratios;
  bool flat_round_keys = false;  // also "rounds_order" and "rounds_<figure>" (see above)
};

// A figure where higher is better (throughput), one where lower is (latency, time), and a
// ratio `name` of `figure` to `limit`: the shapes every bench's spec is made of.
FigureSpec Higher(std::string name, std::string unit, std::string help);
FigureSpec Lower(std::string name, std::string unit, std::string help);
RatioSpec RatioOf(std::string name, std::string figure, std::string limit, std::string help = {},
                  std::optional<double> goal = std::nullopt);

// OK, or InvalidArgument saying what is wrong with the spec (the rules at BenchSpec).
Status ValidateSpec(const BenchSpec& spec);

// The figure or ratio named `name`, or null.
const FigureSpec* FindFigure(const BenchSpec& spec, std::string_view name);
const RatioSpec* FindRatio(const BenchSpec& spec, std::string_view name);

// The help text that says what every figure and ratio means, for a command's footer: one
// paragraph per name, wrapped to 100 columns.
std::string FiguresHelp(const BenchSpec& spec);

// ---- rounds ----------------------------------------------------------------------------------

// The figures of one round. A figure the round did not measure is absent (null in JSON, "-" in
// the table). Not thread-safe.
class Round {
 public:
  // `spec` must outlive the round. `number` counts from 1.
  Round(const BenchSpec& spec, int number, bool limit_first);

  int number() const { return number_; }
  bool limit_first() const { return limit_first_; }
  // "kvstash first", "fio first"; empty when the spec has no limit side.
  std::string OrderLabel() const;

  // Records a figure of the spec (a name it does not have is a programming error: the process
  // aborts saying which). nullopt leaves the figure absent.
  void Set(std::string_view figure, std::optional<double> value);
  std::optional<double> Get(std::string_view figure) const;
  // The ratio in this round (LimitRatio); nullopt unless both figures are present and positive.
  std::optional<double> RatioValue(const RatioSpec& ratio) const;
  // Whether the round was made with `spec` (the same object).
  bool IsOf(const BenchSpec& spec) const { return spec_ == &spec; }

 private:
  const BenchSpec* spec_;
  int number_;
  bool limit_first_;
  std::vector<std::optional<double>> values_;  // by the spec's figure index
};

// A bench's results: settings, outcomes and rounds, for Print. Neither copyable nor movable:
// its rounds point at its spec. Not thread-safe.
class Report {
 public:
  // InvalidArgument for a spec ValidateSpec refuses.
  static Result<std::unique_ptr<Report>> Create(BenchSpec spec);
  Report(const Report&) = delete;
  Report& operator=(const Report&) = delete;

  const BenchSpec& spec() const { return spec_; }

  // A setting or outcome under a stable JSON key (replaced if set before). A key that is also a
  // figure's, a ratio's or one the harness writes is a programming error (the process aborts).
  void Set(const std::string& key, Json value);
  // A line above the figures in the table ("block size: 64 KiB (65536 bytes)").
  void Heading(std::string label, std::string text);
  // A line below them (outcomes: "errors: 0").
  void Footing(std::string label, std::string text);

  // Appends a finished round, made with this report's spec() (another spec's round is a
  // programming error: the process aborts).
  void AddRound(Round round);
  const std::vector<Round>& rounds() const { return rounds_; }

  // The median over the rounds that measured it; nullopt if none did.
  std::optional<double> Median(std::string_view figure) const;
  // The median of the rounds' ratios; nullopt if no round had one.
  std::optional<double> RatioMedian(std::string_view ratio) const;

  Json ToJson() const;
  // The table: "<command>: <title>", the headings, "rounds: ...", the figures (rows: median,
  // unit and, with more than one round, every round; figures no round measured are left out),
  // then the footings. Ends with a newline.
  std::string ToTable() const;

 private:
  explicit Report(BenchSpec spec) : spec_(std::move(spec)) {}

  BenchSpec spec_;
  Json settings_ = Json::object();
  std::vector<std::pair<std::string, std::string>> headings_;
  std::vector<std::pair<std::string, std::string>> footings_;
  std::vector<Round> rounds_;
};

// ---- progress --------------------------------------------------------------------------------

struct ProgressOptions {
  using Clock = std::chrono::steady_clock;
  bool enabled = true;
  std::ostream* out = nullptr;  // null: standard error
  // Each line replaces the last ("\r", for a terminal) instead of starting a new one.
  bool overwrite = false;
  // At most one line per interval, the first once the run has lasted that long: a short run
  // prints nothing.
  std::chrono::milliseconds interval{1000};
  std::function<Clock::time_point()> now = Clock::now;
};

// Progress lines of a long run, "[  12.0s] text". Never standard output, so --json leaves it
// clean. Not thread-safe: one thread reports.
class Progress {
 public:
  explicit Progress(ProgressOptions options = {});
  // Enabled or not; overwriting when standard error is a terminal.
  static Progress ToStderr(bool enabled);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Shows `text` unless a line was shown less than an interval ago (or the run is younger than
  // one). Returns whether it was shown.
  bool Update(std::string_view text);
  // Ends an overwritten line, if one is showing; the next Update starts a new one.
  void Finish();
  // Seconds since construction.
  double elapsed_seconds() const;

 private:
  ProgressOptions options_;
  ProgressOptions::Clock::time_point start_;
  ProgressOptions::Clock::time_point last_;
  bool open_line_ = false;
};

// The two sides of a paired round. Each records its figures in the round it is given and
// returns an error to end the run.
struct RoundSides {
  std::function<Status(Round&)> measure;  // the bench's own side
  std::function<Status(Round&)> limit;    // the machine's limit; empty when skipped (--no-fio)
};

// Runs `rounds` paired rounds into `report`: each runs both sides back to back, the limit first
// in the even rounds (2, 4, ...). A progress line after each round (if due). The first side to
// fail ends the run: its status, its message prefixed with "round N: ". InvalidArgument, before
// anything runs, for rounds outside 1..kMaxRounds or no measuring side.
Status RunRounds(Report& report, int rounds, const RoundSides& sides, Progress& progress);

// ---- output ----------------------------------------------------------------------------------

struct OutputOptions {
  bool json = false;     // one JSON object on standard output instead of the table
  bool progress = true;  // progress lines on standard error
};

// Adds --json and --quiet (no progress lines) to a command.
void AddOutputFlags(CLI::App& command, OutputOptions* options);
// Adds --rounds (1..kMaxRounds, default *rounds), saying how the spec's rounds are paired.
CLI::Option* AddRoundsFlag(CLI::App& command, int* rounds, const BenchSpec& spec);

// Writes the report as the table or as one JSON object and a newline.
void Print(const Report& report, const OutputOptions& options, std::ostream& out);

// "1.23", "12.3", "1234", "0.000391": three significant digits at least; "-" for nullopt.
std::string FormatFigure(std::optional<double> value);

}  // namespace kvstash::bench
