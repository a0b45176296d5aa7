#pragma once

// NodeServer: one offload node (NodeService, node_service.h) served over a transport, with the
// methods of proto/wire.proto (wire.Method). It is a thin adapter: it parses each request,
// checks it against the limits the node stated at hello, hands it to the service, moves the
// block bytes and replies, timing every method. A client's session is its connection: the
// transport's disconnects end it.
//
// Block bytes move once: PutBlock's payload lands straight in the CPU slot the service
// reserved, and GetBlock's reply payload leaves from the pinned slot. Small blocks may travel
// many to a call (GetBlocks, PutBlocks), copied once more on the node, between its slots and
// the call's payload: for them a call costs more than a copy. The CPU tier's memory is
// allocated through the transport, so a client on the same host copies to and from it
// directly (see transport/rpc.h); where that memory cannot be had, the store maps its own and
// payloads go by UCX rendezvous.

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/common/status.h"
#include "kvstash/events/publisher.h"
#include "kvstash/node/node_service.h"
#include "kvstash/store/tiered_store.h"
#include "kvstash/transport/rpc.h"

namespace kvstash::node {

// The service's options (store, lease, quotas) and how it is served.
// KV events (docs/semantics.md §19): off unless `publisher.endpoint` is set.
struct KvEventOptions {
  events::PublisherOptions publisher;  // where (PUB, replay ROUTER) and how much to buffer
  // How often the store's events are drained and published.
  std::chrono::milliseconds interval{10};
  // What clients said of the blocks they store (wire.BlockMeta) waits for the block's event in
  // a table of at most this many blocks; past it the oldest goes first, its event without it
  // (counted: events.block_metas_dropped).
  size_t max_block_metas = 65536;
};

struct NodeOptions : NodeServiceOptions {
  transport::ServerOptions server;  // listen address, port, auth token, transport, limits
  // Keys in one request; stated to clients at hello with the block size (wire.NodeLimits).
  uint32_t max_keys_per_request = 4096;
  // The largest payload of one GetBlocks or PutBlocks call (at most the transport's
  // max_payload_bytes); stated at hello. Clients batch blocks this small and smaller. 0: the
  // node serves neither, and clients send one call per block.
  uint64_t max_batch_bytes = uint64_t{1} << 20;
  // Makes the transport the node serves on; empty: UCX (an RpcServer of `server`). Tests give a
  // loopback network's listener (transport/loopback.h).
  std::function<Result<std::unique_ptr<transport::Listener>>(const transport::ServerOptions&)>
      listen;
  KvEventOptions kv_events;
};

// The largest max_batch_bytes kvstashd takes: the node keeps 16 times it in shared memory.
inline constexpr uint64_t kMaxBatchBytes = uint64_t{4} << 20;

// The upper bounds of the request latency buckets (inclusive, as Prometheus' `le`); latencies
// above the last fall in an overflow bucket. Steps of x2 to x2.5 from 5 us to 1 s: a shared
// memory round trip takes some microseconds, a rendezvous of a large block milliseconds.
inline constexpr std::array<std::chrono::microseconds, 17> kLatencyBuckets = {
    std::chrono::microseconds(5),      std::chrono::microseconds(10),
    std::chrono::microseconds(25),     std::chrono::microseconds(50),
    std::chrono::microseconds(100),    std::chrono::microseconds(250),
    std::chrono::microseconds(500),    std::chrono::microseconds(1000),
    std::chrono::microseconds(2500),   std::chrono::microseconds(5000),
    std::chrono::microseconds(10000),  std::chrono::microseconds(25000),
    std::chrono::microseconds(50000),  std::chrono::microseconds(100000),
    std::chrono::microseconds(250000), std::chrono::microseconds(500000),
    std::chrono::microseconds(1000000)};

// The latencies of one wire method since start: from the handler's dispatch until its reply
// was handed to the transport; for a reply with a payload (GetBlock's block) until the payload
// was sent (or, over shared memory, copied by the client), and for PutBlock including the
// arrival of its payload. A call dropped without a reply (the transport answers Internal) is
// not counted.
struct MethodLatency {
  std::string method;  // "lookup", "put_block", "load", ... (wire.Method in lower case)
  // Requests per bucket of kLatencyBuckets (not cumulative); the last is the overflow.
  std::array<uint64_t, kLatencyBuckets.size() + 1> buckets{};
  uint64_t count = 0;  // the sum of `buckets`
  std::chrono::nanoseconds sum{0};
};

class NodeServer {
 public:
  // Opens the store, binds and starts serving. The port is known after (port()).
  static Result<std::unique_ptr<NodeServer>> Create(NodeOptions options);
  // Stops serving (sessions end, their pins and stores are undone) and closes the store.
  ~NodeServer();
  NodeServer(const NodeServer&) = delete;
  NodeServer& operator=(const NodeServer&) = delete;

  // Stops serving (no new connections; every session ends, undoing its pins and unfinished
  // stores), waits for the store's background work and, under write-back, writes every block
  // the SSD tier lacks. The store's flush error, if any. Idempotent.
  Status Shutdown();

  uint16_t port() const;
  // The counters of wire.StatsReply: the service's, the store's and the transport's (named in
  // node/src/counters.cc). Thread-safe.
  std::map<std::string, uint64_t> Counters() const;
  // The request latencies of every wire method the node serves, in method order. Reads atomic
  // counters while requests go on: a request being recorded may show in its bucket before it
  // shows in `sum`. Thread-safe.
  std::vector<MethodLatency> Latencies() const;
  // NodeService::Namespaces. Thread-safe.
  std::vector<NamespaceStats> Namespaces() const;
  store::TieredStore& store();
  // True when the CPU tier lives in memory shared through the transport.
  bool shares_cpu_memory() const;
  // The share of the CPU tier's memory faulted in, 0 to 1. A node serves from the start and
  // faults its memory in on background threads meanwhile (a slot not in yet is faulted by its
  // first write); 1 once all of it is in. Thread-safe.
  double memory_faulted_share() const;
  // The KV events' publisher (its endpoints, as bound), or null when the node publishes none.
  const events::EventPublisher* kv_events() const;

  class Impl;

 private:
  explicit NodeServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvstash::node
