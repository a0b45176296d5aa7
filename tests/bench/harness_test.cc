// The benchmark harness every kvstash benchmark goes through: paired rounds (order, failure),
// medians and ratios (the median of each round's own ratio, oriented so higher is better), the
// JSON shape, the table's alignment, progress (rate-limited, never on the results' stream), the
// shared flags, and the specs and runs it refuses. Made-up figures only: no test here times
// anything.
#include "kvstash/bench/harness.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "fmt/format.h"

namespace kvstash::bench {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// A bench with a throughput, its limit, a latency (lower is better) and its limit.
BenchSpec TestSpec() {
  BenchSpec spec;
  spec.name = "test";
  spec.command = "kvstash bench test";
  spec.title = "a made-up bench";
  spec.limit = "memcpy";
  spec.figures = {
      Higher("gbps", "GB/s", "the bench's throughput"),
      Higher("limit_gbps", "GB/s", "the machine's"),
      Lower("p50_us", "us", "its latency"),
      Lower("limit_us", "us", "the machine's"),
  };
  spec.ratios = {
      RatioOf("ratio", "gbps", "limit_gbps", "", 0.9),
      RatioOf("latency_ratio", "p50_us", "limit_us"),
  };
  return spec;
}

// A report of a spec the test knows to be valid; the process stops if it is not.
std::unique_ptr<Report> MakeReport(BenchSpec spec) {
  Result<std::unique_ptr<Report>> report = Report::Create(std::move(spec));
  if (!report.ok()) {
    ADD_FAILURE() << report.status().ToString();
    std::abort();
  }
  return std::move(*report);
}

// Appends a round as RunRounds would number and order it.
void AddRound(Report& report, std::optional<double> gbps, std::optional<double> limit) {
  const int number = static_cast<int>(report.rounds().size()) + 1;
  Round round(report.spec(), number, number % 2 == 0);
  round.Set("gbps", gbps);
  round.Set("limit_gbps", limit);
  report.AddRound(std::move(round));
}

// The text with every run of spaces and newlines made one space: help text, whatever its wrap.
std::string Unwrapped(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '\n' || c == ' ') {
      if (!out.empty() && out.back() != ' ') out += ' ';
    } else {
      out += c;
    }
  }
  return out;
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(HarnessTest, MedianAndPercentile) {
  EXPECT_EQ(Median({3, 1, 2}), 2);
  EXPECT_EQ(Median({4, 1, 3, 2}), 2.5);
  EXPECT_EQ(Percentile({5, 1, 4, 2, 3}, 50), 3);
  EXPECT_EQ(Percentile({5, 1, 4, 2, 3}, 99), 5);
  EXPECT_EQ(Percentile({7}, 1), 7);
  EXPECT_EQ(Percentile({}, 50), std::nullopt);
}

TEST(HarnessTest, LimitRatioIsOrientedSoThatOneIsTheLimitAndHigherIsBetter) {
  EXPECT_EQ(LimitRatio(3, 2, Better::kHigher), 1.5);  // 3 GB/s against a limit of 2
  EXPECT_EQ(LimitRatio(4, 2, Better::kLower), 0.5);   // 4 us against a limit of 2 us
  EXPECT_EQ(LimitRatio(3, 0, Better::kHigher), std::nullopt);
  EXPECT_EQ(LimitRatio(0, 2, Better::kHigher), std::nullopt);
  EXPECT_EQ(LimitRatio(0, 2, Better::kLower), std::nullopt);
  EXPECT_EQ(LimitRatio(2, 0, Better::kLower), std::nullopt);  // not a ratio of 0
  EXPECT_EQ(LimitRatio(-1, 2, Better::kHigher), std::nullopt);
}

TEST(HarnessTest, FiguresAreMediansOverTheRoundsThatMeasuredThem) {
  auto report = MakeReport(TestSpec());
  AddRound(*report, 1, std::nullopt);
  AddRound(*report, 5, std::nullopt);
  AddRound(*report, 2, std::nullopt);
  AddRound(*report, std::nullopt, std::nullopt);
  EXPECT_EQ(report->Median("gbps"), 2);  // 1, 2, 5: the missing round does not count
  EXPECT_EQ(report->Median("limit_gbps"), std::nullopt);
  EXPECT_EQ(report->RatioMedian("ratio"), std::nullopt);
}

TEST(HarnessTest, RatioIsTheMedianOfEachRoundsRatioNotTheRatioOfMedians) {
  auto report = MakeReport(TestSpec());
  AddRound(*report, 1, 2);  // 0.5
  AddRound(*report, 4, 4);  // 1
  AddRound(*report, 9, 3);  // 3
  EXPECT_EQ(report->Median("gbps"), 4);
  EXPECT_EQ(report->Median("limit_gbps"), 3);
  // 4 / 3 would be the ratio of the medians; paired rounds give 1.
  EXPECT_DOUBLE_EQ(*report->RatioMedian("ratio"), 1.0);
  // An even count: the mean of the middle two rounds' ratios (0.5 and 1), not of their figures.
  AddRound(*report, 1, 10);  // 0.1
  EXPECT_DOUBLE_EQ(*report->RatioMedian("ratio"), 0.75);
}

TEST(HarnessTest, RatioOfALowerIsBetterFigureIsTheLimitOverIt) {
  const BenchSpec spec = TestSpec();
  Round round(spec, 1, false);
  round.Set("p50_us", 10);
  round.Set("limit_us", 5);
  EXPECT_DOUBLE_EQ(*round.RatioValue(spec.ratios[1]), 0.5);  // twice as slow as the limit
  round.Set("limit_us", 0.0);
  EXPECT_EQ(round.RatioValue(spec.ratios[1]), std::nullopt);
  round.Set("gbps", 3);
  EXPECT_EQ(round.RatioValue(spec.ratios[0]), std::nullopt);  // no limit measured
}

TEST(HarnessTest, RoundsArePairedAndAlternateWhichSideGoesFirst) {
  auto report_owned = MakeReport(TestSpec());
  Report& report = *report_owned;
  std::vector<std::string> calls;
  RoundSides sides;
  sides.measure = [&](Round& round) {
    calls.push_back(std::to_string(round.number()) + ":measure");
    round.Set("gbps", round.number());
    return Status::OK();
  };
  sides.limit = [&](Round& round) {
    calls.push_back(std::to_string(round.number()) + ":limit");
    round.Set("limit_gbps", 2.0 * round.number());
    return Status::OK();
  };
  Progress progress(ProgressOptions{.enabled = false});
  ASSERT_TRUE(RunRounds(report, 3, sides, progress).ok());
  EXPECT_THAT(calls,
              ElementsAre("1:measure", "1:limit", "2:limit", "2:measure", "3:measure", "3:limit"));
  ASSERT_EQ(report.rounds().size(), 3u);
  EXPECT_EQ(report.rounds()[0].OrderLabel(), "kvstash first");
  EXPECT_EQ(report.rounds()[1].OrderLabel(), "memcpy first");
  EXPECT_DOUBLE_EQ(*report.RatioMedian("ratio"), 0.5);
}

TEST(HarnessTest, ASkippedLimitLeavesItsFiguresNull) {
  auto report_owned = MakeReport(TestSpec());
  Report& report = *report_owned;
  RoundSides sides;
  sides.measure = [](Round& round) {
    round.Set("gbps", 1);
    return Status::OK();
  };
  Progress progress(ProgressOptions{.enabled = false});
  ASSERT_TRUE(RunRounds(report, 2, sides, progress).ok());
  const Json doc = report.ToJson();
  EXPECT_EQ(doc["gbps"], 1);
  EXPECT_TRUE(doc["limit_gbps"].is_null());
  EXPECT_TRUE(doc["ratio"].is_null());
  EXPECT_EQ(doc["per_round"]["limit_gbps"], Json::array({nullptr, nullptr}));
}

TEST(HarnessTest, AFailingSideEndsTheRunNamingTheRound) {
  auto report_owned = MakeReport(TestSpec());
  Report& report = *report_owned;
  int limits = 0;
  RoundSides sides;
  sides.measure = [](Round& round) {
    if (round.number() == 2) return UnavailableError("fio exited with 1");
    round.Set("gbps", 1);
    return Status::OK();
  };
  sides.limit = [&](Round&) {
    ++limits;
    return Status::OK();
  };
  Progress progress(ProgressOptions{.enabled = false});
  const Status s = RunRounds(report, 3, sides, progress);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "round 2: fio exited with 1");
  EXPECT_EQ(report.rounds().size(), 1u);  // the failed round is not reported
  EXPECT_EQ(limits, 2);                   // round 2 ran its limit first, then stopped
}

TEST(HarnessTest, JsonHasTheDocumentedShape) {
  BenchSpec spec = TestSpec();
  spec.flat_round_keys = true;
  auto report_owned = MakeReport(std::move(spec));
  Report& report = *report_owned;
  report.Set("block_bytes", 4096);
  report.Set("errors", 0);
  for (int i = 1; i <= 2; ++i) {
    Round round(report.spec(), i, i == 2);
    round.Set("gbps", i);
    round.Set("limit_gbps", 2);
    report.AddRound(std::move(round));
  }
  const Json doc = report.ToJson();
  std::vector<std::string> keys;
  for (const auto& [key, value] : doc.items()) keys.push_back(key);
  EXPECT_THAT(keys, ElementsAre("bench", "block_bytes", "errors", "rounds", "gbps", "limit_gbps",
                                "p50_us", "limit_us", "ratio", "latency_ratio", "rounds_order",
                                "rounds_gbps", "rounds_limit_gbps", "rounds_p50_us",
                                "rounds_limit_us", "per_round", "figures"));
  EXPECT_EQ(doc["bench"], "test");
  EXPECT_EQ(doc["rounds"], 2);
  EXPECT_EQ(doc["gbps"], 1.5);
  EXPECT_TRUE(doc["p50_us"].is_null());
  EXPECT_EQ(doc["ratio"], 0.75);
  EXPECT_EQ(doc["per_round"]["order"], Json::array({"kvstash,memcpy", "memcpy,kvstash"}));
  EXPECT_EQ(doc["per_round"]["gbps"], Json::array({1, 2}));
  EXPECT_EQ(doc["per_round"]["ratio"], Json::array({0.5, 1}));
  EXPECT_EQ(doc["rounds_gbps"], doc["per_round"]["gbps"]);
  EXPECT_EQ(doc["figures"]["gbps"], Json({{"unit", "GB/s"}, {"better", "higher"}}));
  EXPECT_EQ(doc["figures"]["p50_us"]["better"], "lower");
  EXPECT_EQ(doc["figures"]["ratio"]["of"], "gbps");
  EXPECT_EQ(doc["figures"]["ratio"]["to"], "limit_gbps");

  // Without flat keys there are none; without a limit side there is no order.
  BenchSpec plain = TestSpec();
  plain.limit.clear();
  auto other_owned = MakeReport(std::move(plain));
  Report& other = *other_owned;
  AddRound(other, 1, 1);
  const Json second = other.ToJson();
  EXPECT_FALSE(second.contains("rounds_gbps"));
  EXPECT_FALSE(second["per_round"].contains("order"));
}

TEST(HarnessTest, TableAlignsHeadingsAndColumnsAndLeavesOutWhatNoRoundMeasured) {
  auto report_owned = MakeReport(TestSpec());
  Report& report = *report_owned;
  report.Heading("prefill", "2 x 40 tokens");
  report.Heading("decode", "2 streams x 4 tokens");
  report.Footing("errors", "0");
  AddRound(report, 1, 2);          // ratio 0.5
  AddRound(report, 12.5, 20);      // 0.625
  AddRound(report, 1234.4, 1000);  // 1.23
  const std::string table = report.ToTable();
  const std::vector<std::string> lines = Lines(table);
  ASSERT_GE(lines.size(), 10u) << table;
  EXPECT_EQ(lines[0], "kvstash bench test: a made-up bench");
  EXPECT_EQ(lines[1], "prefill: 2 x 40 tokens");
  EXPECT_EQ(lines[2], "decode:  2 streams x 4 tokens");
  EXPECT_EQ(lines[3],
            "rounds:  3, paired: round 1 (kvstash first), round 2 (memcpy first), round 3 "
            "(kvstash first)");
  EXPECT_EQ(lines[4], "");
  // The figures: a header, gbps, limit_gbps, ratio (p50_us, limit_us and latency_ratio had no
  // values), every number right-aligned under its header.
  const std::vector<std::string> rows(lines.begin() + 5, lines.begin() + 9);
  EXPECT_THAT(rows[0], HasSubstr("figure"));
  EXPECT_EQ(rows[1].substr(0, 4), "gbps");
  EXPECT_EQ(rows[2].substr(0, 10), "limit_gbps");
  EXPECT_EQ(rows[3].substr(0, 5), "ratio");
  EXPECT_THAT(table, Not(HasSubstr("p50_us")));
  EXPECT_THAT(table, Not(HasSubstr("latency_ratio")));
  const size_t median_end = rows[0].find("median") + std::string("median").size();
  const size_t last_end = rows[0].size();
  EXPECT_THAT(rows[0], HasSubstr("round 3"));
  EXPECT_EQ(rows[1].find("12.5"), median_end - 4) << table;  // median 12.5, right-aligned
  EXPECT_EQ(rows[1].substr(last_end - 4), "1234") << table;
  EXPECT_EQ(rows[2].substr(last_end - 4), "1000") << table;
  EXPECT_THAT(rows[3], HasSubstr("0.625"));
  EXPECT_THAT(rows[3], HasSubstr("below goal 0.90"));  // the median, 0.625
  EXPECT_EQ(lines[9], "");
  EXPECT_EQ(lines[10], "errors: 0");
  EXPECT_EQ(table.back(), '\n');

  // One round: no per-round columns; a ratio at its goal has no note.
  auto single_owned = MakeReport(TestSpec());
  Report& single = *single_owned;
  AddRound(single, 1, 1);
  const std::vector<std::string> one = Lines(single.ToTable());
  ASSERT_EQ(one.size(), 7u) << single.ToTable();
  EXPECT_EQ(one[1], "rounds: 1, paired: round 1 (kvstash first)");
  EXPECT_EQ(one[3], "figure      median  unit");
  EXPECT_EQ(one[4], "gbps          1.00  GB/s");
  EXPECT_EQ(one[6], "ratio         1.00");
}

TEST(HarnessTest, FiguresAreFormattedToThreeSignificantDigitsAtLeast) {
  EXPECT_EQ(FormatFigure(std::nullopt), "-");
  EXPECT_EQ(FormatFigure(0.0), "0");
  EXPECT_EQ(FormatFigure(0.000391), "0.000391");
  EXPECT_EQ(FormatFigure(0.15), "0.150");
  EXPECT_EQ(FormatFigure(1.234), "1.23");
  EXPECT_EQ(FormatFigure(12.34), "12.3");
  EXPECT_EQ(FormatFigure(123.4), "123.4");
  EXPECT_EQ(FormatFigure(12345.6), "12346");
  EXPECT_EQ(FormatFigure(-2.5), "-2.50");
}

// A clock the test moves.
struct FakeClock {
  ProgressOptions::Clock::time_point now{};
  void Advance(int ms) { now += std::chrono::milliseconds(ms); }
};

TEST(HarnessTest, ProgressIsRateLimitedAndOffWhenDisabled) {
  FakeClock clock;
  std::ostringstream err;
  Progress progress(ProgressOptions{.out = &err, .now = [&clock] { return clock.now; }});
  EXPECT_FALSE(progress.Update("too early"));  // a short run prints nothing
  clock.Advance(1000);
  EXPECT_TRUE(progress.Update("one"));
  clock.Advance(500);
  EXPECT_FALSE(progress.Update("too soon"));
  clock.Advance(500);
  EXPECT_TRUE(progress.Update("two"));
  progress.Finish();
  EXPECT_EQ(err.str(), "[   1.0s] one\n[   2.0s] two\n");

  std::ostringstream quiet;
  Progress off(
      ProgressOptions{.enabled = false, .out = &quiet, .now = [&clock] { return clock.now; }});
  clock.Advance(5000);
  EXPECT_FALSE(off.Update("anything"));
  off.Finish();
  EXPECT_EQ(quiet.str(), "");
}

TEST(HarnessTest, ProgressOnATerminalOverwritesItsLineAndEndsIt) {
  FakeClock clock;
  std::ostringstream err;
  {
    Progress progress(
        ProgressOptions{.out = &err, .overwrite = true, .now = [&clock] { return clock.now; }});
    clock.Advance(1000);
    progress.Update("one");
    clock.Advance(1000);
    progress.Update("two");
  }  // the destructor ends the line
  EXPECT_EQ(err.str(), "\r[   1.0s] one\033[K\r[   2.0s] two\033[K\n");
}

TEST(HarnessTest, JsonOutputIsOneObjectAndProgressNeverReachesIt) {
  FakeClock clock;
  std::ostringstream out, err;
  auto report_owned = MakeReport(TestSpec());
  Report& report = *report_owned;
  RoundSides sides;
  sides.measure = [&clock](Round& round) {
    clock.Advance(1500);  // long rounds: progress is due after each
    round.Set("gbps", 1);
    return Status::OK();
  };
  Progress progress(ProgressOptions{.out = &err, .now = [&clock] { return clock.now; }});
  ASSERT_TRUE(RunRounds(report, 2, sides, progress).ok());
  Print(report, OutputOptions{.json = true}, out);
  EXPECT_THAT(err.str(), HasSubstr("kvstash bench test: round 1/2 done"));
  EXPECT_THAT(err.str(), HasSubstr("round 2/2 done"));
  ASSERT_EQ(Lines(out.str()).size(), 1u) << out.str();
  const Json doc = Json::parse(out.str(), nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << out.str();
  EXPECT_EQ(doc["rounds"], 2);

  std::ostringstream table;
  Print(report, OutputOptions{}, table);
  EXPECT_EQ(table.str(), report.ToTable());
}

TEST(HarnessTest, HelpSaysWhatEveryFigureMeans) {
  const std::string help = FiguresHelp(TestSpec());
  const std::string unwrapped = Unwrapped(help);
  for (const char* text :
       {"gbps (GB/s, higher is better): the bench's throughput",
        "p50_us (us, lower is better): its latency", "ratio = gbps / limit_gbps",
        "latency_ratio = limit_us / p50_us", "goal 0.90", "kvstash and memcpy back to back"}) {
    EXPECT_THAT(unwrapped, HasSubstr(text));
  }
  for (const std::string& line : Lines(help)) EXPECT_LE(line.size(), 100u) << line;
}

TEST(HarnessTest, OutputAndRoundsFlags) {
  CLI::App app("test");
  OutputOptions output;
  int rounds = 3;
  AddOutputFlags(app, &output);
  AddRoundsFlag(app, &rounds, TestSpec());
  app.parse("--json --quiet --rounds 5", false);
  EXPECT_TRUE(output.json);
  EXPECT_FALSE(output.progress);
  EXPECT_EQ(rounds, 5);
  EXPECT_THAT(app.help(), HasSubstr("kvstash first in odd rounds"));

  CLI::App bad("test");
  AddRoundsFlag(bad, &rounds, TestSpec());
  EXPECT_THROW(bad.parse("--rounds 0", false), CLI::ValidationError);
}

// The message of Report::Create's error for `spec`; "" when it accepts the spec.
std::string CreateError(const BenchSpec& spec) {
  Result<std::unique_ptr<Report>> report = Report::Create(spec);
  if (report.ok()) return "";
  EXPECT_EQ(report.status().code(), StatusCode::kInvalidArgument);
  return std::string(report.status().message());
}

TEST(HarnessTest, BadSpecsAreRefusedSayingWhy) {
  EXPECT_EQ(CreateError(TestSpec()), "");

  BenchSpec spec = TestSpec();
  spec.ratios[1].name = "gbps";
  EXPECT_EQ(CreateError(spec), "kvstash bench test names 'gbps' twice");

  spec = TestSpec();
  spec.figures.push_back(Higher("gbps", "GB/s", "again"));
  EXPECT_EQ(CreateError(spec), "kvstash bench test names 'gbps' twice");

  spec = TestSpec();
  spec.ratios[0].limit = "limit_gbpz";
  EXPECT_EQ(CreateError(spec),
            "kvstash bench test: ratio 'ratio' compares 'limit_gbpz', which is not a figure");

  spec = TestSpec();
  spec.ratios[0].figure = "nothing";
  EXPECT_THAT(CreateError(spec), HasSubstr("compares 'nothing', which is not a figure"));

  spec = TestSpec();
  spec.ratios[0].limit = "gbps";
  EXPECT_EQ(CreateError(spec), "kvstash bench test: ratio 'ratio' compares 'gbps' with itself");

  spec = TestSpec();
  spec.ratios[0].limit = "limit_us";  // a throughput over a latency
  EXPECT_EQ(CreateError(spec),
            "kvstash bench test: ratio 'ratio' compares 'gbps' (higher is better) with "
            "'limit_us' (lower is better)");

  spec = TestSpec();
  spec.ratios[0].goal = 0;
  EXPECT_THAT(CreateError(spec), HasSubstr("a goal of 0, not a positive ratio"));

  for (const char* reserved : {"bench", "rounds", "per_round", "figures", "order"}) {
    spec = TestSpec();
    spec.figures[2].name = reserved;
    spec.ratios.pop_back();
    EXPECT_EQ(CreateError(spec),
              fmt::format("kvstash bench test: '{}' is a key the harness writes itself", reserved));
  }
  // "rounds_<figure>" is the harness's only with flat round keys.
  spec = TestSpec();
  spec.figures[2].name = "rounds_total";
  spec.ratios.pop_back();
  EXPECT_EQ(CreateError(spec), "");
  spec.flat_round_keys = true;
  EXPECT_THAT(CreateError(spec), HasSubstr("'rounds_total' is a key the harness writes itself"));

  spec = TestSpec();
  spec.figures[0].name.clear();
  EXPECT_EQ(CreateError(spec), "kvstash bench test: a figure or ratio has no name");

  spec = TestSpec();
  spec.command.clear();
  EXPECT_THAT(CreateError(spec), HasSubstr("a bench needs a name and a command"));

  spec = TestSpec();
  spec.subject.clear();
  EXPECT_EQ(CreateError(spec),
            "kvstash bench test: a limit side ('memcpy') needs a subject side to pair it with");
  spec.limit.clear();  // no sides at all: the bench pairs inside its rounds (the suites)
  EXPECT_EQ(CreateError(spec), "");
}

TEST(HarnessTest, BadRunsAreRefusedBeforeAnythingRuns) {
  auto owned = MakeReport(TestSpec());
  Report& report = *owned;
  int calls = 0;
  RoundSides sides;
  sides.measure = [&calls](Round&) {
    ++calls;
    return Status::OK();
  };
  Progress progress(ProgressOptions{.enabled = false});
  for (int rounds : {0, -1, kMaxRounds + 1}) {
    const Status s = RunRounds(report, rounds, sides, progress);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << rounds;
    EXPECT_EQ(s.message(), fmt::format("kvstash bench test: {} rounds is outside 1..1000", rounds));
  }
  RoundSides limit_only;
  limit_only.limit = sides.measure;
  const Status s = RunRounds(report, 1, limit_only, progress);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "kvstash bench test: no side to measure");
  EXPECT_EQ(calls, 0);
  EXPECT_TRUE(report.rounds().empty());
  EXPECT_TRUE(RunRounds(report, kMaxRounds, sides, progress).ok());
  EXPECT_EQ(calls, kMaxRounds);
}

TEST(HarnessDeathTest, UndeclaredFiguresAndClashingKeysAreProgrammingErrors) {
  const BenchSpec spec = TestSpec();
  EXPECT_DEATH(Round(spec, 1, false).Set("gbpz", 1), "has no figure 'gbpz'");
  EXPECT_DEATH(MakeReport(spec)->Set("gbps", 1), "'gbps' is a key of the harness or a figure");
  EXPECT_DEATH(MakeReport(spec)->Set("rounds", 1), "'rounds'");
  EXPECT_DEATH(MakeReport(spec)->RatioMedian("gbps"), "has no ratio 'gbps'");
  // A round made with another spec (even an equal one) would index the wrong figures.
  EXPECT_DEATH(MakeReport(spec)->AddRound(Round(spec, 1, false)), "a round of another spec");
}

}  // namespace
}  // namespace kvstash::bench
