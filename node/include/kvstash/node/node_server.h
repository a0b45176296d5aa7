#pragma once

// NodeServer: one offload node's tiered store served over the RPC transport, with the methods
// of proto/wire.proto (wire.Method). What each client does is tied to its connection (its
// session): the blocks it prepared to store and the blocks it pinned to read. A session that
// ends (the client closed, crashed or was cut off) releases its pins and aborts its
// uncommitted stores, so a crashed engine never leaks capacity.
//
// Block bytes move once: PutBlock's payload lands straight in the CPU slot the preparation
// reserved, and GetBlock's reply payload leaves from the pinned slot. The CPU tier's memory is
// allocated through the transport, so a client on the same host copies to and from it
// directly (see transport/rpc.h); where that memory cannot be had, the store maps its own and
// payloads go by UCX rendezvous.

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "kvstash/common/status.h"
#include "kvstash/store/tiered_store.h"
#include "kvstash/transport/rpc.h"

namespace kvstash::node {

struct NodeOptions {
  transport::ServerOptions server;  // listen address, port, auth token, transport, limits
  store::TieredStoreOptions store;  // block size, CPU capacity and policy, SSD tier, cascade
  // A client silent for this long (no request at all) loses its pins and unfinished stores,
  // so an engine that hangs without disconnecting does not hold capacity forever.
  std::chrono::milliseconds lease_timeout{30000};
};

// Counters since start. Monotonic.
struct NodeStats {
  uint64_t lookups = 0;  // keys looked up (every mode)
  uint64_t lookup_hits = 0;
  uint64_t lookup_misses = 0;
  uint64_t lookup_retries = 0;
  uint64_t blocks_stored = 0;  // committed
  uint64_t blocks_aborted = 0;
  uint64_t blocks_loaded = 0;  // GetBlock replies sent
  uint64_t bytes_in = 0;       // block payload bytes received
  uint64_t bytes_out = 0;      // block payload bytes sent
  uint64_t checksum_failures = 0;
  uint64_t sessions_closed = 0;
  uint64_t pins_released_on_close = 0;   // pins a closed session still held
  uint64_t stores_aborted_on_close = 0;  // preparations a closed session never committed
  uint64_t leases_expired = 0;           // silent sessions whose pins and stores were undone
  uint64_t pins_released_on_expiry = 0;
};

class NodeServer {
 public:
  // Opens the store, binds and starts serving. The port is known after (port()).
  static Result<std::unique_ptr<NodeServer>> Start(NodeOptions options);
  // Stops serving (sessions end, their pins and stores are undone) and closes the store.
  ~NodeServer();
  NodeServer(const NodeServer&) = delete;
  NodeServer& operator=(const NodeServer&) = delete;

  // Stops serving (no new connections; every session ends, undoing its pins and unfinished
  // stores), waits for the store's background work and, under write-back, writes every block
  // the SSD tier lacks. The store's flush error, if any. Idempotent.
  Status Shutdown();

  uint16_t port() const;
  NodeStats stats() const;
  // The counters of wire.StatsReply: the node's, the store's and the transport's.
  std::map<std::string, uint64_t> Counters() const;
  store::TieredStore& store();
  // True when the CPU tier lives in memory shared through the transport.
  bool shares_cpu_memory() const;

  class Impl;

 private:
  explicit NodeServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvstash::node
