#pragma once

// NodeClient: an engine-side client of one or many offload nodes. Each block key lives on the
// `replicas` live nodes that rank highest for it by rendezvous hashing (hash of key and node
// address), so every client places a key on the same nodes and a node that joins or leaves
// moves only its own share of the keys.
//
// The nodes are a fixed list, or a cluster's live members in etcd (membership::
// MembershipWatcher): the client reads them at Create and follows the prefix, logging and
// counting who joins and leaves. A call works with the members live when it began. Members
// that stay keep their connections (and this client's pins); a new one is connected by its
// first call; one that left is closed once no call uses it. While etcd is away the client
// keeps the last set it knew.
//
// With replicas, a store goes to every replica (done once one holds the block; a replica
// that cannot be reached is counted, not returned); a lookup takes the best answer among them
// (HIT over RETRY over MISS); a read goes to the best-ranked replica and falls back to the next
// when it lacks the block or cannot be reached; touches and pins go to every replica. A key
// that a lookup finds on some replicas and not on others (a node that joined, or evicted it) is
// copied to the others by its next read, so a lost node's keys get back to R copies as they
// are used.
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
#include "kvstash/connector/in_memory_members.h"
#include "kvstash/transport/rpc.h"

namespace kvstash::connector {

// "HOST:PORT"; InvalidArgument naming the text otherwise.
Result<NodeAddress> ParseNodeAddress(std::string_view text);
// Each of `texts` as ParseNodeAddress; the first error.
Result<std::vector<NodeAddress>> ParseNodeAddresses(const std::vector<std::string>& texts);

// The most replicas a client may ask for.
inline constexpr size_t kMaxReplicas = 8;

struct NodeClientOptions {
  // A fixed list of nodes; or, with `etcd` and `cluster` instead, the cluster's live members.
  std::vector<NodeAddress> nodes;
  std::string etcd;     // etcd client URLs, comma-separated ("http://HOST:PORT,...")
  std::string cluster;  // the cluster's name (the nodes' kvstashd --cluster)
  std::chrono::milliseconds etcd_timeout{2000};
  // How long Create waits for etcd's first answer (then Unavailable, naming the endpoints).
  std::chrono::milliseconds etcd_first_read_timeout{5000};
  // Each block is kept on this many nodes (1..kMaxReplicas): a lost node then costs no hits,
  // but the cluster holds 1/replicas as many distinct blocks, and stores send each block that
  // many times (docs/semantics.md §16).
  size_t replicas = 1;
  // The namespace this client's keys live in, a name given at hello; each node gives it an id
  // of its own (docs/semantics.md §18).
  std::string key_namespace = "default";
  std::string auth_token;
  transport::TransportOptions transport;
  // Every call to a node fails after this long (the node then counts as unreachable for it).
  std::chrono::milliseconds timeout{5000};
  // How long a lookup waits for the nodes: keys of a node that has not answered by then
  // (stopped, cut off, or slow) read as misses, counted in unserved_keys; the call goes on and
  // its late answer still tells the node's health. Counted from the calls (a first connection is
  // waited for, at most connect_timeout). At `timeout` or more, a lookup waits for every
  // call's outcome (each ends by its deadline).
  std::chrono::milliseconds lookup_budget{50};
  // When a node is suspect and skipped (see connector/src/cluster/node_health.h): after this
  // many failures or missed budgets in a row with no answer, probed every probe_interval.
  uint32_t suspect_after = 2;
  std::chrono::milliseconds probe_interval{200};
  // A probe's deadline (an echo no engine call waits for).
  std::chrono::milliseconds probe_timeout{1000};
  // The block size this client stores (0: any). A node whose hello states another is refused
  // at membership: logged once, left out of the members (its keys go to the others, as every
  // client with this setting places them), never used again; the call that found it gets
  // FailedPrecondition naming both sizes.
  uint64_t block_bytes = 0;
  std::chrono::milliseconds connect_timeout{2000};
  // The UCX worker and progress thread every connection runs on (see transport::ClientWorker).
  // Empty: each connection takes one of `workers`.
  std::shared_ptr<transport::ClientWorker> worker;
  // The workers the connections spread over when `worker` is empty; empty: the process's pool
  // for these transport options (transport::ClientWorkerPool::ForProcess), shared by every
  // client of the process, as many workers as cores (at most 4).
  std::shared_ptr<transport::ClientWorkerPool> workers;
  // The members from a source a test drives instead of `nodes` or etcd (in_memory_members.h).
  std::shared_ptr<InMemoryMembers> members;
  // Makes the connection to one node; empty: UCX (an RpcClient on `worker`). Tests give a
  // loopback network's channels (transport/loopback.h), possibly in a FaultChannel.
  std::function<Result<std::unique_ptr<transport::Channel>>(const transport::ClientOptions&)>
      connect;
};

// Where a client's nodes come from, as a command line gives them: a list of HOST:PORT, or
// etcd and a cluster to follow; and how many replicas of each block to keep.
struct NodeSource {
  std::vector<std::string> nodes;  // HOST:PORT each (a comma-separated item is split)
  std::string etcd;
  std::string cluster;
  size_t replicas = 1;
};
// Fills `options` from `source`: InvalidArgument (naming the flag, as --node/--etcd/--cluster/
// --replicas) for no source, both, a cluster without etcd or the other way round, a bad
// address, or replicas out of 1..kMaxReplicas.
Status ApplyNodeSource(const NodeSource& source, NodeClientOptions* options);
// Help texts for the flags of a NodeSource, the same in every client.
inline constexpr const char* kEtcdHelp =
    "follow the live offload nodes of a cluster in etcd instead of a node list: etcd client "
    "URLs, comma-separated (http://HOST:PORT,...); nodes that join take their share of the "
    "keys, nodes that leave give theirs back, with no restart. Needs --cluster";
inline constexpr const char* kClusterHelp =
    "the cluster to follow in etcd (the nodes' kvstashd --cluster)";
inline constexpr const char* kReplicasHelp =
    "keep each block on this many nodes (1..8): a lost node then costs no hits, but the "
    "cluster holds 1/R as many distinct blocks and every store sends each block R times";

// What a node states at hello: the transport's limits, and the node's own, which the transport
// carries as they are (transport::ServerLimits::service_limits, a wire.NodeLimits).
struct NodeLimits {
  uint64_t block_bytes = 0;           // the node's block size; 0: a bare transport, no store
  uint32_t max_keys_per_request = 0;  // keys in one request; 0: not stated
  uint64_t max_message_bytes = 0;     // bytes of one request message (the protobuf part)
  uint64_t max_payload_bytes = 0;     // bytes of one request payload
  // Bytes of blocks in one GetBlocks or PutBlocks call; 0: the node serves neither.
  uint64_t max_batch_bytes = 0;
};
// The limits a server stated; InvalidArgument when the node's part does not parse (a peer that
// is not a kvstash node, or a hostile one).
Result<NodeLimits> NodeLimitsFrom(const transport::ServerLimits& stated);

// Keys of one request a node with these limits accepts: its key limit, and as many keys as
// its message limit holds (each key costs at most kKeyWireBytes). At least 1.
inline constexpr size_t kKeyWireBytes = 32;
size_t KeysPerCall(const NodeLimits& limits);

// Blocks of at most this many bytes travel many to a call (GetBlocks, PutBlocks) to a node that
// serves such calls: for them a call costs more than the node's extra copy. Larger blocks go
// one to a call, straight between the client's buffer and the node's slot.
inline constexpr uint64_t kBatchedBlockBytes = uint64_t{64} << 10;
// Blocks of one batched call to a node with these limits: 0 when its blocks do not travel
// batched (larger than kBatchedBlockBytes, or a node that serves no batches), else as many as
// its batch, key and message limits hold, at least 1.
size_t BlocksPerBatch(const NodeLimits& limits);

// A PutBlocks request's message (keys, lengths, block metadata) travels in UCX's active-message
// header beside its payload, not as data: 8,100 bytes on TCP, whatever the node's batch holds.
// Each block costs it at most kPutBlockWireBytes (a key, a length, a BlockMeta with its parent
// key), and one call's message at most kPutBlocksMessageBytes.
inline constexpr size_t kPutBlockWireBytes = 80;
inline constexpr size_t kPutBlocksMessageBytes = 4096;
// Blocks of one PutBlocks call: BlocksPerBatch, and no more than its message holds (51).
size_t BlocksPerPutBatch(const NodeLimits& limits);

class NodeClient : public BlockStoreClient {
 public:
  static Result<std::unique_ptr<NodeClient>> Create(NodeClientOptions options);
  // Waits for touches still in flight (each bounded by the call timeout).
  ~NodeClient() override;

  // The live nodes now, a snapshot (a followed cluster's set changes between calls).
  std::vector<NodeAddress> nodes() const override;
  size_t replicas() const;
  // The nodes of `key`, best-ranked first (up to replicas()); empty when none is live.
  std::vector<NodeAddress> PlacesOf(const BlockKey& key) const;

  // Per-key lookups in key order (see BlockStoreClient::Lookup).
  std::vector<LookupResult> Lookup(std::span<const BlockKey> keys) override;
  // The same, but a node's refusal (or a reply that does not parse) is returned as the error,
  // naming the node; keys of unreachable nodes still read as misses.
  Result<std::vector<LookupResult>> LookupStrict(std::span<const BlockKey> keys);
  // The number of leading keys that are hits (nullopt: a RETRY among them, ask again).
  std::optional<size_t> LookupPrefix(std::span<const BlockKey> keys);

  // Stores blocks[i] under keys[i] (each exactly its node's block size) at each of its
  // replicas: one call per block and replica that reserves a slot, sends the bytes into it and
  // commits them, all blocks in flight at once. A node that already holds a block skips it without
  // taking the bytes, and counts the store as a use of the block (a touch). The blocks are sent
  // last key first, so that a node inserts the first key last: among one call's new blocks the
  // first is the most recent, as a touch would leave them. The first error, naming the node and the
  // key; the other blocks are still stored.
  Status Put(std::span<const BlockKey> keys, std::span<const transport::Bytes> blocks) override;
  // Put with each block's metadata in its call (PutBlock's meta, PutBlocks' metas): none, or one
  // per key (else InvalidArgument, nothing sent). A node older than the metadata ignores it.
  Status PutWithMeta(std::span<const BlockKey> keys, std::span<const transport::Bytes> blocks,
                     std::span<const BlockMeta> metas) override;

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
  void TouchAfterStore(std::span<const BlockKey> keys) override;
  // Asynchronous pins and their releases (see BlockStoreClient::Pin), split likewise. A Get of
  // a pinned key reads it from the pin.
  void Pin(std::span<const BlockKey> keys) override;
  void Unpin(std::span<const BlockKey> keys) override;
  // The same, waiting for the nodes' answers: the first error, naming the node.
  Status TouchSync(std::span<const BlockKey> keys);
  // Waits for the asynchronous touches, pins and releases in flight to be answered (counters()
  // then has them).
  void WaitForTouches();

  // The node's counters (wire.StatsReply): NotFound when it is not a member now (it left
  // meanwhile).
  Result<std::map<std::string, uint64_t>> Stats(const NodeAddress& node);
  // The node's limits as it stated them at hello (connecting first when needed): NotFound when
  // it is not a member; Unavailable when it cannot be reached; the hello's refusal
  // (Unauthenticated, PermissionDenied, FailedPrecondition) otherwise.
  Result<NodeLimits> Limits(const NodeAddress& node);
  // The node's block size, as stated at hello.
  Result<uint64_t> BlockBytes(const NodeAddress& node) override;

  BlockStoreCounters counters() const override;
  uint64_t unreachable() const;

  class Impl;

 private:
  explicit NodeClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvstash::connector
