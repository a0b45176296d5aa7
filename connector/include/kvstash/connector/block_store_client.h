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

#include "kvstash/common/status.h"
#include "kvstash/connector/block_key.h"

namespace kvstash::connector {

struct NodeAddress {
  std::string host;
  uint16_t port = 0;
  std::string ToString() const { return host + ":" + std::to_string(port); }
};

class BlockStoreClient {
 public:
  virtual ~BlockStoreClient() = default;

  virtual size_t node_count() const = 0;
  virtual const NodeAddress& node(size_t i) const = 0;
  // The node's block size; an error when the node does not answer.
  virtual Result<uint64_t> BlockBytes(size_t node) = 0;

  // Per-key lookups in key order; a key whose node cannot be reached is a miss.
  virtual std::vector<KeyState> Lookup(std::span<const BlockKey> keys) = 0;
  // Stores blocks[i] under keys[i], each exactly its node's block size; keys already held are
  // skipped. The first error; the other blocks are still stored.
  virtual Status Put(std::span<const BlockKey> keys,
                     std::span<const std::span<const std::byte>> blocks) = 0;
  // Reads the block of keys[i] into outs[i]; per key, the bytes read, NotFound when absent or
  // Unavailable when its node cannot be reached.
  virtual std::vector<Result<size_t>> Get(std::span<const BlockKey> keys,
                                          std::span<const std::span<std::byte>> outs) = 0;
};

}  // namespace kvstash::connector
