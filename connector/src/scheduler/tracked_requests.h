#pragma once

// The requests the offload scheduler tracks: each one's offloaded blocks (their keys), its GPU
// blocks as the engine reported them, and how far it is stored (docs/semantics.md §7).

#include <cstddef>
#include <optional>
#include <set>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kvstash/common/block_key.h"
#include "kvstash/connector/offload_scheduler.h"
#include "scheduler/group_layout.h"

namespace kvstash::connector {

// One group of a tracked request.
struct TrackedGroup {
  std::vector<BlockKey> keys;         // one per offloaded block with a full hash
  std::vector<GpuBlockId> block_ids;  // the request's GPU blocks as reported, null included
  size_t next_stored = 0;             // first offloaded block not stored yet
  size_t num_hit_blocks = 0;          // offloaded blocks hit when the request started
};

struct TrackedRequest {
  RequestId id = 0;
  std::vector<TrackedGroup> groups;  // one per group of the layout
  size_t num_locally_computed_tokens = 0;
  size_t num_tokens = 0;
  bool finished = false;
  std::set<JobId> jobs;  // in flight: one load, or stores
};

// The offloaded blocks a store of a request may take: per group, the indices of its blocks not
// stored yet that have KV; and their keys, group by group (what the manager is offered).
struct StoreCandidates {
  std::vector<std::vector<size_t>> blocks;
  std::vector<BlockKey> keys;
};

// Owns the tracked requests, and maps their offloaded blocks onto their GPU blocks for the
// transfers. A request is tracked from its first lookup or schedule until it has finished and
// no job of its is in flight. Each group's keys grow with the request's block hashes, in block
// order, and its next_stored block is the first a store may take; a GPU block a window group
// has not stored yet and that was handed out again is forgotten (null), never stored. Borrows the
// group layout, which outlives it. Not thread-safe: the scheduler's thread owns it.
class TrackedRequests {
 public:
  explicit TrackedRequests(const GroupLayout& groups) : groups_(groups) {}

  // The request's state, tracked from now on if it was not (then *created).
  TrackedRequest& Track(RequestId id, bool* created = nullptr);
  // Null when untracked.
  TrackedRequest* Find(RequestId id);
  // Precondition: tracked.
  TrackedRequest& At(RequestId id) { return requests_.at(id); }
  bool contains(RequestId id) const { return requests_.contains(id); }
  void Erase(RequestId id) { requests_.erase(id); }
  bool AllFinished() const;

  // Adds the keys of the offloaded blocks that `hashes` (all the request's, in order) complete.
  void UpdateKeys(TrackedRequest& state, std::span<const BlockHash> hashes) const;
  // Marks the request's blocks used (§7.3): of a window group, only what a new request with the
  // original prompt needs to hit again (the window before the original hit), and what was
  // computed since.
  void Touch(const TrackedRequest& state, OffloadManager& manager) const;

  // Records a step's schedule: each request's new keys and token count, and the GPU blocks
  // added to its tables (a resumed request's replace its old ones); every non-null block added
  // goes into `*allocated`, with the blocks handed out earlier in the step. Then a window
  // group's blocks not stored yet that are in `*allocated` are forgotten: freed and handed out
  // again, they hold someone else's KV now.
  void ApplySchedule(std::span<const ScheduledRequestView> scheduled,
                     std::set<GpuBlockId>* allocated);

  // The load of the request's tokens from its computed ones to `cached`: fills `job` with the
  // keys and the fresh GPU blocks of `tables` (per group, the whole block table) they go to, and
  // adds those blocks to `*allocated`. The hit counts as stored unless `store_loaded`.
  // InvalidArgument: a table shorter than the cached tokens; FailedPrecondition: too few keys.
  // Nothing changes on error.
  Status PlanLoad(TrackedRequest& state, std::span<const std::vector<GpuBlockId>> tables,
                  size_t cached, bool store_loaded, TransferJob* job,
                  std::set<GpuBlockId>* allocated) const;

  // The blocks of the request's first `offloadable` tokens that a store may take.
  StoreCandidates CandidatesOf(const TrackedRequest& state, size_t offloadable) const;
  // The store of the candidates whose key is `chosen`: fills `job` with them, their GPU blocks
  // and their metadata (each one's previous key in the request, its tokens), and `*full` and
  // `*window` with those blocks by kind of group; then AdvanceStored.
  void PlanStore(TrackedRequest& state, const StoreCandidates& candidates,
                 const std::unordered_set<BlockKey>& chosen, size_t offloadable, TransferJob* job,
                 std::vector<GpuBlockId>* full, std::vector<GpuBlockId>* window) const;
  // The request's blocks within its first `offloadable` tokens count as stored (or skipped).
  void AdvanceStored(TrackedRequest& state, size_t offloadable) const;

  // After the offloaded blocks were dropped: finished requests are forgotten, the others store
  // again from their first block, and no job is in flight.
  void Reset();

  // Per group, the first offloaded block not stored yet; nullopt if untracked.
  std::optional<std::vector<size_t>> NextStoredBlocks(RequestId id) const;

 private:
  // Offloaded blocks of `group` within `offloadable` tokens that have a key and all their GPU
  // blocks reported.
  size_t NumStorableBlocks(const TrackedRequest& state, size_t group, size_t offloadable) const;

  const GroupLayout& groups_;
  std::unordered_map<RequestId, TrackedRequest> requests_;
};

}  // namespace kvstash::connector
