#include "serve_command.h"

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "kvstash/common/logging.h"
#include "kvstash/membership/membership.h"
#include "kvstash/worker/client.h"
#include "kvstash/worker/protocol_json.h"
#include "kvstash/worker/server.h"

namespace kvstash::engine::cli {
namespace {

using Clock = std::chrono::steady_clock;

double Millis(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

std::string HexFingerprint(uint64_t f) { return fmt::format("0x{:016x}", f); }

// --max-connections 0: as many as the open-files limit leaves the engine 128 descriptors for.
size_t MaxConnections(size_t flag) {
  if (flag != 0) return flag;
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) != 0 || files.rlim_cur == RLIM_INFINITY) return 65536;
  const size_t limit = std::min<size_t>(files.rlim_cur, 1 << 20);
  return limit > 128 + 16 ? limit - 128 : 16;
}

struct LocalRun {
  std::vector<uint32_t> output;
  double ttft_ms = 0;
};

// The prompt on a local engine without any cache: the time to first token to compare with.
Result<LocalRun> RunWithoutCache(Engine& e, const std::vector<uint32_t>& prompt, size_t max_new) {
  const auto start = Clock::now();
  KVSTASH_ASSIGN_OR_RETURN(RequestId id, e.AddRequest(prompt, max_new));
  LocalRun run;
  run.ttft_ms = -1;
  std::unique_ptr<Request> r;
  while (e.HasUnfinished()) {
    for (RequestId done : e.Step()) r = e.TakeResult(done);
    const Request* live = r ? r.get() : e.Find(id);
    if (run.ttft_ms < 0 && live != nullptr && live->num_output_tokens() > 0) {
      run.ttft_ms = Millis(start, Clock::now());
    }
  }
  if (r == nullptr) return InternalError("the local request did not finish");
  if (r->state == Request::State::kFailed) return r->error;
  run.output.assign(r->output().begin(), r->output().end());
  return run;
}

// One turn through a worker: its completion, then its running totals (for the bytes it moved).
struct WorkerTurn {
  worker::Completion completion;
  worker::WorkerTotals totals;
};

Result<WorkerTurn> RunTurn(worker::WorkerClient& client, const worker::CompletionRequest& request) {
  WorkerTurn turn;
  KVSTASH_ASSIGN_OR_RETURN(turn.completion, client.Complete(request));
  KVSTASH_ASSIGN_OR_RETURN(turn.totals, client.Totals());
  return turn;
}

// --register's key: the worker at --advertise (or the address it listens on) with its role.
Result<std::optional<membership::RegistrationOptions>> WorkerRegistration(const ModelFlags& model,
                                                                          const ServeFlags& serve,
                                                                          uint16_t port) {
  if (!serve.register_worker) {
    if (!serve.advertise.empty()) return InvalidArgumentError("--advertise needs --register");
    return std::optional<membership::RegistrationOptions>();
  }
  if (model.etcd.empty() || model.cluster.empty()) {
    return InvalidArgumentError("--register needs --etcd and --cluster");
  }
  membership::RegistrationOptions r;
  KVSTASH_ASSIGN_OR_RETURN(r.etcd.endpoints, membership::ParseEtcdEndpoints(model.etcd));
  r.cluster = model.cluster;
  r.kind = membership::MemberKind::kWorker;
  r.ttl_s = serve.etcd_ttl_s;
  Result<std::string> address = membership::AdvertisedAddress(serve.advertise, serve.listen, port);
  if (!address.ok()) {
    if (serve.advertise.empty()) {
      return InvalidArgumentError(
          "--register: give --advertise, the address routers reach this worker at (it listens "
          "on every address, {})",
          serve.listen);
    }
    return InvalidArgumentError("--advertise: {}", address.status().message());
  }
  r.record.address = *address;
  r.record.role = serve.role;
  return std::optional<membership::RegistrationOptions>(std::move(r));
}

}  // namespace

int RunServe(const ModelFlags& model, const ServeFlags& serve) {
  // Flags checked before anything starts (the port is filled in once bound).
  if (auto checked = WorkerRegistration(model, serve, serve.port); !checked.ok()) {
    return kErrors.Fail(checked.status());
  }
  if (serve.role != "both" && !HasNodes(model)) {
    return kErrors.Fail(InvalidArgumentError("--role {} needs --nodes or --etcd", serve.role));
  }
  Result<worker::Role> role = worker::ParseRole(serve.role);
  if (!role.ok()) return kErrors.Fail(role.status());
#if defined(__GLIBC__)
  // Request bodies (up to --max-body-bytes) and their parsed JSON come and go on the HTTP
  // threads. glibc raises its mmap threshold to 32 MiB as large blocks are freed, and keeps
  // what is freed below it in each thread's arena for good (829 MB resident after a few 100 MB
  // bodies); a fixed threshold maps every block from 1 MiB on for itself and unmaps it when
  // freed.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
#endif
  // SIGINT and SIGTERM go to one thread that asks the server to stop. Blocked before any
  // thread starts (the engine's transfer and UCX threads inherit the mask), so none of them
  // takes the signal instead.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  if (!serve.kv_events_replay.empty() && serve.kv_events.empty()) {
    return kErrors.Fail(
        InvalidArgumentError("--kv-events-replay '{}' needs --kv-events", serve.kv_events_replay));
  }
  auto engine = MakeEngine(model, /*record_cache_events=*/!serve.kv_events.empty());
  if (!engine.ok()) return kErrors.Fail(engine.status());
  worker::ServerOptions options;
  options.kv_events.endpoint = serve.kv_events;
  options.kv_events.replay_endpoint = serve.kv_events_replay;
  options.kv_events.default_topic = serve.kv_events_topic;
  options.listen = serve.listen;
  options.port = serve.port;
  options.role = *role;
  options.max_body_bytes = serve.max_body_bytes;
  options.http_threads = serve.http_threads;
  options.max_connections = MaxConnections(serve.max_connections);
  options.listen_backlog = serve.listen_backlog;
  options.header_timeout_ms = serve.header_timeout_ms;
  options.read_timeout_ms = serve.read_timeout_ms;
  options.write_timeout_ms = serve.write_timeout_ms;
  options.stop_grace_ms = serve.stop_grace_ms;
  // The nodes at start (a followed cluster's set changes later).
  if (const KvOffload* offload = (*engine)->offload()) {
    options.num_nodes = offload->stats().live_nodes;
  }
  auto server = worker::WorkerServer::Create(engine->get(), options);
  if (!server.ok()) return kErrors.Fail(server.status());
  std::printf("kvstash-engine serving %s (role %s) on %s:%u\n", (*engine)->config().name.c_str(),
              serve.role.c_str(), serve.listen.c_str(), (*server)->port());
  if (const events::EventPublisher* events = (*server)->kv_events()) {
    std::printf("kvstash-engine KV events on %s%s%s\n", events->endpoint().c_str(),
                events->replay_endpoint().empty() ? "" : ", replay on ",
                events->replay_endpoint().c_str());
  }
  std::fflush(stdout);
  // Registered once it serves: a router that learns of it can call it at once.
  std::unique_ptr<membership::Registration> registration;
  if (auto wanted = WorkerRegistration(model, serve, (*server)->port()); wanted.ok() && *wanted) {
    auto created = membership::Registration::Create(std::move(**wanted));
    if (!created.ok()) return kErrors.Fail(created.status());
    registration = std::move(*created);
    KVSTASH_LOG_INFO("registered in cluster '{}' in etcd at {} as {}", model.cluster, model.etcd,
                     registration->key());
  }

  worker::WorkerServer* const stoppable = server->get();
  std::atomic<bool> signalled{false};
  membership::Registration* const registered = registration.get();
  std::thread waiter([&stop_signals, &signalled, stoppable, registered] {
    int signal_number = 0;
    sigwait(&stop_signals, &signal_number);
    signalled = true;
    // Routers stop choosing it before its requests' grace begins (the key deleted, not left to
    // expire).
    if (registered != nullptr) registered->Stop();
    stoppable->Stop();
  });
  const Status status = (*server)->Serve();
  if (registration) registration->Stop();
  // Serve ended without a signal (the HTTP server failed): wake the waiter with one.
  if (!signalled) pthread_kill(waiter.native_handle(), SIGTERM);
  waiter.join();
  if (!status.ok()) return kErrors.Fail(status);
  return kExitOk;
}

namespace {

// The engine a remote chat compares each turn with: the same model here, without prefix
// caching or nodes.
Result<std::unique_ptr<Engine>> MakeComparisonEngine(const ModelFlags& model) {
  ModelFlags local = model;
  local.nodes.clear();
  local.etcd.clear();
  local.cluster.clear();
  local.no_prefix_cache = true;
  return MakeEngine(local);
}

// chat --router: each turn one completion through kvstash-router, which picks the workers.
int RunRoutedChat(const ModelFlags& model, const RemoteChatFlags& flags, size_t turns,
                  size_t user_tokens, size_t max_new, uint64_t seed) {
  auto router_or =
      worker::WorkerClient::Create(flags.router, std::chrono::milliseconds(flags.timeout_ms));
  if (!router_or.ok()) return kErrors.Fail(router_or.status());
  std::unique_ptr<worker::WorkerClient> router = std::move(*router_or);
  auto info = router->Info();
  if (!info.ok()) return kErrors.Fail(info.status());
  auto local_or = MakeComparisonEngine(model);
  if (!local_or.ok()) return kErrors.Fail(local_or.status());
  std::unique_ptr<Engine> local = std::move(*local_or);
  if (flags.compare && local->fingerprint() != info->fingerprint) {
    return kErrors.Fail(InvalidArgumentError(
        "the router's workers run {} (fingerprint {}), not this --model {} ({}); give chat the "
        "workers' model flags",
        info->model, HexFingerprint(info->fingerprint), model.model,
        HexFingerprint(local->fingerprint())));
  }
  std::printf("model=%s router=%s\n", info->model.c_str(), router->address().c_str());
  std::vector<uint32_t> history;
  double sum_ttft = 0, sum_nocache = 0;
  size_t sum_prompt = 0, sum_computed = 0, sum_node = 0, sum_local = 0, mismatches = 0;
  for (size_t turn = 1; turn <= turns; ++turn) {
    std::vector<uint32_t> user = RandomTokens(user_tokens, local->config().vocab_size, seed + turn);
    history.insert(history.end(), user.begin(), user.end());
    worker::CompletionRequest request;
    request.prompt = history;
    request.max_tokens = max_new;
    auto done = router->Complete(request);
    if (!done.ok()) return kErrors.Fail(done.status());
    const worker::CompletionUsage& u = done->usage;
    // Where the router sent the turn, from usage.kvstash.router.
    std::string prefill = "-", decode = "-", skipped = "-";
    const nlohmann::json routed = nlohmann::json::parse(done->router, nullptr, false);
    if (routed.is_object()) {
      if (routed.contains("prefill") && routed["prefill"].is_object()) {
        prefill = routed["prefill"].value("worker", "-");
      }
      decode = routed.value("decode_worker", "-");
      if (routed.contains("skipped_prefill") && routed["skipped_prefill"].is_string()) {
        skipped = routed["skipped_prefill"].get<std::string>();
      }
    }
    std::printf(
        "turn=%zu prompt_tokens=%zu prefill_worker=%s decode_worker=%s skipped_prefill=%s "
        "computed_tokens=%zu decode_node_tokens=%zu decode_local_hit_tokens=%zu ttft_ms=%.2f",
        turn, history.size(), prefill.c_str(), decode.c_str(), skipped.c_str(), u.computed_tokens,
        u.node_tokens, u.local_hit_tokens, u.ttft_ms);
    if (flags.compare) {
      auto base = RunWithoutCache(*local, history, max_new);
      if (!base.ok()) return kErrors.Fail(base.status());
      const bool match = base->output == done->tokens;
      mismatches += match ? 0 : 1;
      std::printf(" nocache_ttft_ms=%.2f speedup=%.1fx tokens=%s", base->ttft_ms,
                  u.ttft_ms > 0 ? base->ttft_ms / u.ttft_ms : 0.0,
                  match ? "same-as-nocache" : "DIFFERENT");
      sum_nocache += base->ttft_ms;
    }
    std::printf("\n");
    std::fflush(stdout);
    sum_ttft += u.ttft_ms;
    sum_prompt += history.size();
    sum_computed += u.computed_tokens;
    sum_node += u.node_tokens;
    sum_local += u.local_hit_tokens;
    history.insert(history.end(), done->tokens.begin(), done->tokens.end());
  }
  std::printf(
      "total turns=%zu prompt_tokens=%zu computed_tokens=%zu decode_node_tokens=%zu "
      "decode_local_hit_tokens=%zu ttft_ms=%.2f",
      turns, sum_prompt, sum_computed, sum_node, sum_local, sum_ttft);
  if (flags.compare) {
    std::printf(" nocache_ttft_ms=%.2f speedup=%.1fx mismatches=%zu", sum_nocache,
                sum_ttft > 0 ? sum_nocache / sum_ttft : 0.0, mismatches);
  }
  std::printf("\n");
  if (mismatches > 0) {
    return kErrors.Fail(
        InternalError("{} turn(s) generated other tokens than without the cache", mismatches));
  }
  return kExitOk;
}

}  // namespace

int RunRemoteChat(const ModelFlags& model, const RemoteChatFlags& flags, size_t turns,
                  size_t user_tokens, size_t max_new, uint64_t seed) {
  if (!flags.router.empty()) return RunRoutedChat(model, flags, turns, user_tokens, max_new, seed);
  const auto timeout = std::chrono::milliseconds(flags.timeout_ms);
  std::unique_ptr<worker::WorkerClient> prefill;
  if (!flags.prefill_worker.empty()) {
    auto c = worker::WorkerClient::Create(flags.prefill_worker, timeout);
    if (!c.ok()) return kErrors.Fail(c.status());
    prefill = std::move(*c);
  }
  auto decode_or = worker::WorkerClient::Create(flags.decode_worker, timeout);
  if (!decode_or.ok()) return kErrors.Fail(decode_or.status());
  std::unique_ptr<worker::WorkerClient> decode = std::move(*decode_or);

  auto decode_info = decode->Info();
  if (!decode_info.ok()) return kErrors.Fail(decode_info.status());
  const std::string fingerprint = HexFingerprint(decode_info->fingerprint);
  if (prefill) {
    auto info = prefill->Info();
    if (!info.ok()) return kErrors.Fail(info.status());
    if (info->fingerprint != decode_info->fingerprint) {
      return kErrors.Fail(InvalidArgumentError(
          "the prefill worker {} runs {} (fingerprint {}) but the decode worker {} runs {} ({}): "
          "their blocks would never match",
          prefill->address(), info->model, HexFingerprint(info->fingerprint), decode->address(),
          decode_info->model, fingerprint));
    }
    if (info->role != worker::Role::kPrefill) {
      KVSTASH_LOG_WARN("the prefill worker {} runs with --role {}", prefill->address(),
                       worker::RoleName(info->role));
    }
  }

  auto local_or = MakeComparisonEngine(model);
  if (!local_or.ok()) return kErrors.Fail(local_or.status());
  std::unique_ptr<Engine> local = std::move(*local_or);
  if (flags.compare && HexFingerprint(local->fingerprint()) != fingerprint) {
    return kErrors.Fail(InvalidArgumentError(
        "the decode worker runs {} (fingerprint {}), not this --model {} ({}); give chat the "
        "workers' model flags",
        decode_info->model, fingerprint, model.model, HexFingerprint(local->fingerprint())));
  }
  const uint32_t vocab = local->config().vocab_size;

  std::printf("model=%s workers: prefill=%s decode=%s\n", decode_info->model.c_str(),
              prefill ? prefill->address().c_str() : "-", decode->address().c_str());
  std::vector<uint32_t> history;
  // Each worker's totals after the previous turn: the bytes a turn moved are the difference.
  worker::WorkerTotals last_p, last_d;
  if (prefill) {
    auto totals = prefill->Totals();
    if (!totals.ok()) return kErrors.Fail(totals.status());
    last_p = *totals;
  }
  auto decode_totals = decode->Totals();
  if (!decode_totals.ok()) return kErrors.Fail(decode_totals.status());
  last_d = *decode_totals;
  double sum_ttft = 0, sum_nocache = 0;
  size_t sum_prompt = 0, sum_node = 0, sum_local = 0, mismatches = 0;
  uint64_t sum_bytes = 0;
  for (size_t turn = 1; turn <= turns; ++turn) {
    std::vector<uint32_t> user = RandomTokens(user_tokens, vocab, seed + turn);
    history.insert(history.end(), user.begin(), user.end());
    worker::CompletionRequest request;
    request.prompt = history;
    request.max_tokens = max_new;
    WorkerTurn p;
    if (prefill) {
      auto reply = RunTurn(*prefill, request);
      if (!reply.ok()) return kErrors.Fail(reply.status());
      p = std::move(*reply);
    }
    auto d_or = RunTurn(*decode, request);
    if (!d_or.ok()) return kErrors.Fail(d_or.status());
    const WorkerTurn& d = *d_or;
    const std::vector<uint32_t>& output = d.completion.tokens;
    // Bytes moved this turn: what either worker pushed to or pulled from the nodes.
    const uint64_t p_stored = prefill ? p.totals.stored_bytes - last_p.stored_bytes : 0;
    const uint64_t p_loaded = prefill ? p.totals.loaded_bytes - last_p.loaded_bytes : 0;
    const uint64_t d_stored = d.totals.stored_bytes - last_d.stored_bytes;
    const uint64_t d_loaded = d.totals.loaded_bytes - last_d.loaded_bytes;
    if (prefill) last_p = p.totals;
    last_d = d.totals;
    std::printf("turn=%zu prompt_tokens=%zu", turn, history.size());
    if (prefill) {
      const worker::CompletionUsage& u = p.completion.usage;
      std::printf(
          " prefill_node_tokens=%zu prefill_local_hit_tokens=%zu prefill_computed_tokens=%zu",
          u.node_tokens, u.local_hit_tokens, u.computed_tokens);
    }
    const worker::CompletionUsage& du = d.completion.usage;
    const double ttft = du.ttft_ms;
    std::printf(
        " decode_node_tokens=%zu decode_local_hit_tokens=%zu decode_computed_tokens=%zu "
        "ttft_ms=%.2f",
        du.node_tokens, du.local_hit_tokens, du.computed_tokens, ttft);
    if (flags.compare) {
      auto base = RunWithoutCache(*local, history, max_new);
      if (!base.ok()) return kErrors.Fail(base.status());
      const bool match = base->output == output;
      mismatches += match ? 0 : 1;
      std::printf(" nocache_ttft_ms=%.2f speedup=%.1fx", base->ttft_ms,
                  ttft > 0 ? base->ttft_ms / ttft : 0.0);
      std::printf(" pushed_bytes=%llu pulled_bytes=%llu tokens=%s\n",
                  static_cast<unsigned long long>(p_stored + d_stored),
                  static_cast<unsigned long long>(p_loaded + d_loaded),
                  match ? "same-as-nocache" : "DIFFERENT");
      sum_nocache += base->ttft_ms;
    } else {
      std::printf(" pushed_bytes=%llu pulled_bytes=%llu\n",
                  static_cast<unsigned long long>(p_stored + d_stored),
                  static_cast<unsigned long long>(p_loaded + d_loaded));
    }
    std::fflush(stdout);
    sum_ttft += ttft;
    sum_prompt += history.size();
    sum_node += du.node_tokens;
    sum_local += du.local_hit_tokens;
    sum_bytes += p_stored + d_stored + p_loaded + d_loaded;
    history.insert(history.end(), output.begin(), output.end());
  }
  std::printf(
      "total turns=%zu prompt_tokens=%zu decode_node_tokens=%zu decode_local_hit_tokens=%zu "
      "ttft_ms=%.2f",
      turns, sum_prompt, sum_node, sum_local, sum_ttft);
  if (flags.compare) {
    std::printf(" nocache_ttft_ms=%.2f speedup=%.1fx mismatches=%zu", sum_nocache,
                sum_ttft > 0 ? sum_nocache / sum_ttft : 0.0, mismatches);
  }
  std::printf(" bytes_moved=%llu\n", static_cast<unsigned long long>(sum_bytes));
  if (mismatches > 0) {
    return kErrors.Fail(
        InternalError("{} turn(s) generated other tokens than without the cache", mismatches));
  }
  return kExitOk;
}

}  // namespace kvstash::engine::cli
