#pragma once

// The engine's scheduler: continuous batching of requests under a per-step token budget, with
// chunked prefill (a long prompt runs over several steps), prefix-cache hits taken when a
// request is first scheduled, and preemption when the KV-cache pool runs out of blocks: the
// newest running request gives its blocks back and later recomputes (its own cached blocks
// usually come back as a prefix hit). As vLLM's v1 scheduler, without priorities.
//
// Owned by the engine; not thread-safe.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvstash/common/status.h"
#include "kvstash/engine/kv_cache_manager.h"

namespace kvstash::engine {

struct Request {
  // kLoading: its blocks are allocated and offload nodes are filling some of them; kLoaded:
  // done, back in the waiting queue to compute the rest.
  enum class State : uint8_t { kWaiting, kLoading, kLoaded, kRunning, kFinished, kFailed };
  RequestId id = 0;
  std::vector<uint32_t> tokens;  // the prompt, then each generated token
  size_t num_prompt_tokens = 0;
  size_t max_new_tokens = 0;
  size_t num_computed_tokens = 0;  // tokens whose KV is in the cache
  State state = State::kWaiting;
  Status error;  // kFailed: why
  std::unique_ptr<RequestHasher> hasher;

  // Statistics.
  size_t num_cached_tokens = 0;           // the prefix hit when first scheduled
  size_t num_computed_prompt_tokens = 0;  // prompt tokens run through the model (recomputes too)
  uint32_t num_preemptions = 0;
  bool scheduled_once = false;
  size_t num_external_tokens = 0;  // tokens loaded from offload nodes (all loads)

  // Connector bookkeeping (see Engine).
  bool do_remote_decode = false;        // its KV is wanted by another worker: store it all
  size_t pending_external_tokens = 0;   // kLoading: tokens being loaded after the computed ones
  std::vector<size_t> reported_blocks;  // per group: table entries the connector has seen
  bool resumed = false;                 // preempted since the connector last saw it
  uint32_t num_deferrals = 0;           // steps the external source said "ask again"
  bool skip_external = false;           // a load failed: compute everything from here on

  size_t num_output_tokens() const { return tokens.size() - num_prompt_tokens; }
  std::span<const uint32_t> output() const {
    return std::span<const uint32_t>(tokens).subspan(num_prompt_tokens);
  }
};

struct SchedulerOptions {
  size_t max_num_batched_tokens = 256;  // token budget of one step (the prefill chunk)
  size_t max_num_seqs = 16;             // running requests at most
  std::string cache_salt;               // extra key of every request's first block hash
};

// Where a waiting request's KV may also come from: offload nodes (the engine adapts its
// KvConnector to this). Called from the scheduler's thread.
class ExternalKvSource {
 public:
  virtual ~ExternalKvSource() = default;
  // Tokens after `num_computed_tokens` the source can provide; nullopt: ask again next step.
  virtual std::optional<size_t> MatchedTokens(const Request& request,
                                              size_t num_computed_tokens) = 0;
  // The request's blocks for those tokens are allocated: start loading them.
  // An error leaves the request to compute them instead.
  virtual Status StartLoad(const Request& request, const std::vector<std::vector<BlockId>>& tables,
                           size_t num_external_tokens) = 0;
};

// One request's share of a step: tokens [start, start + num_tokens) of it.
struct ScheduledSeq {
  Request* request = nullptr;
  size_t start = 0;
  size_t num_tokens = 0;
};

struct SchedulerOutput {
  std::vector<ScheduledSeq> seqs;
  size_t num_tokens = 0;
  std::vector<RequestId> preempted;
  std::vector<RequestId> failed;  // requests that can never fit the pool (state kFailed)
  std::vector<Request*> loading;  // requests whose external tokens started loading this step
};

class Scheduler {
 public:
  Scheduler(SchedulerOptions options, KvCacheManager* kv_cache);

  void Add(std::unique_ptr<Request> request);
  bool HasUnfinished() const { return !waiting_.empty() || !running_.empty(); }
  Request* Find(RequestId id);
  size_t num_running() const { return running_.size(); }
  size_t num_waiting() const { return waiting_.size(); }

  // Picks this step's work: running requests first (preempting the newest when blocks run
  // out; a request alone takes a shorter prefill chunk instead, down to one token, and fails
  // only when even that does not fit), then waiting ones while the budget, max_num_seqs and
  // the pool allow.
  SchedulerOutput Schedule();

  // After the forward pass of `out`: advances computed tokens; a request whose every known
  // token is now computed appends sampled[i] (the greedy token of its last position) and
  // finishes (its blocks freed) once it has max_new_tokens. Returns the finished ids.
  std::vector<RequestId> Update(const SchedulerOutput& out, std::span<const uint32_t> sampled);

  // Hands a finished or failed request to the caller (its entry is dropped).
  std::unique_ptr<Request> Take(RequestId id);
  // Drops a request whatever its state (a running or waiting one gives its blocks back) and
  // hands it to the caller; null for an unknown id. Not for a request whose load is in flight
  // (kLoading): the engine finishes loads within the step that starts them.
  std::unique_ptr<Request> Remove(RequestId id);

  // Waiting requests may load tokens from `source` (borrowed; null: none).
  void SetExternalSource(ExternalKvSource* source) { external_ = source; }
  // A kLoading request's load ended. `ok`: every block arrived, so its external tokens count
  // as computed (and are cached). Otherwise it gives its blocks back and starts over from its
  // local prefix-cache hit, never asking the external source again. Either way it waits to
  // run.
  void LoadFinished(Request* request, bool ok);
  // Fails every request not finished yet with `error` (their blocks freed). Returns their ids.
  std::vector<RequestId> FailAll(const Status& error);

 private:
  void Preempt(Request* request);

  SchedulerOptions options_;
  KvCacheManager* kv_cache_;
  ExternalKvSource* external_ = nullptr;
  bool has_state_group_ = false;
  std::unordered_map<RequestId, std::unique_ptr<Request>> requests_;
  std::deque<Request*> waiting_;
  std::vector<Request*> running_;
};

}  // namespace kvstash::engine
