#pragma once

// What the engine needs from a KV offload connector: where waiting requests' KV may come from
// (ExternalKvSource) and the per-step hooks that move blocks. The engine knows no transport;
// kvstash::engine_offload implements this over offload nodes (connector::KvConnector).
//
// Called from the engine's thread only.

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvstash/common/client_counters.h"
#include "kvstash/common/status.h"
#include "kvstash/engine/kv_cache_manager.h"
#include "kvstash/engine/model_runner.h"
#include "kvstash/engine/scheduler.h"

namespace kvstash::engine {

struct OffloadStats {
  uint64_t bytes_loaded = 0, bytes_stored = 0;
  uint64_t blocks_loaded = 0, blocks_stored = 0, blocks_load_failed = 0;
  // The node client's counters (calls to nodes that were down or late, calls a node refused,
  // keys touched, ...): every row of kvstash/common/client_counters.h.
  ClientCounters client;
  uint64_t live_nodes = 0;  // offload nodes keys are placed on now
};

class KvOffload : public ExternalKvSource {
 public:
  using JobId = uint64_t;
  // Before the forward pass of the step `out`: flushes, then submits the step's loads (those
  // StartLoad queued). `finished`: requests that ended since the last step. Returns the loads
  // submitted, by request.
  virtual std::vector<std::pair<RequestId, JobId>> BeginStep(
      const SchedulerOutput& out, std::span<const RequestId> finished) = 0;
  // After the forward pass: the step's stores (their pages hold the step's KV now).
  virtual void EndStep() = 0;
  // Waits for these loads; per job, whether every block arrived and checked out.
  virtual std::unordered_map<JobId, bool> FinishLoads(std::span<const JobId> jobs) = 0;
  virtual void RequestFinished(RequestId id) = 0;
  // Waits for every transfer in flight.
  virtual void Drain() = 0;
  virtual OffloadStats stats() const = 0;
};

// What an offload implementation is built against.
struct OffloadContext {
  const KvLayout* layout = nullptr;
  std::span<float> pool;  // the paged pool (or its host mirror): layout->page_floats per block
  // Set when `pool` is a host mirror of a pool in device memory (ModelRunner::PagesToHost and
  // PagesToDevice): pages to the mirror before a store reads them, back after a load wrote
  // them. Empty when `pool` is the pool.
  std::function<Status(std::span<const uint32_t>)> pages_to_host, pages_to_device;
  const KvCacheManager* kv_cache = nullptr;
  uint64_t fingerprint = 0;  // model, weights and layout
  bool prefix_caching = true;
};

using KvOffloadFactory = std::function<Result<std::unique_ptr<KvOffload>>(const OffloadContext&)>;

}  // namespace kvstash::engine
