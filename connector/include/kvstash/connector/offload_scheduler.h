#pragma once

// The scheduler side of the offloading connector: which tokens of a waiting request can be loaded
// from the offload tier, which GPU blocks receive them, which blocks of running requests are
// stored, and when the worker must wait for a transfer before the engine reuses a GPU block. A
// port of vLLM's OffloadingConnectorScheduler (docs/semantics.md §7; vectors
// §12.G, §12.I, §12.J) that knows the engine only through the small views below, so it builds and
// tests without an engine, a transport or a device.
//
// One step of the engine's scheduler drives it in this order: GetNumNewMatchedTokens for each
// waiting request it considers, UpdateStateAfterAlloc once blocks are allocated for one,
// BuildConnectorMeta with the step's schedule (its jobs go to the workers), then, with the
// workers' output, UpdateConnectorOutput and RequestFinished for requests that ended.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kvstash/common/block_key.h"
#include "kvstash/common/hash.h"
#include "kvstash/common/status.h"

namespace kvstash::connector {

using RequestId = uint64_t;
// A block of the engine's GPU pool; kNullGpuBlock (0) stands for a position whose KV the group
// does not keep (outside a sliding window or chunk, before a state snapshot).
using GpuBlockId = uint32_t;
inline constexpr GpuBlockId kNullGpuBlock = 0;
// Loads and stores share one increasing counter, so a completion names its job unambiguously.
using JobId = uint64_t;

// The scheduler-side offload manager (docs/semantics.md §1): the index of offloaded blocks that the
// connector consults and updates. Implementations decide placement and eviction; the connector
// decides what to ask for. Called from the scheduler's thread only; implementations need not be
// thread-safe.
class OffloadManager {
 public:
  virtual ~OffloadManager() = default;

  // kHit: stored and readable now. kMiss: absent. kRetry: not decided yet (a write in flight, an
  // asynchronous tier lookup or promotion started); the connector defers the request a step.
  virtual LookupResult Lookup(const BlockKey& key) = 0;
  // Pins `keys`, all of them hits, against eviction until CompleteLoad.
  virtual void PrepareLoad(std::span<const BlockKey> keys) = 0;
  virtual void CompleteLoad(std::span<const BlockKey> keys) = 0;
  // Reserves room for the keys not stored yet and returns them (possibly none); the slots stay
  // unreadable until CompleteStore. nullopt: cannot store now (nothing changed); the connector
  // offers the same blocks again next step.
  virtual std::optional<std::vector<BlockKey>> PrepareStore(std::span<const BlockKey> keys) = 0;
  virtual void CompleteStore(std::span<const BlockKey> keys) = 0;
  // Marks `keys` recently used; any of them may be absent.
  virtual void Touch(std::span<const BlockKey> keys) = 0;
  // Drops every block.
  virtual void ResetCache() = 0;
};

// How a KV-cache group's attention reads earlier tokens, which decides what a hit needs.
enum class OffloadGroupKind : uint8_t {
  kFull,           // every earlier token: a hit is a prefix of offloaded blocks
  kSlidingWindow,  // the last `window` tokens
  kState,          // a recurrent state: one block, the state at its end
  kChunkedLocal,   // the tokens of its own chunk of `window` tokens (not in vLLM; see below)
};

struct OffloadGroupConfig {
  OffloadGroupKind kind = OffloadGroupKind::kFull;
  uint32_t gpu_block_size = 16;  // tokens per GPU block
  // GPU blocks per offloaded block: an offloaded block holds gpu_block_size * factor tokens.
  uint32_t block_size_factor = 1;
  // kSlidingWindow: the window in tokens; kChunkedLocal: the chunk in tokens; else unused.
  uint32_t window = 0;
};

struct OffloadSchedulerOptions {
  std::vector<OffloadGroupConfig> groups;  // the index is the group id (BlockKey::group)
  // Tokens per entry of a request's block hashes; every offloaded block size is a multiple.
  uint32_t hash_block_size = 16;
  // Workers that each acknowledge every job; a job completes when all of them have.
  uint32_t world_size = 1;
  // With GPU prefix caching a second request for keys being loaded waits for that load and then
  // hits them in the GPU cache; without it there is no such cache to wait for.
  bool prefix_caching = true;
};

// A group as the connector uses it (§7.1).
struct OffloadGroupInfo {
  OffloadGroupConfig config;
  uint32_t offloaded_block_size = 0;  // gpu_block_size * block_size_factor
  uint32_t hashes_per_block = 0;      // offloaded_block_size / hash_block_size
  // Offloaded blocks a hit must end with: nullopt for full attention (the whole prefix);
  // ceil(window / offloaded_block_size) for a sliding window (one more token than the GPU
  // prefix cache's ceil((window - 1) / block) needs); 1 for a state. A chunked-local group is
  // looked up as a sliding window of ceil(chunk / offloaded_block_size) blocks: the chunk of the
  // token after a block-aligned hit starts at most chunk - 1 tokens earlier, so those blocks
  // cover every token it and the rest of its chunk read (a superset of what is needed).
  std::optional<uint32_t> window_blocks;
};

// What the connector reads of a request.
struct OffloadRequestView {
  RequestId id = 0;
  size_t num_tokens = 0;  // prompt and output tokens so far
  // Chained hashes of the request's full blocks of hash_block_size tokens, in order.
  std::span<const BlockHash> block_hashes;
  // The request's KV is also wanted elsewhere (disaggregated prefill): store the blocks it
  // loaded too, not only those it computes.
  bool do_remote_decode = false;
};

// One request of a step's schedule.
struct ScheduledRequestView {
  OffloadRequestView request;
  size_t num_computed_tokens = 0;  // before this step
  size_t num_scheduled_tokens = 0;
  // Per group, the GPU blocks added to the request's tables this step, in table order (all of
  // them for a request scheduled for the first time or resumed). Empty: none in any group.
  std::vector<std::vector<GpuBlockId>> new_block_ids;
  // Resumed from preemption: its tables were rebuilt, so new_block_ids replace the old ones.
  bool resumed_from_preemption = false;
};

// A step's schedule as the connector needs it.
struct SchedulerStepView {
  std::vector<ScheduledRequestView> scheduled;
  // Requests that finished since the last step (RequestFinished may already have been called).
  std::vector<RequestId> finished;
  // Requests preempted in this step: their GPU blocks go back to the pool.
  std::vector<RequestId> preempted;
};

// A transfer between GPU blocks and offloaded blocks.
struct TransferJob {
  JobId id = 0;
  RequestId request = 0;
  // The offloaded blocks, group by group in block order; the GPU blocks of `gpu_blocks` map onto
  // them in the same order.
  std::vector<BlockKey> keys;
  // The GPU blocks, group by group; group g has group_sizes[g] of them. block_indices[g] is the
  // request-logical index of group g's first one: block_indices[g] % block_size_factor is the
  // sub-block of the group's first offloaded block it maps to (a hit or a null block may cover
  // the sub-blocks before it).
  std::vector<GpuBlockId> gpu_blocks;
  std::vector<uint32_t> group_sizes;
  std::vector<uint32_t> block_indices;
  // A store's, one per key: the key of the request's block before it in its group (none for the
  // request's first block, whether or not that block is in the job) and the tokens the block
  // holds (its group's offloaded_block_size), for the nodes' KV events (docs/semantics.md §19).
  // Empty for a load.
  std::vector<BlockMeta> metas;
};

// The step's work for the workers.
struct ConnectorMeta {
  std::vector<TransferJob> load_jobs;   // offloaded blocks -> GPU blocks, submitted now
  std::vector<TransferJob> store_jobs;  // GPU blocks -> offloaded blocks
  // Jobs the workers must finish before this step runs: their GPU blocks are about to be
  // overwritten. Ascending.
  std::vector<JobId> jobs_to_flush;
};

// Acknowledgements per job: one worker reports {job: 1} for each job it finished, and the
// connector takes the sum over workers (AggregateCompletedJobs).
using CompletedJobs = std::map<JobId, uint32_t>;
CompletedJobs AggregateCompletedJobs(std::span<const CompletedJobs> per_worker);

// An in-flight job, for tests and diagnostics.
struct InFlightJob {
  JobId id = 0;
  RequestId request = 0;
  bool is_store = false;
  uint32_t pending = 0;  // acknowledgements outstanding
  std::vector<BlockKey> keys;
};

// The scheduler's parts, private to it (connector/src/scheduler/).
class GroupLayout;
class HitFinder;
class JobLedger;
class TrackedRequests;
struct TrackedRequest;

// Owned by the engine's scheduler, which calls it from its one thread; not thread-safe. Owns its
// manager. Never holds GPU blocks back: instead of delaying a block's release until a store
// from it completes, it tells the workers to finish that store before the block is reused
// (ConnectorMeta::jobs_to_flush). Runs the step's protocol and owns the step's work; its parts
// own the rest: the groups' layout (GroupLayout), the requests it tracks and their blocks
// (TrackedRequests), the jobs in flight with their fences (JobLedger), and the lookup of a
// request's hit (HitFinder).
class OffloadScheduler {
 public:
  // InvalidArgument for no groups, a zero block size, factor or world size, an offloaded block
  // size that is not a multiple of hash_block_size, or a window group with no window.
  static Result<std::unique_ptr<OffloadScheduler>> Create(OffloadSchedulerOptions options,
                                                          std::unique_ptr<OffloadManager> manager);

  OffloadScheduler(const OffloadScheduler&) = delete;
  OffloadScheduler& operator=(const OffloadScheduler&) = delete;
  ~OffloadScheduler();

  // Tokens beyond `num_computed_tokens` (the GPU prefix-cache hit) that can be loaded: 0 for
  // none, nullopt to ask again next step (the manager answered kRetry for a block the hit
  // needs, some of the hit is being loaded for another request, or the request still has a
  // transfer in flight). Not necessarily a multiple of a block size: with a window or state
  // group the last token is always computed. Touches the request's blocks (§7.3) and starts
  // tracking the request.
  std::optional<size_t> GetNumNewMatchedTokens(const OffloadRequestView& request,
                                               size_t num_computed_tokens);

  // After the engine allocated `blocks` (per group, the request's whole block table) for a
  // request whose GetNumNewMatchedTokens gave `num_external_tokens`: queues the load of those
  // tokens into the table's fresh blocks. The first num_computed_tokens / gpu_block_size
  // entries of each table are the GPU hit's; a null entry after them is a block the group does
  // not need and is not loaded. Nothing to do when num_external_tokens is 0.
  // FailedPrecondition: the request is unknown (no GetNumNewMatchedTokens) or has a transfer in
  // flight, or its keys do not cover the tokens. InvalidArgument: a table count other than the
  // group count, or a table shorter than the cached tokens.
  Status UpdateStateAfterAlloc(const OffloadRequestView& request,
                               std::span<const std::vector<GpuBlockId>> blocks,
                               size_t num_external_tokens);

  // The step's loads (from UpdateStateAfterAlloc), stores of the blocks the scheduled requests
  // complete in this step, and flushes. Ends the step.
  // InvalidArgument: a new_block_ids with a group count other than the groups'.
  // FailedPrecondition: a scheduled request has a load in flight. Nothing changes on error.
  Result<ConnectorMeta> BuildConnectorMeta(const SchedulerStepView& step);

  // Applies the workers' acknowledgements (summed over workers). Jobs from before the last
  // ResetCache are ignored. A job acknowledged by every worker completes: its blocks become
  // loadable (stores) or unpinned (loads).
  // NotFound: an unknown job. InvalidArgument: a count of 0, or more than the job awaits.
  // Nothing changes on error.
  Status UpdateConnectorOutput(const CompletedJobs& completed);

  // The request ended; the engine may free its GPU blocks at once (none is held back). Stores
  // still in flight from them are fenced: a step that hands one of those blocks out again
  // flushes the store first. The request is forgotten when it has no transfer in flight.
  void RequestFinished(RequestId id);

  // Drops every offloaded block and forgets every job: the next BuildConnectorMeta flushes the
  // jobs in flight, and their late acknowledgements are ignored. Running requests store again
  // from their first block.
  void ResetCache();

  OffloadManager& manager() { return *manager_; }
  std::span<const OffloadGroupInfo> groups() const;
  // Groups in the order a lookup visits them: full attention first, then the others by window,
  // widest first.
  std::span<const uint32_t> lookup_order() const;

  // Introspection for tests.
  // GPU block -> store jobs that must finish before it is reused.
  std::map<GpuBlockId, std::vector<JobId>> FenceIndex() const;
  // Keys being loaded into some request's GPU blocks, sorted by group then hash.
  std::vector<BlockKey> BlocksBeingLoaded() const;
  std::vector<InFlightJob> InFlightJobs() const;  // by id
  // Per group, the first offloaded block of the request not stored yet; nullopt if untracked.
  std::optional<std::vector<size_t>> NextStoredBlocks(RequestId id) const;
  bool IsTracked(RequestId id) const;
  JobId job_counter() const;
  JobId stale_job_threshold() const;

 private:
  OffloadScheduler(OffloadSchedulerOptions options, std::unique_ptr<OffloadManager> manager,
                   std::unique_ptr<GroupLayout> groups);

  void BuildStoreJob(const ScheduledRequestView& scheduled, TrackedRequest& state,
                     std::vector<TransferJob>& store_jobs);

  OffloadSchedulerOptions options_;
  std::unique_ptr<OffloadManager> manager_;
  // Each borrows those above it.
  std::unique_ptr<const GroupLayout> groups_;
  std::unique_ptr<JobLedger> jobs_;
  std::unique_ptr<TrackedRequests> requests_;
  std::unique_ptr<HitFinder> hits_;

  // This step's work, handed out and cleared by BuildConnectorMeta.
  std::vector<TransferJob> batch_load_jobs_;
  std::set<JobId> batch_jobs_to_flush_;
  std::set<GpuBlockId> batch_allocated_blocks_;
};

}  // namespace kvstash::connector
