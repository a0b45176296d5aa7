#pragma once

// BlockStoreClient: what the connector needs of the offload nodes' client, so that KvConnector,
// BlockTransfer and the connector's manager run over the nodes (NodeClient) in production and
// over an in-memory fake in tests.
//
// Implementations must be thread-safe: BlockTransfer calls Put and Get from its transfer
// thread while the engine's thread calls Lookup.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvstash/common/block_key.h"
#include "kvstash/common/status.h"

namespace kvstash::connector {

// What a client's calls to the nodes met since it was created. Monotonic. Nothing here is a
// miss: a block a node does not hold is an answer, not an error.
struct BlockStoreCounters {
  uint64_t calls = 0;  // calls sent (a batch over a node's limits is split into several)
  // Calls to a node that was down or slower than the deadline: their keys read as misses.
  uint64_t unreachable = 0;
  // Calls that failed otherwise: refused by the node (over a limit, a bad request, a wrong
  // token, a quota) or answered with a reply that does not parse. Errors, logged; a lookup's
  // keys read as misses for the caller to go on, but never silently.
  uint64_t refused = 0;
  uint64_t touched_keys = 0;  // keys sent in touches
  uint64_t pinned_keys = 0;   // keys nodes pinned (Pin)
  // Keys of lookups, stores and reads that none of their nodes (replicas) answered, because
  // every one was unreachable: misses and failed stores, where unreachable counts the calls.
  // With replicas, a node that is down costs calls here only for keys it held alone.
  uint64_t unserved_keys = 0;
  // Blocks copied to replicas that lacked them (a lookup found them on another replica; the
  // next read copied them over).
  uint64_t repaired_blocks = 0;
  // Members of a followed cluster that joined or left the client's set after its first read.
  uint64_t members_joined = 0;
  uint64_t members_left = 0;
  // Calls not sent because their node was suspect (it stopped answering; see NodeClientOptions::
  // suspect_after): their keys read as misses, or went to another replica.
  uint64_t skipped_calls = 0;
  // Keys of lookups whose node had not answered within the lookup's budget: read as misses
  // (also in unserved_keys).
  uint64_t late_keys = 0;
  // Echoes sent to suspect nodes to see whether they answer again.
  uint64_t probes = 0;
  // Calls given up once they were not needed: a store's calls to a replica that had not
  // answered a budget after another replica held every block, a read hedged to another replica.
  uint64_t abandoned_calls = 0;
};

struct NodeAddress {
  std::string host;
  uint16_t port = 0;
  std::string ToString() const { return host + ":" + std::to_string(port); }
  bool operator==(const NodeAddress&) const = default;
};

class BlockStoreClient {
 public:
  virtual ~BlockStoreClient() = default;

  // The live nodes now: a snapshot (a followed cluster's set may change before the next).
  virtual std::vector<NodeAddress> nodes() const = 0;
  // The node's block size; an error when the node does not answer or is not a member now.
  virtual Result<uint64_t> BlockBytes(const NodeAddress& node) = 0;

  // Per-key lookups in key order. A key whose node cannot be reached, or whose node refused the
  // call, is a miss; either is counted (counters()) and logged.
  virtual std::vector<LookupResult> Lookup(std::span<const BlockKey> keys) = 0;
  // Marks the keys used on their nodes, the first key most recent (docs/semantics.md §3: LRU moves
  // them to the most recent end, ARC to T2; keys a node does not hold are ignored, or count as
  // ghost hits). Asynchronous: returns once the calls are sent, and their outcome is counted and
  // logged as any call's. Calls still in flight are waited for when the client is destroyed.
  virtual void Touch(std::span<const BlockKey> keys) = 0;
  // Pins the keys on their nodes against eviction, from the scheduler's decision to load them
  // until the load is done (vLLM's prepare_load; docs/semantics.md §7.5), so that a node under
  // churn does not evict a block between the lookup that found it and its read. Asynchronous as
  // Touch. A key its node no longer holds, or whose node cannot be reached, is not pinned: its
  // read may then miss, and the engine recomputes it. Each Pin of a key is undone by one Unpin;
  // a node releases the pins of a client that disconnects or stays silent past its lease.
  virtual void Pin(std::span<const BlockKey> keys) = 0;
  virtual void Unpin(std::span<const BlockKey> keys) = 0;
  // Stores blocks[i] under keys[i], each exactly its node's block size; keys already held are
  // skipped. The first error; the other blocks are still stored.
  virtual Status Put(std::span<const BlockKey> keys,
                     std::span<const std::span<const std::byte>> blocks) = 0;
  // Reads the block of keys[i] into outs[i]; per key, the bytes read, NotFound when absent or
  // Unavailable when its node cannot be reached.
  virtual std::vector<Result<size_t>> Get(std::span<const BlockKey> keys,
                                          std::span<const std::span<std::byte>> outs) = 0;

  virtual BlockStoreCounters counters() const = 0;
};

}  // namespace kvstash::connector
