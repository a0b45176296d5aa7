#pragma once

// Read repair (docs/semantics.md §17): a key that a lookup finds on some of its replicas
// and missing on others (a node that joined, or one that evicted its copy) is copied to those
// others by its next read, so that a lost node's keys get back to `replicas` copies as they are
// used.

#include <atomic>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "cluster/accounting.h"
#include "cluster/members.h"
#include "cluster/node_calls.h"
#include "kvstash/common/block_key.h"
#include "kvstash/common/mutex.h"
#include "kvstash/transport/rpc.h"

namespace kvstash::connector {

// Remembers the replicas a lookup found without a key that another replica holds (Note), and
// copies the block there after its next read (Repair). Owns the keys waiting for a repair: at
// most kMaxRepairs, each with the members that lacked it, held weakly (a member that left is
// not repaired); a key leaves once a read of it ends, repaired or not. pending_ says whether
// any key waits (written under the lock, read without it), so that a read pays no lock when
// none does. Borrows the calls and the counters, which outlive it. Thread-safe.
class ReadRepair {
 public:
  static constexpr size_t kMaxRepairs = 1 << 16;

  ReadRepair(NodeCalls& calls, Accounting& accounting) : calls_(calls), accounting_(accounting) {}

  // Keys a lookup found (`states`: HIT) on some of their replicas and missing on others
  // (`missed_at`[i]: the members that answered MISS): the next read of each copies it there.
  void Note(std::span<const BlockKey> keys, const std::vector<LookupResult>& states,
            std::vector<std::vector<std::shared_ptr<Member>>>& missed_at);

  // After a read: the blocks read whose key waits for a repair are stored at the replicas that
  // lacked them, all at once, the caller waiting (only reads after a change of members pay
  // this).
  void Repair(std::span<const BlockKey> keys, std::span<const transport::MutableBytes> outs,
              const std::vector<Result<size_t>>& results);

 private:
  NodeCalls& calls_;
  Accounting& accounting_;
  Mutex mu_;
  std::map<BlockKey, std::vector<std::weak_ptr<Member>>> repairs_ GUARDED_BY(mu_);
  std::atomic<bool> pending_{false};  // !repairs_.empty(), read without the lock
};

}  // namespace kvstash::connector
