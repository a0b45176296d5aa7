// `kvstash-engine`: runs kvstash's inference engine on a hybrid-attention model.
//   generate  one prompt to completion; the generated token ids on the last line
//   serve     a worker serving an OpenAI-compatible HTTP API (kvstash::worker)
//   chat      a multi-turn conversation, here or through workers; per turn how much of the
//             prompt came from a cache
//   bench     prefill and decode tokens/s, against the machine's own matrix-multiply rate

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench_command.h"
#include "cli_common.h"
#include "kvstash/common/client_counters.h"
#include "kvstash/common/hash.h"
#include "kvstash/engine/engine.h"
#include "kvstash/engine/node_offload.h"
#include "serve_command.h"

namespace {

using namespace kvstash;
using namespace kvstash::engine;
using namespace kvstash::engine::cli;
using Clock = std::chrono::steady_clock;

int RunGenerate(const ModelFlags& f, const std::string& prompt_text, size_t max_new, bool stats,
                const std::string& role, bool show_ttft) {
  auto prompt = ParseTokens(prompt_text);
  if (!prompt.ok()) return kErrors.Fail(prompt.status());
  if (role != "both" && !HasNodes(f)) {
    return kErrors.Fail(InvalidArgumentError("--role {} needs --nodes or --etcd", role));
  }
  auto engine = MakeEngine(f);
  if (!engine.ok()) return kErrors.Fail(engine.status());
  Engine& e = **engine;
  // A prefill worker computes the prompt and its first token, and pushes every full block for
  // the decode worker that continues it.
  const bool prefill = role == "prefill";
  auto id = e.AddRequest(*prompt, prefill ? 1 : max_new, /*do_remote_decode=*/prefill);
  if (!id.ok()) return kErrors.Fail(id.status());
  std::unique_ptr<Request> r;
  // Time to first token: from the request's arrival to its first sampled token (the lookup,
  // loads and prompt computation included; engine and node connections set up before).
  const auto start = Clock::now();
  double ttft_ms = -1;
  while (e.HasUnfinished()) {
    for (RequestId done : e.Step()) r = e.TakeResult(done);
    const Request* running = r ? r.get() : e.Find(*id);
    if (ttft_ms < 0 && running != nullptr && running->num_output_tokens() > 0) {
      ttft_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    }
  }
  e.DrainOffload();  // the pushes land before the process ends
  if (r == nullptr) return kErrors.Fail(InternalError("the request did not finish"));
  if (r->state == Request::State::kFailed) return kErrors.Fail(r->error);
  if (stats) {
    std::printf("prompt_tokens=%zu cached_tokens=%zu computed_tokens=%zu", r->num_prompt_tokens,
                r->num_cached_tokens, r->num_computed_prompt_tokens);
    if (show_ttft) std::printf(" ttft_ms=%.3f", ttft_ms);
    if (const KvOffload* offload = e.offload()) {
      const OffloadStats s = offload->stats();
      std::printf(" node_tokens=%zu loaded_bytes=%llu stored_bytes=%llu load_failures=%llu",
                  r->num_external_tokens, static_cast<unsigned long long>(s.bytes_loaded),
                  static_cast<unsigned long long>(s.bytes_stored),
                  static_cast<unsigned long long>(e.counters().load_failures));
      // The node client's counters, every row of its registry by the name workers export.
      s.client.ForEach([](const ClientCounterDef& def, uint64_t value) {
        std::printf(" %s=%llu", def.export_name, static_cast<unsigned long long>(value));
      });
    }
    std::printf("\n");
  }
  std::printf("%s\n", Join(r->output()).c_str());
  return kExitOk;
}

int RunChat(const ModelFlags& f, size_t turns, size_t user_tokens, size_t max_new, uint64_t seed) {
  auto engine = MakeEngine(f);
  if (!engine.ok()) return kErrors.Fail(engine.status());
  Engine& e = **engine;
  std::printf("model=%s block_size=%u attn_pack=%u groups=%zu page_bytes=%zu\n",
              e.config().name.c_str(), e.layout().block_size, e.layout().attn_pack,
              e.layout().groups.size(), e.layout().page_bytes());
  std::vector<uint32_t> history;
  size_t total_prompt = 0, total_cached = 0;
  for (size_t turn = 1; turn <= turns; ++turn) {
    std::vector<uint32_t> user = RandomTokens(user_tokens, e.config().vocab_size, seed + turn);
    history.insert(history.end(), user.begin(), user.end());
    auto results = e.Generate({history}, max_new);
    if (!results.ok()) return kErrors.Fail(results.status());
    const Request& r = *(*results)[0];
    std::printf("turn=%zu prompt_tokens=%zu cached_tokens=%zu computed_tokens=%zu\n", turn,
                r.num_prompt_tokens, r.num_cached_tokens, r.num_computed_prompt_tokens);
    total_prompt += r.num_prompt_tokens;
    total_cached += r.num_cached_tokens;
    history.insert(history.end(), r.output().begin(), r.output().end());
  }
  std::printf("total prompt_tokens=%zu cached_tokens=%zu (%.1f%%)\n", total_prompt, total_cached,
              total_prompt ? 100.0 * static_cast<double>(total_cached) / total_prompt : 0.0);
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app(
      "kvstash-engine: kvstash's inference engine for hybrid-attention models (full, sliding-"
      "window, chunked-local, KV-sharing and state layers) over a paged KV cache with prefix "
      "caching, chunked prefill and preemption. Greedy sampling; token ids in and out.",
      "kvstash-engine");
  app.require_subcommand(1);
  app.footer("Exit status: 0 on success, 1 on a run-time failure, 2 for bad arguments.");

  ModelFlags gen_flags;
  std::string prompt;
  size_t max_new = 16;
  bool stats = false;
  CLI::App* gen = app.add_subcommand(
      "generate", "Generate from one prompt; prints the generated token ids on the last line.");
  AddModelFlags(gen, gen_flags);
  gen->add_option("--prompt", prompt, "prompt token ids, space separated, e.g. \"1 2 3\"")
      ->required();
  gen->add_option("--max-new-tokens", max_new, "tokens to generate")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{1} << 20));
  std::string role = "both";
  gen->add_option("--role", role,
                  "both: one worker does everything; prefill: compute the prompt, push every full "
                  "block to --nodes and print the first generated token; decode: given the same "
                  "prompt, pull what the nodes hold, compute the rest and print all generated "
                  "tokens")
      ->capture_default_str()
      ->check(CLI::IsMember({"both", "prefill", "decode"}));
  bool ttft = false;
  gen->add_flag("--ttft", ttft,
                "with --stats, also ttft_ms=.. (time to first token: lookup, loads and prompt "
                "computation)");
  gen->add_flag("--stats", stats,
                "also print prompt_tokens=.. cached_tokens=.. computed_tokens=.. (prompt tokens "
                "the prefix cache held, and prompt tokens run through the model); with --nodes "
                "also node_tokens=.. (prompt tokens loaded from the nodes), the bytes loaded and "
                "stored, loads that fell back to recomputing, and the node client's counters: "
                "node_unreachable=.. (calls to nodes that were down or late: their blocks are "
                "misses), node_refusals=.. (calls a node refused: an error, logged), "
                "touched_keys=.. (keys whose use the nodes were told of), node_calls=.., ...");

  ModelFlags chat_flags;
  chat_flags.model = "builtin:tiny-state-hybrid";
  size_t turns = 8, user_tokens = 37, chat_new = 9;
  uint64_t chat_seed = 1;
  CLI::App* chat = app.add_subcommand(
      "chat",
      "A multi-turn conversation: each turn's prompt is the history plus new user tokens; "
      "prints per turn how many prompt tokens came from the prefix cache.");
  AddModelFlags(chat, chat_flags);
  // The last of a repeated flag wins: scripts/demo.sh passes its own, then the user's.
  chat->add_option("--turns", turns, "turns")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000))
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  chat->add_option("--user-tokens", user_tokens, "new user tokens per turn")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  chat->add_option("--max-new-tokens", chat_new, "tokens generated per turn")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  chat->add_option("--conversation-seed", chat_seed, "seed of the user tokens")
      ->capture_default_str();
  RemoteChatFlags remote;
  chat->add_option("--decode-worker", remote.decode_worker,
                   "HOST:PORT of a `kvstash-engine serve` worker: run the conversation there "
                   "instead of here, printing per turn the prompt tokens that came from the "
                   "nodes and the worker's own prefix cache, its time to first token, and the "
                   "bytes pushed and pulled; the model flags must be the workers'");
  chat->add_option("--prefill-worker", remote.prefill_worker,
                   "HOST:PORT of a `serve --role prefill` worker that computes each turn's "
                   "prompt and pushes it to the nodes before the decode worker continues it")
      ->needs("--decode-worker");
  chat->add_option("--router", remote.router,
                   "HOST:PORT of a kvstash-router: run the conversation through it, printing per "
                   "turn where it sent the turn (prefill and decode worker, or why it skipped the "
                   "prefill) and the prompt tokens the cluster computed, took from the nodes and "
                   "from the decode worker's own cache; the model flags must be the workers'")
      ->excludes("--decode-worker")
      ->excludes("--prefill-worker");
  chat->add_flag("!--no-compare", remote.compare,
                 "with --decode-worker or --router: do not also compute each turn here without "
                 "any cache "
                 "(by default each turn is, for the time to first token without a cache and to "
                 "check that the workers generated the same tokens)");
  chat->add_option("--worker-timeout-ms", remote.timeout_ms,
                   "with --decode-worker or --router: give up on a worker that has not answered a "
                   "turn "
                   "after this long")
      ->capture_default_str()
      ->check(CLI::Range(1u, 86400000u));

  ModelFlags serve_model_flags;
  ServeFlags serve_flags;
  CLI::App* serve = app.add_subcommand(
      "serve",
      "A worker: serves the engine over an OpenAI-compatible HTTP API. POST /v1/completions "
      "{\"prompt\": [token ids], \"max_tokens\": N, \"stream\": bool} answers OpenAI's "
      "completion object (choices[0].token_ids, the token ids; usage with kvstash's figures "
      "under usage.kvstash: node_tokens, local_hit_tokens, computed_tokens, ttft_ms, "
      "latency_ms), or with \"stream\": true Server-Sent Events, one per token, then "
      "[DONE]. GET /v1/models: the model, its fingerprint, block size and role; GET "
      "/kvstash/stats: running totals (also as Prometheus counters at GET /metrics); GET "
      "/health. Requests in flight run batched; an answer is sent once the request's blocks "
      "are on the nodes; a request whose client closes its connection is cancelled. Prints "
      "`kvstash-engine serving MODEL (role ROLE) on HOST:PORT` when ready; on SIGTERM or SIGINT "
      "gives the requests in flight --stop-grace-ms to finish, cancels the rest (503) and "
      "exits 0.");
  AddModelFlags(serve, serve_model_flags);
  serve->add_option("--listen", serve_flags.listen, "address to listen on")->capture_default_str();
  serve->add_option("--port", serve_flags.port, "port to listen on (0: any free port)")
      ->capture_default_str();
  serve
      ->add_option("--max-body-bytes", serve_flags.max_body_bytes,
                   "longest request body accepted; a longer one is answered 413 and its "
                   "connection closed")
      ->capture_default_str()
      ->check(CLI::Range(size_t{64}, size_t{1} << 30));
  serve
      ->add_option("--http-threads", serve_flags.http_threads,
                   "requests served at once (the completions in flight at most); more wait for "
                   "a thread. /health and the other GETs have threads of their own, and a "
                   "connection takes a thread only once its request's headers are in")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{4096}));
  serve
      ->add_option("--max-connections", serve_flags.max_connections,
                   "connections open at once, idle ones included; past it new ones wait in the "
                   "listen backlog (0: the open-files limit, RLIMIT_NOFILE, less 128 for the "
                   "engine)")
      ->capture_default_str()
      ->check(CLI::Range(size_t{0}, size_t{1} << 20));
  serve
      ->add_option("--listen-backlog", serve_flags.listen_backlog,
                   "connections the kernel holds for the worker to accept (capped at "
                   "net.core.somaxconn)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  serve
      ->add_option("--header-timeout-ms", serve_flags.header_timeout_ms,
                   "a request's line and headers must arrive within this (else 408 and the "
                   "connection closed); no thread waits for them")
      ->capture_default_str()
      ->check(CLI::Range(1, 3600000));
  serve
      ->add_option("--read-timeout-ms", serve_flags.read_timeout_ms,
                   "a request's body must arrive within this of its headers (else 408)")
      ->capture_default_str()
      ->check(CLI::Range(1, 3600000));
  serve
      ->add_option("--write-timeout-ms", serve_flags.write_timeout_ms,
                   "an answer its client leaves unread this long fails: the connection is "
                   "closed and a stream's request cancelled")
      ->capture_default_str()
      ->check(CLI::Range(1, 3600000));
  serve
      ->add_option("--stop-grace-ms", serve_flags.stop_grace_ms,
                   "on SIGTERM or SIGINT, how long the requests in flight may take to finish "
                   "before they are cancelled (answered 503)")
      ->capture_default_str()
      ->check(CLI::Range(0, 3600000));
  serve->add_option("--kv-events", serve_flags.kv_events,
                    "publish what the prefix cache caches and evicts, in vLLM's KV events schema "
                    "(medium GPU, with each block's parent, block size, group, kind and window), "
                    "on this ZMQ endpoint (PUB; tcp://*:5557 binds, tcp://HOST:PORT connects); "
                    "default off");
  serve->add_option("--kv-events-replay", serve_flags.kv_events_replay,
                    "with --kv-events: a ZMQ ROUTER endpoint (bound) replaying buffered batches "
                    "from a sequence number, as vLLM's publisher does");
  serve->add_option("--kv-events-topic", serve_flags.kv_events_topic,
                    "with --kv-events: the topic of every message (default: none, as vLLM's)");
  serve->add_flag("--register", serve_flags.register_worker,
                  "keep a key in --etcd's --cluster under /kvstash/<cluster>/workers/<advertise> "
                  "(its role; bound to a lease it keeps alive, deleted at SIGTERM/SIGINT) while "
                  "serving, so that kvstash-router --etcd finds this worker; needs --etcd and "
                  "--cluster");
  serve->add_option("--advertise", serve_flags.advertise,
                    "with --register: HOST or HOST:PORT routers reach this worker at. Default: the "
                    "--listen address and the port listened on; required when listening on every "
                    "address (0.0.0.0)");
  serve
      ->add_option("--etcd-ttl-s", serve_flags.etcd_ttl_s,
                   "with --register: TTL of the worker's etcd lease in seconds, refreshed every "
                   "third of it: a worker that dies leaves the routers' set this long after")
      ->capture_default_str()
      ->check(CLI::Range(2, 3600));
  serve
      ->add_option("--role", serve_flags.role,
                   "both: requests run to completion here; prefill: compute the prompt, push "
                   "every full block to --nodes, answer with the first generated token; decode: "
                   "pull what the nodes hold of the prompt, compute the rest, generate")
      ->capture_default_str()
      ->check(CLI::IsMember({"both", "prefill", "decode"}));

  BenchFlags bench_flags;
  AddBenchCommand(app, &bench_flags);

  if (std::optional<int> exit = ::kvstash::cli::ParseCommandLine(app, argc, argv)) return *exit;
  if (gen->parsed()) return RunGenerate(gen_flags, prompt, max_new, stats, role, ttft);
  if (serve->parsed()) return RunServe(serve_model_flags, serve_flags);
  if (chat->parsed() && (!remote.decode_worker.empty() || !remote.router.empty())) {
    return RunRemoteChat(chat_flags, remote, turns, user_tokens, chat_new, chat_seed);
  }
  if (chat->parsed()) return RunChat(chat_flags, turns, user_tokens, chat_new, chat_seed);
  return RunBench(bench_flags);
}
