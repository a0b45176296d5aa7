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
#include "kvstash/store/tiered_store.h"
#include "kvstash/transport/rpc.h"

namespace kvstash::node {

struct NodeOptions {
  transport::ServerOptions server;  // listen address, port, auth token, transport, limits
  store::TieredStoreOptions store;  // block size, CPU capacity and policy, SSD tier, cascade
  // A client silent for this long (no request at all) loses its pins and unfinished stores,
  // so an engine that hangs without disconnecting does not hold capacity forever.
  std::chrono::milliseconds lease_timeout{30000};
  // Ceilings on the blocks a namespace (the one a client names at hello) holds in the CPU tier:
  // by name, and for every namespace not named; none: shared capacity. A namespace at its
  // ceiling makes room by evicting its own least recently used idle blocks, and its stores are
  // refused (ResourceExhausted) when none can go; a ceiling reserves nothing. Each is 1 block to
  // the CPU tier's capacity. They bound the CPU tier only: the SSD tier holds what it cascades.
  std::map<std::string, size_t> namespace_quota_blocks;
  std::optional<size_t> default_namespace_quota_blocks;
  // Makes the transport the node serves on; empty: UCX (an RpcServer of `server`). Tests give a
  // loopback network's listener (transport/loopback.h).
  std::function<Result<std::unique_ptr<transport::Listener>>(const transport::ServerOptions&)>
      listen;
};

// Namespaces are reported by name up to this many (those with a named quota always, then those
// seen at hello, first come); the rest are summed under "other", so that clients choosing names
// cannot grow the metrics without bound.
inline constexpr size_t kMaxNamedNamespaces = 256;
// The name they are summed under; a namespace of that name is counted there too, and no quota
// may name it.
inline constexpr std::string_view kOtherNamespaces = "other";

// One namespace as the node's metrics show it.
struct NamespaceStats {
  std::string name;         // kOtherNamespaces: namespaces past kMaxNamedNamespaces
  uint64_t cpu_blocks = 0;  // held in the CPU tier, readable or being written
  std::optional<uint64_t> cpu_quota_blocks;
  uint64_t quota_refusals = 0;  // blocks its clients were refused for its quota, since start
};

// Lookup results of one lookup kind (wire.LookupMode). A per-key lookup counts each key's
// result. A prefix or window scan counts its hit_length keys as hits and the rest of its keys
// as misses, or, when it answers RETRY (a block of it is being written or promoted), one retry
// and no keys: a scan has no per-key answer to count.
struct LookupCounts {
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t retries = 0;
};

// Counters since start. Monotonic.
struct NodeStats {
  uint64_t lookups = 0;      // keys looked up (every mode)
  uint64_t lookup_hits = 0;  // the sums over the three kinds below
  uint64_t lookup_misses = 0;
  uint64_t lookup_retries = 0;
  LookupCounts per_key;
  LookupCounts prefix;
  LookupCounts window;
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
  std::string method;  // "lookup", "prepare_store", "put_block", ... (wire.Method in lower case)
  // Requests per bucket of kLatencyBuckets (not cumulative); the last is the overflow.
  std::array<uint64_t, kLatencyBuckets.size() + 1> buckets{};
  uint64_t count = 0;  // the sum of `buckets`
  std::chrono::nanoseconds sum{0};
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
  // The request latencies of every wire method the node serves, in method order. Reads atomic
  // counters while requests go on: a request being recorded may show in its bucket before it
  // shows in `sum`. Thread-safe.
  std::vector<MethodLatency> Latencies() const;
  // Every namespace with a named quota or seen at hello (up to kMaxNamedNamespaces, then
  // "other", listed last when any namespace fell into it), by name. Only for the operator's
  // metrics: other namespaces' names are not a client's business, so Counters (which clients
  // read) has totals only. Thread-safe.
  std::vector<NamespaceStats> Namespaces() const;
  store::TieredStore& store();
  // True when the CPU tier lives in memory shared through the transport.
  bool shares_cpu_memory() const;

  class Impl;

 private:
  explicit NodeServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvstash::node
