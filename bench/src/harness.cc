#include "kvstash/bench/harness.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <numeric>
#include <utility>

#include "fmt/format.h"

namespace kvstash::bench {
namespace {

// A programming error in a bench (a figure it did not declare, a key it uses twice): say which,
// and stop.
[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "kvstash bench harness: %s\n", message.c_str());
  std::abort();
}

Json OrNull(std::optional<double> v) { return v.has_value() ? Json(*v) : Json(nullptr); }

const char* BetterName(Better better) { return better == Better::kHigher ? "higher" : "lower"; }

// Keys of the JSON object the harness writes itself (see harness.h); "order" is one of
// "per_round"'s.
bool IsHarnessKey(const BenchSpec& spec, std::string_view key) {
  return key == "bench" || key == "rounds" || key == "per_round" || key == "figures" ||
         key == "order" || (spec.flat_round_keys && key.starts_with("rounds_"));
}

size_t FigureIndex(const BenchSpec& spec, std::string_view name) {
  for (size_t i = 0; i < spec.figures.size(); ++i) {
    if (spec.figures[i].name == name) return i;
  }
  Die(fmt::format("{} has no figure '{}'", spec.command, name));
}

// `text` wrapped to `width` columns, every line after the first indented by `indent`.
std::string Wrap(std::string_view text, size_t width, size_t indent) {
  std::string out;
  size_t column = 0;
  while (!text.empty()) {
    const size_t space = text.find(' ');
    const std::string_view word = text.substr(0, space);
    text = space == std::string_view::npos ? std::string_view() : text.substr(space + 1);
    if (word.empty()) continue;
    if (column > indent && column + 1 + word.size() > width) {
      out += '\n';
      out.append(indent, ' ');
      column = indent;
    } else if (column > 0) {
      out += ' ';
      ++column;
    }
    out += word;
    column += word.size();
  }
  return out;
}

// "label: text" lines, the texts aligned.
std::string Aligned(const std::vector<std::pair<std::string, std::string>>& lines) {
  size_t width = 0;
  for (const auto& [label, text] : lines) width = std::max(width, label.size() + 1);
  std::string out;
  for (const auto& [label, text] : lines) {
    out += fmt::format("{:<{}} {}\n", label + ":", width, text);
  }
  return out;
}

}  // namespace

// ---- measuring -------------------------------------------------------------------------------

double Gbps(uint64_t bytes, std::chrono::steady_clock::duration elapsed) {
  const double seconds = std::chrono::duration<double>(elapsed).count();
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

double CopyLimitGbps(size_t block_bytes, size_t working_set_bytes, int rounds) {
  if (block_bytes == 0) return 0;
  const size_t slots =
      std::max<size_t>(1, std::min(working_set_bytes, size_t{1} << 30) / block_bytes);
  std::vector<std::byte> region(slots * block_bytes, std::byte{1});  // touched: no page faults
  std::vector<std::byte> source(block_bytes, std::byte{2});
  // A fixed scattered order over the slots (a stride coprime with their count).
  size_t stride = slots / 2 + 1;
  while (std::gcd(stride, slots) != 1) ++stride;
  // Each round copies the working set, and at least 64 MiB, so it is long enough to time.
  const size_t copies = std::max(slots, (size_t{64} << 20) / block_bytes);
  std::vector<double> rates;
  size_t slot = 0;
  for (int r = 0; r < std::max(rounds, 1); ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (size_t i = 0; i < copies; ++i) {
      std::memcpy(region.data() + slot * block_bytes, source.data(), block_bytes);
      slot = (slot + stride) % slots;
    }
    rates.push_back(Gbps(copies * block_bytes, std::chrono::steady_clock::now() - start));
  }
  // Keeps the copies from being optimised away.
  volatile std::byte sink = region[slot * block_bytes];
  (void)sink;
  return Median(rates);
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

std::optional<double> Percentile(std::vector<double> values, double p) {
  const size_t n = values.size();
  if (n == 0) return std::nullopt;
  const double rank = std::ceil(p / 100.0 * static_cast<double>(n));
  const size_t index = std::clamp<size_t>(rank < 1 ? 0 : static_cast<size_t>(rank) - 1, 0, n - 1);
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(index),
                   values.end());
  return values[index];
}

std::optional<double> LimitRatio(double figure, double limit, Better better) {
  if (!(figure > 0) || !(limit > 0)) return std::nullopt;
  return better == Better::kLower ? limit / figure : figure / limit;
}

// ---- describing a bench ----------------------------------------------------------------------

FigureSpec Higher(std::string name, std::string unit, std::string help) {
  return FigureSpec{std::move(name), std::move(unit), Better::kHigher, std::move(help)};
}

FigureSpec Lower(std::string name, std::string unit, std::string help) {
  return FigureSpec{std::move(name), std::move(unit), Better::kLower, std::move(help)};
}

RatioSpec RatioOf(std::string name, std::string figure, std::string limit, std::string help,
                  std::optional<double> goal) {
  return RatioSpec{std::move(name), std::move(figure), std::move(limit), std::move(help), goal};
}

const FigureSpec* FindFigure(const BenchSpec& spec, std::string_view name) {
  for (const FigureSpec& f : spec.figures) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

const RatioSpec* FindRatio(const BenchSpec& spec, std::string_view name) {
  for (const RatioSpec& r : spec.ratios) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

std::string FiguresHelp(const BenchSpec& spec) {
  constexpr size_t kWidth = 100;
  constexpr size_t kIndent = 4;
  std::string out =
      Wrap(spec.limit.empty()
               ? "Figures (table rows and --json keys), each the median over rounds:"
               : fmt::format("Figures (table rows and --json keys), each the median over rounds; a "
                             "round runs {} and {} back to back, alternating which goes first:",
                             spec.subject, spec.limit),
           kWidth, 0);
  out += '\n';
  for (const FigureSpec& f : spec.figures) {
    const std::string what =
        fmt::format("{} ({}{} is better): {}", f.name, f.unit.empty() ? "" : f.unit + ", ",
                    BetterName(f.better), f.help);
    out += "  " + Wrap(what, kWidth - 2, kIndent) + "\n";
  }
  for (const RatioSpec& r : spec.ratios) {
    const FigureSpec* figure = FindFigure(spec, r.figure);
    const bool higher = figure == nullptr || figure->better == Better::kHigher;
    std::string what = fmt::format(
        "{} = {} / {} (1 = the machine's limit, higher is better; the median of the rounds' own "
        "ratios{})",
        r.name, higher ? r.figure : r.limit, higher ? r.limit : r.figure,
        r.goal.has_value() ? fmt::format("; goal {:.2f}", *r.goal) : "");
    if (!r.help.empty()) what += ": " + r.help;
    out += "  " + Wrap(what, kWidth - 2, kIndent) + "\n";
  }
  return out;
}

// ---- rounds ----------------------------------------------------------------------------------

Round::Round(const BenchSpec& spec, int number, bool limit_first)
    : spec_(&spec), number_(number), limit_first_(limit_first), values_(spec.figures.size()) {}

std::string Round::OrderLabel() const {
  if (spec_->limit.empty()) return {};
  return fmt::format("{} first", limit_first_ ? spec_->limit : spec_->subject);
}

void Round::Set(std::string_view figure, std::optional<double> value) {
  values_[FigureIndex(*spec_, figure)] = value;
}

std::optional<double> Round::Get(std::string_view figure) const {
  return values_[FigureIndex(*spec_, figure)];
}

std::optional<double> Round::RatioValue(const RatioSpec& ratio) const {
  const std::optional<double> figure = Get(ratio.figure);
  const std::optional<double> limit = Get(ratio.limit);
  if (!figure.has_value() || !limit.has_value()) return std::nullopt;
  return LimitRatio(*figure, *limit, spec_->figures[FigureIndex(*spec_, ratio.figure)].better);
}

Status ValidateSpec(const BenchSpec& spec) {
  if (spec.name.empty() || spec.command.empty()) {
    return InvalidArgumentError("bench '{}' ('{}'): a bench needs a name and a command", spec.name,
                                spec.command);
  }
  if (!spec.limit.empty() && spec.subject.empty()) {
    return InvalidArgumentError("{}: a limit side ('{}') needs a subject side to pair it with",
                                spec.command, spec.limit);
  }
  std::vector<std::string> names;
  for (const FigureSpec& f : spec.figures) names.push_back(f.name);
  for (const RatioSpec& r : spec.ratios) names.push_back(r.name);
  for (const std::string& name : names) {
    if (name.empty()) {
      return InvalidArgumentError("{}: a figure or ratio has no name", spec.command);
    }
    if (IsHarnessKey(spec, name)) {
      return InvalidArgumentError("{}: '{}' is a key the harness writes itself", spec.command,
                                  name);
    }
  }
  std::sort(names.begin(), names.end());
  if (auto twice = std::adjacent_find(names.begin(), names.end()); twice != names.end()) {
    return InvalidArgumentError("{} names '{}' twice", spec.command, *twice);
  }
  for (const RatioSpec& r : spec.ratios) {
    const FigureSpec* figure = FindFigure(spec, r.figure);
    const FigureSpec* limit = FindFigure(spec, r.limit);
    for (const auto& [side, found] : {std::pair{&r.figure, figure}, std::pair{&r.limit, limit}}) {
      if (found == nullptr) {
        return InvalidArgumentError("{}: ratio '{}' compares '{}', which is not a figure",
                                    spec.command, r.name, *side);
      }
    }
    if (figure == limit) {
      return InvalidArgumentError("{}: ratio '{}' compares '{}' with itself", spec.command, r.name,
                                  r.figure);
    }
    if (figure->better != limit->better) {
      return InvalidArgumentError(
          "{}: ratio '{}' compares '{}' ({} is better) with '{}' ({} is better)", spec.command,
          r.name, figure->name, BetterName(figure->better), limit->name, BetterName(limit->better));
    }
    if (r.goal.has_value() && !(*r.goal > 0)) {
      return InvalidArgumentError("{}: ratio '{}' has a goal of {}, not a positive ratio",
                                  spec.command, r.name, *r.goal);
    }
  }
  return Status::OK();
}

Result<std::unique_ptr<Report>> Report::Create(BenchSpec spec) {
  KVSTASH_RETURN_IF_ERROR(ValidateSpec(spec));
  return std::unique_ptr<Report>(new Report(std::move(spec)));
}

void Report::Set(const std::string& key, Json value) {
  if (IsHarnessKey(spec_, key) || FindFigure(spec_, key) != nullptr ||
      FindRatio(spec_, key) != nullptr) {
    Die(fmt::format("{}: '{}' is a key of the harness or a figure", spec_.command, key));
  }
  settings_[key] = std::move(value);
}

void Report::Heading(std::string label, std::string text) {
  headings_.emplace_back(std::move(label), std::move(text));
}

void Report::Footing(std::string label, std::string text) {
  footings_.emplace_back(std::move(label), std::move(text));
}

void Report::AddRound(Round round) {
  if (!round.IsOf(spec_)) Die(fmt::format("{}: a round of another spec", spec_.command));
  rounds_.push_back(std::move(round));
}

std::optional<double> Report::Median(std::string_view figure) const {
  std::vector<double> values;
  for (const Round& r : rounds_) {
    if (auto v = r.Get(figure)) values.push_back(*v);
  }
  if (values.empty()) return std::nullopt;
  return bench::Median(std::move(values));
}

std::optional<double> Report::RatioMedian(std::string_view ratio) const {
  const RatioSpec* spec = FindRatio(spec_, ratio);
  if (spec == nullptr) Die(fmt::format("{} has no ratio '{}'", spec_.command, ratio));
  std::vector<double> values;
  for (const Round& r : rounds_) {
    if (auto v = r.RatioValue(*spec)) values.push_back(*v);
  }
  if (values.empty()) return std::nullopt;
  return bench::Median(std::move(values));
}

Json Report::ToJson() const {
  Json doc = {{"bench", spec_.name}};
  for (const auto& [key, value] : settings_.items()) doc[key] = value;
  doc["rounds"] = rounds_.size();
  for (const FigureSpec& f : spec_.figures) doc[f.name] = OrNull(Median(f.name));
  for (const RatioSpec& r : spec_.ratios) doc[r.name] = OrNull(RatioMedian(r.name));

  Json per_round = Json::object();
  Json order = Json::array();
  for (const Round& r : rounds_) {
    order.push_back(r.limit_first() ? spec_.limit + "," + spec_.subject
                                    : spec_.subject + "," + spec_.limit);
  }
  if (!spec_.limit.empty()) per_round["order"] = order;
  for (const FigureSpec& f : spec_.figures) {
    Json values = Json::array();
    for (const Round& r : rounds_) values.push_back(OrNull(r.Get(f.name)));
    per_round[f.name] = std::move(values);
  }
  for (const RatioSpec& ratio : spec_.ratios) {
    Json values = Json::array();
    for (const Round& r : rounds_) values.push_back(OrNull(r.RatioValue(ratio)));
    per_round[ratio.name] = std::move(values);
  }
  if (spec_.flat_round_keys) {
    if (!spec_.limit.empty()) doc["rounds_order"] = order;
    for (const FigureSpec& f : spec_.figures) doc["rounds_" + f.name] = per_round[f.name];
  }
  doc["per_round"] = std::move(per_round);

  Json figures = Json::object();
  for (const FigureSpec& f : spec_.figures) {
    figures[f.name] = {{"unit", f.unit}, {"better", BetterName(f.better)}};
  }
  for (const RatioSpec& r : spec_.ratios) {
    figures[r.name] = {{"unit", ""}, {"better", "higher"}, {"of", r.figure}, {"to", r.limit}};
  }
  doc["figures"] = std::move(figures);
  return doc;
}

std::string Report::ToTable() const {
  std::string out = fmt::format("{}: {}\n", spec_.command, spec_.title);

  // The headings, then how the rounds ran.
  auto headings = headings_;
  std::string rounds = std::to_string(rounds_.size());
  if (!spec_.limit.empty() && !rounds_.empty()) {
    rounds += ", paired: ";
    constexpr size_t kShown = 4;
    for (size_t i = 0; i < rounds_.size() && i < kShown; ++i) {
      rounds += fmt::format("{}round {} ({})", i == 0 ? "" : ", ", rounds_[i].number(),
                            rounds_[i].OrderLabel());
    }
    if (rounds_.size() > kShown) rounds += ", and so on, alternating";
  }
  headings.emplace_back("rounds", rounds);
  out += Aligned(headings);

  // Rows: name, median, unit, [each round], [note]; a figure no round measured is left out.
  const bool per_round = rounds_.size() > 1;
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> header = {"figure", "median", "unit"};
  if (per_round) {
    for (const Round& r : rounds_) header.push_back(fmt::format("round {}", r.number()));
  }
  rows.push_back(header);
  auto add_row = [&](const std::string& name, std::optional<double> median, const std::string& unit,
                     const std::vector<std::optional<double>>& values, std::string note) {
    if (std::none_of(values.begin(), values.end(), [](auto v) { return v.has_value(); })) return;
    std::vector<std::string> row = {name, FormatFigure(median), unit};
    if (per_round) {
      for (const auto& v : values) row.push_back(FormatFigure(v));
    }
    if (!note.empty()) row.push_back(std::move(note));
    rows.push_back(std::move(row));
  };
  for (const FigureSpec& f : spec_.figures) {
    std::vector<std::optional<double>> values;
    for (const Round& r : rounds_) values.push_back(r.Get(f.name));
    add_row(f.name, Median(f.name), f.unit, values, "");
  }
  for (const RatioSpec& ratio : spec_.ratios) {
    std::vector<std::optional<double>> values;
    for (const Round& r : rounds_) values.push_back(r.RatioValue(ratio));
    const std::optional<double> median = RatioMedian(ratio.name);
    std::string note;
    if (ratio.goal.has_value() && median.has_value() && *median < *ratio.goal) {
      note = fmt::format("below goal {:.2f}", *ratio.goal);
    }
    add_row(ratio.name, median, "", values, std::move(note));
  }
  if (rows.size() > 1) {
    const size_t columns = header.size();
    std::vector<size_t> width(columns, 0);
    for (const auto& row : rows) {
      for (size_t c = 0; c < columns && c < row.size(); ++c) {
        width[c] = std::max(width[c], row[c].size());
      }
    }
    out += "\n";
    for (const auto& row : rows) {
      std::string line;
      for (size_t c = 0; c < row.size(); ++c) {
        if (c > 0) line += "  ";
        if (c >= columns) {
          line += row[c];  // the note
        } else if (c == 0 || c == 2) {
          line += fmt::format("{:<{}}", row[c], width[c]);  // name, unit
        } else {
          line += fmt::format("{:>{}}", row[c], width[c]);  // numbers
        }
      }
      while (!line.empty() && line.back() == ' ') line.pop_back();
      out += line + "\n";
    }
  }
  if (!footings_.empty()) {
    out += "\n";
    out += Aligned(footings_);
  }
  return out;
}

// ---- progress --------------------------------------------------------------------------------

Progress::Progress(ProgressOptions options) : options_(std::move(options)) {
  if (options_.out == nullptr) options_.out = &std::cerr;
  start_ = options_.now();
  last_ = start_;
}

Progress Progress::ToStderr(bool enabled) {
  ProgressOptions options;
  options.enabled = enabled;
  options.overwrite = isatty(STDERR_FILENO) == 1;
  return Progress(std::move(options));
}

Progress::~Progress() { Finish(); }

bool Progress::Update(std::string_view text) {
  if (!options_.enabled) return false;
  const auto now = options_.now();
  if (now - last_ < options_.interval) return false;
  last_ = now;
  const std::string line =
      fmt::format("[{:6.1f}s] {}", std::chrono::duration<double>(now - start_).count(), text);
  std::ostream& out = *options_.out;
  if (options_.overwrite) {
    out << "\r" << line << "\033[K";  // clear what a longer line left
  } else {
    out << line << "\n";
  }
  out.flush();
  open_line_ = options_.overwrite;
  return true;
}

void Progress::Finish() {
  if (!open_line_) return;
  *options_.out << "\n";
  options_.out->flush();
  open_line_ = false;
}

double Progress::elapsed_seconds() const {
  return std::chrono::duration<double>(options_.now() - start_).count();
}

Status RunRounds(Report& report, int rounds, const RoundSides& sides, Progress& progress) {
  const BenchSpec& spec = report.spec();
  if (rounds < 1 || rounds > kMaxRounds) {
    return InvalidArgumentError("{}: {} rounds is outside 1..{}", spec.command, rounds, kMaxRounds);
  }
  if (!sides.measure) return InvalidArgumentError("{}: no side to measure", spec.command);
  for (int i = 1; i <= rounds; ++i) {
    Round round(spec, i, !spec.limit.empty() && i % 2 == 0);
    for (const bool limit_now : {round.limit_first(), !round.limit_first()}) {
      const std::function<Status(Round&)>& side = limit_now ? sides.limit : sides.measure;
      if (!side) continue;
      if (Status s = side(round); !s.ok()) {
        return Status(s.code(), fmt::format("round {}: {}", i, s.message()));
      }
    }
    // The round's ratios, or its first figure, to show the run moving.
    std::string shown;
    for (const RatioSpec& r : spec.ratios) {
      if (auto v = round.RatioValue(r)) shown += fmt::format("  {} {}", r.name, FormatFigure(v));
    }
    if (shown.empty() && !spec.figures.empty()) {
      const FigureSpec& f = spec.figures.front();
      shown = fmt::format("  {} {} {}", f.name, FormatFigure(round.Get(f.name)), f.unit);
    }
    report.AddRound(std::move(round));
    progress.Update(fmt::format("{}: round {}/{} done{}", spec.command, i, rounds, shown));
  }
  progress.Finish();
  return Status::OK();
}

// ---- output ----------------------------------------------------------------------------------

void AddOutputFlags(CLI::App& command, OutputOptions* options) {
  command.add_flag("--json", options->json,
                   "Print one JSON object on standard output instead of the table (progress "
                   "and logs stay on standard error): \"bench\", the settings and outcomes, "
                   "\"rounds\", every figure and ratio below (medians), \"per_round\" (each "
                   "round's values) and \"figures\" (units)");
  command.add_flag_callback(
      "--quiet", [options] { options->progress = false; },
      "No progress lines on standard error (a long run prints one a second)");
}

CLI::Option* AddRoundsFlag(CLI::App& command, int* rounds, const BenchSpec& spec) {
  const std::string help =
      spec.limit.empty()
          ? std::string("Rounds to run; every figure is the median over rounds")
          : fmt::format(
                "Paired rounds to run: each runs {0} and {1} back to back, {0} first in odd "
                "rounds and {1} first in even ones, so the machine's drift weighs on both; every "
                "figure is the median over rounds, every ratio the median of the rounds' own "
                "ratios",
                spec.subject, spec.limit);
  return command.add_option("--rounds", *rounds, help)
      ->check(CLI::Range(1, kMaxRounds))
      ->capture_default_str();
}

void Print(const Report& report, const OutputOptions& options, std::ostream& out) {
  if (options.json) {
    out << report.ToJson().dump() << "\n";
  } else {
    out << report.ToTable();
  }
  out.flush();
}

std::string FormatFigure(std::optional<double> value) {
  if (!value.has_value() || !std::isfinite(*value)) return "-";
  const double v = *value;
  const double a = std::fabs(v);
  if (a == 0) return "0";
  if (a >= 1000) return fmt::format("{:.0f}", v);
  if (a >= 10) return fmt::format("{:.1f}", v);
  if (a >= 1) return fmt::format("{:.2f}", v);
  return fmt::format("{:#.3g}", v);
}

}  // namespace kvstash::bench
