#pragma once

// The cluster client's stores: every replica, done once one holds each block.

#include <span>

#include "cluster/accounting.h"
#include "cluster/call_watch.h"
#include "cluster/members.h"
#include "cluster/node_calls.h"
#include "cluster/placer.h"
#include "kvstash/common/block_key.h"
#include "kvstash/connector/node_client.h"

namespace kvstash::connector {

// Stores blocks at their replicas: one PutBlock call per block and replica (for small blocks,
// to a node that serves batches, one PutBlocks per node and batch, BlocksPerPutBatch), all in
// flight at once across the nodes, last key first; what a node would refuse (a block of another
// size, a payload over its limit) is refused here without moving the bytes. A block is stored once
// one of its replicas holds it: the caller waits for that (CallWatch::WaitForReplicas), not for a
// slow replica. Keeps nothing between stores: borrows the options, the members, the placer,
// the calls, the watch and the counters, which outlive it. Thread-safe.
class ClusterStore {
 public:
  // A thread keeps at most this much memory for batches' payloads between stores.
  static constexpr size_t kMaxKeptStaging = size_t{16} << 20;

  ClusterStore(const NodeClientOptions& options, Accounting& accounting, const MemberSet& members,
               const Placer& placer, NodeCalls& calls, CallWatch& watch)
      : options_(options),
        accounting_(accounting),
        members_(members),
        placer_(placer),
        calls_(calls),
        watch_(watch) {}

  // Stores blocks[i] under keys[i] at each of its replicas among the members live now, with
  // metas[i] in its call when `metas` is not empty (InvalidArgument unless it is one per key). A
  // replica that cannot be reached is counted, not returned, while another holds the block; a
  // refusal is always returned (the first, naming the node and the key).
  Status Put(std::span<const BlockKey> keys, std::span<const transport::Bytes> blocks,
             std::span<const BlockMeta> metas = {});

 private:
  const NodeClientOptions& options_;
  Accounting& accounting_;
  const MemberSet& members_;
  const Placer& placer_;
  NodeCalls& calls_;
  CallWatch& watch_;
};

}  // namespace kvstash::connector
