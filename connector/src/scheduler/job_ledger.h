#pragma once

// The offload scheduler's transfer jobs in flight (docs/semantics.md §7): their
// acknowledgements, the GPU blocks a store still reads from, and the keys being loaded.

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <unordered_set>
#include <vector>

#include "kvstash/common/block_key.h"
#include "kvstash/common/status.h"
#include "kvstash/connector/offload_scheduler.h"

namespace kvstash::connector {

// A job in flight.
struct LedgerJob {
  RequestId request = 0;
  bool is_store = false;
  uint32_t pending = 0;  // acknowledgements outstanding (Add sets it to the world size)
  std::vector<BlockKey> keys;
  // Store sources. Full-attention blocks stay the request's while it runs, so they are fenced
  // only when it finishes (FenceFullBlocks); a window group frees blocks as it goes, so its are
  // fenced when the job is added.
  std::vector<GpuBlockId> full_blocks;
  std::vector<GpuBlockId> window_blocks;
};

// Owns the jobs in flight. Ids come from one counter (loads and stores alike) and are never
// reused; a job is in flight from Add until every worker acknowledged it, or until Reset, after
// which acknowledgements of older ids are stale and ignored. A fence (a GPU block that a step
// must not hand out again before a store from it is flushed) names a store in flight, and goes
// with it. With prefix caching, the keys being loaded are exactly those of the loads in flight.
// Not thread-safe: the scheduler's thread owns it.
class JobLedger {
 public:
  JobLedger(uint32_t world_size, bool prefix_caching)
      : world_size_(world_size), prefix_caching_(prefix_caching) {}

  // The id of the next job.
  JobId NextId() { return counter_++; }

  // A job with an id from NextId, in flight until every worker acknowledged it. A store's
  // window blocks are fenced now; a load's keys are being loaded (with prefix caching).
  void Add(JobId id, LedgerJob job);
  const LedgerJob& at(JobId id) const { return jobs_.at(id); }

  // An acknowledgement of a job from before the last Reset.
  bool Stale(JobId id) const { return id < stale_threshold_; }
  // Whether every acknowledgement of `completed` may apply: NotFound for a job not in flight,
  // InvalidArgument for a count of 0 or more than the job awaits. Stale jobs pass.
  Status Check(const CompletedJobs& completed) const;
  // Applies `count` acknowledgements of job `id` (in flight, Check passed). When they were the
  // last, the job completes: it leaves, with its window blocks' fences, its full blocks' too if
  // `request_finished` (they were fenced only then), and its keys no longer being loaded; it is
  // returned.
  std::optional<LedgerJob> Acknowledge(JobId id, uint32_t count, bool request_finished);

  // The request of job `id` finished: its full-attention sources go back to the engine, so
  // they are fenced until the job is flushed.
  void FenceFullBlocks(JobId id);
  // The jobs that must be flushed before `block` is handed out again, added to `*out`.
  void FencesOf(GpuBlockId block, std::set<JobId>* out) const;
  // Every job in flight, added to `*out`.
  void AllJobs(std::set<JobId>* out) const;
  bool BeingLoaded(const BlockKey& key) const { return being_loaded_.contains(key); }
  bool AnyBeingLoaded() const { return !being_loaded_.empty(); }

  // Forgets every job: acknowledgements of ids given so far are stale from now on.
  void Reset();

  // Introspection (OffloadScheduler's).
  std::map<GpuBlockId, std::vector<JobId>> FenceIndex() const;
  std::vector<BlockKey> BlocksBeingLoaded() const;
  std::vector<InFlightJob> InFlightJobs() const;
  JobId counter() const { return counter_; }
  JobId stale_threshold() const { return stale_threshold_; }

 private:
  void Fence(GpuBlockId block, JobId job) { fence_[block].insert(job); }
  void Unfence(std::span<const GpuBlockId> blocks, JobId job);

  const uint32_t world_size_;
  const bool prefix_caching_;
  std::map<JobId, LedgerJob> jobs_;
  JobId counter_ = 0;
  JobId stale_threshold_ = 0;  // acknowledgements of older jobs are ignored
  std::map<GpuBlockId, std::set<JobId>> fence_;
  std::unordered_set<BlockKey> being_loaded_;
};

}  // namespace kvstash::connector
