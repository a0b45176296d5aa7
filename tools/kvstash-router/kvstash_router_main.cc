// `kvstash-router`: an OpenAI-compatible front door for a prefill/decode cluster of kvstash
// engine workers (docs/semantics.md §20). It reads each worker's model and cache layout from its
// /v1/models, follows the KV events of the workers and the offload nodes, and sends each
// completion where its KV already is.

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "kvstash/common/cli.h"
#include "kvstash/common/status.h"
#include "kvstash/membership/etcd_client.h"
#include "kvstash/membership/membership.h"
#include "kvstash/router/discovery.h"
#include "kvstash/router/router.h"
#include "kvstash/router/router_server.h"

namespace {

using namespace kvstash;
using namespace kvstash::router;

const cli::ErrorReporter kErrors("kvstash-router");

// "a,b" and repeated flags alike: every non-empty item.
std::vector<std::string> Split(const std::vector<std::string>& values) {
  std::vector<std::string> out;
  for (const std::string& v : values) {
    size_t start = 0;
    while (start <= v.size()) {
      const size_t comma = v.find(',', start);
      const std::string item = v.substr(start, comma == std::string::npos ? comma : comma - start);
      if (!item.empty()) out.push_back(item);
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  return out;
}

// With --etcd and no --decode-worker: the router over the first registered decode worker that
// answers (its model is the router's), waiting up to `wait` for one; the rest join through
// discovery.
Result<std::unique_ptr<Router>> CreateOverRegistered(RouterOptions options,
                                                     const Discovery& discovery,
                                                     std::chrono::milliseconds wait) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  Status last = UnavailableError("no decode worker is registered");
  bool logged = false;
  while (true) {
    for (const membership::NodeRecord& r : discovery.workers()) {
      if (r.role == "prefill") continue;
      options.decode_workers = {r.address};
      auto router = Router::Create(options);
      if (router.ok()) return router;
      last = router.status();
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status(last.code(), fmt::format("no registered decode worker could serve within {} ms "
                                             "(--wait-for-workers-ms): {}",
                                             wait.count(), last.message()));
    }
    if (!logged) {
      std::fprintf(stderr, "kvstash-router: waiting up to %lld ms for a decode worker in etcd\n",
                   static_cast<long long>(wait.count()));
      logged = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "kvstash-router: an OpenAI-compatible front door for a prefill/decode cluster of kvstash "
      "engine workers. It learns each worker's model and KV-cache layout from its /v1/models, "
      "follows the KV events of the workers (published with `kvstash-engine serve --kv-events`) "
      "and of the offload nodes (`kvstashd --kv-events`), and places each completion by the "
      "hybrid hit it would really get (full-attention prefix, sliding windows, state snapshots): "
      "prefill on the worker whose own cache holds most of the prompt less its load, no prefill "
      "when the nodes hold the whole prompt already or little is left to compute, decode on the "
      "decode worker that would compute the least. A worker that fails sits out for --down-ms and "
      "the call goes once to "
      "the next best worker. Serves POST /v1/completions (streamed too), GET /v1/models, "
      "/health, /metrics, /kvstash/router (its state as JSON) and POST /kvstash/route (where a "
      "completion would go, without running it); every completion's "
      "usage.kvstash.router says where it went and why.",
      "kvstash-router"};
  std::vector<std::string> prefill, decode, node_events, node_replay;
  std::string etcd, cluster;
  int64_t wait_ms = 30000;
  RouterOptions options;
  RouterServerOptions server;
  std::string policy = "kv";
  int64_t timeout_ms = options.worker_timeout.count();
  int64_t down_ms = options.down_for.count();
  app.add_option("--prefill-worker", prefill,
                 "HOST:PORT of a `kvstash-engine serve --role prefill` worker (repeat the flag or "
                 "separate with commas). None: every request goes to a decode worker alone");
  app.add_option("--decode-worker", decode,
                 "HOST:PORT of a decode worker (--role decode, or both); at least one (repeat or "
                 "separate with commas), unless --etcd finds them");
  app.add_option(
      "--etcd", etcd,
      "URL[,URL...] of the etcd cluster to find workers and nodes in (http://HOST:PORT): "
      "the workers registered under /kvstash/<cluster>/workers/ (kvstash-engine serve "
      "--register) join the router's set as prefill or decode workers by their role "
      "and leave it when their key goes (deleted at their exit, or their lease "
      "expired); nodes under /kvstash/<cluster>/nodes/ whose records name KV events "
      "(kvstashd --etcd --kv-events) are followed. Workers and nodes given by flags "
      "stay whatever etcd says");
  app.add_option("--cluster", cluster, "With --etcd: the cluster's name");
  app.add_option("--wait-for-workers-ms", wait_ms,
                 "With --etcd and no --decode-worker: how long to wait at start for a registered "
                 "decode worker that answers")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{86400000}));
  app.add_option("--node-events", node_events,
                 "A node's KV events endpoint (kvstashd --kv-events, e.g. tcp://127.0.0.1:5600); "
                 "repeat or separate with commas, one per node. Without them the router does not "
                 "know what the nodes hold and never skips a prefill");
  app.add_option("--node-events-replay", node_replay,
                 "The nodes' replay endpoints (kvstashd --kv-events-replay), in --node-events "
                 "order; a node without one cannot fill a gap in its events (the router starts "
                 "over on it)");
  app.add_option("--node-topic", options.node_topic,
                 "The namespace the workers store blocks in (kvstash-engine serve --namespace): "
                 "the topic the nodes publish them under")
      ->capture_default_str();
  app.add_option("--policy", policy,
                 "kv: place by the hit each worker and the nodes would give; round-robin: each "
                 "role's workers in turn, every request prefilled (for comparison)")
      ->capture_default_str();
  app.add_option("--load-tokens", options.load_tokens,
                 "What one request running on a worker costs its score, in prompt tokens of hit "
                 "(0: the hit alone decides, ties going to the worker running fewer; the load "
                 "counts through --max-imbalance)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-imbalance", options.max_imbalance,
                 "A worker running more than this many requests beyond the least loaded one of "
                 "its role is passed over whatever it holds, so that a prefix every request "
                 "shares does not queue them all on one worker")
      ->capture_default_str()
      ->check(CLI::Range(size_t{0}, size_t{1} << 20));
  app.add_option("--node-weight", options.node_weight,
                 "What a prompt token the nodes hold in memory is worth against one in a "
                 "worker's own cache, which needs no pull (0 to 1)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--ssd-weight", options.ssd_weight,
                 "What a prompt token the nodes hold only on SSD is worth against one in memory "
                 "(0 to 1)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--local-prefill-tokens", options.local_prefill_tokens,
                 "A prompt of which at most this many tokens are in neither the chosen decode "
                 "worker's cache nor the nodes goes to the decode worker alone (it computes them "
                 "itself: a prefill worker would compute them too, and the decode worker the "
                 "prompt's last partial block again); 0: every such prompt is prefilled")
      ->capture_default_str();
  app.add_option("--worker-timeout-ms", timeout_ms,
                 "How long one call to a worker may take (a completion runs to its last token)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{86400000}));
  app.add_option("--down-ms", down_ms,
                 "How long a worker that failed a call sits out before it is tried again")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{86400000}));
  app.add_option("--listen", server.listen, "The address to listen on")->capture_default_str();
  app.add_option("--port", server.port, "The port to listen on (0: a free one, printed)")
      ->capture_default_str();
  app.add_option("--http-threads", server.request_threads,
                 "Threads serving completions (each waits on its workers)")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{4096}));
  if (auto code = cli::ParseCommandLine(app, argc, argv)) return *code;

  // Signals are taken by one thread (sigwait), never by whichever thread they land on.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  auto parsed_policy = ParsePolicy(policy);
  if (!parsed_policy.ok()) return kErrors.Fail(parsed_policy.status());
  options.policy = *parsed_policy;
  options.prefill_workers = Split(prefill);
  options.decode_workers = Split(decode);
  const std::vector<std::string> events = Split(node_events);
  const std::vector<std::string> replays = Split(node_replay);
  if (replays.size() > events.size()) {
    return kErrors.Fail(InvalidArgumentError(
        "{} --node-events-replay endpoints for {} --node-events: give them in the same order",
        replays.size(), events.size()));
  }
  for (size_t i = 0; i < events.size(); ++i) {
    options.nodes.push_back({events[i], i < replays.size() ? replays[i] : ""});
  }
  options.worker_timeout = std::chrono::milliseconds(timeout_ms);
  options.down_for = std::chrono::milliseconds(down_ms);
  if (etcd.empty() != cluster.empty()) {
    return kErrors.Fail(InvalidArgumentError("--etcd and --cluster go together"));
  }
  if (etcd.empty() && options.decode_workers.empty()) {
    return kErrors.Fail(
        InvalidArgumentError("give at least one --decode-worker, or --etcd to find them"));
  }
  std::unique_ptr<Discovery> discovery;
  if (!etcd.empty()) {
    DiscoveryOptions d;
    auto endpoints = membership::ParseEtcdEndpoints(etcd);
    if (!endpoints.ok()) return kErrors.Fail(endpoints.status());
    d.etcd.endpoints = std::move(*endpoints);
    d.cluster = cluster;
    auto created = Discovery::Create(d);
    if (!created.ok()) return kErrors.Fail(created.status());
    discovery = std::move(*created);
  }
  auto router = options.decode_workers.empty()
                    ? CreateOverRegistered(options, *discovery, std::chrono::milliseconds(wait_ms))
                    : Router::Create(options);
  if (!router.ok()) return kErrors.Fail(router.status());
  if (discovery) {
    // What the flags named stays; the rest follows etcd.
    std::set<std::string> fixed(options.prefill_workers.begin(), options.prefill_workers.end());
    fixed.insert(options.decode_workers.begin(), options.decode_workers.end());
    for (const NodeEvents& n : options.nodes) fixed.insert(n.endpoint);
    discovery->Follow(router->get(), std::move(fixed));
  }
  auto http = RouterServer::Create(server, router->get());
  if (!http.ok()) return kErrors.Fail(http.status());
  std::printf("kvstash-router (%s) for %s: %zu prefill + %zu decode workers, %zu nodes' events%s\n",
              std::string(PolicyName(options.policy)).c_str(), (*router)->model().model.c_str(),
              options.prefill_workers.size(), options.decode_workers.size(), options.nodes.size(),
              discovery ? fmt::format(", and those in etcd cluster '{}'", cluster).c_str() : "");
  std::printf("kvstash-router serving on %s:%u\n", server.listen.c_str(), (*http)->port());
  std::fflush(stdout);

  RouterServer* const stoppable = http->get();
  std::thread waiter([&stop_signals, stoppable] {
    int signal_number = 0;
    sigwait(&stop_signals, &signal_number);
    stoppable->Stop();
  });
  const Status status = (*http)->Serve();
  if (!status.ok()) pthread_kill(waiter.native_handle(), SIGTERM);
  waiter.join();
  discovery.reset();  // before the router it feeds
  if (!status.ok()) return kErrors.Fail(status);
  return cli::kExitOk;
}
