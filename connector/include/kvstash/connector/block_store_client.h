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
#include "kvstash/common/client_counters.h"
#include "kvstash/common/status.h"

namespace kvstash::connector {

// What a client's calls to the nodes met since it was created: a value per row of the client's
// counter registry (kvstash/common/client_counters.h, where each counter is named and
// explained), read as counters[ClientCounter::kCalls] or row by row with ForEach. Monotonic.
using BlockStoreCounters = ClientCounters;

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
  // The same request's touch after its stores (docs/semantics.md §7.6): recency only. A node
  // under AF-LRU does not count it as another use of the keys; LRU and ARC treat it as Touch.
  virtual void TouchAfterStore(std::span<const BlockKey> keys) { Touch(keys); }
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
  // Put, saying what each block holds: metas[i] of keys[i], the block before it in its request
  // and its tokens, which the nodes' KV events then carry (docs/semantics.md §19). `metas` is
  // empty (Put) or one per key. The default drops them and calls Put: a client whose nodes
  // cannot say them (a fake, a wrapper) need not know them.
  virtual Status PutWithMeta(std::span<const BlockKey> keys,
                             std::span<const std::span<const std::byte>> blocks,
                             std::span<const BlockMeta> metas) {
    return Put(keys, blocks);
  }
  // Reads the block of keys[i] into outs[i]; per key, the bytes read, NotFound when absent or
  // Unavailable when its node cannot be reached.
  virtual std::vector<Result<size_t>> Get(std::span<const BlockKey> keys,
                                          std::span<const std::span<std::byte>> outs) = 0;

  virtual BlockStoreCounters counters() const = 0;
};

}  // namespace kvstash::connector
