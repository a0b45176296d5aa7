#pragma once

// NodeClient: an engine-side client of one or many offload nodes. Each block key lives on one
// node, chosen by rendezvous hashing (highest hash of key and node address), so every client
// places a key on the same node and adding or losing a node moves only that node's keys.
//
// Batched calls fan out to the nodes concerned in parallel and come back in key order. Every
// node states its limits at hello (keys per request, message and payload bytes, block size);
// a batch over them is split into calls within them, all in flight at once, so a long prompt is
// never refused for its length.
//
// Errors are never silent misses. A node that cannot be reached (down, slow past the deadline)
// reads as a miss for its keys: counted, and logged once each time a node goes down or comes
// back. A call a node refuses (a limit, a bad request, a wrong token, a quota) is an error:
// counted, and logged once per node and error code with the node's message (which names the
// value and the limit); a lookup's refused keys still read as misses so that an engine goes on,
// and LookupStrict returns the refusal.
//
// Thread-safe. The connector uses it through BlockStoreClient.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/common/block_key.h"
#include "kvstash/common/hash.h"
#include "kvstash/common/status.h"
#include "kvstash/connector/block_store_client.h"
#include "kvstash/transport/rpc.h"

namespace kvstash::connector {

// "HOST:PORT"; InvalidArgument naming the text otherwise.
Result<NodeAddress> ParseNodeAddress(std::string_view text);
// Each of `texts` as ParseNodeAddress; the first error.
Result<std::vector<NodeAddress>> ParseNodeAddresses(const std::vector<std::string>& texts);

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
  // Makes the connection to one node; empty: UCX (an RpcClient on `worker`). Tests give a
  // loopback network's channels (transport/loopback.h), possibly in a FaultChannel.
  std::function<Result<std::unique_ptr<transport::Channel>>(const transport::ClientOptions&)>
      connect;
};

// Keys of one request a node with these limits accepts: its key limit, and as many keys as
// its message limit holds (each key costs at most kKeyWireBytes). At least 1.
inline constexpr size_t kKeyWireBytes = 32;
size_t KeysPerCall(const transport::ServerLimits& limits);

class NodeClient : public BlockStoreClient {
 public:
  static Result<std::unique_ptr<NodeClient>> Create(NodeClientOptions options);
  // Waits for touches still in flight (each bounded by the call timeout).
  ~NodeClient() override;

  size_t node_count() const override;
  const NodeAddress& node(size_t i) const override;
  // The node that holds `key`.
  size_t NodeOf(const BlockKey& key) const;

  // The node's limits as it stated them at hello (connecting first when needed). Unavailable
  // when it cannot be reached; the hello's refusal (Unauthenticated, PermissionDenied,
  // FailedPrecondition) otherwise.
  Result<transport::ServerLimits> Limits(size_t node);

  // Per-key lookups in key order (see BlockStoreClient::Lookup).
  std::vector<LookupResult> Lookup(std::span<const BlockKey> keys) override;
  // The same, but a node's refusal (or a reply that does not parse) is returned as the error,
  // naming the node; keys of unreachable nodes still read as misses.
  Result<std::vector<LookupResult>> LookupStrict(std::span<const BlockKey> keys);
  // The number of leading keys that are hits (nullopt: a RETRY among them, ask again).
  std::optional<size_t> LookupPrefix(std::span<const BlockKey> keys);

  // Stores blocks[i] under keys[i] (each exactly its node's block size): one call per block
  // that reserves a slot, sends the bytes into it and commits them, all blocks in flight at once. A
  // node that already holds a block skips it without taking the bytes, and counts the store as a
  // use of the block (a touch). The blocks are sent last key first, so that a node inserts the
  // first key last: among one call's new blocks the first is the most recent, as a touch would
  // leave them. The first error, naming the node and the key; the other blocks are still stored.
  Status Put(std::span<const BlockKey> keys, std::span<const transport::Bytes> blocks) override;

  // Reads the block of `key` into `out` in one call (from this client's pin, or the node pins it
  // for the transfer). A block
  // the node is promoting from SSD is asked for again until the timeout. NotFound when its node
  // does not hold it (or cannot be reached: then Unavailable).
  Result<size_t> Get(const BlockKey& key, transport::MutableBytes out);
  // Reads blocks[i] of keys[i] into outs[i], all in flight at once; per key, as Get.
  std::vector<Result<size_t>> Get(std::span<const BlockKey> keys,
                                  std::span<const transport::MutableBytes> outs) override;

  // Asynchronous touch (see BlockStoreClient::Touch), split to each node's limits.
  void Touch(std::span<const BlockKey> keys) override;
  // Asynchronous pins and their releases (see BlockStoreClient::Pin), split likewise. A Get of
  // a pinned key reads it from the pin.
  void Pin(std::span<const BlockKey> keys) override;
  void Unpin(std::span<const BlockKey> keys) override;
  // The same, waiting for the nodes' answers: the first error, naming the node.
  Status TouchSync(std::span<const BlockKey> keys);
  // Waits for the asynchronous touches, pins and releases in flight to be answered (counters()
  // then has them).
  void WaitForTouches();

  // The node's counters (wire.StatsReply).
  Result<std::map<std::string, uint64_t>> Stats(size_t node);
  // The node's block size, as stated at hello.
  Result<uint64_t> BlockBytes(size_t node) override;

  BlockStoreCounters counters() const override;
  uint64_t unreachable() const;

  class Impl;

 private:
  explicit NodeClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvstash::connector
