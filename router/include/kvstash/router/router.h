// A KV-aware front door for a prefill/decode cluster (docs/semantics.md §20): it learns each
// worker's model and cache layout from its /v1/models, follows the KV events of the workers and
// the offload nodes into one index, and sends each completion where its KV already is: prefill
// on the worker whose own cache holds most of the prompt (less its load), none when the nodes
// hold the whole prompt already, decode on the decode worker that would compute the least.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/common/status.h"
#include "kvstash/worker/protocol.h"

namespace kvstash::router {

// How requests are placed. kKv: by the hybrid hit each worker and the nodes would give (what
// the router is for); kRoundRobin: each role's workers in turn, every request prefilled (the
// comparison `kvstash bench route` runs).
enum class Policy : uint8_t { kKv, kRoundRobin };

// "kv", "round-robin".
std::string_view PolicyName(Policy policy);
// InvalidArgument for anything but those names.
Result<Policy> ParsePolicy(std::string_view name);

// An offload node's KV events (kvstashd --kv-events, --kv-events-replay).
struct NodeEvents {
  std::string endpoint;
  std::string replay;  // empty: a gap is a reset, never filled
};

// An events endpoint bound on every interface (tcp://*:P, tcp://0.0.0.0:P) as reached at the
// host of `address` (HOST:PORT of the worker or node that bound it); any other as it is.
std::string ReachableEndpoint(const std::string& endpoint, std::string_view address);

struct RouterOptions {
  // HOST:PORT of each `kvstash-engine serve --role prefill` worker (may be none: every request
  // then goes to a decode worker alone, which computes what the nodes lack).
  std::vector<std::string> prefill_workers;
  // HOST:PORT of each decode worker (--role decode, or both); at least one.
  std::vector<std::string> decode_workers;
  std::vector<NodeEvents> nodes;
  // The topic the nodes publish the workers' blocks under: the namespace the workers store in
  // (kvstash-engine serve's --namespace).
  std::string node_topic = "kvstash-engine";
  Policy policy = Policy::kKv;
  // What one request running on a worker costs its score, in prompt tokens of hit. 0: the hit
  // alone decides (ties go to the worker running fewer); load counts through max_imbalance.
  double load_tokens = 0;
  // A worker running more than this many requests beyond the least loaded one of its role is
  // passed over, whatever it holds (as SGLang's router balances only when the load is uneven):
  // a prefix every request shares must not queue them all on one worker.
  size_t max_imbalance = 8;
  // What a prompt token the nodes hold in memory is worth against one in the worker's own cache
  // (it must be pulled first), and one they hold only on SSD against one in their memory (it
  // comes back slower still).
  double node_weight = 0.9;
  double ssd_weight = 0.5;
  // A prompt whose part the chosen decode worker would not find (in its own cache or on the
  // nodes) is at most this many tokens goes to the decode worker alone, which computes it
  // itself: a prefill worker would compute it too, plus the partial block the decode worker
  // computes again, and the request would wait for two workers (conditional disaggregation).
  // 0: every prompt with something to compute is prefilled. kKv only.
  size_t local_prefill_tokens = 256;
  // How long a call to a worker may take (a completion runs to its last token).
  std::chrono::milliseconds worker_timeout{120000};
  // How long a worker that failed a call sits out before it is tried again.
  std::chrono::milliseconds down_for{5000};
};

// One worker as the router sees it. Values, copied out.
struct WorkerView {
  std::string address;
  worker::Role role = worker::Role::kBoth;
  bool up = true;           // false while it sits out after a failure, or once it left
  bool member = true;       // false once it left (RemoveWorker); kept for its counters
  bool events = false;      // it publishes KV events the router follows
  size_t running = 0;       // requests the router has on it now
  size_t blocks = 0;        // blocks its events say it holds
  uint64_t chosen = 0;      // requests placed on it
  uint64_t failures = 0;    // calls to it that failed
  uint64_t hit_tokens = 0;  // the hit tokens it was scored with when chosen, summed
};

// One request's placement and what it was based on.
struct Choice {
  int prefill = -1;  // index into the prefill workers; -1: no prefill
  int decode = -1;   // index into the decode workers
  size_t prompt_tokens = 0;
  // The prompt tokens the nodes together hold (what any worker could pull), in memory and on
  // any tier.
  size_t node_memory_tokens = 0;
  size_t node_tokens = 0;
  // Per worker, in option order: the hit its own cache would give, and its score.
  std::vector<size_t> prefill_hits;
  std::vector<double> prefill_scores;
  std::vector<size_t> decode_hits;
  std::vector<double> decode_scores;
  // Why there is no prefill ("nodes-hold-prompt", "decode-holds-prompt", "short-prefill",
  // "no-prefill-workers", "prefill-workers-down", "prefill-failed"), or empty.
  std::string skip_reason;
};

// A completion as the router answers it: the decode worker's, what the prefill worker did, and
// the choice.
struct RoutedCompletion {
  worker::Completion completion;  // the decode worker's answer
  std::string prefill_worker;     // empty: not prefilled
  std::string decode_worker;
  worker::CompletionUsage prefill_usage;  // zero without a prefill
  Choice choice;
  size_t retries = 0;  // calls that failed and went to another worker
  double ttft_ms = 0;  // router arrival to the first token (prefill's wait included)
};

// Running totals. Monotonic.
struct RouterTotals {
  uint64_t requests = 0;
  uint64_t failed_requests = 0;
  uint64_t prefills = 0;
  uint64_t skipped_prefills = 0;  // the nodes or the decode worker held the prompt
  uint64_t retries = 0;
  uint64_t prompt_tokens = 0;
  uint64_t computed_tokens = 0;  // prefill's and decode's
  uint64_t node_tokens = 0;      // the decode workers'
  uint64_t local_hit_tokens = 0;
  // The event subscriptions': batches, gaps seen, batches replayed, resets.
  uint64_t event_batches = 0;
  uint64_t event_gaps = 0;
  uint64_t event_replayed = 0;
  uint64_t event_resets = 0;
};

// Owns its workers' clients and its event subscriptions (each on a thread of its own).
// Thread-safe: Complete from any number of threads at once.
class Router {
 public:
  // Reads every worker's /v1/models (each must answer, and all serve one model: the same
  // fingerprint and layout) and subscribes to the events of each worker that publishes them and
  // of each node. InvalidArgument for options that cannot work (no decode worker, a worker of
  // another model, a prefill worker whose role is not prefill); Unavailable when a worker does
  // not answer.
  static Result<std::unique_ptr<Router>> Create(RouterOptions options);
  virtual ~Router() = default;

  // Places a prompt without running it (what Complete does first); counts nothing.
  virtual Choice Choose(std::span<const uint32_t> prompt) = 0;

  // Places the request, prefills it (unless the choice skips that), and has it decoded. A worker
  // that fails the call (unreachable, timed out, a 5xx) sits out for down_for, and the call goes
  // once to the next best worker of its role; a prefill that fails twice is skipped (the decode
  // worker computes the prompt itself). A request error (a 4xx from either worker) is the
  // caller's, returned as is. Unavailable when no decode worker could answer.
  virtual Result<RoutedCompletion> Complete(const worker::CompletionRequest& request) = 0;

  // The same with the decode worker's answer streamed: Complete's placement and prefill, then
  // `on_event` gets each Server-Sent Events payload (the text after "data: ") the decode
  // worker sends, the last chunk's usage carrying the router's choice, and "[DONE]". Retries
  // the decode on another worker only before its first event; after that a failure ends the
  // stream (returned). `on_event` returns false when the client is gone (the stream stops).
  virtual Status Stream(const worker::CompletionRequest& request,
                        const std::function<bool(std::string_view event)>& on_event) = 0;

  // Workers and nodes that join and leave while it runs (kvstash-router --etcd).
  // AddWorker reads the worker's /v1/models (the model and layout of the rest; a prefill
  // worker's role prefill, a decode worker's not) and follows its events; a worker that left
  // joins again on its old entry (its counters kept); one of the other role at that address
  // leaves first. InvalidArgument or Unavailable as Create; OK when it is a member already.
  virtual Status AddWorker(const std::string& address, bool prefill) = 0;
  // Stops choosing it (requests on it finish), stops following its events and forgets what
  // they said; listed on as not a member. A no-op for an address that is not a member.
  virtual void RemoveWorker(const std::string& address) = 0;
  // Follows a node's events (its blocks count for every worker); a node followed already is
  // left as it is.
  virtual Status AddNode(const NodeEvents& node) = 0;
  // Stops following the node whose events are at `endpoint` and forgets what they said.
  virtual void RemoveNode(const std::string& endpoint) = 0;
  virtual size_t nodes() const = 0;  // nodes followed now

  // The model every worker serves.
  virtual const worker::WorkerInfo& model() const = 0;
  virtual std::vector<WorkerView> prefill_workers() const = 0;
  virtual std::vector<WorkerView> decode_workers() const = 0;
  virtual RouterTotals totals() const = 0;
  virtual const RouterOptions& options() const = 0;
};

// The body a router answers a completion with: the decode worker's completion object, its
// usage.kvstash counting the whole request (computed_tokens both workers', ttft_ms from the
// router's arrival) and holding the router's choice under "router" (docs/semantics.md §20).
std::string RoutedCompletionBody(const RoutedCompletion& routed, Policy policy, int64_t created);

// POST /kvstash/route's answer: where `router` would place a prompt (Choose) and why.
std::string ChoiceJson(const Router& router, const Choice& choice);

}  // namespace kvstash::router
