#pragma once

// The cluster client's reads: the best-ranked healthy replica, hedged to the next.

#include <chrono>
#include <cstdint>
#include <future>
#include <span>
#include <utility>
#include <vector>

#include "cluster/accounting.h"
#include "cluster/call_watch.h"
#include "cluster/members.h"
#include "cluster/node_calls.h"
#include "cluster/placer.h"
#include "cluster/repair.h"
#include "kvstash/common/block_key.h"
#include "kvstash/connector/node_client.h"
#include "kvstash/transport/call_group.h"

namespace kvstash::connector {

// Reads blocks from their replicas: one GetBlock per key (read from this client's pin, or
// pinned for the transfer by the node), or for small blocks one GetBlocks per node and batch,
// all in flight at once, from each key's best-ranked
// replica; a replica that does not hold the block or cannot be reached passes the read to the
// next, and one slower than its recent p99 is hedged to the next. Blocks a node is promoting
// from SSD are asked for again until the timeout. Each read ends with the read repair of its
// keys. Keeps nothing between reads: borrows the options, the members, the placer, the calls,
// the watch, the repair and the counters, which outlive it. Thread-safe.
class ClusterRead {
 public:
  // The longest pause before a block being promoted is asked for again.
  static constexpr std::chrono::microseconds kMaxPause{10000};
  // A thread keeps at most this much memory for batches to land in between reads.
  static constexpr size_t kMaxKeptStaging = size_t{16} << 20;

  ClusterRead(const NodeClientOptions& options, Accounting& accounting, const MemberSet& members,
              const Placer& placer, NodeCalls& calls, CallWatch& watch, ReadRepair& repair)
      : options_(options),
        accounting_(accounting),
        members_(members),
        placer_(placer),
        calls_(calls),
        watch_(watch),
        repair_(repair) {}

  // Reads keys[i] into outs[i] from the members live now; per key, the bytes read or why not
  // (NotFound when no replica holds it, Unavailable when none can be reached, a refusal).
  // Then repairs the keys a lookup found missing on some replicas (ReadRepair::Repair).
  std::vector<Result<size_t>> Get(std::span<const BlockKey> keys,
                                  std::span<const transport::MutableBytes> outs);

 private:
  std::vector<Result<size_t>> ReadReplicas(std::span<const BlockKey> keys,
                                           std::span<const transport::MutableBytes> outs);

  // One call of a read: one key's GetBlock, straight into its buffer, or one GetBlocks of
  // several keys of one member (small blocks), received into `staging` and copied out.
  struct ReadCall {
    size_t member = 0;         // index in the members
    std::vector<size_t> keys;  // indices in the read's keys
    bool batch = false;
    // Where a batch's reply payload lands: staging memory of the reading thread's, copied out
    // to the keys' buffers there. (Landing in the buffers themselves measured slower: the
    // progress thread that copies into them takes each cache line from the core that last
    // wrote it, often the reader's.)
    transport::MutableBytes landing;
    std::future<Outcome> outcome;
    uint64_t id = 0;
  };

  // The calls of the keys in `ready`, each to the member at its rank: a member's small blocks
  // many to a call within its limits (BlocksPerBatch), keys with another replica to go to apart
  // from those without (only the first are hedged), any other block alone.
  std::vector<ReadCall> PlanCalls(const Members& members, const std::vector<Placement>& places,
                                  const std::vector<uint32_t>& rank,
                                  const std::vector<size_t>& ready,
                                  const std::vector<Result<NodeLimits>>& limits) const;

  // Where each batch of `calls` lands (ReadCall::landing): slices of `staging`, one block of
  // the member's block_bytes per key.
  static void Land(std::vector<ReadCall>& calls, const std::vector<Result<NodeLimits>>& limits,
                   std::vector<std::byte>* staging);

  // Each key's outcome of a call that came back: its status and the bytes it read into its
  // buffer (a batch's blocks copied from where they landed to their keys' buffers, each checked
  // against what the reply said and what the buffer holds).
  std::vector<std::pair<Status, size_t>> KeyOutcomes(ReadCall& call, const Outcome& outcome,
                                                     std::span<const transport::MutableBytes> outs,
                                                     NodeHealth& health);

  // Reads slower than their node's recent p99 (at least lookup_budget), of keys with another
  // replica to ask, are cancelled (their nodes told they were late) and go to that replica:
  // which of `calls` were. Calls that are not hedged are left to end by their deadline; the
  // caller waits for every callback (the transport no longer touches a cancelled call's buffer
  // once its callback ran).
  std::vector<bool> Hedge(transport::CallGroup& group, const Members& members,
                          const std::vector<Placement>& places, const std::vector<uint32_t>& rank,
                          const std::vector<ReadCall>& calls, transport::Clock::time_point started);

  const NodeClientOptions& options_;
  Accounting& accounting_;
  const MemberSet& members_;
  const Placer& placer_;
  NodeCalls& calls_;
  CallWatch& watch_;
  ReadRepair& repair_;
};

}  // namespace kvstash::connector
