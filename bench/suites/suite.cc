#include "suite.h"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <string_view>
#include <utility>

#include "fmt/format.h"

namespace kvstash::bench {
namespace {

// One case's repetitions as Google Benchmark reported them.
struct CaseRuns {
  std::string name;
  std::vector<std::map<std::string, double>> repetitions;  // counter -> value
  std::string error;                                       // the first error, if any
};

// Collects every repetition of every case; forwards everything to a console reporter on
// standard error when progress is wanted.
class SuiteReporter : public benchmark::BenchmarkReporter {
 public:
  explicit SuiteReporter(bool progress)
      : progress_(progress), console_(benchmark::ConsoleReporter::OO_Tabular) {
    console_.SetOutputStream(&std::cerr);
    console_.SetErrorStream(&std::cerr);
  }

  bool ReportContext(const Context& context) override {
    return progress_ ? console_.ReportContext(context) : true;
  }

  void ReportRuns(const std::vector<Run>& runs) override {
    if (progress_) console_.ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Iteration) continue;  // our medians, not its aggregates
      const std::string name = run.benchmark_name();
      auto [it, added] = index_.try_emplace(name, cases_.size());
      if (added) {
        CaseRuns new_case;
        new_case.name = name;
        cases_.push_back(std::move(new_case));
      }
      CaseRuns& c = cases_[it->second];
      if (run.error_occurred) {
        if (c.error.empty()) c.error = run.error_message.empty() ? "failed" : run.error_message;
        continue;
      }
      std::map<std::string, double> values;
      for (const auto& [counter, value] : run.counters) values[counter] = value.value;
      c.repetitions.push_back(std::move(values));
    }
  }

  void Finalize() override {
    if (progress_) console_.Finalize();
  }

  const std::vector<CaseRuns>& cases() const { return cases_; }

 private:
  bool progress_;
  benchmark::ConsoleReporter console_;
  std::vector<CaseRuns> cases_;
  std::map<std::string, size_t> index_;
};

const CounterSpec* FindCounter(const SuiteSpec& spec, std::string_view counter) {
  for (const CounterSpec& c : spec.counters) {
    if (c.counter == counter) return &c;
  }
  return nullptr;
}

std::string FigureOf(const CounterSpec& c) { return c.figure.empty() ? c.counter : c.figure; }

bool IsRatio(const SuiteSpec& spec, std::string_view counter) {
  return std::any_of(spec.ratios.begin(), spec.ratios.end(),
                     [&](const RatioSpec& r) { return r.name == counter; });
}

// The suite as a bench without figures: the cases pair inside each repetition themselves, so
// it has no limit side (and no subject side) of its own.
BenchSpec BaseSpec(const SuiteSpec& suite) {
  BenchSpec spec;
  spec.name = suite.name;
  spec.command = suite.name;
  spec.title = suite.title;
  spec.subject.clear();
  return spec;
}

// The figures and ratios by their own names, for --help.
BenchSpec HelpSpec(const SuiteSpec& suite) {
  BenchSpec spec = BaseSpec(suite);
  for (const CounterSpec& c : suite.counters) {
    spec.figures.push_back(
        {.name = FigureOf(c), .unit = c.unit, .better = c.better, .help = c.help});
  }
  spec.ratios = suite.ratios;
  return spec;
}

}  // namespace

void SetRatioCounters(benchmark::State& state, const RatioSpec& ratio, double figure, double limit,
                      Better better) {
  state.counters[ratio.figure] = figure;
  state.counters[ratio.limit] = limit;
  if (std::optional<double> r = LimitRatio(figure, limit, better)) state.counters[ratio.name] = *r;
}

std::optional<int> InitSuite(int argc, char** argv, const SuiteSpec& spec, SuiteOptions* options) {
  // Google Benchmark's arguments, kept for the life of the program as argv is.
  static std::vector<std::string> added;
  static std::vector<char*> rest;
  bool help = false;
  bool repetitions_given = false;
  for (int i = 0; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (i > 0 && arg == "--smoke") {
      options->smoke = true;
    } else if (i > 0 && arg == "--json") {
      options->output.json = true;
    } else if (i > 0 && arg == "--quiet") {
      options->output.progress = false;
    } else if (i > 0 && (arg == "--rounds" || arg.rfind("--rounds=", 0) == 0)) {
      std::string value;
      if (arg == "--rounds") {
        if (i + 1 >= argc) {
          std::cerr << spec.name << ": --rounds needs a count\n";
          return 2;
        }
        value = argv[++i];
      } else {
        value = std::string(arg.substr(std::strlen("--rounds=")));
      }
      char* end = nullptr;
      const long rounds = std::strtol(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || rounds < 1 || rounds > kMaxRounds) {
        std::cerr << spec.name << ": --rounds: '" << value << "' is not a count in 1.."
                  << kMaxRounds << "\n";
        return 2;
      }
      options->rounds = static_cast<int>(rounds);
    } else {
      if (i > 0 && (arg == "--help" || arg == "-h")) help = true;
      if (arg.rfind("--benchmark_repetitions", 0) == 0) repetitions_given = true;
      rest.push_back(argv[i]);
    }
  }
  if (help) {
    std::cout << spec.name << ": " << spec.title << "\n\n"
              << spec.usage << "\n\n"
              << "Its own flags: --smoke (tiny sizes), --rounds N (repetitions of every case; "
                 "figures are medians over them, ratios medians of each repetition's ratio), "
                 "--json (one JSON object on standard output: \"bench\", \"cases\", \"rounds\", "
                 "every figure as \"<case>:<figure>\", \"per_round\", \"figures\" (units)), "
                 "--quiet (no progress on standard error).\n\n"
              << FiguresHelp(HelpSpec(spec)) << "\nGoogle Benchmark's flags:\n";
    std::cout.flush();
  }
  if (!repetitions_given && options->rounds > 1) {
    added.push_back(fmt::format("--benchmark_repetitions={}", options->rounds));
    rest.push_back(added.back().data());
  }
  int n = static_cast<int>(rest.size());
  benchmark::Initialize(&n, rest.data());  // prints its flags and exits after --help
  if (benchmark::ReportUnrecognizedArguments(n, rest.data())) return 2;
  return std::nullopt;
}

int RunSuite(const SuiteSpec& suite, const SuiteOptions& options) {
  SuiteReporter reporter(options.output.progress);
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();

  // The figures and ratios, case by case, in the order the cases ran.
  BenchSpec spec = BaseSpec(suite);
  size_t rounds = 0;
  for (const CaseRuns& c : reporter.cases()) {
    rounds = std::max(rounds, c.repetitions.size());
    std::vector<std::string> counters;  // the spec's order first, then the others by name
    for (const CounterSpec& counter : suite.counters) {
      for (const auto& rep : c.repetitions) {
        if (rep.contains(counter.counter)) {
          counters.push_back(counter.counter);
          break;
        }
      }
    }
    std::map<std::string, bool> others;
    for (const auto& rep : c.repetitions) {
      for (const auto& [counter, value] : rep) {
        if (FindCounter(suite, counter) == nullptr && !IsRatio(suite, counter)) {
          others[counter] = true;
        }
      }
    }
    for (const auto& [counter, unused] : others) counters.push_back(counter);
    for (const std::string& counter : counters) {
      const CounterSpec* known = FindCounter(suite, counter);
      spec.figures.push_back({.name = c.name + ":" + (known ? FigureOf(*known) : counter),
                              .unit = known ? known->unit : "",
                              .better = known ? known->better : Better::kHigher,
                              .help = known ? known->help : ""});
    }
    for (const RatioSpec& r : suite.ratios) {
      if (FindFigure(spec, c.name + ":" + r.figure) == nullptr ||
          FindFigure(spec, c.name + ":" + r.limit) == nullptr) {
        continue;
      }
      RatioSpec ratio = r;
      ratio.name = c.name + ":" + r.name;
      ratio.figure = c.name + ":" + r.figure;
      ratio.limit = c.name + ":" + r.limit;
      spec.ratios.push_back(std::move(ratio));
    }
  }

  Result<std::unique_ptr<Report>> created = Report::Create(std::move(spec));
  if (!created.ok()) {
    std::cerr << suite.name << ": " << created.status().ToString() << "\n";
    return 1;
  }
  Report& report = **created;
  for (size_t i = 0; i < rounds; ++i) {
    Round round(report.spec(), static_cast<int>(i + 1), false);
    for (const CaseRuns& c : reporter.cases()) {
      if (i >= c.repetitions.size()) continue;
      for (const auto& [counter, value] : c.repetitions[i]) {
        if (IsRatio(suite, counter)) continue;
        const CounterSpec* known = FindCounter(suite, counter);
        round.Set(c.name + ":" + (known ? FigureOf(*known) : counter),
                  value * (known ? known->scale : 1.0));
      }
    }
    report.AddRound(std::move(round));
  }
  Json cases = Json::array();
  Json failed = Json::object();
  for (const CaseRuns& c : reporter.cases()) {
    cases.push_back(c.name);
    if (!c.error.empty()) {
      failed[c.name] = c.error;
      report.Footing("failed", c.name + ": " + c.error);
    }
  }
  report.Set("smoke", options.smoke);
  report.Set("cases", std::move(cases));
  report.Set("failed", failed);
  report.Heading("cases", fmt::format("{}{}", reporter.cases().size(),
                                      options.smoke ? " at tiny sizes (--smoke)" : ""));
  Print(report, options.output, std::cout);
  return failed.empty() ? 0 : 1;
}

int ReportNothing(const SuiteSpec& suite, const SuiteOptions& options, const std::string& why) {
  benchmark::Shutdown();
  std::cerr << suite.name << ": " << why << "\n";
  Result<std::unique_ptr<Report>> created = Report::Create(BaseSpec(suite));
  if (!created.ok()) {
    std::cerr << suite.name << ": " << created.status().ToString() << "\n";
    return 1;
  }
  Report& report = **created;
  report.Set("smoke", options.smoke);
  report.Set("cases", Json::array());
  report.Set("failed", Json::object());
  report.Set("skipped", why);
  report.Heading("skipped", why);
  Print(report, options.output, std::cout);
  return 0;
}

}  // namespace kvstash::bench
