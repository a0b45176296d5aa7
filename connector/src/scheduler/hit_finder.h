#pragma once

// How many tokens of a request the offload tier can give (docs/semantics.md §7.2).

#include <cstddef>
#include <optional>
#include <span>

#include "kvstash/common/block_key.h"
#include "kvstash/connector/offload_scheduler.h"
#include "scheduler/group_layout.h"
#include "scheduler/job_ledger.h"
#include "scheduler/tracked_requests.h"

namespace kvstash::connector {

// Finds a request's hit: the longest run of tokens after the computed ones that every group can
// load (a prefix of offloaded blocks for full attention, the window at its end for the others),
// asking the manager block by block. Keeps nothing between lookups: borrows the layout, the
// manager and the jobs (the keys being loaded), which outlive it. Not thread-safe: the
// scheduler's thread owns it.
class HitFinder {
 public:
  HitFinder(const GroupLayout& groups, OffloadManager& manager, const JobLedger& jobs,
            bool prefix_caching)
      : groups_(groups), manager_(manager), jobs_(jobs), prefix_caching_(prefix_caching) {}

  // The tokens beyond the request's computed ones that can be loaded: 0 for none (less than a
  // block), nullopt to ask again next step (the manager answered kRetry for a block the hit
  // needs, or, with prefix caching, some of the hit is being loaded for another request).
  std::optional<size_t> Find(const TrackedRequest& state);

 private:
  std::optional<size_t> MaximalPrefixLookup(std::span<const BlockKey> keys);
  std::optional<size_t> SlidingWindowLookup(std::span<const BlockKey> keys, size_t window);

  const GroupLayout& groups_;
  OffloadManager& manager_;
  const JobLedger& jobs_;
  const bool prefix_caching_;
};

}  // namespace kvstash::connector
