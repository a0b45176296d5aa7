#pragma once

// The inference engine: a model runner over a paged KV cache, the hybrid KV-cache manager and
// the scheduler, stepping requests to completion with greedy sampling.
//
// Owned by its caller; not thread-safe (one thread adds requests and steps).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvstash/common/status.h"
#include "kvstash/engine/kv_cache_manager.h"
#include "kvstash/engine/model.h"
#include "kvstash/engine/model_runner.h"
#include "kvstash/engine/offload.h"
#include "kvstash/engine/scheduler.h"

namespace kvstash::engine {

struct EngineOptions {
  uint32_t block_size = 0;   // 0: the layout's default (see KvLayout)
  uint32_t attn_pack = 1;    // full-attention layers sharing one page
  size_t num_blocks = 4096;  // pages in the pool, the null block included
  bool prefix_caching = true;
  // Sliding-window layers keep each request's KV in a ring of their window outside the pool
  // (see KvLayout); the pool holds only the blocks the prefix cache keeps.
  bool swa_ring = false;
  SchedulerOptions scheduler;
  std::optional<uint64_t> seed;  // weights seed; default the config's
  std::string weights_path;      // a safetensors file instead of seeded weights
  // Where the model runs (kernels::MakeDevice): "cpu", "cuda" (the first visible GPU), or
  // "cpu-staged" (the CPU, with the pool apart from the host pages a connector moves, as on a
  // GPU). The fingerprint does not depend on it: a block computed on one device serves the
  // others (its floats may differ in the last bits).
  std::string device = "cpu";
  // Shares KV through offload nodes (engine::NodeOffload in kvstash::engine_offload); empty:
  // the engine keeps its KV to itself.
  KvOffloadFactory offload;
  // Record what the prefix cache caches and evicts for TakeCacheEvents (KV events); the caller
  // then drains them after every step.
  bool record_cache_events = false;
};

struct EngineCounters {
  uint64_t steps = 0;
  uint64_t prefill_tokens = 0;  // tokens run before a request's first sampled token
  uint64_t decode_tokens = 0;
  uint64_t preemptions = 0;
  uint64_t load_failures = 0;  // loads from offload nodes that fell back to recomputing
};

class Engine {
 public:
  // InvalidArgument for a layout that does not fit the model (block size, pack), NotFound or
  // InvalidArgument for an unreadable weights file; MakeDevice's errors for the device.
  // A device that fails later (a GPU fault) fails every request in flight with its error, and
  // every request after.
  static Result<std::unique_ptr<Engine>> Create(ModelConfig config, EngineOptions options);
  ~Engine();  // waits for transfers to and from the offload nodes

  // Queues a request. InvalidArgument for an empty prompt, a token id past the vocabulary, or
  // max_new_tokens 0. `do_remote_decode`: another worker continues it (a prefill worker's
  // request), so every full block of it goes to the offload nodes, loaded ones included.
  Result<RequestId> AddRequest(std::vector<uint32_t> prompt, size_t max_new_tokens,
                               bool do_remote_decode = false);
  bool HasUnfinished() const { return scheduler_.HasUnfinished(); }

  // Whether a request of `num_prompt_tokens` generating `max_new_tokens` can ever run in this
  // pool: OutOfRange, naming the blocks needed and the pool's, when its last prompt token, or
  // any position after it (computed one per step, as its generated tokens are), needs more
  // blocks than the whole pool holds (KvCacheManager::MinBlocksHeldAt: a sliding window counts
  // only its window, a state its snapshot). Its earlier prompt tokens are not counted: a prefix
  // hit may spare them. Thread-safe: reads only what Create fixed.
  Status CheckFits(size_t num_prompt_tokens, size_t max_new_tokens) const;

  // Drops a queued, running or finished request whose result nobody will take (its client
  // went away): its blocks go back to the pool (those the prefix cache holds stay cached), its
  // stores to the offload nodes are fenced as a finished request's, and Find and TakeResult no
  // longer know it. NotFound for an unknown or taken id. Between steps, as every call here.
  Status Abort(RequestId id);

  // One step: schedule, run the model, sample. Returns the requests that finished (or failed)
  // in it; take their results with TakeResult.
  std::vector<RequestId> Step();
  // A queued or running request (null once taken or unknown).
  const Request* Find(RequestId id) { return scheduler_.Find(id); }
  // The finished (or failed: state kFailed with its error) request.
  std::unique_ptr<Request> TakeResult(RequestId id) { return scheduler_.Take(id); }

  // Runs every queued request to completion; results in the order of `prompts`.
  Result<std::vector<std::unique_ptr<Request>>> Generate(
      const std::vector<std::vector<uint32_t>>& prompts, size_t max_new_tokens);

  // With record_cache_events: the hashes the prefix cache cached and evicted since the last
  // call, in order (KvCacheManager::TakeEvents).
  std::vector<CacheEvent> TakeCacheEvents() { return kv_cache_.TakeEvents(); }

  // Waits until every transfer to and from the offload nodes has ended (before exiting: a
  // prefill worker's stores must land).
  void DrainOffload();
  // Null without offload.
  const KvOffload* offload() const { return offload_.get(); }
  // Model, weights and layout: what an offloaded block must have been computed with.
  uint64_t fingerprint() const { return fingerprint_; }
  // The salt of a prompt's first block hash (docs/semantics.md §18): the fingerprint's.
  static std::string CacheSaltOf(uint64_t fingerprint) { return Hash128{fingerprint, 0}.ToHex(); }
  std::string cache_salt() const { return CacheSaltOf(fingerprint_); }

  const ModelConfig& config() const { return runner_.config(); }
  const KvLayout& layout() const { return runner_.layout(); }
  ModelRunner& runner() { return runner_; }
  KvCacheManager& kv_cache() { return kv_cache_; }
  const EngineCounters& counters() const { return counters_; }

 private:
  Engine(ModelRunner runner, KvCacheManagerOptions kv_options, SchedulerOptions sched);

  ModelRunner runner_;
  KvCacheManager kv_cache_;
  Scheduler scheduler_;
  RequestId next_id_ = 1;
  EngineCounters counters_;
  std::vector<SeqInput> inputs_;
  std::vector<float> logits_;
  std::vector<uint32_t> sampled_;
  uint64_t fingerprint_ = 0;
  Status device_error_;  // the device failed: nothing more runs
  std::unique_ptr<KvOffload> offload_;
  std::vector<RequestId> finished_since_step_;  // for the offload's next step
};

}  // namespace kvstash::engine
