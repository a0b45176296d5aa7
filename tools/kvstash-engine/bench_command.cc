#include "bench_command.h"

#include <chrono>
#include <cstdint>
#include <iostream>
#include <vector>

#include "fmt/format.h"
#include "kvstash/engine/engine.h"
#include "kvstash/kernels/cpu_ops.h"

namespace kvstash::engine::cli {
namespace {

using Clock = std::chrono::steady_clock;
using bench::BenchSpec;
using bench::Higher;
using bench::Lower;
using bench::RatioOf;
using bench::Report;
using bench::Round;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The MatMul the limit times: the kernel the engine spends its time in, at a cache-friendly size.
constexpr size_t kRows = 64, kIn = 256, kOut = 768;

BenchSpec EngineSpec() {
  BenchSpec spec;
  spec.name = "engine";
  spec.command = "kvstash-engine bench";
  spec.title = "prefill and decode tokens/s against this machine's one-thread MatMul rate";
  spec.subject = "engine";
  spec.limit = "MatMul";
  spec.figures = {
      Higher("prefill_tokens_per_s", "tokens/s",
             "prompt tokens / the wall time of --batch distinct prompts of --prompt-len tokens "
             "(no prefix hits), one generated token each"),
      Higher("decode_tokens_per_s", "tokens/s",
             "generated tokens / the wall time of the steps that run no prompt tokens, "
             "--batch streams of --decode-tokens tokens"),
      Higher("prefill_gflops", "GFLOP/s",
             "prefill_tokens_per_s x the floating-point operations of one token through the "
             "model's projections (2 per weight; attention scores and states are small next to "
             "them at these lengths)"),
      Higher("decode_gflops", "GFLOP/s", "the same for decode"),
      Lower("prefill_seconds", "s", "the prefill's wall time"),
      Lower("decode_seconds", "s", "the decode steps' wall time"),
      Higher("matmul_gflops", "GFLOP/s",
             "the limit: kernels::MatMul of 64 x 256 by 256 x 768 on one thread (the engine "
             "runs on one), the median of 5 runs of 20"),
  };
  spec.ratios = {
      RatioOf("prefill_ratio", "prefill_gflops", "matmul_gflops",
              "how close prefill comes to the machine's MatMul rate"),
      RatioOf("decode_ratio", "decode_gflops", "matmul_gflops", "the same for decode"),
  };
  return spec;
}

// Floating-point operations of one token through the model's projections (2 per weight;
// attention scores and the state are small next to them at these lengths).
double FlopsPerToken(const ModelConfig& c) {
  const double embed = static_cast<double>(c.vocab_size) * c.hidden;
  return 2.0 * (static_cast<double>(c.NumParameters()) - embed);
}

// The machine's own rate for the kernel the engine spends its time in: one thread, the median
// of 5 runs of 20 MatMuls.
double MatMulGflops() {
  std::vector<float> x(kRows * kIn, 0.5f), w(kIn * kOut, 0.25f), y(kRows * kOut);
  std::vector<double> rates;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = Clock::now();
    for (int i = 0; i < 20; ++i) kernels::MatMul(x.data(), w.data(), y.data(), kRows, kIn, kOut);
    const double s = Seconds(t0, Clock::now());
    rates.push_back(s > 0 ? 20 * 2.0 * kRows * kIn * kOut / s / 1e9 : 0.0);
  }
  return bench::Median(std::move(rates));
}

// One round of the engine's side: distinct prompts of round `round` (0-based), so no round hits
// another's prefix.
Status MeasureEngine(Engine& e, const BenchFlags& f, Round& round) {
  const ModelConfig& c = e.config();
  const size_t first_seed = 7 + 2 * static_cast<size_t>(round.number() - 1) * f.batch;
  // Prefill: distinct prompts (no prefix hits), one generated token each.
  std::vector<std::vector<uint32_t>> prompts;
  for (size_t i = 0; i < f.batch; ++i) {
    prompts.push_back(RandomTokens(f.prompt_len, c.vocab_size, first_seed + i));
  }
  const auto t0 = Clock::now();
  KVSTASH_RETURN_IF_ERROR(e.Generate(prompts, 1).status());
  const double prefill_s = Seconds(t0, Clock::now());
  // Decode: short prompts, then time only the steps that run no prompt tokens.
  for (size_t i = 0; i < f.batch; ++i) {
    KVSTASH_RETURN_IF_ERROR(
        e.AddRequest(RandomTokens(16, c.vocab_size, first_seed + f.batch + i), f.decode_tokens + 1)
            .status());
  }
  double decode_s = 0;
  uint64_t decode_tokens_run = 0;
  while (e.HasUnfinished()) {
    const uint64_t prefill_before = e.counters().prefill_tokens;
    const uint64_t decode_before = e.counters().decode_tokens;
    const auto s0 = Clock::now();
    for (RequestId id : e.Step()) e.TakeResult(id);
    if (e.counters().prefill_tokens == prefill_before) {
      decode_s += Seconds(s0, Clock::now());
      decode_tokens_run += e.counters().decode_tokens - decode_before;
    }
  }
  const double fpt = FlopsPerToken(c);
  const double prefill_tps =
      prefill_s > 0 ? static_cast<double>(f.batch * f.prompt_len) / prefill_s : 0.0;
  const double decode_tps = decode_s > 0 ? static_cast<double>(decode_tokens_run) / decode_s : 0;
  round.Set("prefill_tokens_per_s", prefill_tps);
  round.Set("decode_tokens_per_s", decode_tps);
  round.Set("prefill_gflops", prefill_tps * fpt / 1e9);
  round.Set("decode_gflops", decode_tps * fpt / 1e9);
  round.Set("prefill_seconds", prefill_s);
  round.Set("decode_seconds", decode_s);
  return Status::OK();
}

}  // namespace

CLI::App* AddBenchCommand(CLI::App& app, BenchFlags* flags) {
  const BenchSpec spec = EngineSpec();
  CLI::App* bench = app.add_subcommand(
      "bench",
      "Prefill and decode tokens/s (one thread) against this machine's own MatMul rate measured "
      "in the same run, in paired rounds.");
  AddModelFlags(bench, flags->model);
  bench->add_option("--batch", flags->batch, "concurrent requests")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  bench->add_option("--prompt-len", flags->prompt_len, "prompt tokens per request (prefill phase)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  bench->add_option("--decode-tokens", flags->decode_tokens, "tokens each request decodes")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  bench::AddRoundsFlag(*bench, &flags->rounds, spec);
  bench::AddOutputFlags(*bench, &flags->output);
  bench->footer(bench::FiguresHelp(spec) +
                "--json also carries model, layers, hidden, params, block_size, attn_pack, device, "
                "batch, prompt_len, decode_tokens and flops_per_token.");
  return bench;
}

int RunBench(const BenchFlags& f) {
  auto engine = MakeEngine(f.model);
  if (!engine.ok()) return kErrors.Fail(engine.status());
  Engine& e = **engine;
  const ModelConfig& c = e.config();
  const double params = static_cast<double>(c.NumParameters());

  Result<std::unique_ptr<Report>> created = Report::Create(EngineSpec());
  if (!created.ok()) return kErrors.Fail(created.status());
  Report& report = **created;
  bench::RoundSides sides;
  sides.measure = [&](Round& round) { return MeasureEngine(e, f, round); };
  sides.limit = [](Round& round) {
    round.Set("matmul_gflops", MatMulGflops());
    return Status::OK();
  };
  bench::Progress progress = bench::Progress::ToStderr(f.output.progress);
  if (Status s = bench::RunRounds(report, f.rounds, sides, progress); !s.ok()) {
    return kErrors.Fail(s);
  }

  report.Set("model", c.name);
  report.Set("layers", c.layers.size());
  report.Set("hidden", c.hidden);
  report.Set("params", c.NumParameters());
  report.Set("block_size", e.layout().block_size);
  report.Set("attn_pack", e.layout().attn_pack);
  report.Set("device", f.model.device);
  report.Set("batch", f.batch);
  report.Set("prompt_len", f.prompt_len);
  report.Set("decode_tokens", f.decode_tokens);
  report.Set("flops_per_token", FlopsPerToken(c));
  // Labels of at most 7 letters keep "prefill: " and "decode:  " as scripts have read them.
  report.Heading(
      "model", fmt::format("{} layers={} hidden={} params={:.3f}M ({:.1f} MiB float32) "
                           "block_size={} attn_pack={} device={}",
                           c.name, c.layers.size(), c.hidden, params / 1e6, params * 4 / 1048576.0,
                           e.layout().block_size, e.layout().attn_pack, f.model.device));
  report.Heading("prefill", fmt::format("{} x {} tokens (distinct prompts, one generated token "
                                        "each)",
                                        f.batch, f.prompt_len));
  report.Heading("decode", fmt::format("{} streams x {} tokens (the steps that run no prompt "
                                       "tokens)",
                                       f.batch, f.decode_tokens));
  report.Heading("machine", fmt::format("MatMul {}x{}x{} on one thread, {:.0f} FLOP per token in "
                                        "the model's projections",
                                        kRows, kIn, kOut, FlopsPerToken(c)));
  bench::Print(report, f.output, std::cout);
  return kExitOk;
}

}  // namespace kvstash::engine::cli
