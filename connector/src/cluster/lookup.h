#pragma once

// The cluster client's lookups: per node, within the budget (docs/semantics.md §14).

#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "cluster/accounting.h"
#include "cluster/members.h"
#include "cluster/node_calls.h"
#include "cluster/placer.h"
#include "cluster/repair.h"
#include "kvstash/common/block_key.h"
#include "kvstash/connector/node_client.h"

namespace kvstash::connector {

// Looks keys up at their replicas: one call per member and chunk (within the member's limits),
// all at once; each key's best answer (HIT over RETRY over MISS). A node that has not answered
// within the lookup budget reads as misses for its keys (its late answer still tells its
// health); keys no replica answered are counted unserved. Keys found on some replicas and
// missing on others go to the read repair. Keeps nothing between lookups: borrows the options,
// the members, the placer, the calls and the repair, which outlive it, and shares the counters
// with the callbacks of late answers, which may outlive it. Thread-safe.
class ClusterLookup {
 public:
  ClusterLookup(const NodeClientOptions& options, std::shared_ptr<Accounting> accounting,
                const MemberSet& members, const Placer& placer, NodeCalls& calls,
                ReadRepair& repair)
      : options_(options),
        accounting_(std::move(accounting)),
        members_(members),
        placer_(placer),
        calls_(calls),
        repair_(repair) {}

  // Per-key lookups, the best answer of each key's replicas, among the members live now;
  // *refusal gets the first error that is not an unreachable node.
  std::vector<LookupResult> Lookup(std::span<const BlockKey> keys, Status* refusal);

 private:
  const NodeClientOptions& options_;
  const std::shared_ptr<Accounting> accounting_;
  const MemberSet& members_;
  const Placer& placer_;
  NodeCalls& calls_;
  ReadRepair& repair_;
};

}  // namespace kvstash::connector
