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
};

struct EngineCounters {
  uint64_t steps = 0;
  uint64_t prefill_tokens = 0;  // tokens run before a request's first sampled token
  uint64_t decode_tokens = 0;
  uint64_t preemptions = 0;
};

class Engine {
 public:
  // InvalidArgument for a layout that does not fit the model (block size, pack), NotFound or
  // InvalidArgument for an unreadable weights file.
  static Result<std::unique_ptr<Engine>> Create(ModelConfig config, EngineOptions options);

  // Queues a request. InvalidArgument for an empty prompt, a token id past the vocabulary, or
  // max_new_tokens 0.
  Result<RequestId> AddRequest(std::vector<uint32_t> prompt, size_t max_new_tokens);
  bool HasUnfinished() const { return scheduler_.HasUnfinished(); }

  // One step: schedule, run the model, sample. Returns the requests that finished (or failed)
  // in it; take their results with TakeResult.
  std::vector<RequestId> Step();
  // The finished (or failed: state kFailed with its error) request.
  std::unique_ptr<Request> TakeResult(RequestId id) { return scheduler_.Take(id); }

  // Runs every queued request to completion; results in the order of `prompts`.
  Result<std::vector<std::unique_ptr<Request>>> Generate(
      const std::vector<std::vector<uint32_t>>& prompts, size_t max_new_tokens);

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
};

}  // namespace kvstash::engine
