// `kvstash bench route`: a Mooncake-format trace replayed as completions through kvstash-router
// in front of a fresh local cluster (kvstashd nodes, prefill and decode workers), once per
// routing policy, next to the same prompts on a worker without any cache: the prompt tokens each
// policy computed, where the rest came from, time to first token, and whether every completion
// gave the tokens of the run without a cache.

#include <httplib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "kvstash/bench/harness.h"
#include "kvstash/common/byte_units.h"
#include "kvstash/common/cli.h"
#include "kvstash/common/hash.h"
#include "kvstash/common/subprocess.h"
#include "kvstash/worker/client.h"
#include "replay_trace.h"

namespace kvstash::bench {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

const cli::ErrorReporter kErrors("kvstash bench route");

struct RouteFlags {
  std::string trace;
  int64_t requests = 400;
  size_t tokens_per_id = 16;
  size_t trace_block_tokens = 512;
  size_t max_tokens = 4;
  size_t nodes = 2;
  size_t prefill = 2;
  size_t decode = 2;
  std::string model = "builtin:tiny-hybrid";
  std::string node_bytes = "64MiB";
  size_t num_blocks = 4096;
  size_t concurrency = 2;
  size_t local_prefill_tokens = 256;
  std::vector<std::string> policies = {"kv", "round-robin"};
  bool no_reference = false;
  std::string kvstashd, engine, router;
  OutputOptions output;
};

// A program of this build: next to this one, or where the build tree puts it relative to
// tools/kvstash/kvstash; else its name (looked up on PATH).
std::string FindProgram(const std::string& name, const std::string& build_path) {
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  if (!error) {
    for (const std::filesystem::path& candidate :
         {self.parent_path() / name, self.parent_path() / "../.." / build_path}) {
      if (access(candidate.c_str(), X_OK) == 0) return candidate.lexically_normal().string();
    }
  }
  return name;
}

// A child started with its output kept in memory (it never blocks on a pipe nobody reads),
// once it printed a line starting with `prefix`: the rest of that line.
struct Started {
  std::unique_ptr<ChildProcess> child;
  std::string rest;
};

Result<Started> Start(const std::vector<std::string>& argv, const std::string& prefix) {
  ChildOptions options;
  options.output = ChildOptions::Output::kMemory;
  options.merge_stderr = true;
  KVSTASH_ASSIGN_OR_RETURN(auto child, ChildProcess::Create(argv, options));
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (Clock::now() < deadline) {
    const std::string out = child->Output();
    for (size_t at = out.find(prefix); at != std::string::npos; at = out.find(prefix, at + 1)) {
      if (at != 0 && out[at - 1] != '\n') continue;
      const size_t end = out.find('\n', at);
      if (end == std::string::npos) break;  // not all written yet
      return Started{std::move(child), out.substr(at + prefix.size(), end - at - prefix.size())};
    }
    if (child->Exited()) {
      return UnavailableError("{} exited before it started: {}", argv[0],
                              out.substr(out.size() > 2000 ? out.size() - 2000 : 0));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return DeadlineExceededError("{} did not start within 60 s", argv[0]);
}

// The last word of `text` ("... on 127.0.0.1:4242" -> "127.0.0.1:4242").
std::string LastWord(const std::string& text) { return text.substr(text.rfind(' ') + 1); }

// One trace request as a prompt: each hash id becomes tokens_per_id tokens drawn from the id
// (equal ids, equal tokens: the trace's shared prefixes stay shared), the prompt cut to the
// request's input length scaled by tokens_per_id / trace_block_tokens.
std::vector<uint32_t> PromptOf(const TraceRequest& r, const RouteFlags& f, uint32_t vocab) {
  std::vector<uint32_t> tokens;
  tokens.reserve(r.hash_ids.size() * f.tokens_per_id);
  for (uint64_t id : r.hash_ids) {
    for (size_t j = 0; j < f.tokens_per_id; ++j) {
      tokens.push_back(static_cast<uint32_t>(Mix64(id * 0x9e3779b97f4a7c15ULL + j) % vocab));
    }
  }
  const double scaled = static_cast<double>(r.input_length) * static_cast<double>(f.tokens_per_id) /
                        static_cast<double>(f.trace_block_tokens);
  const size_t length = std::clamp<size_t>(static_cast<size_t>(std::ceil(scaled)), 1,
                                           std::max<size_t>(tokens.size(), 1));
  if (tokens.empty()) tokens.push_back(1);
  tokens.resize(length);
  return tokens;
}

// What one completion gave.
struct Outcome {
  bool ok = false;
  std::string error;
  std::vector<uint32_t> tokens;
  worker::CompletionUsage usage;
  size_t prefill_computed = 0;  // of usage.computed_tokens, the prefill worker's
};

// Sends every prompt to `address` from `concurrency` threads in trace order: each thread takes
// the next request when its last one is answered.
std::vector<Outcome> Replay(const std::string& address,
                            const std::vector<std::vector<uint32_t>>& prompts, const RouteFlags& f,
                            Progress& progress, std::string_view what) {
  std::vector<Outcome> outcomes(prompts.size());
  std::atomic<size_t> next{0}, done{0};
  std::vector<std::thread> threads;
  for (size_t t = 0; t < f.concurrency; ++t) {
    threads.emplace_back([&] {
      auto client = worker::WorkerClient::Create(address, std::chrono::minutes(10));
      for (size_t i; (i = next.fetch_add(1)) < prompts.size();) {
        if (!client.ok()) {
          outcomes[i].error = client.status().ToString();
          done.fetch_add(1);
          continue;
        }
        worker::CompletionRequest request;
        request.prompt = prompts[i];
        request.max_tokens = f.max_tokens;
        Result<worker::Completion> c = (*client)->Complete(request);
        if (c.ok()) {
          size_t prefill_computed = 0;
          const json routed = json::parse(c->router, nullptr, /*allow_exceptions=*/false);
          if (routed.is_object() && routed.contains("prefill") && routed["prefill"].is_object()) {
            prefill_computed = routed["prefill"].value("computed_tokens", size_t{0});
          }
          outcomes[i] = {true, "", std::move(c->tokens), c->usage, prefill_computed};
        } else {
          outcomes[i].error = c.status().ToString();
        }
        done.fetch_add(1);
      }
    });
  }
  while (done.load() < prompts.size()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    progress.Update(fmt::format("{}: {}/{} requests", what, done.load(), prompts.size()));
  }
  for (auto& t : threads) t.join();
  return outcomes;
}

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t k = static_cast<size_t>(std::ceil(p * static_cast<double>(values.size()))) - 1;
  return values[std::min(k, values.size() - 1)];
}

// One policy's run: its figures.
struct PolicyRun {
  std::string policy;
  size_t requests = 0, failed = 0, mismatches = 0;
  uint64_t prompt_tokens = 0, computed_tokens = 0, node_tokens = 0, local_hit_tokens = 0;
  uint64_t prefill_computed_tokens = 0;
  uint64_t prefills = 0, skipped_prefills = 0, retries = 0;
  double ttft_p50 = 0, ttft_p99 = 0;
  std::string first_error;
};

// The cluster of one policy's run: nodes, workers and the router, stopped when destroyed.
struct Cluster {
  std::vector<Started> processes;
  std::string router;
};

Result<Cluster> StartCluster(const RouteFlags& f, const std::string& policy, uint64_t node_bytes) {
  Cluster c;
  std::vector<std::string> nodes, node_events, node_replays;
  for (size_t i = 0; i < f.nodes; ++i) {
    KVSTASH_ASSIGN_OR_RETURN(
        Started node, Start({f.kvstashd, "--listen", "127.0.0.1", "--port", "0",
                             "--metrics-address", "off", "--log-level", "warn", "--block-bytes",
                             "4152", "--cpu-bytes", std::to_string(node_bytes), "--kv-events",
                             "tcp://127.0.0.1:*", "--kv-events-replay", "tcp://127.0.0.1:*"},
                            "kvstashd KV events on "));
    const std::string events = node.rest.substr(0, node.rest.find(','));
    node_events.push_back(events);
    node_replays.push_back(LastWord(node.rest));
    const std::string out = node.child->Output();
    const std::string listening = "kvstashd listening on ";
    const size_t at = out.find("\n" + listening);
    const size_t from = at == std::string::npos ? out.find(listening) : at + 1;
    nodes.push_back(
        out.substr(from + listening.size(), out.find('\n', from) - from - listening.size()));
    c.processes.push_back(std::move(node));
  }
  std::string node_list;
  for (const std::string& n : nodes) node_list += (node_list.empty() ? "" : ",") + n;
  auto worker = [&](const std::string& role) -> Result<std::string> {
    std::vector<std::string> argv = {f.engine,
                                     "serve",
                                     "--model",
                                     f.model,
                                     "--role",
                                     role,
                                     "--port",
                                     "0",
                                     "--num-blocks",
                                     std::to_string(f.num_blocks),
                                     "--kv-events",
                                     "tcp://127.0.0.1:*",
                                     "--kv-events-replay",
                                     "tcp://127.0.0.1:*"};
    if (!node_list.empty()) argv.insert(argv.end(), {"--nodes", node_list});
    KVSTASH_ASSIGN_OR_RETURN(Started w, Start(argv, "kvstash-engine KV events on "));
    const std::string out = w.child->Output();
    const size_t at = out.find("kvstash-engine serving ");
    const std::string address = LastWord(out.substr(at, out.find('\n', at) - at));
    c.processes.push_back(std::move(w));
    return address;
  };
  std::vector<std::string> router_argv = {f.router,
                                          "--port",
                                          "0",
                                          "--policy",
                                          policy,
                                          "--local-prefill-tokens",
                                          std::to_string(f.local_prefill_tokens)};
  for (size_t i = 0; i < f.prefill; ++i) {
    KVSTASH_ASSIGN_OR_RETURN(std::string address, worker("prefill"));
    router_argv.insert(router_argv.end(), {"--prefill-worker", address});
  }
  for (size_t i = 0; i < f.decode; ++i) {
    KVSTASH_ASSIGN_OR_RETURN(std::string address, worker(f.nodes > 0 ? "decode" : "both"));
    router_argv.insert(router_argv.end(), {"--decode-worker", address});
  }
  for (size_t i = 0; i < node_events.size(); ++i) {
    router_argv.insert(router_argv.end(),
                       {"--node-events", node_events[i], "--node-events-replay", node_replays[i]});
  }
  KVSTASH_ASSIGN_OR_RETURN(Started router, Start(router_argv, "kvstash-router serving on "));
  c.router = router.rest;
  c.processes.push_back(std::move(router));
  return c;
}

int RunBenchRoute(const RouteFlags& flags) {
  RouteFlags f = flags;
  if (f.kvstashd.empty()) f.kvstashd = FindProgram("kvstashd", "node/kvstashd");
  if (f.engine.empty()) {
    f.engine = FindProgram("kvstash-engine", "tools/kvstash-engine/kvstash-engine");
  }
  if (f.router.empty()) {
    f.router = FindProgram("kvstash-router", "tools/kvstash-router/kvstash-router");
  }
  auto node_bytes = ParseBytes("--node-bytes", f.node_bytes);
  if (!node_bytes.ok()) return kErrors.Fail(node_bytes.status());
  if (f.prefill > 0 && f.nodes == 0) {
    return kErrors.Fail(InvalidArgumentError("prefill workers need nodes (--nodes)"));
  }
  std::ifstream in(f.trace);
  if (!in) return kErrors.Fail(NotFoundError("cannot open the trace '{}'", f.trace));
  auto trace = ParseReplayTrace(in, f.trace, f.requests);
  if (!trace.ok()) return kErrors.Fail(trace.status());
  if (trace->empty()) return kErrors.Fail(InvalidArgumentError("the trace '{}' is empty", f.trace));
  Progress progress = Progress::ToStderr(f.output.progress);

  // The model's vocabulary, from a worker without nodes or cache: the reference run's.
  Started reference;
  {
    auto started = Start({f.engine, "serve", "--model", f.model, "--port", "0", "--no-prefix-cache",
                          "--num-blocks", std::to_string(f.num_blocks)},
                         "kvstash-engine serving ");
    if (!started.ok()) return kErrors.Fail(started.status());
    reference = std::move(*started);
  }
  const std::string reference_address = LastWord(reference.rest);
  uint32_t vocab = 256;
  {
    auto client = worker::WorkerClient::Create(reference_address, std::chrono::seconds(30));
    if (!client.ok()) return kErrors.Fail(client.status());
    auto info = (*client)->Info();
    if (!info.ok()) return kErrors.Fail(info.status());
    // The model list carries no vocabulary: probe for the largest id the worker accepts.
    worker::CompletionRequest probe;
    probe.max_tokens = 1;
    for (uint32_t v : {uint32_t{1} << 20, uint32_t{1} << 17, uint32_t{1} << 15, uint32_t{32000},
                       uint32_t{4096}, uint32_t{1024}, uint32_t{256}}) {
      probe.prompt = {v - 1};
      if ((*client)->Complete(probe).ok()) {
        vocab = v;
        break;
      }
    }
  }
  std::vector<std::vector<uint32_t>> prompts;
  for (const TraceRequest& r : *trace) prompts.push_back(PromptOf(r, f, vocab));
  uint64_t prompt_tokens = 0;
  for (const auto& p : prompts) prompt_tokens += p.size();

  std::vector<Outcome> expected;
  double reference_p50 = 0, reference_p99 = 0;
  if (!f.no_reference) {
    expected = Replay(reference_address, prompts, f, progress, "no cache");
    std::vector<double> ttft;
    for (const Outcome& o : expected) {
      if (!o.ok) return kErrors.Fail(InternalError("the run without a cache failed: {}", o.error));
      ttft.push_back(o.usage.ttft_ms);
    }
    reference_p50 = Percentile(ttft, 0.5);
    reference_p99 = Percentile(ttft, 0.99);
  }
  reference.child.reset();

  std::vector<PolicyRun> runs;
  for (const std::string& policy : f.policies) {
    progress.Update(fmt::format("{}: starting the cluster", policy));
    auto cluster = StartCluster(f, policy, *node_bytes);
    if (!cluster.ok()) return kErrors.Fail(cluster.status());
    std::vector<Outcome> got = Replay(cluster->router, prompts, f, progress, policy);
    PolicyRun run;
    run.policy = policy;
    std::vector<double> ttft;
    for (size_t i = 0; i < got.size(); ++i) {
      const Outcome& o = got[i];
      if (!o.ok) {
        ++run.failed;
        if (run.first_error.empty()) run.first_error = o.error;
        continue;
      }
      ++run.requests;
      run.prompt_tokens += o.usage.prompt_tokens;
      run.computed_tokens += o.usage.computed_tokens;
      run.prefill_computed_tokens += o.prefill_computed;
      run.node_tokens += o.usage.node_tokens;
      run.local_hit_tokens += o.usage.local_hit_tokens;
      ttft.push_back(o.usage.ttft_ms);
      if (!expected.empty() && o.tokens != expected[i].tokens) ++run.mismatches;
    }
    run.ttft_p50 = Percentile(ttft, 0.5);
    run.ttft_p99 = Percentile(ttft, 0.99);
    // The router's own count of prefills skipped and retries.
    const size_t colon = cluster->router.rfind(':');
    httplib::Client http(cluster->router.substr(0, colon),
                         std::stoi(cluster->router.substr(colon + 1)));
    if (httplib::Result state = http.Get("/kvstash/router"); state && state->status == 200) {
      const json j = json::parse(state->body, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("totals")) {
        run.prefills = j["totals"].value("prefills", uint64_t{0});
        run.skipped_prefills = j["totals"].value("skipped_prefills", uint64_t{0});
        run.retries = j["totals"].value("retries", uint64_t{0});
      }
    }
    runs.push_back(std::move(run));
  }
  progress.Finish();

  const PolicyRun* kv = nullptr;
  const PolicyRun* rr = nullptr;
  for (const PolicyRun& r : runs) {
    if (r.policy == "kv") kv = &r;
    if (r.policy == "round-robin") rr = &r;
  }
  std::optional<double> saved;  // the share of round-robin's computed tokens kv did not compute
  if (kv != nullptr && rr != nullptr && rr->computed_tokens > 0) {
    saved =
        1.0 - static_cast<double>(kv->computed_tokens) / static_cast<double>(rr->computed_tokens);
  }
  if (f.output.json) {
    json out = {{"bench", "route"},
                {"trace", f.trace},
                {"requests", prompts.size()},
                {"prompt_tokens", prompt_tokens},
                {"model", f.model},
                {"nodes", f.nodes},
                {"prefill_workers", f.prefill},
                {"decode_workers", f.decode},
                {"node_bytes", *node_bytes},
                {"num_blocks", f.num_blocks},
                {"tokens_per_id", f.tokens_per_id},
                {"max_tokens", f.max_tokens},
                {"concurrency", f.concurrency},
                {"local_prefill_tokens", f.local_prefill_tokens},
                {"nocache_ttft_p50_ms", f.no_reference ? json() : json(reference_p50)},
                {"nocache_ttft_p99_ms", f.no_reference ? json() : json(reference_p99)},
                {"kv_saved_vs_round_robin", saved ? json(*saved) : json()}};
    json list = json::array();
    for (const PolicyRun& r : runs) {
      list.push_back({{"policy", r.policy},
                      {"requests", r.requests},
                      {"failed", r.failed},
                      {"first_error", r.first_error},
                      {"prompt_tokens", r.prompt_tokens},
                      {"computed_tokens", r.computed_tokens},
                      {"prefill_computed_tokens", r.prefill_computed_tokens},
                      {"node_tokens", r.node_tokens},
                      {"local_hit_tokens", r.local_hit_tokens},
                      {"prefills", r.prefills},
                      {"skipped_prefills", r.skipped_prefills},
                      {"retries", r.retries},
                      {"ttft_p50_ms", r.ttft_p50},
                      {"ttft_p99_ms", r.ttft_p99},
                      {"mismatches", f.no_reference ? json() : json(r.mismatches)}});
    }
    out["runs"] = std::move(list);
    std::cout << out.dump() << "\n";
  } else {
    std::printf(
        "%zu requests of %s (%llu prompt tokens), %s on %zu nodes of %s, %zu prefill + "
        "%zu decode workers, %zu at a time\n",
        prompts.size(), f.trace.c_str(), static_cast<unsigned long long>(prompt_tokens),
        f.model.c_str(), f.nodes, f.node_bytes.c_str(), f.prefill, f.decode, f.concurrency);
    std::printf("%-12s %9s %9s %9s %9s %9s %8s %9s %9s %10s\n", "policy", "computed", "share",
                "node", "local", "skipped", "failed", "ttft_p50", "ttft_p99", "tokens");
    if (!f.no_reference) {
      std::printf("%-12s %9llu %9s %9s %9s %9s %8s %9.2f %9.2f %10s\n", "no-cache",
                  static_cast<unsigned long long>(prompt_tokens), "1.00", "-", "-", "-", "-",
                  reference_p50, reference_p99, "reference");
    }
    for (const PolicyRun& r : runs) {
      std::printf("%-12s %9llu %9.3f %9llu %9llu %9llu %8zu %9.2f %9.2f %10s\n", r.policy.c_str(),
                  static_cast<unsigned long long>(r.computed_tokens),
                  prompt_tokens > 0
                      ? static_cast<double>(r.computed_tokens) / static_cast<double>(prompt_tokens)
                      : 0.0,
                  static_cast<unsigned long long>(r.node_tokens),
                  static_cast<unsigned long long>(r.local_hit_tokens),
                  static_cast<unsigned long long>(r.skipped_prefills), r.failed, r.ttft_p50,
                  r.ttft_p99,
                  f.no_reference      ? "-"
                  : r.mismatches == 0 ? "identical"
                                      : fmt::format("{} differ", r.mismatches).c_str());
      if (!r.first_error.empty()) std::printf("  first error: %s\n", r.first_error.c_str());
    }
    if (saved) {
      std::printf("kv computed %.1f%% fewer prompt tokens than round-robin\n", *saved * 100);
    }
  }
  for (const PolicyRun& r : runs) {
    if (r.failed > 0 || r.mismatches > 0) {
      return kErrors.Fail(
          InternalError("{}: {} request(s) failed and {} gave other tokens than without a cache",
                        r.policy, r.failed, r.mismatches));
    }
  }
  return cli::kExitOk;
}

}  // namespace

void AddBenchRouteCommand(CLI::App& bench, int* exit_code) {
  auto flags = std::make_shared<RouteFlags>();
  CLI::App* cmd = bench.add_subcommand(
      "route",
      "Replay a Mooncake-format trace as completions through kvstash-router in front of a fresh "
      "local cluster (kvstashd nodes, prefill and decode workers of --model), once per --policy, "
      "and the same prompts on a worker without any cache: per policy the prompt tokens computed "
      "(prefill's and decode's; the share of all prompt tokens), the tokens decode workers "
      "loaded from the nodes and found in their own cache, prefills skipped, TTFT p50/p99 at "
      "the router, and whether every completion gave the tokens of the run without a cache "
      "(exit 1 if not). Each hash id of the trace becomes --tokens-per-id tokens drawn from the "
      "id, so shared prefixes stay shared.");
  cmd->add_option("--trace", flags->trace,
                  "The trace: Mooncake's JSONL (timestamp, input_length, "
                  "output_length, hash_ids)")
      ->required();
  cmd->add_option("--requests", flags->requests, "Requests read from the trace's start (0: all)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30))
      ->capture_default_str();
  cmd->add_option("--tokens-per-id", flags->tokens_per_id,
                  "Tokens each hash id becomes (the model's block size: one block per id)")
      ->check(CLI::Range(size_t{1}, size_t{4096}))
      ->capture_default_str();
  cmd->add_option("--trace-block-tokens", flags->trace_block_tokens,
                  "Tokens one hash id stands for in the trace (its input_length is scaled by "
                  "--tokens-per-id over this)")
      ->check(CLI::Range(size_t{1}, size_t{1} << 20))
      ->capture_default_str();
  cmd->add_option("--max-tokens", flags->max_tokens, "Tokens generated per request")
      ->check(CLI::Range(size_t{1}, size_t{4096}))
      ->capture_default_str();
  cmd->add_option("--nodes", flags->nodes, "kvstashd nodes")
      ->check(CLI::Range(size_t{0}, size_t{16}))
      ->capture_default_str();
  cmd->add_option("--prefill", flags->prefill, "Prefill workers")
      ->check(CLI::Range(size_t{0}, size_t{16}))
      ->capture_default_str();
  cmd->add_option("--decode", flags->decode, "Decode workers")
      ->check(CLI::Range(size_t{1}, size_t{16}))
      ->capture_default_str();
  cmd->add_option("--model", flags->model, "The workers' model")->capture_default_str();
  cmd->add_option("--node-bytes", flags->node_bytes, "Each node's CPU tier (kvstashd --cpu-bytes)")
      ->capture_default_str();
  cmd->add_option("--num-blocks", flags->num_blocks,
                  "Pages of each worker's KV-cache pool (kvstash-engine serve --num-blocks): "
                  "what its own prefix cache can keep")
      ->check(CLI::Range(size_t{16}, size_t{1} << 24))
      ->capture_default_str();
  cmd->add_option("--concurrency", flags->concurrency,
                  "Requests in flight at once (each client takes the next request of the trace "
                  "when its last is answered)")
      ->check(CLI::Range(size_t{1}, size_t{256}))
      ->capture_default_str();
  cmd->add_option("--local-prefill-tokens", flags->local_prefill_tokens,
                  "kvstash-router --local-prefill-tokens (kv: prompts with at most this many "
                  "tokens left to compute go to the decode worker alone)")
      ->capture_default_str();
  cmd->add_option("--policy", flags->policies, "The policies to run, in order: kv, round-robin")
      ->check(CLI::IsMember({"kv", "round-robin"}))
      ->capture_default_str();
  cmd->add_flag("--no-reference", flags->no_reference,
                "Skip the run without a cache (no token check)");
  cmd->add_option("--kvstashd", flags->kvstashd,
                  "The kvstashd to start. Default: next to this program, or in its build tree, "
                  "else on PATH");
  cmd->add_option("--kvstash-engine", flags->engine,
                  "The kvstash-engine to start (found as "
                  "--kvstashd)");
  cmd->add_option("--kvstash-router", flags->router,
                  "The kvstash-router to start (found as "
                  "--kvstashd)");
  AddOutputFlags(*cmd, &flags->output);
  cmd->callback([flags, exit_code] { *exit_code = RunBenchRoute(*flags); });
}

}  // namespace kvstash::bench
