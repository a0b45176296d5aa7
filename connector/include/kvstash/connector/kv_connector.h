#pragma once

// KvConnector: what an engine process holds to share KV through offload nodes. It joins the
// scheduler side (OffloadScheduler: which tokens to load, which blocks to store, fences) with
// the worker side (BlockTransfer: the bytes, off the engine's thread) over a NodeClient (or,
// in tests, any BlockStoreClient).
//
// The engine drives it once per step (see engine::Engine): GetNumNewMatchedTokens and
// UpdateStateAfterAlloc while scheduling, BeginStep before the forward pass (flushes, loads
// submitted), EndStep after it (this step's stores submitted), FinishLoads before the loading
// requests compute. A node that is down or slow past its deadline, or a block that fails its
// checks, makes a load report failure: the engine then recomputes those tokens.
//
// Owned by the engine; called from the engine's thread only.

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvstash/common/status.h"
#include "kvstash/connector/block_store_client.h"
#include "kvstash/connector/block_transfer.h"
#include "kvstash/connector/node_client.h"
#include "kvstash/connector/offload_scheduler.h"

namespace kvstash::connector {

struct KvConnectorOptions {
  NodeClientOptions client;           // the nodes, namespace, token, deadlines (Create only)
  OffloadSchedulerOptions scheduler;  // the engine's KV-cache groups (block_size_factor 1)
  PoolView pool;                      // the engine's paged pool: one page per GPU block
  uint64_t fingerprint = 0;           // model, weights and layout (BlockTransfer)
  // Set when `pool` is a host mirror of pages in device memory (a GPU's paged cache): the
  // pages of the step's stores go to the mirror (after the compute that wrote them) before
  // they are read, and the pages of a load that arrived go back to the device before the
  // request computes. An error fails those stores or that load. Empty: `pool` is the pool.
  std::function<Status(std::span<const uint32_t>)> pages_to_host, pages_to_device;
};

struct KvConnectorStats {
  uint64_t load_jobs = 0, blocks_loaded = 0, blocks_load_failed = 0, bytes_loaded = 0;
  uint64_t store_jobs = 0, blocks_stored = 0, blocks_store_failed = 0, bytes_stored = 0;
  double load_seconds = 0;  // time spent waiting for loads
  // The node client's counters, every row of its registry (kvstash/common/client_counters.h).
  BlockStoreCounters client;
  uint64_t live_nodes = 0;  // the nodes the client places keys on now
};

class KvConnector {
 public:
  // Connects to the nodes. Unavailable when a node cannot be reached at start;
  // FailedPrecondition when a node's block size does not fit the engine's page.
  static Result<std::unique_ptr<KvConnector>> Create(KvConnectorOptions options);
  // The same over `client` instead of a NodeClient of options.client (a fake store in tests),
  // with `manager` as the scheduler side's manager; null: the nodes' own manager (recency and
  // eviction on the nodes, lookups batched per request through `client`). FailedPrecondition
  // when a node's block size does not fit the engine's page; Unimplemented for a
  // block_size_factor other than 1.
  static Result<std::unique_ptr<KvConnector>> Create(KvConnectorOptions options,
                                                     std::unique_ptr<BlockStoreClient> client,
                                                     std::unique_ptr<OffloadManager> manager);
  ~KvConnector();  // waits for every transfer in flight

  // Tokens beyond `num_computed_tokens` the nodes can provide (nullopt: ask again next step).
  // Looks every key of the request up in one batched call first.
  std::optional<size_t> GetNumNewMatchedTokens(const OffloadRequestView& request,
                                               size_t num_computed_tokens);
  Status UpdateStateAfterAlloc(const OffloadRequestView& request,
                               std::span<const std::vector<GpuBlockId>> blocks,
                               size_t num_external_tokens);

  // Before the step's forward pass: builds the step's jobs, waits for the flushes and submits
  // the loads. Returns the step's load jobs (by request) for FinishLoads.
  Result<std::vector<std::pair<RequestId, JobId>>> BeginStep(const SchedulerStepView& step);
  // After the forward pass: submits the step's stores (their pages are computed now).
  Status EndStep();
  // Waits for these load jobs and acknowledges them; per job, whether every block arrived.
  std::unordered_map<JobId, bool> FinishLoads(std::span<const JobId> jobs);
  void RequestFinished(RequestId id);
  // Waits for every transfer and acknowledges it (before the process exits).
  void Drain();

  KvConnectorStats stats() const;
  BlockStoreClient& client() { return *client_; }

 private:
  KvConnector(std::unique_ptr<BlockStoreClient> client, std::unique_ptr<OffloadScheduler> scheduler,
              std::unique_ptr<BlockTransfer> transfer, class NodeOffloadManager* manager);
  Status Submit(const TransferJob& job, BlockJob::Kind kind);
  // Acknowledges finished transfers to the scheduler; records load outcomes.
  void Collect();
  // Logs a job's failure, once per kind of job and error code.
  void NoteFailure(const BlockJobResult& r);
  // EndStep's stores.
  Status EndStepStores();
  // Hands the step's touches to the transfer: those of its lookups (taking the step's touches
  // from the manager) before its stores, those of its store decisions after them.
  void SubmitTouches(bool before_stores);

  std::unique_ptr<BlockStoreClient> client_;
  std::unique_ptr<OffloadScheduler> scheduler_;
  std::unique_ptr<BlockTransfer> transfer_;
  NodeOffloadManager* manager_;  // owned by scheduler_; null when another manager was given
  std::vector<TransferJob> pending_stores_;
  std::unordered_map<JobId, bool> load_outcomes_;
  std::function<Status(std::span<const uint32_t>)> pages_to_host_, pages_to_device_;
  // Submitted loads' pages, for pages_to_device.
  std::unordered_map<JobId, std::vector<GpuBlockId>> load_pages_;
  KvConnectorStats stats_;
  std::set<std::pair<bool, int>> logged_failures_;  // (load, status code) logged once
  // The step's store touches, between EndStep's stores and their submission.
  std::vector<BlockKey> after_store_touches_;
};

}  // namespace kvstash::connector
