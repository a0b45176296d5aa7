#pragma once

// NodeClient: an engine-side client of one or many offload nodes. Each block key lives on one
// node, chosen by rendezvous hashing (highest hash of key and node address), so every client
// places a key on the same node and adding or losing a node moves only that node's keys.
// Batched calls fan out to the nodes concerned in parallel and come back in key order. A node
// that cannot be reached (down, slow past the deadline) is a miss for its keys, never an error
// that stops the caller; unreachable() counts such answers.
//
// Thread-safe. The connector uses it through BlockStoreClient.

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/common/hash.h"
#include "kvstash/common/status.h"
#include "kvstash/connector/block_key.h"
#include "kvstash/connector/block_store_client.h"
#include "kvstash/transport/rpc.h"

namespace kvstash::connector {

// "HOST:PORT"; InvalidArgument naming the text otherwise.
Result<NodeAddress> ParseNodeAddress(std::string_view text);

struct NodeClientOptions {
  std::vector<NodeAddress> nodes;
  std::string key_namespace = "default";
  std::string auth_token;
  transport::TransportOptions transport;
  // Every call to a node fails after this long (the node then counts as unreachable for it).
  std::chrono::milliseconds timeout{5000};
  std::chrono::milliseconds connect_timeout{2000};
  // The UCX worker and progress thread the connections run on; clients of one process should
  // share one (see transport::ClientWorker). Empty: this client makes one for all its nodes.
  std::shared_ptr<transport::ClientWorker> worker;
};

class NodeClient : public BlockStoreClient {
 public:
  static Result<std::unique_ptr<NodeClient>> Create(NodeClientOptions options);
  ~NodeClient() override;

  size_t node_count() const override;
  const NodeAddress& node(size_t i) const override;
  // The node that holds `key`.
  size_t NodeOf(const BlockKey& key) const;

  // Per-key lookups in key order; an unreachable node's keys are misses.
  std::vector<KeyState> Lookup(std::span<const BlockKey> keys) override;
  // The number of leading keys that are hits (nullopt: a RETRY among them, ask again).
  std::optional<size_t> LookupPrefix(std::span<const BlockKey> keys);

  // Stores blocks[i] under keys[i] (each exactly its node's block size): one call per block
  // that prepares, sends and commits it, all blocks in flight at once. Keys a node already
  // holds are skipped. The first error, naming the node and the key; the other blocks are
  // still stored.
  Status Put(std::span<const BlockKey> keys, std::span<const transport::Bytes> blocks) override;

  // Reads the block of `key` into `out` in one call (the node pins it for the transfer). A block
  // the node is promoting from SSD is asked for again until the timeout. NotFound when its node
  // does not hold it (or cannot be reached: then Unavailable).
  Result<size_t> Get(const BlockKey& key, transport::MutableBytes out);
  // Reads blocks[i] of keys[i] into outs[i], all in flight at once; per key, as Get.
  std::vector<Result<size_t>> Get(std::span<const BlockKey> keys,
                                  std::span<const transport::MutableBytes> outs) override;

  // The node's counters (wire.StatsReply).
  Result<std::map<std::string, uint64_t>> Stats(size_t node);
  // The node's block size (from its counters).
  Result<uint64_t> BlockBytes(size_t node) override;

  uint64_t unreachable() const;

  class Impl;

 private:
  explicit NodeClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvstash::connector
